//! The allocation path: a request rounded and served from the stash or by
//! best fit in its pool's bins, else from new memory (a segment, or pages
//! of an expandable range); split when the rest is worth keeping. When the
//! device has no room the heap borrows another stream's block, and failing
//! that says it is exhausted: the out-of-memory ladder (releasing, asking
//! the other processes, retrying, counting) is the device's (device.rs).

use super::block::{BlockId, BlockState, NIL};
use super::history::HistoryAction;
use super::ids::PoolId;
use super::segment::Segment;
use super::DeviceHeap;
use crate::backend::BackendError;
use crate::error::AllocError;
use crate::page_map::PageMap;
use crate::recording::rows::Action;
use crate::types::Stream;

/// How many free blocks past the best fit a request of an expandable
/// segment looks at for one whose pages are mapped (`DeviceHeap::fit`):
/// a bound on the allocation path's work.
const MAPPED_FIT_CANDIDATES: usize = 8;

impl DeviceHeap {
    /// Serves a request of `size` bytes on `stream`; 0 bytes gives address 0.
    #[inline]
    pub fn allocate(&mut self, size: u64, stream: Stream) -> Result<u64, AllocError> {
        if size == 0 {
            return Ok(0);
        }
        let rounded = self.rules.round(size).ok_or(AllocError::TooLarge { size })?;
        let pool = self.pool_id(stream, self.rules.kind(rounded));
        self.allocate_in(pool, rounded, size, stream)
    }

    /// Serves `size` bytes, rounded to `rounded`, from `pool`: its stashed
    /// block when that is exactly the size and no free waits for other
    /// streams' work, else the bins. (Frees whose work has run are merged
    /// before best fit looks, as PyTorch does; one of them, merged after
    /// the stashed block, could come first.)
    #[inline(always)]
    pub(super) fn allocate_in(&mut self, pool: PoolId, rounded: u64, size: u64, stream: Stream) -> Result<u64, AllocError> {
        let stashed = self.pools[pool].stash;
        if stashed != NIL && self.blocks[stashed].size == rounded && !self.streams.pending.awaits_events() {
            self.pools[pool].stash = NIL;
            self.blocks[stashed].state = BlockState::Detached;
            return Ok(self.hand_out(stashed, size));
        }
        self.allocate_from_bins(pool, rounded, size, stream)
    }

    /// `allocate`, remembering `context` (0: none) for the block and for its
    /// `alloc` event: snapshots show the context's frames. From the first
    /// context on, the heap is observed, so that every free forgets its block's.
    pub fn allocate_with_context(&mut self, size: u64, stream: Stream, context: u64) -> Result<u64, AllocError> {
        self.with_context(context, |heap| heap.allocate(size, stream))
    }

    /// The allocation path past the stash: best fit in the bins, else growth.
    #[cold]
    #[inline(never)]
    pub(super) fn allocate_from_bins(&mut self, pool: PoolId, rounded: u64, size: u64, stream: Stream) -> Result<u64, AllocError> {
        self.process_pending(false);
        self.flush_stash(pool);
        if self.growth_need(pool, rounded).is_none() {
            return Err(AllocError::TooLarge { size });
        }
        let block = match self.take_block(pool, rounded) {
            Ok(block) => block,
            Err(BackendError::OutOfMemory) => self.take_block_after_oom(pool, rounded, size, stream)?,
            Err(err) => return Err(AllocError::Backend(err)),
        };
        let borrowed = self.pools[self.blocks[block].pool].stream != stream;
        let addr = self.carve(block, rounded, size);
        if borrowed {
            self.streams.recorded.insert(addr, vec![stream]);
        }
        Ok(addr)
    }

    /// A free block for `rounded` bytes, unlinked from its bin (`fit`),
    /// else one from new memory. In an expandable segment the pages under
    /// the block's allocated part are mapped first. Threads' caches never
    /// make the heap grow: before new memory (a segment, or pages to map),
    /// their blocks come back and the fit is looked for again.
    pub(super) fn take_block(&mut self, pool: PoolId, rounded: u64) -> Result<BlockId, BackendError> {
        let paged = self.pools[pool].vm.is_some();
        let mut fit = self.fit(pool, rounded);
        // New memory: no fit, or one whose pages must be mapped.
        if fit.is_none_or(|(_, mapped)| !mapped) && self.recall_cached() {
            fit = self.fit(pool, rounded);
        }
        let block = match fit {
            Some((id, _)) => {
                self.remove_free(id);
                id
            }
            None => self.grow(pool, rounded)?,
        };
        if paged {
            if let Err(err) = self.map_block(block, rounded) {
                self.insert_free(block);
                return Err(err);
            }
        }
        Ok(block)
    }

    /// The free block of `pool` a request of `rounded` bytes takes: the
    /// best fit; in an expandable segment, the best fit among the first
    /// `MAPPED_FIT_CANDIDATES` that fit whose pages under the request are
    /// all mapped, when the best fit's are not (no driver call: the way
    /// PyTorch's expandable segments place, whose free blocks are all
    /// mapped), else the best fit. With whether its pages under the request
    /// are all mapped (always, outside an expandable segment).
    fn fit(&self, pool: PoolId, rounded: u64) -> Option<(BlockId, bool)> {
        let pool_ref = &self.pools[pool];
        let best = pool_ref.best_fit(&self.blocks, rounded, &self.rules)?;
        if pool_ref.vm.is_none() || self.mapped_under(best, rounded) {
            return Some((best, true));
        }
        let mapped = pool_ref.fits_after(&self.blocks, best).take(MAPPED_FIT_CANDIDATES).find(|&id| self.mapped_under(id, rounded));
        Some(mapped.map_or((best, false), |id| (id, true)))
    }

    /// When the device has no room: another stream's cached block, else the
    /// heap is exhausted: an out-of-memory whose report says what the other
    /// processes would have to give back. What follows (releasing,
    /// retrying, asking, counting) is the device's ladder (`Device::after_oom`).
    #[cold]
    pub(super) fn take_block_after_oom(&mut self, pool: PoolId, rounded: u64, size: u64, stream: Stream) -> Result<BlockId, AllocError> {
        if let Some(block) = self.borrow_from_other_streams(pool, rounded, stream) {
            return Ok(block);
        }
        let need = self.need_from_others(pool, rounded);
        Err(AllocError::OutOfMemory(Box::new(self.oom_report(size, need))))
    }

    /// Counts a request retried after the device's cache went back
    /// (`num_alloc_retries`, once per request, as PyTorch counts it).
    pub(crate) fn count_alloc_retry(&mut self) {
        self.stats.events.num_alloc_retries += 1;
    }

    /// Counts an out-of-memory the device's ladder could not avoid, once;
    /// a failed allocation of (`size`, `stream`) is recorded too (the trace's
    /// failure row, the history's `oom` event).
    pub(crate) fn count_oom(&mut self, failed_allocation: Option<(u64, Stream)>) {
        self.stats.events.num_ooms += 1;
        if let (Some((size, stream)), true) = (failed_allocation, self.observers.observed) {
            self.record(Action::AllocateFailure, 0, size, stream);
        }
    }

    /// Memory a request of `rounded` bytes makes the heap take from the
    /// device: a segment, or (expandable) the pages it covers at most.
    /// None when that does not fit in 64 bits.
    pub(super) fn growth_need(&self, pool: PoolId, rounded: u64) -> Option<u64> {
        match self.pool_vm(pool) {
            Some(vm) => rounded.checked_next_multiple_of(vm.page),
            None => self.rules.segment_size(rounded),
        }
    }

    /// A new segment (or expandable range) for `pool` big enough for
    /// `rounded`; its one block is returned unlinked from any bin.
    pub(super) fn grow(&mut self, pool: PoolId, rounded: u64) -> Result<BlockId, BackendError> {
        let stream = self.pools[pool].stream;
        let (base, size, pages) = match self.pool_vm(pool) {
            Some(vm) => {
                let (base, size) = self.reserve_range(vm, rounded)?;
                (base, size, Some(PageMap::new(size, vm.page)))
            }
            None => {
                let size = self.growth_need(pool, rounded).ok_or(BackendError::OutOfMemory)?;
                let (donors, _) = self.recycle_before_growth(size, rounded, None);
                self.release_donors(donors); // a segment is new memory: nothing moves into it
                (self.new_segment(size, stream)?, size, None)
            }
        };
        let kind = self.pools[pool].kind;
        let blocks = &mut self.blocks;
        let segment_id = self.segments.insert(|id| {
            let first_block = blocks.insert(base, size, id, pool, kind);
            Segment { base, size, pages, pool, first_block, idle_since_ms: 0 }
        });
        let block = self.segments[segment_id].first_block;
        self.stamp_freed(block);
        if self.segments[segment_id].pages.is_none() {
            self.stats.reserved_bytes.increase(kind, size);
            self.limits.reserve.note_peak();
            self.stats.events.num_device_alloc += 1;
            self.note(HistoryAction::SegmentAlloc, base, size, stream);
        }
        self.stats.segment.increase(kind, 1);
        Ok(block)
    }

    /// Allocates the free, unbinned block `id` for a request, splitting off
    /// the rest when the rules say so. Returns the block's address.
    #[inline]
    pub(super) fn carve(&mut self, id: BlockId, rounded: u64, requested: u64) -> u64 {
        let (addr, size, pool) = {
            let b = &self.blocks[id];
            (b.addr, b.size, b.pool)
        };
        if self.should_split(pool, size, rounded) {
            let rest = self.blocks.split(id, rounded);
            self.insert_free(rest);
        }
        self.by_addr.insert(addr, id);
        self.hand_out(id, requested)
    }

    /// Marks the free, unbinned block `id`, already in `by_addr`, allocated
    /// for `requested` bytes.
    #[inline(always)]
    pub(super) fn hand_out(&mut self, id: BlockId, requested: u64) -> u64 {
        let b = &mut self.blocks[id];
        b.state = BlockState::Allocated;
        b.requested = requested;
        let (addr, size, kind, pool) = (b.addr, b.size, b.kind, b.pool);
        if self.observers.observed {
            let stream = self.pools[pool].stream;
            self.record(Action::Allocate, addr, requested, stream);
        }
        if self.lending.armed() {
            self.make_room_under_peaks(kind, size, requested);
        }
        let stats = &mut self.stats;
        stats.allocation.increase(kind, 1);
        stats.allocated_bytes.increase(kind, size);
        stats.requested_bytes.increase(kind, requested);
        if !self.streams.pending.is_empty() {
            stats.note_active_peaks();
        }
        addr
    }
}
