//! The C structs of ffi/tidepool.h and their versions: a caller built
//! against an older, shorter struct sets its `size` and gets that prefix.

use std::ffi::{c_char, c_int, c_void};

use super::boundary::{Failure, TIDEPOOL_ERR_INVALID_ARGUMENT};

/// Version of `tidepool_stats` this library fills.
pub const TIDEPOOL_STATS_VERSION: u32 = 7;
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
    /// Version 6: 1 when `reserved_limit_bytes` is a limit (0 included).
    pub has_reserved_limit: u64,
    /// Version 7: the memory driver calls made on the device.
    pub num_driver_calls: u64,
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

/// The bytes of a versioned struct `T` to write at `out` (non-NULL, its
/// first field a u32 `size` the caller sets to the size of its struct, at
/// least `min`): a caller built against an older, shorter struct gets its
/// prefix.
pub(super) fn versioned_size<T>(out: *mut T, min: usize, function: &str) -> Result<usize, Failure> {
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
pub(super) unsafe fn copy_prefix<T>(filled: &T, out: *mut T, n: usize) {
    // SAFETY: as the function's contract says.
    unsafe { std::ptr::copy_nonoverlapping(filled as *const T as *const u8, out as *mut u8, n) };
}
