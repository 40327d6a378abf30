//! Block records: where each block lies and how it links to its neighbours,
//! and the address map that finds a block by its address (`ByAddr`).
//!
//! Device memory holds no headers, so every block is described here, out of
//! band, in one arena addressed by `BlockId`. A block has two sets of links:
//! `prev`/`next` to its address neighbours in its segment, and
//! `link_prev`/`link_next` in a list: its bin while it is free, its thread
//! cache's while it is lent, the arena's list of unused records while it is
//! unused. Only the arena's methods change links (`split`, `absorb_next`;
//! `link_front`, `link_after`, `unlink`), and a segment's blocks are read in
//! address order through `walk_segment`, a list through `walk_list`.
//!
//! Invariants (checked by `DeviceHeap::validate`): following `next` from a
//! segment's first block tiles the segment, each block's `prev` the one
//! before; `len()` records are in use, each reached from a segment.
#![forbid(unsafe_code)]

pub use super::ids::BlockId;
use super::ids::{PoolId, SegmentId};
use crate::addr_map::AddrMap;
use crate::size_class::PoolKind;

/// The absent link.
pub const NIL: BlockId = BlockId::NIL;

/// Where a block stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockState {
    /// Free and in its pool's bin.
    Binned,
    /// Free, not yet merged: its pool's stash.
    Stashed,
    /// Free and in no list: being split or merged right now.
    Detached,
    /// Handed out to a caller.
    Allocated,
    /// Freed by its caller but still used by work queued on other streams
    /// (`record_stream`): waits for their events before it can be reused.
    /// Active, no longer allocated (as in PyTorch).
    Pending,
    /// Lent to a thread's cache (`lent.rs`): free while in one of the
    /// cache's entries, allocated once the thread hands it out again.
    Lent,
}

/// One block: a range of a segment, allocated or free.
#[derive(Clone, Debug)]
pub struct Block {
    pub addr: u64,
    pub size: u64,
    /// Bytes the caller asked for; 0 while free.
    pub requested: u64,
    /// The segment holding the block.
    pub segment: SegmentId,
    /// The pool the segment belongs to, and that pool's kind.
    pub pool: PoolId,
    pub kind: PoolKind,
    /// Address neighbours in the segment (`BlockArena::split`, `absorb_next`).
    prev: BlockId,
    next: BlockId,
    /// List neighbours: in the block's bin while binned, in its thread
    /// cache's list while lent, in the arena's unused list while unused
    /// (`BlockArena::link_front`, `link_after`, `unlink`).
    link_prev: BlockId,
    link_next: BlockId,
    pub state: BlockState,
    /// When the block last went into a bin (reclaimer clock; kept for
    /// blocks of expandable segments, whose free pages the policies release).
    pub idle_since_ms: u64,
    /// When the block was freed or made (a merged block: the free that
    /// merged it; a block split off a free one: that one's), in the heap's
    /// count of frees (kept in heaps with expandable segments; see
    /// `Recycling`).
    pub freed_at: u64,
    /// The thread cache's slot a lent block belongs to (`lent.rs`).
    pub lent_to: u32,
}

impl Block {
    /// Held by a caller, who may still free it or record streams on it.
    #[inline]
    pub fn is_allocated(&self) -> bool {
        self.state == BlockState::Allocated
    }

    /// Allocated, pending or lent to a thread's cache: the heap cannot
    /// reuse the block's memory (nor merge it, nor give it back).
    #[inline]
    pub fn is_active(&self) -> bool {
        matches!(self.state, BlockState::Allocated | BlockState::Pending | BlockState::Lent)
    }

    /// The block before it in its segment (NIL: it is the first).
    #[inline(always)]
    pub fn prev(&self) -> BlockId {
        self.prev
    }

    /// The block after it in its segment (NIL: it is the last).
    #[inline(always)]
    pub fn next(&self) -> BlockId {
        self.next
    }

    /// Whether it is the last block of its segment.
    #[inline(always)]
    pub fn is_last(&self) -> bool {
        self.next == NIL
    }

    /// The block before it in its list (NIL: it is the head).
    #[inline(always)]
    pub fn link_prev(&self) -> BlockId {
        self.link_prev
    }

    /// The block after it in its list (NIL: it is the tail).
    #[inline(always)]
    pub fn link_next(&self) -> BlockId {
        self.link_next
    }

    /// True when the block does not cover its whole segment.
    #[inline]
    pub fn is_split(&self) -> bool {
        self.prev != NIL || self.next != NIL
    }
}

/// Blocks by address (`crate::addr_map`, which holds plain numbers): the
/// pointer lookup of `free`.
#[derive(Default)]
pub struct ByAddr(AddrMap);

impl ByAddr {
    #[inline(always)]
    pub fn get(&self, addr: u64) -> Option<BlockId> {
        self.0.get(addr).map(BlockId::from_raw)
    }

    #[inline(always)]
    pub fn insert(&mut self, addr: u64, id: BlockId) {
        self.0.insert(addr, id.raw());
    }

    #[inline(always)]
    pub fn remove(&mut self, addr: u64) -> Option<BlockId> {
        self.0.remove(addr).map(BlockId::from_raw)
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }
}

/// All block records of one heap, with unused records chained for reuse so
/// that the steady state allocates no memory.
pub struct BlockArena {
    blocks: Vec<Block>,
    unused: BlockId,
    in_use: usize,
}

impl BlockArena {
    pub fn new() -> Self {
        BlockArena { blocks: Vec::new(), unused: NIL, in_use: 0 }
    }

    /// A fresh record for a free, unlinked block.
    pub fn insert(&mut self, addr: u64, size: u64, segment: SegmentId, pool: PoolId, kind: PoolKind) -> BlockId {
        let block = Block {
            addr,
            size,
            requested: 0,
            segment,
            pool,
            kind,
            prev: NIL,
            next: NIL,
            link_prev: NIL,
            link_next: NIL,
            state: BlockState::Detached,
            idle_since_ms: 0,
            freed_at: 0,
            lent_to: 0,
        };
        self.in_use += 1;
        if self.unused != NIL {
            let id = self.unused;
            self.unused = self.blocks[id.index()].link_next;
            self.blocks[id.index()] = block;
            id
        } else {
            let id = BlockId::new(self.blocks.len());
            self.blocks.push(block);
            id
        }
    }

    /// Returns a record to the unused list.
    pub fn remove(&mut self, id: BlockId) {
        let block = &mut self.blocks[id.index()];
        block.size = 0;
        block.state = BlockState::Detached;
        block.link_next = self.unused;
        self.unused = id;
        self.in_use -= 1;
    }

    /// Cuts the block `id` at `size` bytes: the rest becomes a new record
    /// after it in its segment (same segment, pool and age), detached, and
    /// is returned.
    #[inline]
    pub fn split(&mut self, id: BlockId, size: u64) -> BlockId {
        let b = &self[id];
        let (addr, rest_size, segment, pool, kind, freed_at, next) = (b.addr, b.size - size, b.segment, b.pool, b.kind, b.freed_at, b.next);
        let rest = self.insert(addr + size, rest_size, segment, pool, kind);
        self[rest].prev = id;
        self[rest].next = next;
        self[rest].freed_at = freed_at;
        if next != NIL {
            self[next].prev = rest;
        }
        self[id].next = rest;
        self[id].size = size;
        rest
    }

    /// Merges the block after `id` into `id` and drops its record.
    #[inline]
    pub fn absorb_next(&mut self, id: BlockId) {
        let next = self[id].next;
        let (next_size, after) = (self[next].size, self[next].next);
        self[id].size += next_size;
        self[id].next = after;
        if after != NIL {
            self[after].prev = id;
        }
        self.remove(next);
    }

    /// Links `id` in front of `head` (NIL: an empty list); the caller
    /// makes `id` the list's head.
    #[inline(always)]
    pub fn link_front(&mut self, id: BlockId, head: BlockId) {
        self[id].link_prev = NIL;
        self[id].link_next = head;
        if head != NIL {
            self[head].link_prev = id;
        }
    }

    /// Links `id` after `prev` in `prev`'s list.
    #[inline(always)]
    pub fn link_after(&mut self, id: BlockId, prev: BlockId) {
        let next = self[prev].link_next;
        self[id].link_prev = prev;
        self[id].link_next = next;
        if next != NIL {
            self[next].link_prev = id;
        }
        self[prev].link_next = id;
    }

    /// Takes `id` out of its list; returns its neighbours there (a NIL
    /// `prev`: it was the head, and the caller makes `next` the head).
    #[inline(always)]
    pub fn unlink(&mut self, id: BlockId) -> (BlockId, BlockId) {
        let (prev, next) = (self[id].link_prev, self[id].link_next);
        if next != NIL {
            self[next].link_prev = prev;
        }
        if prev != NIL {
            self[prev].link_next = next;
        }
        self[id].link_prev = NIL;
        self[id].link_next = NIL;
        (prev, next)
    }

    /// The blocks from `first` on in address order, each with its id: all
    /// the blocks of a segment when `first` is its first block.
    #[inline]
    pub fn walk_segment(&self, first: BlockId) -> impl Iterator<Item = (BlockId, &Block)> + '_ {
        self.follow(first, |b| b.next)
    }

    /// The blocks of a list linked through `link_next` (a bin, a thread
    /// cache's lent blocks) from `head` on, each with its id.
    #[inline]
    pub fn walk_list(&self, head: BlockId) -> impl Iterator<Item = (BlockId, &Block)> + '_ {
        self.follow(head, |b| b.link_next)
    }

    #[inline(always)]
    fn follow(&self, first: BlockId, link: fn(&Block) -> BlockId) -> impl Iterator<Item = (BlockId, &Block)> + '_ {
        let mut cur = first;
        std::iter::from_fn(move || {
            if cur == NIL {
                return None;
            }
            let (id, b) = (cur, &self.blocks[cur.index()]);
            cur = link(b);
            Some((id, b))
        })
    }

    /// Number of records describing blocks.
    pub fn len(&self) -> usize {
        self.in_use
    }
}

impl std::ops::Index<BlockId> for BlockArena {
    type Output = Block;
    #[inline]
    fn index(&self, id: BlockId) -> &Block {
        &self.blocks[id.index()]
    }
}

impl std::ops::IndexMut<BlockId> for BlockArena {
    #[inline]
    fn index_mut(&mut self, id: BlockId) -> &mut Block {
        &mut self.blocks[id.index()]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn removed_records_are_reused_before_the_arena_grows() {
        let mut arena = BlockArena::new();
        let a = arena.insert(0, 512, SegmentId::new(0), PoolId::new(0), PoolKind::Small);
        let b = arena.insert(512, 512, SegmentId::new(0), PoolId::new(0), PoolKind::Small);
        arena.remove(a);
        assert_eq!(arena.len(), 1);
        let c = arena.insert(1024, 512, SegmentId::new(0), PoolId::new(0), PoolKind::Small);
        assert_eq!(c, a);
        assert_eq!(arena[c].addr, 1024);
        assert_eq!(arena[b].addr, 512);
        assert_eq!(arena.blocks.len(), 2);
    }
}
