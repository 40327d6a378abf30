//! One GPU: the heaps of its stream shards and the routing of streams to
//! them, the device's reserved count and cap (shared by the shards), this
//! process's registry slot and cooperation with the other processes (asked
//! from whichever shard fails), and the device's figures over all shards.
//!
//! Invariants, checked by `validate()` (with every shard locked):
//! - each shard's heap is valid (`heap/mod.rs`);
//! - the device's reserved count equals the sum of its shards' reserved
//!   bytes, and its peak is at least that.
#![forbid(unsafe_code)]

use std::sync::Arc;

use crate::sync::Mutex;

use crate::backend::Backend;
use crate::cache_slot::CacheSlot;
use crate::config::Config;
use crate::cooperation::Cooperation;
use crate::error::AllocError;
use crate::heap::history::HistoryEntry;
use crate::heap::private::PrivatePoolId;
use crate::heap::reserve::Reserve;

use crate::heap::{DeviceHeap, FreedOrLent, SegmentSnapshot, TagStats, Totals};
use crate::reclaim::policy::Reason;
use crate::reclaim::Clock;
use crate::recording::Recorder;
use crate::registry::Entry;
use crate::stats::{Released, Stats};
use crate::tag::TagId;
use crate::types::{DevicePtr, Stream};

/// Everything tidepool keeps for one GPU.
pub struct Device {
    index: usize,
    /// One heap per stream shard (`stream_shards`), each behind its own lock.
    shards: Box<[Mutex<DeviceHeap>]>,
    reserve: Arc<Reserve>,
    cooperation: Option<Cooperation>,
    backend: Arc<dyn Backend>,
}

impl Device {
    /// Device `index` of `backend`, configured by `config`.
    pub(crate) fn new(
        index: usize,
        config: &Config,
        backend: &Arc<dyn Backend>,
        clock: &Arc<Clock>,
        recorder: Option<&Arc<Recorder>>,
    ) -> Device {
        let reserve = Arc::new(Reserve::default());
        let shards = (0..config.stream_shards.max(1))
            .map(|shard| {
                let mut heap = DeviceHeap::new(index, config.rules.clone(), backend.clone());
                heap.share_reserve(reserve.clone());
                heap.set_stash(config.stash);
                heap.set_cross_stream_reuse(config.lend_across_streams);
                // On by default where the backend maps pages; a device that
                // cannot (an old driver) says so and keeps whole segments.
                let expandable = config.expandable && backend.maps_pages();
                let expandable = heap.set_expandable(expandable).and_then(|()| match config.expandable_page {
                    Some(page) if expandable => heap.set_expandable_page(page),
                    _ => Ok(()),
                });
                if let Err(err) = expandable {
                    if shard == 0 {
                        crate::log::log_line(format_args!("tidepool: warning: device {index}: {err}"));
                    }
                }
                heap.set_max_allocation(config.expandable_allocation);
                heap.set_split_allocations(config.expandable_split_allocations);
                heap.set_move_pages(config.move_pages);
                heap.set_policy(config.policy(), clock.clone());
                heap.record_history(Some(config.history_entries));
                if let Some(recorder) = recorder {
                    heap.record_to(recorder.clone());
                }
                Mutex::new(heap)
            })
            .collect();
        let cooperation = Cooperation::join(config, backend.as_ref(), index);
        Device { index, shards, reserve, cooperation, backend: backend.clone() }
    }

    /// Whether this device shares its memory with other processes' allocators.
    pub fn cooperates(&self) -> bool {
        self.cooperation.is_some()
    }

    /// The heap serving `stream`.
    #[inline(always)]
    pub(crate) fn shard(&self, stream: Stream) -> &Mutex<DeviceHeap> {
        if self.shards.len() == 1 {
            return &self.shards[0];
        }
        let mixed = stream.0 ^ (stream.0 >> 7) ^ (stream.0 >> 17);
        &self.shards[(mixed % self.shards.len() as u64) as usize]
    }

    /// Runs `f` on the heap holding the block `ptr`, locked once:
    /// `stream`'s heap first, then the others; if none holds such a block,
    /// the heap whose segments hold the address, else `stream`'s (which
    /// then reports the bad pointer: a double free, an interior or a
    /// foreign pointer).
    #[inline(always)]
    pub(crate) fn with_owner<R>(&self, ptr: DevicePtr, stream: Stream, f: impl FnOnce(&mut DeviceHeap) -> R) -> R {
        let first = self.shard(stream);
        {
            let mut heap = first.lock();
            if self.shards.len() == 1 || heap.owns(ptr.0) {
                return f(&mut heap);
            }
        }
        for other in self.shards.iter().filter(|h| !std::ptr::eq(*h, first)) {
            let mut heap = other.lock();
            if heap.owns(ptr.0) {
                return f(&mut heap);
            }
        }
        let holder = self.shards.iter().find(|h| h.lock().holds(ptr.0)).unwrap_or(first);
        f(&mut holder.lock())
    }

    /// The out-of-memory ladder, run here and nowhere else: `attempt` (an
    /// allocation or a resume on `heap`, a shard of this device) found the
    /// heap exhausted. The heap's cache goes back and the attempt runs again
    /// (a retry, counted once as PyTorch counts `num_alloc_retries`); then
    /// the other shards' cache; then the other processes are asked for what
    /// the last failure says they would have to give back, and the attempt
    /// runs as they answer. A request that still fails is one out-of-memory,
    /// counted once; an allocation (`failed_allocation`: its size and
    /// stream) is recorded too.
    #[cold]
    pub(crate) fn after_oom<T>(
        &self,
        heap: &Mutex<DeviceHeap>,
        mut attempt: impl FnMut(&mut DeviceHeap) -> Result<T, AllocError>,
        failed_allocation: Option<(u64, Stream)>,
    ) -> Result<T, AllocError> {
        {
            let mut locked = heap.lock();
            locked.count_alloc_retry();
            locked.release_free_segments(Reason::OutOfMemory, |_, _| true);
        }
        let mut retry = || attempt(&mut heap.lock());
        let out_of_memory = |result: &Result<T, AllocError>| matches!(result, Err(AllocError::OutOfMemory(_)));
        let mut result = retry();
        if out_of_memory(&result) && self.shards.len() > 1 {
            for other in self.shards.iter().filter(|h| !std::ptr::eq(*h, heap)) {
                other.lock().release_free_segments(Reason::OutOfMemory, |_, _| true);
            }
            result = retry();
        }
        if let (Err(AllocError::OutOfMemory(report)), Some(cooperation)) = (&result, self.cooperation.as_ref()) {
            let need = report.need_from_others;
            if need > 0 {
                if let Some(answered) = cooperation.ask_and_retry(need, &mut retry) {
                    result = answered;
                }
            }
        }
        if out_of_memory(&result) {
            heap.lock().count_oom(failed_allocation);
        }
        result
    }

    /// One reclaimer pass: each shard applies the release policy; then the
    /// device's figures are published to the other processes, and if one
    /// of them asks for memory, every shard gives back its idle cache.
    pub fn reclaim(&self) -> Released {
        let mut released = Released::default();
        for heap in self.shards.iter() {
            released += heap.lock().reclaim();
        }
        if let Some(cooperation) = &self.cooperation {
            let entry = self.registry_entry();
            released += cooperation.publish_and_answer(entry, || self.release_free_segments(Reason::Cooperation));
        }
        released
    }

    /// What the other processes see of this device.
    fn registry_entry(&self) -> Entry {
        let stats = self.stats();
        let info = self.backend.mem_info(self.index).ok();
        Entry {
            device: self.index as u32,
            reserved: stats.reserved_bytes.all.current,
            allocated: stats.allocated_bytes.all.current,
            cached_free: stats.cached_free_bytes,
            inactive_split: stats.inactive_split_bytes.all.current,
            largest_free_block: stats.largest_free_block_bytes,
            requests_served: stats.events.num_coop_served,
            requests_posted: stats.events.num_coop_requests,
            ooms: stats.events.num_ooms,
            device_total: info.map_or(0, |i| i.total),
            device_free: info.map_or(0, |i| i.free),
            paused: stats.paused_bytes,
            released: Reason::ALL.map(|r| stats.released(r).bytes),
            driver_calls: stats.events.num_driver_calls,
            ..Entry::default()
        }
    }

    /// Releases every whole free segment (and free page) of every shard.
    pub(crate) fn release_free_segments(&self, reason: Reason) -> Released {
        let mut total = Released::default();
        for heap in self.shards.iter() {
            total += heap.lock().release_free_segments(reason, |_, _| true);
        }
        total
    }

    /// The device's statistics: with stream shards, each figure is the sum
    /// over the shards, so a peak is an upper bound of the device's (the
    /// shards may peak at different times), except the peak of all reserved
    /// bytes (small and large pools together), which the shards' shared
    /// count keeps for the device, and the driver calls, which each shard
    /// reads whole from the backend (the latest read, the largest, is kept).
    pub fn stats(&self) -> Stats {
        let each: Vec<Stats> = self.shards.iter().map(|h| h.lock().stats()).collect();
        let mut stats = Stats::combine(&each);
        stats.reserved_bytes.all.peak = self.reserve.peak();
        stats.events.num_driver_calls = each.iter().map(|s| s.events.num_driver_calls).max().unwrap_or(0);
        if let Some(cooperation) = &self.cooperation {
            stats.events.add(&cooperation.events());
        }
        stats
    }

    /// Requested, allocated and reserved bytes now, summed over the shards;
    /// changes nothing.
    pub fn totals(&self) -> Totals {
        self.shards.iter().fold(Totals::default(), |sum, heap| {
            let t = heap.lock().totals();
            Totals { requested: sum.requested + t.requested, allocated: sum.allocated + t.allocated, reserved: sum.reserved + t.reserved }
        })
    }

    pub fn reset_peak_stats(&self) {
        self.shards.iter().for_each(|h| h.lock().reset_peak_stats());
        self.reserve.reset_peak();
    }

    /// Zeroes what the device accumulated; current values and peaks stay.
    pub fn reset_accumulated_stats(&self) {
        self.shards.iter().for_each(|h| h.lock().reset_accumulated_stats());
        if let Some(cooperation) = &self.cooperation {
            cooperation.reset_accumulated();
        }
    }

    /// Caps what the device may reserve (`None`: no cap); cached memory
    /// above the new cap is released at once.
    pub fn set_reserved_limit(&self, limit: Option<u64>) {
        self.reserve.set_limit(limit);
        self.shards.iter().for_each(|h| h.lock().release_over_budget());
    }

    /// The cap on what the device may reserve: the memory fraction's or
    /// the release budget's, the lower.
    pub fn reserved_limit(&self) -> Option<u64> {
        self.shards[0].lock().reserved_limit()
    }

    /// Whether the device grows by expandable segments.
    pub fn is_expandable(&self) -> bool {
        self.shards[0].lock().is_expandable()
    }

    /// The base and size of the segment holding `ptr`.
    pub fn segment_of(&self, ptr: DevicePtr) -> Option<(DevicePtr, u64)> {
        self.shards.iter().find_map(|h| h.lock().segment_of(ptr.0)).map(|(base, size)| (DevicePtr(base), size))
    }

    /// Whether one of this device's heaps holds `ptr` (`DeviceHeap::holds`:
    /// a block, or an address inside a segment), one lock at a time.
    pub fn holds(&self, ptr: DevicePtr) -> bool {
        self.shards.iter().any(|h| h.lock().holds(ptr.0))
    }

    /// The requested size of the live block at `ptr`.
    pub fn live_size(&self, ptr: DevicePtr) -> Option<u64> {
        self.shards.iter().find_map(|h| h.lock().live_size(ptr.0))
    }

    /// Notes that the live block at `ptr` is used on `stream` too; None
    /// when no shard holds such a block.
    pub(crate) fn record_stream(&self, ptr: DevicePtr, stream: Stream) -> Option<Result<(), AllocError>> {
        self.shards.iter().find_map(|heap| {
            let mut heap = heap.lock();
            heap.live_size(ptr.0).is_some().then(|| heap.record_stream(ptr.0, stream))
        })
    }

    /// The streams other than its own the live block at `ptr` was used on.
    pub fn recorded_streams(&self, ptr: DevicePtr) -> Vec<Stream> {
        self.shards.iter().map(|h| h.lock().recorded_streams(ptr.0).to_vec()).find(|s| !s.is_empty()).unwrap_or_default()
    }

    /// Applies `change` to every shard (they keep the same private pools,
    /// so the first refusal stops them all).
    pub(crate) fn on_shards(&self, mut change: impl FnMut(&mut DeviceHeap) -> Result<(), AllocError>) -> Result<(), AllocError> {
        self.shards.iter().try_for_each(|heap| change(&mut heap.lock()))
    }

    pub(crate) fn begin_private(&self, id: PrivatePoolId) -> Result<(), AllocError> {
        self.on_shards(|heap| {
            heap.begin_private(id);
            Ok(())
        })
    }

    pub(crate) fn record_history(&self, max_entries: Option<usize>) {
        self.shards.iter().for_each(|h| h.lock().record_history(max_entries));
    }

    /// The events kept, oldest first (the shards' events merged by time).
    pub fn history(&self) -> Vec<HistoryEntry> {
        let mut entries: Vec<HistoryEntry> = self.shards.iter().flat_map(|h| h.lock().history()).collect();
        entries.sort_by_key(|e| e.time_us);
        entries
    }

    /// Every segment with its blocks, in address order.
    pub fn snapshot(&self) -> Vec<SegmentSnapshot> {
        let mut segments: Vec<SegmentSnapshot> = self.shards.iter().flat_map(|h| h.lock().snapshot()).collect();
        segments.sort_by_key(|s| s.address);
        segments
    }

    pub(crate) fn flush_trace(&self) {
        self.shards.iter().for_each(|h| h.lock().flush_trace());
    }

    /// Refuses a pause of `tag` that could not complete (`DeviceHeap::check_pausable`).
    pub(crate) fn check_pausable(&self, tag: TagId) -> Result<(), AllocError> {
        self.shards.iter().try_for_each(|h| h.lock().check_pausable(tag))
    }

    /// Pauses `tag` on every shard, all or nothing: the shards paused
    /// before a failure resume. Returns the device bytes given back.
    pub(crate) fn pause(&self, tag: TagId, offload: bool) -> Result<u64, AllocError> {
        let mut given_back = 0;
        for heap in self.shards.iter() {
            let paused = heap.lock().pause_tag(tag, offload);
            match paused {
                Ok(bytes) => given_back += bytes,
                Err(err) => {
                    // A failed pause changes nothing: the shards before it resume.
                    self.resume_where_possible(tag);
                    return Err(err);
                }
            }
        }
        Ok(given_back)
    }

    pub(crate) fn tag_paused(&self, tag: TagId) -> bool {
        self.shards.iter().any(|h| h.lock().tag_paused(tag))
    }

    /// Resumes `tag` on every shard where it is paused, asking the other
    /// processes when the device has no room; returns the bytes mapped.
    pub(crate) fn resume(&self, tag: TagId) -> Result<u64, AllocError> {
        let mut mapped = 0;
        for heap in self.shards.iter() {
            let result = {
                let mut locked = heap.lock();
                if !locked.tag_paused(tag) {
                    continue;
                }
                locked.resume_tag(tag)
            };
            mapped += match result {
                Err(AllocError::OutOfMemory(_)) => self.after_oom(heap, |heap| heap.resume_tag(tag), None)?,
                result => result?,
            };
        }
        Ok(mapped)
    }

    /// Resumes `tag` on every shard where it is paused, as far as each can:
    /// undoing a pause that failed on another device (errors are dropped,
    /// nobody is asked).
    pub(crate) fn resume_where_possible(&self, tag: TagId) {
        for heap in self.shards.iter() {
            let mut heap = heap.lock();
            if heap.tag_paused(tag) {
                let _ = heap.resume_tag(tag);
            }
        }
    }

    pub(crate) fn tag_stats(&self, tag: TagId) -> TagStats {
        let mut total = TagStats::default();
        for heap in self.shards.iter() {
            total += heap.lock().tag_stats(tag);
        }
        total
    }

    /// Registers a thread's cache (`thread_cache.rs`; caches are kept only
    /// with one shard); returns its index in the heap.
    pub(crate) fn register_slot(&self, slot: &'static CacheSlot) -> u32 {
        self.shards[0].lock().register_slot(slot)
    }

    /// Takes back what the thread cache `index` holds, as its thread exits.
    pub(crate) fn retire_slot(&self, index: u32) {
        self.shards[0].lock().retire_slot(index);
    }

    /// The slow free of `ptr` on a thread with a cache (`heap/lent.rs`),
    /// counting a stated `size` that differs from the requested one.
    pub(crate) fn free_or_lend(
        &self,
        ptr: u64,
        index: u32,
        entry: Option<usize>,
        max_size: u64,
        size: Option<u64>,
    ) -> Result<FreedOrLent, AllocError> {
        let mut heap = self.shards[0].lock();
        let outcome = heap.free_or_lend(ptr, index, entry, max_size)?;
        if size.is_some_and(|size| size != outcome.requested()) {
            heap.count_size_mismatch();
        }
        Ok(outcome)
    }

    /// Checks the invariants at the top of this file.
    pub fn validate(&self) -> Result<(), String> {
        let mut heaps: Vec<_> = self.shards.iter().map(|h| h.lock()).collect();
        let mut reserved = 0;
        for (shard, heap) in heaps.iter_mut().enumerate() {
            heap.validate_lending().and_then(|()| heap.validate()).map_err(|e| format!("device {} (shard {shard}): {e}", self.index))?;
            reserved += heap.totals().reserved;
        }
        if reserved != self.reserve.bytes() {
            return Err(format!("device {}: the reserved count is {} but the shards reserve {reserved}", self.index, self.reserve.bytes()));
        }
        if self.reserve.peak() < reserved {
            return Err(format!("device {}: the reserved peak {} is below the {reserved} bytes reserved", self.index, self.reserve.peak()));
        }
        Ok(())
    }
}
