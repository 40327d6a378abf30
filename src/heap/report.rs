//! What the heap reports without changing what it holds: statistics,
//! snapshots of its segments and blocks, the segment of a pointer, the
//! report of an out-of-memory.

use std::collections::HashMap;

use super::block::BlockState;
use super::private::PrivatePoolId;
use super::DeviceHeap;
use crate::error::OomReport;
use crate::page_map::PageMap;
use crate::size_class::PoolKind;
use crate::stats::Stats;
use crate::tag::TagId;
use crate::types::Stream;

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

/// What one tag holds on one heap.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TagStats {
    /// Live blocks of the tag (count).
    pub allocations: u64,
    /// Bytes of the tag's live blocks (rounded sizes).
    pub allocated_bytes: u64,
    /// Device memory the tag's ranges hold now (mapped pages).
    pub reserved_bytes: u64,
    /// Device memory the pause gave back (0 unless paused).
    pub paused_bytes: u64,
    /// Host bytes holding the tag's contents while paused with offload.
    pub offloaded_bytes: u64,
    /// Whether the tag is paused.
    pub paused: bool,
}

impl std::ops::AddAssign for TagStats {
    fn add_assign(&mut self, other: TagStats) {
        self.allocations += other.allocations;
        self.allocated_bytes += other.allocated_bytes;
        self.reserved_bytes += other.reserved_bytes;
        self.paused_bytes += other.paused_bytes;
        self.offloaded_bytes += other.offloaded_bytes;
        self.paused |= other.paused;
    }
}

impl DeviceHeap {
    /// The segment holding `ptr`: its base and size.
    pub fn segment_of(&self, ptr: u64) -> Option<(u64, u64)> {
        let (_, segment) = self.segments.last_at_or_below(ptr)?;
        let size = segment.pages.as_ref().map_or(segment.size, PageMap::end_bytes);
        (ptr < segment.base + size).then_some((segment.base, size))
    }

    /// Every segment with its blocks in address order, for snapshots. An
    /// expandable segment shows as one segment per run of mapped pages
    /// (as PyTorch shows its own), its blocks cut to the run; a paused
    /// tag's range, as the runs resume maps again, marked paused.
    pub fn snapshot(&mut self) -> Vec<SegmentSnapshot> {
        self.recall_all();
        self.flush_stashes();
        let paused = self.paused_ranges();
        let mut out = Vec::new();
        for (_, segment) in self.segments.iter() {
            let saved = paused.get(&segment.base);
            let runs = match &segment.pages {
                Some(_) if saved.is_some() => saved.into_iter().flatten().map(|&(a, n)| (a - segment.base, a - segment.base + n)).collect(),
                Some(pages) => {
                    let page = pages.page_size();
                    pages.runs(0, pages.end_bytes() / page, true).into_iter().map(|(p, n)| (p * page, (p + n) * page)).collect()
                }
                None => vec![(0, segment.size)],
            };
            let pool = &self.pools[segment.pool];
            // Blocks and runs both ascend: one walk over the blocks.
            let mut walk = self.blocks.walk_segment(segment.first_block).peekable();
            for (start, end) in runs {
                let (start, end) = (segment.base + start, segment.base + end);
                let mut blocks = Vec::new();
                while let Some(&(_, b)) = walk.peek().filter(|(_, b)| b.addr < end) {
                    let (from, to) = (b.addr.max(start), (b.addr + b.size).min(end));
                    if from < to {
                        let (address, size, requested, context) = (from, to - from, b.requested, self.context_of(b.addr));
                        // A lent block is cached only between two operations of its thread.
                        let (allocated, pending) = (b.is_allocated() || b.state == BlockState::Lent, b.state == BlockState::Pending);
                        blocks.push(BlockSnapshot { address, size, requested, allocated, pending, context });
                    }
                    if b.addr + b.size > end {
                        break; // the block goes on into the next run
                    }
                    walk.next();
                }
                out.push(SegmentSnapshot {
                    address: start,
                    size: end - start,
                    stream: pool.stream,
                    kind: pool.kind,
                    expandable: segment.pages.is_some(),
                    private: pool.private,
                    tag: pool.tag,
                    paused: saved.is_some(),
                    blocks,
                });
            }
        }
        out.sort_by_key(|s| s.address);
        out
    }

    /// Whether `ptr` lies in one of this heap's segments or ranges (a
    /// block's address, any byte inside, or freed memory): the heap that
    /// must answer a free of it, which needs no device. One lookup in the
    /// address map (a block's address), else one in the segments by base.
    pub fn holds(&self, ptr: u64) -> bool {
        self.by_addr.get(ptr).is_some() || self.segments.containing(ptr).is_some()
    }

    /// The size of the live block at `ptr`, if there is one.
    pub fn live_size(&self, ptr: u64) -> Option<u64> {
        self.by_addr.get(ptr).filter(|&id| self.is_live(id)).map(|id| self.blocks[id].size)
    }

    /// The statistics, with the cache figures computed now (stashed
    /// blocks are merged first, so the figures are those of a merged heap)
    /// and the backend's driver calls on the device since the heap was made
    /// or last reset (those of every heap of the device: the backend counts
    /// per device).
    pub fn stats(&mut self) -> Stats {
        self.recall_all();
        self.process_pending(false);
        self.flush_stashes();
        let mut stats = self.stats.report();
        let (paused, offloaded, unmapped_active) = self.paused_totals();
        (stats.paused_bytes, stats.offloaded_bytes) = (paused, offloaded);
        // With the stashes merged, every reserved byte not active (allocated,
        // or freed but pending) is cached; paused tags' blocks hold none.
        stats.cached_free_bytes = stats.reserved_bytes.all.current - (stats.active_bytes.all.current - unmapped_active);
        let classic = self.pools.iter().filter(|(_, p)| p.vm.is_none()).map(|(_, p)| p.largest(&self.blocks));
        stats.largest_free_block_bytes = classic.max().unwrap_or(0).max(self.largest_mapped_free_run());
        stats.events.num_driver_calls = self.backend.driver_calls_on(self.device).saturating_sub(self.driver_calls_at_reset);
        stats
    }

    pub fn reset_peak_stats(&mut self) {
        self.disarm_all();
        self.stats.reset_peaks();
    }

    pub fn reset_accumulated_stats(&mut self) {
        self.disarm_all();
        self.stats.reset_accumulated();
        self.driver_calls_at_reset = self.backend.driver_calls_on(self.device);
    }

    /// The report of an out-of-memory for `requested` bytes, which the
    /// other processes could serve by giving back `need_from_others`.
    pub(super) fn oom_report(&mut self, requested: u64, need_from_others: u64) -> OomReport {
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
            limit_is_budget: self.limits.policy.max_reserved < self.limits.reserve.limit(),
            expandable: self.paging.vm.is_some(),
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

    /// What `tag` holds on this heap; nothing for "default", which has no
    /// pools of its own (`stats()` has what untagged allocations hold).
    pub fn tag_stats(&mut self, tag: TagId) -> TagStats {
        if tag == TagId::DEFAULT {
            return TagStats::default();
        }
        for pool in self.pools.of_tag(tag) {
            self.flush_stash(pool);
        }
        let mut stats = TagStats::default();
        for id in self.tag_segments(tag) {
            let segment = self.segments.get(id).expect("listed");
            stats.reserved_bytes += segment.pages.as_ref().map_or(segment.size, |p| p.mapped_bytes());
            for (_, b) in self.blocks.walk_segment(segment.first_block).filter(|(_, b)| b.is_allocated()) {
                stats.allocations += 1;
                stats.allocated_bytes += b.size;
            }
        }
        if let Some(paused) = self.tags.paused.get(&tag) {
            stats.paused = true;
            stats.paused_bytes = paused.given_back;
            stats.offloaded_bytes = paused.offloaded_bytes();
        }
        stats
    }

    /// Device bytes given back by paused tags, host bytes holding their
    /// contents (`Stats::paused_bytes`, `offloaded_bytes`), and the bytes
    /// of their active blocks on unmapped pages (active, but holding no
    /// device memory).
    pub(super) fn paused_totals(&mut self) -> (u64, u64, u64) {
        if self.tags.paused.is_empty() {
            return (0, 0, 0);
        }
        let (mut given, mut held, mut unmapped) = (0, 0, 0);
        for (&tag, paused) in &self.tags.paused {
            given += paused.given_back;
            held += paused.offloaded_bytes();
            for id in self.tag_segments(tag) {
                let segment = self.segments.get(id).expect("listed");
                let Some(pages) = segment.pages.as_ref() else { continue };
                for (_, b) in self.blocks.walk_segment(segment.first_block).filter(|(_, b)| b.is_active()) {
                    let offset = b.addr - segment.base;
                    unmapped += b.size - pages.mapped_bytes_within(offset, offset + b.size);
                }
            }
        }
        (given, held, unmapped)
    }

    /// The paused state of the ranges, for snapshots: the base of every
    /// range of a paused tag, with its saved runs as (address, bytes).
    pub(super) fn paused_ranges(&self) -> HashMap<u64, Vec<(u64, u64)>> {
        let page = self.tags.page();
        let mut out: HashMap<u64, Vec<(u64, u64)>> = HashMap::new();
        for (&tag, paused) in &self.tags.paused {
            for id in self.tag_segments(tag) {
                let base = self.segments.get(id).expect("listed").base;
                out.entry(base).or_default();
            }
            for run in &paused.runs {
                out.entry(run.base).or_default().push((run.base + run.first_page * page, run.pages * page));
            }
        }
        for runs in out.values_mut() {
            runs.sort_unstable();
        }
        out
    }
}
