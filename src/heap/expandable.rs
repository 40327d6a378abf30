//! Expandable segments (`expandable:true`): the large pool of each stream
//! grows inside one large reserved range of address space instead of
//! separate segments, and memory is held page by page. (The small pool
//! keeps its segments: they are one page each, and small blocks packed
//! across page boundaries would pin two pages where one would do.) Owns
//! `Paging` (whether and how the heap maps pages) and the range-sizing
//! rule (`ranges_of`, `MAX_RANGE`), which tags' ranges share.
//!
//! A range is reserved (no memory) when a pool first needs one, as large as
//! the device, and starts as one free block; blocks are carved from it by
//! the ordinary best fit, so a pool's blocks pack against each other across
//! what would have been segment boundaries. Before a block is handed out,
//! the pages under it that hold no memory are mapped (`map_block`), in
//! physical allocations of one or more pages (`page_map.rs`: the driver
//! takes an allocation back only whole; with `split_allocations`, a block
//! carved from freed memory that ends inside a larger allocation gives it
//! back first and maps its own pages). An allocation lying entirely inside free
//! blocks can be unmapped when a release policy asks for memory
//! (`release_free_pages`): holes left by freed blocks give their memory
//! back even while live blocks sit on both sides, and the address space
//! stays for the next block to land there.
//!
//! Invariants (checked by `validate()`):
//! - every page touched by an allocated or stashed block is mapped, so an
//!   unmapped page lies inside one free block;
//! - `reserved_bytes` counts mapped pages; `inactive_split_bytes` counts,
//!   of each free block but a range's last, the bytes held by allocations
//!   that reach outside it (`PageMap::pinned_bytes`): the free memory that
//!   neither goes back to the driver nor serves any request but one that
//!   fits the block.
#![forbid(unsafe_code)]

use super::block::{Block, BlockId, BlockState};
use super::history::HistoryAction;
use super::ids::{PoolId, SegmentId};
use super::recycle::{self, Donor, Recycling};
use super::{DeviceHeap, Released, Segment};
use crate::backend::BackendError;
use crate::error::ExpandableError;
use crate::page_map::{self, PageMap};
use crate::size_class::PoolKind;

/// Pages `map_block` maps: `pages` from page `first`, an edge page (an
/// allocation of its own) or not; a donor placed in it may reach up to
/// page `room_end`.
#[derive(Clone, Copy, Debug)]
struct Piece {
    first: u64,
    pages: u64,
    room_end: u64,
    edge: bool,
}

/// How a heap maps and moves pages: expandable segments and their
/// physical allocations, and the moves of cached pages (`recycle.rs`).
pub(super) struct Paging {
    /// Expandable segments (`expandable:true`): page size and range size;
    /// None: off.
    pub vm: Option<Vm>,
    /// The most bytes one physical allocation of an expandable segment
    /// holds (a run of new pages is mapped in allocations this large, and
    /// each goes back or moves only whole).
    pub max_allocation: u64,
    /// A block carved from freed memory gives back the larger allocation
    /// it ends inside (`split_allocation_past`).
    pub split_allocations: bool,
    /// Which holes' pages move to where growth needs them (`recycle.rs`).
    pub recycling: Recycling,
}

impl Default for Paging {
    fn default() -> Paging {
        Paging {
            vm: None,
            max_allocation: crate::config::DEFAULT_EXPANDABLE_ALLOCATION,
            split_allocations: false,
            recycling: Recycling::default(),
        }
    }
}

/// Page size and range size of a heap's expandable segments.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Vm {
    pub page: u64,
    pub range: u64,
}

/// The most address space one range reserves (a request larger than this
/// gets a range of its own size).
const MAX_RANGE: u64 = 1 << 40;

impl DeviceHeap {
    /// Turns expandable segments on or off; only before the first allocation.
    /// Fails, leaving them off, when the backend cannot map pages.
    pub fn set_expandable(&mut self, on: bool) -> Result<(), ExpandableError> {
        if !self.segments.is_empty() {
            return Err(ExpandableError::SwitchedAfterAllocation);
        }
        if !on {
            self.paging.vm = None;
            self.refresh_pool_vms();
            return Ok(());
        }
        let page = self.mappable_page().ok_or(ExpandableError::NoVirtualMemory { backend: self.backend.name() })?;
        self.use_page(page);
        Ok(())
    }

    /// Expandable segments of `page` bytes, in ranges as large as the
    /// device, for the default pools made so far and to come.
    fn use_page(&mut self, page: u64) {
        self.paging.vm = Some(self.ranges_of(page));
        self.refresh_pool_vms();
    }

    /// The backend's page, when it maps pages (a power of two).
    pub(super) fn mappable_page(&self) -> Option<u64> {
        self.backend.vm_page_size(self.device).filter(|p| p.is_power_of_two())
    }

    /// Ranges of `page`-byte pages as large as the device (its size unknown:
    /// `MAX_RANGE`), at most `MAX_RANGE` and at least a page: the ranges of
    /// expandable segments and of tags' large pools.
    pub(super) fn ranges_of(&self, page: u64) -> Vm {
        let total = self.backend.mem_info(self.device).map_or(MAX_RANGE, |info| info.total);
        Vm { page, range: total.min(MAX_RANGE).max(page).next_multiple_of(page) }
    }

    /// Maps physical memory `page` bytes at a time in the expandable
    /// segments just turned on: a multiple of the backend's page (the
    /// replay's model of PyTorch maps 20 MiB at a time). Only before the
    /// first allocation. With a page larger than the backend's, no cached
    /// page moves (`recycle.rs`: pages move between ranges of one page size).
    pub fn set_expandable_page(&mut self, page: u64) -> Result<(), ExpandableError> {
        let Some(vm) = self.paging.vm else {
            return Err(ExpandableError::Off);
        };
        if !self.segments.is_empty() {
            return Err(ExpandableError::PageAfterAllocation);
        }
        if page == 0 || !page.is_multiple_of(vm.page) {
            return Err(ExpandableError::PageNotMultiple { page, backend_page: vm.page });
        }
        if page > MAX_RANGE {
            return Err(ExpandableError::PageTooLarge { page, max: MAX_RANGE });
        }
        self.use_page(page);
        Ok(())
    }

    /// Maps new memory in physical allocations of at most `bytes` (at least
    /// a page each): fewer, larger allocations make fewer driver calls,
    /// smaller ones go back, or move, in smaller pieces.
    pub fn set_max_allocation(&mut self, bytes: u64) {
        self.paging.max_allocation = bytes.max(1);
    }

    /// Turns on giving back a larger allocation that a block carved from
    /// freed memory ends inside (`split_allocation_past`).
    pub fn set_split_allocations(&mut self, on: bool) {
        self.paging.split_allocations = on;
    }

    /// Whether a free block of `block` bytes serving `rounded` is split. In
    /// an expandable segment any remainder of at least `min_block` is: it
    /// merges back with its neighbours like any free block, while left
    /// inside the allocation it would be held for the allocation's life.
    #[inline]
    pub(super) fn should_split(&self, pool: PoolId, block: u64, rounded: u64) -> bool {
        match self.pool_vm(pool) {
            Some(_) => block - rounded >= self.rules.min_block,
            None => self.rules.should_split(self.pools[pool].kind, block, rounded),
        }
    }

    /// Whether the pages a request of `rounded` bytes would use in the free
    /// block `id` are all mapped (it takes the block with no driver call);
    /// true outside expandable segments.
    pub(super) fn mapped_under(&self, id: BlockId, rounded: u64) -> bool {
        let b = &self.blocks[id];
        let Some((base, pages)) = self.segments.range(b.segment) else {
            return true;
        };
        let used = if self.should_split(b.pool, b.size, rounded) { rounded } else { b.size };
        let (first, count) = pages.touched(b.addr - base, b.addr - base + used);
        pages.all_mapped(first, count)
    }

    /// Whether this heap grows by expandable segments.
    pub fn is_expandable(&self) -> bool {
        self.paging.vm.is_some()
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
    ///
    /// An edge page (one the block shares with a neighbour) is an
    /// allocation of its own, so that the block's inside is allocations
    /// lying wholly inside it, which go back, or move, when it is freed
    /// whatever its neighbours hold. The inside's pages come from the
    /// heap's holes first (`recycle.rs`: whole allocations move), then
    /// from the device, in allocations of at most `max_allocation` bytes,
    /// all of one run asked for in one `vm_map` (one grant of access).
    pub(super) fn map_block(&mut self, id: BlockId, rounded: u64) -> Result<(), BackendError> {
        let b = &self.blocks[id];
        let (size, segment_id, kind, pool) = (b.size, b.segment, b.kind, b.pool);
        if self.pool_vm(pool).is_none() {
            return Ok(());
        }
        let used = if self.should_split(pool, size, rounded) { rounded } else { size };
        if self.paging.split_allocations {
            self.split_allocation_past(id, used);
        }
        let pieces = self.pieces_to_map(id, used);
        let Some(page) = self.segments.pages(segment_id).map(PageMap::page_size).filter(|_| !pieces.is_empty()) else {
            return Ok(());
        };
        let need = pieces.iter().map(|piece| piece.pages * page).sum();
        let (mut donors, short) = self.recycle_before_growth(need, used, Some(id));
        // Past the device's free memory (or the cap), even with every donor,
        // the map would take what there is, fail and give it all back, on
        // every rung of the out-of-memory ladder (for a request larger than
        // an H200, some 70,000 calls): fail first.
        if short > 0 {
            return Err(BackendError::OutOfMemory);
        }
        // The allocations (first page, pages) done so far.
        let most = (self.paging.max_allocation / page).max(1);
        let mut mapped: Vec<(u64, u64)> = Vec::with_capacity((need / page).div_ceil(most) as usize + 2 * pieces.len());
        let result = self.map_pieces(segment_id, &pieces, &mut mapped, &mut donors);
        // Donors no room took stay cached where they are.
        drop(donors);
        if let Err(err) = result {
            self.undo_mapped(segment_id, kind, mapped);
            return Err(err);
        }
        self.commit_mapped(segment_id, kind, &mapped);
        Ok(())
    }

    /// The unmapped pages under the first `used` bytes of the block `id` of
    /// a reserved range, as `map_block` maps them: each edge page (shared
    /// with a neighbour) a piece of its own, the runs between them pieces
    /// that may take donors (the inside's last one reaching into the rest
    /// of the block when nothing is shared there). None outside a range.
    fn pieces_to_map(&self, id: BlockId, used: u64) -> Vec<Piece> {
        let b = &self.blocks[id];
        let (addr, size) = (b.addr, b.size);
        let Some((base, pages)) = self.segments.range(b.segment) else {
            return Vec::new();
        };
        let page = pages.page_size();
        let (start, end) = (addr - base, addr - base + used);
        let (first, count) = pages.touched(start, end);
        // Past the pages the request uses, a moved allocation may reach into
        // the rest of the block it is carved from (not into the next block).
        let room_end = (addr + size - base) / page;
        let edges = [(!start.is_multiple_of(page)).then_some(first), (!end.is_multiple_of(page)).then_some(first + count - 1)];
        let mut pieces: Vec<Piece> = Vec::new();
        for (p, n) in pages.runs(first, count, false) {
            let mut q = p;
            while q < p + n {
                if edges.contains(&Some(q)) {
                    pieces.push(Piece { first: q, pages: 1, room_end: q + 1, edge: true });
                    q += 1;
                    continue;
                }
                let stop = edges.iter().flatten().copied().filter(|&e| e > q && e < p + n).min().unwrap_or(p + n);
                // The inside's last piece may take a donor reaching past it
                // when nothing is shared there.
                let room = if stop == first + count && edges[1].is_none() { room_end.max(stop) } else { stop };
                pieces.push(Piece { first: q, pages: stop - q, room_end: room, edge: false });
                q = stop;
            }
        }
        pieces
    }

    /// Maps `pieces` of the range `segment_id`: donors moved where they fit
    /// (`place_donors`), new allocations elsewhere, a run of adjacent
    /// pieces' new allocations in one `vm_map` (`map_batch`). What it
    /// mapped is in `mapped` (first page, pages), also when it fails (the
    /// caller undoes it then).
    fn map_pieces(
        &mut self,
        segment_id: SegmentId,
        pieces: &[Piece],
        mapped: &mut Vec<(u64, u64)>,
        donors: &mut Vec<Donor>,
    ) -> Result<(), BackendError> {
        let page = self.segments.pages(segment_id).map_or(1, PageMap::page_size);
        // From `batched` on, `mapped` holds allocations not yet asked for,
        // which one `vm_map` makes (one grant of access for the run).
        let mut batched = mapped.len();
        for piece in pieces {
            let mut at = piece.first;
            while at < piece.first + piece.pages {
                if let Some(next) = self.place_donors(segment_id, piece, at, mapped, &mut batched, donors)? {
                    at = next;
                    continue;
                }
                let rest = if piece.edge { 1 } else { piece.first + piece.pages - at };
                for each in self.allocations_for(rest, page) {
                    mapped.push((at, each));
                    at += each;
                }
            }
            // A batch is one run: it ends where the next piece does not follow.
            let next = piece.first + piece.pages;
            if !pieces.iter().any(|p| p.first == next) {
                self.map_batch(segment_id, mapped, &mut batched, donors)?;
            }
        }
        self.map_batch(segment_id, mapped, &mut batched, donors)
    }

    /// Moves to page `at` of `piece` the latest chosen donor that fits
    /// there, with the donors just before it in memory that fit too (one
    /// move, one grant of access), after asking for what is batched (the
    /// donors land after it). Returns the page after them, or None when no
    /// donor fits or the backend cannot move (then new memory goes there).
    /// (An edge page takes a donor of one page only.)
    fn place_donors(
        &mut self,
        segment_id: SegmentId,
        piece: &Piece,
        at: u64,
        mapped: &mut Vec<(u64, u64)>,
        batched: &mut usize,
        donors: &mut Vec<Donor>,
    ) -> Result<Option<u64>, BackendError> {
        if donors.is_empty() {
            return Ok(None);
        }
        let left = piece.first + piece.pages - at;
        let room = left.max(self.unmapped_from(segment_id, at, piece.room_end));
        let Some(last) = donors.iter().rposition(|d| d.pages <= room) else {
            return Ok(None);
        };
        self.map_batch(segment_id, mapped, batched, donors)?;
        let run = recycle::adjacent_run(donors, last, room);
        let mut next = at;
        for donor in &donors[run.clone()] {
            mapped.push((next, donor.pages));
            next += donor.pages;
        }
        let (base, page) = self.segments.base_and_page(segment_id).expect("an expandable segment");
        if self.move_donors(donors, run, base + at * page) {
            *batched = mapped.len();
            return Ok(Some(next));
        }
        mapped.truncate(*batched);
        Ok(None)
    }

    /// When the first `used` bytes of the free block `id` (about to be
    /// carved) end inside a physical allocation lying wholly inside the
    /// block and reaching past them, gives that allocation back once the
    /// stream's queued work has run, so that `map_block` maps the block's
    /// own pages and the rest of the block holds none of it: a large
    /// allocation made for a block freed since holds no memory a smaller
    /// one does not use (`Config::expandable_split_allocations`). Not while
    /// the pool keeps its memory (a held private pool, a paused tag) or a
    /// capture is open.
    fn split_allocation_past(&mut self, id: BlockId, used: u64) {
        let b = &self.blocks[id];
        let (addr, size, pool, segment_id) = (b.addr, b.size, b.pool, b.segment);
        if !self.may_release() || self.keeps_memory(pool) {
            return;
        }
        let Some(segment) = self.segments.get(segment_id) else { return };
        let Some(pages) = segment.pages.as_ref() else { return };
        let (first, count) = pages.touched(addr - segment.base, addr - segment.base + used);
        let last = first + count - 1;
        if !pages.is_mapped(last) {
            return;
        }
        let (start, length) = pages.allocation(last);
        let (inside, inside_count) = pages.inside(addr - segment.base, addr - segment.base + size);
        if start + length <= last + 1 || start < inside || start + length > inside + inside_count {
            return;
        }
        let stream = self.pools[pool].stream;
        if self.backend.synchronize_stream(self.device, stream).is_err() {
            self.stats.events.num_stream_sync_errors += 1;
            return;
        }
        self.unmap_run(segment_id, start, length);
    }

    /// Unmaps the allocations (first page, pages) that a map failing midway
    /// made in the expandable segment `segment_id`, a run of adjacent ones
    /// per call; those the backend will not unmap stay mapped and counted,
    /// inside what is still a free block.
    pub(super) fn undo_mapped(&mut self, segment_id: SegmentId, kind: PoolKind, mut allocations: Vec<(u64, u64)>) {
        let Some((base, page)) = self.segments.base_and_page(segment_id) else {
            return;
        };
        allocations.sort_unstable();
        let mut stuck = Vec::new();
        for (first, n) in page_map::runs_of(&allocations) {
            if self.backend.vm_unmap(self.device, base + first * page, n * page).is_ok() {
                self.limits.reserve.give_back(n * page);
            } else {
                stuck.extend(allocations.iter().filter(|&&(p, _)| p >= first && p < first + n));
            }
        }
        self.commit_mapped(segment_id, kind, &stuck);
    }

    /// Asks the backend for the new allocations of `mapped` from `batched`
    /// on (first page and pages each, adjacent, in address order) in one
    /// `vm_map`, and moves `batched` past them; all or nothing: on failure
    /// they leave `mapped`. Donors no room took give back as much memory
    /// first (`recycle.rs`), so that the heap grows no further than moving
    /// them would have taken it.
    fn map_batch(
        &mut self,
        segment_id: SegmentId,
        mapped: &mut Vec<(u64, u64)>,
        batched: &mut usize,
        donors: &mut Vec<Donor>,
    ) -> Result<(), BackendError> {
        let batch = &mapped[*batched..];
        let Some(&(first, _)) = batch.first() else { return Ok(()) };
        let (base, page) = self.segments.base_and_page(segment_id).expect("an expandable segment");
        let sizes: Vec<u64> = batch.iter().map(|&(_, n)| n * page).collect();
        let bytes = sizes.iter().sum();
        self.release_donors_for(donors, bytes);
        let result = self.claim_reserved(bytes).and_then(|()| {
            self.backend.vm_map(self.device, base + first * page, &sizes).inspect_err(|_| self.limits.reserve.give_back(bytes))
        });
        if result.is_err() {
            mapped.truncate(*batched);
        }
        *batched = mapped.len();
        result
    }

    /// How many unmapped pages follow page `from` (itself included) of the
    /// expandable segment `segment_id`, up to page `limit`.
    fn unmapped_from(&self, segment_id: SegmentId, from: u64, limit: u64) -> u64 {
        let Some(pages) = self.segments.pages(segment_id) else { return 0 };
        pages.next_mapped(from, limit).max(from) - from
    }

    /// The pages of each allocation a run of `pages` new pages is mapped
    /// in, in address order: `max_allocation` each, the last the rest.
    pub(super) fn allocations_for(&self, pages: u64, page: u64) -> impl Iterator<Item = u64> {
        let most = (self.paging.max_allocation / page).max(1);
        (0..pages.div_ceil(most)).map(move |i| most.min(pages - i * most))
    }

    /// Marks allocations just mapped (first page, pages; in address order)
    /// and counts them; the history notes one event per run of adjacent
    /// ones.
    pub(super) fn commit_mapped(&mut self, segment_id: SegmentId, kind: PoolKind, allocations: &[(u64, u64)]) {
        let Some(pages) = self.segments.get_mut(segment_id).and_then(|s| s.pages.as_mut()) else {
            return;
        };
        let page = pages.page_size();
        let mut total = 0;
        // Allocations of one size side by side in one mark.
        for same in allocations.chunk_by(|a, b| a.1 == b.1 && a.0 + a.1 == b.0) {
            let (p, each) = same[0];
            let n = each * same.len() as u64;
            pages.set_mapped(p, n, each);
            total += n;
        }
        let segment = self.segments.get(segment_id).expect("checked above");
        let (base, stream) = (segment.base, self.pools[segment.pool].stream);
        for (p, n) in page_map::runs_of(allocations) {
            self.note(HistoryAction::SegmentMap, base + p * page, n * page, stream);
        }
        self.stats.reserved_bytes.increase(kind, total * page);
        self.limits.reserve.note_peak();
        self.stats.events.num_pages_mapped += total;
        self.stats.events.num_device_alloc += allocations.len() as u64;
    }

    /// Unmaps every allocation lying entirely inside the free blocks of the
    /// expandable segment `segment_id`, after the work queued on its
    /// stream has run; a range left with no memory and no block goes back
    /// whole. Pages the backend fails to unmap stay mapped and counted.
    pub(super) fn release_free_pages(&mut self, segment_id: SegmentId) -> Released {
        let mut released = Released::default();
        let Some(segment) = self.segments.get(segment_id) else {
            return released;
        };
        let stream = self.pools[segment.pool].stream;
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
    /// that `select` picks and that have allocations lying entirely inside
    /// them, each with their bytes (what unmapping it would give back).
    /// None while private pools keep their memory, in theirs.
    pub(super) fn free_blocks_with_pages(&self, segment: &Segment, select: impl Fn(&Block) -> bool, out: &mut Vec<(BlockId, u64)>) {
        if segment.pages.is_none() || self.keeps_memory(segment.pool) {
            return;
        }
        for (id, b) in self.blocks.walk_segment(segment.first_block) {
            if b.state == BlockState::Binned && select(b) {
                let bytes = self.hole_bytes(id);
                if bytes > 0 {
                    out.push((id, bytes));
                }
            }
        }
    }

    /// The page map of the expandable segment `segment_id` and the pages
    /// lying entirely inside bytes [start, end) of it: (map, first, count).
    fn pages_inside(&self, segment_id: SegmentId, start: u64, end: u64) -> Option<(&PageMap, u64, u64)> {
        let segment = self.segments.get(segment_id)?;
        let pages = segment.pages.as_ref()?;
        let (first, count) = pages.inside(start - segment.base, end - segment.base);
        Some((pages, first, count))
    }

    /// `pages_inside` the block `id`.
    fn pages_inside_block(&self, id: BlockId) -> Option<(&PageMap, u64, u64)> {
        let b = &self.blocks[id];
        self.pages_inside(b.segment, b.addr, b.addr + b.size)
    }

    /// The bytes of the allocations lying entirely inside the block `id`
    /// of an expandable segment: what unmapping its pages gives back.
    pub(super) fn hole_bytes(&self, id: BlockId) -> u64 {
        self.pages_inside_block(id).map_or(0, |(pages, first, count)| pages.pages_of_allocations_in(first, count) * pages.page_size())
    }

    /// Whether an allocation lies entirely inside the block `id` of an
    /// expandable segment (`hole_bytes` > 0, without counting them).
    pub(super) fn is_hole(&self, id: BlockId) -> bool {
        self.pages_inside_block(id).is_some_and(|(pages, first, count)| pages.any_allocation_within(first, count))
    }

    /// The free blocks of expandable segments, idle since `idle_before` or
    /// earlier, that hold unmappable pages while live blocks keep their
    /// range: each with the bytes it would give back. (A range with no live
    /// block is a whole free segment instead.)
    pub(super) fn holes_with_free_pages(&self, idle_before: u64) -> Vec<(BlockId, u64)> {
        let mut holes = Vec::new();
        for (_, segment) in self.segments.iter() {
            self.free_blocks_with_pages(segment, |b| b.is_split() && b.idle_since_ms <= idle_before, &mut holes);
        }
        holes
    }

    /// Unmaps the free pages inside the free block `id` of an expandable
    /// segment once its stream's queued work has run. Returns the bytes.
    pub(super) fn release_hole(&mut self, id: BlockId) -> u64 {
        let stream = self.pools[self.blocks[id].pool].stream;
        if self.backend.synchronize_stream(self.device, stream).is_err() {
            self.stats.events.num_stream_sync_errors += 1;
            return 0;
        }
        self.unmap_inside(id)
    }

    /// Unmaps the allocations lying entirely inside the binned free block
    /// `id` (whose stream has no work left on them), a run of adjacent
    /// ones at a time. Only those: its edge pages, and allocations that
    /// reach outside it (its inactive-split bytes), are shared with its
    /// neighbours. Returns the bytes unmapped.
    fn unmap_inside(&mut self, id: BlockId) -> u64 {
        let segment = self.blocks[id].segment;
        let runs = self.pages_inside_block(id).map(|(pages, first, count)| pages.allocation_runs(first, count));
        runs.unwrap_or_default().into_iter().map(|(p, n)| self.unmap_run(segment, p, n)).sum()
    }

    /// The allocations lying entirely inside [start, end) of the expandable
    /// segment `segment_id`, as (first page, pages), in address order.
    pub(super) fn allocations_within(&self, segment_id: SegmentId, start: u64, end: u64) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.pages_inside(segment_id, start, end).into_iter().flat_map(|(pages, first, count)| pages.allocations_in(first, count))
    }

    /// Unmaps the `n` mapped pages from page `p` of the expandable segment
    /// `segment_id` (whole allocations, no work left on them) and frees
    /// their memory. Returns the bytes unmapped. A run the backend refuses
    /// goes allocation by allocation, so that only the allocations it
    /// refuses stay mapped (and counted).
    pub(super) fn unmap_run(&mut self, segment_id: SegmentId, p: u64, n: u64) -> u64 {
        match self.unmap_whole_run(segment_id, p, n) {
            0 => {
                let Some(pages) = self.segments.pages(segment_id) else { return 0 };
                let each: Vec<(u64, u64)> = pages.allocations_in(p, n).collect();
                if each.len() < 2 {
                    return 0;
                }
                each.into_iter().map(|(q, k)| self.unmap_whole_run(segment_id, q, k)).sum()
            }
            bytes => bytes,
        }
    }

    /// `unmap_run`, all or nothing: a run the backend refuses stays mapped
    /// and counted whole (0 bytes returned).
    pub(super) fn unmap_whole_run(&mut self, segment_id: SegmentId, p: u64, n: u64) -> u64 {
        let Some((base, page)) = self.segments.base_and_page(segment_id) else {
            return 0;
        };
        if self.backend.vm_unmap(self.device, base + p * page, n * page).is_err() {
            return 0;
        }
        self.forget_mapped_run(segment_id, p, n, 1);
        self.limits.reserve.give_back(n * page);
        n * page
    }

    /// Marks the `n` pages from page `p` of the expandable segment
    /// `segment_id` unmapped (their memory now elsewhere, or given back)
    /// and counts them, as `allocations` freed; the device's count of
    /// reserved bytes is the caller's.
    pub(super) fn forget_mapped_run(&mut self, segment_id: SegmentId, p: u64, n: u64, allocations: u64) {
        let segment = self.segments.get_mut(segment_id).expect("an expandable segment");
        let (base, pool) = (segment.base, segment.pool);
        let pages = segment.pages.as_mut().expect("an expandable segment");
        let page = pages.page_size();
        pages.set_unmapped(p, n);
        let (stream, kind) = (self.pools[pool].stream, self.pools[pool].kind);
        self.note(HistoryAction::SegmentUnmap, base + p * page, n * page, stream);
        self.stats.reserved_bytes.decrease(kind, n * page);
        self.stats.events.num_pages_unmapped += n;
        self.stats.events.num_device_free += allocations;
    }

    /// Gives back the expandable range `segment_id` if it is one free block
    /// with no page mapped.
    fn free_empty_range(&mut self, segment_id: SegmentId) -> Released {
        let Some(segment) = self.segments.get(segment_id) else {
            return Released::default();
        };
        let block = segment.first_block;
        let b = &self.blocks[block];
        let empty = b.state == BlockState::Binned && b.is_last() && segment.pages.as_ref().is_some_and(|p| p.mapped_bytes() == 0);
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
        for (_, segment) in self.segments.iter() {
            let Some(pages) = segment.pages.as_ref() else {
                continue;
            };
            for (_, b) in self.blocks.walk_segment(segment.first_block) {
                if b.state == BlockState::Binned && b.addr - segment.base < pages.end_bytes() {
                    let offset = b.addr - segment.base;
                    largest = largest.max(pages.longest_mapped_run(offset, offset + b.size));
                }
            }
        }
        largest
    }
}
