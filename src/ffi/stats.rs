//! Statistics through the C ABI: `tidepool_stats` filled from `Stats`
//! (every counter from the one list in src/stats.rs), and their resets.

use std::ffi::c_int;

use super::boundary::{allocator_or_internal, boundary, device_index, failure, return_code, Failure, TIDEPOOL_ERR_INTERNAL};
use super::types::{copy_prefix, tidepool_stat, tidepool_stat_by_pool, tidepool_stats, versioned_size, TIDEPOOL_STATS_VERSION};
use crate::allocator::Allocator;
use crate::error::AllocError;
use crate::reclaim::policy::Reason;
use crate::stats::{for_each_counter, Events, Stat, StatByPool, Stats};

fn c_stat(stat: &Stat) -> tidepool_stat {
    tidepool_stat { current: stat.current, peak: stat.peak, allocated: stat.allocated, freed: stat.freed }
}

fn c_gauge(gauge: &StatByPool) -> tidepool_stat_by_pool {
    tidepool_stat_by_pool { all: c_stat(&gauge.all), small_pool: c_stat(&gauge.small_pool), large_pool: c_stat(&gauge.large_pool) }
}

fn c_stats(s: &Stats, reserved_limit: Option<u64>) -> tidepool_stats {
    let mut gauges = [tidepool_stat_by_pool::default(); 9];
    for (slot, (_, gauge)) in gauges.iter_mut().zip(s.gauges()) {
        *slot = c_gauge(gauge);
    }
    tidepool_stats {
        size: std::mem::size_of::<tidepool_stats>() as u32,
        version: TIDEPOOL_STATS_VERSION,
        allocated_bytes: s.allocated_bytes.all.current,
        peak_allocated_bytes: s.allocated_bytes.all.peak,
        requested_bytes: s.requested_bytes.all.current,
        peak_requested_bytes: s.requested_bytes.all.peak,
        reserved_bytes: s.reserved_bytes.all.current,
        peak_reserved_bytes: s.reserved_bytes.all.peak,
        active_bytes: s.active_bytes.all.current,
        peak_active_bytes: s.active_bytes.all.peak,
        inactive_split_bytes: s.inactive_split_bytes.all.current,
        peak_inactive_split_bytes: s.inactive_split_bytes.all.peak,
        largest_free_block_bytes: s.largest_free_block_bytes,
        cached_free_bytes: s.cached_free_bytes,
        num_allocs: s.num_allocs,
        num_frees: s.num_frees,
        reserved_limit_bytes: reserved_limit.unwrap_or(0),
        has_reserved_limit: reserved_limit.is_some() as u64,
        gauges,
        released_idle_decay_bytes: s.released(Reason::IdleDecay).bytes,
        released_budget_bytes: s.released(Reason::Budget).bytes,
        released_headroom_bytes: s.released(Reason::Headroom).bytes,
        released_out_of_memory_bytes: s.released(Reason::OutOfMemory).bytes,
        released_empty_cache_bytes: s.released(Reason::EmptyCache).bytes,
        released_cooperation_bytes: s.released(Reason::Cooperation).bytes,
        paused_bytes: s.paused_bytes,
        offloaded_bytes: s.offloaded_bytes,
        ..fill_counters(&s.events)
    }
}

/// `tidepool_stats` with every event counter filled from the one list
/// (`for_each_counter` in src/stats.rs): a counter with no field in the
/// struct does not compile. (`c_stats` fills the rest; the test
/// `every_field_of_tidepool_stats_is_filled` sees that no field is left.)
macro_rules! c_counters {
    ($( $(#[doc = $doc:literal])* $field:ident : $how:ident, $key:literal, $c_field:ident; )*) => {
        fn fill_counters(events: &Events) -> tidepool_stats {
            tidepool_stats { $( $c_field: events.$field, )* ..tidepool_stats::default() }
        }
    };
}
for_each_counter!(c_counters);

// `tidepool_stats.gauges` holds `Stats::GAUGES` in order; their number is ABI.
const _: () = assert!(Stats::GAUGES.len() == 9);

/// The size of version 1 of `tidepool_stats`: the smallest `size` accepted.
/// Later versions append fields, so this stays as it is.
const STATS_V1_SIZE: usize = 1040;
const _: () = assert!(std::mem::size_of::<tidepool_stats>() >= STATS_V1_SIZE);

/// Fills `*out` with the statistics of `device`. Returns TIDEPOOL_OK, or
/// TIDEPOOL_ERR_INVALID_ARGUMENT (NULL `out`, `out->size` too small),
/// TIDEPOOL_ERR_INVALID_DEVICE, TIDEPOOL_ERR_INTERNAL.
#[no_mangle]
pub extern "C" fn tidepool_get_stats(device: c_int, out: *mut tidepool_stats) -> c_int {
    boundary!(TIDEPOOL_ERR_INTERNAL, return_code(get_stats(device, out)))
}

fn get_stats(device: c_int, out: *mut tidepool_stats) -> Result<(), Failure> {
    let n = versioned_size(out, STATS_V1_SIZE, "tidepool_get_stats")?;
    let allocator = allocator_or_internal()?;
    let device = device_index(device).map_err(failure)?;
    let stats = allocator.stats(device).map_err(failure)?;
    let limit = allocator.device(device).ok().and_then(|d| d.reserved_limit());
    let mut filled = c_stats(&stats, limit);
    filled.size = n as u32;
    // SAFETY: `n` is `versioned_size(out, ..)`'s.
    unsafe { copy_prefix(&filled, out, n) };
    Ok(())
}

/// Resets the peaks of `device` (-1: every device) to the current values
/// (`torch.cuda.reset_peak_memory_stats`). Returns TIDEPOOL_OK,
/// TIDEPOOL_ERR_INVALID_DEVICE or TIDEPOOL_ERR_INTERNAL.
#[no_mangle]
pub extern "C" fn tidepool_reset_peak_stats(device: c_int) -> c_int {
    boundary!(TIDEPOOL_ERR_INTERNAL, return_code(reset_stats(device, Allocator::reset_peak_stats)))
}

/// Zeroes what `device` (-1: every device) accumulated: each gauge's
/// allocated and freed sums and the event counters
/// (`torch.cuda.reset_accumulated_memory_stats`). Returns TIDEPOOL_OK,
/// TIDEPOOL_ERR_INVALID_DEVICE or TIDEPOOL_ERR_INTERNAL.
#[no_mangle]
pub extern "C" fn tidepool_reset_accumulated_stats(device: c_int) -> c_int {
    boundary!(TIDEPOOL_ERR_INTERNAL, return_code(reset_stats(device, Allocator::reset_accumulated_stats)))
}

/// Applies `reset` to `device`, or to every device for -1.
fn reset_stats(device: c_int, reset: fn(&Allocator, usize) -> Result<(), AllocError>) -> Result<(), Failure> {
    let allocator = allocator_or_internal()?;
    let devices = match device {
        -1 => 0..allocator.device_count(),
        _ => {
            let device = device_index(device).map_err(failure)?;
            device..device + 1
        }
    };
    for device in devices {
        reset(allocator, device).map_err(failure)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stats::Released;

    /// A `Stats` whose every figure, gauge and counter is non-zero and
    /// distinct.
    fn every_figure_set() -> Stats {
        let mut s = Stats::default();
        let mut next = 0u64;
        let mut value = || {
            next += 1;
            next
        };
        for (_, gauge) in s.gauges_mut() {
            for stat in [&mut gauge.all, &mut gauge.small_pool, &mut gauge.large_pool] {
                *stat = Stat { current: value(), peak: value(), allocated: value(), freed: value() };
            }
        }
        macro_rules! set_counters {
            ($( $(#[doc = $doc:literal])* $field:ident : $how:ident, $key:literal, $c_field:ident; )*) => {
                $( s.events.$field = value(); )*
            };
        }
        for_each_counter!(set_counters);
        for released in &mut s.events.released {
            *released = Released { segments: value(), bytes: value() };
        }
        (s.num_allocs, s.num_frees, s.cached_free_bytes, s.largest_free_block_bytes) = (value(), value(), value(), value());
        (s.paused_bytes, s.offloaded_bytes) = (value(), value());
        s
    }

    #[test]
    fn every_field_of_tidepool_stats_is_filled() {
        let s = every_figure_set();
        let filled = c_stats(&s, Some(u64::MAX));
        assert_eq!((filled.size as usize, filled.version), (std::mem::size_of::<tidepool_stats>(), TIDEPOOL_STATS_VERSION));
        // After `size` and `version`, the struct is u64 words only.
        const WORDS: usize = (std::mem::size_of::<tidepool_stats>() - 8) / 8;
        // SAFETY: tidepool_stats is repr(C): two u32, then u64 fields and
        // arrays of structs of u64, with no padding.
        let words: [u64; WORDS] = unsafe { std::ptr::read_unaligned((&filled as *const tidepool_stats as *const u8).add(8) as *const _) };
        for (index, word) in words.iter().enumerate() {
            assert_ne!(*word, 0, "word {index} of tidepool_stats (byte {}) is not filled by c_stats", 8 + 8 * index);
        }
        for (counter, value) in Events::COUNTERS.iter().zip(s.events.values()) {
            assert!(words.contains(&value), "{} is not in tidepool_stats", counter.field);
        }
    }
}
