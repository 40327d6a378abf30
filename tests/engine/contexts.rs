//! Allocation contexts (PyTorch's `_record_memory_history(stacks="python")`):
//! the frames registered for a context show on the blocks allocated with it
//! and on their events in a snapshot, read back here as PyTorch would read
//! it; a block allocated without one, even at a reused address, shows none.

use crate::common;

use crate::pickle_doc::{NodeId, PickleDoc};
use common::MIB;
use tidepool::snapshot::pytorch_snapshot;
use tidepool::{Allocator, Frame, PrivatePoolId, Stream};

const S: Stream = Stream(3);

fn frame(filename: &str, name: &str, line: i64) -> Frame {
    Frame { filename: filename.into(), name: name.into(), line }
}

fn snapshot(alloc: &Allocator) -> PickleDoc {
    PickleDoc::parse(&tidepool::pickle::dumps(&pytorch_snapshot(alloc))[..]).unwrap()
}

/// A frame as a snapshot lists it: (filename, name, line).
type ShownFrame = (String, String, i128);

/// Each frame of a `frames` list.
fn frames_of(doc: &PickleDoc, frames: NodeId) -> Vec<ShownFrame> {
    let text = |f, key| doc.str(doc.get(f, key).unwrap()).unwrap().to_string();
    doc.items(frames)
        .unwrap()
        .iter()
        .map(|&f| (text(f, "filename"), text(f, "name"), doc.int(doc.get(f, "line").unwrap()).unwrap()))
        .collect()
}

/// The frames of the block at `addr` in the snapshot.
fn block_frames(doc: &PickleDoc, addr: u64) -> Vec<ShownFrame> {
    let segments = doc.items(doc.get(doc.root(), "segments").unwrap()).unwrap();
    let blocks = segments.iter().flat_map(|&s| doc.items(doc.get(s, "blocks").unwrap()).unwrap());
    let block = blocks.into_iter().find(|&b| doc.int(doc.get(b, "address").unwrap()) == Some(addr as i128)).unwrap();
    frames_of(doc, doc.get(block, "frames").unwrap())
}

/// The action and frames of each block event (not segment event) of device 0 at `addr`.
fn trace_frames(doc: &PickleDoc, addr: u64) -> Vec<(String, Vec<ShownFrame>)> {
    let traces = doc.items(doc.get(doc.root(), "device_traces").unwrap()).unwrap();
    let entries = doc.items(traces[0]).unwrap();
    entries
        .iter()
        .filter(|&&e| doc.int(doc.get(e, "addr").unwrap()) == Some(addr as i128))
        .map(|&e| (doc.str(doc.get(e, "action").unwrap()).unwrap().to_string(), frames_of(doc, doc.get(e, "frames").unwrap())))
        .filter(|(action, _)| !action.starts_with("segment_"))
        .collect()
}

fn owned(frames: &[Frame]) -> Vec<ShownFrame> {
    frames.iter().map(|f| (f.filename.clone(), f.name.clone(), f.line as i128)).collect()
}

#[test]
fn a_block_allocated_with_a_context_shows_its_frames_and_so_do_its_events() {
    let (alloc, _) = common::host_allocator(1, 1 << 30, "history_entries:100");
    let frames = vec![frame("model.py", "forward", 42), frame("train.py", "step", 7)];
    alloc.register_context(11, frames.clone()).unwrap();
    let p = alloc.allocate_with_context(0, 4096, S, 11).unwrap();
    let plain = alloc.allocate(0, 4096, S).unwrap();
    alloc.validate().unwrap();
    let doc = snapshot(&alloc);
    assert_eq!(block_frames(&doc, p.0), owned(&frames));
    assert_eq!(block_frames(&doc, plain.0), []);
    assert_eq!(trace_frames(&doc, p.0), [("alloc".to_string(), owned(&frames))]);
    assert_eq!(trace_frames(&doc, plain.0), [("alloc".to_string(), vec![])]);
    // Its frees carry the frames too, as PyTorch's do.
    alloc.free(0, p).unwrap();
    let actions: Vec<_> = trace_frames(&snapshot(&alloc), p.0).into_iter().map(|(a, f)| (a, f.len())).collect();
    assert_eq!(actions, [("alloc".into(), 2), ("free_requested".into(), 2), ("free_completed".into(), 2)]);
    alloc.validate().unwrap();
}

#[test]
fn an_address_reused_without_a_context_shows_no_frames() {
    let (alloc, _) = common::host_allocator(1, 1 << 30, "");
    alloc.register_context(5, vec![frame("a.py", "f", 1)]).unwrap();
    let p = alloc.allocate_with_context(0, 3 * MIB as usize, S, 5).unwrap();
    assert_eq!(block_frames(&snapshot(&alloc), p.0).len(), 1);
    alloc.free(0, p).unwrap();
    alloc.validate().unwrap();
    let q = alloc.allocate(0, 3 * MIB as usize, S).unwrap();
    assert_eq!(q, p, "the same block again");
    assert_eq!(block_frames(&snapshot(&alloc), q.0), []);
    alloc.free(0, q).unwrap();
    alloc.validate().unwrap();
}

#[test]
fn an_unknown_context_or_none_has_no_frames_and_a_later_registration_shows() {
    let (alloc, _) = common::host_allocator(1, 1 << 30, "");
    let unknown = alloc.allocate_with_context(0, 512, S, 99).unwrap();
    let none = alloc.allocate_with_context(0, 512, S, 0).unwrap();
    assert_eq!(block_frames(&snapshot(&alloc), unknown.0), []);
    alloc.register_context(99, vec![frame("late.py", "g", 3)]).unwrap();
    let doc = snapshot(&alloc);
    assert_eq!(block_frames(&doc, unknown.0), owned(&[frame("late.py", "g", 3)]));
    assert_eq!(block_frames(&doc, none.0), []);
    assert!(alloc.register_context(0, vec![]).is_err(), "context 0 means none");
    alloc.free(0, unknown).unwrap();
    alloc.free(0, none).unwrap();
    alloc.validate().unwrap();
}

#[test]
fn a_pending_block_keeps_its_frames_until_its_free_completes() {
    let (alloc, _) = common::host_allocator(1, 1 << 30, "history_entries:100");
    alloc.register_context(8, vec![frame("p.py", "h", 9)]).unwrap();
    // During a capture a free used on another stream waits, pending, for its end.
    let pool = PrivatePoolId(1, 0);
    alloc.begin_private(0, pool).unwrap();
    let p = alloc.allocate_with_context(0, 4096, S, 8).unwrap();
    alloc.record_stream(p, Stream(4)).unwrap();
    alloc.free(0, p).unwrap();
    let doc = snapshot(&alloc);
    assert_eq!(block_frames(&doc, p.0).len(), 1, "pending: still its frames");
    let actions: Vec<_> = trace_frames(&doc, p.0).into_iter().map(|(a, f)| (a, f.len())).collect();
    assert_eq!(actions, [("alloc".into(), 1), ("free_requested".into(), 1)]);
    alloc.validate().unwrap();
    alloc.end_private(0, pool).unwrap(); // the free completes
    alloc.validate().unwrap();
    let actions: Vec<_> = trace_frames(&snapshot(&alloc), p.0).into_iter().map(|(a, f)| (a, f.len())).collect();
    assert_eq!(actions.last().unwrap(), &("free_completed".into(), 1));
    alloc.begin_private(0, pool).unwrap();
    let q = alloc.allocate(0, 4096, S).unwrap();
    assert_eq!(q, p);
    assert_eq!(block_frames(&snapshot(&alloc), q.0), []);
    alloc.validate().unwrap();
}
