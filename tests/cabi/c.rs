//! Builds tests/c/ffi_test.c against the cdylib and runs it (and, when
//! valgrind is installed, runs it again under memcheck; under `CI=true` a
//! missing valgrind fails).

use crate::common;

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::pickle_doc::{NodeId, PickleDoc};

/// Compiles the C test to `name` (one name per test: tests run in parallel).
fn build_c_test(name: &str) -> PathBuf {
    let flags = ["-std=c11", "-D_DEFAULT_SOURCE", "-Wall", "-Wextra", "-Werror", "-O1", "-pthread"];
    common::build_against_cdylib("cc", &flags, &["tests/c/ffi_test.c"], name)
}

fn run(program: &Path, wrapper: &[&str], iterations: &str) -> (bool, String) {
    run_with(program, wrapper, iterations, &[("TIDEPOOL_CONF", "backend:host,host_capacity_mb:4096")])
}

fn run_with(program: &Path, wrapper: &[&str], iterations: &str, env: &[(&str, &str)]) -> (bool, String) {
    let snapshot = program.with_extension("pickle");
    let _ = std::fs::remove_file(&snapshot);
    let mut command = match wrapper.split_first() {
        Some((tool, args)) => {
            let mut c = Command::new(tool);
            c.args(args).arg(program);
            c
        }
        None => Command::new(program),
    };
    command.arg(&snapshot).arg(iterations);
    common::contained(&mut command);
    for (key, value) in env {
        command.env(key, value);
    }
    let output = command.output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    (output.status.success() && snapshot.exists(), text)
}

#[test]
fn the_c_abi_works_from_c_and_refuses_bad_input() {
    let program = build_c_test("ffi_test");
    let (ok, text) = run(&program, &[], "20000");
    assert!(ok, "ffi_test failed:\n{text}");
    assert!(text.contains(" passed, 0 failed"), "{text}");
    // Bad input is logged once, then only counted.
    assert_eq!(text.matches("(further ones are only counted)").count(), 2, "{text}");
    check_context_frames(&program.with_extension("pickle"));
}

/// The snapshot ffi_test wrote shows the frames of context 42 on the block
/// of 54321 bytes allocated with it and on its `alloc` event, and none on
/// the block of 12345 bytes allocated without one.
fn check_context_frames(snapshot: &Path) {
    let doc = PickleDoc::parse(std::fs::File::open(snapshot).unwrap()).unwrap();
    let field = |node: NodeId, key: &str| doc.get(node, key).unwrap();
    let frames = |node: NodeId| -> Vec<(String, String, i128)> {
        let text = |f, key| doc.str(field(f, key)).unwrap().to_string();
        doc.items(field(node, "frames"))
            .unwrap()
            .iter()
            .map(|&f| (text(f, "filename"), text(f, "name"), doc.int(field(f, "line")).unwrap()))
            .collect()
    };
    let expected = vec![("model.py".to_string(), "forward".to_string(), 42), ("train.py".to_string(), "main".to_string(), 7)];
    let segments = doc.items(field(doc.root(), "segments")).unwrap();
    let blocks: Vec<NodeId> = segments.iter().flat_map(|&s| doc.items(field(s, "blocks")).unwrap().to_vec()).collect();
    let block = |requested: i128| *blocks.iter().find(|&&b| doc.int(field(b, "requested_size")) == Some(requested)).unwrap();
    assert_eq!(frames(block(54321)), expected);
    assert_eq!(frames(block(12345)), []);
    let trace = doc.items(doc.items(field(doc.root(), "device_traces")).unwrap()[0]).unwrap();
    let allocs: Vec<_> = trace
        .iter()
        .filter(|&&e| doc.str(field(e, "action")) == Some("alloc") && doc.int(field(e, "size")) == Some(54321))
        .map(|&e| frames(e))
        .collect();
    assert_eq!(allocs, [expected.clone(), expected], "both allocations with context 42 carry its frames");
}

#[test]
fn the_c_abi_works_with_expandable_segments() {
    let program = build_c_test("ffi_test_expandable");
    let (ok, text) = run_with(&program, &[], "5000", &[("TIDEPOOL_CONF", "backend:host,host_capacity_mb:4096,expandable:true")]);
    assert!(ok && text.contains(" passed, 0 failed"), "ffi_test with expandable segments failed:\n{text}");
}

#[test]
fn the_c_abi_is_clean_under_valgrind_memcheck() {
    if common::tool("valgrind", "apt-get install valgrind").is_none() {
        return;
    }
    let program = build_c_test("ffi_test_valgrind");
    let (ok, text) = run(&program, &["valgrind", "--error-exitcode=99", "--leak-check=no", "-q"], "300");
    assert!(ok, "ffi_test under valgrind failed:\n{text}");
    assert!(!text.contains("Invalid read") && !text.contains("Invalid write"), "{text}");
}

#[test]
fn the_c_abi_works_over_the_cuda_backend_on_simgpu() {
    let program = build_c_test("ffi_test_cuda");
    let simgpu = common::simgpu_dir();
    let env = [("TIDEPOOL_CONF", "backend:cuda"), ("LD_LIBRARY_PATH", simgpu.to_str().unwrap()), ("SIMGPU_CAPACITY", "4096M")];
    let (ok, text) = run_with(&program, &[], "5000", &env);
    assert!(ok, "ffi_test over cuda/simgpu failed:\n{text}");
    assert!(text.contains(" passed, 0 failed"), "{text}");
}

/// Builds tests/c/free_ptr_test.c and runs it on two devices under
/// `conf` (TIDEPOOL_CONF) and `env`, optionally under a wrapper (valgrind).
fn run_free_ptr_test(name: &str, conf: &str, env: &[(&str, &str)], wrapper: &[&str], iterations: &str) -> String {
    let flags = ["-std=c11", "-D_DEFAULT_SOURCE", "-Wall", "-Wextra", "-Werror", "-O1", "-pthread"];
    let program = common::build_against_cdylib("cc", &flags, &["tests/c/free_ptr_test.c"], name);
    let mut command = match wrapper.split_first() {
        Some((tool, args)) => {
            let mut c = Command::new(tool);
            c.args(args).arg(&program);
            c
        }
        None => Command::new(&program),
    };
    command.arg("-").arg(iterations);
    common::contained(&mut command);
    command.env("TIDEPOOL_CONF", conf).envs(env.iter().copied());
    let output = command.output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    assert!(output.status.success() && text.contains(" passed, 0 failed"), "free_ptr_test ({conf}) failed:\n{text}");
    // A refused free is logged once, then only counted.
    assert_eq!(text.matches("(further ones are only counted)").count(), 1, "{text}");
    text
}

const TWO_HOST_DEVICES: &str = "backend:host,host_devices:2,host_capacity_mb:1024";

#[test]
fn the_free_by_pointer_alone_works_from_c_on_two_devices() {
    for (name, conf) in [
        ("free_ptr_test", ""),
        ("free_ptr_test_no_caches", ",thread_cache_blocks:0"),
        ("free_ptr_test_shards", ",stream_shards:2"),
        ("free_ptr_test_segments", ",expandable:false"),
    ] {
        run_free_ptr_test(name, &format!("{TWO_HOST_DEVICES}{conf}"), &[], &[], "200");
    }
}

#[test]
fn the_free_by_pointer_alone_works_over_the_cuda_backend_on_two_simgpu_devices() {
    let simgpu = common::simgpu_dir();
    let env = [("LD_LIBRARY_PATH", simgpu.to_str().unwrap()), ("SIMGPU_CAPACITY", "1024M"), ("SIMGPU_DEVICES", "2")];
    run_free_ptr_test("free_ptr_test_cuda", "backend:cuda", &env, &[], "50");
}

#[test]
fn the_free_by_pointer_alone_is_clean_under_valgrind_memcheck() {
    if common::tool("valgrind", "apt-get install valgrind").is_none() {
        return;
    }
    let valgrind = ["valgrind", "--error-exitcode=99", "--leak-check=no", "-q"];
    let text = run_free_ptr_test("free_ptr_test_valgrind", TWO_HOST_DEVICES, &[], &valgrind, "5");
    assert!(!text.contains("Invalid read") && !text.contains("Invalid write"), "{text}");
}
