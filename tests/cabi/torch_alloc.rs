//! Builds the C++ entry points PyTorch calls (ffi/python/csrc/torch_alloc.cpp)
//! with tests/cpp/torch_alloc_test.cpp, which calls them as PyTorch does
//! (through a std::function), against this build's cdylib, and runs it:
//! an out-of-memory must arrive as a C++ exception with PyTorch's message.

use crate::common;

use std::process::Command;

#[test]
fn out_of_memory_reaches_pytorch_as_a_cpp_exception() {
    let flags = ["-std=c++17", "-Wall", "-Wextra", "-Werror", "-O1", "-pthread"];
    let sources = ["tests/cpp/torch_alloc_test.cpp", "ffi/python/csrc/torch_alloc.cpp"];
    let out = common::build_against_cdylib("c++", &flags, &sources, "torch_alloc_test");
    let output = common::contained(Command::new(&out).env("TIDEPOOL_CONF", "backend:host,host_capacity_mb:64")).output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    assert!(output.status.success(), "{text}");
    assert!(text.contains(" passed, 0 failed"), "{text}");
    assert!(text.contains("oom message: CUDA out of memory. tidepool: out of memory on device 0"), "{text}");
}
