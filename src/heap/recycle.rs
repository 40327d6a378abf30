//! Moving cached memory to where it is needed when the heap cannot grow
//! (heaps with expandable segments): when taking more memory from the
//! device would pass what the device has free or the heap's cap
//! (`max_reserved_mb`, the memory fraction), the memory the heap caches and
//! does not use goes first, longest free first: the free pages inside
//! holes of every pool's ranges (the free block the growing request is
//! carved from included: it may cache pages past where the request lands),
//! and the small pools' segments that are one whole free block. The
//! allocations lying inside holes become donors: their physical memory is
//! moved (`Backend::vm_move`: one unmap and one map per allocation, where
//! giving it back and taking new memory would be four driver calls) to the
//! pages the growth needs, an allocation whole (it may reach past the
//! request into the rest of the block the request is carved from); a hole
//! donates allocations until the growth has what the limits leave it short
//! of, and keeps the rest cached.
//!
//! While memory is plentiful nothing moves: the heap grows by new pages,
//! and the pages it maps stay where they are until something asks for
//! memory (a limit reached here, an out-of-memory, `empty_cache`, another
//! process, idle release). So a step repeated finds every page it needs
//! mapped where it left it, and makes no driver call once it has run
//! (docs/expandable-segments.md: moving to keep reserved a few percent
//! tighter while memory is plentiful made hundreds of calls a step, the
//! same moves each step).
//!
//! Owns `Recycling` (the heap's clock of frees, and whether pages move),
//! kept in `Paging`.
//!
//! Invariant: pages move only for the part of a growth that would pass the
//! device's free memory or the cap (a rule of the code: `over_limits` is
//! what the donors are sized to; no figure of the heap records it).
#![forbid(unsafe_code)]

use std::ops::Range;

use super::block::BlockId;
use super::ids::SegmentId;
use super::DeviceHeap;

/// What the heap knows of its moves over its life.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Recycling {
    /// Frees and growths so far (counted in heaps with expandable
    /// segments; `DeviceHeap::stamp_freed`): the clock that orders free
    /// blocks by age, the same in a live run and a replay, stash or not.
    pub frees: u64,
    /// Nothing moves (`Config::move_pages` off: the replay's model of
    /// PyTorch's expandable segments, which grow by new memory only).
    pub off: bool,
}

/// Where cached memory can come from before a growth.
#[derive(Clone, Copy, Debug)]
enum Source {
    /// The mapped pages of a free block of an expandable segment from
    /// `from` on: a hole's from its start, those of the block a request
    /// is being carved from past the request.
    Pages { block: BlockId, from: u64 },
    /// A small pool's segment that is one whole free block.
    Segment(SegmentId),
}

/// An allocation inside a hole whose stream has no work left on it, about
/// to move: `pages` pages from page `first` of the expandable segment
/// `segment`. One that no growth takes stays where it is, cached.
#[derive(Clone, Copy, Debug)]
pub(super) struct Donor {
    segment: SegmentId,
    first: u64,
    pub pages: u64,
}

impl DeviceHeap {
    /// Turns moving cached pages before growth on (the default) or off.
    pub fn set_move_pages(&mut self, on: bool) {
        self.paging.recycling.off = !on;
    }

    /// How far taking `bytes` more from the device would go past what the
    /// device has free (every process counted) or past the heap's cap: what
    /// cached memory must give (0: the heap may grow). One question to the
    /// driver (its free memory), asked only when the heap is about to grow.
    pub(super) fn over_limits(&self, bytes: u64) -> u64 {
        let free = self.backend.mem_info(self.device).map_or(u64::MAX, |info| info.free);
        let over_cap = self.reserved_limit().map_or(0, |cap| (self.limits.reserve.bytes() + bytes).saturating_sub(cap));
        bytes.saturating_sub(free).max(over_cap)
    }

    /// Before the heap takes `bytes` more from the device for a request of
    /// `request` bytes: when that would pass the device's free memory or
    /// the cap (`over_limits`), releases whole free small segments and
    /// returns the mapped pages of holes (as donors, ready to move) until
    /// the excess is found, longest free first. The block about to be
    /// mapped is not binned, so it is never among the holes; `carved` names
    /// it (the request takes its first `request` bytes), so that the mapped
    /// pages of the rest of it (the free block the request is carved from
    /// may hold cached pages past where it lands) are donors too. The
    /// caller moves the donors it has room for and leaves the others cached.
    /// Also returns what the growth still lacks after them (0: it fits), so
    /// that a growth of pages that cannot succeed fails before its first
    /// driver call. A heap of whole segments asks nothing (0): nothing of
    /// it moves, and its one `cuMemAlloc` answers for itself.
    pub(super) fn recycle_before_growth(&mut self, bytes: u64, request: u64, carved: Option<BlockId>) -> (Vec<Donor>, u64) {
        let mut donors = Vec::new();
        if self.paging.vm.is_none() {
            return (donors, 0);
        }
        let mut want = self.over_limits(bytes);
        // Donors and their destinations must have pages of one size: the
        // driver's, which tags' ranges always use (a heap mapping larger
        // pages, `set_expandable_page`, moves nothing).
        let driver_page = self.backend.vm_page_size(self.device);
        let can_move = self.paging.vm.map(|vm| vm.page) == driver_page && !self.paging.recycling.off && self.may_release();
        if want == 0 || !can_move {
            return (donors, want);
        }
        // A stashed block is a hole too (threads' cached blocks came back
        // before the block to map was taken: `take_block`).
        self.flush_stashes();
        for candidate in self.recycling_sources(request, carved) {
            let got = match candidate {
                Source::Pages { block, from } => self.donate_pages(block, from, want, &mut donors),
                Source::Segment(segment) => self.release_whole_segment(segment).bytes,
            };
            want = want.saturating_sub(got);
            if want == 0 {
                break;
            }
        }
        (donors, want)
    }

    /// Where cached memory can come from before a growth, longest free
    /// first (ties: the block `carved` is carved from, past its first
    /// `request` bytes; small segments; then holes, each in address order):
    /// holes with whole allocations inside and small segments that are one
    /// free block, in pools that need not keep their memory.
    fn recycling_sources(&self, request: u64, carved: Option<BlockId>) -> Vec<Source> {
        let page = self.paging.vm.map_or(0, |vm| vm.page);
        let mut candidates: Vec<(u64, Source)> = Vec::new();
        if let Some(block) = carved {
            // (A held private pool's free blocks keep their memory: a graph
            // replay still writes to them.)
            let b = &self.blocks[block];
            if !self.keeps_memory(b.pool) {
                candidates.push((b.freed_at, Source::Pages { block, from: b.addr + request }));
            }
        }
        for pool in self.pools.ids().filter(|&pool| !self.keeps_memory(pool)) {
            for id in self.pools[pool].free_members(&self.blocks) {
                let b = &self.blocks[id];
                if self.segments[b.segment].pages.is_some() {
                    // (A block smaller than a page holds no whole one.)
                    if b.size >= page && self.is_hole(id) {
                        candidates.push((b.freed_at, Source::Pages { block: id, from: b.addr }));
                    }
                } else if !b.is_split() {
                    candidates.push((b.freed_at, Source::Segment(b.segment)));
                }
            }
        }
        let order = |source: &Source| match *source {
            Source::Pages { block, .. } if Some(block) == carved => (0, 0),
            Source::Segment(segment) => (1, u64::from(segment.raw())),
            Source::Pages { block, .. } => (2, self.blocks[block].addr),
        };
        candidates.sort_by_key(|(freed_at, source)| (*freed_at, order(source)));
        candidates.into_iter().map(|(_, source)| source).collect()
    }

    /// Adds to `donors` the allocations inside the free block `block` from
    /// `from` on, once its stream's queued work has run, until they hold
    /// `want` bytes (the rest stay cached). Returns the bytes they hold.
    fn donate_pages(&mut self, block: BlockId, from: u64, want: u64, donors: &mut Vec<Donor>) -> u64 {
        let page = self.paging.vm.map_or(0, |vm| vm.page);
        let stream = self.pools[self.blocks[block].pool].stream;
        if self.backend.synchronize_stream(self.device, stream).is_err() {
            self.stats.events.num_stream_sync_errors += 1;
            return 0;
        }
        let b = &self.blocks[block];
        let mut left = want.div_ceil(page);
        let mut got = 0;
        let segment = b.segment;
        for (first, pages) in self.allocations_within(segment, from, b.addr + b.size) {
            if left == 0 {
                break;
            }
            left = left.saturating_sub(pages);
            donors.push(Donor { segment, first, pages });
            got += pages * page;
        }
        got
    }

    /// Moves the memory of the donors `run` (allocations next to each other
    /// in one segment, in address order: `adjacent_run`) to the unmapped
    /// pages at `to` (one run of a reserved range they fit), in one
    /// `vm_move`: one grant of access for them all. Returns false when the
    /// backend cannot move (every donor gives its memory back then, and the
    /// caller maps new memory in their place).
    pub(super) fn move_donors(&mut self, donors: &mut Vec<Donor>, run: Range<usize>, to: u64) -> bool {
        let (first, last) = (donors[run.start], donors[run.end - 1]);
        let Some((base, page)) = self.segments.base_and_page(first.segment) else {
            return false;
        };
        let pages = last.first + last.pages - first.first;
        if self.backend.vm_move(self.device, base + first.first * page, to, pages * page).is_err() {
            self.release_donors(std::mem::take(donors));
            return false;
        }
        // The memory stays on the device: only where it is mapped changed.
        let moved = run.len() as u64;
        donors.drain(run);
        self.forget_mapped_run(first.segment, first.first, pages, moved);
        true
    }

    /// Unmaps donors until they have given back at least `bytes` (or none
    /// is left), the smallest that covers what is left first, else the
    /// largest: a growth about to take new memory because no donor fits
    /// where it maps gives back what the donors chosen for it hold instead,
    /// so that it stays under the high-water mark as a move would have kept
    /// it (an allocation moves only whole, and a larger one does not fit a
    /// smaller run of pages), and gives back little more than it takes.
    pub(super) fn release_donors_for(&mut self, donors: &mut Vec<Donor>, bytes: u64) {
        let mut left = bytes;
        while left > 0 && !donors.is_empty() {
            let pages = |i: usize| donors[i].pages;
            let page = self.paging.vm.map_or(1, |vm| vm.page);
            let covering = (0..donors.len()).filter(|&i| pages(i) * page >= left).min_by_key(|&i| pages(i));
            let index = covering.unwrap_or_else(|| (0..donors.len()).max_by_key(|&i| pages(i)).expect("not empty"));
            let donor = donors.remove(index);
            left = left.saturating_sub(self.unmap_run(donor.segment, donor.first, donor.pages));
        }
    }

    /// Unmaps donors, giving their memory back (where a growth takes new
    /// memory of another kind: a small segment).
    pub(super) fn release_donors(&mut self, donors: Vec<Donor>) {
        for donor in donors {
            self.unmap_run(donor.segment, donor.first, donor.pages);
        }
    }
}

/// The donors from the first of those just before `donors[last]` in memory
/// (one segment, each ending where the next begins) to `last`, as many as
/// fit `room` pages together: what one move can carry.
pub(super) fn adjacent_run(donors: &[Donor], last: usize, room: u64) -> Range<usize> {
    let mut first = last;
    let mut pages = donors[last].pages;
    while first > 0 {
        let (before, next) = (donors[first - 1], donors[first]);
        if before.segment != next.segment || before.first + before.pages != next.first || pages + before.pages > room {
            break;
        }
        pages += before.pages;
        first -= 1;
    }
    first..last + 1
}

#[cfg(test)]
mod tests {
    use super::*;

    fn donor(segment: usize, first: u64, pages: u64) -> Donor {
        Donor { segment: SegmentId::new(segment), first, pages }
    }

    #[test]
    fn a_run_is_the_donors_before_the_last_that_touch_in_one_segment_and_fit() {
        // Pages 0-1, 2, 3-5 of segment 0 touch; 7 does not (page 6 between);
        // page 8 of segment 1 follows 7 in the list but not in memory.
        let donors = [donor(0, 0, 2), donor(0, 2, 1), donor(0, 3, 3), donor(0, 7, 1), donor(1, 8, 1)];
        assert_eq!(adjacent_run(&donors, 2, 6), 0..3, "all three that touch fit 6 pages");
        assert_eq!(adjacent_run(&donors, 2, 5), 1..3, "the first would take 7 pages: left out");
        assert_eq!(adjacent_run(&donors, 2, 3), 2..3, "the last alone");
        assert_eq!(adjacent_run(&donors, 3, 16), 3..4, "a gap before it");
        assert_eq!(adjacent_run(&donors, 4, 16), 4..5, "another segment before it");
    }
}
