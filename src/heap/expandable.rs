//! Expandable segments (`expandable:true`): the large pool of each stream
//! grows inside one large reserved range of address space instead of
//! separate segments, and memory is held page by page. (The small pool
//! keeps its segments: they are one page each, and small blocks packed
//! across page boundaries would pin two pages where one would do.)
//!
//! A range is reserved (no memory) when a pool first needs one, as large as
//! the device, and starts as one free block; blocks are carved from it by
//! the ordinary best fit, so a pool's blocks pack against each other across
//! what would have been segment boundaries. Before a block is handed out,
//! the pages under it that hold no memory are mapped (`map_block`). A page
//! lying entirely inside free blocks can be unmapped when a release policy
//! asks for memory (`release_free_pages`): holes left by freed blocks give
//! their memory back even while live blocks sit on both sides, and the
//! address space stays for the next block to land there.
//!
//! Invariants (checked by `validate()`):
//! - every page touched by an allocated or stashed block is mapped, so an
//!   unmapped page lies inside one free block;
//! - `reserved_bytes` counts mapped pages; `inactive_split_bytes` counts,
//!   of each free block but a range's last, the bytes of its edge pages:
//!   the free memory that neither goes back to the driver nor serves any
//!   request but one that fits the block.
#![forbid(unsafe_code)]

use std::sync::atomic::Ordering;

use super::block::{Block, BlockId, BlockState, NIL};
use super::history::HistoryAction;
use super::{DeviceHeap, Released, Segment};
use crate::backend::BackendError;
use crate::size_class::PoolKind;

/// Page size and range size of a heap's expandable segments.
#[derive(Clone, Copy, Debug)]
pub(super) struct Vm {
    pub page: u64,
    pub range: u64,
}

/// How many times its high-water mark a heap moves over its life. Decoding
/// (caches grown by `torch.cat`, every one replaced as it grows) needs
/// about one for its first call to `generate` and a little more; GPT-2
/// small decoding reserved 1.049x its peak of live bytes with one and
/// 1.008x with two, after which it moved nothing more.
const MOVES_PER_HIGH_WATER: u64 = 2;

/// What `recycle_before_growth` knows over the heap's life.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Recycling {
    /// The most bytes the heap has held reserved (as of its last growth;
    /// `reset_peak_stats` does not lower it).
    pub high_water: u64,
    /// Bytes given back so that the heap would not grow past `high_water`.
    /// Moving starts only while this is below `MOVES_PER_HIGH_WATER` times
    /// `high_water`: a workload whose layout drifts from step to step pays
    /// a bounded number of driver calls, once, and then holds its memory
    /// as it is.
    pub moved: u64,
    /// Frees so far (counted in heaps with expandable segments): the clock
    /// that orders free blocks by age, the same in a live run and a replay.
    pub frees: u64,
}

/// The most address space one range reserves (a request larger than this
/// gets a range of its own size).
const MAX_RANGE: u64 = 1 << 40;

impl DeviceHeap {
    /// Turns expandable segments on or off; only before the first allocation.
    /// Fails, leaving them off, when the backend cannot map pages.
    pub fn set_expandable(&mut self, on: bool) -> Result<(), String> {
        if self.segments.iter().any(Option::is_some) {
            return Err("expandable segments can only be switched before the first allocation".into());
        }
        if !on {
            self.vm = None;
            return Ok(());
        }
        let page = self
            .backend
            .vm_page_size(self.device)
            .filter(|p| p.is_power_of_two())
            .ok_or_else(|| format!("the {} backend cannot map pages; expandable segments stay off", self.backend.name()))?;
        let total = self.backend.mem_info(self.device).map_or(MAX_RANGE, |info| info.total);
        let range = total.clamp(page, MAX_RANGE).next_multiple_of(page);
        // A range is one huge free block: it must split for any request.
        self.rules.max_split_size = u64::MAX;
        self.vm = Some(Vm { page, range });
        Ok(())
    }

    /// The expandable-segment parameters for pools of `kind`, or None when
    /// that kind grows by whole segments.
    #[inline]
    pub(super) fn expandable_vm(&self, kind: PoolKind) -> Option<Vm> {
        self.vm.filter(|_| kind == PoolKind::Large)
    }

    /// Whether a free block of `block` bytes serving `rounded` is split. In
    /// an expandable segment any remainder of at least `min_block` is: it
    /// merges back with its neighbours like any free block, while left
    /// inside the allocation it would be held for the allocation's life.
    #[inline]
    pub(super) fn should_split(&self, pool: u32, block: u64, rounded: u64) -> bool {
        match self.pool_vm(pool) {
            Some(_) => block - rounded >= self.rules.min_block,
            None => self.rules.should_split(self.pools[pool as usize].kind, block, rounded),
        }
    }

    /// Whether this heap grows by expandable segments.
    pub fn is_expandable(&self) -> bool {
        self.vm.is_some()
    }

    /// Reserves address space for a new range holding at least `rounded`
    /// bytes: the device's size, halved while the reservation fails (an
    /// address space shared by many pools), but never below the request.
    pub(super) fn reserve_range(&mut self, vm: Vm, rounded: u64) -> Result<(u64, u64), BackendError> {
        let need = rounded.checked_next_multiple_of(vm.page).ok_or(BackendError::OutOfMemory)?;
        let mut size = vm.range.max(need);
        loop {
            match self.backend.vm_reserve(self.device, size) {
                Ok(base) => return Ok((base, size)),
                Err(_) if size / 2 >= need => size = (size / 2).next_multiple_of(vm.page),
                Err(err) => return Err(err),
            }
        }
    }

    /// Maps the unmapped pages under the part of the free, unbinned block
    /// `id` that a request of `rounded` bytes will use (all of it when the
    /// block will not be split). All or nothing: on failure no page stays
    /// mapped that was not before. Nothing to do outside expandable segments.
    pub(super) fn map_block(&mut self, id: BlockId, rounded: u64) -> Result<(), BackendError> {
        let b = &self.blocks[id];
        let (addr, size, segment_id, kind, pool) = (b.addr, b.size, b.segment as usize, b.kind, b.pool);
        if self.pool_vm(pool).is_none() {
            return Ok(());
        }
        let Some((base, pages)) = self.segments[segment_id].as_ref().and_then(|s| Some((s.base, s.pages.as_ref()?))) else {
            return Ok(());
        };
        let used = if self.should_split(pool, size, rounded) { rounded } else { size };
        let (first, count) = pages.touched(addr - base, addr - base + used);
        let runs = pages.runs(first, count, false);
        if runs.is_empty() {
            return Ok(());
        }
        let page = pages.page_size();
        self.recycle_before_growth(runs.iter().map(|&(_, n)| n * page).sum());
        let mut failed = None;
        for (done, &(p, n)) in runs.iter().enumerate() {
            let bytes = n * page;
            let mapped = self.claim_reserved(bytes).and_then(|()| {
                let result = self.backend.vm_map(self.device, base + p * page, bytes);
                if result.is_err() {
                    self.device_reserved.fetch_sub(bytes, Ordering::SeqCst);
                }
                result
            });
            if let Err(err) = mapped {
                failed = Some((done, err));
                break;
            }
        }
        let mut keep = runs.as_slice();
        if let Some((done, err)) = failed {
            // Undo the runs mapped so far; one the backend will not unmap
            // stays mapped (and counted), inside what is still a free block.
            keep = &runs[..done];
            let mut stuck = Vec::new();
            for &(p, n) in keep {
                if self.backend.vm_unmap(self.device, base + p * page, n * page).is_ok() {
                    self.device_reserved.fetch_sub(n * page, Ordering::SeqCst);
                } else {
                    stuck.push((p, n));
                }
            }
            self.commit_mapped(segment_id, kind, &stuck);
            return Err(err);
        }
        self.commit_mapped(segment_id, kind, keep);
        Ok(())
    }

    /// Marks runs of pages mapped and counts them.
    fn commit_mapped(&mut self, segment_id: usize, kind: PoolKind, runs: &[(u64, u64)]) {
        let Some(pages) = self.segments[segment_id].as_mut().and_then(|s| s.pages.as_mut()) else {
            return;
        };
        let page = pages.page_size();
        let mut total = 0;
        for &(p, n) in runs {
            pages.set_mapped(p, n);
            total += n;
        }
        let segment = self.segments[segment_id].as_ref().expect("checked above");
        let (base, stream) = (segment.base, self.pools[segment.pool as usize].stream);
        for &(p, n) in runs {
            self.note(HistoryAction::SegmentMap, base + p * page, n * page, stream);
        }
        self.stats.reserved_bytes.increase(kind, total * page);
        self.stats.events.num_pages_mapped += total;
        self.stats.events.num_device_alloc += runs.len() as u64;
    }

    /// Unmaps every page lying entirely inside the free blocks of the
    /// expandable segment `segment_id`, after the work queued on its
    /// stream has run; a range left with no memory and no block goes back
    /// whole. Pages the backend fails to unmap stay mapped and counted.
    pub(super) fn release_free_pages(&mut self, segment_id: u32) -> Released {
        let mut released = Released::default();
        let Some(segment) = self.segments[segment_id as usize].as_ref() else {
            return released;
        };
        let stream = self.pools[segment.pool as usize].stream;
        let mut free_blocks = Vec::new();
        self.free_blocks_with_pages(segment, |_| true, &mut free_blocks);
        if !free_blocks.is_empty() {
            // Work already queued on the pool's stream may still use these pages.
            if self.backend.synchronize_stream(self.device, stream).is_err() {
                self.stats.events.num_stream_sync_errors += 1;
                return released;
            }
            for (block, _) in free_blocks {
                released.bytes += self.unmap_inside(block);
            }
        }
        released += self.free_empty_range(segment_id);
        released
    }

    /// Appends to `out` the binned free blocks of the expandable `segment`
    /// that `select` picks and that have mapped pages lying entirely inside
    /// them, each with those pages' bytes (what unmapping it would give back).
    /// None while private pools keep their memory, in theirs.
    fn free_blocks_with_pages(&self, segment: &Segment, select: impl Fn(&Block) -> bool, out: &mut Vec<(BlockId, u64)>) {
        let Some(pages) = segment.pages.as_ref() else { return };
        if self.keeps_memory(segment.pool) {
            return;
        }
        let page = pages.page_size();
        let mut cur = segment.first_block;
        while cur != NIL {
            let b = &self.blocks[cur];
            if b.state == BlockState::Binned && select(b) {
                let offset = b.addr - segment.base;
                let (first, count) = pages.inside(offset, offset + b.size);
                let bytes = pages.mapped_bytes_within(first * page, (first + count) * page);
                if bytes > 0 {
                    out.push((cur, bytes));
                }
            }
            cur = b.next;
        }
    }

    /// The free blocks of expandable segments, idle since `idle_before` or
    /// earlier, that hold unmappable pages while live blocks keep their
    /// range: each with the bytes it would give back. (A range with no live
    /// block is a whole free segment instead.)
    pub(super) fn holes_with_free_pages(&self, idle_before: u64) -> Vec<(BlockId, u64)> {
        let mut holes = Vec::new();
        for segment in self.segments.iter().flatten() {
            self.free_blocks_with_pages(segment, |b| b.is_split() && b.idle_since_ms <= idle_before, &mut holes);
        }
        holes
    }

    /// Before the heap takes `bytes` more from the device past its
    /// high-water mark, memory it caches and does not use goes back first,
    /// so that it moves to where it is needed instead of the peak rising:
    /// the free pages inside holes of every pool's ranges (the block about
    /// to be mapped is not binned, so it is never among them) and the small
    /// pools' segments that are one whole free block, longest free first.
    /// Below the high-water mark nothing moves, and over the heap's life it
    /// moves at most twice its high-water mark (`Recycling`).
    pub(super) fn recycle_before_growth(&mut self, bytes: u64) {
        if self.vm.is_none() || !self.may_release() {
            return;
        }
        let reserved = &self.stats.reserved_bytes;
        let recycling = &mut self.recycling;
        recycling.high_water = recycling.high_water.max(reserved.peak_total());
        let past_peak = (reserved.total() + bytes).saturating_sub(recycling.high_water);
        let mut want = past_peak.min((MOVES_PER_HIGH_WATER * recycling.high_water).saturating_sub(recycling.moved));
        if want == 0 {
            return;
        }
        self.flush_stashes(); // a stashed block is a hole too
        // (freed at, the hole's block, or the whole segment's id)
        let mut candidates: Vec<(u64, Result<BlockId, u32>)> = Vec::new();
        let mut holes = Vec::new();
        for (id, segment) in self.segments.iter().enumerate() {
            let Some(segment) = segment.as_ref() else { continue };
            if segment.pages.is_some() {
                self.free_blocks_with_pages(segment, |_| true, &mut holes);
                continue;
            }
            let b = &self.blocks[segment.first_block];
            if b.state == BlockState::Binned && b.next == NIL && !self.keeps_memory(segment.pool) {
                candidates.push((b.freed_at, Err(id as u32)));
            }
        }
        candidates.extend(holes.iter().map(|&(id, _)| (self.blocks[id].freed_at, Ok(id))));
        candidates.sort_by_key(|&(freed_at, _)| freed_at);
        for (_, candidate) in candidates {
            let got = match candidate {
                Ok(hole) => self.release_hole(hole),
                Err(segment) => self.release_whole_segment(segment).bytes,
            };
            self.recycling.moved += got;
            want = want.saturating_sub(got);
            if want == 0 {
                break;
            }
        }
    }

    /// Unmaps the free pages inside the free block `id` of an expandable
    /// segment once its stream's queued work has run. Returns the bytes.
    pub(super) fn release_hole(&mut self, id: BlockId) -> u64 {
        let stream = self.pools[self.blocks[id].pool as usize].stream;
        if self.backend.synchronize_stream(self.device, stream).is_err() {
            self.stats.events.num_stream_sync_errors += 1;
            return 0;
        }
        self.unmap_inside(id)
    }

    /// Unmaps the mapped pages lying entirely inside the binned free block
    /// `id` (whose stream has no work left on them). Returns the bytes unmapped.
    fn unmap_inside(&mut self, id: BlockId) -> u64 {
        let b = &self.blocks[id];
        let (addr, size, segment_id, kind) = (b.addr, b.size, b.segment as usize, b.kind);
        let Some((base, pages)) = self.segments[segment_id].as_ref().and_then(|s| Some((s.base, s.pages.as_ref()?))) else {
            return 0;
        };
        let page = pages.page_size();
        let (first, count) = pages.inside(addr - base, addr - base + size);
        let mut bytes = 0;
        for (p, n) in pages.runs(first, count, true) {
            if self.backend.vm_unmap(self.device, base + p * page, n * page).is_err() {
                continue;
            }
            let segment = self.segments[segment_id].as_mut().expect("checked above");
            let stream = self.pools[segment.pool as usize].stream;
            segment.pages.as_mut().expect("checked above").set_unmapped(p, n);
            self.note(HistoryAction::SegmentUnmap, base + p * page, n * page, stream);
            bytes += n * page;
            self.stats.events.num_pages_unmapped += n;
            self.stats.events.num_device_free += 1;
        }
        // Only pages inside the block go: its inactive-split bytes (its edge
        // pages) stay as they were.
        self.stats.reserved_bytes.decrease(kind, bytes);
        self.device_reserved.fetch_sub(bytes, Ordering::SeqCst);
        bytes
    }

    /// Gives back the expandable range `segment_id` if it is one free block
    /// with no page mapped.
    fn free_empty_range(&mut self, segment_id: u32) -> Released {
        let Some(segment) = self.segments[segment_id as usize].as_ref() else {
            return Released::default();
        };
        let block = segment.first_block;
        let b = &self.blocks[block];
        let empty = b.state == BlockState::Binned && b.next == NIL && segment.pages.as_ref().is_some_and(|p| p.mapped_bytes() == 0);
        if !empty || self.backend.vm_free(self.device, segment.base, segment.size).is_err() {
            return Released::default();
        }
        self.forget_segment(segment_id);
        Released { segments: 1, bytes: 0 }
    }

    /// The longest stretch of mapped memory inside one free block: the
    /// largest request the expandable segments serve without the driver.
    pub(super) fn largest_mapped_free_run(&self) -> u64 {
        let mut largest = 0;
        for segment in self.segments.iter().flatten() {
            let Some(pages) = segment.pages.as_ref() else {
                continue;
            };
            let mut cur = segment.first_block;
            while cur != NIL {
                let b = &self.blocks[cur];
                if b.state == BlockState::Binned && b.addr - segment.base < pages.end_bytes() {
                    let offset = b.addr - segment.base;
                    largest = largest.max(pages.longest_mapped_run(offset, offset + b.size));
                }
                cur = b.next;
            }
        }
        largest
    }
}
