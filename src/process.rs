//! The process-wide allocator: the one the C ABI (and so PyTorch, through
//! `CUDAPluggableAllocator`) uses and Rust callers reach with `global()`,
//! made from `TIDEPOOL_CONF` on first use and never freed. A fork child
//! gets a fresh one (a fork handler forgets the parent's); at exit the
//! trace being recorded is written out.
//!
//! Unsafe code here, as in the backends and the C ABI: the fork and exit
//! handlers are registered with libc, and the allocator is published as a
//! pointer a fork handler can reset with one atomic store.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr::null_mut;
use std::sync::atomic::{AtomicPtr, Ordering};
use std::sync::Once;

use crate::allocator::Allocator;
use crate::config::Config;
use crate::error::AllocError;
use crate::log::log_line;

static ALLOCATOR: AtomicPtr<Allocator> = AtomicPtr::new(null_mut());
static AT_FORK: Once = Once::new();
static AT_EXIT: Once = Once::new();

extern "C" fn on_fork_child() {
    // Only an atomic store: a fork child may run nothing that locks. The
    // child makes its own allocator on first use.
    ALLOCATOR.store(null_mut(), Ordering::Release);
}

extern "C" fn finish_trace_at_exit() {
    let current = ALLOCATOR.load(Ordering::Acquire);
    if !current.is_null() {
        // SAFETY: a published allocator is never freed (see `allocator`).
        if let Ok(Err(err)) = catch_unwind(AssertUnwindSafe(|| unsafe { &*current }.finish_trace())) {
            log_line(format_args!("tidepool: warning: TIDEPOOL_TRACE: writing the trace failed: {err}"));
        }
    }
}

/// The process-wide configuration; a fork child records to `<path>.<pid>`
/// rather than over its parent's trace.
fn process_config() -> Config {
    let mut config = Config::from_env();
    if crate::fork::fork_generation() > 0 {
        if let Some(path) = config.trace_path.as_mut() {
            path.as_mut_os_string().push(format!(".{}", std::process::id()));
        }
    }
    config
}

/// The process-wide allocator: the one the C ABI (and so PyTorch, through
/// `CUDAPluggableAllocator`) uses, made from `TIDEPOOL_CONF` by whichever
/// of the Rust API and the C ABI asks first, and never freed. Rust code
/// that allocates from it shares the cache, the statistics and the
/// registry slot of the C callers in the process: one cache per process.
///
/// Errors: the allocator could not be made (`TIDEPOOL_CONF` names a
/// backend that cannot start); the next call tries again. In a fork child
/// it is a fresh allocator, not the parent's (the parent's refuses every
/// call with `AllocError::Forked`, buffers of it included).
///
/// One copy of tidepool per process: the statics live in the library
/// that holds this code, so a Rust extension shares the cache with the C
/// ABI that library exports (point `TIDEPOOL_LIBRARY` or
/// `CUDAPluggableAllocator` at it), not with a second copy loaded apart.
pub fn global() -> Result<&'static Allocator, AllocError> {
    let current = ALLOCATOR.load(Ordering::Acquire);
    if !current.is_null() {
        // SAFETY: a non-null ALLOCATOR always points to a leaked Box that is
        // never freed, so the reference is valid for the whole process.
        return Ok(unsafe { &*current });
    }
    crate::fork::watch_forks();
    AT_FORK.call_once(|| {
        // SAFETY: registers a fork handler that only performs an atomic store.
        unsafe { libc::pthread_atfork(None, None, Some(on_fork_child)) };
    });
    AT_EXIT.call_once(|| {
        // SAFETY: registers an exit handler that catches any panic.
        unsafe { libc::atexit(finish_trace_at_exit) };
    });
    let fresh = Box::into_raw(Box::new(Allocator::new(process_config())?));
    match ALLOCATOR.compare_exchange(null_mut(), fresh, Ordering::AcqRel, Ordering::Acquire) {
        // SAFETY: `fresh` was just leaked from a Box and is now published for good.
        Ok(_) => Ok(unsafe { &*fresh }),
        Err(winner) => {
            // SAFETY: `fresh` lost the race, was never shared, and is freed
            // once; `winner` is a published allocator, valid forever.
            unsafe {
                drop(Box::from_raw(fresh));
                Ok(&*winner)
            }
        }
    }
}
