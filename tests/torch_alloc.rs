//! Builds the C++ entry points PyTorch calls (ffi/python/csrc/torch_alloc.cpp)
//! with tests/cpp/torch_alloc_test.cpp, which calls them as PyTorch does
//! (through a std::function), against this build's cdylib, and runs it:
//! an out-of-memory must arrive as a C++ exception with PyTorch's message.

mod common;

use std::path::Path;
use std::process::Command;

#[test]
fn out_of_memory_reaches_pytorch_as_a_cpp_exception() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join("torch_alloc_test");
    let lib = common::cdylib().parent().unwrap().to_path_buf();
    let status = Command::new("c++")
        .args(["-std=c++17", "-Wall", "-Wextra", "-Werror", "-O1", "-pthread"])
        .arg("-I")
        .arg(root.join("ffi"))
        .arg(root.join("tests/cpp/torch_alloc_test.cpp"))
        .arg(root.join("ffi/python/csrc/torch_alloc.cpp"))
        .arg("-L")
        .arg(&lib)
        .arg(format!("-Wl,-rpath,{}", lib.display()))
        .args(["-ltidepool", "-o"])
        .arg(&out)
        .status()
        .expect("a C++ compiler (c++) is needed for the PyTorch entry point test");
    assert!(status.success(), "compiling the PyTorch entry point test failed");
    let output = Command::new(&out).env("TIDEPOOL_CONF", "backend:host,host_capacity_mb:64").output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    assert!(output.status.success(), "{text}");
    assert!(text.contains(" passed, 0 failed"), "{text}");
    assert!(text.contains("oom message: CUDA out of memory. tidepool: out of memory on device 0"), "{text}");
}
