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
//! `routing.rs` (which pools serve a request, and how each grows),
//! `report.rs` (statistics, tags' figures, snapshots, the out-of-memory
//! report); `release.rs` gives memory back (`Limits`: caps, the policy and
//! its clock; the reclaimer's pass; what an OOM needs from other
//! processes); `streams.rs` keeps blocks safe across streams
//! (`StreamSafety`: pending frees waiting for events, cross-stream reuse
//! of a block cached for another stream when the device is full);
//! `private.rs` routes allocations to private pools (CUDA graphs,
//! MemPools); `tags.rs` pauses and resumes a tag's memory; `lent.rs`
//! lends freed blocks to threads' caches and counts what they do
//! (`Lending`); `expandable.rs` and `recycle.rs` map and move the pages of
//! expandable segments (`Paging`; their page maps: `crate::page_map`);
//! `observe.rs` and `history.rs` are who watches the heap; `reserve.rs`
//! keeps the reserved count, its peak and its cap shared by the heaps of
//! one device. The data structures: `ids.rs` (the typed identifiers),
//! `block.rs` (`BlockArena`, `ByAddr` over `crate::addr_map`),
//! `segment.rs` (`Segments`), `pool.rs` (`Pool`, `Pools`); `validate.rs`
//! checks the invariants, one check per group.
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
//!   and at least one, or for the end of a capture (`streams.rs`); streams
//!   are recorded only for allocated blocks, never a block's own stream;
//! - each pool grows as its tag and kind say (`Pool::vm`: pages of reserved
//!   ranges, or whole segments);
//! - each pool is filed once, under its own stream, private pool, tag and
//!   kind (`Pools::check`), and every open private pool is held (`private.rs`);
//! - each segment is filed under its base, and its slot is reused only once
//!   it is gone (`Segments::check`);
//! - each kept context (`contexts`) is that of an allocated or pending
//!   block at its address, and the heap is `observed` while one is kept.
#![forbid(unsafe_code)]

mod allocate;
mod block;
mod expandable;
mod free;
pub(crate) mod history;
mod ids;
mod lent;
mod observe;
mod pool;
pub(crate) mod private;
mod recycle;
mod release;
mod report;
pub mod reserve;
mod routing;
mod segment;
mod streams;
mod tags;
mod validate;

use std::sync::Arc;

use crate::backend::Backend;
use crate::size_class::SizeRules;
use crate::stats::Counters;
pub use crate::stats::Released;
use block::{BlockArena, BlockId, ByAddr, NIL};
use expandable::Paging;
use lent::Lending;
use observe::Observers;
use pool::Pools;
use private::PrivatePools;
use release::Limits;
use reserve::Reserve;
use segment::Segments;
use streams::StreamSafety;
use tags::Tags;

pub use free::Freed;
pub use ids::SegmentId;
pub use lent::{FreedOrLent, LentBlock};
pub use report::{BlockSnapshot, SegmentSnapshot, TagStats, Totals};
pub use segment::Segment;

/// The heap of one device (or of one stream shard of a device). Aligned to
/// 128 bytes so that heaps side by side, used by different threads, share
/// no cache line.
///
/// Each part owns its data and says, with its type, which file keeps it;
/// the invariants that tie parts together are at the top of this file.
#[repr(align(128))]
pub struct DeviceHeap {
    // What it is: its device, size rules and backend.
    device: usize,
    rules: SizeRules,
    backend: Arc<dyn Backend>,
    // Placement: blocks, segments, pools, and the lookups into them.
    /// Every block record (`block.rs`).
    blocks: BlockArena,
    /// Every segment or reserved range, by id and base (`segment.rs`).
    segments: Segments,
    /// The pools, filed by stream, private pool, tag and kind (`pool.rs`).
    pools: Pools,
    /// Allocated, pending, stashed and lent blocks by address: the pointer
    /// lookup of `free` (free blocks in the bins are not in it).
    by_addr: ByAddr,
    /// Whether frees go through the stash (see the top of this file).
    stash_enabled: bool,
    /// How expandable segments map and move pages (`expandable.rs`, `recycle.rs`).
    paging: Paging,
    // Pools of their own: CUDA graphs and MemPools, tags.
    /// Graph pools and `MemPool`s (`private.rs`).
    private: PrivatePools,
    /// Paused tags and the page of tags' ranges (`tags.rs`; their pools are in `pools`).
    tags: Tags,
    /// Blocks used on other streams, frees waiting for their events, and
    /// reuse across streams (`streams.rs`).
    streams: StreamSafety,
    /// The reserved count and cap shared by the device's heaps, the release
    /// policy and its clock (`release.rs`).
    limits: Limits,
    // What it counts and who watches.
    stats: Counters,
    /// The backend's driver calls on this device when the heap was made or
    /// its accumulated statistics last reset: `num_driver_calls` counts
    /// from there.
    driver_calls_at_reset: u64,
    /// Blocks lent to threads' caches and what those caches did (`lent.rs`).
    lending: Lending,
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
            by_addr: ByAddr::default(),
            stash_enabled: true,
            paging: Paging::default(),
            private: PrivatePools::default(),
            tags: Tags::default(),
            streams: StreamSafety::default(),
            limits: Limits::default(),
            stats: Counters::default(),
            lending: Lending::default(),
            observers: Observers::default(),
        }
    }

    /// Lets (or stops) a full device serve one stream from blocks cached
    /// for another: cross-stream reuse (`streams.rs`; the
    /// `lend_across_streams` option). "Lending" is what the heap does with
    /// threads' caches (`lent.rs`).
    pub fn set_cross_stream_reuse(&mut self, on: bool) {
        self.streams.cross_stream_reuse = on;
    }

    /// Shares the device's reserved count and cap with the other heaps of the device.
    pub fn share_reserve(&mut self, reserve: Arc<Reserve>) {
        self.limits.reserve = reserve;
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

    /// The blocks of segment `id` in address order (none once it is gone).
    fn blocks_of(&self, id: SegmentId) -> impl Iterator<Item = (BlockId, &block::Block)> + '_ {
        self.blocks.walk_segment(self.segments.get(id).map_or(NIL, |s| s.first_block))
    }
}
