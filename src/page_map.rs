//! The page map of an expandable segment: which pages of its virtual range
//! are backed by physical memory, and how that memory was allocated. The
//! heap keeps one per expandable segment; the host backend one per reserved
//! range, to refuse and count what the driver would.
//!
//! An expandable segment is a range of address space reserved once; pages
//! (the driver's granularity, 2 MiB on CUDA) are mapped when a block needs
//! them and unmapped when they lie inside free blocks and a release policy
//! asks for memory. Memory comes in allocations of one or more pages (one
//! `cuMemCreate` each, mapped whole): the driver unmaps and frees an
//! allocation only whole, so a page goes back, or moves, with the rest of
//! its allocation. Offsets here are bytes from the range's base.
//!
//! Invariants (checked by `DeviceHeap::validate` through `check`):
//!   mapped = number of set bits
//!   end    = one past the highest set bit (0 when none): every page at or
//!            after `end` is unmapped, so scans stop there
//!   starts ⊆ bits, and the first page of every run of mapped pages is a
//!            start: an allocation is a start and the mapped pages after
//!            it up to the next start or unmapped page
#![forbid(unsafe_code)]

/// One bit per page of a range; set when the page is mapped, and where an
/// allocation begins.
#[derive(Clone, Debug)]
pub struct PageMap {
    page: u64,
    /// Pages in the range.
    pages: u64,
    /// Grown on demand, up to the word holding `end - 1`.
    bits: Vec<u64>,
    /// The first page of each allocation (the same length as `bits`).
    starts: Vec<u64>,
    mapped: u64,
    end: u64,
}

impl PageMap {
    /// A map of `range` bytes (a multiple of `page`), nothing mapped.
    pub fn new(range: u64, page: u64) -> PageMap {
        debug_assert!(page > 0 && range.is_multiple_of(page));
        PageMap { page, pages: range / page, bits: Vec::new(), starts: Vec::new(), mapped: 0, end: 0 }
    }

    pub fn page_size(&self) -> u64 {
        self.page
    }

    /// Pages in the range.
    pub fn page_count(&self) -> u64 {
        self.pages
    }

    /// Bytes mapped.
    pub fn mapped_bytes(&self) -> u64 {
        self.mapped * self.page
    }

    /// Bytes from the base to the end of the highest mapped page.
    pub fn end_bytes(&self) -> u64 {
        self.end * self.page
    }

    pub fn is_mapped(&self, page: u64) -> bool {
        page < self.end && bit(&self.bits, page)
    }

    /// Whether every page of `[first, first + count)` is mapped.
    pub fn all_mapped(&self, first: u64, count: u64) -> bool {
        first + count <= self.end && find(&self.bits, first, first + count, false) >= first + count
    }

    /// The first mapped page in `[from, stop)`, or `stop`.
    pub fn next_mapped(&self, from: u64, stop: u64) -> u64 {
        find(&self.bits, from, stop, true)
    }

    /// Whether an allocation begins at `page`.
    pub fn is_start(&self, page: u64) -> bool {
        page < self.end && bit(&self.starts, page)
    }

    /// Marks pages `[first, first + count)` mapped (each must be unmapped),
    /// as allocations of `each` pages (`count` a multiple of it).
    pub fn set_mapped(&mut self, first: u64, count: u64, each: u64) {
        debug_assert!(first + count <= self.pages && each > 0 && count.is_multiple_of(each));
        let words = (first + count).div_ceil(64) as usize;
        if self.bits.len() < words {
            self.bits.resize(words, 0);
            self.starts.resize(words, 0);
        }
        debug_assert!(find(&self.bits, first, first + count, true) == first + count, "pages {first}+{count} are mapped already");
        set_range(&mut self.bits, first, count, true);
        if each == 1 {
            set_range(&mut self.starts, first, count, true);
        } else {
            for start in (first..first + count).step_by(each as usize) {
                self.starts[(start / 64) as usize] |= 1 << (start % 64);
            }
        }
        self.mapped += count;
        self.end = self.end.max(first + count);
    }

    /// Marks the whole allocations of pages `[first, first + count)`
    /// unmapped (`whole` must hold).
    pub fn set_unmapped(&mut self, first: u64, count: u64) {
        debug_assert!(self.whole(first, count), "pages {first}+{count} are not whole allocations");
        set_range(&mut self.bits, first, count, false);
        set_range(&mut self.starts, first, count, false);
        self.mapped -= count;
        if first + count >= self.end {
            // The new end: after the last page still mapped, if any.
            self.end = if self.mapped == 0 { 0 } else { last_set_at_or_before(&self.bits, first - 1) + 1 };
        }
    }

    /// Whether pages `[first, first + count)` are mapped and are whole
    /// allocations (`count` > 0): they begin one and the page after them
    /// begins another or is unmapped.
    pub fn whole(&self, first: u64, count: u64) -> bool {
        count > 0
            && self.is_start(first)
            && find(&self.bits, first, first + count, false) == first + count
            && !self.continues(first + count)
    }

    /// Whether `page` is mapped as part of the allocation before it.
    fn continues(&self, page: u64) -> bool {
        self.is_mapped(page) && !self.is_start(page)
    }

    /// The allocation holding the mapped `page`: its first page and length.
    pub fn allocation(&self, page: u64) -> (u64, u64) {
        debug_assert!(self.is_mapped(page));
        let first = last_set_at_or_before(&self.starts, page);
        (first, self.length_from(first, page))
    }

    /// The pages of the allocation beginning at `first`, given its `page`:
    /// up to the next start or the next unmapped page.
    fn length_from(&self, first: u64, page: u64) -> u64 {
        let next = find(&self.starts, page + 1, self.end, true);
        find(&self.bits, page + 1, next, false) - first
    }

    /// The pages touched by bytes `[start, end)`: first page and count.
    pub fn touched(&self, start: u64, end: u64) -> (u64, u64) {
        let first = start / self.page;
        (first, end.div_ceil(self.page) - first)
    }

    /// The pages lying entirely inside bytes `[start, end)`: first page and count.
    pub fn inside(&self, start: u64, end: u64) -> (u64, u64) {
        let first = start.div_ceil(self.page);
        let last = end / self.page;
        (first, last.saturating_sub(first))
    }

    /// Maximal runs `(first, count)` of pages in `[first, first + count)`
    /// whose mapped state is `mapped`.
    pub fn runs(&self, first: u64, count: u64, mapped: bool) -> Vec<(u64, u64)> {
        let mut out: Vec<(u64, u64)> = Vec::new();
        let stop = if mapped { (first + count).min(self.end) } else { first + count };
        let mut page = first;
        while page < stop {
            let begin = find(&self.bits, page, stop, mapped);
            if begin >= stop {
                break;
            }
            let end = find(&self.bits, begin, stop, !mapped);
            out.push((begin, end - begin));
            page = end;
        }
        out
    }

    /// The allocations lying entirely inside pages `[first, first + count)`,
    /// each `(first page, pages)`, in address order. (One that begins in
    /// the range and reaches past it ends the walk: any later one begins
    /// past it.)
    pub fn allocations_in(&self, first: u64, count: u64) -> impl Iterator<Item = (u64, u64)> + '_ {
        let stop = first + count;
        let mut at = find(&self.starts, first, stop, true);
        std::iter::from_fn(move || {
            if at >= stop {
                return None;
            }
            let (start, len) = (at, self.length_from(at, at));
            if start + len > stop {
                at = stop;
                return None;
            }
            at = find(&self.starts, start + len, stop, true);
            Some((start, len))
        })
    }

    /// The runs of adjacent allocations lying entirely inside pages
    /// `[first, first + count)` (`runs_of` over `allocations_in`), found a
    /// word at a time: the mapped runs there, less the part of an
    /// allocation begun before the range at its start and of one reaching
    /// past it at its end (a run after an unmapped page begins an
    /// allocation).
    pub fn allocation_runs(&self, first: u64, count: u64) -> Vec<(u64, u64)> {
        let stop = first + count;
        let mut runs = self.runs(first, count, true);
        if let Some(run) = runs.first_mut().filter(|&&mut (p, _)| self.continues(p)) {
            let next = find(&self.starts, run.0, run.0 + run.1, true);
            *run = (next, run.0 + run.1 - next);
        }
        if let Some(run) = runs.last_mut().filter(|&&mut (p, n)| p + n == stop && self.continues(stop)) {
            let cut = last_set_at_or_before(&self.starts, stop).max(run.0);
            run.1 = cut - run.0;
        }
        runs.retain(|&(_, n)| n > 0);
        runs
    }

    /// How many allocations begin in pages `[first, first + count)`.
    pub fn allocation_count(&self, first: u64, count: u64) -> u64 {
        let stop = (first + count).min(self.end);
        if first >= stop {
            return 0;
        }
        count_set(&self.starts, first, stop - first)
    }

    /// The pages of the allocations lying entirely inside pages `[first,
    /// first + count)` (those `allocations_in` yields), counted a word at a
    /// time: the mapped pages from the first start in the range, less those
    /// of an allocation reaching past its end.
    pub fn pages_of_allocations_in(&self, first: u64, count: u64) -> u64 {
        let stop = (first + count).min(self.end);
        let from = find(&self.starts, first, stop, true);
        if from >= stop {
            return 0;
        }
        let straddling = if self.continues(first + count) { first + count - self.allocation(first + count).0 } else { 0 };
        count_set(&self.bits, from, stop - from) - straddling
    }

    /// Whether an allocation lies entirely inside pages `[first, first +
    /// count)`: the first that starts there does, or none does.
    pub fn any_allocation_within(&self, first: u64, count: u64) -> bool {
        let stop = first + count;
        let start = find(&self.starts, first, stop, true);
        start < stop && {
            let next = find(&self.starts, start + 1, self.end, true);
            find(&self.bits, start + 1, next, false) <= stop
        }
    }

    /// Bytes of `[start, end)` that lie in mapped pages.
    pub fn mapped_bytes_within(&self, start: u64, end: u64) -> u64 {
        let end = end.min(self.end_bytes());
        if start >= end {
            return 0;
        }
        if self.mapped == self.end {
            // No holes below `end`: every byte up to it is mapped.
            return end - start;
        }
        let (first, count) = self.touched(start, end);
        (first..first + count).filter(|&p| self.is_mapped(p)).map(|p| end.min((p + 1) * self.page) - start.max(p * self.page)).sum()
    }

    /// Bytes of `[start, end)` in mapped memory that cannot go back while
    /// what lies outside it is in use: the bytes inside it of the
    /// allocations that reach outside (the part of a free block held by
    /// its neighbours' allocations; with allocations of one page, at most
    /// a page at each end).
    pub fn pinned_bytes(&self, start: u64, end: u64) -> u64 {
        if start >= end {
            return 0;
        }
        let (first, count) = self.touched(start, end);
        let outside = |page: u64| -> Option<(u64, u64)> {
            if !self.is_mapped(page) {
                return None;
            }
            let (a, n) = self.allocation(page);
            let (from, to) = (a * self.page, (a + n) * self.page);
            (from < start || to > end).then(|| (from.max(start), to.min(end)))
        };
        let head = outside(first);
        let tail = if count > 1 { outside(first + count - 1) } else { None };
        match (head, tail) {
            (Some((a, b)), Some((c, d))) if (a, b) == (c, d) => b - a,
            (head, tail) => head.map_or(0, |(a, b)| b - a) + tail.map_or(0, |(c, d)| d - c),
        }
    }

    /// The longest stretch of mapped bytes inside `[start, end)`.
    pub fn longest_mapped_run(&self, start: u64, end: u64) -> u64 {
        let (first, count) = self.touched(start, end);
        self.runs(first, count, true).into_iter().map(|(p, n)| end.min((p + n) * self.page) - start.max(p * self.page)).max().unwrap_or(0)
    }

    /// Checks the counts and the allocations against the bits.
    pub fn check(&self) -> Result<(), String> {
        let set: u64 = self.bits.iter().map(|w| w.count_ones() as u64).sum();
        if set != self.mapped {
            return Err(format!("page map counts {} mapped pages, bits hold {set}", self.mapped));
        }
        let highest = (0..self.bits.len() as u64 * 64).rev().find(|&p| bit(&self.bits, p));
        if highest.map_or(0, |p| p + 1) != self.end {
            return Err(format!("page map end is {} but the highest mapped page is {highest:?}", self.end));
        }
        if self.end > self.pages {
            return Err(format!("page map end {} past the range's {} pages", self.end, self.pages));
        }
        if let Some(w) = (0..self.starts.len()).find(|&w| self.starts[w] & !self.bits[w] != 0) {
            return Err(format!("page map: an allocation begins at an unmapped page (word {w})"));
        }
        for (p, _) in self.runs(0, self.end, true) {
            if !self.is_start(p) {
                return Err(format!("page map: the mapped run at page {p} begins inside no allocation"));
            }
        }
        Ok(())
    }
}

/// The first page in `[from, stop)` whose bit is `set` (`stop` if none),
/// a word at a time; pages past the words are clear.
fn find(words: &[u64], from: u64, stop: u64, set: bool) -> u64 {
    let mut page = from;
    while page < stop {
        let index = (page / 64) as usize;
        let Some(&word) = words.get(index) else {
            return if set { stop } else { page };
        };
        let candidates = if set { word } else { !word } & (u64::MAX << (page % 64));
        if candidates != 0 {
            return (index as u64 * 64 + candidates.trailing_zeros() as u64).min(stop);
        }
        page = (index as u64 + 1) * 64;
    }
    stop
}

/// The words holding pages `[first, first + count)`, each with the mask of
/// those pages in it.
fn word_masks(first: u64, count: u64) -> impl Iterator<Item = (usize, u64)> {
    let stop = first + count;
    let mut page = first;
    std::iter::from_fn(move || {
        if page >= stop {
            return None;
        }
        let index = (page / 64) as usize;
        let low = page % 64;
        let high = (stop - index as u64 * 64).min(64);
        page = index as u64 * 64 + high;
        Some((index, (u64::MAX >> (64 - (high - low))) << low))
    })
}

/// Sets (or clears) the bits of pages `[first, first + count)`, a word at a time.
fn set_range(words: &mut [u64], first: u64, count: u64, value: bool) {
    for (index, mask) in word_masks(first, count) {
        if value {
            words[index] |= mask;
        } else {
            words[index] &= !mask;
        }
    }
}

/// How many of pages `[first, first + count)` have their bit set, a word
/// at a time (the pages must lie within the words).
fn count_set(words: &[u64], first: u64, count: u64) -> u64 {
    word_masks(first, count).map(|(index, mask)| u64::from((words[index] & mask).count_ones())).sum()
}

/// The last page at or before `page` whose bit is set (one must be).
fn last_set_at_or_before(words: &[u64], page: u64) -> u64 {
    let mut index = (page / 64) as usize;
    let mut word = words[index] & (u64::MAX >> (63 - page % 64));
    while word == 0 {
        index -= 1;
        word = words[index];
    }
    index as u64 * 64 + 63 - word.leading_zeros() as u64
}

fn bit(words: &[u64], page: u64) -> bool {
    words[(page / 64) as usize] >> (page % 64) & 1 == 1
}

/// The runs of adjacent allocations among `allocations` (first page and
/// pages each, in address order), as (first page, pages).
pub fn runs_of(allocations: &[(u64, u64)]) -> impl Iterator<Item = (u64, u64)> + '_ {
    allocations.chunk_by(|a, b| a.0 + a.1 == b.0).map(|run| {
        let (first, last) = (run[0], run[run.len() - 1]);
        (first.0, last.0 + last.1 - first.0)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const PAGE: u64 = 2 << 20;

    #[test]
    fn runs_and_counts_follow_the_bits() {
        let mut map = PageMap::new(64 * PAGE, PAGE);
        map.set_mapped(0, 3, 1);
        map.set_mapped(5, 2, 1);
        assert_eq!((map.mapped_bytes(), map.end_bytes()), (5 * PAGE, 7 * PAGE));
        assert_eq!(map.runs(0, 10, true), vec![(0, 3), (5, 2)]);
        assert_eq!(map.runs(0, 10, false), vec![(3, 2), (7, 3)]);
        assert_eq!(map.mapped_bytes_within(PAGE / 2, 6 * PAGE), 5 * PAGE / 2 + PAGE);
        assert_eq!(map.longest_mapped_run(PAGE / 2, 64 * PAGE), 5 * PAGE / 2);
        assert_eq!(map.pinned_bytes(PAGE / 2, 5 * PAGE + 512), PAGE / 2 + 512, "pages 0 and 5 stick out");
        assert_eq!(map.pinned_bytes(PAGE + 512, PAGE + 1024), 512);
        assert_eq!(map.pinned_bytes(PAGE, 3 * PAGE), 0, "whole pages are not pinned");
        map.set_unmapped(5, 2);
        assert_eq!(map.end_bytes(), 3 * PAGE, "end drops back to the highest mapped page");
        assert_eq!(map.mapped_bytes_within(0, 64 * PAGE), 3 * PAGE);
        map.check().unwrap();
    }

    #[test]
    fn allocations_go_back_whole() {
        let mut map = PageMap::new(256 * PAGE, PAGE);
        map.set_mapped(0, 8, 4); // two allocations of four pages
        map.set_mapped(8, 3, 3); // and one of three right after
        assert_eq!(map.allocation(5), (4, 4));
        assert_eq!(map.allocation(10), (8, 3));
        assert!(map.whole(4, 4) && map.whole(0, 11));
        assert!(!map.whole(5, 3) && !map.whole(4, 5) && !map.whole(0, 3), "a part of an allocation is not whole");
        // Only allocations wholly inside a range can go back from it.
        assert_eq!(map.allocations_in(1, 10).collect::<Vec<_>>(), vec![(4, 4), (8, 3)]);
        assert_eq!(runs_of(&[(4, 4), (8, 3), (12, 1)]).collect::<Vec<_>>(), vec![(4, 7), (12, 1)]);
        assert_eq!(map.allocations_in(0, 7).collect::<Vec<_>>(), vec![(0, 4)]);
        assert!(map.any_allocation_within(0, 4) && map.any_allocation_within(1, 10) && map.any_allocation_within(3, 8));
        assert!(!map.any_allocation_within(1, 6) && !map.any_allocation_within(5, 5) && !map.any_allocation_within(11, 20));
        // A free stretch of pages 2..9 is held by the allocations at 0 and 8 that reach outside it.
        assert_eq!(map.pinned_bytes(2 * PAGE, 9 * PAGE), 2 * PAGE + PAGE);
        assert_eq!(map.pinned_bytes(5 * PAGE, 6 * PAGE), PAGE, "inside one allocation: all of it");
        map.set_unmapped(4, 4);
        assert_eq!(map.runs(0, 11, true), vec![(0, 4), (8, 3)]);
        map.check().unwrap();
        // Across words: an allocation of 100 pages from page 60.
        map.set_mapped(60, 100, 100);
        assert_eq!((map.allocation(150), map.end_bytes()), ((60, 100), 160 * PAGE));
        assert_eq!(map.runs(0, 200, true), vec![(0, 4), (8, 3), (60, 100)]);
        assert_eq!(map.runs(3, 100, false), vec![(4, 4), (11, 49)]);
        map.set_mapped(160, 70, 1);
        assert_eq!((map.allocation_count(0, 256), map.allocation_count(3, 100), map.allocation_count(61, 166)), (73, 2, 67));
        // Counted (and runs found) a word at a time, the same as walked
        // allocation by allocation.
        for first in (0..256).step_by(3) {
            for count in [1, 2, 5, 40, 64, 100, 170, 256 - first] {
                let walked: u64 = map.allocations_in(first, count).map(|(_, n)| n).sum();
                assert_eq!(map.pages_of_allocations_in(first, count), walked, "pages {first}+{count}");
                let walked_runs: Vec<_> = runs_of(&map.allocations_in(first, count).collect::<Vec<_>>()).collect();
                assert_eq!(map.allocation_runs(first, count), walked_runs, "runs in pages {first}+{count}");
            }
        }
        map.set_unmapped(60, 170);
        assert_eq!(map.end_bytes(), 11 * PAGE);
        map.check().unwrap();
    }

    #[test]
    fn touched_and_inside_round_outward_and_inward() {
        let map = PageMap::new(64 * PAGE, PAGE);
        assert_eq!(map.touched(PAGE - 512, PAGE + 512), (0, 2));
        assert_eq!(map.inside(PAGE - 512, 3 * PAGE + 512), (1, 2));
        assert_eq!(map.inside(PAGE + 512, 2 * PAGE - 512), (2, 0));
    }

    #[test]
    fn a_drifted_count_or_a_run_without_its_allocation_is_caught() {
        let mut map = PageMap::new(64 * PAGE, PAGE);
        map.set_mapped(70 % 64, 1, 1);
        map.mapped += 1;
        assert!(map.check().unwrap_err().contains("mapped pages"));
        map.mapped -= 1;
        map.starts[0] = 0;
        assert!(map.check().unwrap_err().contains("begins inside no allocation"));
    }
}
