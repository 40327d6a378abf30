//! The allocator through its Rust API: the engine, backends (host, and cuda
//! over simgpu), expandable segments, tags, private pools, history,
//! buffers, the model-based and stress tests, and the layering rule.
//!
//! One test binary, one module per file (cargo links each binary once).

#[path = "../common/mod.rs"]
mod common;
#[path = "../common/pickle_doc.rs"]
mod pickle_doc;

mod api;
mod backends;
mod buffer;
mod concurrency;
mod contexts;
mod expandable;
mod free_ptr;
mod heap_stress;
mod heap_stress_caches;
mod history;
mod hot_path;
mod layers;
mod model;
mod private_pools;
mod reclaim;
mod shards;
mod tags;
mod thread_cache;
