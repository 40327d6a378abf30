//! tidepool's tools, beside the allocator: allocation traces (reading,
//! replay, plan, cards, plots), the pickle reader for PyTorch's memory
//! snapshots, and the exporter's scrape of the device registries. The
//! `tidepool` command (src/main.rs) is built on them; the allocator crate
//! (`tidepool`) knows nothing of them.
//!
//! Modules, lowest first (tests/engine/layers.rs checks that imports point only
//! to modules earlier in this list): `pickle`, `trace`, `exporter`.

pub mod exporter;
pub mod pickle;
pub mod trace;
