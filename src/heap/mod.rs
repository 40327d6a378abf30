//! The device heap: segments of one device split into blocks, the pools of
//! free blocks, and the statistics, kept consistent under one lock.
//!
//! A request is rounded (`SizeRules::round`), looked up in the pool of its
//! stream, private pool, tag and kind by best fit, and served from the
//! block found, split when the rest is worth keeping. With no fitting block
//! the heap grows by one segment from the backend (with expandable
//! segments, the large pool instead maps pages of one reserved range:
//! `expandable.rs`); when the backend refuses, the heap borrows another
//! stream's cached block or says it is exhausted, and the device runs the
//! out-of-memory ladder (`Device::after_oom`: the cache released, the
//! request retried, the other processes asked, the OOM counted once). A
//! free merges the block with its free neighbours and returns it to the
//! pool of the stream it was allocated on.
//!
//! The stash (the cached pair's fast path): a pool holds back its most
//! recently freed block, unmerged, until the next operation on the pool,
//! when that block is where best fit over the merged bins would put the
//! next request of its size (`stash_is_best_fit`: no free block before it,
//! none elsewhere that fits such a request better, and a free neighbour
//! after it that would be split off again to the same place in its bin),
//! so the stash saves work and never moves a block, nor changes the age of
//! one (tests/engine/model.rs compares every placement and driver call with the
//! stash off). A request of exactly that size takes it back with no split
//! and no merge; anything else merges it first (`flush_stash`), and so
//! does every operation that looks at the whole heap (release,
//! statistics). Allocation loops that free and reallocate the same sizes
//! thus cost one map lookup, however fragmented their pool; a whole segment
//! stashed and then idle counts as idle from when it is merged (at most
//! one reclaimer pass later).
//!
//! Files by what happens to a block: `allocate.rs` (a request served, or
//! the heap exhausted: the out-of-memory ladder that follows is the
//! device's), `free.rs` (a block freed: the stash, merging, the bins),
//! `report.rs` (statistics, snapshots, the out-of-memory report);
//! `release.rs` gives memory back (caps, the reclaimer's pass, what an OOM
//! needs from other processes); `streams.rs` keeps blocks safe across
//! streams (pending frees waiting for events, lending a block to another
//! stream when the device is full); `private.rs` routes allocations to
//! private pools (CUDA graphs, MemPools); `tags.rs` serves tagged
//! allocations from each tag's own pools and pauses and resumes a tag's
//! memory; `lent.rs` lends freed blocks to threads' caches and counts
//! what they do; `expandable.rs` and `recycle.rs` map and move the
//! pages of expandable segments (their page maps: `crate::page_map`);
//! `observe.rs` and `history.rs` are who watches the heap; `reserve.rs`
//! keeps the reserved count, its peak and its cap shared by the heaps of
//! one device; `pool.rs` and `block.rs` (with `crate::addr_map`) are the
//! data structures, `validate.rs` the invariants.
//!
//! Invariants, checked by `validate()`:
//! - the blocks of a segment tile it exactly, in address order, linked both ways;
//! - no two free blocks are neighbours, unless one of them is a stashed
//!   block or in a thread's cache;
//! - each free block is either in exactly one bin (the bin of its size, in
//!   its segment's pool) or the stash of its pool, where best fit would
//!   put the next request of its size;
//! - each allocated, pending, stashed or lent block is in `by_addr` under
//!   its address, and nothing else is; each lent block is on its thread
//!   cache's list (`lent.rs`, whose own invariants `validate_lending` checks);
//! - every gauge equals the sum recomputed from the blocks (stashed blocks
//!   count as free, but as inactive-split only once merged; pending blocks
//!   as active, not allocated; lent blocks as free while cached, allocated
//!   once handed out again);
//! - each pending block waits for as many queued events as it is named in,
//!   and at least one, or for the end of a capture (`streams.rs`);
//! - each pool grows as its tag and kind say (`Pool::vm`: pages of reserved
//!   ranges, or whole segments);
//! - each pool is filed once, under its own stream, private pool, tag and
//!   kind (`pools_by_key`), and every open private pool is held (`private.rs`);
//! - each kept context (`contexts`) is that of an allocated or pending
//!   block at its address, and the heap is `observed` while one is kept.
#![forbid(unsafe_code)]

mod allocate;
pub(crate) mod block;
mod expandable;
mod free;
pub(crate) mod history;
mod ids;
pub(crate) mod lent;
mod observe;
pub(crate) mod pool;
pub(crate) mod private;
mod recycle;
mod release;
mod report;
pub mod reserve;
mod segment;
mod streams;
pub(crate) mod tags;
mod validate;

use std::collections::HashMap;
use std::sync::Arc;

use crate::backend::{Backend, BackendError};
use crate::error::{AllocError, InvalidFree, OomReport};
use crate::page_map::PageMap;
use crate::reclaim::policy::Policy;
use crate::reclaim::Clock;
use crate::recording::rows::Action;
use crate::recording::{Recorder, TraceBuffer};
use crate::size_class::{PoolKind, SizeRules};
pub use crate::stats::Released;
use crate::stats::{Counters, Stats};
use crate::tag::TagId;
use crate::types::Stream;
use block::{BlockArena, BlockId, BlockState, ByAddr, NIL};
use expandable::Vm;
use history::{History, HistoryAction};
use ids::PoolId;
use observe::Observers;
use pool::{Pool, PoolKey, Pools};
use private::{PrivatePoolId, PrivatePools};
use reserve::Reserve;
use segment::Segments;
use streams::PendingFrees;

pub use free::Freed;
pub use ids::SegmentId;
pub use lent::{FreedOrLent, LentBlock};
pub use report::{BlockSnapshot, SegmentSnapshot, Totals};
pub use segment::Segment;

/// The heap of one device (or of one stream shard of a device). Aligned to
/// 128 bytes so that heaps side by side, used by different threads, share
/// no cache line.
#[repr(align(128))]
pub struct DeviceHeap {
    // What it is: its device, size rules and backend.
    device: usize,
    rules: SizeRules,
    backend: Arc<dyn Backend>,
    // Placement: blocks, segments, pools, and the lookups into them.
    blocks: BlockArena,
    segments: Segments,
    /// The pools, filed by stream, private pool, tag and kind.
    pools: Pools,
    /// Allocated and stashed blocks by address: the pointer lookup of `free`.
    by_addr: ByAddr,
    /// Whether frees go through the stash (see the top of this file).
    stash_enabled: bool,
    /// Expandable segments (`expandable:true`): page size and range size.
    vm: Option<Vm>,
    /// The most bytes one physical allocation of an expandable segment
    /// holds (`expandable.rs`: a run of new pages is mapped in allocations
    /// this large, and each goes back or moves only whole).
    max_allocation: u64,
    /// A block carved from freed memory gives back the larger allocation
    /// it ends inside (`expandable.rs`: `split_allocation_past`).
    split_allocations: bool,
    /// Which holes' pages move to where growth needs them (`recycle.rs`).
    recycling: recycle::Recycling,
    // Pools of their own: CUDA graphs and MemPools, tags.
    /// Graph pools and `MemPool`s (`private.rs`).
    private: PrivatePools,
    /// The pools of tags other than "default", and paused tags (`tags.rs`).
    tags: tags::Tags,
    // Streams (`streams.rs`).
    /// Live blocks used on streams other than their own (`record_stream`).
    recorded_streams: HashMap<u64, Vec<Stream>>,
    /// Freed blocks waiting for the events of the other streams that used them.
    pending: PendingFrees,
    /// Whether a full device may lend one stream's cached blocks to another.
    lend_across_streams: bool,
    // Giving memory back (`release.rs`).
    /// The device's reserved count and memory-fraction cap, shared with
    /// the other heaps of the device (one per stream shard).
    reserve: Arc<Reserve>,
    /// When to give memory back; the budget also caps growth.
    policy: Policy,
    /// The reclaimer's clock, for idle stamps.
    clock: Arc<Clock>,
    // What it counts and who watches.
    stats: Counters,
    /// The backend's driver calls on this device when the heap was made or
    /// its accumulated statistics last reset: `num_driver_calls` counts
    /// from there.
    driver_calls_at_reset: u64,
    /// Blocks lent to threads' caches and what those caches did (`lent.rs`).
    lending: lent::Lending,
    /// The recording, the history and the contexts (`observe.rs`).
    observers: Observers,
}

impl DeviceHeap {
    pub fn new(device: usize, rules: SizeRules, backend: Arc<dyn Backend>) -> DeviceHeap {
        DeviceHeap {
            driver_calls_at_reset: backend.driver_calls_on(device),
            device,
            rules,
            backend,
            blocks: BlockArena::new(),
            segments: Segments::default(),
            pools: Pools::default(),
            private: PrivatePools::default(),
            by_addr: ByAddr::default(),
            recorded_streams: HashMap::new(),
            pending: PendingFrees::default(),
            reserve: Arc::default(),
            policy: Policy { release_after_ms: u64::MAX, headroom: 0, headroom_min_idle_ms: 0, max_reserved: u64::MAX },
            clock: Clock::new(),
            stash_enabled: true,
            lend_across_streams: true,
            vm: None,
            max_allocation: crate::config::DEFAULT_EXPANDABLE_ALLOCATION,
            split_allocations: false,
            stats: Counters::default(),
            lending: lent::Lending::default(),
            observers: Observers::default(),
            tags: tags::Tags::default(),
            recycling: recycle::Recycling::default(),
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
    fn pool_id(&mut self, stream: Stream, kind: PoolKind) -> PoolId {
        if let Some(id) = self.pools.last_served(stream, kind) {
            return id;
        }
        let ids = self.pools_of(PoolKey { stream, private: self.private.routing(), tag: TagId::DEFAULT });
        self.pools.note_served(stream, ids);
        ids[kind as usize]
    }

    /// The (small, large) pools of `key`, created on first use: growing
    /// as expandable segments say for the "default" tag, in ranges of
    /// their own for any other.
    fn pools_of(&mut self, key: PoolKey) -> [PoolId; 2] {
        let vms = [PoolKind::Small, PoolKind::Large].map(|kind| self.vm_for(key.tag, kind));
        self.pools.of_key(key, |kind| {
            let mut pool = Pool::new(key.stream, kind, key.private);
            pool.tag = key.tag;
            pool.vm = vms[kind as usize];
            pool
        })
    }
}
