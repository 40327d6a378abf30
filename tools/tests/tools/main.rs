//! The tools: replay and plan of traces (and their driver calls against a
//! live run over simgpu), expandable segments on every trace, snapshots
//! read back, `tidepool top`, the exporter with a real Prometheus, the
//! documentation (the configuration page; README's and docs/' commands and
//! links), the Python package built and installed as a user would, and
//! the GPU check: its staging's size check, and the script that times
//! the driver calls, over simgpu.
//!
//! One test binary, one module per file (cargo links each binary once).

#[path = "../../../tests/common/mod.rs"]
mod common;

mod config;
mod docs;
mod expandable;
mod exporter;
mod gpu_check;
mod live_replay;
mod python;
mod readme;
mod replay;
mod snapshots;
mod top;
mod vmm_calls;
