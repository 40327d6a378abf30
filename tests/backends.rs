//! The conformance suite on every backend: `host` in this process, `cuda`
//! over simgpu (cuda/simgpu, the stand-in libcuda.so built here) in a child
//! process that finds it through LD_LIBRARY_PATH, and the clear error of
//! the `cuda` backend where no driver exists.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::{conformance, host_allocator, simgpu_dir};
use tidepool::{Allocator, Config};

const CAPACITY: u64 = 256 << 20;

#[test]
fn the_host_backend_conforms() {
    conformance::run(&|conf| host_allocator(1, CAPACITY, conf).0, CAPACITY);
}

/// Runs the test `name` of this binary in a child process with `env`.
fn child(name: &str, env: &[(&str, &str)]) -> (bool, String) {
    let mut command = Command::new(std::env::current_exe().unwrap());
    command.args(["--exact", name, "--test-threads=1", "--nocapture"]).env("TIDEPOOL_TEST_CHILD", "1");
    for (k, v) in env {
        command.env(k, v);
    }
    let out = command.output().unwrap();
    (out.status.success(), format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)))
}

fn in_child() -> bool {
    std::env::var_os("TIDEPOOL_TEST_CHILD").is_some()
}

fn cuda_allocator(conf: &str) -> Allocator {
    let config = Config::builder().conf("backend:cuda,release_after_ms:off,headroom_mb:0").unwrap().conf(conf).unwrap().build().unwrap();
    Allocator::new(config).unwrap()
}

/// The child side: the suite over the `cuda` backend.
#[test]
fn child_cuda_conformance() {
    if !in_child() {
        return;
    }
    let alloc = cuda_allocator("");
    assert_eq!(alloc.backend().name(), "cuda");
    assert_eq!(alloc.backend().mem_info(0).unwrap().total, CAPACITY);
    conformance::run(&cuda_allocator, CAPACITY);
    println!("cuda conformance: ok");
}

#[test]
fn the_cuda_backend_conforms_over_simgpu() {
    let dir = simgpu_dir();
    let (ok, text) = child(
        "child_cuda_conformance",
        &[("LD_LIBRARY_PATH", dir.to_str().unwrap()), ("SIMGPU_CAPACITY", "256M"), ("SIMGPU_DEVICES", "2")],
    );
    assert!(ok && text.contains("cuda conformance: ok"), "{text}");
}

/// The child side: a machine without libcuda.
#[test]
fn child_no_driver() {
    if !in_child() {
        return;
    }
    let config = Config::builder().conf("backend:cuda").unwrap().build().unwrap();
    let err = Allocator::new(config).err().expect("no driver here");
    println!("{err}");
}

#[test]
fn without_a_driver_the_cuda_backend_is_a_clear_error_not_a_panic() {
    let empty = Path::new(env!("CARGO_TARGET_TMPDIR")).join("no-driver");
    std::fs::create_dir_all(&empty).unwrap();
    if Path::new("/usr/lib/x86_64-linux-gnu/libcuda.so").exists() || Path::new("/usr/lib64/libcuda.so").exists() {
        eprintln!("a CUDA driver is installed here: skipped");
        return;
    }
    let (ok, text) = child("child_no_driver", &[("LD_LIBRARY_PATH", empty.to_str().unwrap())]);
    assert!(ok, "{text}");
    assert!(text.contains("no CUDA driver found") && text.contains("backend:host runs without a GPU"), "{text}");
}
