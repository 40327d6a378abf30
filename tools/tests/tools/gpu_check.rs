//! The GPU check's staging (cuda/check/prepare.sh): what travels to the GPU
//! machine in one call is checked against its bound before anything is
//! sent. CI runs prepare.sh itself and then the rehearsal of run.sh over
//! simgpu (./test.sh); this tests the size check on staged folders made here,
//! and the summary (cuda/check/summary.py) on results a GPU run could leave:
//! sections ok, failed, timed out, never reached.

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

/// summary.py over a folder of results: its exit status, and what it printed.
fn summary(out: &std::path::Path) -> (Option<i32>, String) {
    let python = std::env::var_os("TIDEPOOL_TEST_PYTHON").unwrap_or_else(|| "python3".into());
    let output = common::contained(Command::new(python).arg(common::repo_root().join("cuda/check/summary.py")).arg(out)).output().unwrap();
    (output.status.code(), format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr)))
}

/// A line of torch_e2e.py's on a GPU, with the step figures.
fn e2e_line(allocator: &str, steady_ms: f64, extra_ms: f64, calls_after_step_2: u64, counted: &str) -> String {
    format!(
        r#"{{"allocator": "{allocator}", "device": "cuda", "steps": 20, "losses": [9.1, 9.0], "steady_step_ms": {steady_ms}, "warm_up_ms": {}, "warm_up_extra_ms": {extra_ms}, "driver_calls_counted": "{counted}", "driver_calls_after_step_2": {calls_after_step_2}, "driver_calls_after_warm_up": 0, "peak_reserved_bytes": 1073741824, "graph_ok": true}}"#,
        2.0 * steady_ms + extra_ms
    )
}

#[test]
fn the_summary_tables_each_allocators_step_whatever_its_section_did() {
    let out = common::scratch_dir("gpu-results");
    let dir = out.path();
    // One line of an older run.sh (no time), the others with theirs.
    std::fs::write(
        dir.join("sections.tsv"),
        "python-package\tok\n\
         e2e-native\tok\t31 s of 45 s\n\
         e2e-native-expandable\ttimed out\t45 s of 45 s\n\
         e2e-tidepool\tok\t33 s of 45 s\n\
         e2e-tidepool-whole\tFAILED (1)\t12 s of 45 s\n",
    )
    .unwrap();
    std::fs::write(dir.join("gpu.txt"), "NVIDIA H200, 580.00, 143771 MiB\n").unwrap();
    std::fs::write(dir.join("e2e-native.json"), e2e_line("native", 20.0, 900.0, 12, "num_device_alloc+num_device_free")).unwrap();
    std::fs::write(dir.join("e2e-tidepool.json"), e2e_line("tidepool", 20.2, 904.5, 40, "tidepool.num_driver_calls")).unwrap();
    // A failed run that still wrote a line, of an older torch_e2e.py: no step figures.
    std::fs::write(dir.join("e2e-tidepool-whole.json"), r#"{"allocator": "tidepool-whole", "median_step_s": 0.02}"#).unwrap();
    let (status, text) = summary(dir);
    assert_eq!(status, Some(1), "a section failed and one timed out: {text}");
    assert!(text.contains("e2e-native-expandable  timed out   45 s of 45 s"), "{text}");
    let row =
        |label: &str| text.lines().find(|l| l.trim_start().starts_with(label)).unwrap_or_else(|| panic!("{label}: {text}")).to_string();
    let native = row("PyTorch's allocator");
    assert!(
        native.contains("20.00") && native.contains("1.000") && native.contains("940.0") && native.contains("num_device_alloc"),
        "{native}"
    );
    // tidepool against PyTorch's: 1.010 the steady step, +4.5 ms the warm-up.
    let tidepool = row("tidepool's default");
    for figure in ["20.20", "1.010", "944.9", "904.5", "+4.5", " 40 ", "tidepool.num_driver_calls"] {
        assert!(tidepool.contains(figure), "{figure}: {tidepool}");
    }
    assert!(row("PyTorch's expandable_segments:True").ends_with("timed out"), "{text}");
    assert!(row("tidepool's whole segments").ends_with("FAILED (1), no step figures"), "{text}");
    assert!(text.contains("sections: 5, ok 3, skipped 0, not ok 2: e2e-native-expandable, e2e-tidepool-whole"), "{text}");
}

#[test]
fn the_summary_of_an_empty_folder_names_nothing_and_passes() {
    let out = common::scratch_dir("gpu-results");
    let (status, text) = summary(out.path());
    assert_eq!(status, Some(0), "{text}");
    assert!(text.contains("gpu: unknown") && text.contains("sections: 0, ok 0, skipped 0, not ok 0"), "{text}");
    assert!(!text.contains("training step"), "no e2e section, no table: {text}");
}
