//! Counters, peaks and fragmentation of one device heap.
//!
//! Names follow `torch.cuda.memory_stats`: each gauge (`allocated_bytes`,
//! `reserved_bytes`, ...) is kept for `all`, `small_pool` and `large_pool`,
//! each with `current`, `peak`, `allocated` (sum of increases) and `freed`
//! (sum of decreases). `all` is kept, not summed, because peaks do not add.
#![forbid(unsafe_code)]

use crate::size_class::PoolKind;

/// One gauge: its value now, its highest value, and its total ups and downs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stat {
    pub current: u64,
    pub peak: u64,
    pub allocated: u64,
    pub freed: u64,
}

impl Stat {
    #[inline]
    fn increase(&mut self, amount: u64) {
        self.current += amount;
        self.allocated += amount;
        if self.current > self.peak {
            self.peak = self.current;
        }
    }

    #[inline]
    fn decrease(&mut self, amount: u64) {
        debug_assert!(self.current >= amount, "stat would go negative");
        self.current -= amount;
        self.freed += amount;
    }
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

    fn kind_mut(&mut self, kind: PoolKind) -> &mut Stat {
        match kind {
            PoolKind::Small => &mut self.small_pool,
            PoolKind::Large => &mut self.large_pool,
        }
    }

    #[inline]
    pub(crate) fn increase(&mut self, kind: PoolKind, amount: u64) {
        self.all.increase(amount);
        self.kind_mut(kind).increase(amount);
    }

    #[inline]
    pub(crate) fn decrease(&mut self, kind: PoolKind, amount: u64) {
        self.all.decrease(amount);
        self.kind_mut(kind).decrease(amount);
    }

    fn reset_peak(&mut self) {
        for stat in [&mut self.all, &mut self.small_pool, &mut self.large_pool] {
            stat.peak = stat.current;
        }
    }

    fn reset_accumulated(&mut self) {
        for stat in [&mut self.all, &mut self.small_pool, &mut self.large_pool] {
            stat.allocated = 0;
            stat.freed = 0;
        }
    }
}

/// The statistics of one device, as `Allocator::stats` returns them.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Stats {
    /// Live blocks (count).
    pub allocation: StatByPool,
    /// Segments obtained from the driver (count).
    pub segment: StatByPool,
    /// Blocks in use (count); equals `allocation` until deferred frees exist.
    pub active: StatByPool,
    /// Free blocks inside segments that also hold other blocks (count).
    pub inactive_split: StatByPool,
    /// Bytes of live blocks (rounded sizes).
    pub allocated_bytes: StatByPool,
    /// Bytes obtained from the driver.
    pub reserved_bytes: StatByPool,
    /// Bytes of blocks in use.
    pub active_bytes: StatByPool,
    /// Bytes of free blocks inside partly used segments: memory that only
    /// a request fitting the hole can use.
    pub inactive_split_bytes: StatByPool,
    /// Bytes the callers asked for (before rounding).
    pub requested_bytes: StatByPool,

    pub num_allocs: u64,
    pub num_frees: u64,
    pub num_device_alloc: u64,
    pub num_device_free: u64,
    /// Times a failed growth released cache and tried again.
    pub num_alloc_retries: u64,
    /// Requests that failed for lack of memory.
    pub num_ooms: u64,
    /// Frees of pointers that were not live allocations (foreign, double,
    /// interior): refused and counted.
    pub num_invalid_frees: u64,
    /// Frees whose stated size differed from the allocation's (the recorded
    /// size is used).
    pub num_size_mismatches: u64,

    /// Free bytes cached in all pools (reserved minus allocated).
    pub cached_free_bytes: u64,
    /// The largest free block in any pool.
    pub largest_free_block_bytes: u64,
}

impl Stats {
    /// External fragmentation of the cache: `1 - largest free block / free
    /// bytes`; 0 when nothing is cached. Near 1, the cache is many small
    /// holes and a large request needs a new segment despite free memory.
    pub fn external_fragmentation(&self) -> f64 {
        if self.cached_free_bytes == 0 {
            0.0
        } else {
            1.0 - self.largest_free_block_bytes as f64 / self.cached_free_bytes as f64
        }
    }

    /// Sets every peak to its current value (`torch.cuda.reset_peak_memory_stats`).
    pub fn reset_peaks(&mut self) {
        for gauge in self.gauges_mut() {
            gauge.reset_peak();
        }
    }

    /// Zeroes the accumulated counters (`torch.cuda.reset_accumulated_memory_stats`).
    pub fn reset_accumulated(&mut self) {
        for gauge in self.gauges_mut() {
            gauge.reset_accumulated();
        }
        self.num_allocs = 0;
        self.num_frees = 0;
        self.num_device_alloc = 0;
        self.num_device_free = 0;
        self.num_alloc_retries = 0;
        self.num_ooms = 0;
        self.num_invalid_frees = 0;
        self.num_size_mismatches = 0;
    }

    fn gauges_mut(&mut self) -> [&mut StatByPool; 9] {
        [
            &mut self.allocation,
            &mut self.segment,
            &mut self.active,
            &mut self.inactive_split,
            &mut self.allocated_bytes,
            &mut self.reserved_bytes,
            &mut self.active_bytes,
            &mut self.inactive_split_bytes,
            &mut self.requested_bytes,
        ]
    }

    fn gauges(&self) -> [(&'static str, &StatByPool); 9] {
        [
            ("allocation", &self.allocation),
            ("segment", &self.segment),
            ("active", &self.active),
            ("inactive_split", &self.inactive_split),
            ("allocated_bytes", &self.allocated_bytes),
            ("reserved_bytes", &self.reserved_bytes),
            ("active_bytes", &self.active_bytes),
            ("inactive_split_bytes", &self.inactive_split_bytes),
            ("requested_bytes", &self.requested_bytes),
        ]
    }

    /// Every figure under the key `torch.cuda.memory_stats` uses for it
    /// (`allocated_bytes.all.current`, `num_ooms`, ...); tidepool's own
    /// figures are under `tidepool.*`.
    pub fn to_pytorch_keys(&self) -> Vec<(String, u64)> {
        let mut out = Vec::with_capacity(9 * 12 + 12);
        for (name, gauge) in self.gauges() {
            for (pool, stat) in [("all", &gauge.all), ("small_pool", &gauge.small_pool), ("large_pool", &gauge.large_pool)] {
                for (field, value) in
                    [("current", stat.current), ("peak", stat.peak), ("allocated", stat.allocated), ("freed", stat.freed)]
                {
                    out.push((format!("{name}.{pool}.{field}"), value));
                }
            }
        }
        for (key, value) in [
            ("num_alloc_retries", self.num_alloc_retries),
            ("num_ooms", self.num_ooms),
            ("num_device_alloc", self.num_device_alloc),
            ("num_device_free", self.num_device_free),
            ("tidepool.num_allocs", self.num_allocs),
            ("tidepool.num_frees", self.num_frees),
            ("tidepool.num_invalid_frees", self.num_invalid_frees),
            ("tidepool.num_size_mismatches", self.num_size_mismatches),
            ("tidepool.cached_free_bytes", self.cached_free_bytes),
            ("tidepool.largest_free_block_bytes", self.largest_free_block_bytes),
        ] {
            out.push((key.to_string(), value));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn all_keeps_its_own_peak_which_is_not_the_sum_of_pool_peaks() {
        let mut g = StatByPool::default();
        g.increase(PoolKind::Small, 10);
        g.decrease(PoolKind::Small, 10);
        g.increase(PoolKind::Large, 7);
        assert_eq!(g.all.peak, 10);
        assert_eq!(g.small_pool.peak + g.large_pool.peak, 17);
        assert_eq!((g.all.current, g.all.allocated, g.all.freed), (7, 17, 10));
    }

    #[test]
    fn fragmentation_is_zero_without_cache_and_grows_with_holes() {
        let mut s = Stats::default();
        assert_eq!(s.external_fragmentation(), 0.0);
        s.cached_free_bytes = 100;
        s.largest_free_block_bytes = 100;
        assert_eq!(s.external_fragmentation(), 0.0);
        s.largest_free_block_bytes = 25;
        assert_eq!(s.external_fragmentation(), 0.75);
    }

    #[test]
    fn pytorch_keys_cover_every_gauge_pool_and_field() {
        let mut s = Stats::default();
        s.allocated_bytes.increase(PoolKind::Large, 4096);
        s.num_ooms = 2;
        let keys: std::collections::HashMap<_, _> = s.to_pytorch_keys().into_iter().collect();
        assert_eq!(keys["allocated_bytes.all.current"], 4096);
        assert_eq!(keys["allocated_bytes.large_pool.peak"], 4096);
        assert_eq!(keys["allocated_bytes.small_pool.current"], 0);
        assert_eq!(keys["inactive_split_bytes.all.freed"], 0);
        assert_eq!(keys["num_ooms"], 2);
        assert_eq!(keys.len(), 9 * 3 * 4 + 10);
    }

    #[test]
    fn resetting_peaks_keeps_current_values() {
        let mut s = Stats::default();
        s.reserved_bytes.increase(PoolKind::Small, 8);
        s.reserved_bytes.decrease(PoolKind::Small, 6);
        s.reset_peaks();
        assert_eq!(s.reserved_bytes.all.peak, 2);
        assert_eq!(s.reserved_bytes.all.current, 2);
        s.reset_accumulated();
        assert_eq!(s.reserved_bytes.all.allocated, 0);
        assert_eq!(s.reserved_bytes.all.current, 2);
    }
}
