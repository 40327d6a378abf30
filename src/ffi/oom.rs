//! What follows an out-of-memory of `tidepool_malloc` (the observers, the
//! first one's snapshot), and the snapshots and history a caller asks for.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::panic::catch_unwind;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};

use super::boundary::{
    allocator_or_internal, boundary, return_code, set_last_error, Failure, LAST_ERROR, TIDEPOOL_ERR_INTERNAL,
    TIDEPOOL_ERR_INVALID_ARGUMENT, TIDEPOOL_ERR_IO, TIDEPOOL_OK,
};
use super::types::tidepool_oom_observer;
use crate::allocator::Allocator;
use crate::error::OomReport;
use crate::fork::ProcessLock;
use crate::log::log_line;
use crate::process::global;

/// The most OOM observers a process may attach.
const MAX_OOM_OBSERVERS: usize = 64;

/// The process's OOM observers with their `user` pointers, in attach order.
type Observer = (unsafe extern "C" fn(c_int, usize, usize, usize, *mut c_void), usize);
static OOM_OBSERVERS: ProcessLock<Vec<Observer>> = ProcessLock::new(Vec::new());

/// Set once the `oom_snapshot` was tried: only the first out-of-memory writes it.
static OOM_SNAPSHOT_TRIED: AtomicBool = AtomicBool::new(false);

/// What follows an out-of-memory of malloc, on the failing thread with no
/// tidepool lock held: each observer in attach order, then, at the
/// process's first one, the `oom_snapshot`. The last error (the report)
/// is what it was before, whatever they did.
pub(super) fn after_oom(allocator: &Allocator, report: &OomReport) {
    let saved = LAST_ERROR.try_with(|e| e.borrow().clone()).unwrap_or_default();
    // A copy: an observer may attach another (it is called from the next OOM on).
    let observers = OOM_OBSERVERS.lock().clone();
    if !observers.is_empty() {
        let stats = allocator.stats(report.device);
        let allocated = stats.map_or(report.allocated, |s| s.allocated_bytes.all.current) as usize;
        let (device, requested, free) = (report.device as c_int, report.requested as usize, report.device_free.unwrap_or(0) as usize);
        for (observer, user) in observers {
            // SAFETY: `observer` is a non-null function pointer attached by the
            // caller, who vouches for its signature and for `user`.
            let _ = catch_unwind(|| unsafe { observer(device, requested, allocated, free, user as *mut c_void) });
        }
    }
    if let Some(path) = &allocator.config().oom_snapshot {
        if !OOM_SNAPSHOT_TRIED.swap(true, Ordering::AcqRel) {
            if let Err(err) = crate::snapshot::write_snapshot(allocator, path) {
                log_line(format_args!("tidepool: warning: oom_snapshot: cannot write {}: {err}", path.display()));
            }
        }
    }
    set_last_error(saved);
}

/// Calls `observer(device, requested, device_allocated, device_free, user)`
/// at each out-of-memory of `tidepool_malloc`, after the observers attached
/// before it. Returns TIDEPOOL_OK, or TIDEPOOL_ERR_INVALID_ARGUMENT (NULL
/// observer, or 64 observers already attached).
#[no_mangle]
pub extern "C" fn tidepool_attach_oom_observer(observer: tidepool_oom_observer, user: *mut c_void) -> c_int {
    boundary!(TIDEPOOL_ERR_INTERNAL, return_code(attach_oom_observer(observer, user)))
}

fn attach_oom_observer(observer: tidepool_oom_observer, user: *mut c_void) -> Result<(), Failure> {
    const WHO: &str = "tidepool: tidepool_attach_oom_observer";
    let Some(observer) = observer else {
        return Err((TIDEPOOL_ERR_INVALID_ARGUMENT, format!("{WHO}: observer is NULL")));
    };
    let mut observers = OOM_OBSERVERS.lock();
    if observers.len() >= MAX_OOM_OBSERVERS {
        return Err((TIDEPOOL_ERR_INVALID_ARGUMENT, format!("{WHO}: {MAX_OOM_OBSERVERS} observers already attached")));
    }
    observers.push((observer, user as usize));
    Ok(())
}

/// Keeps the last `max_entries` allocation and segment events of every
/// device for snapshots' `device_traces` (0: stops and forgets them).
#[no_mangle]
pub extern "C" fn tidepool_record_history(max_entries: usize) -> c_int {
    boundary!(TIDEPOOL_ERR_INTERNAL, {
        match global().and_then(|a| a.record_history(Some(max_entries))) {
            Ok(()) => TIDEPOOL_OK,
            Err(err) => {
                set_last_error(err.to_string());
                TIDEPOOL_ERR_INTERNAL
            }
        }
    })
}

/// Writes a PyTorch-schema memory snapshot (a pickle) of every device to
/// `path`. Returns TIDEPOOL_OK, TIDEPOOL_ERR_INVALID_ARGUMENT (NULL or
/// non-UTF-8 path), TIDEPOOL_ERR_IO or TIDEPOOL_ERR_INTERNAL.
#[no_mangle]
pub extern "C" fn tidepool_dump_snapshot(path: *const c_char) -> c_int {
    boundary!(TIDEPOOL_ERR_INTERNAL, return_code(dump_snapshot(path)))
}

fn dump_snapshot(path: *const c_char) -> Result<(), Failure> {
    const WHO: &str = "tidepool: tidepool_dump_snapshot";
    if path.is_null() {
        return Err((TIDEPOOL_ERR_INVALID_ARGUMENT, format!("{WHO}: path is NULL")));
    }
    // SAFETY: `path` is non-null and, per the contract, a NUL-terminated string.
    let Ok(path) = unsafe { CStr::from_ptr(path) }.to_str() else {
        return Err((TIDEPOOL_ERR_INVALID_ARGUMENT, format!("{WHO}: path is not UTF-8")));
    };
    let allocator = allocator_or_internal()?;
    crate::snapshot::write_snapshot(allocator, Path::new(path))
        .map_err(|err| (TIDEPOOL_ERR_IO, format!("tidepool: cannot write snapshot {path}: {err}")))
}
