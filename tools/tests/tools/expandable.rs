//! Expandable segments on real traces: peak reserved and the smallest
//! device that fits, against the models of PyTorch's allocator with and
//! without its expandable segments, on every trace present.

use std::path::{Path, PathBuf};

use tidepool_tools::trace::plan::smallest_capacity_in_steps;
use tidepool_tools::trace::replay::{replay, Policy, ReplayOptions};

use crate::common::MIB;

/// The traces the targets are checked on: examples/traces (always there)
/// and ../shared/traces (when present).
fn traces() -> Vec<PathBuf> {
    let files = crate::replay::all_traces();
    assert!(files.len() >= 5, "examples/traces is missing");
    files
}

/// Shared traces that miss the smallest-device target, with why (docs/benchmarks.md:
/// "One target is not met"); on them that figure is only held to "never
/// above PyTorch's model" (every other target holds). Named one by one so
/// that any other trace, shared or held out, meets every target.
const OPEN_SMALLEST_DEVICE: [(&str, &str); 1] = [(
    "niu_fwdbwd_200_bf16mixed.pickle",
    "931.9 MiB live in bf16 autocast needs 957 MiB (peak + 25 MiB): blocks born in the first step and kept (autocast's \
     weight copies, gradients) pin pages among the second step's activations; best fit that gave back every page \
     with no live byte at once would need peak + 20 MiB; knowing lifetimes as blocks arrive, 14 to 18",
)];

fn open_smallest_device(file: &Path) -> Option<&'static str> {
    let name = file.file_name()?.to_str()?;
    OPEN_SMALLEST_DEVICE.iter().find(|(open, _)| *open == name).map(|(_, why)| *why)
}

/// Each device of each trace, on its own: the targets are one card's.
fn device_traces() -> Vec<(String, PathBuf, tidepool_tools::trace::Trace)> {
    let mut out = Vec::new();
    for file in traces() {
        let trace = tidepool_tools::trace::load(&file).unwrap();
        for (device, part) in trace.per_device() {
            let name = if trace.devices <= 1 { file.display().to_string() } else { format!("{} device {device}", file.display()) };
            out.push((name, file.clone(), part.into_owned()));
        }
    }
    out
}

/// Peak reserved with plentiful memory, as a ratio to the peak of live bytes.
fn peak_ratio(trace: &tidepool_tools::trace::Trace, policy: Policy) -> f64 {
    let options = ReplayOptions { capacity: 1 << 50, policy, conf: String::new(), samples: 0, record_to: None };
    let report = replay(trace, &options).unwrap();
    assert_eq!(report.ooms, 0);
    report.peak_reserved_bytes as f64 / trace.peak_requested() as f64
}

#[test]
fn with_plentiful_memory_expandable_reserves_no_more_than_pytorch_either_way_on_every_trace() {
    let (mut log_sum, mut counted) = (0.0, 0);
    for (name, _, trace) in device_traces() {
        let (ours, pytorch) = (peak_ratio(&trace, Policy::Expandable), peak_ratio(&trace, Policy::Pytorch));
        let theirs = peak_ratio(&trace, Policy::PytorchExpandable);
        eprintln!(
            "{name}: peak reserved / peak live: expandable {ours:.4}, pytorch model {pytorch:.4}, its expandable segments {theirs:.4}"
        );
        assert!(ours <= pytorch, "{name}: {ours:.4} above PyTorch's {pytorch:.4}");
        assert!(ours <= theirs, "{name}: {ours:.4} above PyTorch's expandable segments' {theirs:.4}");
        assert!(ours <= 1.05, "{name}: {ours:.4} > 1.05");
        log_sum += ours.ln();
        counted += 1;
    }
    let geomean = (log_sum / counted as f64).exp();
    eprintln!("geometric mean of peak reserved / peak live: {geomean:.4} over {counted} traces and devices");
    assert!(geomean <= 1.015, "geometric mean {geomean:.4} > 1.015");
}

#[test]
fn the_smallest_device_that_fits_is_within_1_5_percent_or_16_mib_of_peak_live_on_every_trace() {
    // To 4 MiB rather than plan's 64 MiB: 64 MiB is an eighth of the smallest trace.
    const STEP: u64 = 4 * MIB;
    const GIB: f64 = (1u64 << 30) as f64;
    for (name, file, trace) in device_traces() {
        let peak = trace.peak_requested() as f64;
        let ours = smallest_capacity_in_steps(&trace, Policy::Expandable, "", STEP).unwrap().min_capacity;
        let pytorch = smallest_capacity_in_steps(&trace, Policy::Pytorch, "", STEP).unwrap().min_capacity;
        let theirs = smallest_capacity_in_steps(&trace, Policy::PytorchExpandable, "", STEP).unwrap().min_capacity;
        let ratio = |bytes: u64| bytes as f64 / peak;
        eprintln!(
            "{name}: smallest device / peak live: expandable {:.4}, pytorch model {:.4}, its expandable segments {:.4}",
            ratio(ours),
            ratio(pytorch),
            ratio(theirs)
        );
        assert!(ours <= pytorch, "{name}: needs {ours}, PyTorch's model {pytorch}");
        assert!(ours <= theirs, "{name}: needs {ours}, PyTorch's expandable segments {theirs}");
        if let Some(why) = open_smallest_device(&file) {
            eprintln!("  target open: {why}");
            continue;
        }
        // Under 1 GiB live a ratio is loose: there the margin is 16 MiB.
        let target = if peak < GIB { peak + 16.0 * MIB as f64 } else { 1.015 * peak + STEP as f64 };
        assert!(ours as f64 <= target, "{name}: needs {ours}, peak live {peak}, target {target}");
    }
}

#[test]
fn allocations_of_8_mib_cut_the_driver_calls_of_page_by_page_for_little_memory_on_every_trace() {
    let (mut log_sum, mut counted) = (0.0, 0);
    for (name, _, trace) in device_traces() {
        let run = |conf: &str| {
            let options = ReplayOptions { capacity: 1 << 50, policy: Policy::Expandable, conf: conf.into(), samples: 0, record_to: None };
            let report = replay(&trace, &options).unwrap();
            (report.driver_calls as f64, report.peak_reserved_bytes as f64 / trace.peak_requested() as f64)
        };
        let ((by_page, _), (by_8_mib, reserved)) = (run(""), run("expandable_allocation_mb:8"));
        if by_page == 0.0 {
            continue;
        }
        eprintln!("{name}: driver calls page by page {by_page}, in 8 MiB allocations {by_8_mib}; reserved {reserved:.4}");
        assert!(by_8_mib <= 0.85 * by_page, "{name}: {by_8_mib} calls in 8 MiB allocations against {by_page} page by page");
        assert!(reserved <= 1.05, "{name}: {reserved:.4} reserved in 8 MiB allocations");
        log_sum += (by_8_mib / by_page).ln();
        counted += 1;
    }
    let mean = (log_sum / counted as f64).exp();
    assert!(mean <= 0.5, "8 MiB allocations make {mean:.2}x the calls of page by page in geometric mean");
}

#[test]
fn allocations_as_large_as_each_run_that_split_when_reused_hold_page_by_page_s_memory_for_a_third_of_its_calls() {
    const SPLIT: &str = "expandable_allocation_mb:unlimited,expandable_split_allocations:true";
    let (mut log_sum, mut counted) = (0.0, 0);
    for (name, _, trace) in device_traces() {
        let run = |conf: &str| {
            let options = ReplayOptions { capacity: 1 << 50, policy: Policy::Expandable, conf: conf.into(), samples: 0, record_to: None };
            let report = replay(&trace, &options).unwrap();
            (report.driver_calls as f64, report.peak_reserved_bytes as f64)
        };
        let ((by_page, page_reserved), (split, split_reserved)) = (run(""), run(SPLIT));
        if by_page == 0.0 {
            continue;
        }
        eprintln!(
            "{name}: driver calls page by page {by_page}, split {split}; reserved {:.4}x page by page's",
            split_reserved / page_reserved
        );
        assert!(split_reserved <= 1.005 * page_reserved, "{name}: {split_reserved} reserved against {page_reserved} page by page");
        log_sum += (split / by_page).ln();
        counted += 1;
    }
    let mean = (log_sum / counted as f64).exp();
    assert!(mean <= 0.4, "split allocations make {mean:.2}x the calls of page by page in geometric mean");
}
