//! The segments of one heap: each allocation from the backend, or reserved
//! range of an expandable segment, by id and by base address, with the
//! blocks that tile it reached through its first block.
//!
//! Invariants (checked by `Segments::check`, called by `validate()`):
//! - a slot is empty exactly when its id is in `unused` (reused first);
//! - every segment is in `by_base` under its base, and nothing else is.
#![forbid(unsafe_code)]

use std::collections::BTreeMap;

use super::ids::{BlockId, PoolId, SegmentId};
use crate::page_map::PageMap;

/// One allocation from the backend, or one reserved range of an
/// expandable segment (then `size` is its address space, and `pages` says
/// which of its pages hold memory).
#[derive(Clone, Debug)]
pub struct Segment {
    pub base: u64,
    pub size: u64,
    pub pages: Option<PageMap>,
    pub pool: PoolId,
    /// The block at `base`.
    pub first_block: BlockId,
    /// When the segment last became one whole free block (reclaimer clock).
    pub idle_since_ms: u64,
}

impl Segment {
    /// The base and the page map of a reserved range (None: a whole segment).
    #[inline]
    pub fn range(&self) -> Option<(u64, &PageMap)> {
        Some((self.base, self.pages.as_ref()?))
    }

    /// Whether `ptr` lies inside the segment's address space.
    #[inline]
    pub fn contains(&self, ptr: u64) -> bool {
        ptr >= self.base && ptr < self.base + self.size
    }
}

/// The segments of a heap, by id (slots reused) and by base.
#[derive(Default)]
pub(super) struct Segments {
    slots: Vec<Option<Segment>>,
    /// The empty slots, reused before the table grows.
    unused: Vec<SegmentId>,
    by_base: BTreeMap<u64, SegmentId>,
}

impl Segments {
    /// The segment `id`, if it is still held.
    #[inline]
    pub fn get(&self, id: SegmentId) -> Option<&Segment> {
        self.slots[id.index()].as_ref()
    }

    #[inline]
    pub fn get_mut(&mut self, id: SegmentId) -> Option<&mut Segment> {
        self.slots[id.index()].as_mut()
    }

    /// The page map of segment `id`, when it is a reserved range.
    #[inline]
    pub fn pages(&self, id: SegmentId) -> Option<&PageMap> {
        self.get(id)?.pages.as_ref()
    }

    /// The base and page map of segment `id`, when it is a reserved range.
    #[inline]
    pub fn range(&self, id: SegmentId) -> Option<(u64, &PageMap)> {
        self.get(id)?.range()
    }

    /// The base and page size of segment `id`, when it is a reserved range.
    #[inline]
    pub fn base_and_page(&self, id: SegmentId) -> Option<(u64, u64)> {
        let (base, pages) = self.range(id)?;
        Some((base, pages.page_size()))
    }

    /// Files a new segment made by `make` (given its id); returns the id.
    pub fn insert(&mut self, make: impl FnOnce(SegmentId) -> Segment) -> SegmentId {
        let id = match self.unused.pop() {
            Some(id) => id,
            None => {
                self.slots.push(None);
                SegmentId::new(self.slots.len() - 1)
            }
        };
        let segment = make(id);
        self.by_base.insert(segment.base, id);
        self.slots[id.index()] = Some(segment);
        id
    }

    /// Takes segment `id` out of the table (its slot to be reused).
    pub fn remove(&mut self, id: SegmentId) -> Option<Segment> {
        let segment = self.slots[id.index()].take()?;
        self.unused.push(id);
        self.by_base.remove(&segment.base);
        Some(segment)
    }

    /// Whether the heap holds no segment.
    pub fn is_empty(&self) -> bool {
        self.by_base.is_empty()
    }

    /// How many slots the table has (held or not): ids are below it.
    pub fn slot_count(&self) -> usize {
        self.slots.len()
    }

    /// The ids of every slot, held or not, in id order.
    pub fn ids(&self) -> impl Iterator<Item = SegmentId> {
        (0..self.slots.len()).map(SegmentId::new)
    }

    /// The segments held, in id order.
    pub fn iter(&self) -> impl Iterator<Item = (SegmentId, &Segment)> {
        self.slots.iter().enumerate().filter_map(|(i, s)| Some((SegmentId::new(i), s.as_ref()?)))
    }

    /// The segments held, in address order.
    pub fn by_address(&self) -> impl Iterator<Item = (SegmentId, &Segment)> {
        self.by_base.values().map(|&id| (id, self.slots[id.index()].as_ref().expect("indexed segment exists")))
    }

    /// The segment whose base is `base`.
    pub fn at_base(&self, base: u64) -> Option<SegmentId> {
        self.by_base.get(&base).copied()
    }

    /// The segment whose address space holds `ptr`.
    pub fn containing(&self, ptr: u64) -> Option<(SegmentId, &Segment)> {
        self.last_at_or_below(ptr).filter(|(_, s)| s.contains(ptr))
    }

    /// The segment with the highest base at or below `ptr`.
    pub fn last_at_or_below(&self, ptr: u64) -> Option<(SegmentId, &Segment)> {
        let (_, &id) = self.by_base.range(..=ptr).next_back()?;
        Some((id, self.slots[id.index()].as_ref().expect("indexed segment exists")))
    }

    /// Checks the invariants at the top of this file.
    pub fn check(&self) -> Result<(), String> {
        for (i, slot) in self.slots.iter().enumerate() {
            let id = SegmentId::new(i);
            match slot {
                None if !self.unused.contains(&id) => return Err(format!("empty segment slot {id} not reusable")),
                Some(_) if self.unused.contains(&id) => return Err(format!("segment {id} is held but its slot is marked unused")),
                Some(segment) if self.by_base.get(&segment.base) != Some(&id) => return Err(format!("segment {id} not indexed by base")),
                _ => {}
            }
        }
        if self.by_base.len() + self.unused.len() != self.slots.len() {
            return Err(format!(
                "{} segments indexed by base, {} unused, of {} slots",
                self.by_base.len(),
                self.unused.len(),
                self.slots.len()
            ));
        }
        Ok(())
    }
}

impl std::ops::Index<SegmentId> for Segments {
    type Output = Segment;
    #[inline]
    fn index(&self, id: SegmentId) -> &Segment {
        self.get(id).expect("a held segment")
    }
}

impl std::ops::IndexMut<SegmentId> for Segments {
    #[inline]
    fn index_mut(&mut self, id: SegmentId) -> &mut Segment {
        self.get_mut(id).expect("a held segment")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn segment(base: u64) -> impl FnOnce(SegmentId) -> Segment {
        move |_| Segment { base, size: 1 << 20, pages: None, pool: PoolId::new(0), first_block: BlockId::new(0), idle_since_ms: 0 }
    }

    #[test]
    fn slots_are_reused_and_found_by_address() {
        let mut segments = Segments::default();
        let a = segments.insert(segment(1 << 30));
        let b = segments.insert(segment(1 << 31));
        assert_eq!(segments.containing((1 << 30) + 5).map(|(id, _)| id), Some(a));
        assert!(segments.containing((1 << 30) + (1 << 20)).is_none(), "past its end");
        segments.remove(a);
        segments.check().unwrap();
        let c = segments.insert(segment(1 << 32));
        assert_eq!(c, a, "the empty slot is reused");
        assert_eq!(segments.by_address().map(|(id, _)| id).collect::<Vec<_>>(), [b, c]);
        segments.check().unwrap();
    }

    #[test]
    fn a_broken_table_is_caught() {
        let mut segments = Segments::default();
        let a = segments.insert(segment(1 << 30));
        segments.remove(a);
        segments.unused.clear();
        assert!(segments.check().unwrap_err().contains("not reusable"));
        let mut segments = Segments::default();
        segments.insert(segment(1 << 30));
        segments.by_base.clear();
        assert!(segments.check().unwrap_err().contains("not indexed by base"));
    }
}
