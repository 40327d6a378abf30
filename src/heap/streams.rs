//! Stream-ordered safety, for one device heap: blocks used on other streams
//! (`record_stream`) wait for events before they can be reused, and a full
//! device lends a block cached for another stream after a device-side wait.
#![forbid(unsafe_code)]

use super::block::BlockId;
use super::{DeviceHeap, Freed};
use crate::error::AllocError;
use crate::Stream;

impl DeviceHeap {
    /// When the device is full, a free block cached for another stream can
    /// serve: the requesting stream first waits (on the device, not the
    /// host) for an event recorded on the block's stream, and the block is
    /// recorded as used by the requester, so it goes back to its own
    /// stream's pool only once the requester's work on it is done.
    #[cold]
    pub(super) fn borrow_from_other_streams(&mut self, pool: u32, rounded: u64, stream: Stream) -> Option<BlockId> {
        if !self.lend_across_streams {
            return None;
        }
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
        if self.map_block(best, rounded).is_err() {
            self.insert_free(best);
            return None;
        }
        self.stats.events.num_cross_stream_reuses += 1;
        Some(best)
    }

    /// A block used on other streams becomes reusable only once the work
    /// those streams had queued has run: an event is recorded on each, and
    /// the block waits in `pending` (still counted as allocated) until they
    /// complete. Returns None when there is nothing to wait for (a backend
    /// without asynchronous work), and the block is freed at once.
    #[cold]
    pub(super) fn defer_free(&mut self, id: BlockId, ptr: u64, streams: &[Stream]) -> Option<Freed> {
        let mut events = Vec::with_capacity(streams.len());
        for &stream in streams {
            match self.backend.record_event(self.device, stream) {
                Ok(Some(event)) => events.push(event),
                Ok(None) => {}
                // No event: wait for the stream here instead.
                Err(_) => {
                    if self.backend.synchronize_stream(self.device, stream).is_err() {
                        self.stats.events.num_stream_sync_errors += 1;
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
}
