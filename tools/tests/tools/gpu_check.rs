//! The GPU check's staging (cuda/check/prepare.sh): what travels to the GPU
//! machine in one call is checked against its bound before anything is
//! sent. CI runs prepare.sh itself and then the rehearsal of run.sh over
//! simgpu (.ci/run); this tests the size check on staged folders made here.

use std::process::Command;

use crate::common;

/// `prepare.sh --check-size` over the folder `stage`: whether it passed, and what it printed.
fn check_size(stage: &std::path::Path) -> (bool, String) {
    let output = Command::new("bash")
        .arg(common::repo_root().join("cuda/check/prepare.sh"))
        .arg("--check-size")
        .env("STAGE", stage)
        .output()
        .unwrap();
    (output.status.success(), format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr)))
}

#[test]
fn a_staged_folder_past_the_bound_fails_the_size_check_with_the_figures() {
    let stage = common::scratch_dir("staged");
    // What a debug build of the engine's test binary weighs (about 60 MB),
    // as a sparse file: the check counts apparent sizes, as the transfer does.
    let big = std::fs::File::create(stage.path().join("engine-test")).unwrap();
    big.set_len(61 << 20).unwrap();
    std::fs::write(stage.path().join("libtidepool.so"), vec![0u8; 1 << 20]).unwrap();
    let (ok, text) = check_size(stage.path());
    assert!(!ok, "{text}");
    assert!(text.contains("FAILED") && text.contains("(bound 60 MiB)"), "{text}");
    // Each staged file with its size, the largest first, and by how much the bound is passed.
    let engine = text.find("61.0 MiB  engine-test").expect(&text);
    let library = text.find("1.0 MiB  libtidepool.so").expect(&text);
    assert!(engine < library, "{text}");
    assert!(text.contains("over the 60 MiB bound by"), "{text}");
}

#[test]
fn a_staged_folder_within_the_bound_passes_and_an_empty_one_fails() {
    let stage = common::scratch_dir("staged");
    std::fs::write(stage.path().join("libtidepool.so"), vec![0u8; 2 << 20]).unwrap();
    let (ok, text) = check_size(stage.path());
    assert!(ok && text.contains("size check: ok") && text.contains("2.0 MiB  libtidepool.so"), "{text}");
    std::fs::remove_file(stage.path().join("libtidepool.so")).unwrap();
    let (ok, text) = check_size(stage.path());
    assert!(!ok && text.contains("run cuda/check/prepare.sh"), "{text}");
}
