//! The smallest device a trace fits: bisection over the capacity, in steps
//! (by default the larger of 2 MiB and 0.25 % of the peak of live bytes,
//! or any other), replaying until the trace runs to the end without an
//! OOM; each device of a trace on its own.
#![forbid(unsafe_code)]

use super::replay::{name_device, replay, FirstOom, Model, ReplayOptions};
use super::Trace;

/// The step of the search when none is given: the larger of 2 MiB and
/// 0.25 % of the peak of live bytes, rounded up to whole MiB, so that the
/// answer is within a quarter of a percent whatever the trace's size.
pub fn default_step(peak_requested: u64) -> u64 {
    const MIB: u64 = 1 << 20;
    (peak_requested / 400).max(2 * MIB).next_multiple_of(MIB)
}

/// What `smallest_capacity` found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    pub model: Model,
    /// The device these figures are of (0 for a one-device trace).
    pub device: u32,
    /// The least multiple of the step at which the trace runs without an OOM.
    pub min_capacity: u64,
    /// The step of the search: `min_capacity - step` does not fit.
    pub step: u64,
    /// Replays it took.
    pub replays: u32,
    /// Where and why the trace runs out on a device one step smaller (None
    /// when nothing smaller can hold its peak of live bytes).
    pub one_step_less: Option<FirstOom>,
}

/// Bisection between the peak of live bytes (nothing fits in less) and a
/// capacity that passes (the unconstrained peak reserved), in the default
/// step. For a trace on several devices: the capacity every device fits.
pub fn smallest_capacity(trace: &Trace, model: Model, conf: &str) -> Result<Plan, String> {
    smallest_capacity_in_steps(trace, model, conf, default_step(trace.peak_requested()))
}

/// The smallest capacity of each device of `trace`, each replayed on its
/// own, in `step` (None: the default step of each device's peak);
/// devices that allocate nothing are left out. A request PyTorch recorded
/// as failing counts as asked (`Trace::with_failed_requests`): the device
/// must serve it too. Events and messages are the trace's own: its
/// numbering, its device.
pub fn smallest_capacity_per_device(trace: &Trace, model: Model, conf: &str, step: Option<u64>) -> Result<Vec<Plan>, String> {
    let mut plans = Vec::new();
    for (device, part) in trace.per_device() {
        let (whole, origin) = part.with_failed_requests();
        let step = step.unwrap_or_else(|| default_step(whole.peak_requested()));
        let mut plan = smallest_capacity_in_steps(&whole, model, conf, step)?;
        plan.device = device;
        if let Some(oom) = &mut plan.one_step_less {
            oom.event = origin.get(oom.event as usize).copied().unwrap_or(oom.event);
            oom.message = name_device(&oom.message, device);
        }
        plans.push(plan);
    }
    Ok(plans)
}

/// `smallest_capacity` to the nearest multiple of `step` bytes.
pub fn smallest_capacity_in_steps(trace: &Trace, model: Model, conf: &str, step: u64) -> Result<Plan, String> {
    // Unconstrained, the replay never holds more than its peak reserved: a
    // device of that size fits it (tried first, doubling if ever not).
    let options = ReplayOptions { capacity: 1 << 50, model, conf: conf.to_string(), samples: 0, record_to: None };
    let unconstrained = replay(trace, &options)?.peak_reserved_bytes;
    if unconstrained == 0 {
        // Nothing to hold (no allocation, or only empty ones): no device needed.
        return Ok(Plan { model, device: 0, min_capacity: 0, step, replays: 1, one_step_less: None });
    }
    let mut replays = 1;
    // The first OOM of a replay on `capacity`; None when the trace fits.
    let mut runs_out = |capacity: u64| -> Result<Option<FirstOom>, String> {
        replays += 1;
        let options = ReplayOptions { capacity, model, conf: conf.to_string(), samples: 0, record_to: None };
        Ok(replay(trace, &options)?.first_oom)
    };
    let floor = trace.peak_requested() / step * step;
    let mut hi = unconstrained.next_multiple_of(step).max(floor + step);
    while runs_out(hi)?.is_some() {
        hi = hi.checked_mul(2).filter(|&h| h < 1 << 50).ok_or("the trace does not fit even in 1 PiB")?;
    }
    // The trace fits `hi`, and nothing below `lo` (`below`: why `lo` does
    // not, once tried).
    let (mut lo, mut below) = (floor, None);
    while hi - lo > step {
        let mid = (lo + (hi - lo) / 2) / step * step;
        match runs_out(mid)? {
            None => hi = mid,
            Some(oom) => (lo, below) = (mid, Some(oom)),
        }
    }
    if lo > 0 && lo != hi && below.is_none() {
        // The floor, never tried: it fits only a trace whose peak it is.
        match runs_out(lo)? {
            None => hi = lo,
            Some(oom) => below = Some(oom),
        }
    }
    // A failure was seen at `lo`, now `hi - step`.
    Ok(Plan { model, device: 0, min_capacity: hi, step, replays, one_step_less: below })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bisection_finds_the_least_capacity_that_fits() {
        // Two 100 MiB blocks live together, then one of 300 MiB alone:
        // 300 MiB is the floor, but the two 100 MiB segments must be
        // released first, which the OOM path does.
        let mut trace = Trace::new("t", crate::trace::Format::RmmCsv);
        let a = trace.alloc(100 << 20, 0, 0);
        let b = trace.alloc(100 << 20, 0, 0);
        trace.free(a);
        trace.free(b);
        let c = trace.alloc(300 << 20, 0, 0);
        trace.free(c);
        let plan = smallest_capacity(&trace, Model::Tidepool, "").unwrap();
        assert_eq!(plan.min_capacity, 300 << 20);
        assert_eq!(plan.step, 2 << 20);
        // Nothing smaller than the peak can hold it: no device one step less to explain.
        assert_eq!(plan.one_step_less, None);
        // With whole segments a 2 MiB block keeps its 20 MiB segment while
        // 300 MiB is asked: 320 MiB fits, and one step less runs out at
        // that request.
        let mut trace = Trace::new("t", crate::trace::Format::RmmCsv);
        let small = trace.alloc(2 << 20, 0, 0);
        let c = trace.alloc(300 << 20, 0, 0);
        trace.free(c);
        trace.free(small);
        // With expandable segments (tidepool's default) the block holds
        // its own 2 MiB page: 302 MiB fits.
        let expandable = smallest_capacity(&trace, Model::Tidepool, "").unwrap();
        assert_eq!(expandable.min_capacity, 302 << 20);
        let plan = smallest_capacity(&trace, Model::WholeSegments, "").unwrap();
        assert_eq!(plan.min_capacity, 320 << 20);
        let oom = plan.one_step_less.expect("the device one step smaller runs out");
        assert_eq!(oom.event, 1, "at the 300 MiB request");
        assert!(oom.message.contains("tried to allocate 300.00 MiB"), "{}", oom.message);
    }

    #[test]
    fn a_trace_that_holds_nothing_needs_no_device() {
        let mut trace = Trace::new("t", crate::trace::Format::RmmCsv);
        let empty = trace.alloc(0, 0, 0);
        trace.free(empty);
        for t in [Trace::new("t", crate::trace::Format::RmmCsv), trace] {
            let plan = smallest_capacity(&t, Model::WholeSegments, "").unwrap();
            assert_eq!((plan.min_capacity, plan.one_step_less.is_none()), (0, true));
        }
    }

    #[test]
    fn the_default_step_is_2_mib_or_a_quarter_percent_of_the_peak() {
        const MIB: u64 = 1 << 20;
        assert_eq!(default_step(100 * MIB), 2 * MIB);
        assert_eq!(default_step(800 * MIB), 2 * MIB);
        assert_eq!(default_step(4000 * MIB), 10 * MIB);
        assert_eq!(default_step(51 << 30), 131 * MIB);
    }

    #[test]
    fn each_device_of_a_trace_is_planned_on_its_own() {
        // Device 0 holds 100 MiB while device 1 holds 300 MiB: each card's
        // need, not their sum.
        let mut trace = Trace::new("t", crate::trace::Format::TorchSnapshot);
        let a = trace.alloc(100 << 20, 0, 0);
        let b = trace.alloc(300 << 20, 0, 1);
        trace.free(a);
        trace.free(b);
        assert_eq!(trace.peak_requested_per_device(), [100 << 20, 300 << 20]);
        let plans = smallest_capacity_per_device(&trace, Model::Pytorch, "", None).unwrap();
        let found: Vec<_> = plans.iter().map(|p| (p.device, p.min_capacity)).collect();
        assert_eq!(found, [(0, 100 << 20), (1, 300 << 20)]);
    }
}
