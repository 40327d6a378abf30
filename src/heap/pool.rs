//! Pools: the free blocks of one (stream, private pool, tag, pool kind),
//! binned by size (`Pool`), and the table of a heap's pools, filed by key
//! (`Pools`).
//!
//! Each bin is a free list kept in ascending size order (equal sizes: the
//! most recently freed first). A two-level bitmap marks the non-empty bins:
//! one bit per row (power of two) in `rows_nonempty`, one bit per bin in
//! `bins_nonempty[row]`. Finding the first non-empty bin at or after a given
//! one is two bit scans, whatever the number of free blocks.
//!
//! Invariants (checked by `DeviceHeap::validate`):
//!   bit of bin b set  <=>  `heads[b] != NIL`
//!   bit of row r set  <=>  `bins_nonempty[r] != 0`
//!   every block in list b has bin_of(size) == b, sizes ascend along the list
//!   free_bytes = sum of sizes in all lists, free_blocks = their count
//! and of the table (`Pools::check`):
//!   each pool is filed once, under its own (stream, private, tag) and kind;
//!   no pool is both tagged and private.
#![forbid(unsafe_code)]

use std::collections::HashMap;

use super::block::{BlockArena, BlockId, BlockState, NIL};
use super::ids::PoolId;
use super::private::PrivatePoolId;
use crate::size_class::{bin_of, PoolKind, SizeRules, BIN_COUNT, MANTISSA_BITS, ROWS};
use crate::tag::TagId;
use crate::types::Stream;

const SUBS: usize = 1 << MANTISSA_BITS;

pub struct Pool {
    pub stream: Stream,
    pub kind: PoolKind,
    /// The private pool (graph pool, `MemPool`) this pool belongs to, if any.
    pub private: Option<PrivatePoolId>,
    /// The tag of its blocks (`TagId::DEFAULT`: untagged).
    pub tag: TagId,
    /// Page and range size when it grows by pages of reserved ranges
    /// (expandable segments, tags); None when by whole segments.
    pub(super) vm: Option<super::expandable::Vm>,
    pub heads: Box<[BlockId]>,
    pub rows_nonempty: u64,
    pub bins_nonempty: [u32; ROWS as usize],
    /// Bytes and count of the blocks in the bins (not the stash).
    pub free_bytes: u64,
    pub free_blocks: usize,
    /// The most recently freed block, not yet merged or binned, where best
    /// fit would put the next request of its size (NIL: none).
    pub stash: BlockId,
}

impl Pool {
    pub fn new(stream: Stream, kind: PoolKind, private: Option<PrivatePoolId>) -> Pool {
        Pool {
            stream,
            kind,
            private,
            tag: TagId::DEFAULT,
            vm: None,
            heads: vec![NIL; BIN_COUNT].into_boxed_slice(),
            rows_nonempty: 0,
            bins_nonempty: [0; ROWS as usize],
            free_bytes: 0,
            free_blocks: 0,
            stash: NIL,
        }
    }

    #[inline]
    fn mark(&mut self, bin: usize, nonempty: bool) {
        let (row, sub) = (bin / SUBS, bin % SUBS);
        if nonempty {
            self.bins_nonempty[row] |= 1 << sub;
            self.rows_nonempty |= 1 << row;
        } else {
            self.bins_nonempty[row] &= !(1 << sub);
            if self.bins_nonempty[row] == 0 {
                self.rows_nonempty &= !(1 << row);
            }
        }
    }

    /// The first non-empty bin at or after `bin`.
    #[inline]
    pub fn first_nonempty_from(&self, bin: usize) -> Option<usize> {
        let (row, sub) = (bin / SUBS, bin % SUBS);
        let in_row = self.bins_nonempty[row] & (u32::MAX << sub);
        if in_row != 0 {
            return Some(row * SUBS + in_row.trailing_zeros() as usize);
        }
        let later_rows = if row + 1 >= 64 { 0 } else { self.rows_nonempty & (u64::MAX << (row + 1)) };
        if later_rows == 0 {
            return None;
        }
        let r = later_rows.trailing_zeros() as usize;
        Some(r * SUBS + self.bins_nonempty[r].trailing_zeros() as usize)
    }

    /// Adds the free block `id` of `size` bytes, keeping its bin in
    /// ascending size order (equal sizes: most recent first).
    #[inline]
    pub fn insert(&mut self, blocks: &mut BlockArena, id: BlockId, size: u64) {
        blocks[id].state = BlockState::Binned;
        let bin = bin_of(size);
        let head = self.heads[bin];
        if head == NIL || blocks[head].size >= size {
            blocks.link_front(id, head);
            if head == NIL {
                self.mark(bin, true);
            }
            self.heads[bin] = id;
        } else {
            let mut prev = head;
            let mut cur = blocks[head].link_next();
            while cur != NIL && blocks[cur].size < size {
                prev = cur;
                cur = blocks[cur].link_next();
            }
            blocks.link_after(id, prev);
        }
        self.free_bytes += size;
        self.free_blocks += 1;
    }

    /// Unlinks the free block `id` of `size` bytes from its bin.
    #[inline]
    pub fn remove(&mut self, blocks: &mut BlockArena, id: BlockId, size: u64) {
        blocks[id].state = BlockState::Detached;
        let (prev, next) = blocks.unlink(id);
        if prev == NIL {
            let bin = bin_of(size);
            self.heads[bin] = next;
            if next == NIL {
                self.mark(bin, false);
            }
        }
        self.free_bytes -= size;
        self.free_blocks -= 1;
    }

    /// The best-fitting free block for a rounded request: the smallest
    /// block of at least `rounded` bytes that the rules let serve it.
    #[inline]
    pub fn best_fit(&self, blocks: &BlockArena, rounded: u64, rules: &SizeRules) -> Option<BlockId> {
        let cur = self.first_fit(blocks, rounded)?;
        // Sizes only grow from here, so a block the rules refuse means no
        // larger block will do either. A paged pool splits any block: its
        // ranges are huge free blocks, and a split holds no memory.
        (self.vm.is_some() || rules.may_serve(blocks[cur].size, rounded)).then_some(cur)
    }

    /// The size of the block `best_fit` would look at first for `rounded`
    /// bytes if `skip` (NIL: none) were not in the bins; None when no
    /// other block is that large. The rules are not asked: the caller
    /// (`DeviceHeap::stash_is_best_fit`) compares sizes only.
    pub fn first_fit_size_without(&self, blocks: &BlockArena, rounded: u64, skip: BlockId) -> Option<u64> {
        let mut cur = self.first_fit(blocks, rounded)?;
        if cur == skip {
            cur = self.next_in_size_order(blocks, skip)?;
        }
        Some(blocks[cur].size)
    }

    /// The free blocks after `id` in size order (each at least as large).
    pub fn fits_after<'a>(&'a self, blocks: &'a BlockArena, id: BlockId) -> impl Iterator<Item = BlockId> + 'a {
        let mut cur = Some(id);
        std::iter::from_fn(move || {
            cur = self.next_in_size_order(blocks, cur?);
            cur
        })
    }

    /// The first block of at least `rounded` bytes in size order: looks in
    /// the request's own bin first (blocks there may be smaller), then
    /// takes the head of the first non-empty bin above it.
    #[inline(always)]
    fn first_fit(&self, blocks: &BlockArena, rounded: u64) -> Option<BlockId> {
        let own = bin_of(rounded);
        let mut cur = self.heads[own];
        while cur != NIL && blocks[cur].size < rounded {
            cur = blocks[cur].link_next();
        }
        if cur == NIL {
            if own + 1 >= BIN_COUNT {
                return None;
            }
            cur = self.heads[self.first_nonempty_from(own + 1)?];
        }
        Some(cur)
    }

    /// The free block after `id` in size order: the next in its bin, else
    /// the head of the first non-empty bin above.
    fn next_in_size_order(&self, blocks: &BlockArena, id: BlockId) -> Option<BlockId> {
        let next = blocks[id].link_next();
        if next != NIL {
            return Some(next);
        }
        let bin = bin_of(blocks[id].size) + 1;
        if bin >= BIN_COUNT {
            return None;
        }
        Some(self.heads[self.first_nonempty_from(bin)?])
    }

    /// The largest free block's size (0 when empty).
    pub fn largest(&self, blocks: &BlockArena) -> u64 {
        if self.rows_nonempty == 0 {
            return 0;
        }
        let row = 63 - self.rows_nonempty.leading_zeros() as usize;
        let bin = row * SUBS + 31 - self.bins_nonempty[row].leading_zeros() as usize;
        blocks.walk_list(self.heads[bin]).last().map_or(0, |(_, b)| b.size)
    }

    /// Every block in the bins, bin by bin (smallest first).
    pub fn free_members<'a>(&'a self, blocks: &'a BlockArena) -> impl Iterator<Item = BlockId> + 'a {
        let mut bin = self.first_nonempty_from(0);
        let mut cur = bin.map_or(NIL, |b| self.heads[b]);
        std::iter::from_fn(move || {
            while cur == NIL {
                let next = bin? + 1;
                bin = if next < BIN_COUNT { self.first_nonempty_from(next) } else { None };
                cur = bin.map_or(NIL, |b| self.heads[b]);
            }
            let id = cur;
            cur = blocks[id].link_next();
            Some(id)
        })
    }

    /// The blocks of one bin, in list order.
    pub fn bin_members<'a>(&self, blocks: &'a BlockArena, bin: usize) -> impl Iterator<Item = BlockId> + 'a {
        blocks.walk_list(self.heads[bin]).map(|(id, _)| id)
    }
}

/// What picks a request's pools: its stream, the private pool open (if
/// any) and its tag (`TagId::DEFAULT` for untagged; tagged pools are never
/// private).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) struct PoolKey {
    pub stream: Stream,
    pub private: Option<PrivatePoolId>,
    pub tag: TagId,
}

/// The pools of a heap, two (small, large) per key, made on first use.
#[derive(Default)]
pub(super) struct Pools {
    pools: Vec<Pool>,
    /// The (small, large) pools of each key.
    by_key: HashMap<PoolKey, [PoolId; 2]>,
    /// The last stream served from untagged pools and the pools it was
    /// served from: skips the map on the hot path (forgotten as private
    /// pools open and close).
    last_stream: Option<(Stream, [PoolId; 2])>,
}

impl Pools {
    /// The untagged pool of (`stream`, `kind`) if `stream` was the last served.
    #[inline(always)]
    pub fn last_served(&self, stream: Stream, kind: PoolKind) -> Option<PoolId> {
        match self.last_stream {
            Some((s, ids)) if s == stream => Some(ids[kind as usize]),
            _ => None,
        }
    }

    /// Remembers `ids` as the untagged pools `stream` is served from.
    #[inline]
    pub fn note_served(&mut self, stream: Stream, ids: [PoolId; 2]) {
        self.last_stream = Some((stream, ids));
    }

    /// Forgets the last stream served (its pools changed: a private pool opened or closed).
    pub fn forget_served(&mut self) {
        self.last_stream = None;
    }

    /// The (small, large) pools of `key`, made by `make` (given the kind) on first use.
    pub fn of_key(&mut self, key: PoolKey, mut make: impl FnMut(PoolKind) -> Pool) -> [PoolId; 2] {
        if let Some(ids) = self.by_key.get(&key) {
            return *ids;
        }
        let ids = [PoolKind::Small, PoolKind::Large].map(|kind| {
            self.pools.push(make(kind));
            PoolId::new(self.pools.len() - 1)
        });
        self.by_key.insert(key, ids);
        ids
    }

    /// Every pool, in id order.
    pub fn iter(&self) -> impl Iterator<Item = (PoolId, &Pool)> {
        self.pools.iter().enumerate().map(|(i, p)| (PoolId::new(i), p))
    }

    pub fn iter_mut(&mut self) -> impl Iterator<Item = &mut Pool> {
        self.pools.iter_mut()
    }

    /// Every pool's id.
    pub fn ids(&self) -> impl Iterator<Item = PoolId> {
        (0..self.pools.len()).map(PoolId::new)
    }

    /// The pools of `tag`.
    pub fn of_tag(&self, tag: TagId) -> Vec<PoolId> {
        self.iter().filter(|(_, p)| p.tag == tag).map(|(id, _)| id).collect()
    }

    /// Checks the table's invariants (top of this file).
    pub fn check(&self) -> Result<(), String> {
        for (key, ids) in &self.by_key {
            for (kind, &id) in [PoolKind::Small, PoolKind::Large].into_iter().zip(ids) {
                let pool = &self[id];
                let filed = PoolKey { stream: pool.stream, private: pool.private, tag: pool.tag };
                if filed != *key || pool.kind != kind {
                    return Err(format!("pool {id} is filed under {key:?}, not its own {filed:?} and kind"));
                }
                if key.tag != TagId::DEFAULT && key.private.is_some() {
                    return Err(format!("pool {id} is both tagged and private"));
                }
            }
        }
        if self.pools.len() != 2 * self.by_key.len() {
            return Err(format!("{} pools, {} filed", self.pools.len(), 2 * self.by_key.len()));
        }
        Ok(())
    }
}

impl std::ops::Index<PoolId> for Pools {
    type Output = Pool;
    #[inline(always)]
    fn index(&self, id: PoolId) -> &Pool {
        &self.pools[id.index()]
    }
}

impl std::ops::IndexMut<PoolId> for Pools {
    #[inline(always)]
    fn index_mut(&mut self, id: PoolId) -> &mut Pool {
        &mut self.pools[id.index()]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool_with(sizes: &[u64]) -> (Pool, BlockArena, Vec<BlockId>) {
        let mut arena = BlockArena::new();
        let mut pool = Pool::new(Stream::DEFAULT, PoolKind::Large, None);
        let mut ids = Vec::new();
        let mut addr = 1 << 30;
        for &size in sizes {
            let id = arena.insert(addr, size, super::super::ids::SegmentId::new(0), PoolId::new(0), PoolKind::Large);
            addr += size;
            pool.insert(&mut arena, id, size);
            ids.push(id);
        }
        (pool, arena, ids)
    }

    #[test]
    fn best_fit_takes_the_smallest_block_that_fits() {
        let kib = 1024;
        let (pool, arena, ids) = pool_with(&[64 * kib, 33 * kib, 40 * kib, 32 * kib + 512, 1 << 20]);
        let rules = SizeRules::default();
        // 33 KiB and 32.5 KiB share a bin: the walk inside the bin must find 33 KiB for a 33 KiB request.
        assert_eq!(pool.best_fit(&arena, 33 * kib, &rules), Some(ids[1]));
        assert_eq!(pool.best_fit(&arena, 32 * kib + 512, &rules), Some(ids[3]));
        assert_eq!(pool.best_fit(&arena, 34 * kib, &rules), Some(ids[2]));
        assert_eq!(pool.best_fit(&arena, 41 * kib, &rules), Some(ids[0]));
        assert_eq!(pool.best_fit(&arena, 65 * kib, &rules), Some(ids[4]));
        assert_eq!(pool.best_fit(&arena, (1 << 20) + 512, &rules), None);
        assert_eq!(pool.largest(&arena), 1 << 20);
    }

    #[test]
    fn removing_the_last_block_of_a_bin_clears_its_bits() {
        let (mut pool, mut arena, ids) = pool_with(&[4096, 4096, 1 << 21]);
        for id in ids {
            let size = arena[id].size;
            pool.remove(&mut arena, id, size);
        }
        assert_eq!(pool.rows_nonempty, 0);
        assert!(pool.bins_nonempty.iter().all(|&b| b == 0));
        assert_eq!((pool.free_bytes, pool.free_blocks), (0, 0));
        assert_eq!(pool.first_nonempty_from(0), None);
    }

    #[test]
    fn oversize_blocks_do_not_serve_small_requests() {
        let mib = 1u64 << 20;
        let (pool, arena, ids) = pool_with(&[64 * mib]);
        let rules = SizeRules { max_split_size: 32 * mib, ..SizeRules::default() };
        assert_eq!(pool.best_fit(&arena, 4 * mib, &rules), None);
        assert_eq!(pool.best_fit(&arena, 50 * mib, &rules), Some(ids[0]));
        assert_eq!(pool.best_fit(&arena, 40 * mib, &rules), None, "would waste more than 20 MiB");
    }
}
