//! The Python package as a user gets it: `pip wheel ./ffi/python` builds
//! libtidepool.so with cargo and the C++ parts beside it; the wheel
//! installs into a fresh venv where no Rust toolchain is on PATH and reads
//! statistics; then the package's own tests (ffi/python/tests) run over the
//! installed package, with the real torch.
//!
//! The Python used is `TIDEPOOL_TEST_PYTHON` (`./test.sh` makes a venv with a
//! pinned torch and setuptools-rust), else `python3`. Without torch the
//! torch tests are skipped with a message, except under `CI=true`, where a
//! missing torch fails. The planner's tests (test_plan*.py) run once, in a
//! test of their own, with this build's `tidepool` command; they need
//! transformers and peft too (./test.sh installs them).

use crate::common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

use common::in_ci;

fn root() -> &'static Path {
    common::repo_root()
}

fn scratch() -> PathBuf {
    Path::new(env!("CARGO_TARGET_TMPDIR")).join("python")
}

fn python() -> PathBuf {
    std::env::var_os("TIDEPOOL_TEST_PYTHON").map_or_else(|| PathBuf::from("python3"), PathBuf::from)
}

fn text(output: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr))
}

fn run(command: &mut Command) -> Output {
    common::contained(command).output().unwrap_or_else(|err| panic!("cannot run {command:?}: {err}"))
}

/// Whether `python` can import `module`.
fn has_module(python: &Path, module: &str) -> bool {
    Command::new(python).args(["-c", &format!("import {module}")]).output().is_ok_and(|o| o.status.success())
}

/// The wheel pip builds from this checkout (once per test run).
fn wheel() -> &'static Path {
    static WHEEL: OnceLock<PathBuf> = OnceLock::new();
    WHEEL.get_or_init(|| {
        let out = scratch().join("wheel");
        let _ = std::fs::remove_dir_all(&out);
        let python = python();
        let mut build = Command::new(&python);
        build.args(["-m", "pip", "wheel", "--no-deps", "--quiet", "-w"]).arg(&out).arg(root().join("ffi/python"));
        // The same source a user's build compiles, with less work for the
        // optimizer (no LTO, more codegen units: half the build time), in a
        // target directory of its own (the release build's stays as it is).
        build
            .env("CARGO_TARGET_DIR", scratch().join("cargo-target"))
            .env("CARGO_PROFILE_RELEASE_LTO", "off")
            .env("CARGO_PROFILE_RELEASE_CODEGEN_UNITS", "16")
            .env("CARGO_PROFILE_RELEASE_DEBUG", "0");
        if has_module(&python, "setuptools_rust") {
            build.arg("--no-build-isolation"); // the test venv has the build tools: no download
        }
        let output = run(&mut build);
        assert!(output.status.success(), "pip wheel ./ffi/python failed:\n{}", text(&output));
        let wheels: Vec<PathBuf> = std::fs::read_dir(&out).unwrap().map(|e| e.unwrap().path()).collect();
        assert_eq!(wheels.len(), 1, "{wheels:?}");
        wheels.into_iter().next().unwrap()
    })
}

/// The wheel unpacked into a directory of its own, for PYTHONPATH.
fn installed_site() -> &'static Path {
    static SITE: OnceLock<PathBuf> = OnceLock::new();
    SITE.get_or_init(|| {
        let site = scratch().join("site");
        let _ = std::fs::remove_dir_all(&site);
        let output = run(Command::new(python())
            .args(["-m", "pip", "install", "--quiet", "--no-deps", "--no-index", "--target"])
            .arg(&site)
            .arg(wheel()));
        assert!(output.status.success(), "installing the wheel failed:\n{}", text(&output));
        site
    })
}

#[test]
fn the_wheel_is_a_platform_wheel_holding_its_libraries() {
    let name = wheel().file_name().unwrap().to_string_lossy().into_owned();
    assert!(name.starts_with("tidepool-") && (name.ends_with("_x86_64.whl") || name.ends_with("_aarch64.whl")), "{name}");
    assert!(!name.contains("-none-any"), "a platform wheel, not a pure one: {name}");
    let listing = run(Command::new(python()).args(["-m", "zipfile", "-l"]).arg(wheel()));
    let listing = text(&listing);
    for part in ["tidepool/libtidepool.", "tidepool/libtidepool_torch.", "tidepool/_stacks.", ".data/scripts/tidepool"] {
        assert!(listing.contains(part), "{part} missing from the wheel:\n{listing}");
    }
}

#[test]
fn the_wheel_installs_into_a_fresh_venv_without_rust_and_reads_statistics() {
    let venv = scratch().join("fresh-venv");
    let _ = std::fs::remove_dir_all(&venv);
    let output = run(Command::new(python()).args(["-m", "venv"]).arg(&venv));
    assert!(output.status.success(), "python -m venv failed:\n{}", text(&output));
    let venv_python = venv.join("bin/python");
    let output = run(Command::new(&venv_python).args(["-m", "pip", "install", "--quiet", "--no-deps", "--no-index"]).arg(wheel()));
    assert!(output.status.success(), "pip install of the wheel failed:\n{}", text(&output));
    // No cargo, no TIDEPOOL_LIBRARY, no PYTHONPATH: what a user of the wheel has.
    let script = r#"
import ctypes, shutil
assert shutil.which("cargo") is None, "cargo is on PATH"
import tidepool
from tidepool import _native
assert "site-packages" in tidepool.library_path(), tidepool.library_path()
ptr = _native.lib().tidepool_malloc(3 << 20, 0, None)
assert ptr
assert tidepool.memory_allocated() >= 3 << 20, tidepool.memory_allocated()
assert tidepool.memory_stats()["allocation.all.current"] == 1
_native.lib().tidepool_free(ptr, 3 << 20, 0, None)
# The tidepool command came with the wheel, and the planner finds it
# without an activated environment.
import subprocess, sys, os
from tidepool.plan import find_tidepool
command = find_tidepool()
assert command.startswith(os.path.dirname(sys.executable)), command
assert subprocess.run([command, "--version"], capture_output=True, text=True).stdout.startswith("tidepool ")
print("fresh venv ok", tidepool.memory_stats()["allocated_bytes.all.peak"])
"#;
    let output = run(Command::new(&venv_python)
        .args(["-c", script])
        .current_dir(&venv)
        .env_clear()
        .env("PATH", "/usr/bin:/bin")
        .env("HOME", &venv)
        .env("TIDEPOOL_CONF", "backend:host,host_capacity_mb:256"));
    assert!(output.status.success(), "{}", text(&output));
    assert!(text(&output).contains("fresh venv ok 3145728"), "{}", text(&output));
}

#[test]
fn building_without_cargo_says_what_to_install() {
    let python = python();
    if !has_module(&python, "setuptools_rust") {
        assert!(!in_ci(), "TIDEPOOL_TEST_PYTHON must have setuptools-rust under CI");
        eprintln!("setuptools-rust not installed for {}: skipped", python.display());
        return;
    }
    let home = scratch().join("no-cargo-home");
    std::fs::create_dir_all(&home).unwrap();
    let output = run(Command::new(&python)
        .args(["-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w"])
        .arg(scratch().join("no-cargo-wheel"))
        .arg(root().join("ffi/python"))
        .env("PATH", "/usr/bin:/bin")
        .env("HOME", &home));
    assert!(!output.status.success(), "built without cargo?\n{}", text(&output));
    assert!(text(&output).contains("building tidepool needs Rust's cargo"), "{}", text(&output));
    assert!(text(&output).contains("rustup"), "{}", text(&output));
}

#[test]
fn the_python_package_tests_pass_over_the_installed_package() {
    python_tests("backend:host,host_capacity_mb:1024");
}

#[test]
fn the_python_package_tests_pass_with_expandable_segments() {
    // memory_stats' keys, summaries and snapshots (is_expandable segments
    // in torch's memory_viz) hold in that mode too.
    python_tests("backend:host,host_capacity_mb:1024,expandable:true");
}

#[test]
fn the_planner_records_and_plans_real_models() {
    // tidepool.plan over real transformers and peft models on tiny
    // configurations, planned by this build's tidepool command (once: the
    // allocator's configuration does not matter to it).
    let python = python();
    let output = run(Command::new(&python)
        .args(["-m", "unittest", "discover", "-v", "-p", "test_plan*.py", "-s"])
        .arg(root().join("ffi/python/tests"))
        .env("PYTHONPATH", installed_site())
        .env("TIDEPOOL_BIN", env!("CARGO_BIN_EXE_tidepool"))
        .env_remove("TIDEPOOL_SKIP_PLAN")
        .env("TIDEPOOL_REQUIRE_TORCH", if in_ci() { "1" } else { "0" }));
    let text = text(&output);
    assert!(output.status.success(), "planner tests failed:\n{text}");
    assert!(text.contains("\nOK"), "{text}");
}

fn python_tests(conf: &str) {
    let python = python();
    let have_torch = has_module(&python, "torch");
    assert!(have_torch || !in_ci(), "CI=true: {} has no torch (./test.sh installs it)", python.display());
    if !have_torch {
        eprintln!("torch not installed for {}: its tests are skipped (set TIDEPOOL_TEST_PYTHON)", python.display());
    }
    let output = run(Command::new(&python)
        .args(["-m", "unittest", "discover", "-v", "-s"])
        .arg(root().join("ffi/python/tests"))
        .env("PYTHONPATH", installed_site())
        .env_remove("TIDEPOOL_LIBRARY")
        .env("TIDEPOOL_CONF", conf)
        .env("TIDEPOOL_SKIP_PLAN", "1") // the_planner_records_and_plans_real_models runs them
        .env("TIDEPOOL_REQUIRE_TORCH", if in_ci() { "1" } else { "0" }));
    let text = text(&output);
    assert!(output.status.success(), "python tests failed with {conf}:\n{text}");
    assert!(text.contains("\nOK"), "{text}");
}
