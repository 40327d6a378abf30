//! Counters, peaks and fragmentation of one device heap.
//!
//! Names follow `torch.cuda.memory_stats`: each gauge (`allocated_bytes`,
//! `reserved_bytes`, ...) is reported for `all`, `small_pool` and
//! `large_pool`, each with `current`, `peak`, `allocated` (sum of increases)
//! and `freed` (sum of decreases). The heap keeps them per pool kind in
//! `Counters` and derives `all` when asked, except its peak, which it keeps.
#![forbid(unsafe_code)]

use crate::reclaim::policy::Reason;
use crate::size_class::PoolKind;

/// What releasing cached segments gave back.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Released {
    pub segments: u64,
    pub bytes: u64,
}

impl std::ops::AddAssign for Released {
    fn add_assign(&mut self, other: Released) {
        self.segments += other.segments;
        self.bytes += other.bytes;
    }
}

/// `inactive_split / reserved`, in [0, 1]; 0 when nothing is reserved
/// (the definition of [`Stats::fragmentation`], for figures that come
/// from elsewhere: the registry, a replay's peaks).
pub fn fragmentation(inactive_split: u64, reserved: u64) -> f64 {
    if reserved == 0 {
        0.0
    } else {
        (inactive_split as f64 / reserved as f64).min(1.0)
    }
}

/// One gauge as reported: its value now, its highest value, and its total
/// ups and downs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stat {
    pub current: u64,
    pub peak: u64,
    pub allocated: u64,
    pub freed: u64,
}

/// A gauge for all pools together and for each pool kind.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StatByPool {
    pub all: Stat,
    pub small_pool: Stat,
    pub large_pool: Stat,
}

impl StatByPool {
    pub fn kind(&self, kind: PoolKind) -> &Stat {
        match kind {
            PoolKind::Small => &self.small_pool,
            PoolKind::Large => &self.large_pool,
        }
    }
}

/// A gauge as the heap keeps it on the hot path: per pool kind, `current`,
/// `peak` and `freed`, with `allocated` derived (`current + freed` since the
/// last reset) and `all` derived by summing, except its peak, which is kept
/// (peaks do not add).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Gauge {
    current: [u64; 2],
    peak: [u64; 2],
    freed: [u64; 2],
    all_peak: u64,
    /// `current` and `freed` when accumulated counts were last reset.
    current_at_reset: [u64; 2],
    freed_at_reset: [u64; 2],
}

impl Gauge {
    #[inline]
    pub fn increase(&mut self, kind: PoolKind, amount: u64) {
        let k = kind as usize;
        self.current[k] += amount;
        self.peak[k] = self.peak[k].max(self.current[k]);
        self.all_peak = self.all_peak.max(self.current[0] + self.current[1]);
    }

    #[inline]
    pub fn decrease(&mut self, kind: PoolKind, amount: u64) {
        let k = kind as usize;
        debug_assert!(self.current[k] >= amount, "gauge would go negative");
        self.current[k] -= amount;
        self.freed[k] += amount;
    }

    /// Folds in what was added and taken away elsewhere (a thread's cache,
    /// `heap/lent.rs`) while the peaks were kept from being passed: the
    /// peaks stay.
    pub fn absorb(&mut self, kind: PoolKind, up: u64, down: u64) {
        let k = kind as usize;
        self.current[k] = self.current[k] + up - down;
        self.freed[k] += down;
        debug_assert!(self.current[k] <= self.peak[k] && self.total() <= self.all_peak, "a folded-in gauge passed its peak");
    }

    /// The current value of pool kind `k` (0: small, 1: large).
    pub fn current_of(&self, k: usize) -> u64 {
        self.current[k]
    }

    /// The peak of pool kind `k`.
    pub fn peak_of(&self, k: usize) -> u64 {
        self.peak[k]
    }

    /// The current value over both pool kinds.
    pub fn total(&self) -> u64 {
        self.current[0] + self.current[1]
    }

    /// The peak of the value over both pool kinds.
    pub fn peak_total(&self) -> u64 {
        self.all_peak
    }

    fn reset_peak(&mut self) {
        self.peak = self.current;
        self.all_peak = self.current[0] + self.current[1];
    }

    fn reset_accumulated(&mut self) {
        self.current_at_reset = self.current;
        self.freed_at_reset = self.freed;
    }

    pub fn report(&self) -> StatByPool {
        let stat = |k: usize| {
            let freed = self.freed[k] - self.freed_at_reset[k];
            Stat {
                current: self.current[k],
                peak: self.peak[k],
                // Everything added since the reset: what is here now and
                // what left, less what was here at the reset.
                allocated: self.current[k] + freed - self.current_at_reset[k],
                freed,
            }
        };
        let (small, large) = (stat(0), stat(1));
        StatByPool {
            all: Stat {
                current: small.current + large.current,
                peak: self.all_peak,
                allocated: small.allocated + large.allocated,
                freed: small.freed + large.freed,
            },
            small_pool: small,
            large_pool: large,
        }
    }
}

/// The one list of event counters, passed to `$callback`: each counter's
/// doc, its field in [`Events`], how two heaps' values combine (`sum`, or
/// `last` for a last value: the larger is kept, and resetting the
/// accumulated counts keeps it), its key in [`Stats::to_pytorch_keys`] and
/// Python's `tidepool.memory_stats` (PyTorch's own name, or `tidepool.*`),
/// and its field in the C struct `tidepool_stats`. The struct, its sum, its
/// reset, the keys and the C fill (src/ffi/stats.rs) are generated from it;
/// tests/cabi/header.rs checks ffi/tidepool.h and the Python package
/// against [`Events::COUNTERS`]. A new counter goes here, at the end of
/// `tidepool_stats` (a version bump), in the header, and in
/// ffi/python/tidepool/_native.py (`Stats` and `COUNTERS`).
macro_rules! for_each_counter {
    ($callback:ident) => {
        $callback! {
            /// Driver allocations (segments, or runs of expandable pages).
            num_device_alloc: sum, "num_device_alloc", num_device_allocs;
            /// Driver frees.
            num_device_free: sum, "num_device_free", num_device_frees;
            /// Times a failed growth released cache and tried again.
            num_alloc_retries: sum, "num_alloc_retries", num_alloc_retries;
            /// Requests that failed for lack of memory.
            num_ooms: sum, "num_ooms", num_ooms;
            /// Frees of pointers that were not live allocations (foreign, double,
            /// interior): refused and counted.
            num_invalid_frees: sum, "tidepool.num_invalid_frees", num_invalid_frees;
            /// Frees whose stated size differed from the allocation's (the recorded
            /// size is used).
            num_size_mismatches: sum, "tidepool.num_size_mismatches", num_size_mismatches;
            /// Passes of the reclaimer over this device.
            num_reclaims: sum, "tidepool.num_reclaims", num_reclaims;
            /// Requests for memory posted to the other processes on the device.
            num_coop_requests: sum, "tidepool.num_coop_requests", num_coop_requests;
            /// Of those, the ones that got the memory before `oom_wait_ms`.
            num_coop_satisfied: sum, "tidepool.num_coop_satisfied", num_coop_satisfied;
            /// Other processes' requests this one answered by releasing cache.
            num_coop_served: sum, "tidepool.num_coop_served", num_coop_served;
            /// Milliseconds the last satisfied request waited for the memory.
            coop_last_wait_ms: last, "tidepool.coop_last_wait_ms", coop_last_wait_ms;
            /// Streams of `record_stream` the driver failed to synchronize at free.
            num_stream_sync_errors: sum, "tidepool.num_stream_sync_errors", num_stream_sync_errors;
            /// Requests served, when the device was full, by a block cached for another stream.
            num_cross_stream_reuses: sum, "tidepool.num_cross_stream_reuses", num_cross_stream_reuses;
            /// Pages of expandable segments mapped (`expandable:true`).
            num_pages_mapped: sum, "tidepool.num_pages_mapped", num_pages_mapped;
            /// Pages of expandable segments unmapped.
            num_pages_unmapped: sum, "tidepool.num_pages_unmapped", num_pages_unmapped;
            /// Memory driver calls made on the device, failed ones included:
            /// `cuMemAlloc`/`cuMemFree` (or the stream-ordered pair),
            /// `cuMemAddressReserve`/`cuMemAddressFree`, `cuMemCreate`/`cuMemRelease`,
            /// `cuMemMap`/`cuMemUnmap`, `cuMemSetAccess`. Read from the backend
            /// (`Backend::driver_calls_on`) when statistics are read, less its
            /// value at the last reset: the whole device's in every shard's.
            num_driver_calls: sum, "tidepool.num_driver_calls", num_driver_calls;
        }
    };
}
pub(crate) use for_each_counter;

/// One event counter as each interface names it (see [`Events::COUNTERS`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Counter {
    /// The field of [`Events`].
    pub field: &'static str,
    /// The key in `Stats::to_pytorch_keys` and Python's `memory_stats`.
    pub key: &'static str,
    /// The field of the C struct `tidepool_stats`.
    pub c_field: &'static str,
    /// A last value rather than an accumulation: combined by `max`, kept
    /// by `reset_accumulated`.
    pub last: bool,
}

macro_rules! define_events {
    ($( $(#[doc = $doc:literal])* $field:ident : $how:ident, $key:literal, $c_field:ident; )*) => {
        /// Events a heap counts as they happen: driver calls, failures, releases,
        /// cooperation. Kept whole in `Counters` and reported whole in `Stats`.
        #[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
        pub struct Events {
            $( $(#[doc = $doc])* pub $field: u64, )*
            /// Segments and bytes given back to the driver, by why (index with
            /// `Reason as usize`; see `released()`).
            pub released: [Released; 6],
        }

        impl Events {
            /// Every counter, in the order of the list (`for_each_counter`).
            pub const COUNTERS: [Counter; [$(stringify!($field)),*].len()] = [
                $( Counter { field: stringify!($field), key: $key, c_field: stringify!($c_field), last: define_events!(@last $how) }, )*
            ];

            /// Each counter's value, in the order of [`Events::COUNTERS`].
            pub fn values(&self) -> [u64; Self::COUNTERS.len()] {
                [$(self.$field),*]
            }

            /// Sums `other` into these (a last value: the larger of the two).
            pub(crate) fn add(&mut self, other: &Events) {
                for (into, from) in self.released.iter_mut().zip(other.released) {
                    *into += from;
                }
                $( define_events!(@add $how, self.$field, other.$field); )*
            }

            /// These with every accumulation zeroed; last values stay.
            pub(crate) fn accumulations_reset(&self) -> Events {
                Events { $( $field: define_events!(@reset $how, self.$field), )* released: Default::default() }
            }
        }
    };
    (@last sum) => { false };
    (@last last) => { true };
    (@add sum, $into:expr, $from:expr) => { $into += $from };
    (@add last, $into:expr, $from:expr) => { $into = $into.max($from) };
    (@reset sum, $value:expr) => { 0 };
    (@reset last, $value:expr) => { $value };
}

for_each_counter!(define_events);

/// Everything a heap counts, in the form it updates cheaply.
#[derive(Clone, Debug, Default)]
pub(crate) struct Counters {
    pub allocation: Gauge,
    pub segment: Gauge,
    pub inactive_split: Gauge,
    pub allocated_bytes: Gauge,
    pub reserved_bytes: Gauge,
    pub inactive_split_bytes: Gauge,
    pub requested_bytes: Gauge,
    /// Blocks freed by their caller but waiting for other streams' work:
    /// active, no longer allocated (as in PyTorch).
    pub pending: Gauge,
    pub pending_bytes: Gauge,
    active_peaks: [Peaks; 2],
    pub events: Events,
}

/// Peaks of active blocks and bytes (allocated + pending) reached while
/// blocks were pending. The rest of the time active equals allocated, so
/// active's peak is the larger of these and allocated's: the hot path never
/// counts active memory, and only notes these while blocks are pending.
#[derive(Clone, Copy, Debug, Default)]
struct Peaks {
    per_kind: [u64; 2],
    all: u64,
}

impl Peaks {
    fn note(&mut self, allocated: &Gauge, pending: &Gauge) {
        let current = [0, 1].map(|k| allocated.current[k] + pending.current[k]);
        self.per_kind = [0, 1].map(|k| self.per_kind[k].max(current[k]));
        self.all = self.all.max(current[0] + current[1]);
    }

    /// Active as reported: allocated plus pending, with these peaks.
    fn active(&self, allocated: &Gauge, pending: &Gauge) -> StatByPool {
        let (allocated, pending) = (allocated.report(), pending.report());
        // Active grows only as blocks are allocated, and shrinks as they are
        // freed, except for those that went pending and are still pending.
        let stat = |a: &Stat, p: &Stat, peak: u64| Stat {
            current: a.current + p.current,
            peak: a.peak.max(peak),
            allocated: a.allocated,
            freed: a.freed + p.freed - p.allocated,
        };
        StatByPool {
            all: stat(&allocated.all, &pending.all, self.all),
            small_pool: stat(&allocated.small_pool, &pending.small_pool, self.per_kind[0]),
            large_pool: stat(&allocated.large_pool, &pending.large_pool, self.per_kind[1]),
        }
    }
}

impl Counters {
    fn gauges_mut(&mut self) -> [&mut Gauge; 9] {
        [
            &mut self.allocation,
            &mut self.segment,
            &mut self.inactive_split,
            &mut self.allocated_bytes,
            &mut self.reserved_bytes,
            &mut self.inactive_split_bytes,
            &mut self.requested_bytes,
            &mut self.pending,
            &mut self.pending_bytes,
        ]
    }

    /// Notes the peaks of active memory; called on each allocation made while blocks are pending.
    pub fn note_active_peaks(&mut self) {
        self.active_peaks[0].note(&self.allocation, &self.pending);
        self.active_peaks[1].note(&self.allocated_bytes, &self.pending_bytes);
    }

    /// Sets every peak to its current value (`torch.cuda.reset_peak_memory_stats`).
    pub fn reset_peaks(&mut self) {
        for gauge in self.gauges_mut() {
            gauge.reset_peak();
        }
        self.active_peaks = Default::default();
        self.note_active_peaks();
    }

    /// Zeroes the accumulated counters (`torch.cuda.reset_accumulated_memory_stats`).
    pub fn reset_accumulated(&mut self) {
        for gauge in self.gauges_mut() {
            gauge.reset_accumulated();
        }
        // Last values (`coop_last_wait_ms`) are not accumulations: they stay.
        self.events = self.events.accumulations_reset();
    }

    /// The public statistics; the cache figures are the caller's to fill.
    pub fn report(&self) -> Stats {
        let allocation = self.allocation.report();
        Stats {
            allocation,
            segment: self.segment.report(),
            active: self.active_peaks[0].active(&self.allocation, &self.pending),
            inactive_split: self.inactive_split.report(),
            allocated_bytes: self.allocated_bytes.report(),
            reserved_bytes: self.reserved_bytes.report(),
            active_bytes: self.active_peaks[1].active(&self.allocated_bytes, &self.pending_bytes),
            inactive_split_bytes: self.inactive_split_bytes.report(),
            requested_bytes: self.requested_bytes.report(),
            // Every allocation adds one to `allocation`, every free takes one.
            num_allocs: allocation.all.allocated,
            num_frees: allocation.all.freed,
            events: self.events,
            cached_free_bytes: 0,
            largest_free_block_bytes: 0,
            paused_bytes: 0,
            offloaded_bytes: 0,
        }
    }
}

/// Generates [`Stats`] from its list of gauges (PyTorch's names, in
/// PyTorch's order), with [`Stats::GAUGES`], `gauges()` and `gauges_mut()`.
/// tests/cabi/header.rs checks the C struct's `gauges` array, the header's
/// list of them and Python's `GAUGES` against [`Stats::GAUGES`].
macro_rules! define_stats {
    ($( $(#[doc = $doc:literal])* $gauge:ident, )*) => {
        /// The statistics of one device, as `Allocator::stats` returns them.
        #[derive(Clone, Debug, Default, PartialEq)]
        pub struct Stats {
            $( $(#[doc = $doc])* pub $gauge: StatByPool, )*

            pub num_allocs: u64,
            pub num_frees: u64,
            /// Everything counted as it happened.
            pub events: Events,

            /// Free bytes cached in all pools (reserved minus allocated).
            pub cached_free_bytes: u64,
            /// The largest free block in any pool.
            pub largest_free_block_bytes: u64,
            /// Device memory given back by paused tags (their addresses stay reserved).
            pub paused_bytes: u64,
            /// Host memory holding paused tags' contents (pauses with offload).
            pub offloaded_bytes: u64,
        }

        impl Stats {
            /// The gauges under PyTorch's names, in PyTorch's order (that of
            /// `tidepool_stats.gauges` in C).
            pub const GAUGES: [&'static str; [$(stringify!($gauge)),*].len()] = [$(stringify!($gauge)),*];

            /// The gauges under PyTorch's names, in PyTorch's order.
            pub fn gauges(&self) -> [(&'static str, &StatByPool); Self::GAUGES.len()] {
                [$((stringify!($gauge), &self.$gauge)),*]
            }

            pub(crate) fn gauges_mut(&mut self) -> [(&'static str, &mut StatByPool); Self::GAUGES.len()] {
                [$((stringify!($gauge), &mut self.$gauge)),*]
            }
        }
    };
}

define_stats! {
    /// Live blocks (count).
    allocation,
    /// Segments obtained from the driver (count).
    segment,
    /// Blocks in use (count); equals `allocation` until deferred frees exist.
    active,
    /// Free blocks inside segments that also hold other blocks (count).
    inactive_split,
    /// Bytes of live blocks (rounded sizes).
    allocated_bytes,
    /// Bytes obtained from the driver.
    reserved_bytes,
    /// Bytes of blocks in use.
    active_bytes,
    /// Bytes of free blocks inside partly used segments: memory that only
    /// a request fitting the hole can use.
    inactive_split_bytes,
    /// Bytes the callers asked for (before rounding).
    requested_bytes,
}

impl Stats {
    /// The figures of several heaps of one device as one: every count and
    /// current value summed, peaks summed too (an upper bound: the heaps
    /// may peak at different times), the largest free block the largest.
    pub fn combine(parts: &[Stats]) -> Stats {
        let Some((first, rest)) = parts.split_first() else {
            return Stats::default();
        };
        let mut total = first.clone();
        for part in rest {
            for ((_, into), (_, from)) in total.gauges_mut().into_iter().zip(part.gauges()) {
                for (a, b) in
                    [(&mut into.all, &from.all), (&mut into.small_pool, &from.small_pool), (&mut into.large_pool, &from.large_pool)]
                {
                    a.current += b.current;
                    a.peak += b.peak;
                    a.allocated += b.allocated;
                    a.freed += b.freed;
                }
            }
            total.events.add(&part.events);
            total.num_allocs += part.num_allocs;
            total.num_frees += part.num_frees;
            total.cached_free_bytes += part.cached_free_bytes;
            total.largest_free_block_bytes = total.largest_free_block_bytes.max(part.largest_free_block_bytes);
            total.paused_bytes += part.paused_bytes;
            total.offloaded_bytes += part.offloaded_bytes;
        }
        total
    }

    /// What was given back for `reason`.
    pub fn released(&self, reason: Reason) -> Released {
        self.events.released[reason as usize]
    }

    /// Fragmentation: the share of reserved bytes that are free but stuck
    /// inside partly used segments (`inactive_split_bytes / reserved_bytes`,
    /// now); 0 when nothing is reserved. This is memory that can neither go
    /// back to the driver (its segment holds live blocks) nor serve a request
    /// larger than its hole: what `expandable:true` or `max_split_size_mb`
    /// act on. Whole free segments do not count: they are releasable at once
    /// (`empty_cache`, the reclaimer, a request from another process). The
    /// one meaning of "fragmentation" in tidepool: statistics, the OOM
    /// report, `tidepool top`, replay and the exporter.
    pub fn fragmentation(&self) -> f64 {
        fragmentation(self.inactive_split_bytes.all.current, self.reserved_bytes.all.current)
    }

    /// Every figure under the key `torch.cuda.memory_stats` uses for it
    /// (`allocated_bytes.all.current`, `num_ooms`, ...); tidepool's own
    /// figures are under `tidepool.*`.
    pub fn to_pytorch_keys(&self) -> Vec<(String, u64)> {
        let mut out = Vec::with_capacity(Self::GAUGES.len() * 12 + Events::COUNTERS.len() + 6 + 2 * Reason::ALL.len());
        for (name, gauge) in self.gauges() {
            for (pool, stat) in [("all", &gauge.all), ("small_pool", &gauge.small_pool), ("large_pool", &gauge.large_pool)] {
                for (field, value) in [("current", stat.current), ("peak", stat.peak), ("allocated", stat.allocated), ("freed", stat.freed)]
                {
                    out.push((format!("{name}.{pool}.{field}"), value));
                }
            }
        }
        for (counter, value) in Events::COUNTERS.iter().zip(self.events.values()) {
            out.push((counter.key.to_string(), value));
        }
        for (key, value) in [
            ("tidepool.num_allocs", self.num_allocs),
            ("tidepool.num_frees", self.num_frees),
            ("tidepool.cached_free_bytes", self.cached_free_bytes),
            ("tidepool.largest_free_block_bytes", self.largest_free_block_bytes),
            ("tidepool.paused_bytes", self.paused_bytes),
            ("tidepool.offloaded_bytes", self.offloaded_bytes),
        ] {
            out.push((key.to_string(), value));
        }
        for reason in Reason::ALL {
            let released = self.released(reason);
            out.push((format!("tidepool.released_bytes.{}", reason.name()), released.bytes));
            out.push((format!("tidepool.released_segments.{}", reason.name()), released.segments));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn all_keeps_its_own_peak_which_is_not_the_sum_of_pool_peaks() {
        let mut g = Gauge::default();
        g.increase(PoolKind::Small, 10);
        g.decrease(PoolKind::Small, 10);
        g.increase(PoolKind::Large, 7);
        let r = g.report();
        assert_eq!(r.all.peak, 10);
        assert_eq!(r.small_pool.peak + r.large_pool.peak, 17);
        assert_eq!((r.all.current, r.all.allocated, r.all.freed), (7, 17, 10));
    }

    /// Drives the counters as the heap does: allocate (with the peak note
    /// while frees are pending), free (count), go pending, complete.
    fn allocate(c: &mut Counters, bytes: u64) {
        c.allocation.increase(PoolKind::Large, 1);
        c.allocated_bytes.increase(PoolKind::Large, bytes);
        if c.pending.total() > 0 {
            c.note_active_peaks();
        }
    }

    fn free(c: &mut Counters, bytes: u64, pending: bool) {
        c.allocation.decrease(PoolKind::Large, 1);
        c.allocated_bytes.decrease(PoolKind::Large, bytes);
        if pending {
            c.pending.increase(PoolKind::Large, 1);
            c.pending_bytes.increase(PoolKind::Large, bytes);
        }
    }

    fn complete(c: &mut Counters, bytes: u64) {
        c.pending.decrease(PoolKind::Large, 1);
        c.pending_bytes.decrease(PoolKind::Large, bytes);
    }

    #[test]
    fn active_is_allocated_plus_pending_with_its_own_peak_and_totals() {
        let mut c = Counters::default();
        allocate(&mut c, 100);
        free(&mut c, 100, true); // pending: active stays 100
        allocate(&mut c, 30); // active 130 while allocated is 30
        let s = c.report();
        assert_eq!((s.allocated_bytes.all.current, s.allocated_bytes.all.peak), (30, 100));
        assert_eq!((s.active_bytes.all.current, s.active_bytes.all.peak), (130, 130));
        assert_eq!((s.active.all.current, s.active.all.allocated, s.active.all.freed), (2, 2, 0));
        c.reset_accumulated();
        complete(&mut c, 100);
        free(&mut c, 30, false);
        let s = c.report();
        assert_eq!((s.active_bytes.all.current, s.active_bytes.all.allocated, s.active_bytes.all.freed), (0, 0, 130));
        assert_eq!(s.active_bytes.large_pool.freed, 130);
        c.reset_peaks();
        assert_eq!(c.report().active_bytes.all.peak, 0);
        allocate(&mut c, 10);
        assert_eq!(c.report().active_bytes.all.peak, 10, "without pending frees active's peak is allocated's");
    }

    #[test]
    fn fragmentation_is_the_share_of_reserved_stuck_in_partly_used_segments() {
        let mut s = Stats::default();
        assert_eq!(s.fragmentation(), 0.0, "nothing reserved");
        s.reserved_bytes.all.current = 100;
        s.cached_free_bytes = 90;
        s.largest_free_block_bytes = 10;
        assert_eq!(s.fragmentation(), 0.0, "free memory in whole segments is releasable: not fragmentation");
        s.inactive_split_bytes.all.current = 25;
        assert_eq!(s.fragmentation(), 0.25);
        assert_eq!(fragmentation(7, 0), 0.0);
        assert_eq!(fragmentation(u64::MAX, 1), 1.0, "a corrupt figure stays a ratio");
    }

    #[test]
    fn pytorch_keys_cover_every_gauge_pool_and_field() {
        let mut c = Counters::default();
        c.allocated_bytes.increase(PoolKind::Large, 4096);
        c.events.num_ooms = 2;
        let keys: std::collections::HashMap<_, _> = c.report().to_pytorch_keys().into_iter().collect();
        assert_eq!(keys["allocated_bytes.all.current"], 4096);
        assert_eq!(keys["allocated_bytes.large_pool.peak"], 4096);
        assert_eq!(keys["allocated_bytes.small_pool.current"], 0);
        assert_eq!(keys["inactive_split_bytes.all.freed"], 0);
        assert_eq!(keys["num_ooms"], 2);
        assert_eq!(keys.len(), 9 * 3 * 4 + 16 + 6 + 12);
        for counter in Events::COUNTERS {
            assert!(keys.contains_key(counter.key), "{} has no key", counter.field);
        }
    }

    #[test]
    fn the_counter_list_names_each_counter_once_in_every_interface() {
        for (what, names) in [
            ("field", Events::COUNTERS.map(|c| c.field)),
            ("key", Events::COUNTERS.map(|c| c.key)),
            ("C field", Events::COUNTERS.map(|c| c.c_field)),
        ] {
            let unique: std::collections::BTreeSet<_> = names.iter().collect();
            assert_eq!(unique.len(), names.len(), "a {what} repeats: {names:?}");
        }
        // PyTorch's own counters under PyTorch's names, tidepool's under `tidepool.*`.
        let pytorch = ["num_device_alloc", "num_device_free", "num_alloc_retries", "num_ooms"];
        for counter in Events::COUNTERS {
            let key = if pytorch.contains(&counter.field) { counter.field.to_string() } else { format!("tidepool.{}", counter.field) };
            assert_eq!(counter.key, key);
        }
    }

    /// Events whose every counter is `scale` times its place in the list (1-based).
    fn events_scaled(scale: u64) -> Events {
        let mut events = Events::default();
        let mut next = 0;
        macro_rules! set {
            ($( $(#[doc = $doc:literal])* $field:ident : $how:ident, $key:literal, $c_field:ident; )*) => {
                $( next += scale; events.$field = next; )*
            };
        }
        for_each_counter!(set);
        events
    }

    #[test]
    fn combining_sums_every_counter_and_keeps_the_larger_last_value() {
        let (a, b) = (events_scaled(1), events_scaled(10));
        let parts = [a, b].map(|events| Stats { events, ..Stats::default() });
        let combined = Stats::combine(&parts).events.values();
        for (i, counter) in Events::COUNTERS.iter().enumerate() {
            let expected = if counter.last { b.values()[i] } else { a.values()[i] + b.values()[i] };
            assert_eq!(combined[i], expected, "{}", counter.field);
        }
        let mut c = Counters { events: b, ..Counters::default() };
        c.reset_accumulated();
        for (counter, value) in Events::COUNTERS.iter().zip(c.report().events.values()) {
            assert_eq!(value != 0, counter.last, "{} after reset_accumulated: {value}", counter.field);
        }
    }

    #[test]
    fn resetting_peaks_keeps_current_values() {
        let mut c = Counters::default();
        c.reserved_bytes.increase(PoolKind::Small, 8);
        c.reserved_bytes.decrease(PoolKind::Small, 6);
        c.reset_peaks();
        let r = c.report().reserved_bytes;
        assert_eq!((r.all.peak, r.all.current, r.small_pool.peak), (2, 2, 2));
        c.events.num_cross_stream_reuses = 3;
        c.events.coop_last_wait_ms = 40;
        c.reset_accumulated();
        let r = c.report().reserved_bytes;
        assert_eq!((r.all.allocated, r.all.current), (0, 2));
        let e = c.report().events;
        assert_eq!((e.num_cross_stream_reuses, e.coop_last_wait_ms), (0, 40), "counts reset, the last wait stays");
    }
}
