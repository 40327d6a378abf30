//! `DeviceHeap::validate`: recomputes everything the heap keeps
//! incrementally and checks it against the invariants, one check per group
//! of them: those of the tables (`Pools`, `Segments`, `PendingFrees`,
//! `PrivatePools`: their own `check`), of each pool's growth and stash,
//! of each segment's tiling and each block's state (the walk that sums the
//! gauges), of the address map, the contexts and the pending blocks, of
//! the bins, of the gauges, and of paused tags. The invariants are listed
//! in `heap/mod.rs` (and, for expandable segments, `heap/expandable.rs`;
//! for tags, `heap/tags.rs`; for the pools' bins, `heap/pool.rs`). Threads'
//! caches have their own check, `validate_lending` (`lent.rs`), which
//! callers run first.
#![forbid(unsafe_code)]

use std::collections::HashSet;

use super::block::{Block, BlockId, BlockState, NIL};
use super::ids::SegmentId;
use super::segment::Segment;
use super::tags::Paused;
use super::DeviceHeap;
use crate::size_class::{bin_of, BIN_COUNT};
use crate::stats::Gauge;
use crate::tag::TagId;

macro_rules! ensure {
    ($cond:expr, $($msg:tt)+) => {
        if !$cond {
            return Err(format!($($msg)+));
        }
    };
}

/// Per-kind sums recomputed from the blocks.
#[derive(Default)]
struct Sums {
    allocation: [u64; 2],
    segment: [u64; 2],
    inactive_split: [u64; 2],
    allocated_bytes: [u64; 2],
    reserved_bytes: [u64; 2],
    inactive_split_bytes: [u64; 2],
    requested_bytes: [u64; 2],
    pending: [u64; 2],
    pending_bytes: [u64; 2],
}

/// What the walk over the segments' blocks found, for the checks after it.
#[derive(Default)]
struct Walked {
    sums: Sums,
    /// Free blocks neither stashed nor lent: each must be in exactly one bin.
    free_blocks: HashSet<BlockId>,
    active_blocks: usize,
    lent_blocks: usize,
    /// Block records reached from the segments.
    records: usize,
}

/// What the walk is told: the blocks stashed and those pending.
struct Known {
    stashed: HashSet<BlockId>,
    pending: HashSet<BlockId>,
}

/// What a segment's walk knows of the blocks already seen.
struct Cursor {
    expected_addr: u64,
    prev: BlockId,
    prev_free: bool,
}

fn check_gauge(name: &str, gauge: &Gauge, sums: [u64; 2]) -> Result<(), String> {
    let gauge = gauge.report();
    ensure!(gauge.small_pool.current == sums[0], "{name}.small_pool is {} but the blocks sum to {}", gauge.small_pool.current, sums[0]);
    ensure!(gauge.large_pool.current == sums[1], "{name}.large_pool is {} but the blocks sum to {}", gauge.large_pool.current, sums[1]);
    ensure!(gauge.all.current == sums[0] + sums[1], "{name}.all is {} but the pools sum to {}", gauge.all.current, sums[0] + sums[1]);
    for (pool, stat) in [("all", &gauge.all), ("small_pool", &gauge.small_pool), ("large_pool", &gauge.large_pool)] {
        ensure!(stat.peak >= stat.current, "{name}.{pool} peak {} below current {}", stat.peak, stat.current);
    }
    Ok(())
}

impl DeviceHeap {
    /// Checks every invariant of the heap; the error names the first broken one.
    pub fn validate(&self) -> Result<(), String> {
        let pending = self.streams.pending.check()?;
        self.private.check()?;
        self.pools.check()?;
        self.segments.check()?;
        let known = Known { stashed: self.check_pool_growth_and_stashes()?, pending };
        let mut walked = Walked::default();
        for (segment_id, segment) in self.segments.iter() {
            self.check_segment(segment_id, segment, &known, &mut walked)?;
        }
        self.check_records_and_address_map(&walked, known.stashed.len())?;
        self.check_contexts()?;
        self.check_recorded_streams()?;
        for &id in &known.pending {
            ensure!(self.blocks[id].state == BlockState::Pending, "block {id} waits for events but is {:?}", self.blocks[id].state);
        }
        self.check_bins(&walked.free_blocks)?;
        self.check_gauges(&walked.sums)?;
        self.check_tags()
    }

    /// Each pool grows as its tag and kind say; each stash holds a block
    /// of its pool, marked stashed, where best fit would put the next
    /// request of its size, its age unchanged. Returns the stashed blocks.
    fn check_pool_growth_and_stashes(&self) -> Result<HashSet<BlockId>, String> {
        let mut stashed = HashSet::new();
        for (pool_id, pool) in self.pools.iter() {
            let vm = self.vm_for(pool.tag, pool.kind);
            ensure!(pool.vm == vm, "pool {pool_id} grows by {:?} where its tag and kind say {vm:?}", pool.vm);
            if pool.stash == NIL {
                continue;
            }
            let b = &self.blocks[pool.stash];
            ensure!(
                b.state == BlockState::Stashed && b.pool == pool_id,
                "stash of pool {pool_id} holds block {} in state {:?} of pool {}",
                pool.stash,
                b.state,
                b.pool
            );
            let next_free = self.free_after(pool.stash);
            ensure!(
                self.stash_is_best_fit(pool.stash, next_free),
                "pool {pool_id} stashes block {}, where best fit would not put the next request of its size",
                pool.stash
            );
            ensure!(
                self.paging.vm.is_none() || next_free == NIL || self.blocks[next_free].freed_at == b.freed_at,
                "pool {pool_id} stashes block {} freed at {} beside block {next_free} freed at {}: the stash changed an age",
                pool.stash,
                b.freed_at,
                self.blocks[next_free].freed_at
            );
            stashed.insert(pool.stash);
        }
        Ok(stashed)
    }

    /// A segment's pages are consistent and aligned; its blocks tile it in
    /// address order, linked both ways, each checked and counted (`check_block`).
    fn check_segment(&self, segment_id: SegmentId, segment: &Segment, known: &Known, walked: &mut Walked) -> Result<(), String> {
        let k = self.pools[segment.pool].kind as usize;
        walked.sums.segment[k] += 1;
        let pages = segment.pages.as_ref();
        if let Some(pages) = pages {
            pages.check().map_err(|e| format!("segment {segment_id}: {e}"))?;
            // The driver maps at its own page; tidepool's may be a multiple.
            let driver_page = self.backend.vm_page_size(self.device).unwrap_or(pages.page_size());
            ensure!(
                segment.base.is_multiple_of(driver_page) && segment.size.is_multiple_of(pages.page_size()),
                "expandable segment {segment_id} is not page-aligned"
            );
        }
        walked.sums.reserved_bytes[k] += pages.map_or(segment.size, |p| p.mapped_bytes());
        let mut cursor = Cursor { expected_addr: segment.base, prev: NIL, prev_free: false };
        for (id, b) in self.blocks.walk_segment(segment.first_block) {
            walked.records += 1;
            ensure!(b.addr == cursor.expected_addr, "block {id} at {:#x}, expected {:#x}: segment not tiled", b.addr, cursor.expected_addr);
            ensure!(b.prev() == cursor.prev, "block {id} has a wrong prev link");
            ensure!(b.segment == segment_id && b.pool == segment.pool, "block {id} names the wrong segment or pool");
            self.check_block(id, b, segment, &cursor, known, walked)?;
            cursor = Cursor { expected_addr: cursor.expected_addr + b.size, prev: id, prev_free: b.state == BlockState::Binned };
        }
        ensure!(
            cursor.expected_addr == segment.base + segment.size,
            "segment {segment_id}: blocks cover {:#x} bytes of {:#x}",
            cursor.expected_addr - segment.base,
            segment.size
        );
        Ok(())
    }

    /// One block of `segment`: its size and state are possible, its pages
    /// mapped while in use, it is where the address map says, and it counts
    /// in the gauges as its state says (lent, active, stashed or free; a
    /// free one never beside another).
    fn check_block(
        &self,
        id: BlockId,
        b: &Block,
        segment: &Segment,
        cursor: &Cursor,
        known: &Known,
        walked: &mut Walked,
    ) -> Result<(), String> {
        let (k, pages) = (self.pools[segment.pool].kind as usize, segment.pages.as_ref());
        let (stashed, pending) = (&known.stashed, &known.pending);
        let sums = &mut walked.sums;
        ensure!(
            b.size > 0 && b.size.is_multiple_of(self.rules.min_block),
            "block {id} size {} not a positive multiple of min_block",
            b.size
        );
        ensure!(b.state != BlockState::Detached, "block {id} is detached outside an operation");
        ensure!(b.state != BlockState::Stashed || stashed.contains(&id), "block {id} is marked stashed but no pool stashes it");
        if b.state != BlockState::Binned && !self.pool_paused(segment.pool) {
            // Bytes of the block that hold memory.
            let held = pages.map_or(b.size, |p| p.mapped_bytes_within(b.addr - segment.base, b.addr - segment.base + b.size));
            ensure!(held == b.size, "block {id} at {:#x} is in use but not all its pages are mapped", b.addr);
        }
        if b.state == BlockState::Lent {
            walked.lent_blocks += 1;
            ensure!(self.by_addr.get(b.addr) == Some(id), "lent block {id} at {:#x} missing from the address map", b.addr);
            if !self.lent_is_cached(id)? {
                sums.allocation[k] += 1;
                sums.allocated_bytes[k] += b.size;
                sums.requested_bytes[k] += b.requested;
            }
        } else if b.is_active() {
            walked.active_blocks += 1;
            ensure!(self.by_addr.get(b.addr) == Some(id), "active block {id} at {:#x} missing from the address map", b.addr);
            ensure!(b.requested > 0 && b.requested <= b.size, "block {id} requested {} of {}", b.requested, b.size);
            ensure!(b.is_allocated() || pending.contains(&id), "block {id} is marked pending but waits for no event");
            if b.is_allocated() {
                sums.allocation[k] += 1;
                sums.allocated_bytes[k] += b.size;
                sums.requested_bytes[k] += b.requested;
            } else {
                sums.pending[k] += 1;
                sums.pending_bytes[k] += b.size;
            }
        } else if stashed.contains(&id) {
            ensure!(self.by_addr.get(b.addr) == Some(id), "stashed block {id} at {:#x} missing from the address map", b.addr);
            // A stashed block may touch free neighbours: it is merged
            // at the next operation on its pool.
        } else {
            ensure!(!cursor.prev_free, "free blocks {} and {id} are neighbours and were not merged", cursor.prev);
            walked.free_blocks.insert(id);
            // A range's last block grows to fit any request: not split.
            if b.is_split() && !(pages.is_some() && b.is_last()) {
                sums.inactive_split[k] += 1;
                sums.inactive_split_bytes[k] +=
                    pages.map_or(b.size, |p| p.pinned_bytes(b.addr - segment.base, b.addr - segment.base + b.size));
            }
        }
        Ok(())
    }

    /// Every block record in use is reached from a segment; the address
    /// map holds exactly the active, stashed and lent blocks; the slots'
    /// lists hold exactly the lent ones.
    fn check_records_and_address_map(&self, walked: &Walked, stashed: usize) -> Result<(), String> {
        let (records, active_blocks, lent_blocks) = (walked.records, walked.active_blocks, walked.lent_blocks);
        ensure!(records == self.blocks.len(), "{} block records in use but {records} reachable from segments", self.blocks.len());
        ensure!(
            active_blocks + stashed + lent_blocks == self.by_addr.len(),
            "{} address map entries for {active_blocks} active, {stashed} stashed and {lent_blocks} lent blocks",
            self.by_addr.len()
        );
        ensure!(lent_blocks == self.lent_listed(), "{lent_blocks} lent blocks, {} on the slots' lists", self.lent_listed());
        Ok(())
    }

    /// Each kept context is that of an active block at its address, and
    /// the heap is observed while one is kept.
    fn check_contexts(&self) -> Result<(), String> {
        for &addr in self.observers.contexts.keys() {
            let live = self.by_addr.get(addr).is_some_and(|id| self.blocks[id].is_active());
            ensure!(live, "a context is kept for {addr:#x}, which is no allocated or pending block");
        }
        ensure!(
            self.observers.contexts.is_empty() || self.observers.observed,
            "contexts are kept but frees are not observed: they would go stale"
        );
        Ok(())
    }

    /// Streams are recorded only for allocated blocks, and never a block's own.
    fn check_recorded_streams(&self) -> Result<(), String> {
        for (&addr, streams) in &self.streams.recorded {
            let block = self.by_addr.get(addr).filter(|&id| self.blocks[id].is_allocated());
            let Some(id) = block else {
                return Err(format!("streams are recorded for {addr:#x}, which is no allocated block"));
            };
            let own = self.pools[self.blocks[id].pool].stream;
            ensure!(!streams.contains(&own), "block {id} at {addr:#x} records its own stream {own:?}");
        }
        Ok(())
    }

    /// The bins (`pool.rs`'s invariants): bitmaps agree with the lists,
    /// each list holds free blocks of its bin in ascending size order,
    /// linked both ways, counted; every free block is in exactly one bin.
    fn check_bins(&self, free_blocks: &HashSet<BlockId>) -> Result<(), String> {
        let mut binned = HashSet::new();
        for (pool_id, pool) in self.pools.iter() {
            let (mut bytes, mut count) = (0u64, 0usize);
            for bin in 0..BIN_COUNT {
                let bit = pool.bins_nonempty[bin / 32] >> (bin % 32) & 1 == 1;
                ensure!(bit == (pool.heads[bin] != NIL), "pool {pool_id} bin {bin}: bitmap disagrees with the list");
                let mut last_size = 0;
                let mut link_prev = NIL;
                for id in pool.bin_members(&self.blocks, bin) {
                    let b = &self.blocks[id];
                    ensure!(
                        free_blocks.contains(&id),
                        "bin {bin} of pool {pool_id} holds block {id}, which is not a free block of a segment"
                    );
                    ensure!(binned.insert(id), "block {id} is in more than one bin");
                    ensure!(b.pool == pool_id, "block {id} of pool {} is binned in pool {pool_id}", b.pool);
                    ensure!(bin_of(b.size) == bin, "block {id} of size {} is in bin {bin}", b.size);
                    ensure!(b.size >= last_size, "bin {bin} of pool {pool_id} is not in ascending size order");
                    ensure!(b.link_prev() == link_prev, "block {id} has a wrong free-list back link");
                    last_size = b.size;
                    link_prev = id;
                    bytes += b.size;
                    count += 1;
                }
            }
            for row in 0..pool.bins_nonempty.len() {
                ensure!(
                    (pool.rows_nonempty >> row & 1 == 1) == (pool.bins_nonempty[row] != 0),
                    "pool {pool_id} row {row}: summary bit wrong"
                );
            }
            ensure!(
                bytes == pool.free_bytes && count == pool.free_blocks,
                "pool {pool_id} counts {} bytes in {} blocks, lists hold {bytes} in {count}",
                pool.free_bytes,
                pool.free_blocks
            );
        }
        ensure!(binned.len() == free_blocks.len(), "{} free blocks but {} binned", free_blocks.len(), binned.len());
        Ok(())
    }

    /// Every gauge equals the sum recomputed from the blocks.
    fn check_gauges(&self, sums: &Sums) -> Result<(), String> {
        let s = &self.stats;
        check_gauge("allocation", &s.allocation, sums.allocation)?;
        check_gauge("segment", &s.segment, sums.segment)?;
        check_gauge("inactive_split", &s.inactive_split, sums.inactive_split)?;
        check_gauge("allocated_bytes", &s.allocated_bytes, sums.allocated_bytes)?;
        check_gauge("reserved_bytes", &s.reserved_bytes, sums.reserved_bytes)?;
        check_gauge("inactive_split_bytes", &s.inactive_split_bytes, sums.inactive_split_bytes)?;
        check_gauge("requested_bytes", &s.requested_bytes, sums.requested_bytes)?;
        check_gauge("pending", &s.pending, sums.pending)?;
        check_gauge("pending_bytes", &s.pending_bytes, sums.pending_bytes)
    }

    /// The invariants of paused tags (`tags.rs`): "default" is never
    /// paused and a paused tag's pools stash nothing; each saved run is
    /// checked (`check_saved_runs`), and every page a live block of a
    /// paused tag touches is mapped or saved.
    fn check_tags(&self) -> Result<(), String> {
        ensure!(!self.tags.paused.contains_key(&TagId::DEFAULT), "the default tag is paused");
        for (id, pool) in self.pools.iter() {
            ensure!(pool.stash == NIL || !self.tags.is_paused(pool.tag), "pool {id} of paused tag {} stashes a block", pool.tag.0);
        }
        for (&tag_id, paused) in &self.tags.paused {
            self.check_saved_runs(tag_id, paused)?;
            let tag = tag_id.0;
            for id in self.tag_segments(tag_id) {
                let segment = &self.segments[id];
                let pages = segment.pages.as_ref().ok_or_else(|| format!("tag {tag}: segment {id} is not a range"))?;
                for (_, b) in self.blocks.walk_segment(segment.first_block).filter(|(_, b)| b.is_active()) {
                    let (first, count) = pages.touched(b.addr - segment.base, b.addr - segment.base + b.size);
                    for p in first..first + count {
                        let saved =
                            paused.runs.iter().any(|r| r.base == segment.base && (r.first_page..r.first_page + r.pages).contains(&p));
                        ensure!(
                            pages.is_mapped(p) || saved,
                            "tag {tag}: page {p} of the live block at {:#x} is neither mapped nor saved",
                            b.addr
                        );
                    }
                }
            }
        }
        Ok(())
    }

    /// The saved runs of the paused `tag_id` lie in its ranges, each needed
    /// by an active block, holding host memory of their size exactly when
    /// the pause offloaded.
    fn check_saved_runs(&self, tag_id: TagId, paused: &Paused) -> Result<(), String> {
        let (tag, page) = (tag_id.0, self.tags.page());
        for run in &paused.runs {
            self.segment_pages(run.base).ok_or_else(|| format!("tag {tag}: a saved run names no range at {:#x}", run.base))?;
            let owner = self.segments.at_base(run.base).expect("a range of the tag");
            ensure!(self.pools[self.segments[owner].pool].tag == tag_id, "tag {tag}: a saved run lies in a range of another tag");
            let (_, touched) = self.touched_pages(owner);
            ensure!(
                touched.iter().any(|&(s, e)| s < run.first_page + run.pages && run.first_page < e),
                "tag {tag}: a saved run at {:#x} is needed by no active block",
                run.base + run.first_page * page
            );
            match &run.data {
                Some(data) if !paused.offload || data.bytes().len() as u64 != run.pages * page => {
                    return Err(format!("tag {tag}: a saved run holds {} host bytes for {} pages", data.bytes().len(), run.pages))
                }
                None if paused.offload => return Err(format!("tag {tag}: an offloaded run holds no host memory")),
                _ => {}
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::super::DeviceHeap;
    use crate::backend::host::HostBackend;
    use crate::size_class::{PoolKind, SizeRules};
    use crate::types::Stream;

    fn heap_with_holes() -> (DeviceHeap, Vec<u64>) {
        let mut heap = DeviceHeap::new(0, SizeRules::default(), Arc::new(HostBackend::new(1, 1 << 30)));
        let ptrs: Vec<u64> = (0..6).map(|_| heap.allocate(4096, Stream::DEFAULT).unwrap()).collect();
        heap.free(ptrs[1]).unwrap();
        heap.free(ptrs[3]).unwrap();
        heap.stats(); // merges the stash
        heap.validate().unwrap();
        (heap, ptrs)
    }

    // Each test breaks one invariant by hand and checks that validate() names it.

    #[test]
    fn a_stat_that_drifts_from_the_blocks_is_caught() {
        let (mut heap, _) = heap_with_holes();
        heap.stats.allocated_bytes.increase(PoolKind::Small, 512);
        assert!(heap.validate().unwrap_err().contains("allocated_bytes"));
    }

    #[test]
    fn a_gap_between_blocks_is_caught() {
        let (mut heap, ptrs) = heap_with_holes();
        let id = heap.by_addr.get(ptrs[2]).unwrap();
        heap.blocks[id].addr += 512;
        assert!(heap.validate().unwrap_err().contains("not tiled"));
    }

    #[test]
    fn unmerged_free_neighbours_are_caught() {
        let (mut heap, ptrs) = heap_with_holes();
        // Free block 2 by hand, next to the free block 1 (and 3), without merging.
        let id = heap.by_addr.remove(ptrs[2]).unwrap();
        heap.stats.allocated_bytes.decrease(PoolKind::Small, 4096);
        heap.stats.requested_bytes.decrease(PoolKind::Small, 4096);
        heap.stats.allocation.decrease(PoolKind::Small, 1);
        heap.insert_free(id);
        assert!(heap.validate().unwrap_err().contains("not merged"));
    }

    #[test]
    fn a_free_block_missing_from_its_bin_is_caught() {
        let (mut heap, ptrs) = heap_with_holes();
        let hole = heap.blocks[heap.by_addr.get(ptrs[0]).unwrap()].next();
        let size = heap.blocks[hole].size;
        heap.pools[super::super::ids::PoolId::new(0)].remove(&mut heap.blocks, hole, size);
        heap.blocks[hole].state = super::BlockState::Binned;
        assert!(heap.validate().is_err());
    }

    #[test]
    fn a_broken_bitmap_is_caught() {
        let (mut heap, _) = heap_with_holes();
        heap.pools[super::super::ids::PoolId::new(0)].bins_nonempty[3] ^= 1;
        assert!(heap.validate().unwrap_err().contains("bitmap"));
    }

    #[test]
    fn a_live_block_missing_from_the_address_map_is_caught() {
        let (mut heap, ptrs) = heap_with_holes();
        heap.by_addr.remove(ptrs[4]);
        assert!(heap.validate().unwrap_err().contains("address map"));
    }

    #[test]
    fn a_pending_block_that_waits_for_nothing_is_caught() {
        let (mut heap, ptrs) = heap_with_holes();
        let id = heap.by_addr.get(ptrs[4]).unwrap();
        heap.blocks[id].state = super::BlockState::Pending;
        assert!(heap.validate().unwrap_err().contains("waits for no event"));
    }

    #[test]
    fn a_context_left_for_a_freed_block_is_caught() {
        let (mut heap, _) = heap_with_holes();
        let p = heap.allocate_with_context(4096, Stream::DEFAULT, 9).unwrap();
        heap.validate().unwrap();
        heap.free(p).unwrap();
        heap.validate().unwrap();
        heap.observers.contexts.insert(p, 9); // freed (and stashed): no longer live
        assert!(heap.validate().unwrap_err().contains("no allocated or pending block"));
    }

    #[test]
    fn a_stream_recorded_for_a_freed_block_is_caught() {
        let (mut heap, ptrs) = heap_with_holes();
        heap.record_stream(ptrs[2], Stream(7)).unwrap();
        heap.validate().unwrap();
        heap.streams.recorded.insert(ptrs[1], vec![Stream(7)]); // ptrs[1] is free
        assert!(heap.validate().unwrap_err().contains("no allocated block"));
    }

    #[test]
    fn a_block_recording_its_own_stream_is_caught() {
        let (mut heap, ptrs) = heap_with_holes();
        heap.streams.recorded.insert(ptrs[2], vec![Stream::DEFAULT]);
        assert!(heap.validate().unwrap_err().contains("records its own stream"));
    }
}
