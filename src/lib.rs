//! tidepool: a CUDA caching allocator that measures fragmentation and gives
//! idle memory back.
//!
//! [`Allocator`] is the entry point: one [`device::Device`] per GPU, each
//! holding the [`heap::DeviceHeap`]s of its stream shards behind their own
//! locks, all growing through one [`backend::Backend`].
//!
//! Modules, lowest first. A module imports only modules listed before it,
//! each from the module that defines it (never through this root, which
//! only declares and re-exports); tests/engine/layers.rs checks it. Code
//! that must call upward takes a closure.
//! - below the heap: `types` (Stream, DevicePtr), `sync` (the lock: std's,
//!   which keeps no state outside its word), `fork` (the fork count, the
//!   locks held across a fork, lists claimed without a lock), `addr_map`
//!   (address -> number, the pointer lookup of frees and threads' caches),
//!   `page_map` (which pages of a reserved range hold memory), `log`,
//!   `user_file` (writing a file to a path the user named), `proc_info`
//!   (when a process started: a live pid from a reused one),
//!   `size_class` (the bin math), `backend` (the only code that talks to a
//!   driver), `error`, `tag`, `frames`, `pickle` (the
//!   snapshot writer), `recording` (trace rows written live), `reclaim`
//!   (the release policy, pure, and the thread that runs a pass),
//!   `stats`, `config`, `registry` (the file processes on one device share), `cache_owner`
//!   (a thread's records of its cache), `cache_slot` (what a thread's cache
//!   shares with the heap);
//! - `heap`: one `DeviceHeap` per stream shard (blocks, segments, pools,
//!   pages, tags, stream safety, statistics, history; `heap/mod.rs` lists
//!   its parts);
//! - the device: `cooperation` (its registry slot, asking and answering),
//!   `device` (one GPU's shards, routing, reserved count and cap, the
//!   out-of-memory ladder, figures over the shards), `thread_cache` (a
//!   thread's side of its cache: the cached path without the lock);
//! - the faces: `allocator` (`Allocator`, the Rust API), `process` (the
//!   process-wide allocator, `global()`), `snapshot` (PyTorch's snapshot
//!   format), `buffer` (`Buffer<T>`), `cudarc_interop`, `ffi` (the C ABI).
//!
//! The tools (trace replay and planning, `tidepool top`, the exporter) are
//! the `tidepool-tools` crate beside this one (tools/): they use this
//! crate's public API, and nothing here knows of them.
//!
//! ```
//! use tidepool::{Allocator, Config, Stream};
//!
//! let config = Config::builder().host(1, 1 << 30).build().unwrap();
//! let alloc = Allocator::new(config).unwrap();
//! let ptr = alloc.allocate(0, 4096, Stream::DEFAULT).unwrap();
//! assert_eq!(alloc.stats(0).unwrap().allocated_bytes.all.current, 4096);
//! alloc.free(0, ptr).unwrap();
//! ```

mod addr_map;
mod allocator;
pub mod backend;
pub mod buffer;
mod cache_owner;
mod cache_slot;
pub mod config;
mod cooperation;
mod device;
pub mod error;
#[allow(non_camel_case_types)]
pub mod ffi;
mod fork;
pub mod frames;
// The heap is no part of the public API: public only so that the engine's
// own tests (tests/engine: heap_stress, expandable, tags) can drive one
// heap alone; hidden from the documentation, and no dependent should name it.
#[doc(hidden)]
pub mod heap;
mod log;
mod page_map;
pub mod pickle;
mod proc_info;
mod process;
pub mod reclaim;
pub mod recording;
pub mod registry;
pub mod size_class;
pub mod snapshot;
pub mod stats;
mod sync;
pub mod tag;
mod thread_cache;
pub mod types;
mod user_file;

/// cudarc interop: tidepool buffers as cudarc device memory (feature `cudarc`).
#[cfg(feature = "cudarc")]
pub mod cudarc_interop;

pub use allocator::Allocator;
pub use buffer::{Buffer, Plain};
pub use config::{BackendKind, Config, ConfigError};
pub use device::Device;
pub use error::{AllocError, ExpandableError, InvalidArgument, InvalidFree, OomReport, PrivatePoolMisuse, TagError, TagState};
pub use frames::Frame;
pub use heap::history::{HistoryAction, HistoryEntry};
pub use heap::private::PrivatePoolId;

pub use heap::{BlockSnapshot, SegmentSnapshot, TagStats};
pub use process::global;
pub use stats::{Events, Released, Stat, StatByPool, Stats};
pub use tag::TagId;
pub use types::{DevicePtr, Stream};
