//! Who watches a heap: the TIDEPOOL_TRACE recording, the history kept for
//! snapshots (`history.rs`), and the contexts allocations were made with.
//! One flag, `observed`, keeps the hot path to a single test while none is on.
//! Owns `Observers`.
//!
//! Invariants (checked by `validate()`: `check_contexts`): each kept
//! context is that of an allocated or pending block at its address, and
//! the heap is `observed` while one is kept.
#![forbid(unsafe_code)]

use std::collections::HashMap;
use std::sync::Arc;

use super::history::History;
use super::DeviceHeap;
use crate::error::AllocError;
use crate::recording::rows::Action;
use crate::recording::{Recorder, TraceBuffer};
use crate::types::Stream;

/// Who watches the heap.
#[derive(Default)]
pub(super) struct Observers {
    /// Rows for the TIDEPOOL_TRACE recording, when one is on.
    pub(super) trace: Option<TraceBuffer>,
    /// The last events, for snapshots' `device_traces`, when kept (`history.rs`).
    pub(super) history: Option<History>,
    /// Whether a recording, a history or contexts are on: one test on the
    /// hot path for all.
    pub(super) observed: bool,
    /// The context of each allocated or pending block allocated with one
    /// (`allocate_with_context`), by address; an entry goes when its block's
    /// free completes.
    pub(super) contexts: HashMap<u64, u64>,
    /// Whether a block was ever allocated with a context (keeps `observed` on).
    pub(super) with_contexts: bool,
    /// The context of the allocation under way, for its `alloc` event.
    pub(super) allocating_context: u64,
}

impl DeviceHeap {
    /// Records every allocation and free from now on into `recorder`.
    pub(crate) fn record_to(&mut self, recorder: Arc<Recorder>) {
        self.observers.trace = Some(TraceBuffer::new(recorder));
        self.observers.observed = true;
        self.disarm_all();
    }

    /// Hands buffered trace rows to the recorder's writer.
    pub fn flush_trace(&mut self) {
        if let Some(trace) = self.observers.trace.as_mut() {
            trace.flush();
        }
    }

    /// Tells the recording and the history (call only when `observed`).
    #[inline(always)]
    pub(super) fn record(&mut self, action: Action, pointer: u64, size: u64, stream: Stream) {
        if let Some(trace) = self.observers.trace.as_mut() {
            trace.push(action, pointer, size, stream.0);
        }
        if self.observers.history.is_some() {
            self.note_action(action, pointer, size, stream);
        }
    }

    /// Runs `allocate` with `context` (0: none) noted for the block it serves.
    pub(super) fn with_context(
        &mut self,
        context: u64,
        allocate: impl FnOnce(&mut Self) -> Result<u64, AllocError>,
    ) -> Result<u64, AllocError> {
        if context == 0 {
            return allocate(self);
        }
        self.observers.with_contexts = true;
        if !self.observers.observed {
            self.observers.observed = true;
            self.disarm_all();
        }
        self.observers.allocating_context = context;
        let result = allocate(self);
        self.observers.allocating_context = 0;
        if let Ok(addr @ 1..) = result {
            self.observers.contexts.insert(addr, context);
        }
        result
    }

    /// Forgets the context of the block at `addr`, whose free completed.
    #[cold]
    pub(super) fn forget_context(&mut self, addr: u64) {
        self.observers.contexts.remove(&addr);
    }

    /// The context the block at `addr` was allocated with (0: none).
    pub(super) fn context_of(&self, addr: u64) -> u64 {
        self.observers.contexts.get(&addr).copied().unwrap_or(0)
    }
}
