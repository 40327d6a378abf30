//! Several processes on one device: cooperation through the registry,
//! the multi-process soak, fork, and a paused tag's memory used by another
//! process.
//!
//! One test binary, one module per file (cargo links each binary once).

#[path = "../common/mod.rs"]
mod common;

mod cooperation;
mod fork;
mod shared_capacity;
mod soak;
mod tags_devices;
