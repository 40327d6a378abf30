//! The smallest device a trace fits: bisection over the capacity, in steps
//! of 64 MiB (or any other), replaying until the trace runs to the end
//! without an OOM.
#![forbid(unsafe_code)]

use super::replay::{replay, Policy, ReplayOptions};
use super::Trace;

/// The step of the search.
pub const STEP: u64 = 64 << 20;

/// What `smallest_capacity` found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Plan {
    pub policy: Policy,
    /// The least multiple of the step at which the trace runs without an OOM.
    pub min_capacity: u64,
    /// Replays it took.
    pub replays: u32,
}

/// Bisection between the peak of live bytes (nothing fits in less) and a
/// capacity that passes (found by doubling from the unconstrained peak).
pub fn smallest_capacity(trace: &Trace, policy: Policy, conf: &str) -> Result<Plan, String> {
    smallest_capacity_in_steps(trace, policy, conf, STEP)
}

/// `smallest_capacity` to the nearest multiple of `step` bytes.
pub fn smallest_capacity_in_steps(trace: &Trace, policy: Policy, conf: &str, step: u64) -> Result<Plan, String> {
    let mut replays = 0;
    let mut fits = |capacity: u64| -> Result<bool, String> {
        replays += 1;
        let options = ReplayOptions { capacity, policy, conf: conf.to_string(), samples: 0, record_to: None };
        Ok(replay(trace, &options)?.ooms == 0)
    };
    let floor = trace.peak_requested() / step * step;
    let mut hi = floor + step;
    while !fits(hi)? {
        hi = hi.checked_mul(2).filter(|&h| h < 1 << 50).ok_or("the trace does not fit even in 1 PiB")?;
    }
    // fits(hi); below `lo` nothing can fit.
    let mut lo = floor;
    while hi - lo > step {
        let mid = (lo + (hi - lo) / 2) / step * step;
        if fits(mid)? {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    if lo > 0 && lo != hi && fits(lo)? {
        hi = lo;
    }
    Ok(Plan { policy, min_capacity: hi, replays })
}

/// Common GPU memory sizes, in GiB, for the plain answer.
pub const CARDS_GIB: [u64; 14] = [4, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 80, 96, 141];

/// "fits a 32 GiB card; not a 24 GiB one" for the larger of the needs.
pub fn card_advice(need: u64) -> String {
    const GIB: u64 = 1 << 30;
    let fits = CARDS_GIB.iter().find(|&&c| c * GIB >= need);
    let not = CARDS_GIB.iter().rev().find(|&&c| c * GIB < need);
    match (fits, not) {
        (Some(f), Some(n)) => format!("fits a {f} GiB card; not a {n} GiB one"),
        (Some(f), None) => format!("fits a {f} GiB card"),
        (None, _) => format!("more than a {} GiB card holds", CARDS_GIB[CARDS_GIB.len() - 1]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn card_advice_names_the_nearest_cards() {
        const GIB: u64 = 1 << 30;
        assert_eq!(card_advice(29 * GIB + GIB / 10), "fits a 32 GiB card; not a 24 GiB one");
        assert_eq!(card_advice(3 * GIB), "fits a 4 GiB card");
        assert_eq!(card_advice(16 * GIB), "fits a 16 GiB card; not a 12 GiB one");
        assert!(card_advice(500 * GIB).starts_with("more than"));
    }

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
        let plan = smallest_capacity(&trace, Policy::Tidepool, "").unwrap();
        assert_eq!(plan.min_capacity, 320 << 20);
    }
}
