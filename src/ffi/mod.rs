//! The C ABI: the exports PyTorch's `CUDAPluggableAllocator` loads, plus
//! statistics, snapshots, allocation contexts, out-of-memory observers,
//! tags and the last error. `ffi/tidepool.h` declares them (a test checks
//! the header against these files).
//!
//! Every export runs inside `boundary!` (boundary.rs): a panic becomes
//! NULL or an error code and a last-error message, never an unwind into C;
//! an error becomes its code through one function (`failure`). The
//! allocator behind them is the process-wide one (`crate::process`), made
//! on first use from `TIDEPOOL_CONF`; after `fork` the child starts a fresh
//! one.
//!
//! One file a job: boundary.rs (the panic boundary, the last error, error
//! codes), types.rs (the C structs and their versions), alloc.rs
//! (allocation, free, the allocator's hooks), stats.rs (statistics and
//! their resets), oom.rs (out-of-memory observers, history and snapshots),
//! tags.rs (sleep and wake).

// The exports take C pointers whose contracts ffi/tidepool.h states; they
// are called from C, where an `unsafe fn` marker would mean nothing.
#![allow(clippy::not_unsafe_ptr_arg_deref)]

mod alloc;
mod boundary;
mod oom;
mod stats;
mod tags;
mod types;

pub use alloc::{
    tidepool_base_alloc, tidepool_begin_allocate_to_pool, tidepool_check_conf, tidepool_empty_cache, tidepool_end_allocate_to_pool,
    tidepool_free, tidepool_free_ptr, tidepool_init, tidepool_malloc, tidepool_malloc_with_context, tidepool_record_stream,
    tidepool_register_context, tidepool_release_pool, tidepool_set_memory_fraction,
};
pub use boundary::{
    tidepool_last_error, TIDEPOOL_ERR_INTERNAL, TIDEPOOL_ERR_INVALID_ARGUMENT, TIDEPOOL_ERR_INVALID_DEVICE, TIDEPOOL_ERR_INVALID_FREE,
    TIDEPOOL_ERR_IO, TIDEPOOL_ERR_OUT_OF_MEMORY, TIDEPOOL_ERR_TAG_STATE, TIDEPOOL_OK,
};
pub use oom::{tidepool_attach_oom_observer, tidepool_dump_snapshot, tidepool_record_history};
pub use stats::{tidepool_get_stats, tidepool_reset_accumulated_stats, tidepool_reset_peak_stats};
pub use tags::{tidepool_get_tag_stats, tidepool_pause, tidepool_resume, tidepool_set_tag, TIDEPOOL_PAUSE_OFFLOAD};
pub use types::{
    tidepool_frame, tidepool_oom_observer, tidepool_stat, tidepool_stat_by_pool, tidepool_stats, tidepool_tag_stats,
    TIDEPOOL_STATS_VERSION, TIDEPOOL_TAG_STATS_VERSION,
};
