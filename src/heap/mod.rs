//! The device heap: segments of one device split into blocks, the pools of
//! free blocks, and the statistics, kept consistent under one lock.
//!
//! A request is rounded (`SizeRules::round`), looked up in the pool of its
//! (stream, kind) by best fit, and served from the block found, split when
//! the rest is worth keeping. With no fitting block the heap grows by one
//! segment from the backend; when the backend refuses, every whole free
//! segment of the device is released and growth is tried once more. A free
//! merges the block with its free neighbours and returns it to the pool of
//! the stream it was allocated on.
//!
//! The stash (the cached pair's fast path): each pool holds back its most
//! recently freed block, unmerged, until the next operation on the pool. A
//! request of exactly that block's size takes it back with no split and no
//! merge; anything else merges it first (`flush_stash`), and so does every
//! operation that looks at the whole heap (release, statistics). Allocation
//! loops that free and reallocate the same sizes thus cost two map updates.
//!
//! Invariants, checked by `validate()`:
//! - the blocks of a segment tile it exactly, in address order, linked both ways;
//! - no two free blocks are neighbours, unless one of them is a stashed block;
//! - each free block is either in exactly one bin (the bin of its size, in
//!   its segment's pool) or the stash of its pool;
//! - each allocated or stashed block is in `by_addr` under its address, and
//!   nothing else is;
//! - every gauge equals the sum recomputed from the blocks (stashed blocks
//!   count as free, but as inactive-split only once merged).
#![forbid(unsafe_code)]

pub mod addr_map;
pub mod block;
pub mod pool;
mod validate;

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::backend::{Backend, BackendError};
use crate::error::{AllocError, InvalidFree, OomReport};
use crate::size_class::{PoolKind, SizeRules};
use crate::stats::{Counters, Stats};
use crate::reclaim::policy::{decide, IdleSegment, Policy, Pressure, Reason};
use crate::reclaim::registry::{Entry, Registry};
use crate::reclaim::Clock;
use crate::trace::record::{Recorder, TraceBuffer};
use crate::trace::rmm_csv::Action;
use crate::Stream;
use addr_map::AddrMap;
use block::{BlockArena, BlockId, BlockState, NIL};
use pool::Pool;

/// One allocation from the backend.
#[derive(Clone, Debug)]
pub struct Segment {
    pub base: u64,
    pub size: u64,
    pub pool: u32,
    /// The block at `base`.
    pub first_block: BlockId,
    /// When the segment last became one whole free block (reclaimer clock).
    pub idle_since_ms: u64,
}

/// What releasing cached segments gave back.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Released {
    pub segments: u64,
    pub bytes: u64,
}

/// The three byte counts a replay follows.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Totals {
    pub requested: u64,
    pub allocated: u64,
    pub reserved: u64,
}

/// One segment as a snapshot shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SegmentSnapshot {
    pub address: u64,
    pub size: u64,
    pub stream: Stream,
    pub kind: PoolKind,
    pub blocks: Vec<BlockSnapshot>,
}

/// One block of a segment snapshot.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockSnapshot {
    pub address: u64,
    pub size: u64,
    /// Bytes asked for; 0 for a free block.
    pub requested: u64,
    pub allocated: bool,
}

/// A freed block, as the caller needs to know it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Freed {
    pub size: u64,
    pub requested: u64,
}

/// The heap of one device.
pub struct DeviceHeap {
    device: usize,
    rules: SizeRules,
    backend: Arc<dyn Backend>,
    blocks: BlockArena,
    segments: Vec<Option<Segment>>,
    unused_segments: Vec<u32>,
    segment_by_base: BTreeMap<u64, u32>,
    pools: Vec<Pool>,
    pools_by_stream: HashMap<Stream, [u32; 2]>,
    /// The last stream served and its pools: skips the map on the hot path.
    last_stream: Option<(Stream, [u32; 2])>,
    /// Allocated and stashed blocks by address: the pointer lookup of `free`.
    by_addr: AddrMap,
    /// Live blocks used on streams other than their own (`record_stream`).
    recorded_streams: HashMap<u64, Vec<Stream>>,
    /// Freed blocks waiting for the events of the other streams that used
    /// them: (address, events). Still allocated to the heap until then.
    pending: Vec<(u64, Vec<u64>)>,
    /// The most this heap may reserve by the memory fraction (u64::MAX: no limit).
    reserved_limit: u64,
    /// When to give memory back; the budget also caps growth.
    policy: Policy,
    /// The reclaimer's clock, for idle stamps.
    clock: Arc<Clock>,
    /// This process's slot among the processes sharing the device.
    registry: Option<Registry>,
    /// How long a request other processes could help waits for them.
    oom_wait: Duration,
    /// Whether frees go through the stash (see the top of this file).
    stash_enabled: bool,
    /// Rows for the TIDEPOOL_TRACE recording, when one is on.
    trace: Option<TraceBuffer>,
    stats: Counters,
}

impl DeviceHeap {
    pub fn new(device: usize, rules: SizeRules, backend: Arc<dyn Backend>) -> DeviceHeap {
        DeviceHeap {
            device,
            rules,
            backend,
            blocks: BlockArena::new(),
            segments: Vec::new(),
            unused_segments: Vec::new(),
            segment_by_base: BTreeMap::new(),
            pools: Vec::new(),
            pools_by_stream: HashMap::new(),
            last_stream: None,
            by_addr: AddrMap::default(),
            recorded_streams: HashMap::new(),
            pending: Vec::new(),
            reserved_limit: u64::MAX,
            policy: Policy { release_after_ms: u64::MAX, headroom: 0, headroom_min_idle_ms: 0, max_reserved: u64::MAX },
            clock: Clock::new(),
            registry: None,
            oom_wait: Duration::ZERO,
            stash_enabled: true,
            trace: None,
            stats: Counters::default(),
        }
    }

    /// Records every allocation and free from now on into `recorder`.
    pub fn record_to(&mut self, recorder: Arc<Recorder>) {
        self.trace = Some(TraceBuffer::new(recorder));
    }

    /// Hands buffered trace rows to the recorder's writer.
    pub fn flush_trace(&mut self) {
        if let Some(trace) = self.trace.as_mut() {
            trace.flush();
        }
    }

    #[cold]
    fn record(&mut self, action: Action, pointer: u64, size: u64, stream: Stream) {
        if let Some(trace) = self.trace.as_mut() {
            trace.push(action, pointer, size, stream.0);
        }
    }

    /// Turns the stash on or off (off: every free merges at once).
    pub fn set_stash(&mut self, on: bool) {
        self.stash_enabled = on;
        if !on {
            self.flush_stashes();
        }
    }

    pub fn rules(&self) -> &SizeRules {
        &self.rules
    }

    /// The pool of (stream, kind), created on first use.
    #[inline]
    fn pool_id(&mut self, stream: Stream, kind: PoolKind) -> u32 {
        if let Some((s, ids)) = self.last_stream {
            if s == stream {
                return ids[kind as usize];
            }
        }
        let ids = match self.pools_by_stream.get(&stream) {
            Some(ids) => *ids,
            None => {
                let first = self.pools.len() as u32;
                self.pools.push(Pool::new(stream, PoolKind::Small));
                self.pools.push(Pool::new(stream, PoolKind::Large));
                let ids = [first, first + 1];
                self.pools_by_stream.insert(stream, ids);
                ids
            }
        };
        self.last_stream = Some((stream, ids));
        ids[kind as usize]
    }

    /// Serves a request of `size` bytes on `stream`; 0 bytes gives address 0.
    #[inline]
    pub fn allocate(&mut self, size: u64, stream: Stream) -> Result<u64, AllocError> {
        if size == 0 {
            return Ok(0);
        }
        let rounded = self.rules.round(size).ok_or(AllocError::TooLarge { size })?;
        let kind = self.rules.kind(rounded);
        let pool = self.pool_id(stream, kind);
        let stashed = self.pools[pool as usize].stash;
        if stashed != NIL && self.blocks[stashed].size == rounded {
            self.pools[pool as usize].stash = NIL;
            self.blocks[stashed].state = BlockState::Detached;
            return Ok(self.hand_out(stashed, size));
        }
        self.allocate_from_bins(pool, rounded, size, stream)
    }

    /// The allocation path past the stash: best fit in the bins, else growth.
    #[cold]
    #[inline(never)]
    fn allocate_from_bins(&mut self, pool: u32, rounded: u64, size: u64, stream: Stream) -> Result<u64, AllocError> {
        self.process_pending(false);
        self.flush_stash(pool);
        let block = match self.pools[pool as usize].best_fit(&self.blocks, rounded, &self.rules) {
            Some(id) => {
                self.remove_free(id);
                id
            }
            None => self.grow(pool, rounded, size, stream)?,
        };
        let borrowed = self.pools[self.blocks[block].pool as usize].stream != stream;
        let addr = self.carve(block, rounded, size);
        if borrowed {
            self.recorded_streams.insert(addr, vec![stream]);
        }
        Ok(addr)
    }

    /// Gets a new segment for `pool` big enough for `rounded`, releasing the
    /// cache and retrying once when the backend refuses. The segment's one
    /// block is returned unlinked from any bin.
    fn grow(&mut self, pool: u32, rounded: u64, size: u64, stream: Stream) -> Result<BlockId, AllocError> {
        let segment_size = self.rules.segment_size(rounded).ok_or(AllocError::TooLarge { size })?;
        let base = match self.new_segment(segment_size, stream) {
            Ok(base) => base,
            Err(BackendError::OutOfMemory) => {
                if let Some(block) = self.borrow_from_other_streams(pool, rounded, stream) {
                    return Ok(block);
                }
                self.release_free_segments(Reason::OutOfMemory, |_, _| true);
                self.stats.num_alloc_retries += 1;
                let retried = match self.new_segment(segment_size, stream) {
                    Err(BackendError::OutOfMemory) => self.ask_others(segment_size, stream),
                    other => other,
                };
                match retried {
                    Ok(base) => base,
                    Err(BackendError::OutOfMemory) => {
                        self.stats.num_ooms += 1;
                        self.record(Action::AllocateFailure, 0, size, stream);
                        return Err(AllocError::OutOfMemory(Box::new(self.oom_report(size))));
                    }
                    Err(err) => return Err(AllocError::Backend(err)),
                }
            }
            Err(err) => return Err(AllocError::Backend(err)),
        };
        let kind = self.pools[pool as usize].kind;
        let segment_id = match self.unused_segments.pop() {
            Some(id) => id,
            None => {
                self.segments.push(None);
                (self.segments.len() - 1) as u32
            }
        };
        let block = self.blocks.insert(base, segment_size, segment_id, pool, kind);
        self.segments[segment_id as usize] = Some(Segment { base, size: segment_size, pool, first_block: block, idle_since_ms: 0 });
        self.segment_by_base.insert(base, segment_id);
        self.stats.segment.increase(kind, 1);
        self.stats.reserved_bytes.increase(kind, segment_size);
        self.stats.num_device_alloc += 1;
        Ok(block)
    }

    /// When the device is full, a free block cached for another stream can
    /// serve: the requesting stream first waits (on the device, not the
    /// host) for an event recorded on the block's stream, and the block is
    /// recorded as used by the requester, so it goes back to its own
    /// stream's pool only once the requester's work on it is done.
    #[cold]
    fn borrow_from_other_streams(&mut self, pool: u32, rounded: u64, stream: Stream) -> Option<BlockId> {
        let kind = self.pools[pool as usize].kind;
        self.flush_stashes();
        let best = (0..self.pools.len() as u32)
            .filter(|&p| p != pool && self.pools[p as usize].kind == kind)
            .filter_map(|p| self.pools[p as usize].best_fit(&self.blocks, rounded, &self.rules))
            .min_by_key(|&id| self.blocks[id].size)?;
        let owner = self.pools[self.blocks[best].pool as usize].stream;
        match self.backend.record_event(self.device, owner) {
            Ok(Some(event)) => {
                let waited = self.backend.stream_wait_event(self.device, stream, event);
                self.backend.recycle_event(self.device, event);
                waited.ok()?;
            }
            Ok(None) => {}
            Err(_) => return None,
        }
        self.remove_free(best);
        self.stats.num_cross_stream_reuses += 1;
        Some(best)
    }

    /// The last resort before an OOM: ask the other processes on the device
    /// for `size` bytes and retry until they free enough or `oom_wait` passes.
    #[cold]
    fn ask_others(&mut self, size: u64, stream: Stream) -> Result<u64, BackendError> {
        let over_budget = self.stats.reserved_bytes.total().saturating_add(size) > self.reserved_limit.min(self.policy.max_reserved);
        if self.oom_wait.is_zero() || over_budget {
            return Err(BackendError::OutOfMemory);
        }
        let Some(registry) = self.registry.as_mut() else { return Err(BackendError::OutOfMemory) };
        if registry.request(size).is_err() {
            return Err(BackendError::OutOfMemory);
        }
        self.stats.num_coop_requests += 1;
        let start = Instant::now();
        let result = loop {
            std::thread::sleep(Duration::from_millis(5));
            match self.new_segment(size, stream) {
                Ok(base) => {
                    self.stats.num_coop_satisfied += 1;
                    self.stats.coop_last_wait_ms = start.elapsed().as_millis() as u64;
                    break Ok(base);
                }
                Err(BackendError::OutOfMemory) if start.elapsed() < self.oom_wait => continue,
                Err(err) => break Err(err),
            }
        };
        if let Some(registry) = self.registry.as_mut() {
            let _ = registry.request(0);
        }
        result
    }

    /// Joins the processes sharing this device: publishes at every
    /// reclaimer pass, answers their requests, asks them before an OOM.
    pub fn cooperate(&mut self, registry: Registry, oom_wait: Duration) {
        self.registry = Some(registry);
        self.oom_wait = oom_wait;
    }

    /// A segment from the backend, unless it would take the heap past its
    /// reserve limit (which then counts as out of memory).
    fn new_segment(&mut self, size: u64, stream: Stream) -> Result<u64, BackendError> {
        match self.stats.reserved_bytes.total().checked_add(size) {
            Some(total) if total <= self.reserved_limit.min(self.policy.max_reserved) => {}
            _ => return Err(BackendError::OutOfMemory),
        }
        self.backend.allocate(self.device, size, stream)
    }

    /// Caps the bytes this heap may reserve (`None`: no cap). Cached
    /// segments above the new cap are released at once.
    pub fn set_reserved_limit(&mut self, limit: Option<u64>) {
        self.reserved_limit = limit.unwrap_or(u64::MAX);
        self.release_over_budget();
    }

    /// The cap on reserved bytes: the memory fraction's or the budget's, the lower.
    pub fn reserved_limit(&self) -> Option<u64> {
        let limit = self.reserved_limit.min(self.policy.max_reserved);
        (limit != u64::MAX).then_some(limit)
    }

    /// Sets the release policy and the clock its idle stamps use.
    pub fn set_policy(&mut self, policy: Policy, clock: Arc<Clock>) {
        self.policy = policy;
        self.clock = clock;
        self.release_over_budget();
    }

    /// Releases cached segments, longest idle first, while reserved is over the cap.
    fn release_over_budget(&mut self) {
        let Some(limit) = self.reserved_limit() else { return };
        if self.stats.reserved_bytes.total() > limit {
            let policy = Policy { release_after_ms: u64::MAX, headroom: 0, headroom_min_idle_ms: 0, max_reserved: limit };
            self.apply(&policy);
        }
    }

    /// One pass of the reclaimer: releases what the policy picks, then
    /// publishes to the other processes on the device and, if any of them
    /// asks for memory, gives back every idle cached segment.
    pub fn reclaim(&mut self) -> Released {
        self.stats.num_reclaims += 1;
        self.process_pending(false);
        let policy = Policy { max_reserved: self.reserved_limit().unwrap_or(u64::MAX), ..self.policy };
        let mut released = self.apply(&policy);
        if self.registry.is_some() {
            let stats = self.stats();
            let entry = Entry {
                device: self.device as u32,
                reserved: stats.reserved_bytes.all.current,
                allocated: stats.allocated_bytes.all.current,
                cached_free: stats.cached_free_bytes,
                fragmentation_milli: (stats.external_fragmentation() * 1000.0) as u64,
                requests_served: stats.num_coop_served,
                released: Reason::ALL.map(|r| stats.released(r).bytes),
                ..Entry::default()
            };
            let asked = self.registry.as_mut().and_then(|r| r.publish(entry).ok()).unwrap_or(0);
            if asked > 0 {
                let answer = self.release_free_segments(Reason::Cooperation, |_, _| true);
                if answer.segments > 0 {
                    self.stats.num_coop_served += 1;
                }
                released.segments += answer.segments;
                released.bytes += answer.bytes;
            }
        }
        released
    }

    fn apply(&mut self, policy: &Policy) -> Released {
        self.flush_stashes();
        let idle: Vec<IdleSegment> = self
            .segments
            .iter()
            .enumerate()
            .filter_map(|(id, s)| {
                let s = s.as_ref()?;
                let b = &self.blocks[s.first_block];
                (!b.is_allocated() && b.next == NIL).then_some(IdleSegment { id: id as u32, size: s.size, idle_since_ms: s.idle_since_ms })
            })
            .collect();
        if idle.is_empty() {
            return Released::default();
        }
        let device_free = if policy.headroom > 0 { self.backend.mem_info(self.device).map_or(u64::MAX, |i| i.free) } else { u64::MAX };
        let pressure = Pressure { device_free, reserved: self.stats.reserved_bytes.total() };
        let chosen = decide(policy, self.clock.now_ms(), &idle, pressure);
        let mut total = Released::default();
        for reason in Reason::ALL {
            let ids: Vec<u32> = chosen.iter().filter(|c| c.1 == reason).map(|c| c.0).collect();
            if !ids.is_empty() {
                let released = self.release_free_segments(reason, |id, _| ids.contains(&id));
                total.segments += released.segments;
                total.bytes += released.bytes;
            }
        }
        total
    }

    /// Allocates the free, unbinned block `id` for a request, splitting off
    /// the rest when the rules say so. Returns the block's address.
    #[inline]
    fn carve(&mut self, id: BlockId, rounded: u64, requested: u64) -> u64 {
        let (addr, size, pool, segment) = {
            let b = &self.blocks[id];
            (b.addr, b.size, b.pool, b.segment)
        };
        let kind = self.pools[pool as usize].kind;
        if self.rules.should_split(kind, size, rounded) {
            let rest = self.blocks.insert(addr + rounded, size - rounded, segment, pool, kind);
            let next = self.blocks[id].next;
            self.blocks[rest].prev = id;
            self.blocks[rest].next = next;
            if next != NIL {
                self.blocks[next].prev = rest;
            }
            self.blocks[id].next = rest;
            self.blocks[id].size = rounded;
            self.insert_free(rest);
        }
        self.by_addr.insert(addr, id);
        self.hand_out(id, requested)
    }

    /// Marks the free, unbinned block `id`, already in `by_addr`, allocated
    /// for `requested` bytes.
    #[inline(always)]
    fn hand_out(&mut self, id: BlockId, requested: u64) -> u64 {
        let b = &mut self.blocks[id];
        b.state = BlockState::Allocated;
        b.requested = requested;
        let (addr, size, kind, pool) = (b.addr, b.size, b.kind, b.pool);
        if self.trace.is_some() {
            let stream = self.pools[pool as usize].stream;
            self.record(Action::Allocate, addr, requested, stream);
        }
        let stats = &mut self.stats;
        stats.allocation.increase(kind, 1);
        stats.allocated_bytes.increase(kind, size);
        stats.requested_bytes.increase(kind, requested);
        addr
    }

    /// Frees the live block at `ptr`, merging it with free neighbours.
    #[inline]
    pub fn free(&mut self, ptr: u64) -> Result<Freed, AllocError> {
        let found = self.by_addr.get(ptr).filter(|&id| self.blocks[id].is_allocated());
        let Some(id) = found else {
            self.stats.num_invalid_frees += 1;
            return Err(AllocError::InvalidFree { ptr, reason: self.classify_invalid_free(ptr) });
        };
        if !self.recorded_streams.is_empty() || !self.pending.is_empty() {
            if self.pending.iter().any(|(p, _)| *p == ptr) {
                self.stats.num_invalid_frees += 1;
                return Err(AllocError::InvalidFree { ptr, reason: InvalidFree::NotLive });
            }
            if let Some(streams) = self.recorded_streams.remove(&ptr) {
                if let Some(freed) = self.defer_free(id, ptr, &streams) {
                    return Ok(freed);
                }
            }
        }
        self.free_now(id, ptr)
    }

    /// Frees the allocated block `id` at `ptr` now: stats, then the stash or the bins.
    fn free_now(&mut self, id: BlockId, ptr: u64) -> Result<Freed, AllocError> {
        let (size, requested, pool, kind) = {
            let b = &mut self.blocks[id];
            b.state = BlockState::Stashed;
            let requested = std::mem::take(&mut b.requested);
            (b.size, requested, b.pool, b.kind)
        };
        if self.trace.is_some() {
            let stream = self.pools[pool as usize].stream;
            self.record(Action::Free, ptr, requested, stream);
        }
        let stats = &mut self.stats;
        stats.allocation.decrease(kind, 1);
        stats.allocated_bytes.decrease(kind, size);
        stats.requested_bytes.decrease(kind, requested);

        if !self.stash_enabled {
            self.merge_and_bin(id);
            return Ok(Freed { size, requested });
        }
        let previous = std::mem::replace(&mut self.pools[pool as usize].stash, id);
        if previous != NIL {
            self.merge_and_bin(previous);
        }
        // The stash path ends here: merging is for the next operation.
        Ok(Freed { size, requested })
    }

    /// Merges the stashed block of `pool`, if any, into the bins.
    #[inline]
    fn flush_stash(&mut self, pool: u32) {
        let id = std::mem::replace(&mut self.pools[pool as usize].stash, NIL);
        if id != NIL {
            self.merge_and_bin(id);
        }
    }

    /// Merges every pool's stashed block.
    fn flush_stashes(&mut self) {
        for pool in 0..self.pools.len() as u32 {
            self.flush_stash(pool);
        }
    }

    /// Merges the free, unbinned block `id` with its free neighbours and
    /// puts the result in its bin.
    #[inline(never)]
    fn merge_and_bin(&mut self, id: BlockId) {
        self.blocks[id].state = BlockState::Detached;
        self.by_addr.remove(self.blocks[id].addr);
        let mut merged = id;
        let prev = self.blocks[id].prev;
        if prev != NIL && self.blocks[prev].state == BlockState::Binned {
            self.remove_free(prev);
            self.absorb_next(prev);
            merged = prev;
        }
        let next = self.blocks[merged].next;
        if next != NIL && self.blocks[next].state == BlockState::Binned {
            self.remove_free(next);
            self.absorb_next(merged);
        }
        self.insert_free(merged);
    }

    /// Merges the block after `id` into `id` and drops its record.
    #[inline]
    fn absorb_next(&mut self, id: BlockId) {
        let next = self.blocks[id].next;
        let (next_size, after) = (self.blocks[next].size, self.blocks[next].next);
        self.blocks[id].size += next_size;
        self.blocks[id].next = after;
        if after != NIL {
            self.blocks[after].prev = id;
        }
        self.blocks.remove(next);
    }

    /// Puts a free block into its pool's bin and counts it.
    #[inline]
    fn insert_free(&mut self, id: BlockId) {
        let b = &self.blocks[id];
        let (pool, size, split, segment) = (b.pool, b.size, b.is_split(), b.segment);
        let pool = &mut self.pools[pool as usize];
        pool.insert(&mut self.blocks, id, size);
        if split {
            self.stats.inactive_split.increase(pool.kind, 1);
            self.stats.inactive_split_bytes.increase(pool.kind, size);
        } else if let Some(segment) = self.segments[segment as usize].as_mut() {
            segment.idle_since_ms = self.clock.now_ms();
        }
    }

    /// Takes a free block out of its pool's bin and uncounts it.
    #[inline]
    fn remove_free(&mut self, id: BlockId) {
        let b = &self.blocks[id];
        let (pool, size, split) = (b.pool, b.size, b.is_split());
        let pool = &mut self.pools[pool as usize];
        pool.remove(&mut self.blocks, id, size);
        if split {
            self.stats.inactive_split.decrease(pool.kind, 1);
            self.stats.inactive_split_bytes.decrease(pool.kind, size);
        }
    }

    /// Why `ptr` is not a live block (slow path: errors only).
    fn classify_invalid_free(&self, ptr: u64) -> InvalidFree {
        let Some((_, &segment_id)) = self.segment_by_base.range(..=ptr).next_back() else {
            return InvalidFree::Foreign;
        };
        let segment = self.segments[segment_id as usize].as_ref().expect("indexed segment exists");
        if ptr >= segment.base + segment.size {
            return InvalidFree::Foreign;
        }
        let mut cur = segment.first_block;
        while cur != NIL {
            let b = &self.blocks[cur];
            if ptr < b.addr + b.size {
                return if b.is_allocated() { InvalidFree::Interior { block: b.addr } } else { InvalidFree::NotLive };
            }
            cur = b.next;
        }
        InvalidFree::NotLive
    }

    /// Releases every segment that is one whole free block and that `keep`
    /// selects (by segment). A segment the backend fails to release stays
    /// cached, whole and consistent.
    pub fn release_free_segments(&mut self, reason: Reason, mut select: impl FnMut(u32, &Segment) -> bool) -> Released {
        self.process_pending(true);
        self.flush_stashes();
        let mut released = Released::default();
        for segment_id in 0..self.segments.len() as u32 {
            let Some(segment) = &self.segments[segment_id as usize] else { continue };
            let block = &self.blocks[segment.first_block];
            if block.is_allocated() || block.next != NIL || !select(segment_id, segment) {
                continue;
            }
            let (base, size, pool, block) = (segment.base, segment.size, segment.pool, segment.first_block);
            if self.backend.release(self.device, base, size, self.pools[pool as usize].stream).is_err() {
                continue;
            }
            let kind = self.pools[pool as usize].kind;
            self.remove_free(block);
            self.blocks.remove(block);
            self.segments[segment_id as usize] = None;
            self.unused_segments.push(segment_id);
            self.segment_by_base.remove(&base);
            self.stats.segment.decrease(kind, 1);
            self.stats.reserved_bytes.decrease(kind, size);
            self.stats.num_device_free += 1;
            released.segments += 1;
            released.bytes += size;
        }
        let by_reason = &mut self.stats.released[reason as usize];
        by_reason.segments += released.segments;
        by_reason.bytes += released.bytes;
        released
    }

    /// The segment holding `ptr`: its base and size.
    pub fn segment_of(&self, ptr: u64) -> Option<(u64, u64)> {
        let (_, &id) = self.segment_by_base.range(..=ptr).next_back()?;
        let segment = self.segments[id as usize].as_ref()?;
        (ptr < segment.base + segment.size).then_some((segment.base, segment.size))
    }

    /// A block used on other streams becomes reusable only once the work
    /// those streams had queued has run: an event is recorded on each, and
    /// the block waits in `pending` (still counted as allocated) until they
    /// complete. Returns None when there is nothing to wait for (a backend
    /// without asynchronous work), and the block is freed at once.
    #[cold]
    fn defer_free(&mut self, id: BlockId, ptr: u64, streams: &[Stream]) -> Option<Freed> {
        let mut events = Vec::with_capacity(streams.len());
        for &stream in streams {
            match self.backend.record_event(self.device, stream) {
                Ok(Some(event)) => events.push(event),
                Ok(None) => {}
                // No event: wait for the stream here instead.
                Err(_) => {
                    if self.backend.synchronize_stream(self.device, stream).is_err() {
                        self.stats.num_stream_sync_errors += 1;
                    }
                }
            }
        }
        if events.is_empty() {
            return None;
        }
        let b = &self.blocks[id];
        let freed = Freed { size: b.size, requested: b.requested };
        self.pending.push((ptr, events));
        Some(freed)
    }

    /// Frees the pending blocks whose events completed; with `wait`, waits
    /// for every event first (before releasing memory, so nothing still in
    /// use goes back to the driver).
    pub fn process_pending(&mut self, wait: bool) {
        if self.pending.is_empty() {
            return;
        }
        let mut still = Vec::new();
        for (ptr, events) in std::mem::take(&mut self.pending) {
            let done = events.iter().all(|&event| {
                if wait {
                    self.backend.wait_event(self.device, event).is_ok()
                } else {
                    self.backend.event_done(self.device, event).unwrap_or(true)
                }
            });
            if !done {
                still.push((ptr, events));
                continue;
            }
            for event in events {
                self.backend.recycle_event(self.device, event);
            }
            if let Some(id) = self.by_addr.get(ptr).filter(|&id| self.blocks[id].is_allocated()) {
                let _ = self.free_now(id, ptr);
            }
        }
        self.pending = still;
    }

    /// Notes that the live block at `ptr` is also used on `stream`: when it
    /// is freed, it is reused only after the work queued on `stream` runs.
    pub fn record_stream(&mut self, ptr: u64, stream: Stream) -> Result<(), AllocError> {
        let id = self.by_addr.get(ptr).filter(|&id| self.blocks[id].is_allocated());
        let Some(id) = id else {
            return Err(AllocError::UnknownPointer { ptr });
        };
        if self.pools[self.blocks[id].pool as usize].stream != stream {
            let streams = self.recorded_streams.entry(ptr).or_default();
            if !streams.contains(&stream) {
                streams.push(stream);
            }
        }
        Ok(())
    }

    /// The streams recorded for the live block at `ptr`.
    pub fn recorded_streams(&self, ptr: u64) -> &[Stream] {
        self.recorded_streams.get(&ptr).map_or(&[], Vec::as_slice)
    }

    /// Every segment with its blocks in address order, for snapshots.
    pub fn snapshot(&mut self) -> Vec<SegmentSnapshot> {
        self.flush_stashes();
        let mut out: Vec<SegmentSnapshot> = self
            .segments
            .iter()
            .flatten()
            .map(|segment| {
                let pool = &self.pools[segment.pool as usize];
                let mut blocks = Vec::new();
                let mut cur = segment.first_block;
                while cur != NIL {
                    let b = &self.blocks[cur];
                    blocks.push(BlockSnapshot {
                        address: b.addr,
                        size: b.size,
                        requested: b.requested,
                        allocated: b.is_allocated(),
                    });
                    cur = b.next;
                }
                SegmentSnapshot { address: segment.base, size: segment.size, stream: pool.stream, kind: pool.kind, blocks }
            })
            .collect();
        out.sort_by_key(|s| s.address);
        out
    }

    /// The size of the live block at `ptr`, if there is one.
    pub fn live_size(&self, ptr: u64) -> Option<u64> {
        self.by_addr.get(ptr).filter(|&id| self.blocks[id].is_allocated()).map(|id| self.blocks[id].size)
    }

    /// Counts a free whose stated size differed from the block's.
    pub fn count_size_mismatch(&mut self) {
        self.stats.num_size_mismatches += 1;
    }

    /// The statistics, with the cache figures computed now (stashed
    /// blocks are merged first, so the figures are those of a merged heap).
    pub fn stats(&mut self) -> Stats {
        self.process_pending(false);
        self.flush_stashes();
        let mut stats = self.stats.report();
        stats.cached_free_bytes = self.pools.iter().map(|p| p.free_bytes).sum();
        stats.largest_free_block_bytes = self.pools.iter().map(|p| p.largest(&self.blocks)).max().unwrap_or(0);
        stats
    }

    pub fn reset_peak_stats(&mut self) {
        self.stats.reset_peaks();
    }

    pub fn reset_accumulated_stats(&mut self) {
        self.stats.reset_accumulated();
    }

    fn oom_report(&mut self, requested: u64) -> OomReport {
        let stats = self.stats();
        let info = self.backend.mem_info(self.device).ok();
        OomReport {
            device: self.device,
            requested,
            allocated: stats.allocated_bytes.all.current,
            reserved: stats.reserved_bytes.all.current,
            cached_free: stats.cached_free_bytes,
            largest_free_block: stats.largest_free_block_bytes,
            fragmentation: stats.external_fragmentation(),
            device_free: info.map(|i| i.free),
            device_total: info.map(|i| i.total),
            reserved_limit: self.reserved_limit(),
        }
    }

    /// Requested, allocated and reserved bytes now, over both pool kinds.
    /// Unlike `stats()`, merges nothing: watching does not change the heap.
    pub fn totals(&self) -> Totals {
        Totals {
            requested: self.stats.requested_bytes.total(),
            allocated: self.stats.allocated_bytes.total(),
            reserved: self.stats.reserved_bytes.total(),
        }
    }

    /// Live blocks as (address, size, requested) in address order, for tests and snapshots.
    pub fn live_blocks(&self) -> Vec<(u64, u64, u64)> {
        let mut out: Vec<_> = self
            .by_addr
            .iter()
            .filter(|&(_, id)| self.blocks[id].is_allocated())
            .map(|(addr, id)| (addr, self.blocks[id].size, self.blocks[id].requested))
            .collect();
        out.sort_unstable();
        out
    }
}
