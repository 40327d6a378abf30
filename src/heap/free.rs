//! The free path: a block freed by its caller (or pending on other
//! streams' work, `streams.rs`) goes to its pool's stash or is merged with
//! its free neighbours into the bins; the stash (see the top of mod.rs)
//! takes back the next request of its size without a split or a merge.

use super::block::{BlockId, BlockState, NIL};
use super::history::HistoryAction;
use super::ids::PoolId;
use super::DeviceHeap;
use crate::error::{AllocError, InvalidFree};
use crate::recording::rows::Action;
use crate::tag::TagId;

/// A freed block, as the caller needs to know it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Freed {
    pub size: u64,
    pub requested: u64,
}

impl DeviceHeap {
    /// Frees the live block at `ptr`, merging it with free neighbours.
    #[inline]
    pub fn free(&mut self, ptr: u64) -> Result<Freed, AllocError> {
        let mut found = self.by_addr.get(ptr);
        if let Some(id) = found.filter(|&id| !self.blocks[id].is_allocated()) {
            found = (self.blocks[id].state == BlockState::Lent && self.settle_lent(id)).then_some(id);
        }
        let Some(id) = found else {
            self.stats.events.num_invalid_frees += 1;
            return Err(AllocError::InvalidFree { ptr, reason: self.classify_invalid_free(ptr) });
        };
        if !self.streams.recorded.is_empty() {
            if let Some(streams) = self.streams.recorded.remove(&ptr) {
                if let Some(freed) = self.defer_free(id, ptr, streams) {
                    return Ok(freed);
                }
            }
        }
        let freed = self.count_free(id, ptr, true);
        self.deactivate(id);
        Ok(freed)
    }

    /// Counts the caller's free of the allocated block `id` at `ptr`: the
    /// statistics of allocated memory, the trace and the history (with
    /// `completed`, the block is reusable at once).
    #[inline(always)]
    pub(super) fn count_free(&mut self, id: BlockId, ptr: u64, completed: bool) -> Freed {
        let b = &self.blocks[id];
        let (size, requested, pool, kind) = (b.size, b.requested, b.pool, b.kind);
        if self.observers.observed {
            let stream = self.pools[pool].stream;
            self.record(Action::Free, ptr, requested, stream);
            if completed && self.observers.history.is_some() {
                self.note(HistoryAction::FreeCompleted, ptr, requested, stream);
            }
            if completed && !self.observers.contexts.is_empty() {
                self.forget_context(ptr);
            }
        }
        let stats = &mut self.stats;
        stats.allocation.decrease(kind, 1);
        stats.allocated_bytes.decrease(kind, size);
        stats.requested_bytes.decrease(kind, requested);
        Freed { size, requested }
    }

    /// Makes the freed block `id` reusable: into the stash or the bins.
    /// The common case, an untagged pool with nothing stashed, is
    /// `stash_or_bin` written out inline (the cached pair's free path:
    /// calling it costs 27 more instructions a pair, by callgrind).
    #[inline(always)]
    pub(super) fn deactivate(&mut self, id: BlockId) {
        let b = &mut self.blocks[id];
        b.state = BlockState::Stashed;
        b.requested = 0;
        let pool = b.pool;
        let p = &self.pools[pool];
        if p.tag == TagId::DEFAULT && p.stash == NIL {
            let next_free = self.free_after(id);
            if self.stash_enabled && self.stash_fits(id, next_free, p.free_blocks) {
                self.stash(pool, id, next_free);
            } else {
                self.bin_freed(id);
            }
            return;
        }
        if p.tag != TagId::DEFAULT {
            return self.deactivate_tagged(id);
        }
        self.stash_or_bin(id);
    }

    /// Puts the freed block `id` (marked stashed by `deactivate`) into its
    /// pool's stash (the one before it goes to the bins) after the block
    /// stashed before goes to the bins; or, where stashing could move where
    /// blocks land, straight into the bins.
    #[inline]
    pub(super) fn stash_or_bin(&mut self, id: BlockId) {
        let pool = self.blocks[id].pool;
        self.flush_stash(pool);
        let next_free = self.free_after(id);
        if self.stash_enabled && self.stash_fits(id, next_free, self.pools[pool].free_blocks) {
            self.stash(pool, id, next_free);
        } else {
            self.bin_freed(id);
        }
    }

    /// The block after `id` if it is in the bins, else NIL.
    #[inline(always)]
    pub(super) fn free_after(&self, id: BlockId) -> BlockId {
        let next = self.blocks[id].next();
        if next != NIL && self.blocks[next].state == BlockState::Binned {
            next
        } else {
            NIL
        }
    }

    /// `stash_is_best_fit`, answered at once in the cached pair's case:
    /// `next_free`, the free block after `id` (NIL: none), is all its pool
    /// has free (or nothing is) and `max_split_size` is unlimited, so that
    /// a merged block always serves a request of `id`'s size and is split
    /// to it (small blocks are at least `min_block`, large ones larger than
    /// `small_size`).
    #[inline(always)]
    pub(super) fn stash_fits(&self, id: BlockId, next_free: BlockId, free_blocks: usize) -> bool {
        (free_blocks == (next_free != NIL) as usize && self.rules.max_split_size == u64::MAX) || self.stash_is_best_fit(id, next_free)
    }

    /// Whether the freed block `id` (`next_free`: the free block after it,
    /// NIL: none), taken back by a request of its size, is what best fit
    /// over the merged bins would hand that request:
    /// merged with its free neighbours it would start at `id` (the block
    /// before it is not free), the rules would let it serve the request and
    /// split it to exactly `id`, and no other free block of the pool would
    /// come first (none of a size from `id`'s up to the merged size; of
    /// the merged size itself, the merged block, freed last, comes first).
    /// Then the stash only saves work; otherwise it would change where
    /// blocks land (a block misplaced can keep a whole segment from going
    /// back), and the block merges at once. So the stash never makes
    /// tidepool hold more than PyTorch would.
    #[inline(never)]
    pub(super) fn stash_is_best_fit(&self, id: BlockId, next_free: BlockId) -> bool {
        let b = &self.blocks[id];
        if b.prev() != NIL && self.blocks[b.prev()].state == BlockState::Binned {
            return false;
        }
        let merged = if next_free != NIL { b.size + self.blocks[next_free].size } else { b.size };
        let pool = &self.pools[b.pool];
        if next_free != NIL {
            // Split off again, the rest would go back first of the free
            // blocks of its size: where the neighbour must be now.
            let n = &self.blocks[next_free];
            let first_of_its_size = n.link_prev() == NIL || self.blocks[n.link_prev()].size < n.size;
            let split_to_id = (pool.vm.is_some() || self.rules.may_serve(merged, b.size)) && self.should_split(b.pool, merged, b.size);
            if !(first_of_its_size && split_to_id) {
                return false;
            }
        }
        pool.first_fit_size_without(&self.blocks, b.size, next_free).is_none_or(|fit| fit >= merged)
    }

    /// Stamps the block `id`, freed or new, with the next tick of the
    /// heap's count of frees, the age `Recycling` orders holes by (heaps
    /// with expandable segments). A free ticks when it happens, stashed or
    /// not; a block merged from it takes its tick, and a block split off a
    /// free one keeps the tick of the block it was split from.
    #[inline(always)]
    pub(super) fn stamp_freed(&mut self, id: BlockId) {
        if self.paging.vm.is_some() {
            self.paging.recycling.frees += 1;
            self.blocks[id].freed_at = self.paging.recycling.frees;
        }
    }

    /// Stamps the freed block `id` and merges it into the bins.
    pub(super) fn bin_freed(&mut self, id: BlockId) {
        self.stamp_freed(id);
        self.merge_and_bin(id);
    }

    /// Stashes the freed block `id` of `pool` and stamps it. `next_free`,
    /// the free block after it (NIL: none), takes the same tick, and is idle
    /// from now: what it would have as the rest split off the two merged if
    /// the stashed block is taken back (merged, they take the tick anyway),
    /// so the stash changes no block's age (its idle time, by no more than
    /// the time until the take-back).
    #[inline(always)]
    pub(super) fn stash(&mut self, pool: PoolId, id: BlockId, next_free: BlockId) {
        self.pools[pool].stash = id;
        self.stamp_freed(id);
        if next_free != NIL && self.paging.vm.is_some() {
            let (tick, now) = (self.blocks[id].freed_at, self.limits.clock.now_ms());
            let next = &mut self.blocks[next_free];
            next.freed_at = tick;
            next.idle_since_ms = now;
        }
    }

    /// Merges the stashed block of `pool`, if any, into the bins.
    #[inline]
    pub(super) fn flush_stash(&mut self, pool: PoolId) {
        let id = std::mem::replace(&mut self.pools[pool].stash, NIL);
        if id != NIL {
            self.merge_and_bin(id);
        }
    }

    /// Merges every pool's stashed block.
    pub(super) fn flush_stashes(&mut self) {
        for pool in self.pools.ids() {
            self.flush_stash(pool);
        }
    }

    /// Merges the free, unbinned block `id` with its free neighbours and
    /// puts the result in its bin.
    #[inline(never)]
    pub(super) fn merge_and_bin(&mut self, id: BlockId) {
        self.blocks[id].state = BlockState::Detached;
        self.by_addr.remove(self.blocks[id].addr);
        let freed_at = self.blocks[id].freed_at;
        let mut merged = id;
        let prev = self.blocks[id].prev();
        if prev != NIL && self.blocks[prev].state == BlockState::Binned {
            self.remove_free(prev);
            self.blocks.absorb_next(prev);
            merged = prev;
        }
        let next = self.blocks[merged].next();
        if next != NIL && self.blocks[next].state == BlockState::Binned {
            self.remove_free(next);
            self.blocks.absorb_next(merged);
        }
        self.blocks[merged].freed_at = freed_at;
        self.insert_free(merged);
    }

    /// Puts a free block into its pool's bin and counts it.
    #[inline]
    pub(super) fn insert_free(&mut self, id: BlockId) {
        let b = &self.blocks[id];
        let (pool, size, whole, segment) = (b.pool, b.size, !b.is_split(), b.segment);
        let (split, counted) = self.inactive_split_bytes_of(id);
        let pool = &mut self.pools[pool];
        if pool.vm.is_some() {
            self.blocks[id].idle_since_ms = self.limits.clock.now_ms();
        }
        pool.insert(&mut self.blocks, id, size);
        if split {
            self.stats.inactive_split.increase(pool.kind, 1);
            self.stats.inactive_split_bytes.increase(pool.kind, counted);
        }
        if whole {
            let Some(segment) = self.segments.get_mut(segment) else {
                return;
            };
            segment.idle_since_ms = self.limits.clock.now_ms();
        }
    }

    /// Takes a free block out of its pool's bin and uncounts it.
    #[inline]
    pub(super) fn remove_free(&mut self, id: BlockId) {
        let b = &self.blocks[id];
        let (pool, size) = (b.pool, b.size);
        let (split, counted) = self.inactive_split_bytes_of(id);
        let pool = &mut self.pools[pool];
        pool.remove(&mut self.blocks, id, size);
        if split {
            self.stats.inactive_split.decrease(pool.kind, 1);
            self.stats.inactive_split_bytes.decrease(pool.kind, counted);
        }
    }

    /// Whether the free block `id` counts as inactive split (free memory
    /// that only a request fitting the block can use and that cannot go
    /// back to the driver while the block's neighbours are in use), and
    /// its bytes that do. A block that is not its whole segment counts with
    /// all its bytes. In an expandable segment only the bytes held by
    /// allocations that reach outside it count (those inside it can be
    /// unmapped), and the range's last block not at all (it grows to fit
    /// any request).
    #[inline(always)]
    pub(super) fn inactive_split_bytes_of(&self, id: BlockId) -> (bool, u64) {
        let b = &self.blocks[id];
        if !b.is_split() {
            return (false, 0);
        }
        if self.pool_vm(b.pool).is_none() {
            return (true, b.size);
        }
        match self.segments.range(b.segment) {
            Some(_) if b.is_last() => (false, 0),
            Some((base, pages)) => (true, pages.pinned_bytes(b.addr - base, b.addr - base + b.size)),
            None => (true, b.size),
        }
    }

    /// Why `ptr` is not a live block (slow path: errors only).
    pub(super) fn classify_invalid_free(&self, ptr: u64) -> InvalidFree {
        let Some((_, segment)) = self.segments.containing(ptr) else {
            return InvalidFree::Foreign;
        };
        match self.blocks.walk_segment(segment.first_block).find(|(_, b)| ptr < b.addr + b.size) {
            Some((_, b)) if b.is_allocated() => InvalidFree::Interior { block: b.addr },
            _ => InvalidFree::NotLive,
        }
    }

    /// Counts a free whose stated size differed from the block's.
    pub fn count_size_mismatch(&mut self) {
        self.stats.events.num_size_mismatches += 1;
    }
}
