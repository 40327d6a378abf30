//! Memory history, for one device heap (PyTorch's `_record_memory_history`):
//! the last events of the heap, as snapshots carry them in `device_traces`,
//! so pytorch.org/memory_viz draws its timeline of tidepool's memory and
//! `tidepool replay` replays a snapshot tidepool wrote.
//!
//! Events, named as PyTorch names them: `alloc` (address, bytes asked
//! for), `free_requested` (the caller freed it), `free_completed` (it can
//! be reused: at once, or once the other streams that used it are done),
//! `segment_alloc`/`segment_free` (memory from and back to the driver),
//! `segment_map`/`segment_unmap` (pages of an expandable segment) and `oom`
//! (address: the device's free bytes, size: the request).
#![forbid(unsafe_code)]

use std::collections::VecDeque;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use super::DeviceHeap;
use crate::recording::rows::Action;
use crate::types::Stream;

/// What happened, in PyTorch's words.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HistoryAction {
    Alloc,
    FreeRequested,
    FreeCompleted,
    SegmentAlloc,
    SegmentFree,
    SegmentMap,
    SegmentUnmap,
    Oom,
}

impl HistoryAction {
    /// The name a snapshot's trace entry gives it.
    pub fn name(self) -> &'static str {
        match self {
            HistoryAction::Alloc => "alloc",
            HistoryAction::FreeRequested => "free_requested",
            HistoryAction::FreeCompleted => "free_completed",
            HistoryAction::SegmentAlloc => "segment_alloc",
            HistoryAction::SegmentFree => "segment_free",
            HistoryAction::SegmentMap => "segment_map",
            HistoryAction::SegmentUnmap => "segment_unmap",
            HistoryAction::Oom => "oom",
        }
    }
}

/// One event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HistoryEntry {
    pub action: HistoryAction,
    pub addr: u64,
    pub size: u64,
    pub stream: Stream,
    /// Microseconds since the Unix epoch, as PyTorch stamps its entries.
    pub time_us: u64,
    /// The context of the block (`alloc` and `free_*` events; 0: none).
    pub context: u64,
}

/// The last `max_entries` events, oldest first. Stamps come from a
/// monotonic clock anchored to the wall clock when history started, so
/// events stay in order even if the wall clock is set back.
pub(super) struct History {
    entries: VecDeque<HistoryEntry>,
    max_entries: usize,
    started: Instant,
    started_us: u64,
}

impl DeviceHeap {
    /// Keeps the last `max_entries` events from now on (None or 0: stops
    /// and forgets them).
    pub fn record_history(&mut self, max_entries: Option<usize>) {
        let started_us = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_micros() as u64);
        self.observers.history = max_entries.filter(|&n| n > 0).map(|max_entries| History {
            entries: VecDeque::new(),
            max_entries,
            started: Instant::now(),
            started_us,
        });
        self.observers.observed = self.observers.trace.is_some() || self.observers.history.is_some() || self.observers.with_contexts;
        if self.observers.observed {
            self.disarm_all(); // every event goes through the lock from now on
        }
    }

    /// The events kept, oldest first.
    pub fn history(&self) -> Vec<HistoryEntry> {
        self.observers.history.as_ref().map_or_else(Vec::new, |h| h.entries.iter().copied().collect())
    }

    /// Adds the event of a trace row.
    #[cold]
    #[inline(never)]
    pub(super) fn note_action(&mut self, action: Action, addr: u64, size: u64, stream: Stream) {
        match action {
            Action::Allocate => self.note(HistoryAction::Alloc, addr, size, stream),
            Action::Free => self.note(HistoryAction::FreeRequested, addr, size, stream),
            Action::AllocateFailure => {
                let device_free = self.backend.mem_info(self.device).map_or(0, |i| i.free);
                self.note(HistoryAction::Oom, device_free, size, stream);
            }
        }
    }

    /// Adds an event, when history is on.
    #[cold]
    #[inline(never)]
    pub(super) fn note(&mut self, action: HistoryAction, addr: u64, size: u64, stream: Stream) {
        let context = match action {
            HistoryAction::Alloc => self.observers.allocating_context,
            HistoryAction::FreeRequested | HistoryAction::FreeCompleted => self.context_of(addr),
            _ => 0,
        };
        let Some(history) = self.observers.history.as_mut() else { return };
        if history.entries.len() == history.max_entries {
            history.entries.pop_front();
        }
        let time_us = history.started_us + history.started.elapsed().as_micros() as u64;
        history.entries.push_back(HistoryEntry { action, addr, size, stream, time_us, context });
    }
}
