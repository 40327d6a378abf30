//! Moving cached memory to where it is needed before the heap grows (heaps
//! with expandable segments): when a heap is about to take memory from the
//! device past its high-water mark, the memory it caches and does not use
//! goes first, longest free first: the free pages inside holes of every
//! pool's ranges (the free block the growing request is carved from
//! included: it may cache pages past where the request lands), and the
//! small pools' segments that are one whole free block. The allocations
//! lying inside holes become donors: their physical memory is moved
//! (`Backend::vm_move`: one unmap and one map per allocation, where giving
//! it back and taking new memory would be four driver calls) to the pages
//! the growth needs, an allocation whole (it may reach past the request
//! into the rest of the block the request is carved from). Within the
//! budget below, a hole donates allocations until the growth has what it
//! needs and keeps the rest cached (no driver call); past it, all of a
//! hole's allocations go and those the growth leaves are unmapped.
//!
//! Invariants:
//! - below the high-water mark nothing moves, so a loop that has met its
//!   largest step makes no driver call here;
//! - over a heap's life, moving starts freely only while
//!   `Recycling::moved` is below `MOVES_PER_HIGH_WATER` times the
//!   high-water mark;
//! - past that budget, pages move only for the part of a growth that would
//!   take the heap above its bound: `MOST_HELD_OVER_LIVE_PERCENT` above the
//!   most it has had live, and at least `LEAST_HELD_OVER_LIVE` (whole pages
//!   and small segments make more than a few percent of a small heap). A
//!   workload whose layout drifts from step to step within the bound pays
//!   a bounded number of driver calls, once, and then holds its memory as
//!   it is; one that drifts further pays moves to stay within it.
#![forbid(unsafe_code)]

use std::ops::Range;

use super::block::BlockId;
use super::DeviceHeap;

/// How many times its high-water mark a heap moves freely over its life.
/// Decoding (caches grown by `torch.cat`, every one replaced as it grows)
/// moves the most before its layout settles, more as the caches outweigh
/// the model: GPT-2 small decoding (three calls to `generate`) settled
/// after 1.7 times at batch 16, 2.3 at batch 32, 3.1 at batch 64, and
/// reserved 1.054x / 1.068x its peak of live bytes at batch 32 / 64 with
/// a budget of two (measured before the carved block's pages could
/// move), 1.007x / 1.005x with four.
const MOVES_PER_HIGH_WATER: u64 = 4;

/// Past its budget, a heap still moves pages rather than hold more than
/// this many percent above the most it has had live (or
/// `LEAST_HELD_OVER_LIVE`, whichever is more). A generation that
/// grows its caches every token never settles (120 tokens at batch 64:
/// 27 times its high-water mark moved with no budget; 1.050x reserved
/// with a budget of two and no bound, 1.053x with four, 1.029x with the
/// bound, which moves 9.9 times).
const MOST_HELD_OVER_LIVE_PERCENT: u64 = 4;

/// The bound above live memory is never below this: a heap of a few
/// hundred MiB holds more than 4 % in page and segment rounding that no
/// move gives back (an 88 MiB training step: 96 MiB at best), and would
/// otherwise move pages at every growth for ever.
const LEAST_HELD_OVER_LIVE: u64 = 16 << 20;

/// What the heap knows of its moves over its life.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Recycling {
    /// The most bytes the heap has held reserved (as of its last growth;
    /// `reset_peak_stats` does not lower it).
    pub high_water: u64,
    /// Bytes taken from cached memory so that the heap would not grow past
    /// `high_water`.
    pub moved: u64,
    /// The most bytes the heap has had allocated, as the peak statistics
    /// said at each growth (a reset between two growths can hide a peak;
    /// no reset lowers this).
    pub live_high_water: u64,
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
    Segment(u32),
}

/// An allocation inside a hole whose stream has no work left on it, about
/// to move: `pages` pages from page `first` of the expandable segment
/// `segment`. A `spare` one that no growth takes is unmapped (past the
/// budget); another stays where it is, cached.
#[derive(Clone, Copy, Debug)]
pub(super) struct Donor {
    segment: u32,
    first: u64,
    pub pages: u64,
    spare: bool,
}

impl DeviceHeap {
    /// Turns moving cached pages before growth on (the default) or off.
    pub fn set_move_pages(&mut self, on: bool) {
        self.recycling.off = !on;
    }

    /// Whether taking `bytes` more from the device would take the heap past
    /// its high-water mark (where `recycle_before_growth` looks for pages).
    pub(super) fn past_high_water(&self, bytes: u64) -> bool {
        let reserved = &self.stats.reserved_bytes;
        reserved.total() + bytes > self.recycling.high_water.max(reserved.peak_total())
    }

    /// Before the heap takes `bytes` more from the device for a request of
    /// `request` bytes: when that would take it past its high-water mark,
    /// releases whole free small segments and returns the mapped pages of
    /// holes (as donors, ready to move) until enough is found, longest free
    /// first, within the heap's budget of moves, or past it as far as the
    /// growth would take the heap above its bound over live memory. The
    /// block about to be mapped is not binned, so it is never among the
    /// holes; `carved` names it (the request takes its first `request`
    /// bytes), so that the mapped pages of the rest of it (the free block
    /// the request is carved from may hold cached pages past where it
    /// lands) are donors too. The caller moves or unmaps every donor.
    pub(super) fn recycle_before_growth(&mut self, bytes: u64, request: u64, carved: Option<BlockId>) -> Vec<Donor> {
        let mut donors = Vec::new();
        // Donors and their destinations must have pages of one size: the
        // driver's, which tags' ranges always use (a heap mapping larger
        // pages, `set_expandable_page`, moves nothing).
        let driver_page = self.backend.vm_page_size(self.device);
        if self.vm.is_none_or(|vm| Some(vm.page) != driver_page) || self.recycling.off || !self.may_release() {
            return donors;
        }
        let (reserved, allocated) = (&self.stats.reserved_bytes, &self.stats.allocated_bytes);
        let recycling = &mut self.recycling;
        recycling.high_water = recycling.high_water.max(reserved.peak_total());
        recycling.live_high_water = recycling.live_high_water.max(allocated.peak_total());
        // The request counts as live for this growth only: it may still fail.
        let live = recycling.live_high_water.max(allocated.total() + request);
        let bound = live + (live * MOST_HELD_OVER_LIVE_PERCENT / 100).max(LEAST_HELD_OVER_LIVE);
        let after = reserved.total() + bytes;
        let past_peak = after.saturating_sub(recycling.high_water);
        let budget_left = (MOVES_PER_HIGH_WATER * recycling.high_water).saturating_sub(recycling.moved);
        let mut want = past_peak.min(budget_left.max(after.saturating_sub(bound)));
        // What the growth needs past the high-water mark: within the budget,
        // no hole gives more.
        let mut need = past_peak;
        if want == 0 {
            return donors;
        }
        let page = self.vm.map_or(0, |vm| vm.page);
        // A stashed block is a hole too (threads' cached blocks came back
        // before the block to map was taken: `take_block`).
        self.flush_stashes();
        let mut candidates: Vec<(u64, Source)> = Vec::new();
        if let Some(block) = carved {
            // (A held private pool's free blocks keep their memory: a graph
            // replay still writes to them.)
            let b = &self.blocks[block];
            if !self.keeps_memory(b.pool) {
                candidates.push((b.freed_at, Source::Pages { block, from: b.addr + request }));
            }
        }
        // The free blocks, pool by pool: holes with whole allocations
        // inside, small segments that are one free block.
        for pool in 0..self.pools.len() as u32 {
            if self.keeps_memory(pool) {
                continue;
            }
            for id in self.pools[pool as usize].free_members(&self.blocks) {
                let b = &self.blocks[id];
                let segment = self.segments[b.segment as usize].as_ref().expect("a binned block's segment");
                if segment.pages.is_some() {
                    // (A block smaller than a page holds no whole one.)
                    if b.size >= page && self.is_hole(id) {
                        candidates.push((b.freed_at, Source::Pages { block: id, from: b.addr }));
                    }
                } else if !b.is_split() {
                    candidates.push((b.freed_at, Source::Segment(b.segment)));
                }
            }
        }
        // Longest free first; ties: the carved block, small segments, then
        // holes, each in address order.
        let order = |source: &Source, blocks: &super::block::BlockArena| match *source {
            Source::Pages { block, .. } if Some(block) == carved => (0, 0),
            Source::Segment(segment) => (1, segment as u64),
            Source::Pages { block, .. } => (2, blocks[block].addr),
        };
        candidates.sort_by_key(|(freed_at, source)| (*freed_at, order(source, &self.blocks)));
        for (_, candidate) in candidates {
            let got = match candidate {
                Source::Pages { block, from } => {
                    let stream = self.pools[self.blocks[block].pool as usize].stream;
                    if self.backend.synchronize_stream(self.device, stream).is_err() {
                        self.stats.events.num_stream_sync_errors += 1;
                        continue;
                    }
                    let b = &self.blocks[block];
                    // Within the budget a growth takes only the allocations
                    // it needs and the rest stay cached; past it, all of
                    // them, and what the growth leaves goes back, so that a
                    // heap that keeps drifting holds no more than it must.
                    let spare = budget_left == 0;
                    let mut left = if spare { u64::MAX } else { need.div_ceil(page) };
                    let mut got = 0;
                    let segment = b.segment;
                    for (first, pages) in self.allocations_within(segment, from, b.addr + b.size) {
                        if left == 0 {
                            break;
                        }
                        left = left.saturating_sub(pages);
                        donors.push(Donor { segment, first, pages, spare });
                        got += pages * page;
                    }
                    got
                }
                Source::Segment(segment) => self.release_whole_segment(segment).bytes,
            };
            self.recycling.moved += got;
            want = want.saturating_sub(got);
            need = need.saturating_sub(got);
            if want == 0 {
                break;
            }
        }
        donors
    }

    /// Moves the memory of the donors `run` (allocations next to each other
    /// in one segment, in address order: `adjacent_run`) to the unmapped
    /// pages at `to` (one run of a reserved range they fit), in one
    /// `vm_move`: one grant of access for them all. Returns false when the
    /// backend cannot move (every donor gives its memory back then, and the
    /// caller maps new memory in their place).
    pub(super) fn move_donors(&mut self, donors: &mut Vec<Donor>, run: Range<usize>, to: u64) -> bool {
        let (first, last) = (donors[run.start], donors[run.end - 1]);
        let Some((base, page)) = self.segments[first.segment as usize].as_ref().and_then(|s| Some((s.base, s.pages.as_ref()?.page_size())))
        else {
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
            let page = self.vm.map_or(1, |vm| vm.page);
            let covering = (0..donors.len()).filter(|&i| pages(i) * page >= left).min_by_key(|&i| pages(i));
            let index = covering.unwrap_or_else(|| (0..donors.len()).max_by_key(|&i| pages(i)).expect("not empty"));
            let donor = donors.remove(index);
            left = left.saturating_sub(self.unmap_run(donor.segment, donor.first, donor.pages));
        }
    }

    /// Unmaps the spare donors no growth took, giving their memory back;
    /// the others stay cached where they are.
    pub(super) fn settle_donors(&mut self, donors: Vec<Donor>) {
        self.release_donors(donors.into_iter().filter(|d| d.spare).collect());
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

    fn donor(segment: u32, first: u64, pages: u64) -> Donor {
        Donor { segment, first, pages, spare: false }
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
