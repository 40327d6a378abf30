//! Giving memory back, for one device heap: the reserve cap (budget and
//! memory fraction), the reclaimer's pass (the release policy applied to
//! idle segments), the release of whole free segments, and what an
//! out-of-memory needs from the other processes on the device (the device
//! layer asks them: `crate::device`). Owns `Limits`: the reserved count
//! and cap shared with the device's other heaps, the policy, its clock.
#![forbid(unsafe_code)]

use std::sync::Arc;

use super::block::BlockId;
use super::history::HistoryAction;
use super::ids::{PoolId, SegmentId};
use super::reserve::Reserve;
use super::{DeviceHeap, Released, Segment};
use crate::backend::BackendError;
use crate::reclaim::policy::{decide, IdleSegment, Policy, Pressure, Reason};
use crate::reclaim::Clock;
use crate::types::Stream;

/// What bounds a heap's memory, and when it gives memory back.
pub(super) struct Limits {
    /// The device's reserved count and memory-fraction cap, shared with
    /// the other heaps of the device (one per stream shard).
    pub reserve: Arc<Reserve>,
    /// When to give memory back; the budget also caps growth.
    pub policy: Policy,
    /// The reclaimer's clock, for idle stamps.
    pub clock: Arc<Clock>,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits { reserve: Arc::default(), policy: Policy::RELEASE_NOTHING, clock: Clock::new() }
    }
}

impl DeviceHeap {
    /// The memory the other processes would have to give back for a
    /// request of `rounded` bytes in `pool` that found no room: 0 when
    /// they cannot help (past the reserve cap).
    #[cold]
    pub(super) fn need_from_others(&self, pool: PoolId, rounded: u64) -> u64 {
        self.need_within_cap(self.growth_need(pool, rounded).unwrap_or(u64::MAX))
    }

    /// `need` bytes more from the device, or 0 when the heap's reserve cap
    /// (budget or memory fraction) would refuse them anyway: what other
    /// processes giving memory back could do for this heap.
    #[cold]
    pub(super) fn need_within_cap(&self, need: u64) -> u64 {
        let limit = self.limits.reserve.limit().min(self.limits.policy.max_reserved);
        if self.limits.reserve.bytes().saturating_add(need) > limit {
            return 0;
        }
        need
    }

    /// A segment from the backend, unless it would take the heap past its
    /// reserve limit (which then counts as out of memory).
    pub(super) fn new_segment(&mut self, size: u64, stream: Stream) -> Result<u64, BackendError> {
        self.claim_reserved(size)?;
        let result = self.backend.allocate(self.device, size, stream);
        if result.is_err() {
            self.limits.reserve.give_back(size);
        }
        result
    }

    /// Counts `size` more bytes reserved on the device, unless that would
    /// pass the reserve limit (which counts as out of memory). Claimed on
    /// the device's count (shared with the other stream shards of the
    /// device) before the backend is asked, so two shards cannot both pass
    /// the cap.
    pub(super) fn claim_reserved(&mut self, size: u64) -> Result<(), BackendError> {
        if !self.limits.reserve.claim(size, self.limits.policy.max_reserved) {
            return Err(BackendError::OutOfMemory);
        }
        Ok(())
    }

    /// The cap on reserved bytes: the memory fraction's or the budget's, the lower.
    pub fn reserved_limit(&self) -> Option<u64> {
        let limit = self.limits.reserve.limit().min(self.limits.policy.max_reserved);
        (limit != u64::MAX).then_some(limit)
    }

    /// Sets the release policy and the clock its idle stamps use.
    pub fn set_policy(&mut self, policy: Policy, clock: Arc<Clock>) {
        self.limits.policy = policy;
        self.limits.clock = clock;
        self.release_over_budget();
    }

    /// Releases cached segments, longest idle first, while the device's
    /// reserved count is over the cap (after the cap changed).
    pub fn release_over_budget(&mut self) {
        let Some(limit) = self.reserved_limit() else {
            return;
        };
        if self.limits.reserve.bytes() > limit {
            let policy = Policy { max_reserved: limit, ..Policy::RELEASE_NOTHING };
            self.apply(&policy);
        }
    }

    /// One pass of the reclaimer: releases what the policy picks.
    pub fn reclaim(&mut self) -> Released {
        self.stats.events.num_reclaims += 1;
        self.recall_idle();
        self.process_pending(false);
        let policy = Policy { max_reserved: self.reserved_limit().unwrap_or(u64::MAX), ..self.limits.policy };
        self.apply(&policy)
    }

    /// Releases what `policy` picks among the whole free segments and, in
    /// expandable segments, the free pages inside holes between live blocks
    /// (each hole a candidate, idle since it was last freed).
    pub(super) fn apply(&mut self, policy: &Policy) -> Released {
        if !self.may_release() {
            return Released::default();
        }
        self.flush_stashes();
        let device_free = if policy.headroom > 0 { self.backend.mem_info(self.device).map_or(u64::MAX, |i| i.free) } else { u64::MAX };
        let pressure = Pressure { device_free, reserved: self.limits.reserve.bytes() };
        let (idle, holes) = self.release_candidates(policy, pressure);
        if idle.is_empty() {
            return Released::default();
        }
        let chosen = decide(policy, self.limits.clock.now_ms(), &idle, pressure);
        let mut total = Released::default();
        for reason in Reason::ALL {
            let ids: Vec<u32> = chosen.iter().filter(|c| c.1 == reason).map(|c| c.0).collect();
            if !ids.is_empty() {
                let released = self.release_chosen(&ids, &holes);
                self.stats.events.released[reason as usize] += released;
                total += released;
            }
        }
        total
    }

    /// What the policy chooses among: the whole free segments (by id), then
    /// the holes (ids past the segments' slots, each indexing the holes
    /// returned, with the bytes it would give back). Without pressure only
    /// holes past the idle deadline can go, so the walk (under the heap's
    /// lock) looks at no others.
    fn release_candidates(&self, policy: &Policy, pressure: Pressure) -> (Vec<IdleSegment>, Vec<(BlockId, u64)>) {
        let mut idle: Vec<IdleSegment> = self
            .segments
            .iter()
            .filter_map(|(id, s)| {
                let b = &self.blocks[s.first_block];
                let size = s.pages.as_ref().map_or(s.size, |p| p.mapped_bytes());
                let whole_free = !b.is_active() && b.is_last() && !self.keeps_memory(s.pool);
                whole_free.then_some(IdleSegment { id: id.raw(), size, idle_since_ms: s.idle_since_ms })
            })
            .collect();
        let under_pressure = pressure.reserved > policy.max_reserved || pressure.device_free < policy.headroom;
        let idle_before = if under_pressure { u64::MAX } else { self.limits.clock.now_ms().saturating_sub(policy.release_after_ms) };
        // Holes hold pages in any pool that grows by pages: expandable
        // segments', and tags' (paged whatever `expandable` says).
        let paged = self.pools.iter().any(|(_, p)| p.vm.is_some());
        let holes = if paged && (under_pressure || policy.release_after_ms != u64::MAX) {
            self.holes_with_free_pages(idle_before)
        } else {
            Vec::new()
        };
        for (index, &(block, bytes)) in holes.iter().enumerate() {
            let id = u32::try_from(self.segments.slot_count() + index).expect("fewer than 4 billion candidates");
            idle.push(IdleSegment { id, size: bytes, idle_since_ms: self.blocks[block].idle_since_ms });
        }
        (idle, holes)
    }

    /// Releases the candidates `ids` (as `release_candidates` numbers them).
    fn release_chosen(&mut self, ids: &[u32], holes: &[(BlockId, u64)]) -> Released {
        let segment_count = self.segments.slot_count() as u32;
        let mut released = Released::default();
        let whole: Vec<SegmentId> = ids.iter().filter(|&&id| id < segment_count).map(|&id| SegmentId::from_raw(id)).collect();
        if !whole.is_empty() {
            // Chosen as whole free segments: no pending free is in them,
            // so none is waited for (the heap stays locked meanwhile).
            released += self.release_segments_where(false, |id, _| whole.contains(&id));
        }
        for &id in ids.iter().filter(|&&id| id >= segment_count) {
            released.bytes += self.release_hole(holes[(id - segment_count) as usize].0);
        }
        released
    }

    /// Releases every segment that is one whole free block and that `keep`
    /// selects (by segment), and in the selected expandable segments every
    /// page lying entirely inside free blocks. A segment the backend fails
    /// to release stays cached, whole and consistent.
    pub fn release_free_segments(&mut self, reason: Reason, select: impl FnMut(SegmentId, &Segment) -> bool) -> Released {
        let released = self.release_segments_where(true, select);
        self.stats.events.released[reason as usize] += released;
        released
    }

    /// `release_free_segments` without counting the release under a reason.
    /// Frees waiting on other streams' events complete first: waited for
    /// (`wait`, so that their blocks can go back too), or only those done.
    /// Nothing while a private pool is open; nothing of private pools while
    /// they keep their memory (`private.rs`).
    fn release_segments_where(&mut self, wait: bool, mut select: impl FnMut(SegmentId, &Segment) -> bool) -> Released {
        if !self.may_release() {
            return Released::default();
        }
        self.recall_all();
        self.process_pending(wait);
        self.flush_stashes();
        let mut released = Released::default();
        for segment_id in self.segments.ids() {
            let Some(segment) = self.segments.get(segment_id) else {
                continue;
            };
            if self.keeps_memory(segment.pool) {
                continue;
            }
            if segment.pages.is_some() {
                if select(segment_id, segment) {
                    released += self.release_free_pages(segment_id);
                }
                continue;
            }
            let block = &self.blocks[segment.first_block];
            if block.is_active() || !block.is_last() || !select(segment_id, segment) {
                continue;
            }
            released += self.release_whole_segment(segment_id);
        }
        released
    }

    /// Gives the segment `segment_id` (not expandable, one whole free
    /// block) back to the backend. Nothing when the backend refuses: the
    /// segment stays cached, whole and consistent.
    pub(super) fn release_whole_segment(&mut self, segment_id: SegmentId) -> Released {
        let Some(segment) = self.segments.get(segment_id) else {
            return Released::default();
        };
        let (base, size, pool) = (segment.base, segment.size, segment.pool);
        if self.backend.release(self.device, base, size, self.pools[pool].stream).is_err() {
            return Released::default();
        }
        let kind = self.pools[pool].kind;
        self.forget_segment(segment_id);
        self.note(HistoryAction::SegmentFree, base, size, self.pools[pool].stream);
        self.stats.reserved_bytes.decrease(kind, size);
        self.limits.reserve.give_back(size);
        self.stats.events.num_device_free += 1;
        Released { segments: 1, bytes: size }
    }

    /// Drops the records of the segment `segment_id`, one whole free block
    /// the backend has just taken back.
    pub(super) fn forget_segment(&mut self, segment_id: SegmentId) {
        let Some(segment) = self.segments.remove(segment_id) else { return };
        let kind = self.pools[segment.pool].kind;
        self.remove_free(segment.first_block);
        self.blocks.remove(segment.first_block);
        self.stats.segment.decrease(kind, 1);
    }
}
