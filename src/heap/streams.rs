//! Stream-ordered safety, for one device heap: blocks used on other streams
//! (`record_stream`) wait for events before they can be reused, and a full
//! device serves a stream from a block cached for another after a device-side
//! wait (cross-stream reuse: the requester borrows the block). Owns
//! `StreamSafety`: the streams recorded for live blocks, the pending frees
//! (`PendingFrees`), and whether cross-stream reuse is on.
//!
//! Invariants (checked by `validate()`, through `PendingFrees::check`):
//! each pending block waits for as many queued events as it is named in,
//! and at least one, or for the end of a capture, never both; each stream
//! has one queue; a block waits exactly when it is `Pending`; streams are
//! recorded only for allocated blocks, never a block's own stream.
#![forbid(unsafe_code)]

use std::collections::{HashMap, HashSet, VecDeque};

use super::block::{BlockId, BlockState};
use super::history::HistoryAction;
use super::ids::PoolId;
use super::{DeviceHeap, Freed};
use crate::error::AllocError;
use crate::tag::TagId;
use crate::types::Stream;

impl DeviceHeap {
    /// When the device is full, a free block cached for another stream can
    /// serve: the requesting stream first waits (on the device, not the
    /// host) for an event recorded on the block's stream, and the block is
    /// recorded as used by the requester, so it goes back to its own
    /// stream's pool only once the requester's work on it is done.
    /// Private pools neither give nor borrow, and nothing is borrowed while one
    /// is open (the wait would join a capture to other streams' work).
    /// Tagged pools neither give nor borrow either: a page holds the blocks
    /// of one tag, so that pausing a tag touches no other tag's memory.
    #[cold]
    pub(super) fn borrow_from_other_streams(&mut self, pool: PoolId, rounded: u64, stream: Stream) -> Option<BlockId> {
        let p = &self.pools[pool];
        if !self.streams.cross_stream_reuse || !self.may_release() || p.private.is_some() || p.tag != TagId::DEFAULT {
            return None;
        }
        let kind = self.pools[pool].kind;
        self.recall_all();
        self.flush_stashes();
        let best = self
            .pools
            .iter()
            .filter(|&(id, p)| id != pool && p.kind == kind && p.private.is_none() && p.tag == TagId::DEFAULT)
            .filter_map(|(_, p)| p.best_fit(&self.blocks, rounded, &self.rules))
            .min_by_key(|&id| self.blocks[id].size)?;
        let owner = self.pools[self.blocks[best].pool].stream;
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
        if self.map_block(best, rounded).is_err() {
            self.insert_free(best);
            return None;
        }
        self.stats.events.num_cross_stream_reuses += 1;
        Some(best)
    }

    /// A block used on other streams becomes reusable only once the work
    /// those streams had queued has run: an event is recorded on each, and
    /// the block waits, pending (active, no longer allocated), until they
    /// complete. Returns None when there is nothing to wait for (a backend
    /// without asynchronous work): the caller frees the block at once.
    /// While a private pool is open (a capture may be underway) no event
    /// is recorded: the block waits, pending, until the last one closes.
    #[cold]
    pub(super) fn defer_free(&mut self, id: BlockId, ptr: u64, streams: Vec<Stream>) -> Option<Freed> {
        if !self.may_release() {
            let freed = self.count_free(id, ptr, false);
            self.make_pending(id);
            self.streams.pending.after_capture.push((id, streams));
            return Some(freed);
        }
        let events = self.record_events(&streams);
        if events.is_empty() {
            return None;
        }
        let freed = self.count_free(id, ptr, false);
        self.make_pending(id);
        self.streams.pending.push(id, &events);
        Some(freed)
    }

    /// Records an event on each of `streams` (one that cannot be recorded:
    /// waits for that stream instead).
    fn record_events(&mut self, streams: &[Stream]) -> Vec<(Stream, u64)> {
        let mut events = Vec::with_capacity(streams.len());
        for &stream in streams {
            match self.backend.record_event(self.device, stream) {
                Ok(Some(event)) => events.push((stream, event)),
                Ok(None) => {}
                // No event: wait for the stream here instead.
                Err(_) => {
                    if self.backend.synchronize_stream(self.device, stream).is_err() {
                        self.stats.events.num_stream_sync_errors += 1;
                    }
                }
            }
        }
        events
    }

    /// Marks the freed block `id` pending: active, no longer allocated.
    fn make_pending(&mut self, id: BlockId) {
        // Active memory's peaks are noted under the lock only: no thread
        // hands out cached blocks while frees are pending.
        self.disarm_all();
        let b = &mut self.blocks[id];
        b.state = BlockState::Pending;
        let (kind, size) = (b.kind, b.size);
        self.stats.pending.increase(kind, 1);
        self.stats.pending_bytes.increase(kind, size);
    }

    /// Makes the pending block `id` reusable.
    fn finish_pending(&mut self, id: BlockId) {
        let b = &self.blocks[id];
        let (kind, size, addr, requested, stream) = (b.kind, b.size, b.addr, b.requested, self.pools[b.pool].stream);
        self.stats.pending.decrease(kind, 1);
        self.stats.pending_bytes.decrease(kind, size);
        self.note(HistoryAction::FreeCompleted, addr, requested, stream);
        self.forget_context(addr);
        self.deactivate(id);
    }

    /// Once the last private pool closes: records the events of the frees
    /// that waited for it.
    pub(super) fn record_events_after_capture(&mut self) {
        for (id, streams) in std::mem::take(&mut self.streams.pending.after_capture) {
            let events = self.record_events(&streams);
            if events.is_empty() {
                self.finish_pending(id);
            } else {
                self.streams.pending.push(id, &events);
            }
        }
    }

    /// Makes reusable the pending blocks whose events completed; with
    /// `wait`, waits for every event first (before releasing memory, so
    /// nothing still in use goes back to the driver). A stream's events
    /// complete in order, so each stream's queue is polled up to its first
    /// event not done: one query per stream, however many blocks wait.
    /// Queries nothing while a private pool is open (a capture forbids it).
    pub fn process_pending(&mut self, wait: bool) {
        if self.streams.pending.is_empty() || !self.may_release() {
            return;
        }
        for queue in 0..self.streams.pending.queues.len() {
            while let Some(&(event, id)) = self.streams.pending.queues[queue].1.front() {
                let done = if wait {
                    self.backend.wait_event(self.device, event).is_ok()
                } else {
                    self.backend.event_done(self.device, event).unwrap_or(true)
                };
                if !done {
                    break;
                }
                self.streams.pending.queues[queue].1.pop_front();
                self.backend.recycle_event(self.device, event);
                if self.streams.pending.event_done(id) {
                    self.finish_pending(id);
                }
            }
        }
        self.streams.pending.queues.retain(|(_, events)| !events.is_empty());
    }

    /// Notes that the allocated block at `ptr` is also used on `stream`: when
    /// it is freed, it is reused only after the work queued on `stream` runs.
    pub fn record_stream(&mut self, ptr: u64, stream: Stream) -> Result<(), AllocError> {
        let mut id = self.by_addr.get(ptr);
        if let Some(lent) = id.filter(|&id| self.blocks[id].state == BlockState::Lent) {
            id = self.settle_lent(lent).then_some(lent);
        }
        let Some(id) = id.filter(|&id| self.blocks[id].is_allocated()) else {
            return Err(AllocError::UnknownPointer { ptr });
        };
        if self.pools[self.blocks[id].pool].stream != stream {
            let streams = self.streams.recorded.entry(ptr).or_default();
            if !streams.contains(&stream) {
                streams.push(stream);
            }
        }
        Ok(())
    }

    /// The streams recorded for the live block at `ptr`.
    pub fn recorded_streams(&self, ptr: u64) -> &[Stream] {
        self.streams.recorded.get(&ptr).map_or(&[], Vec::as_slice)
    }
}

/// What keeps blocks safe across streams on one heap.
pub(super) struct StreamSafety {
    /// Live blocks used on streams other than their own (`record_stream`), by address.
    pub recorded: HashMap<u64, Vec<Stream>>,
    /// Freed blocks waiting for the events of the other streams that used them.
    pub pending: PendingFrees,
    /// Whether a full device may serve one stream from blocks cached for
    /// another (`borrow_from_other_streams`; the `lend_across_streams` option).
    pub cross_stream_reuse: bool,
}

impl Default for StreamSafety {
    fn default() -> StreamSafety {
        StreamSafety { recorded: HashMap::new(), pending: PendingFrees::default(), cross_stream_reuse: true }
    }
}

/// Freed blocks waiting for events recorded on the other streams that used
/// them: per stream, its events in the order they were recorded (the order
/// they complete), each naming its block; and per block, how many of its
/// events have not completed. And the blocks freed while a private pool was
/// open, with the streams to record their events on once none is.
#[derive(Default)]
pub(super) struct PendingFrees {
    queues: Vec<(Stream, VecDeque<(u64, BlockId)>)>,
    waiting: HashMap<BlockId, u32>,
    after_capture: Vec<(BlockId, Vec<Stream>)>,
}

impl PendingFrees {
    pub fn is_empty(&self) -> bool {
        self.waiting.is_empty() && self.after_capture.is_empty()
    }

    /// Whether some block waits for an event (one `process_pending` could
    /// find completed).
    #[inline(always)]
    pub fn awaits_events(&self) -> bool {
        !self.queues.is_empty()
    }

    /// Queues the events `block` waits for, each on its stream.
    fn push(&mut self, block: BlockId, events: &[(Stream, u64)]) {
        for &(stream, event) in events {
            let queue = match self.queues.iter().position(|(s, _)| *s == stream) {
                Some(queue) => queue,
                None => {
                    self.queues.push((stream, VecDeque::new()));
                    self.queues.len() - 1
                }
            };
            self.queues[queue].1.push_back((event, block));
        }
        self.waiting.insert(block, events.len() as u32);
    }

    /// Notes that one event of `block` completed; true when it was the last.
    fn event_done(&mut self, block: BlockId) -> bool {
        let left = self.waiting.get_mut(&block).expect("a queued event names a pending block");
        *left -= 1;
        if *left > 0 {
            return false;
        }
        self.waiting.remove(&block);
        true
    }

    /// Checks that each block waits for as many events as the queues name
    /// it in, at least one, or for the end of a capture, and that each
    /// stream has one queue; returns the pending blocks (for `validate`).
    pub fn check(&self) -> Result<HashSet<BlockId>, String> {
        let mut queued: HashMap<BlockId, u32> = HashMap::new();
        for (i, (stream, events)) in self.queues.iter().enumerate() {
            if self.queues[..i].iter().any(|(s, _)| s == stream) {
                return Err(format!("stream {stream:?} has two queues of pending frees"));
            }
            for &(_, block) in events {
                *queued.entry(block).or_default() += 1;
            }
        }
        for (&block, &left) in &self.waiting {
            if left == 0 || queued.get(&block) != Some(&left) {
                return Err(format!("pending block {block} waits for {left} events but is queued for {:?}", queued.get(&block)));
            }
        }
        if queued.len() != self.waiting.len() {
            return Err(format!("{} blocks queued for events but {} pending", queued.len(), self.waiting.len()));
        }
        let mut pending: HashSet<BlockId> = queued.into_keys().collect();
        for (block, _) in &self.after_capture {
            if !pending.insert(*block) {
                return Err(format!("pending block {block} both waits for events and for the end of a capture"));
            }
        }
        Ok(pending)
    }
}
