//! Memory snapshots in PyTorch's schema (`torch.cuda.memory._snapshot()`),
//! so pytorch.org/memory_viz and `torch.cuda._memory_viz` read tidepool's
//! heaps as they read PyTorch's own: the segments and their blocks, and,
//! with history on, each device's recent events (`device_traces`). Blocks
//! and events allocated with a context carry its frames (`crate::frames`).
#![forbid(unsafe_code)]

use std::path::Path;

use crate::allocator::Allocator;
use crate::heap::history::HistoryAction;
use crate::heap::BlockSnapshot;
use crate::pickle::{dumps, PyValue};
use crate::size_class::PoolKind;

/// The snapshot of every device as a Python value:
/// `{"segments": [...], "device_traces": [[], ...]}`.
pub fn pytorch_snapshot(alloc: &Allocator) -> PyValue {
    let mut segments = Vec::new();
    for device in 0..alloc.device_count() {
        for segment in alloc.snapshot(device).unwrap_or_default() {
            let allocated: u64 = segment.blocks.iter().filter(|b| b.allocated).map(|b| b.size).sum();
            // As PyTorch: pending blocks are active, and keep their requested size.
            let active = segment.blocks.iter().filter(|b| b.allocated || b.pending);
            let (active, requested) = active.fold((0, 0), |(size, requested), b| (size + b.size, requested + b.requested));
            let blocks = segment
                .blocks
                .iter()
                .map(|b| {
                    PyValue::dict([
                        ("address", PyValue::int(b.address)),
                        ("size", PyValue::int(b.size)),
                        ("requested_size", PyValue::int(b.requested)),
                        ("state", PyValue::str(block_state(b))),
                        ("frames", frames(alloc, b.context)),
                    ])
                })
                .collect();
            let pool_id = segment.private.map_or((0, 0), |id| (id.0, id.1));
            segments.push(PyValue::dict([
                ("device", PyValue::int(device as i64)),
                ("address", PyValue::int(segment.address)),
                ("total_size", PyValue::int(segment.size)),
                ("allocated_size", PyValue::int(allocated)),
                ("active_size", PyValue::int(active)),
                ("requested_size", PyValue::int(requested)),
                ("stream", PyValue::int(segment.stream.0)),
                ("segment_type", PyValue::str(if segment.kind == PoolKind::Small { "small" } else { "large" })),
                ("segment_pool_id", PyValue::Tuple(vec![PyValue::int(pool_id.0), PyValue::int(pool_id.1)])),
                ("is_expandable", PyValue::Bool(segment.expandable)),
                // tidepool's own: the segment's tag, and whether it is paused
                // (pages given back; the blocks keep their addresses).
                ("tag", PyValue::str(&*crate::tag::name_of(segment.tag))),
                ("paused", PyValue::Bool(segment.paused)),
                ("frames", PyValue::List(vec![])),
                ("blocks", PyValue::List(blocks)),
            ]));
        }
    }
    let traces = (0..alloc.device_count()).map(|device| PyValue::List(device_trace(alloc, device))).collect();
    PyValue::dict([("segments", PyValue::List(segments)), ("device_traces", PyValue::List(traces))])
}

/// The events kept for `device` (none unless history is on), as PyTorch's
/// trace entries.
fn device_trace(alloc: &Allocator, device: usize) -> Vec<PyValue> {
    let entries = alloc.history(device).unwrap_or_default();
    entries
        .iter()
        .map(|e| {
            // An out-of-memory's `addr` is the device's free bytes, which
            // PyTorch (2.1 on) and memory_viz read as `device_free`.
            let addr_key = if e.action == HistoryAction::Oom { "device_free" } else { "addr" };
            PyValue::dict([
                ("action", PyValue::str(e.action.name())),
                (addr_key, PyValue::int(e.addr)),
                ("size", PyValue::int(e.size)),
                ("stream", PyValue::int(e.stream.0)),
                ("time_us", PyValue::int(e.time_us)),
                ("frames", frames(alloc, e.context)),
            ])
        })
        .collect()
}

/// The frames of `context` as PyTorch lists them: `[{"filename", "line", "name"}, ...]`.
fn frames(alloc: &Allocator, context: u64) -> PyValue {
    let frames = alloc.context_frames(context);
    let frame = |f: &crate::frames::Frame| {
        PyValue::dict([("filename", PyValue::str(&f.filename)), ("line", PyValue::int(f.line)), ("name", PyValue::str(&f.name))])
    };
    PyValue::List(frames.iter().map(frame).collect())
}

/// A block's state as PyTorch names it.
fn block_state(block: &BlockSnapshot) -> &'static str {
    match (block.allocated, block.pending) {
        (true, _) => "active_allocated",
        (false, true) => "active_pending_free",
        (false, false) => "inactive",
    }
}

/// Writes the snapshot as a pickle to `path`: replacing a regular file at
/// once (a reader never sees half of it), through a symbolic link to its
/// target, into a FIFO or a device; never over a directory
/// (`user_file.rs`).
pub fn write_snapshot(alloc: &Allocator, path: &Path) -> std::io::Result<()> {
    crate::user_file::write_whole(path, &dumps(&pytorch_snapshot(alloc)))
}
