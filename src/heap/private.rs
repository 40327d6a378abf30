//! Private pools, for one device heap: PyTorch's CUDA graph pools and
//! `torch.cuda.MemPool`s, driven by its `beginAllocateToPool`,
//! `endAllocateToPool` and `releasePool` hooks.
//!
//! A CUDA graph replays the addresses it was captured with: every block it
//! allocated while being captured, even one it freed before the capture
//! ended, is written again at each replay. So those blocks must serve no one
//! else, and their memory must stay, for as long as the graph lives. Between
//! `begin_private(id)` and `end_private(id)` every allocation of the heap
//! (whatever its stream: the hook's stream filter is C++ and out of reach,
//! and routing more than the capture's own requests is safe) comes from the
//! pools of `id`, one pair per stream as for ordinary pools. Blocks go back to
//! the pool they came from, as always.
//!
//! Rules, all conservative:
//! - while any private pool is open (a capture may be underway), the heap
//!   calls nothing a capture forbids: no event query or wait (pending frees
//!   keep their blocks, frees needing events wait until the last pool
//!   closes), no release of memory, no unmapping of pages, no reuse of
//!   blocks across streams. Growth (`cuMemAlloc`, mapping pages) is allowed,
//!   as in PyTorch's allocator (the `cuda` backend relaxes the thread's
//!   capture mode around it);
//! - the free memory of private pools stays in them, never released nor borrowed
//!   nor recycled, while any private pool of the heap is held (begun more
//!   often than released). A pool used inside another's capture (a
//!   `MemPool` inside a graph capture) may be released before the graph
//!   that replays its addresses, so no private memory goes until every
//!   private pool is released;
//! - once the last is released, their free memory is the release policies'
//!   again, as any cached memory (`empty_cache` gives it back).
#![forbid(unsafe_code)]

use std::collections::HashMap;

use super::ids::PoolId;
use super::DeviceHeap;
use crate::error::{AllocError, InvalidArgument, PrivatePoolMisuse};

/// A private pool's identity: PyTorch's `MempoolId_t`, a pair of integers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PrivatePoolId(pub u64, pub u64);

/// The private pools of a heap: those open now, innermost last, and how
/// many times each pool was begun but not yet released.
#[derive(Default)]
pub(super) struct PrivatePools {
    open: Vec<PrivatePoolId>,
    uses: HashMap<PrivatePoolId, u64>,
}

impl PrivatePools {
    /// The pool allocations go to now, if any.
    pub fn routing(&self) -> Option<PrivatePoolId> {
        self.open.last().copied()
    }

    /// Whether some private pool is open: a capture may be underway.
    pub fn any_open(&self) -> bool {
        !self.open.is_empty()
    }

    /// Whether the memory of private pools must stay where it is.
    pub fn any_held(&self) -> bool {
        !self.uses.is_empty()
    }

    pub fn check(&self) -> Result<(), String> {
        for id in &self.open {
            if !self.uses.contains_key(id) {
                return Err(format!("private pool {id:?} is open but was released"));
            }
        }
        Ok(())
    }
}

impl DeviceHeap {
    /// Routes every allocation to the private pool `id` until
    /// `end_private(id)` (PyTorch's `beginAllocateToPool`).
    pub fn begin_private(&mut self, id: PrivatePoolId) {
        self.disarm_all(); // a capture's allocations come from its pool, not threads' caches
        self.private.open.push(id);
        *self.private.uses.entry(id).or_default() += 1;
        self.pools.forget_served();
    }

    /// Stops routing allocations to `id` (PyTorch's `endAllocateToPool`).
    /// Frees that waited for the last open pool to close record their events now.
    pub fn end_private(&mut self, id: PrivatePoolId) -> Result<(), AllocError> {
        let Some(at) = self.private.open.iter().rposition(|&open| open == id) else {
            return Err(misuse(id, PrivatePoolMisuse::NotOpen));
        };
        self.private.open.remove(at);
        self.pools.forget_served();
        if !self.private.any_open() {
            self.record_events_after_capture();
        }
        Ok(())
    }

    /// Drops one use of `id` (PyTorch's `releasePool`, when a graph or a
    /// `MemPool` goes); once no private pool is held, their free memory is
    /// the release policies' again (`empty_cache` gives it back).
    pub fn release_private(&mut self, id: PrivatePoolId) -> Result<(), AllocError> {
        match self.private.uses.get(&id).copied() {
            None => Err(misuse(id, PrivatePoolMisuse::NeverBegun)),
            Some(1) if self.private.open.contains(&id) => Err(misuse(id, PrivatePoolMisuse::ReleasedWhileOpen)),
            Some(1) => {
                self.private.uses.remove(&id);
                Ok(())
            }
            Some(n) => {
                self.private.uses.insert(id, n - 1);
                Ok(())
            }
        }
    }

    /// Whether the free memory of `pool` must stay in it (a private pool
    /// while private pools are held; a paused tag's, whose ranges stay
    /// reserved: `tags.rs`).
    pub(super) fn keeps_memory(&self, pool: PoolId) -> bool {
        (self.pools[pool].private.is_some() && self.private.any_held()) || self.pool_paused(pool)
    }

    /// Whether memory may leave the heap's caches now, and events be queried.
    pub(super) fn may_release(&self) -> bool {
        !self.private.any_open()
    }
}

/// The error of a private pool named out of order.
fn misuse(id: PrivatePoolId, misuse: PrivatePoolMisuse) -> AllocError {
    AllocError::InvalidArgument(InvalidArgument::PrivatePool { id: (id.0, id.1), misuse })
}
