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

/// Traces that miss the smallest-device target, with why (docs/benchmarks.md:
/// "One target is not met"); on them that figure is only held to "never
/// above PyTorch's model" (every other target holds). Named one by one so
/// that any other trace, shared or held out, meets every target.
const OPEN_SMALLEST_DEVICE: [(&str, &str); 2] = [
    (
        "gpt2-bf16-mixed-train.csv",
        "2,390 MiB live (GPT-2 small in bf16 autocast, AdamW, three steps) needs 2,432 MiB (1.0177x): where it runs \
         out, in the second step's backward, 30 free pieces of 0.06 to 1.88 MiB (36 MiB) lie between live blocks, \
         mostly that step's fp32 gradients, each sharing its pages with them",
    ),
    (
        "niu_fwdbwd_200_bf16mixed.pickle",
        "931.9 MiB live in bf16 autocast needs 957 MiB (peak + 25 MiB): blocks born in the first step and kept (autocast's \
         weight copies, gradients) pin pages among the second step's activations; best fit that gave back every page \
         with no live byte at once would need peak + 20 MiB; knowing lifetimes as blocks arrive, 14 to 18",
    ),
];

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
    let mut ratios = Vec::new();
    for (name, _, trace) in device_traces() {
        let (ours, pytorch) = (peak_ratio(&trace, Policy::Expandable), peak_ratio(&trace, Policy::Pytorch));
        let theirs = peak_ratio(&trace, Policy::PytorchExpandable);
        eprintln!(
            "{name}: peak reserved / peak live: expandable {ours:.4}, pytorch model {pytorch:.4}, its expandable segments {theirs:.4}"
        );
        assert!(ours <= pytorch, "{name}: {ours:.4} above PyTorch's {pytorch:.4}");
        assert!(ours <= theirs, "{name}: {ours:.4} above PyTorch's expandable segments' {theirs:.4}");
        assert!(ours <= 1.05, "{name}: {ours:.4} > 1.05");
        ratios.push(ours);
    }
    let geomean = geometric_mean(&ratios);
    eprintln!("geometric mean of peak reserved / peak live: {geomean:.4} over {} traces and devices", ratios.len());
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

/// A replay's driver calls and peak reserved bytes.
struct Run {
    calls: f64,
    reserved: f64,
}

/// Each device of each trace that makes driver calls, with plentiful
/// memory: its name, its peak of live bytes, and its replay page by page
/// and with `conf`.
fn page_by_page_and(conf: &str) -> Vec<(String, f64, Run, Run)> {
    let mut out = Vec::new();
    for (name, _, trace) in device_traces() {
        let run = |conf: &str| {
            let options = ReplayOptions { capacity: 1 << 50, policy: Policy::Expandable, conf: conf.into(), samples: 0, record_to: None };
            let report = replay(&trace, &options).unwrap();
            Run { calls: report.driver_calls as f64, reserved: report.peak_reserved_bytes as f64 }
        };
        let (by_page, other) = (run(""), run(conf));
        if by_page.calls > 0.0 {
            out.push((name, trace.peak_requested() as f64, by_page, other));
        }
    }
    out
}

fn geometric_mean(ratios: &[f64]) -> f64 {
    (ratios.iter().map(|r| r.ln()).sum::<f64>() / ratios.len() as f64).exp()
}

#[test]
fn allocations_of_8_mib_cut_the_driver_calls_of_page_by_page_for_little_memory_on_every_trace() {
    let mut ratios = Vec::new();
    for (name, live, by_page, by_8_mib) in page_by_page_and("expandable_allocation_mb:8") {
        let reserved = by_8_mib.reserved / live;
        eprintln!("{name}: driver calls page by page {}, in 8 MiB allocations {}; reserved {reserved:.4}", by_page.calls, by_8_mib.calls);
        assert!(
            by_8_mib.calls <= 0.85 * by_page.calls,
            "{name}: {} calls in 8 MiB allocations against {} page by page",
            by_8_mib.calls,
            by_page.calls
        );
        assert!(reserved <= 1.05, "{name}: {reserved:.4} reserved in 8 MiB allocations");
        ratios.push(by_8_mib.calls / by_page.calls);
    }
    let mean = geometric_mean(&ratios);
    assert!(mean <= 0.5, "8 MiB allocations make {mean:.2}x the calls of page by page in geometric mean");
}

#[test]
fn allocations_as_large_as_each_run_that_split_when_reused_hold_page_by_page_s_memory_for_fewer_calls() {
    const GIB: f64 = (1u64 << 30) as f64;
    let mut ratios = Vec::new();
    for (name, live, by_page, split) in page_by_page_and("expandable_allocation_mb:unlimited,expandable_split_allocations:true") {
        eprintln!(
            "{name}: driver calls page by page {}, split {}; reserved {:.4}x page by page's",
            by_page.calls,
            split.calls,
            split.reserved / by_page.reserved
        );
        assert!(
            split.reserved <= 1.005 * by_page.reserved,
            "{name}: {} reserved against {} page by page",
            split.reserved,
            by_page.reserved
        );
        let calls = split.calls / by_page.calls;
        // Large tensors are allocated and freed whole (0.004x to 0.47x here).
        if live >= 20.0 * GIB {
            assert!(calls <= 0.5, "{name}: split allocations make {calls:.2}x the calls of page by page");
        }
        ratios.push(calls);
    }
    // 0.33x over the 23 traces of docs/benchmarks.md; 0.54x over the
    // shipped ones alone, small steps whose freed blocks are carved smaller.
    let mean = geometric_mean(&ratios);
    assert!(mean <= 0.6, "split allocations make {mean:.2}x the calls of page by page in geometric mean");
}
