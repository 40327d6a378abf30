//! Runs the Python package's tests (ffi/python/tests) against the library
//! this build produced, with Python alone (no torch).

mod common;

use std::path::Path;
use std::process::Command;

#[test]
fn the_python_package_works_through_ctypes() {
    python_tests("backend:host,host_capacity_mb:1024");
}

#[test]
fn the_python_package_works_with_expandable_segments() {
    // memory_stats' keys, summaries and snapshots (is_expandable segments in
    // torch's memory_viz, where torch is installed) hold in that mode too.
    python_tests("backend:host,host_capacity_mb:1024,expandable:true");
}

fn python_tests(conf: &str) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let lib = common::cdylib();
    let Ok(output) = Command::new("python3")
        .args(["-m", "unittest", "discover", "-v", "-s"])
        .arg(root.join("ffi/python/tests"))
        .env("TIDEPOOL_LIBRARY", &lib)
        .env("TIDEPOOL_CONF", conf)
        .output()
    else {
        eprintln!("python3 not installed: skipped");
        return;
    };
    let text = format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    assert!(output.status.success(), "python tests failed with {conf}:\n{text}");
    assert!(text.contains("\nOK"), "{text}");
}
