//! The C ABI: the exports PyTorch's `CUDAPluggableAllocator` loads, plus
//! statistics, snapshots, allocation contexts, out-of-memory observers and
//! the last error. `ffi/tidepool.h` declares them
//! (a test checks the header against this file).
//!
//! Every export runs inside `boundary!`: a panic becomes NULL or an error
//! code and a last-error message, never an unwind into C. The process-wide
//! allocator is made on first use from `TIDEPOOL_CONF`. After `fork` the
//! child starts a fresh allocator (the parent's heaps belong to the parent;
//! a CUDA context does not survive fork either).

// The exports take C pointers whose contracts ffi/tidepool.h states; they
// are called from C, where an `unsafe fn` marker would mean nothing.
#![allow(clippy::not_unsafe_ptr_arg_deref)]

use std::cell::RefCell;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;
use std::ptr::null_mut;
use std::sync::atomic::{AtomicBool, AtomicPtr, Ordering};
use std::sync::Once;

use parking_lot::Mutex;

use crate::config::Config;
use crate::log::log_line;
use crate::reclaim::policy::Reason;
use crate::stats::{for_each_counter, Events, Stat, StatByPool, Stats};
use crate::{AllocError, Allocator, DevicePtr, Frame, OomReport, PrivatePoolId, Stream};

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

/// `tidepool_pause` flag: keep the contents of live blocks in host memory.
pub const TIDEPOOL_PAUSE_OFFLOAD: c_int = 1;

/// Version of `tidepool_stats` this library fills.
pub const TIDEPOOL_STATS_VERSION: u32 = 5;
/// Version of `tidepool_tag_stats` this library fills.
pub const TIDEPOOL_TAG_STATS_VERSION: u32 = 1;

/// One gauge (`torch.cuda.memory_stats` fields).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct tidepool_stat {
    pub current: u64,
    pub peak: u64,
    pub allocated: u64,
    pub freed: u64,
}

/// A gauge for all pools and each pool kind.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct tidepool_stat_by_pool {
    pub all: tidepool_stat,
    pub small_pool: tidepool_stat,
    pub large_pool: tidepool_stat,
}

/// Statistics of one device. The caller sets `size` to
/// `sizeof(tidepool_stats)`; the library fills that many bytes at most,
/// writes its `version`, and sets `size` to the bytes it filled. Later
/// versions only append fields.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct tidepool_stats {
    pub size: u32,
    pub version: u32,
    pub allocated_bytes: u64,
    pub peak_allocated_bytes: u64,
    pub requested_bytes: u64,
    pub peak_requested_bytes: u64,
    pub reserved_bytes: u64,
    pub peak_reserved_bytes: u64,
    pub active_bytes: u64,
    pub peak_active_bytes: u64,
    pub inactive_split_bytes: u64,
    pub peak_inactive_split_bytes: u64,
    pub largest_free_block_bytes: u64,
    pub cached_free_bytes: u64,
    pub num_allocs: u64,
    pub num_frees: u64,
    pub num_device_allocs: u64,
    pub num_device_frees: u64,
    pub num_alloc_retries: u64,
    pub num_ooms: u64,
    pub num_invalid_frees: u64,
    pub num_size_mismatches: u64,
    pub reserved_limit_bytes: u64,
    pub gauges: [tidepool_stat_by_pool; 9],
    pub released_idle_decay_bytes: u64,
    pub released_budget_bytes: u64,
    pub released_headroom_bytes: u64,
    pub released_out_of_memory_bytes: u64,
    pub released_empty_cache_bytes: u64,
    pub num_reclaims: u64,
    pub released_cooperation_bytes: u64,
    pub num_coop_requests: u64,
    pub num_coop_satisfied: u64,
    pub num_coop_served: u64,
    /// Version 3: pages of expandable segments mapped and unmapped.
    pub num_pages_mapped: u64,
    pub num_pages_unmapped: u64,
    /// Version 4: device memory given back by paused tags, and host memory
    /// holding their contents.
    pub paused_bytes: u64,
    pub offloaded_bytes: u64,
    /// Version 5: the last cooperation wait, failed stream synchronizations
    /// at free, blocks reused across streams (every counter of
    /// `Events::COUNTERS` is now here).
    pub coop_last_wait_ms: u64,
    pub num_stream_sync_errors: u64,
    pub num_cross_stream_reuses: u64,
}

/// What one tag holds on a device (`tidepool_get_tag_stats`); versioned as
/// `tidepool_stats`: `size` first, set by the caller.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct tidepool_tag_stats {
    pub size: u32,
    pub version: u32,
    pub allocated_bytes: u64,
    pub reserved_bytes: u64,
    pub paused_bytes: u64,
    pub offloaded_bytes: u64,
    pub num_allocations: u64,
    pub paused: u64,
}

/// One stack frame of an allocation context (`tidepool_register_context`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct tidepool_frame {
    pub filename: *const c_char,
    pub name: *const c_char,
    pub line: i64,
}

/// Called at an out-of-memory of `tidepool_malloc` (`tidepool_attach_oom_observer`).
pub type tidepool_oom_observer =
    Option<unsafe extern "C" fn(device: c_int, requested: usize, device_allocated: usize, device_free: usize, user: *mut c_void)>;

thread_local! {
    static LAST_ERROR: RefCell<String> = const { RefCell::new(String::new()) };
}

/// Sets this thread's last error. Once the thread's locals are gone (a
/// call from another library's thread-exit destructor) there is none to
/// set, and nothing panics.
fn set_last_error(message: impl Into<String>) {
    let message = message.into();
    let _ = LAST_ERROR.try_with(|e| *e.borrow_mut() = message);
}

/// Runs an export's body; a panic becomes `$on_panic` and a last error.
macro_rules! boundary {
    ($on_panic:expr, $body:expr) => {
        match catch_unwind(AssertUnwindSafe(|| $body)) {
            Ok(value) => value,
            Err(payload) => {
                let what = payload
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| payload.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "unknown panic".into());
                set_last_error(format!("tidepool: internal error: {what}"));
                $on_panic
            }
        }
    };
}

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
fn process_config() -> crate::Config {
    let mut config = crate::Config::from_env();
    if crate::backend::fork::fork_generation() > 0 {
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
    allocator()
}

/// The process-wide allocator, made on first use.
fn allocator() -> Result<&'static Allocator, AllocError> {
    let current = ALLOCATOR.load(Ordering::Acquire);
    if !current.is_null() {
        // SAFETY: a non-null ALLOCATOR always points to a leaked Box that is
        // never freed, so the reference is valid for the whole process.
        return Ok(unsafe { &*current });
    }
    crate::backend::fork::watch_forks();
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

fn device_index(device: c_int) -> Result<usize, AllocError> {
    usize::try_from(device)
        .map_err(|_| AllocError::InvalidDevice { device: device as i64, device_count: allocator().map_or(0, |a| a.device_count()) })
}

/// Logs `message` to stderr the first time `flag` is seen unset.
fn log_once(flag: &AtomicBool, message: &str) {
    if !flag.swap(true, Ordering::Relaxed) {
        log_line(format_args!("{message} (further ones are only counted)"));
    }
}

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
    let result = allocator().and_then(|a| {
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
    if let (AllocError::OutOfMemory(report), Ok(allocator)) = (&err, allocator()) {
        log_line(&err);
        after_oom(allocator, report);
    }
}

/// The most OOM observers a process may attach.
const MAX_OOM_OBSERVERS: usize = 64;

/// The process's OOM observers with their `user` pointers, in attach order.
type Observer = (unsafe extern "C" fn(c_int, usize, usize, usize, *mut c_void), usize);
static OOM_OBSERVERS: Mutex<Vec<Observer>> = Mutex::new(Vec::new());

/// Set once the `oom_snapshot` was tried: only the first out-of-memory writes it.
static OOM_SNAPSHOT_TRIED: AtomicBool = AtomicBool::new(false);

/// What follows an out-of-memory of malloc, on the failing thread with no
/// tidepool lock held: each observer in attach order, then, at the
/// process's first one, the `oom_snapshot`. The last error (the report)
/// is what it was before, whatever they did.
fn after_oom(allocator: &Allocator, report: &OomReport) {
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
    allocator.register_context(context, frames).map_err(|err| (TIDEPOOL_ERR_INVALID_ARGUMENT, err.to_string()))
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
        let result = allocator().and_then(|a| a.free_sized(device_index(device)?, DevicePtr(ptr as u64), size, Stream(stream as u64)));
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

/// PyTorch's init hook: creates the allocator now rather than at the
/// first allocation. Warns when PyTorch sees more devices than tidepool.
#[no_mangle]
pub extern "C" fn tidepool_init(device_count: c_int) {
    boundary!((), {
        match allocator() {
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
        match allocator() {
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
        if let Err(err) = allocator().and_then(|a| a.set_memory_fraction(device_index(device)?, fraction)) {
            set_last_error(err.to_string());
        }
    })
}

/// Notes that the live allocation `ptr` is used on `stream` too.
#[no_mangle]
pub extern "C" fn tidepool_record_stream(ptr: *mut c_void, stream: *mut c_void) {
    boundary!((), {
        if let Err(err) = allocator().and_then(|a| a.record_stream(DevicePtr(ptr as u64), Stream(stream as u64))) {
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
    if let Err(err) = device_index(device).and_then(|d| call(allocator()?, d, PrivatePoolId(id0, id1))) {
        set_last_error(err.to_string());
    }
}

/// Keeps the last `max_entries` allocation and segment events of every
/// device for snapshots' `device_traces` (0: stops and forgets them).
#[no_mangle]
pub extern "C" fn tidepool_record_history(max_entries: usize) -> c_int {
    boundary!(TIDEPOOL_ERR_INTERNAL, {
        match allocator().and_then(|a| a.record_history(Some(max_entries))) {
            Ok(()) => TIDEPOOL_OK,
            Err(err) => {
                set_last_error(err.to_string());
                TIDEPOOL_ERR_INTERNAL
            }
        }
    })
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
        match allocator().map(|a| a.find_segment(DevicePtr(ptr as u64))) {
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

fn c_stat(stat: &Stat) -> tidepool_stat {
    tidepool_stat { current: stat.current, peak: stat.peak, allocated: stat.allocated, freed: stat.freed }
}

fn c_gauge(gauge: &StatByPool) -> tidepool_stat_by_pool {
    tidepool_stat_by_pool { all: c_stat(&gauge.all), small_pool: c_stat(&gauge.small_pool), large_pool: c_stat(&gauge.large_pool) }
}

fn c_stats(s: &Stats, reserved_limit: Option<u64>) -> tidepool_stats {
    let mut gauges = [tidepool_stat_by_pool::default(); 9];
    for (slot, (_, gauge)) in gauges.iter_mut().zip(s.gauges()) {
        *slot = c_gauge(gauge);
    }
    tidepool_stats {
        size: std::mem::size_of::<tidepool_stats>() as u32,
        version: TIDEPOOL_STATS_VERSION,
        allocated_bytes: s.allocated_bytes.all.current,
        peak_allocated_bytes: s.allocated_bytes.all.peak,
        requested_bytes: s.requested_bytes.all.current,
        peak_requested_bytes: s.requested_bytes.all.peak,
        reserved_bytes: s.reserved_bytes.all.current,
        peak_reserved_bytes: s.reserved_bytes.all.peak,
        active_bytes: s.active_bytes.all.current,
        peak_active_bytes: s.active_bytes.all.peak,
        inactive_split_bytes: s.inactive_split_bytes.all.current,
        peak_inactive_split_bytes: s.inactive_split_bytes.all.peak,
        largest_free_block_bytes: s.largest_free_block_bytes,
        cached_free_bytes: s.cached_free_bytes,
        num_allocs: s.num_allocs,
        num_frees: s.num_frees,
        reserved_limit_bytes: reserved_limit.unwrap_or(0),
        gauges,
        released_idle_decay_bytes: s.released(Reason::IdleDecay).bytes,
        released_budget_bytes: s.released(Reason::Budget).bytes,
        released_headroom_bytes: s.released(Reason::Headroom).bytes,
        released_out_of_memory_bytes: s.released(Reason::OutOfMemory).bytes,
        released_empty_cache_bytes: s.released(Reason::EmptyCache).bytes,
        released_cooperation_bytes: s.released(Reason::Cooperation).bytes,
        paused_bytes: s.paused_bytes,
        offloaded_bytes: s.offloaded_bytes,
        ..fill_counters(&s.events)
    }
}

/// `tidepool_stats` with every event counter filled from the one list
/// (`for_each_counter` in src/stats.rs): a counter with no field in the
/// struct does not compile. (`c_stats` fills the rest; the test
/// `every_field_of_tidepool_stats_is_filled` sees that no field is left.)
macro_rules! c_counters {
    ($( $(#[doc = $doc:literal])* $field:ident : $how:ident, $key:literal, $c_field:ident; )*) => {
        fn fill_counters(events: &Events) -> tidepool_stats {
            tidepool_stats { $( $c_field: events.$field, )* ..tidepool_stats::default() }
        }
    };
}
for_each_counter!(c_counters);

// `tidepool_stats.gauges` holds `Stats::GAUGES` in order; their number is ABI.
const _: () = assert!(Stats::GAUGES.len() == 9);

/// The size of version 1 of `tidepool_stats`: the smallest `size` accepted.
/// Later versions append fields, so this stays as it is.
const STATS_V1_SIZE: usize = 1040;
const _: () = assert!(std::mem::size_of::<tidepool_stats>() >= STATS_V1_SIZE);

/// An export's failure: the code it returns and the last error it sets.
type Failure = (c_int, String);

/// Turns an export body's result into its return code, setting the last error.
fn return_code(result: Result<(), Failure>) -> c_int {
    match result {
        Ok(()) => TIDEPOOL_OK,
        Err((code, message)) => {
            set_last_error(message);
            code
        }
    }
}

fn allocator_or_internal() -> Result<&'static Allocator, Failure> {
    allocator().map_err(|err| (TIDEPOOL_ERR_INTERNAL, err.to_string()))
}

/// Fills `*out` with the statistics of `device`. Returns TIDEPOOL_OK, or
/// TIDEPOOL_ERR_INVALID_ARGUMENT (NULL `out`, `out->size` too small),
/// TIDEPOOL_ERR_INVALID_DEVICE, TIDEPOOL_ERR_INTERNAL.
#[no_mangle]
pub extern "C" fn tidepool_get_stats(device: c_int, out: *mut tidepool_stats) -> c_int {
    boundary!(TIDEPOOL_ERR_INTERNAL, return_code(get_stats(device, out)))
}

fn get_stats(device: c_int, out: *mut tidepool_stats) -> Result<(), Failure> {
    let n = versioned_size(out, STATS_V1_SIZE, "tidepool_get_stats")?;
    let allocator = allocator_or_internal()?;
    let invalid_device = |err: AllocError| (TIDEPOOL_ERR_INVALID_DEVICE, err.to_string());
    let device = device_index(device).map_err(invalid_device)?;
    let stats = allocator.stats(device).map_err(invalid_device)?;
    let limit = allocator.device(device).ok().and_then(|d| d.reserved_limit());
    let mut filled = c_stats(&stats, limit);
    filled.size = n as u32;
    // SAFETY: `n` is `versioned_size(out, ..)`'s.
    unsafe { copy_prefix(&filled, out, n) };
    Ok(())
}

/// The bytes of a versioned struct `T` to write at `out` (non-NULL, its
/// first field a u32 `size` the caller sets to the size of its struct, at
/// least `min`): a caller built against an older, shorter struct gets its
/// prefix.
fn versioned_size<T>(out: *mut T, min: usize, function: &str) -> Result<usize, Failure> {
    if out.is_null() {
        return Err((TIDEPOOL_ERR_INVALID_ARGUMENT, format!("tidepool: {function}: out is NULL")));
    }
    // SAFETY: `out` is non-null and points to at least its `size` field, a u32 first.
    let caller_size = unsafe { (out as *const u32).read_unaligned() } as usize;
    if caller_size < min {
        return Err((TIDEPOOL_ERR_INVALID_ARGUMENT, format!("tidepool: {function}: out->size is {caller_size}, at least {min} needed")));
    }
    Ok(caller_size.min(std::mem::size_of::<T>()))
}

/// Copies the first `n` bytes of `filled` to `out`.
///
/// # Safety
/// `n` comes from `versioned_size(out, ..)`: the C caller vouched for that
/// many writable bytes at `out`, and it is at most `size_of::<T>()`.
unsafe fn copy_prefix<T>(filled: &T, out: *mut T, n: usize) {
    // SAFETY: as the function's contract says.
    unsafe { std::ptr::copy_nonoverlapping(filled as *const T as *const u8, out as *mut u8, n) };
}

/// Resets the peaks of `device` (-1: every device) to the current values
/// (`torch.cuda.reset_peak_memory_stats`). Returns TIDEPOOL_OK,
/// TIDEPOOL_ERR_INVALID_DEVICE or TIDEPOOL_ERR_INTERNAL.
#[no_mangle]
pub extern "C" fn tidepool_reset_peak_stats(device: c_int) -> c_int {
    boundary!(TIDEPOOL_ERR_INTERNAL, return_code(reset_stats(device, Allocator::reset_peak_stats)))
}

/// Zeroes what `device` (-1: every device) accumulated: each gauge's
/// allocated and freed sums and the event counters
/// (`torch.cuda.reset_accumulated_memory_stats`). Returns TIDEPOOL_OK,
/// TIDEPOOL_ERR_INVALID_DEVICE or TIDEPOOL_ERR_INTERNAL.
#[no_mangle]
pub extern "C" fn tidepool_reset_accumulated_stats(device: c_int) -> c_int {
    boundary!(TIDEPOOL_ERR_INTERNAL, return_code(reset_stats(device, Allocator::reset_accumulated_stats)))
}

/// Applies `reset` to `device`, or to every device for -1.
fn reset_stats(device: c_int, reset: fn(&Allocator, usize) -> Result<(), AllocError>) -> Result<(), Failure> {
    let allocator = allocator_or_internal()?;
    let failure = |err: AllocError| match err {
        AllocError::InvalidDevice { .. } => (TIDEPOOL_ERR_INVALID_DEVICE, err.to_string()),
        other => (TIDEPOOL_ERR_INTERNAL, other.to_string()),
    };
    let devices = match device {
        -1 => 0..allocator.device_count(),
        _ => {
            let device = device_index(device).map_err(failure)?;
            device..device + 1
        }
    };
    for device in devices {
        reset(allocator, device).map_err(failure)?;
    }
    Ok(())
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
fn copy_out(message: &str, buf: *mut c_char, len: usize) -> usize {
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

/// Checks a TIDEPOOL_CONF string without starting anything: writes what is
/// wrong with it into `buf` as `tidepool_last_error` does (one problem a
/// line, as the warnings TIDEPOOL_CONF would print say them) and returns how
/// many problems there are (0: none); -1 when `conf` is NULL or not UTF-8.
#[no_mangle]
pub extern "C" fn tidepool_check_conf(conf: *const c_char, buf: *mut c_char, len: usize) -> c_int {
    boundary!(-1, {
        if conf.is_null() {
            return -1;
        }
        // SAFETY: `conf` is non-null and, per the contract, a NUL-terminated string.
        let Ok(text) = unsafe { CStr::from_ptr(conf) }.to_str() else {
            return -1;
        };
        let (_, problems) = Config::parse(text);
        copy_out(&problems.join("\n"), buf, len);
        problems.len().min(c_int::MAX as usize) as c_int
    })
}

/// The tag `tag` (NULL: "default") as a string, or the failure of `who`.
fn tag_arg(tag: *const c_char, who: &str) -> Result<Option<String>, Failure> {
    if tag.is_null() {
        return Ok(None);
    }
    // SAFETY: `tag` is non-null and, per the contract, a NUL-terminated string.
    let text = unsafe { CStr::from_ptr(tag) }
        .to_str()
        .map_err(|_| (TIDEPOOL_ERR_INVALID_ARGUMENT, format!("tidepool: {who}: the tag is not UTF-8")))?;
    crate::tag::check_name(text).map_err(|err| (TIDEPOOL_ERR_INVALID_ARGUMENT, format!("{who}: {err}")))?;
    Ok(Some(text.to_string()))
}

/// The tag a pause, resume or tag-statistics call names: NULL is "default".
fn named_tag(tag: *const c_char, who: &str) -> Result<String, Failure> {
    Ok(tag_arg(tag, who)?.unwrap_or_else(|| crate::tag::DEFAULT_TAG.to_string()))
}

/// `device` as the tag calls take it: -1 is every device.
fn tag_device(device: c_int) -> Result<Option<usize>, Failure> {
    match device {
        -1 => Ok(None),
        _ => device_index(device).map(Some).map_err(|err| (TIDEPOOL_ERR_INVALID_DEVICE, err.to_string())),
    }
}

/// The return code of a failed tag call.
fn tag_failure(err: AllocError) -> Failure {
    let code = match &err {
        AllocError::InvalidArgument(_) => TIDEPOOL_ERR_INVALID_ARGUMENT,
        AllocError::InvalidDevice { .. } => TIDEPOOL_ERR_INVALID_DEVICE,
        AllocError::Tag(_) => TIDEPOOL_ERR_TAG_STATE,
        AllocError::OutOfMemory(_) | AllocError::HostOutOfMemory { .. } => TIDEPOOL_ERR_OUT_OF_MEMORY,
        _ => TIDEPOOL_ERR_INTERNAL,
    };
    (code, err.to_string())
}

/// Sets the calling thread's tag for its later allocations (NULL:
/// "default"). Returns TIDEPOOL_OK, or TIDEPOOL_ERR_INVALID_ARGUMENT (a
/// tag empty, longer than 63 bytes, or not UTF-8), the tag unchanged.
#[no_mangle]
pub extern "C" fn tidepool_set_tag(tag: *const c_char) -> c_int {
    boundary!(TIDEPOOL_ERR_INTERNAL, return_code(set_tag(tag)))
}

fn set_tag(tag: *const c_char) -> Result<(), Failure> {
    let name = tag_arg(tag, "tidepool_set_tag")?;
    crate::tag::set_current_name(name.as_deref()).map_err(tag_failure)?;
    Ok(())
}

/// Pauses `tag` on `device` (-1: every device): waits for the work queued
/// on the streams that used its blocks, then gives every page of it back
/// to the device, addresses kept. `flags`: TIDEPOOL_PAUSE_OFFLOAD keeps
/// the contents in host memory until `tidepool_resume`; 0 discards them.
/// Returns TIDEPOOL_OK, or (nothing changed) TIDEPOOL_ERR_INVALID_ARGUMENT
/// (bad tag, unknown flags), TIDEPOOL_ERR_INVALID_DEVICE,
/// TIDEPOOL_ERR_TAG_STATE (unknown tag, "default", already paused, a
/// private pool open), TIDEPOOL_ERR_OUT_OF_MEMORY (no host memory for the
/// offload), TIDEPOOL_ERR_INTERNAL.
#[no_mangle]
pub extern "C" fn tidepool_pause(tag: *const c_char, device: c_int, flags: c_int) -> c_int {
    boundary!(TIDEPOOL_ERR_INTERNAL, return_code(pause(tag, device, flags)))
}

fn pause(tag: *const c_char, device: c_int, flags: c_int) -> Result<(), Failure> {
    let name = named_tag(tag, "tidepool_pause")?;
    if flags & !TIDEPOOL_PAUSE_OFFLOAD != 0 {
        return Err((TIDEPOOL_ERR_INVALID_ARGUMENT, format!("tidepool: tidepool_pause: unknown flags {flags:#x}")));
    }
    let device = tag_device(device)?;
    allocator_or_internal()?.pause(&name, device, flags & TIDEPOOL_PAUSE_OFFLOAD != 0).map_err(tag_failure)?;
    Ok(())
}

/// Resumes `tag` on `device` (-1: every device where it is paused): maps
/// its pages again at the same addresses and copies offloaded contents
/// back; returns once the memory is usable. Returns TIDEPOOL_OK, or
/// TIDEPOOL_ERR_INVALID_ARGUMENT, TIDEPOOL_ERR_INVALID_DEVICE,
/// TIDEPOOL_ERR_TAG_STATE (unknown tag, not paused),
/// TIDEPOOL_ERR_OUT_OF_MEMORY (the device could not give the memory back
/// even after the cache was released and other processes were asked: the
/// tag stays paused, nothing mapped, its saved contents intact),
/// TIDEPOOL_ERR_INTERNAL.
#[no_mangle]
pub extern "C" fn tidepool_resume(tag: *const c_char, device: c_int) -> c_int {
    boundary!(TIDEPOOL_ERR_INTERNAL, return_code(resume(tag, device)))
}

fn resume(tag: *const c_char, device: c_int) -> Result<(), Failure> {
    let name = named_tag(tag, "tidepool_resume")?;
    let device = tag_device(device)?;
    allocator_or_internal()?.resume(&name, device).map_err(tag_failure)?;
    Ok(())
}

/// Fills `*out` with what `tag` holds on `device`. Set `out->size =
/// sizeof(tidepool_tag_stats)` first (as for `tidepool_get_stats`).
/// Returns TIDEPOOL_OK, or TIDEPOOL_ERR_INVALID_ARGUMENT (NULL `out`,
/// `out->size` too small, bad tag), TIDEPOOL_ERR_INVALID_DEVICE,
/// TIDEPOOL_ERR_TAG_STATE (unknown tag), TIDEPOOL_ERR_INTERNAL.
#[no_mangle]
pub extern "C" fn tidepool_get_tag_stats(tag: *const c_char, device: c_int, out: *mut tidepool_tag_stats) -> c_int {
    boundary!(TIDEPOOL_ERR_INTERNAL, return_code(get_tag_stats(tag, device, out)))
}

/// The smallest `size` `tidepool_get_tag_stats` accepts: version 1's.
const TAG_STATS_V1_SIZE: usize = 56;
const _: () = assert!(std::mem::size_of::<tidepool_tag_stats>() >= TAG_STATS_V1_SIZE);

fn get_tag_stats(tag: *const c_char, device: c_int, out: *mut tidepool_tag_stats) -> Result<(), Failure> {
    let n = versioned_size(out, TAG_STATS_V1_SIZE, "tidepool_get_tag_stats")?;
    let name = named_tag(tag, "tidepool_get_tag_stats")?;
    let device = device_index(device).map_err(|err| (TIDEPOOL_ERR_INVALID_DEVICE, err.to_string()))?;
    let s = allocator_or_internal()?.tag_stats(&name, device).map_err(tag_failure)?;
    let filled = tidepool_tag_stats {
        size: n as u32,
        version: TIDEPOOL_TAG_STATS_VERSION,
        allocated_bytes: s.allocated_bytes,
        reserved_bytes: s.reserved_bytes,
        paused_bytes: s.paused_bytes,
        offloaded_bytes: s.offloaded_bytes,
        num_allocations: s.allocations,
        paused: s.paused as u64,
    };
    // SAFETY: `n` is `versioned_size(out, ..)`'s.
    unsafe { copy_prefix(&filled, out, n) };
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Released;

    /// A `Stats` whose every figure, gauge and counter is non-zero and
    /// distinct.
    fn every_figure_set() -> Stats {
        let mut s = Stats::default();
        let mut next = 0u64;
        let mut value = || {
            next += 1;
            next
        };
        for (_, gauge) in s.gauges_mut() {
            for stat in [&mut gauge.all, &mut gauge.small_pool, &mut gauge.large_pool] {
                *stat = Stat { current: value(), peak: value(), allocated: value(), freed: value() };
            }
        }
        macro_rules! set_counters {
            ($( $(#[doc = $doc:literal])* $field:ident : $how:ident, $key:literal, $c_field:ident; )*) => {
                $( s.events.$field = value(); )*
            };
        }
        for_each_counter!(set_counters);
        for released in &mut s.events.released {
            *released = Released { segments: value(), bytes: value() };
        }
        (s.num_allocs, s.num_frees, s.cached_free_bytes, s.largest_free_block_bytes) = (value(), value(), value(), value());
        (s.paused_bytes, s.offloaded_bytes) = (value(), value());
        s
    }

    #[test]
    fn every_field_of_tidepool_stats_is_filled() {
        let s = every_figure_set();
        let filled = c_stats(&s, Some(u64::MAX));
        assert_eq!((filled.size as usize, filled.version), (std::mem::size_of::<tidepool_stats>(), TIDEPOOL_STATS_VERSION));
        // After `size` and `version`, the struct is u64 words only.
        const WORDS: usize = (std::mem::size_of::<tidepool_stats>() - 8) / 8;
        // SAFETY: tidepool_stats is repr(C): two u32, then u64 fields and
        // arrays of structs of u64, with no padding.
        let words: [u64; WORDS] = unsafe { std::ptr::read_unaligned((&filled as *const tidepool_stats as *const u8).add(8) as *const _) };
        for (index, word) in words.iter().enumerate() {
            assert_ne!(*word, 0, "word {index} of tidepool_stats (byte {}) is not filled by c_stats", 8 + 8 * index);
        }
        for (counter, value) in Events::COUNTERS.iter().zip(s.events.values()) {
            assert!(words.contains(&value), "{} is not in tidepool_stats", counter.field);
        }
    }
}
