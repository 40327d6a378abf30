//! The device heap: segments of one device split into blocks, the pools of
//! free blocks, and the statistics, kept consistent under one lock.
//!
//! A request is rounded (`SizeRules::round`), looked up in the pool of its
//! stream, private pool, tag and kind by best fit, and served from the block found, split when
//! the rest is worth keeping. With no fitting block the heap grows by one
//! segment from the backend (with expandable segments, the large pool
//! instead maps pages of one reserved range: `expandable.rs`); when the
//! backend refuses, every whole free segment (and free page) of the device
//! is released and growth is tried once more. A free
//! merges the block with its free neighbours and returns it to the pool of
//! the stream it was allocated on.
//!
//! The stash (the cached pair's fast path): a pool holds back its most
//! recently freed block, unmerged, until the next operation on the pool,
//! when that block is where best fit over the merged bins would put the
//! next request of its size (`stash_is_best_fit`: no free block before it,
//! none elsewhere that fits such a request better, and a free neighbour
//! after it that would be split off again to the same place in its bin),
//! so the stash saves work and never moves a block, nor changes the age of
//! one (tests/model.rs compares every placement and driver call with the
//! stash off). A request of exactly that size takes it back with no split
//! and no merge; anything else merges it first (`flush_stash`), and so
//! does every operation that looks at the whole heap (release,
//! statistics). Allocation loops that free and reallocate the same sizes
//! thus cost one map lookup, however fragmented their pool; a whole segment
//! stashed and then idle counts as idle from when it is merged (at most
//! one reclaimer pass later).
//!
//! This file holds the allocation and free paths; `release.rs` gives memory
//! back (caps, the reclaimer's pass, what an OOM needs from other processes) and
//! `streams.rs` keeps blocks safe across streams (pending frees waiting for
//! events, lending a block to another stream when the device is full);
//! `private.rs` routes allocations to private pools (CUDA graphs, MemPools);
//! `tags.rs` serves tagged allocations from each tag's own pools and pauses
//! and resumes a tag's memory; `reserve.rs` keeps the reserved count, its
//! peak and its cap shared by the heaps of one device.
//!
//! Invariants, checked by `validate()`:
//! - the blocks of a segment tile it exactly, in address order, linked both ways;
//! - no two free blocks are neighbours, unless one of them is a stashed block;
//! - each free block is either in exactly one bin (the bin of its size, in
//!   its segment's pool) or the stash of its pool, where best fit would
//!   put the next request of its size;
//! - each allocated, pending or stashed block is in `by_addr` under its
//!   address, and nothing else is;
//! - every gauge equals the sum recomputed from the blocks (stashed blocks
//!   count as free, but as inactive-split only once merged; pending blocks
//!   as active, not allocated);
//! - each pending block waits for as many queued events as it is named in,
//!   and at least one, or for the end of a capture (`streams.rs`);
//! - each pool grows as its tag and kind say (`Pool::vm`: pages of reserved
//!   ranges, or whole segments);
//! - each pool is filed once, under its own stream, private pool, tag and
//!   kind (`pools_by_key`), and every open private pool is held (`private.rs`);
//! - each kept context (`contexts`) is that of an allocated or pending
//!   block at its address, and the heap is `observed` while one is kept.
#![forbid(unsafe_code)]

pub mod addr_map;
pub mod block;
mod expandable;
pub mod history;
pub mod pages;
pub mod pool;
pub mod private;
mod recycle;
mod release;
pub mod reserve;
mod streams;
pub mod tags;
mod validate;

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use crate::backend::{Backend, BackendError};
use crate::error::{AllocError, InvalidFree, OomReport};
use crate::reclaim::policy::{Policy, Reason};
use crate::reclaim::Clock;
use crate::recording::rows::Action;
use crate::recording::{Recorder, TraceBuffer};
use crate::size_class::{PoolKind, SizeRules};
pub use crate::stats::Released;
use crate::stats::{Counters, Stats};
use crate::types::Stream;
use addr_map::AddrMap;
use block::{BlockArena, BlockId, BlockState, NIL};
use expandable::Vm;
use history::{History, HistoryAction};
use pages::PageMap;
use pool::Pool;
use private::{PrivatePoolId, PrivatePools};
use reserve::Reserve;
use streams::PendingFrees;

/// One allocation from the backend, or one reserved range of an
/// expandable segment (then `size` is its address space, and `pages` says
/// which of its pages hold memory).
#[derive(Clone, Debug)]
pub struct Segment {
    pub base: u64,
    pub size: u64,
    pub pages: Option<PageMap>,
    pub pool: u32,
    /// The block at `base`.
    pub first_block: BlockId,
    /// When the segment last became one whole free block (reclaimer clock).
    pub idle_since_ms: u64,
}

/// The three byte counts a replay follows.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Totals {
    pub requested: u64,
    pub allocated: u64,
    pub reserved: u64,
}

/// One segment as a snapshot shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SegmentSnapshot {
    pub address: u64,
    pub size: u64,
    pub stream: Stream,
    pub kind: PoolKind,
    /// Part of an expandable segment (a run of its mapped pages).
    pub expandable: bool,
    /// The private pool (graph pool, `MemPool`) it belongs to, if any.
    pub private: Option<PrivatePoolId>,
    /// The tag of its blocks (`crate::tag`).
    pub tag: crate::tag::TagId,
    /// Its tag is paused: the segment is a run of pages that resume maps
    /// again, holding no device memory now.
    pub paused: bool,
    pub blocks: Vec<BlockSnapshot>,
}

/// One block of a segment snapshot.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockSnapshot {
    pub address: u64,
    pub size: u64,
    /// Bytes asked for; 0 for a free block.
    pub requested: u64,
    /// Held by its caller.
    pub allocated: bool,
    /// Freed by its caller, waiting for other streams' work (PyTorch's
    /// `active_pending_free`).
    pub pending: bool,
    /// The context it was allocated with (0: none; see `crate::frames`).
    pub context: u64,
}

/// A freed block, as the caller needs to know it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Freed {
    pub size: u64,
    pub requested: u64,
}

/// What picks a request's pools: its stream, the private pool open (if
/// any) and its tag (0: "default"; tagged pools are never private).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct PoolKey {
    stream: Stream,
    private: Option<PrivatePoolId>,
    tag: u32,
}

/// The heap of one device (or of one stream shard of a device). Aligned to
/// 128 bytes so that heaps side by side, used by different threads, share
/// no cache line.
#[repr(align(128))]
pub struct DeviceHeap {
    device: usize,
    rules: SizeRules,
    backend: Arc<dyn Backend>,
    blocks: BlockArena,
    segments: Vec<Option<Segment>>,
    unused_segments: Vec<u32>,
    segment_by_base: BTreeMap<u64, u32>,
    pools: Vec<Pool>,
    /// The (small, large) pools of each stream, private pool and tag.
    pools_by_key: HashMap<PoolKey, [u32; 2]>,
    /// The last stream served and the pools it was served from: skips the
    /// map on the hot path (cleared as private pools open and close).
    last_stream: Option<(Stream, [u32; 2])>,
    /// Graph pools and `MemPool`s (`private.rs`).
    private: PrivatePools,
    /// Allocated and stashed blocks by address: the pointer lookup of `free`.
    by_addr: AddrMap,
    /// Live blocks used on streams other than their own (`record_stream`).
    recorded_streams: HashMap<u64, Vec<Stream>>,
    /// Freed blocks waiting for the events of the other streams that used them.
    pending: PendingFrees,
    /// The device's reserved count and memory-fraction cap, shared with
    /// the other heaps of the device (one per stream shard).
    reserve: Arc<Reserve>,
    /// When to give memory back; the budget also caps growth.
    policy: Policy,
    /// The reclaimer's clock, for idle stamps.
    clock: Arc<Clock>,
    /// A failed request is being retried (`retry_allocate`): its failures
    /// are not counted or recorded again.
    retrying: bool,
    /// Whether frees go through the stash (see the top of this file).
    stash_enabled: bool,
    /// Whether a full device may lend one stream's cached blocks to another.
    lend_across_streams: bool,
    /// Expandable segments (`expandable:true`): page size and range size.
    vm: Option<Vm>,
    /// Rows for the TIDEPOOL_TRACE recording, when one is on.
    trace: Option<TraceBuffer>,
    /// The last events, for snapshots' `device_traces`, when kept (`history.rs`).
    history: Option<History>,
    /// Whether a recording, a history or contexts are on: one test on the
    /// hot path for all.
    observed: bool,
    stats: Counters,
    /// The context of each allocated or pending block allocated with one
    /// (`allocate_with_context`), by address; an entry goes when its block's
    /// free completes.
    contexts: HashMap<u64, u64>,
    /// Whether a block was ever allocated with a context (keeps `observed` on).
    with_contexts: bool,
    /// The context of the allocation under way, for its `alloc` event.
    allocating_context: u64,
    /// The pools of tags other than "default", and paused tags (`tags.rs`).
    tags: tags::Tags,
    recycling: recycle::Recycling,
}

impl DeviceHeap {
    pub fn new(device: usize, rules: SizeRules, backend: Arc<dyn Backend>) -> DeviceHeap {
        DeviceHeap {
            device,
            rules,
            backend,
            blocks: BlockArena::new(),
            segments: Vec::new(),
            unused_segments: Vec::new(),
            segment_by_base: BTreeMap::new(),
            pools: Vec::new(),
            pools_by_key: HashMap::new(),
            last_stream: None,
            private: PrivatePools::default(),
            by_addr: AddrMap::default(),
            recorded_streams: HashMap::new(),
            pending: PendingFrees::default(),
            reserve: Arc::default(),
            policy: Policy { release_after_ms: u64::MAX, headroom: 0, headroom_min_idle_ms: 0, max_reserved: u64::MAX },
            clock: Clock::new(),
            retrying: false,
            stash_enabled: true,
            lend_across_streams: true,
            vm: None,
            trace: None,
            history: None,
            observed: false,
            stats: Counters::default(),
            contexts: HashMap::new(),
            with_contexts: false,
            allocating_context: 0,
            tags: tags::Tags::default(),
            recycling: recycle::Recycling::default(),
        }
    }

    /// Records every allocation and free from now on into `recorder`.
    pub fn record_to(&mut self, recorder: Arc<Recorder>) {
        self.trace = Some(TraceBuffer::new(recorder));
        self.observed = true;
    }

    /// Hands buffered trace rows to the recorder's writer.
    pub fn flush_trace(&mut self) {
        if let Some(trace) = self.trace.as_mut() {
            trace.flush();
        }
    }

    /// Tells the recording and the history (call only when `observed`).
    #[inline(always)]
    fn record(&mut self, action: Action, pointer: u64, size: u64, stream: Stream) {
        if let Some(trace) = self.trace.as_mut() {
            trace.push(action, pointer, size, stream.0);
        }
        if self.history.is_some() {
            self.note_action(action, pointer, size, stream);
        }
    }

    /// Lets (or stops) a full device lend one stream's cached blocks to another.
    pub fn set_lend_across_streams(&mut self, on: bool) {
        self.lend_across_streams = on;
    }

    /// Shares the device's reserved count and cap with the other heaps of the device.
    pub fn share_reserve(&mut self, reserve: Arc<Reserve>) {
        self.reserve = reserve;
    }

    /// Whether `ptr` is a block of this heap that a free could name
    /// (allocated, or freed and pending).
    pub fn owns(&self, ptr: u64) -> bool {
        self.by_addr.get(ptr).is_some_and(|id| self.blocks[id].is_active())
    }

    /// Turns the stash on or off (off: every free merges at once).
    pub fn set_stash(&mut self, on: bool) {
        self.stash_enabled = on;
        if !on {
            self.flush_stashes();
        }
    }

    pub fn rules(&self) -> &SizeRules {
        &self.rules
    }

    /// The pool of (stream, kind) that serves now (a private pool's while
    /// one is open), created on first use.
    #[inline]
    fn pool_id(&mut self, stream: Stream, kind: PoolKind) -> u32 {
        if let Some((s, ids)) = self.last_stream {
            if s == stream {
                return ids[kind as usize];
            }
        }
        let ids = self.pools_of(PoolKey { stream, private: self.private.routing(), tag: 0 });
        self.last_stream = Some((stream, ids));
        ids[kind as usize]
    }

    /// The (small, large) pools of `key`, created on first use: growing
    /// as expandable segments say for the "default" tag, in ranges of
    /// their own for any other.
    fn pools_of(&mut self, key: PoolKey) -> [u32; 2] {
        if let Some(ids) = self.pools_by_key.get(&key) {
            return *ids;
        }
        let first = self.pools.len() as u32;
        for kind in [PoolKind::Small, PoolKind::Large] {
            let mut pool = Pool::new(key.stream, kind, key.private);
            pool.tag = key.tag;
            pool.vm = self.vm_for(key.tag, kind);
            self.pools.push(pool);
        }
        let ids = [first, first + 1];
        self.pools_by_key.insert(key, ids);
        ids
    }

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
    fn allocate_in(&mut self, pool: u32, rounded: u64, size: u64, stream: Stream) -> Result<u64, AllocError> {
        let stashed = self.pools[pool as usize].stash;
        if stashed != NIL && self.blocks[stashed].size == rounded && !self.pending.awaits_events() {
            self.pools[pool as usize].stash = NIL;
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

    /// Runs `allocate` with `context` (0: none) noted for the block it serves.
    fn with_context(&mut self, context: u64, allocate: impl FnOnce(&mut Self) -> Result<u64, AllocError>) -> Result<u64, AllocError> {
        if context == 0 {
            return allocate(self);
        }
        self.with_contexts = true;
        self.observed = true;
        self.allocating_context = context;
        let result = allocate(self);
        self.allocating_context = 0;
        if let Ok(addr @ 1..) = result {
            self.contexts.insert(addr, context);
        }
        result
    }

    /// Forgets the context of the block at `addr`, whose free completed.
    #[cold]
    fn forget_context(&mut self, addr: u64) {
        self.contexts.remove(&addr);
    }

    /// The context the block at `addr` was allocated with (0: none).
    fn context_of(&self, addr: u64) -> u64 {
        self.contexts.get(&addr).copied().unwrap_or(0)
    }

    /// The allocation path past the stash: best fit in the bins, else growth.
    #[cold]
    #[inline(never)]
    fn allocate_from_bins(&mut self, pool: u32, rounded: u64, size: u64, stream: Stream) -> Result<u64, AllocError> {
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
        let borrowed = self.pools[self.blocks[block].pool as usize].stream != stream;
        let addr = self.carve(block, rounded, size);
        if borrowed {
            self.recorded_streams.insert(addr, vec![stream]);
        }
        Ok(addr)
    }

    /// A free block for `rounded` bytes, unlinked from its bin: the best
    /// fit, else one from new memory. In an expandable segment the pages
    /// under the block's allocated part are mapped first.
    fn take_block(&mut self, pool: u32, rounded: u64) -> Result<BlockId, BackendError> {
        let p = &self.pools[pool as usize];
        let paged = p.vm.is_some();
        let block = match p.best_fit(&self.blocks, rounded, &self.rules) {
            Some(id) => {
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

    /// When the device has no room: borrow another stream's block, else
    /// release every free segment (and free page) of the device and retry
    /// once, else ask the other processes; then it is an out-of-memory.
    #[cold]
    fn take_block_after_oom(&mut self, pool: u32, rounded: u64, size: u64, stream: Stream) -> Result<BlockId, AllocError> {
        if let Some(block) = self.borrow_from_other_streams(pool, rounded, stream) {
            return Ok(block);
        }
        self.release_free_segments(Reason::OutOfMemory, |_, _| true);
        if !self.retrying {
            self.stats.events.num_alloc_retries += 1;
        }
        match self.take_block(pool, rounded) {
            Ok(block) => Ok(block),
            Err(BackendError::OutOfMemory) => {
                let need = self.need_from_others(pool, rounded);
                if !self.retrying {
                    self.stats.events.num_ooms += 1;
                    if self.observed {
                        self.record(Action::AllocateFailure, 0, size, stream);
                    }
                }
                Err(AllocError::OutOfMemory(Box::new(self.oom_report(size, need))))
            }
            Err(err) => Err(AllocError::Backend(err)),
        }
    }

    /// Memory a request of `rounded` bytes makes the heap take from the
    /// device: a segment, or (expandable) the pages it covers at most.
    /// None when that does not fit in 64 bits.
    fn growth_need(&self, pool: u32, rounded: u64) -> Option<u64> {
        match self.pool_vm(pool) {
            Some(vm) => rounded.checked_next_multiple_of(vm.page),
            None => self.rules.segment_size(rounded),
        }
    }

    /// A new segment (or expandable range) for `pool` big enough for
    /// `rounded`; its one block is returned unlinked from any bin.
    fn grow(&mut self, pool: u32, rounded: u64) -> Result<BlockId, BackendError> {
        let stream = self.pools[pool as usize].stream;
        let (base, size, pages) = match self.pool_vm(pool) {
            Some(vm) => {
                let (base, size) = self.reserve_range(vm, rounded)?;
                (base, size, Some(PageMap::new(size, vm.page)))
            }
            None => {
                let size = self.growth_need(pool, rounded).ok_or(BackendError::OutOfMemory)?;
                let donors = self.recycle_before_growth(size, rounded, None);
                self.unmap_donors(donors); // a segment is new memory: nothing moves into it
                (self.new_segment(size, stream)?, size, None)
            }
        };
        let kind = self.pools[pool as usize].kind;
        let segment_id = match self.unused_segments.pop() {
            Some(id) => id,
            None => {
                self.segments.push(None);
                (self.segments.len() - 1) as u32
            }
        };
        let block = self.blocks.insert(base, size, segment_id, pool, kind);
        self.stamp_freed(block);
        if pages.is_none() {
            self.stats.reserved_bytes.increase(kind, size);
            self.reserve.note_peak();
            self.stats.events.num_device_alloc += 1;
            self.note(HistoryAction::SegmentAlloc, base, size, stream);
        }
        self.segments[segment_id as usize] = Some(Segment { base, size, pages, pool, first_block: block, idle_since_ms: 0 });
        self.segment_by_base.insert(base, segment_id);
        self.stats.segment.increase(kind, 1);
        Ok(block)
    }

    /// Allocates the free, unbinned block `id` for a request, splitting off
    /// the rest when the rules say so. Returns the block's address.
    #[inline]
    fn carve(&mut self, id: BlockId, rounded: u64, requested: u64) -> u64 {
        let (addr, size, pool, segment) = {
            let b = &self.blocks[id];
            (b.addr, b.size, b.pool, b.segment)
        };
        let kind = self.pools[pool as usize].kind;
        if self.should_split(pool, size, rounded) {
            let rest = self.blocks.insert(addr + rounded, size - rounded, segment, pool, kind);
            let next = self.blocks[id].next;
            self.blocks[rest].prev = id;
            self.blocks[rest].next = next;
            if next != NIL {
                self.blocks[next].prev = rest;
            }
            self.blocks[id].next = rest;
            self.blocks[id].size = rounded;
            self.blocks[rest].freed_at = self.blocks[id].freed_at;
            self.insert_free(rest);
        }
        self.by_addr.insert(addr, id);
        self.hand_out(id, requested)
    }

    /// Marks the free, unbinned block `id`, already in `by_addr`, allocated
    /// for `requested` bytes.
    #[inline(always)]
    fn hand_out(&mut self, id: BlockId, requested: u64) -> u64 {
        let b = &mut self.blocks[id];
        b.state = BlockState::Allocated;
        b.requested = requested;
        let (addr, size, kind, pool) = (b.addr, b.size, b.kind, b.pool);
        if self.observed {
            let stream = self.pools[pool as usize].stream;
            self.record(Action::Allocate, addr, requested, stream);
        }
        let stats = &mut self.stats;
        stats.allocation.increase(kind, 1);
        stats.allocated_bytes.increase(kind, size);
        stats.requested_bytes.increase(kind, requested);
        if !self.pending.is_empty() {
            stats.note_active_peaks();
        }
        addr
    }

    /// Frees the live block at `ptr`, merging it with free neighbours.
    #[inline]
    pub fn free(&mut self, ptr: u64) -> Result<Freed, AllocError> {
        let found = self.by_addr.get(ptr).filter(|&id| self.blocks[id].is_allocated());
        let Some(id) = found else {
            self.stats.events.num_invalid_frees += 1;
            return Err(AllocError::InvalidFree { ptr, reason: self.classify_invalid_free(ptr) });
        };
        if !self.recorded_streams.is_empty() {
            if let Some(streams) = self.recorded_streams.remove(&ptr) {
                if let Some(freed) = self.defer_free(id, ptr, streams) {
                    return Ok(freed);
                }
            }
        }
        let freed = self.count_free(id, ptr, true);
        self.deactivate(id);
        Ok(freed)
    }

    /// Counts the caller's free of the allocated block `id` at `ptr`: the
    /// statistics of allocated memory, the trace and the history (with
    /// `completed`, the block is reusable at once).
    #[inline(always)]
    fn count_free(&mut self, id: BlockId, ptr: u64, completed: bool) -> Freed {
        let b = &self.blocks[id];
        let (size, requested, pool, kind) = (b.size, b.requested, b.pool, b.kind);
        if self.observed {
            let stream = self.pools[pool as usize].stream;
            self.record(Action::Free, ptr, requested, stream);
            if completed && self.history.is_some() {
                self.note(HistoryAction::FreeCompleted, ptr, requested, stream);
            }
            if completed && !self.contexts.is_empty() {
                self.forget_context(ptr);
            }
        }
        let stats = &mut self.stats;
        stats.allocation.decrease(kind, 1);
        stats.allocated_bytes.decrease(kind, size);
        stats.requested_bytes.decrease(kind, requested);
        Freed { size, requested }
    }

    /// Makes the freed block `id` reusable: into the stash or the bins.
    /// The common case, an untagged pool with nothing stashed, is
    /// `stash_or_bin` written out inline (the cached pair's free path:
    /// calling it costs 27 more instructions a pair, by callgrind).
    #[inline(always)]
    fn deactivate(&mut self, id: BlockId) {
        let b = &mut self.blocks[id];
        b.state = BlockState::Stashed;
        b.requested = 0;
        let pool = b.pool as usize;
        let p = &self.pools[pool];
        if p.tag == 0 && p.stash == NIL {
            let next_free = self.free_after(id);
            if self.stash_enabled && self.stash_fits(id, next_free, p.free_blocks) {
                self.stash(pool, id, next_free);
            } else {
                self.bin_freed(id);
            }
            return;
        }
        if p.tag != 0 {
            return self.deactivate_tagged(id);
        }
        self.stash_or_bin(id);
    }

    /// Puts the freed block `id` (marked stashed by `deactivate`) into its
    /// pool's stash (the one before it goes to the bins) after the block
    /// stashed before goes to the bins; or, where stashing could move where
    /// blocks land, straight into the bins.
    #[inline]
    fn stash_or_bin(&mut self, id: BlockId) {
        let pool = self.blocks[id].pool as usize;
        self.flush_stash(pool as u32);
        let next_free = self.free_after(id);
        if self.stash_enabled && self.stash_fits(id, next_free, self.pools[pool].free_blocks) {
            self.stash(pool, id, next_free);
        } else {
            self.bin_freed(id);
        }
    }

    /// The block after `id` if it is in the bins, else NIL.
    #[inline(always)]
    fn free_after(&self, id: BlockId) -> BlockId {
        let next = self.blocks[id].next;
        if next != NIL && self.blocks[next].state == BlockState::Binned {
            next
        } else {
            NIL
        }
    }

    /// `stash_is_best_fit`, answered at once in the cached pair's case:
    /// `next_free`, the free block after `id` (NIL: none), is all its pool
    /// has free (or nothing is) and `max_split_size` is unlimited, so that
    /// a merged block always serves a request of `id`'s size and is split
    /// to it (small blocks are at least `min_block`, large ones larger than
    /// `small_size`).
    #[inline(always)]
    fn stash_fits(&self, id: BlockId, next_free: BlockId, free_blocks: usize) -> bool {
        (free_blocks == (next_free != NIL) as usize && self.rules.max_split_size == u64::MAX) || self.stash_is_best_fit(id, next_free)
    }

    /// Whether the freed block `id` (`next_free`: the free block after it,
    /// NIL: none), taken back by a request of its size, is what best fit
    /// over the merged bins would hand that request:
    /// merged with its free neighbours it would start at `id` (the block
    /// before it is not free), the rules would let it serve the request and
    /// split it to exactly `id`, and no other free block of the pool would
    /// come first (none of a size from `id`'s up to the merged size; of
    /// the merged size itself, the merged block, freed last, comes first).
    /// Then the stash only saves work; otherwise it would change where
    /// blocks land (a block misplaced can keep a whole segment from going
    /// back), and the block merges at once. So the stash never makes
    /// tidepool hold more than PyTorch would.
    #[inline(never)]
    fn stash_is_best_fit(&self, id: BlockId, next_free: BlockId) -> bool {
        let b = &self.blocks[id];
        if b.prev != NIL && self.blocks[b.prev].state == BlockState::Binned {
            return false;
        }
        let merged = if next_free != NIL { b.size + self.blocks[next_free].size } else { b.size };
        let pool = &self.pools[b.pool as usize];
        if next_free != NIL {
            // Split off again, the rest would go back first of the free
            // blocks of its size: where the neighbour must be now.
            let n = &self.blocks[next_free];
            let first_of_its_size = n.link_prev == NIL || self.blocks[n.link_prev].size < n.size;
            let split_to_id = (pool.vm.is_some() || self.rules.may_serve(merged, b.size)) && self.should_split(b.pool, merged, b.size);
            if !(first_of_its_size && split_to_id) {
                return false;
            }
        }
        pool.first_fit_size_without(&self.blocks, b.size, next_free).is_none_or(|fit| fit >= merged)
    }

    /// Stamps the block `id`, freed or new, with the next tick of the
    /// heap's count of frees, the age `Recycling` orders holes by (heaps
    /// with expandable segments). A free ticks when it happens, stashed or
    /// not; a block merged from it takes its tick, and a block split off a
    /// free one keeps the tick of the block it was split from.
    #[inline(always)]
    fn stamp_freed(&mut self, id: BlockId) {
        if self.vm.is_some() {
            self.recycling.frees += 1;
            self.blocks[id].freed_at = self.recycling.frees;
        }
    }

    /// Stamps the freed block `id` and merges it into the bins.
    fn bin_freed(&mut self, id: BlockId) {
        self.stamp_freed(id);
        self.merge_and_bin(id);
    }

    /// Stashes the freed block `id` of `pool` and stamps it. `next_free`,
    /// the free block after it (NIL: none), takes the same tick, and is idle
    /// from now: what it would have as the rest split off the two merged if
    /// the stashed block is taken back (merged, they take the tick anyway),
    /// so the stash changes no block's age (its idle time, by no more than
    /// the time until the take-back).
    #[inline(always)]
    fn stash(&mut self, pool: usize, id: BlockId, next_free: BlockId) {
        self.pools[pool].stash = id;
        self.stamp_freed(id);
        if next_free != NIL && self.vm.is_some() {
            let (tick, now) = (self.blocks[id].freed_at, self.clock.now_ms());
            let next = &mut self.blocks[next_free];
            next.freed_at = tick;
            next.idle_since_ms = now;
        }
    }

    /// Merges the stashed block of `pool`, if any, into the bins.
    #[inline]
    fn flush_stash(&mut self, pool: u32) {
        let id = std::mem::replace(&mut self.pools[pool as usize].stash, NIL);
        if id != NIL {
            self.merge_and_bin(id);
        }
    }

    /// Merges every pool's stashed block.
    fn flush_stashes(&mut self) {
        for pool in 0..self.pools.len() as u32 {
            self.flush_stash(pool);
        }
    }

    /// Merges the free, unbinned block `id` with its free neighbours and
    /// puts the result in its bin.
    #[inline(never)]
    fn merge_and_bin(&mut self, id: BlockId) {
        self.blocks[id].state = BlockState::Detached;
        self.by_addr.remove(self.blocks[id].addr);
        let freed_at = self.blocks[id].freed_at;
        let mut merged = id;
        let prev = self.blocks[id].prev;
        if prev != NIL && self.blocks[prev].state == BlockState::Binned {
            self.remove_free(prev);
            self.absorb_next(prev);
            merged = prev;
        }
        let next = self.blocks[merged].next;
        if next != NIL && self.blocks[next].state == BlockState::Binned {
            self.remove_free(next);
            self.absorb_next(merged);
        }
        self.blocks[merged].freed_at = freed_at;
        self.insert_free(merged);
    }

    /// Merges the block after `id` into `id` and drops its record.
    #[inline]
    fn absorb_next(&mut self, id: BlockId) {
        let next = self.blocks[id].next;
        let (next_size, after) = (self.blocks[next].size, self.blocks[next].next);
        self.blocks[id].size += next_size;
        self.blocks[id].next = after;
        if after != NIL {
            self.blocks[after].prev = id;
        }
        self.blocks.remove(next);
    }

    /// Puts a free block into its pool's bin and counts it.
    #[inline]
    fn insert_free(&mut self, id: BlockId) {
        let b = &self.blocks[id];
        let (pool, size, whole, segment) = (b.pool, b.size, !b.is_split(), b.segment);
        let (split, counted) = self.inactive_split_bytes_of(id);
        let pool = &mut self.pools[pool as usize];
        if pool.vm.is_some() {
            self.blocks[id].idle_since_ms = self.clock.now_ms();
        }
        pool.insert(&mut self.blocks, id, size);
        if split {
            self.stats.inactive_split.increase(pool.kind, 1);
            self.stats.inactive_split_bytes.increase(pool.kind, counted);
        }
        if whole {
            let Some(segment) = self.segments[segment as usize].as_mut() else {
                return;
            };
            segment.idle_since_ms = self.clock.now_ms();
        }
    }

    /// Takes a free block out of its pool's bin and uncounts it.
    #[inline]
    fn remove_free(&mut self, id: BlockId) {
        let b = &self.blocks[id];
        let (pool, size) = (b.pool, b.size);
        let (split, counted) = self.inactive_split_bytes_of(id);
        let pool = &mut self.pools[pool as usize];
        pool.remove(&mut self.blocks, id, size);
        if split {
            self.stats.inactive_split.decrease(pool.kind, 1);
            self.stats.inactive_split_bytes.decrease(pool.kind, counted);
        }
    }

    /// Whether the free block `id` counts as inactive split (free memory
    /// that only a request fitting the block can use and that cannot go
    /// back to the driver while the block's neighbours are in use), and
    /// its bytes that do. A block that is not its whole segment counts with
    /// all its bytes. In an expandable segment only the bytes of its edge
    /// pages count (the pages inside it can be unmapped), and the range's
    /// last block not at all (it grows to fit any request).
    #[inline(always)]
    fn inactive_split_bytes_of(&self, id: BlockId) -> (bool, u64) {
        let b = &self.blocks[id];
        if !b.is_split() {
            return (false, 0);
        }
        if self.pool_vm(b.pool).is_none() {
            return (true, b.size);
        }
        match self.segments[b.segment as usize].as_ref().and_then(|s| Some((s.base, s.pages.as_ref()?))) {
            Some(_) if b.next == NIL => (false, 0),
            Some((base, pages)) => (true, pages.edge_bytes(b.addr - base, b.addr - base + b.size)),
            None => (true, b.size),
        }
    }

    /// Why `ptr` is not a live block (slow path: errors only).
    fn classify_invalid_free(&self, ptr: u64) -> InvalidFree {
        let Some((_, &segment_id)) = self.segment_by_base.range(..=ptr).next_back() else {
            return InvalidFree::Foreign;
        };
        let segment = self.segments[segment_id as usize].as_ref().expect("indexed segment exists");
        if ptr >= segment.base + segment.size {
            return InvalidFree::Foreign;
        }
        let mut cur = segment.first_block;
        while cur != NIL {
            let b = &self.blocks[cur];
            if ptr < b.addr + b.size {
                return if b.is_allocated() { InvalidFree::Interior { block: b.addr } } else { InvalidFree::NotLive };
            }
            cur = b.next;
        }
        InvalidFree::NotLive
    }

    /// The segment holding `ptr`: its base and size.
    pub fn segment_of(&self, ptr: u64) -> Option<(u64, u64)> {
        let (_, &id) = self.segment_by_base.range(..=ptr).next_back()?;
        let segment = self.segments[id as usize].as_ref()?;
        let size = segment.pages.as_ref().map_or(segment.size, PageMap::end_bytes);
        (ptr < segment.base + size).then_some((segment.base, size))
    }

    /// Every segment with its blocks in address order, for snapshots. An
    /// expandable segment shows as one segment per run of mapped pages
    /// (as PyTorch shows its own), its blocks cut to the run; a paused
    /// tag's range, as the runs resume maps again, marked paused.
    pub fn snapshot(&mut self) -> Vec<SegmentSnapshot> {
        self.flush_stashes();
        let paused = self.paused_ranges();
        let mut out = Vec::new();
        for segment in self.segments.iter().flatten() {
            let saved = paused.get(&segment.base);
            let runs = match &segment.pages {
                Some(_) if saved.is_some() => saved.into_iter().flatten().map(|&(a, n)| (a - segment.base, a - segment.base + n)).collect(),
                Some(pages) => {
                    let page = pages.page_size();
                    pages.runs(0, pages.end_bytes() / page, true).into_iter().map(|(p, n)| (p * page, (p + n) * page)).collect()
                }
                None => vec![(0, segment.size)],
            };
            let pool = &self.pools[segment.pool as usize];
            // Blocks and runs both ascend: one walk over the blocks.
            let mut cur = segment.first_block;
            for (start, end) in runs {
                let (start, end) = (segment.base + start, segment.base + end);
                let mut blocks = Vec::new();
                while cur != NIL && self.blocks[cur].addr < end {
                    let b = &self.blocks[cur];
                    let (from, to) = (b.addr.max(start), (b.addr + b.size).min(end));
                    if from < to {
                        let (address, size, requested, context) = (from, to - from, b.requested, self.context_of(b.addr));
                        let (allocated, pending) = (b.is_allocated(), b.state == BlockState::Pending);
                        blocks.push(BlockSnapshot { address, size, requested, allocated, pending, context });
                    }
                    if b.addr + b.size > end {
                        break; // the block goes on into the next run
                    }
                    cur = b.next;
                }
                out.push(SegmentSnapshot {
                    address: start,
                    size: end - start,
                    stream: pool.stream,
                    kind: pool.kind,
                    expandable: segment.pages.is_some(),
                    private: pool.private,
                    tag: crate::tag::TagId(pool.tag),
                    paused: saved.is_some(),
                    blocks,
                });
            }
        }
        out.sort_by_key(|s| s.address);
        out
    }

    /// The size of the live block at `ptr`, if there is one.
    pub fn live_size(&self, ptr: u64) -> Option<u64> {
        self.by_addr.get(ptr).filter(|&id| self.blocks[id].is_allocated()).map(|id| self.blocks[id].size)
    }

    /// Runs `again`, a request that failed as out of memory tried once more
    /// (after the other shards or processes gave memory back): a new failure
    /// is not counted or recorded again, and a success retracts the first
    /// failure's count.
    fn retried<T>(&mut self, again: impl FnOnce(&mut Self) -> Result<T, AllocError>) -> Result<T, AllocError> {
        self.retrying = true;
        let result = again(self);
        self.retrying = false;
        if result.is_ok() {
            self.stats.events.num_ooms = self.stats.events.num_ooms.saturating_sub(1);
        }
        result
    }

    /// `allocate_tagged` tried again after an out-of-memory (`retried`).
    #[cold]
    pub fn retry_allocate(&mut self, size: u64, stream: Stream, tag: crate::tag::TagId, context: u64) -> Result<u64, AllocError> {
        self.retried(|heap| heap.allocate_tagged(size, stream, tag, context))
    }

    /// `resume_tag` tried again after an out-of-memory (`retried`).
    #[cold]
    pub fn retry_resume_tag(&mut self, tag: crate::tag::TagId) -> Result<u64, AllocError> {
        self.retried(|heap| heap.resume_tag(tag))
    }

    /// Counts a free whose stated size differed from the block's.
    pub fn count_size_mismatch(&mut self) {
        self.stats.events.num_size_mismatches += 1;
    }

    /// The statistics, with the cache figures computed now (stashed
    /// blocks are merged first, so the figures are those of a merged heap).
    pub fn stats(&mut self) -> Stats {
        self.process_pending(false);
        self.flush_stashes();
        let mut stats = self.stats.report();
        let (paused, offloaded, unmapped_active) = self.paused_totals();
        (stats.paused_bytes, stats.offloaded_bytes) = (paused, offloaded);
        // With the stashes merged, every reserved byte not active (allocated,
        // or freed but pending) is cached; paused tags' blocks hold none.
        stats.cached_free_bytes = stats.reserved_bytes.all.current - (stats.active_bytes.all.current - unmapped_active);
        let classic =
            (0..self.pools.len() as u32).filter(|&p| self.pool_vm(p).is_none()).map(|p| self.pools[p as usize].largest(&self.blocks));
        stats.largest_free_block_bytes = classic.max().unwrap_or(0).max(self.largest_mapped_free_run());
        stats
    }

    pub fn reset_peak_stats(&mut self) {
        self.stats.reset_peaks();
    }

    pub fn reset_accumulated_stats(&mut self) {
        self.stats.reset_accumulated();
    }

    /// The report of an out-of-memory for `requested` bytes, which the
    /// other processes could serve by giving back `need_from_others`.
    fn oom_report(&mut self, requested: u64, need_from_others: u64) -> OomReport {
        let stats = self.stats();
        let info = self.backend.mem_info(self.device).ok();
        OomReport {
            device: self.device,
            requested,
            allocated: stats.allocated_bytes.all.current,
            reserved: stats.reserved_bytes.all.current,
            cached_free: stats.cached_free_bytes,
            largest_free_block: stats.largest_free_block_bytes,
            inactive_split: stats.inactive_split_bytes.all.current,
            fragmentation: stats.fragmentation(),
            device_free: info.map(|i| i.free),
            device_total: info.map(|i| i.total),
            reserved_limit: self.reserved_limit(),
            limit_is_budget: self.policy.max_reserved < self.reserve.limit(),
            expandable: self.vm.is_some(),
            capturing: !self.may_release(),
            need_from_others,
        }
    }

    /// Requested, allocated and reserved bytes now, over both pool kinds.
    /// Unlike `stats()`, merges nothing: watching does not change the heap.
    pub fn totals(&self) -> Totals {
        Totals {
            requested: self.stats.requested_bytes.total(),
            allocated: self.stats.allocated_bytes.total(),
            reserved: self.stats.reserved_bytes.total(),
        }
    }
}
