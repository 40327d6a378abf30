//! Allocation through the C ABI: malloc and free (with an allocation
//! context), the hooks PyTorch calls (init, empty_cache, memory fraction,
//! record_stream, private pools, base allocation), and the check of a
//! configuration string.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::ptr::null_mut;
use std::sync::atomic::AtomicBool;

use super::boundary::{
    allocator_or_internal, boundary, copy_out, device_index, failure, log_once, return_code, set_last_error, Failure,
    TIDEPOOL_ERR_INTERNAL, TIDEPOOL_ERR_INVALID_ARGUMENT, TIDEPOOL_OK,
};
use super::oom::after_oom;
use super::types::tidepool_frame;
use crate::allocator::Allocator;
use crate::config::Config;
use crate::error::AllocError;
use crate::frames::Frame;
use crate::heap::private::PrivatePoolId;
use crate::log::log_line;
use crate::process::global;
use crate::types::{DevicePtr, Stream};

static LOGGED_INVALID_FREE: AtomicBool = AtomicBool::new(false);
static LOGGED_SIZE_MISMATCH: AtomicBool = AtomicBool::new(false);

/// `size` bytes on `device` for `stream`; NULL when out of memory (after
/// releasing the cache and retrying; the report goes to stderr, the OOM
/// observers are called) or on bad input (see `tidepool_last_error`).
/// 0 bytes give NULL without error.
#[no_mangle]
pub extern "C" fn tidepool_malloc(size: usize, device: c_int, stream: *mut c_void) -> *mut c_void {
    boundary!(null_mut(), malloc(size, device, stream, 0))
}

/// `tidepool_malloc`, remembering `context` (0: none) for the block and
/// for its `alloc` event in the history (see `tidepool_register_context`).
#[no_mangle]
pub extern "C" fn tidepool_malloc_with_context(size: usize, device: c_int, stream: *mut c_void, context: u64) -> *mut c_void {
    boundary!(null_mut(), malloc(size, device, stream, context))
}

#[inline(always)]
fn malloc(size: usize, device: c_int, stream: *mut c_void, context: u64) -> *mut c_void {
    let result = global().and_then(|a| {
        let (device, stream) = (device_index(device)?, Stream(stream as u64));
        if context == 0 {
            a.allocate(device, size, stream)
        } else {
            a.allocate_with_context(device, size, stream, context)
        }
    });
    match result {
        Ok(ptr) => ptr.0 as *mut c_void,
        Err(err) => {
            malloc_failed(err);
            null_mut()
        }
    }
}

/// Sets the last error of a failed malloc; after an out-of-memory, also
/// prints the report and runs what follows one (`after_oom`).
#[cold]
fn malloc_failed(err: AllocError) {
    set_last_error(err.to_string());
    if let (AllocError::OutOfMemory(report), Ok(allocator)) = (&err, global()) {
        log_line(&err);
        after_oom(allocator, report);
    }
}

/// Registers the frames (innermost first) of the context `context`
/// (non-zero), replacing any registered before; the strings are copied.
/// Returns TIDEPOOL_OK, TIDEPOOL_ERR_INVALID_ARGUMENT (context 0, NULL
/// `frames` with `count` > 0, a string NULL or not UTF-8) or TIDEPOOL_ERR_INTERNAL.
#[no_mangle]
pub extern "C" fn tidepool_register_context(context: u64, frames: *const tidepool_frame, count: usize) -> c_int {
    boundary!(TIDEPOOL_ERR_INTERNAL, return_code(register_context(context, frames, count)))
}

fn register_context(context: u64, frames: *const tidepool_frame, count: usize) -> Result<(), Failure> {
    const WHO: &str = "tidepool: tidepool_register_context";
    let invalid = |what: String| (TIDEPOOL_ERR_INVALID_ARGUMENT, format!("{WHO}: {what}"));
    if context == 0 {
        return Err(invalid("context 0 means none".into()));
    }
    let frames: &[tidepool_frame] = if count == 0 {
        &[]
    } else if frames.is_null() {
        return Err(invalid(format!("frames is NULL with count {count}")));
    } else if count > isize::MAX as usize / std::mem::size_of::<tidepool_frame>() {
        return Err(invalid(format!("count {count} is too large")));
    } else {
        // SAFETY: `frames` is non-null and, per the contract, points to
        // `count` initialized frames, a size that fits in isize.
        unsafe { std::slice::from_raw_parts(frames, count) }
    };
    let text = |ptr: *const c_char, index: usize, field: &str| -> Result<String, Failure> {
        if ptr.is_null() {
            return Err(invalid(format!("frame {index}: {field} is NULL")));
        }
        // SAFETY: `ptr` is non-null and, per the contract, a NUL-terminated string.
        let text = unsafe { CStr::from_ptr(ptr) }.to_str();
        text.map(str::to_owned).map_err(|_| invalid(format!("frame {index}: {field} is not UTF-8")))
    };
    let frames = frames
        .iter()
        .enumerate()
        .map(|(i, f)| Ok(Frame { filename: text(f.filename, i, "filename")?, name: text(f.name, i, "name")?, line: f.line }))
        .collect::<Result<Vec<_>, Failure>>()?;
    let allocator = allocator_or_internal()?;
    allocator.register_context(context, frames).map_err(failure)
}

/// Frees `ptr` (NULL: nothing). A pointer tidepool does not hold is
/// refused and counted; a `size` that differs from the allocation's is
/// counted and the recorded size used.
#[no_mangle]
pub extern "C" fn tidepool_free(ptr: *mut c_void, size: usize, device: c_int, stream: *mut c_void) {
    boundary!((), {
        if ptr.is_null() {
            return;
        }
        let result = global().and_then(|a| a.free_sized(device_index(device)?, DevicePtr(ptr as u64), size, Stream(stream as u64)));
        match result {
            Ok(recorded) if recorded != size as u64 => {
                log_once(&LOGGED_SIZE_MISMATCH, &format!("tidepool: warning: free of {ptr:p} with size {size}, allocated with {recorded}"))
            }
            Ok(_) => {}
            Err(err) => {
                log_once(&LOGGED_INVALID_FREE, &format!("{err}"));
                set_last_error(err.to_string());
            }
        }
    })
}

/// Frees `ptr` without its size, device or stream (NULL: nothing, and
/// TIDEPOOL_OK): the device is the one whose memory holds it, the stream
/// the block's own. Returns TIDEPOOL_OK, TIDEPOOL_ERR_INVALID_FREE (a
/// pointer tidepool does not hold, freed twice or inside a block: refused,
/// counted in `num_invalid_frees`, the reason the last error) or
/// TIDEPOOL_ERR_INTERNAL (no allocator).
#[no_mangle]
pub extern "C" fn tidepool_free_ptr(ptr: *mut c_void) -> c_int {
    boundary!(TIDEPOOL_ERR_INTERNAL, {
        if ptr.is_null() {
            return TIDEPOOL_OK;
        }
        match global().and_then(|a| a.free_ptr(DevicePtr(ptr as u64))) {
            Ok(()) => TIDEPOOL_OK,
            Err(err) => free_ptr_failed(err),
        }
    })
}

/// Logs a refused `tidepool_free_ptr` once (as `tidepool_free` does) and
/// sets the last error; returns the code.
#[cold]
fn free_ptr_failed(err: AllocError) -> c_int {
    log_once(&LOGGED_INVALID_FREE, &format!("{err}"));
    return_code(Err(failure(err)))
}

/// PyTorch's init hook: creates the allocator now rather than at the
/// first allocation. Warns when PyTorch sees more devices than tidepool.
#[no_mangle]
pub extern "C" fn tidepool_init(device_count: c_int) {
    boundary!((), {
        match global() {
            Ok(a) if device_count > a.device_count() as c_int => log_line(format_args!(
                "tidepool: warning: {device_count} devices visible but the {} backend has {}",
                a.backend().name(),
                a.device_count()
            )),
            Ok(_) => {}
            Err(err) => {
                log_line(&err);
                set_last_error(err.to_string());
            }
        }
    })
}

/// Releases every whole free segment to the driver (`torch.cuda.empty_cache`).
#[no_mangle]
pub extern "C" fn tidepool_empty_cache() {
    boundary!((), {
        match global() {
            Ok(a) => {
                a.empty_cache();
            }
            Err(err) => set_last_error(err.to_string()),
        }
    })
}

/// Caps what `device` may reserve at `fraction` of its memory; a bad
/// fraction or device changes nothing and sets the last error.
#[no_mangle]
pub extern "C" fn tidepool_set_memory_fraction(fraction: f64, device: c_int) {
    boundary!((), {
        if let Err(err) = global().and_then(|a| a.set_memory_fraction(device_index(device)?, fraction)) {
            set_last_error(err.to_string());
        }
    })
}

/// Notes that the live allocation `ptr` is used on `stream` too.
#[no_mangle]
pub extern "C" fn tidepool_record_stream(ptr: *mut c_void, stream: *mut c_void) {
    boundary!((), {
        if let Err(err) = global().and_then(|a| a.record_stream(DevicePtr(ptr as u64), Stream(stream as u64))) {
            set_last_error(err.to_string());
        }
    })
}

/// Routes every allocation on `device` to the private pool (id0, id1)
/// until `tidepool_end_allocate_to_pool` (PyTorch's
/// `set_begin_allocate_to_pool` hook: CUDA graph capture, `use_mem_pool`).
/// `filter` (a C++ `std::function` of PyTorch's) is not used: every
/// allocation on the device goes to the pool, which is safe.
#[no_mangle]
pub extern "C" fn tidepool_begin_allocate_to_pool(device: c_int, id0: u64, id1: u64, _filter: *mut c_void) {
    boundary!((), private_pool_call(device, id0, id1, Allocator::begin_private))
}

/// Stops routing allocations on `device` to the private pool (id0, id1).
#[no_mangle]
pub extern "C" fn tidepool_end_allocate_to_pool(device: c_int, id0: u64, id1: u64) {
    boundary!((), private_pool_call(device, id0, id1, Allocator::end_private))
}

/// Drops a use of the private pool (id0, id1) on `device` (a graph or a
/// `MemPool` went); its memory is kept while any private pool is in use.
#[no_mangle]
pub extern "C" fn tidepool_release_pool(device: c_int, id0: u64, id1: u64) {
    boundary!((), private_pool_call(device, id0, id1, Allocator::release_private))
}

/// One of the private-pool hooks; a refusal becomes the last error.
fn private_pool_call(device: c_int, id0: u64, id1: u64, call: fn(&Allocator, usize, PrivatePoolId) -> Result<(), AllocError>) {
    if let Err(err) = device_index(device).and_then(|d| call(global()?, d, PrivatePoolId(id0, id1))) {
        set_last_error(err.to_string());
    }
}

/// The base of the segment holding `ptr`, with its size in `*size`; NULL
/// (and `*size` untouched) when no segment holds it or `size` is NULL.
#[no_mangle]
pub extern "C" fn tidepool_base_alloc(ptr: *mut c_void, size: *mut usize) -> *mut c_void {
    boundary!(null_mut(), {
        if size.is_null() {
            set_last_error("tidepool: tidepool_base_alloc: size is NULL");
            return null_mut();
        }
        match global().map(|a| a.find_segment(DevicePtr(ptr as u64))) {
            Ok(Some((_, base, bytes))) => {
                // SAFETY: `size` is non-null and, per the contract, points to a writable size_t.
                unsafe { *size = bytes as usize };
                base.0 as *mut c_void
            }
            Ok(None) => {
                set_last_error(format!("tidepool: {ptr:p} is not in any tidepool segment"));
                null_mut()
            }
            Err(err) => {
                set_last_error(err.to_string());
                null_mut()
            }
        }
    })
}

/// Checks a TIDEPOOL_CONF string without starting anything: writes what is
/// wrong with it into `buf` as `tidepool_last_error` does (one problem a
/// line, as the warnings TIDEPOOL_CONF would print say them: an entry that
/// is not UTF-8 is one) and returns how many problems there are (0: none);
/// -1 when `conf` is NULL.
#[no_mangle]
pub extern "C" fn tidepool_check_conf(conf: *const c_char, buf: *mut c_char, len: usize) -> c_int {
    boundary!(-1, {
        if conf.is_null() {
            return -1;
        }
        // SAFETY: `conf` is non-null and, per the contract, a NUL-terminated string.
        let text = unsafe { CStr::from_ptr(conf) }.to_bytes();
        let (_, problems) = Config::parse_bytes(text);
        copy_out(&problems.join("\n"), buf, len);
        problems.len().min(c_int::MAX as usize) as c_int
    })
}
