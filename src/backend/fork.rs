//! The process's fork count: an allocator remembers it when made, and a
//! fork child (whose copy of the parent's heaps may have been locked by
//! threads the child does not have) sees a different count and refuses to
//! touch them.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Once;

static AT_FORK: Once = Once::new();
/// Forks this process has gone through, as seen from the child side.
static FORK_GENERATION: AtomicU64 = AtomicU64::new(0);

extern "C" fn on_fork_child() {
    // Only an atomic add: a fork child may run nothing that locks.
    FORK_GENERATION.fetch_add(1, Ordering::AcqRel);
}

/// Starts counting forks (idempotent) and returns the count now.
pub fn watch_forks() -> u64 {
    AT_FORK.call_once(|| {
        // SAFETY: registers a fork handler that only performs an atomic add.
        unsafe { libc::pthread_atfork(None, None, Some(on_fork_child)) };
    });
    fork_generation()
}

/// The forks counted so far (0 in a process that was not forked since
/// `watch_forks` was first called).
#[inline]
pub fn fork_generation() -> u64 {
    FORK_GENERATION.load(Ordering::Relaxed)
}
