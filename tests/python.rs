//! Runs the Python package's tests (ffi/python/tests) against the library
//! this build produced, with Python alone (no torch).

mod common;

use std::path::Path;
use std::process::Command;

#[test]
fn the_python_package_works_through_ctypes() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let lib = common::cdylib();
    let Ok(output) = Command::new("python3")
        .args(["-m", "unittest", "discover", "-v", "-s"])
        .arg(root.join("ffi/python/tests"))
        .env("TIDEPOOL_LIBRARY", &lib)
        .env("TIDEPOOL_CONF", "backend:host,host_capacity_mb:1024")
        .output()
    else {
        eprintln!("python3 not installed: skipped");
        return;
    };
    let text = format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    assert!(output.status.success(), "python tests failed:\n{text}");
    assert!(text.contains("\nOK"), "{text}");
}
