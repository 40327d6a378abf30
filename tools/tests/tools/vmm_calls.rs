//! The GPU check's scripts of expandable segments run here:
//! cuda/check/vmm_calls.py, which times the driver calls on a GPU, over
//! simgpu (every call it makes is one the driver takes, and its warm-up
//! makes the calls each setting's count says); cuda/check/trace_warmup.py,
//! which plays a trace through PyTorch, on the host with the real torch.

use std::process::Command;

use crate::common;

#[test]
fn the_gpu_timing_of_driver_calls_runs_over_simgpu() {
    let json = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("vmm_calls.json");
    let python = std::env::var_os("TIDEPOOL_TEST_PYTHON").unwrap_or_else(|| "python3".into());
    let script = common::repo_root().join("cuda/check/vmm_calls.py");
    let output = common::contained(Command::new(python).arg(script))
        .args(["--sizes-mib", "2,20,128", "--repeats", "3", "--warm-up", "1", "--json"])
        .arg(&json)
        .env("LD_LIBRARY_PATH", common::simgpu_dir())
        .env("SIMGPU_CAPACITY", "4G")
        .output()
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    assert!(output.status.success() && text.contains("vmm calls: ok"), "{text}");
    let figures: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    for size in ["2MiB", "20MiB", "128MiB"] {
        for call in ["create", "map", "set_access", "unmap", "release"] {
            assert!(figures["calls"][size][call].as_f64().is_some_and(|us| us > 0.0), "{size} {call}: {figures}");
        }
    }
    // 1 GiB: 512 pages, 128 allocations of 8 MiB, 51 of 20 MiB (1020 MiB),
    // 16 of 64 MiB; a create and a map each, one grant of access, an unmap
    // and a release each.
    for (setting, allocations) in [("page by page", 512), ("8 MiB (tidepool)", 128), ("20 MiB (PyTorch)", 51), ("64 MiB", 16)] {
        assert_eq!(figures["warm_up"][setting]["calls"], 4 * allocations + 1, "{setting}: {figures}");
    }
}

#[test]
fn the_trace_warm_up_plays_a_trace_through_torch_on_the_host() {
    let python = std::env::var_os("TIDEPOOL_TEST_PYTHON").unwrap_or_else(|| "python3".into());
    let has_torch = Command::new(&python).args(["-c", "import torch"]).output().is_ok_and(|o| o.status.success());
    if !has_torch {
        assert!(!common::in_ci(), "CI=true: {python:?} has no torch (./test.sh installs it)");
        eprintln!("skipped: {python:?} has no torch");
        return;
    }
    let root = common::repo_root();
    let output = common::contained(Command::new(&python).arg(root.join("cuda/check/trace_warmup.py")))
        .args(["--allocator", "native", "--device", "cpu", "--target-gib", "1", "--trace"])
        .arg(root.join("examples/traces/mlp-train.csv"))
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{text}{}", String::from_utf8_lossy(&output.stderr));
    let result: serde_json::Value = serde_json::from_str(text.lines().last().unwrap()).unwrap();
    // mlp-train: 304 events, 537,034,780 bytes live at most; scale 2 for 1 GiB.
    assert_eq!((result["events"].as_u64(), result["scale"].as_u64()), (Some(304), Some(2)), "{result}");
    assert_eq!(result["peak_live_bytes"].as_u64(), Some(2 * 537_034_780), "{result}");
    assert!(result["warm_up_s"].as_f64().is_some() && result["steady_s"].as_f64().is_some(), "{result}");
}
