//! Routing: which pools serve a request, and how each pool grows.
//!
//! An untagged request goes to the pools of its stream (those of the
//! private pool open, while one is: `private.rs`), a tagged one to the
//! pools of (stream, tag); each key has a small and a large pool, made on
//! first use (`Pools`). A pool grows by whole segments, or by pages of
//! reserved ranges (`Pool::vm`): the large untagged pools as expandable
//! segments say, every tagged pool always (only a reserved range keeps
//! its addresses while a paused tag's memory is gone: `tags.rs`), its
//! small pools in smaller ranges (`SMALL_RANGE`).
//!
//! Invariant (checked by `validate()`): each pool grows as its tag and
//! kind say (`vm_for`).
#![forbid(unsafe_code)]

use super::expandable::Vm;
use super::ids::PoolId;
use super::pool::{Pool, PoolKey};
use super::tags::tag_error;
use super::DeviceHeap;
use crate::error::{AllocError, InvalidArgument, TagState};
use crate::size_class::PoolKind;
use crate::tag::TagId;
use crate::types::Stream;

/// The address space a tag's small pool reserves at a time (its large
/// pool reserves as much as the device holds, as expandable segments do).
const SMALL_RANGE: u64 = 1 << 30;

impl DeviceHeap {
    /// The pool of (stream, kind) that serves now (a private pool's while
    /// one is open), created on first use.
    #[inline]
    pub(super) fn pool_id(&mut self, stream: Stream, kind: PoolKind) -> PoolId {
        if let Some(id) = self.pools.last_served(stream, kind) {
            return id;
        }
        let ids = self.pools_of(PoolKey { stream, private: self.private.routing(), tag: TagId::DEFAULT });
        self.pools.note_served(stream, ids);
        ids[kind as usize]
    }

    /// The (small, large) pools of `key`, created on first use: growing
    /// as expandable segments say for the "default" tag, in ranges of
    /// their own for any other.
    fn pools_of(&mut self, key: PoolKey) -> [PoolId; 2] {
        let vms = [PoolKind::Small, PoolKind::Large].map(|kind| self.vm_for(key.tag, kind));
        self.pools.of_key(key, |kind| {
            let mut pool = Pool::new(key.stream, kind, key.private);
            pool.tag = key.tag;
            pool.vm = vms[kind as usize];
            pool
        })
    }

    /// The expandable-segment parameters for pools of `kind`, or None when
    /// that kind grows by whole segments.
    #[inline]
    pub(super) fn expandable_vm(&self, kind: PoolKind) -> Option<Vm> {
        self.paging.vm.filter(|_| kind == PoolKind::Large)
    }

    /// Tells the default pools made so far how they grow now.
    pub(super) fn refresh_pool_vms(&mut self) {
        let vm = self.paging.vm;
        for pool in self.pools.iter_mut().filter(|p| p.tag == TagId::DEFAULT) {
            pool.vm = vm.filter(|_| pool.kind == PoolKind::Large);
        }
    }

    /// The page and range size pools of `pool` grow by, or None when it
    /// grows by whole segments: expandable segments' for untagged large
    /// pools, the tags' own for every tagged pool.
    #[inline]
    pub(super) fn pool_vm(&self, pool: PoolId) -> Option<Vm> {
        self.pools[pool].vm
    }

    /// The reserved ranges of a tag's pools of `kind`: the small ones
    /// smaller (`SMALL_RANGE`).
    fn tag_vm(&self, kind: PoolKind) -> Option<Vm> {
        let vm = self.tags.vm?;
        Some(match kind {
            PoolKind::Small => Vm { page: vm.page, range: SMALL_RANGE.max(vm.page).next_multiple_of(vm.page) },
            PoolKind::Large => vm,
        })
    }

    /// How pools of `tag` and `kind` grow: as expandable segments say for
    /// the "default" tag, in the tags' own ranges for any other.
    pub(super) fn vm_for(&self, tag: TagId, kind: PoolKind) -> Option<Vm> {
        if tag == TagId::DEFAULT {
            self.expandable_vm(kind)
        } else {
            self.tag_vm(kind)
        }
    }

    /// The pool of (stream, tag, kind), created on first use.
    fn tag_pool_id(&mut self, stream: Stream, tag: TagId, kind: PoolKind) -> Result<PoolId, AllocError> {
        if self.tags.vm.is_none() {
            let page = self
                .mappable_page()
                .ok_or_else(|| AllocError::InvalidArgument(InvalidArgument::TagsNeedVirtualMemory { backend: self.backend.name() }))?;
            self.tags.vm = Some(self.ranges_of(page));
        }
        Ok(self.pools_of(PoolKey { stream, private: None, tag })[kind as usize])
    }

    /// Serves a request of `size` bytes on `stream` tagged `tag` (non-zero),
    /// remembering `context` (0: none) as `allocate_with_context` does.
    /// While a private pool is open the private pool serves it, tag or not
    /// (a graph's memory stays with the graph).
    pub fn allocate_tagged(&mut self, size: u64, stream: Stream, tag: TagId, context: u64) -> Result<u64, AllocError> {
        if self.private.any_open() || tag == TagId::DEFAULT {
            return self.allocate_with_context(size, stream, context);
        }
        if size == 0 {
            return Ok(0);
        }
        if self.tags.is_paused(tag) {
            return Err(tag_error(tag, TagState::Paused));
        }
        let rounded = self.rules.round(size).ok_or(AllocError::TooLarge { size })?;
        let pool = self.tag_pool_id(stream, tag, self.rules.kind(rounded))?;
        self.with_context(context, |heap| heap.allocate_in(pool, rounded, size, stream))
    }
}
