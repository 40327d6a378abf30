//! Expandable segments, tidepool's default, on real traces: driver calls
//! after warm-up, peak reserved and the smallest device that fits, against
//! the models of PyTorch's allocator with and without its expandable
//! segments, on every trace present, and on repeated steps recorded by the
//! planner (tools/tests/traces/steps, with record.sh beside them).

use std::path::PathBuf;

use tidepool_tools::trace::plan::smallest_capacity_in_steps;
use tidepool_tools::trace::replay::{replay, Model, ReplayOptions, ReplayReport};
use tidepool_tools::trace::{Trace, WarmUpEnd};

use crate::common::MIB;

/// The traces the targets are checked on: examples/traces and
/// tools/tests/traces (always there) and ../shared/traces (when present).
fn traces() -> Vec<PathBuf> {
    let files = crate::replay::all_traces();
    assert!(files.len() >= 13, "examples/traces or tools/tests/traces/steps is missing");
    files
}

/// The planner's repeated steps.
fn step_traces() -> Vec<PathBuf> {
    let files: Vec<PathBuf> = traces().into_iter().filter(|f| f.parent().is_some_and(|d| d.ends_with("steps"))).collect();
    assert_eq!(files.len(), 8, "tools/tests/traces/steps: {files:?}");
    files
}

/// Each device of each of `files`, on its own: the targets are one card's.
fn device_traces(files: Vec<PathBuf>) -> Vec<(String, PathBuf, Trace)> {
    let mut out = Vec::new();
    for file in files {
        let trace = tidepool_tools::trace::load(&file).unwrap();
        for (device, part) in trace.per_device() {
            let name = if trace.devices <= 1 { file.display().to_string() } else { format!("{} device {device}", file.display()) };
            out.push((name, file.clone(), part.into_owned()));
        }
    }
    out
}

/// A replay with plentiful memory.
fn plentiful(trace: &Trace, model: Model, conf: &str) -> ReplayReport {
    let options = ReplayOptions { capacity: 1 << 50, model, conf: conf.into(), samples: 0, record_to: None };
    let report = replay(trace, &options).unwrap();
    assert_eq!(report.ooms, 0);
    report
}

/// Peak reserved with plentiful memory, as a ratio to the peak of live bytes.
fn peak_ratio(trace: &Trace, model: Model) -> f64 {
    plentiful(trace, model, "").peak_reserved_bytes as f64 / trace.peak_requested() as f64
}

fn geometric_mean(ratios: &[f64]) -> f64 {
    (ratios.iter().map(|r| r.ln()).sum::<f64>() / ratios.len() as f64).exp()
}

#[test]
fn a_repeated_step_makes_no_driver_call_after_its_second() {
    for (name, _, trace) in device_traces(step_traces()) {
        let report = |model| plentiful(&trace, model, "");
        let [ours, whole, pytorch] = [Model::Tidepool, Model::WholeSegments, Model::Pytorch].map(report);
        eprintln!(
            "{name}: driver calls (after step 2): tidepool {} ({}), whole segments {} ({}), pytorch model {} ({})",
            ours.driver_calls,
            ours.steady_driver_calls,
            whole.driver_calls,
            whole.steady_driver_calls,
            pytorch.driver_calls,
            pytorch.steady_driver_calls,
        );
        assert_eq!(ours.warm_up.by, WarmUpEnd::SecondStep, "{name}: the planner marks its steps");
        assert!(ours.warm_up.events < trace.events.len(), "{name}: a third step");
        assert_eq!(ours.steady_driver_calls, 0, "{name}");
        // Whole segments grow as PyTorch's do (resnet's fourth step: one
        // segment more, for both).
        assert!(whole.steady_driver_calls <= pytorch.steady_driver_calls, "{name}");
    }
}

#[test]
fn where_memory_is_short_a_repeated_step_makes_fewer_calls_than_pytorchs_expandable_segments() {
    // With room for what it reserves with plentiful memory, none after
    // step 2 (above). On less, pages move to make room step after step
    // (docs/expandable-segments.md, "Steady state"), fewer than PyTorch's
    // expandable segments unmap and map on the device they need: 919 in
    // all against 1,241 (the hand-written optimizer's step alone makes
    // more: 8 against 3).
    let (mut ours_in_all, mut theirs_in_all) = (0, 0);
    for (name, _, trace) in device_traces(step_traces()) {
        let run = |capacity, model| {
            let options = ReplayOptions { capacity, model, conf: String::new(), samples: 0, record_to: None };
            replay(&trace, &options).unwrap()
        };
        let smallest = |model| smallest_capacity_in_steps(&trace, model, "", 2 * MIB).unwrap().min_capacity;
        let (ours, theirs) = (smallest(Model::Tidepool), smallest(Model::PytorchExpandable));
        let tight = run(ours, Model::Tidepool);
        let (roomy, pytorch) = (run(theirs, Model::Tidepool), run(theirs, Model::PytorchExpandable));
        eprintln!(
            "{name}: driver calls after step 2 on the smallest device, {} MiB: {}; on PyTorch's expandable segments' \
             {} MiB: {}, theirs {}",
            ours / MIB,
            tight.steady_driver_calls,
            theirs / MIB,
            roomy.steady_driver_calls,
            pytorch.steady_driver_calls
        );
        assert_eq!((tight.ooms, roomy.ooms, pytorch.ooms), (0, 0, 0), "{name}");
        ours_in_all += roomy.steady_driver_calls;
        theirs_in_all += pytorch.steady_driver_calls;
    }
    eprintln!("in all: {ours_in_all} against {theirs_in_all}");
    assert!(ours_in_all < theirs_in_all, "{ours_in_all} calls after step 2 against PyTorch's {theirs_in_all}");
}

#[test]
fn with_plentiful_memory_the_default_reserves_no_more_than_pytorchs_expandable_segments_on_every_trace() {
    let mut ratios = Vec::new();
    for (name, _, trace) in device_traces(traces()) {
        let (ours, whole) = (peak_ratio(&trace, Model::Tidepool), peak_ratio(&trace, Model::WholeSegments));
        let (pytorch, theirs) = (peak_ratio(&trace, Model::Pytorch), peak_ratio(&trace, Model::PytorchExpandable));
        eprintln!(
            "{name}: peak reserved / peak live: tidepool {ours:.4}, whole segments {whole:.4}, pytorch model {pytorch:.4}, \
             its expandable segments {theirs:.4}"
        );
        assert!(ours <= theirs, "{name}: {ours:.4} above PyTorch's expandable segments' {theirs:.4}");
        ratios.push(ours);
    }
    // The target is 1.01: unmet (docs/expandable-segments.md, "Steady
    // state"): a layout that makes no call once settled holds the address
    // space its first steps spread over.
    let geomean = geometric_mean(&ratios);
    eprintln!("geometric mean of peak reserved / peak live: {geomean:.4} over {} traces and devices", ratios.len());
    assert!(geomean <= 1.05, "geometric mean {geomean:.4} > 1.05");
}

#[test]
fn the_smallest_device_that_fits_is_never_above_pytorchs_and_within_1_2_percent_of_peak_live_in_geometric_mean() {
    // To 4 MiB rather than plan's 64 MiB: 64 MiB is an eighth of the smallest trace.
    const STEP: u64 = 4 * MIB;
    let mut ratios = Vec::new();
    for (name, _, trace) in device_traces(traces()) {
        let peak = trace.peak_requested() as f64;
        let ours = smallest_capacity_in_steps(&trace, Model::Tidepool, "", STEP).unwrap().min_capacity;
        let pytorch = smallest_capacity_in_steps(&trace, Model::Pytorch, "", STEP).unwrap().min_capacity;
        let theirs = smallest_capacity_in_steps(&trace, Model::PytorchExpandable, "", STEP).unwrap().min_capacity;
        let ratio = |bytes: u64| bytes as f64 / peak;
        eprintln!(
            "{name}: smallest device / peak live: tidepool {:.4}, pytorch model {:.4}, its expandable segments {:.4}",
            ratio(ours),
            ratio(pytorch),
            ratio(theirs)
        );
        assert!(ours <= pytorch, "{name}: needs {ours}, PyTorch's model {pytorch}");
        assert!(ours <= theirs, "{name}: needs {ours}, PyTorch's expandable segments {theirs}");
        ratios.push(ratio(ours));
    }
    // 1.0118 (PyTorch's expandable segments 1.0275, its default 1.0735);
    // the largest, 1.0473, niu's bf16 step (docs/benchmarks.md).
    let geomean = geometric_mean(&ratios);
    eprintln!("geometric mean of the smallest device / peak live: {geomean:.4} over {} traces and devices", ratios.len());
    assert!(geomean <= 1.012, "geometric mean {geomean:.4} > 1.012");
}

#[test]
fn warming_up_costs_at_most_4x_the_calls_of_pytorchs_expandable_segments() {
    let mut ratios = Vec::new();
    for (name, _, trace) in device_traces(traces()) {
        let ours = plentiful(&trace, Model::Tidepool, "").driver_calls as f64;
        let theirs = plentiful(&trace, Model::PytorchExpandable, "").driver_calls as f64;
        eprintln!("{name}: driver calls: tidepool {ours}, PyTorch's expandable segments {theirs}: {:.2}x", ours / theirs);
        if theirs > 0.0 {
            ratios.push(ours / theirs);
        }
    }
    let mean = geometric_mean(&ratios);
    eprintln!("geometric mean: {mean:.2}x over {} traces and devices", ratios.len());
    assert!(mean <= 4.0, "{mean:.2}x the calls of PyTorch's expandable segments");
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
    for (name, _, trace) in device_traces(traces()) {
        let run = |conf: &str| {
            let report = plentiful(&trace, Model::Tidepool, conf);
            Run { calls: report.driver_calls as f64, reserved: report.peak_reserved_bytes as f64 }
        };
        let (by_page, other) = (run("expandable_allocation_mb:2"), run(conf));
        if by_page.calls > 0.0 {
            out.push((name, trace.peak_requested() as f64, by_page, other));
        }
    }
    out
}

#[test]
fn allocations_of_8_mib_the_default_cut_the_driver_calls_of_page_by_page_on_every_trace() {
    let mut ratios = Vec::new();
    for (name, live, by_page, by_8_mib) in page_by_page_and("") {
        let reserved = by_8_mib.reserved / live;
        eprintln!("{name}: driver calls page by page {}, in 8 MiB allocations {}; reserved {reserved:.4}", by_page.calls, by_8_mib.calls);
        assert!(
            by_8_mib.calls <= 0.85 * by_page.calls,
            "{name}: {} calls in 8 MiB allocations against {} page by page",
            by_8_mib.calls,
            by_page.calls
        );
        ratios.push(by_8_mib.calls / by_page.calls);
    }
    let mean = geometric_mean(&ratios);
    eprintln!("geometric mean: {mean:.2}x the calls of page by page");
    assert!(mean <= 0.5, "8 MiB allocations make {mean:.2}x the calls of page by page in geometric mean");
}

#[test]
fn allocations_as_large_as_each_run_that_split_when_reused_hold_within_5_percent_of_page_by_page_s_memory_for_fewer_calls() {
    // (1.047x at most, cnn-train; 0.42x the calls in geometric mean.)
    let mut ratios = Vec::new();
    for (name, _, by_page, split) in page_by_page_and("expandable_allocation_mb:unlimited,expandable_split_allocations:true") {
        eprintln!(
            "{name}: driver calls page by page {}, split {}; reserved {:.4}x page by page's",
            by_page.calls,
            split.calls,
            split.reserved / by_page.reserved
        );
        assert!(split.reserved <= 1.05 * by_page.reserved, "{name}: {} reserved against {} page by page", split.reserved, by_page.reserved);
        ratios.push(split.calls / by_page.calls);
    }
    let mean = geometric_mean(&ratios);
    eprintln!("geometric mean: {mean:.2}x the calls of page by page");
    assert!(mean <= 0.6, "split allocations make {mean:.2}x the calls of page by page in geometric mean");
}
