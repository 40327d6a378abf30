//! The page map of an expandable segment: which pages of its virtual range
//! are backed by physical memory.
//!
//! An expandable segment is a range of address space reserved once; pages
//! (the driver's granularity, 2 MiB on CUDA) are mapped when a block needs
//! them and unmapped when they lie entirely inside free blocks and a release
//! policy asks for memory. Offsets here are bytes from the range's base.
//!
//! Invariants (checked by `DeviceHeap::validate` through `check`):
//!   mapped = number of set bits
//!   end    = one past the highest set bit (0 when none): every page at or
//!            after `end` is unmapped, so scans stop there
#![forbid(unsafe_code)]

/// One bit per page of a range; set when the page is mapped.
#[derive(Clone, Debug)]
pub struct PageMap {
    page: u64,
    /// Pages in the range.
    pages: u64,
    /// Grown on demand, up to the word holding `end - 1`.
    bits: Vec<u64>,
    mapped: u64,
    end: u64,
}

impl PageMap {
    /// A map of `range` bytes (a multiple of `page`), nothing mapped.
    pub fn new(range: u64, page: u64) -> PageMap {
        debug_assert!(page > 0 && range.is_multiple_of(page));
        PageMap { page, pages: range / page, bits: Vec::new(), mapped: 0, end: 0 }
    }

    pub fn page_size(&self) -> u64 {
        self.page
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
        page < self.end && self.bits[(page / 64) as usize] >> (page % 64) & 1 == 1
    }

    /// Marks pages `[first, first + count)` mapped (each must be unmapped).
    pub fn set_mapped(&mut self, first: u64, count: u64) {
        debug_assert!(first + count <= self.pages);
        let words = (first + count).div_ceil(64) as usize;
        if self.bits.len() < words {
            self.bits.resize(words, 0);
        }
        for page in first..first + count {
            debug_assert!(!self.is_mapped(page));
            self.bits[(page / 64) as usize] |= 1 << (page % 64);
        }
        self.mapped += count;
        self.end = self.end.max(first + count);
    }

    /// Marks pages `[first, first + count)` unmapped (each must be mapped).
    pub fn set_unmapped(&mut self, first: u64, count: u64) {
        for page in first..first + count {
            debug_assert!(self.is_mapped(page));
            self.bits[(page / 64) as usize] &= !(1 << (page % 64));
        }
        self.mapped -= count;
        while self.end > 0 && !self.is_mapped(self.end - 1) {
            self.end -= 1;
        }
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
            if page >= self.end {
                // Everything from `end` on is unmapped.
                push_run(&mut out, page, stop - page);
                break;
            }
            if self.is_mapped(page) == mapped {
                push_run(&mut out, page, 1);
            }
            page += 1;
        }
        out
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

    /// Bytes of `[start, end)` in mapped pages that reach outside it: the
    /// part of a free block that cannot be unmapped while its neighbours
    /// are in use (at most a page at each end).
    pub fn edge_bytes(&self, start: u64, end: u64) -> u64 {
        let (first, count) = self.touched(start, end);
        let overlap = |p: u64| end.min((p + 1) * self.page) - start.max(p * self.page);
        let edge = |p: u64| {
            let whole = p * self.page >= start && (p + 1) * self.page <= end;
            if !whole && self.is_mapped(p) {
                overlap(p)
            } else {
                0
            }
        };
        match count {
            0 => 0,
            1 => edge(first),
            _ => edge(first) + edge(first + count - 1),
        }
    }

    /// The longest stretch of mapped bytes inside `[start, end)`.
    pub fn longest_mapped_run(&self, start: u64, end: u64) -> u64 {
        let (first, count) = self.touched(start, end);
        self.runs(first, count, true).into_iter().map(|(p, n)| end.min((p + n) * self.page) - start.max(p * self.page)).max().unwrap_or(0)
    }

    /// Checks the counts against the bits.
    pub fn check(&self) -> Result<(), String> {
        let set: u64 = self.bits.iter().map(|w| w.count_ones() as u64).sum();
        if set != self.mapped {
            return Err(format!("page map counts {} mapped pages, bits hold {set}", self.mapped));
        }
        let highest = (0..self.bits.len() as u64 * 64).rev().find(|&p| self.bits[(p / 64) as usize] >> (p % 64) & 1 == 1);
        if highest.map_or(0, |p| p + 1) != self.end {
            return Err(format!("page map end is {} but the highest mapped page is {highest:?}", self.end));
        }
        if self.end > self.pages {
            return Err(format!("page map end {} past the range's {} pages", self.end, self.pages));
        }
        Ok(())
    }
}

fn push_run(out: &mut Vec<(u64, u64)>, page: u64, count: u64) {
    match out.last_mut() {
        Some((first, n)) if *first + *n == page => *n += count,
        _ => out.push((page, count)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PAGE: u64 = 2 << 20;

    #[test]
    fn runs_and_counts_follow_the_bits() {
        let mut map = PageMap::new(64 * PAGE, PAGE);
        map.set_mapped(0, 3);
        map.set_mapped(5, 2);
        assert_eq!((map.mapped_bytes(), map.end_bytes()), (5 * PAGE, 7 * PAGE));
        assert_eq!(map.runs(0, 10, true), vec![(0, 3), (5, 2)]);
        assert_eq!(map.runs(0, 10, false), vec![(3, 2), (7, 3)]);
        assert_eq!(map.mapped_bytes_within(PAGE / 2, 6 * PAGE), 5 * PAGE / 2 + PAGE);
        assert_eq!(map.longest_mapped_run(PAGE / 2, 64 * PAGE), 5 * PAGE / 2);
        assert_eq!(map.edge_bytes(PAGE / 2, 5 * PAGE + 512), PAGE / 2 + 512, "pages 0 and 5 stick out");
        assert_eq!(map.edge_bytes(PAGE + 512, PAGE + 1024), 512);
        assert_eq!(map.edge_bytes(PAGE, 3 * PAGE), 0, "whole pages are not edges");
        map.set_unmapped(5, 2);
        assert_eq!(map.end_bytes(), 3 * PAGE, "end drops back to the highest mapped page");
        assert_eq!(map.mapped_bytes_within(0, 64 * PAGE), 3 * PAGE);
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
    fn a_drifted_count_is_caught() {
        let mut map = PageMap::new(64 * PAGE, PAGE);
        map.set_mapped(70 % 64, 1);
        map.mapped += 1;
        assert!(map.check().unwrap_err().contains("mapped pages"));
    }
}
