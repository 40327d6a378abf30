//! The host backend's fault injection: the test hooks (`HostBackend::faults`)
//! that fail the Nth allocate or release call, or every allocate call, as
//! out-of-memory or as a driver error, and refuse host memory. The allocate
//! hooks also hit `vm_map` and `vm_move` (both take memory), the release
//! hook `vm_unmap`.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use crate::backend::BackendError;

/// How an injected failure presents itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FaultKind {
    /// As if the device were full.
    OutOfMemory,
    /// As if the driver failed for another reason.
    DriverError,
}

/// Failure injection, shared by all devices of one backend.
/// Every field can be changed at any time from any thread.
#[derive(Debug, Default)]
pub struct Faults {
    /// Fail the allocate call this many calls from now (1 = the next); 0: off.
    pub(super) allocate_countdown: AtomicU64,
    /// Fail every allocate call.
    pub(super) allocate_always: AtomicBool,
    /// Fail the release call this many calls from now; 0: off.
    pub(super) release_countdown: AtomicU64,
    /// Injected failures are driver errors rather than out-of-memory.
    pub(super) as_driver_error: AtomicBool,
    /// Refuse host memory (`host_memory`).
    pub(super) host_memory_always: AtomicBool,
}

impl Faults {
    /// Fails the `n`th allocate call from now (`n >= 1`; 0 turns it off).
    pub fn fail_nth_allocate(&self, n: u64) {
        self.allocate_countdown.store(n, Ordering::SeqCst);
    }
    /// Fails every allocate call while `on`.
    pub fn fail_every_allocate(&self, on: bool) {
        self.allocate_always.store(on, Ordering::SeqCst);
    }
    /// Fails the `n`th release call from now (`n >= 1`; 0 turns it off).
    pub fn fail_nth_release(&self, n: u64) {
        self.release_countdown.store(n, Ordering::SeqCst);
    }
    /// What injected failures look like.
    pub fn set_kind(&self, kind: FaultKind) {
        self.as_driver_error.store(kind == FaultKind::DriverError, Ordering::SeqCst);
    }
    /// Refuses host memory (`host_memory`) while `on`.
    pub fn fail_host_memory(&self, on: bool) {
        self.host_memory_always.store(on, Ordering::SeqCst);
    }

    /// Counts one call down; true when this call must fail.
    pub(super) fn countdown_hits(counter: &AtomicU64) -> bool {
        counter
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| if n == 0 { None } else { Some(n - 1) })
            .map(|before| before == 1)
            .unwrap_or(false)
    }

    pub(super) fn injected(&self, call: &'static str) -> BackendError {
        if self.as_driver_error.load(Ordering::SeqCst) {
            BackendError::Driver { call, code: -1, message: "failure injected by a test".into() }
        } else {
            BackendError::OutOfMemory
        }
    }
}
