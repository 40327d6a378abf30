//! The boundary every export runs behind: a panic becomes a return value
//! and a last error (`boundary!`), never an unwind into C; the error codes,
//! and the one function from an error to its code (`failure`); this
//! thread's last error and how it is copied out.

use std::cell::RefCell;
use std::ffi::{c_char, c_int};
use std::sync::atomic::{AtomicBool, Ordering};

use crate::allocator::Allocator;
use crate::error::AllocError;
use crate::log::log_line;
use crate::process::global;

/// Success.
pub const TIDEPOOL_OK: c_int = 0;
/// A NULL pointer, or a `size` field smaller than version 1 of the struct.
pub const TIDEPOOL_ERR_INVALID_ARGUMENT: c_int = 1;
/// No such device.
pub const TIDEPOOL_ERR_INVALID_DEVICE: c_int = 2;
/// The allocator could not be created, or an internal error (see the last error).
pub const TIDEPOOL_ERR_INTERNAL: c_int = 3;
/// A file could not be written.
pub const TIDEPOOL_ERR_IO: c_int = 4;
/// A tag in the wrong state (unknown, paused, not paused), or a pause
/// refused now (a private pool is open); nothing changed.
pub const TIDEPOOL_ERR_TAG_STATE: c_int = 5;
/// Device or host memory could not be had (a resume, an offload); nothing changed.
pub const TIDEPOOL_ERR_OUT_OF_MEMORY: c_int = 6;
/// A free of a pointer that is not a live allocation (never allocated,
/// freed twice, inside a block); refused and counted, nothing changed.
pub const TIDEPOOL_ERR_INVALID_FREE: c_int = 7;

thread_local! {
    pub(super) static LAST_ERROR: RefCell<String> = const { RefCell::new(String::new()) };
}

/// Sets this thread's last error. Once the thread's locals are gone (a
/// call from another library's thread-exit destructor) there is none to
/// set, and nothing panics.
pub(super) fn set_last_error(message: impl Into<String>) {
    let message = message.into();
    let _ = LAST_ERROR.try_with(|e| *e.borrow_mut() = message);
}

/// Runs an export's body; a panic becomes `$on_panic` and a last error.
macro_rules! boundary {
    ($on_panic:expr, $body:expr) => {
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| $body)) {
            Ok(value) => value,
            Err(payload) => {
                let what = payload
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| payload.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "unknown panic".into());
                $crate::ffi::boundary::set_last_error(format!("tidepool: internal error: {what}"));
                $on_panic
            }
        }
    };
}

pub(super) use boundary;

/// An export's failure: the code it returns and the last error it sets.
pub(super) type Failure = (c_int, String);

/// Turns an export body's result into its return code, setting the last error.
pub(super) fn return_code(result: Result<(), Failure>) -> c_int {
    match result {
        Ok(()) => TIDEPOOL_OK,
        Err((code, message)) => {
            set_last_error(message);
            code
        }
    }
}

/// The code and message of an export that failed with `err`: the one
/// mapping from tidepool's errors to the codes of ffi/tidepool.h.
pub(super) fn failure(err: AllocError) -> Failure {
    let code = match &err {
        AllocError::InvalidArgument(_) => TIDEPOOL_ERR_INVALID_ARGUMENT,
        AllocError::InvalidDevice { .. } => TIDEPOOL_ERR_INVALID_DEVICE,
        AllocError::Tag(_) => TIDEPOOL_ERR_TAG_STATE,
        AllocError::OutOfMemory(_) | AllocError::HostOutOfMemory { .. } => TIDEPOOL_ERR_OUT_OF_MEMORY,
        AllocError::InvalidFree { .. } | AllocError::UnknownPointer { .. } => TIDEPOOL_ERR_INVALID_FREE,
        _ => TIDEPOOL_ERR_INTERNAL,
    };
    (code, err.to_string())
}

/// The process-wide allocator, or the failure of an export that needs it:
/// one that cannot be made (a backend that cannot start) is an internal error.
pub(super) fn allocator_or_internal() -> Result<&'static Allocator, Failure> {
    global().map_err(|err| (TIDEPOOL_ERR_INTERNAL, err.to_string()))
}

pub(super) fn device_index(device: c_int) -> Result<usize, AllocError> {
    usize::try_from(device)
        .map_err(|_| AllocError::InvalidDevice { device: device as i64, device_count: global().map_or(0, |a| a.device_count()) })
}

/// Logs `message` to stderr the first time `flag` is seen unset.
pub(super) fn log_once(flag: &AtomicBool, message: &str) {
    if !flag.swap(true, Ordering::Relaxed) {
        log_line(format_args!("{message} (further ones are only counted)"));
    }
}

/// Copies this thread's last error message into `buf` (NUL-terminated,
/// cut to `len - 1` bytes) and returns its full length; with a NULL `buf`
/// or `len` 0, only the length. 0: no error yet.
#[no_mangle]
pub extern "C" fn tidepool_last_error(buf: *mut c_char, len: usize) -> usize {
    boundary!(0, LAST_ERROR.try_with(|e| copy_out(&e.borrow(), buf, len)).unwrap_or(0))
}

/// Copies `message` into `buf` as the functions that fill a caller's
/// buffer do (NUL-terminated, cut to `len - 1` bytes; nothing with a NULL
/// `buf` or `len` 0) and returns its full length.
pub(super) fn copy_out(message: &str, buf: *mut c_char, len: usize) -> usize {
    if !buf.is_null() && len > 0 {
        let n = message.len().min(len - 1);
        // SAFETY: `buf` is non-null with room for `len` bytes per the
        // contract; we write n + 1 <= len bytes and do not overlap `message`.
        unsafe {
            std::ptr::copy_nonoverlapping(message.as_ptr(), buf as *mut u8, n);
            *buf.add(n) = 0;
        }
    }
    message.len()
}
