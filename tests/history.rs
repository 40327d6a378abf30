//! Memory history (`record_history`): the events a snapshot carries in
//! `device_traces`, named and ordered as PyTorch's, bounded, and complete
//! enough that a snapshot tidepool wrote replays to the run it recorded.

mod common;

use std::path::Path;

use common::{host_allocator, MIB};
use tidepool::trace::Event;
use tidepool::{Allocator, DevicePtr, HistoryAction, Stream};

const S: Stream = Stream(7);

fn actions(alloc: &Allocator) -> Vec<(HistoryAction, u64, u64)> {
    alloc.history(0).unwrap().iter().map(|e| (e.action, e.addr, e.size)).collect()
}

#[test]
fn each_allocation_free_and_segment_is_an_event_in_pytorchs_words() {
    let (alloc, _) = host_allocator(1, 1 << 30, "");
    alloc.allocate(0, 100, S).unwrap(); // before history: not kept
    alloc.record_history(Some(1000)).unwrap();
    let ptr = alloc.allocate(0, 3 * MIB as usize, S).unwrap();
    alloc.free(0, ptr).unwrap();
    alloc.empty_cache();
    let base = ptr.0;
    use HistoryAction::*;
    assert_eq!(
        actions(&alloc),
        [
            (SegmentAlloc, base, 20 * MIB),
            (Alloc, base, 3 * MIB),
            (FreeRequested, base, 3 * MIB),
            (FreeCompleted, base, 3 * MIB),
            (SegmentFree, base, 20 * MIB)
        ]
    );
    let history = alloc.history(0).unwrap();
    assert!(history.iter().all(|e| e.stream == S));
    assert!(history.windows(2).all(|w| w[0].time_us <= w[1].time_us));
    assert_eq!(tidepool::HistoryAction::SegmentUnmap.name(), "segment_unmap");
}

#[test]
fn history_entries_in_tidepool_conf_keeps_them_from_the_start() {
    let (alloc, _) = host_allocator(1, 1 << 30, "history_entries:3");
    let p = alloc.allocate(0, 4096, S).unwrap();
    alloc.free(0, p).unwrap();
    let kept: Vec<_> = alloc.history(0).unwrap().iter().map(|e| e.action).collect();
    assert_eq!(kept, [HistoryAction::Alloc, HistoryAction::FreeRequested, HistoryAction::FreeCompleted]);
    let (quiet, _) = host_allocator(1, 1 << 30, "");
    quiet.allocate(0, 4096, S).unwrap();
    assert!(quiet.history(0).unwrap().is_empty(), "history is off by default");
    assert!(tidepool::Config::builder().conf("history_entries:many").is_err());
}

#[test]
fn only_the_last_entries_are_kept_and_off_forgets_them() {
    let (alloc, _) = host_allocator(1, 1 << 30, "");
    alloc.record_history(Some(10)).unwrap();
    for _ in 0..100 {
        let p = alloc.allocate(0, 4096, S).unwrap();
        alloc.free(0, p).unwrap();
    }
    let kept = alloc.history(0).unwrap();
    assert_eq!(kept.len(), 10);
    assert_eq!(kept.last().unwrap().action, HistoryAction::FreeCompleted);
    alloc.record_history(None).unwrap();
    assert!(alloc.history(0).unwrap().is_empty());
}

#[test]
fn an_oom_is_an_event_with_the_devices_free_bytes() {
    let (alloc, _) = host_allocator(1, 64 * MIB, "");
    alloc.record_history(Some(100)).unwrap();
    assert!(alloc.allocate(0, 100 * MIB as usize, S).is_err());
    let oom = alloc.history(0).unwrap().into_iter().find(|e| e.action == HistoryAction::Oom).expect("an oom entry");
    assert_eq!((oom.addr, oom.size), (64 * MIB, 100 * MIB));
}

/// Replays `trace` through an allocator with history on, writes a snapshot,
/// reads it back as a trace: the same allocations and frees, and the peak
/// reserved the run had.
fn round_trip(file: &str, conf: &str) {
    let trace = tidepool::trace::load(&Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/traces").join(file)).unwrap();
    let (alloc, _) = host_allocator(1, 1 << 40, conf);
    alloc.record_history(Some(1 << 20)).unwrap();
    let mut ptrs = vec![DevicePtr(0); trace.allocs as usize];
    for (step, event) in trace.events.iter().enumerate() {
        match *event {
            Event::Alloc { id, size, stream, .. } => ptrs[id as usize] = alloc.allocate(0, size as usize, Stream(stream)).unwrap(),
            Event::Free { id } => alloc.free(0, ptrs[id as usize]).unwrap(),
        }
        if step == trace.events.len() / 2 {
            alloc.empty_cache(); // segments (or pages) go back mid-run too
        }
    }
    let dir = common::scratch_dir(&format!("history-{file}"));
    let path = dir.path().join("snapshot.pickle");
    tidepool::snapshot::write_snapshot(&alloc, &path).unwrap();
    let back = tidepool::trace::load(&path).unwrap();
    assert_eq!(back.warnings.count, 0, "{:?}", back.warnings.first);
    assert_eq!(back.events.len(), trace.events.len(), "{file} {conf}");
    assert_eq!(back.peak_requested(), trace.peak_requested(), "{file} {conf}");
    let peak = alloc.stats(0).unwrap().reserved_bytes.all.peak;
    assert_eq!(back.pytorch_peak_reserved, Some(peak), "{file} {conf}: the snapshot's segments and events disagree");
}

#[test]
fn a_snapshot_with_history_replays_to_the_run_it_recorded() {
    for file in ["mlp-train.csv", "cnn-train.csv"] {
        round_trip(file, "");
    }
}

#[test]
fn with_expandable_segments_pages_mapped_and_unmapped_are_in_the_history() {
    round_trip("transformer-varlen-train.csv", "expandable:true");
}

#[test]
fn snapshots_written_at_once_to_neighbouring_names_are_each_whole_and_a_failed_one_leaves_nothing() {
    let (alloc, _) = host_allocator(1, 1 << 30, "");
    alloc.record_history(Some(1000)).unwrap();
    let p = alloc.allocate(0, 1 << 20, Stream::DEFAULT).unwrap();
    let dir = common::scratch_dir("snapshot-names");
    // a.pickle and a.pkl: one temporary name each would have been a.tidepool-tmp.
    let names = [dir.path().join("a.pickle"), dir.path().join("a.pkl")];
    std::thread::scope(|scope| {
        for path in &names {
            let alloc = &alloc;
            scope.spawn(move || {
                for _ in 0..50 {
                    tidepool::snapshot::write_snapshot(alloc, path).unwrap();
                }
            });
        }
    });
    for path in &names {
        let back = tidepool::trace::load(path).unwrap();
        assert_eq!(back.peak_requested(), 1 << 20, "{}", path.display());
    }
    // A path that is a directory: the rename fails, and no temporary file stays.
    let err = tidepool::snapshot::write_snapshot(&alloc, dir.path()).unwrap_err();
    assert!(err.kind() != std::io::ErrorKind::NotFound, "{err}");
    let left: Vec<_> = std::fs::read_dir(dir.path().parent().unwrap())
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().ends_with(".tidepool-tmp"))
        .collect();
    assert!(left.is_empty(), "{left:?}");
    alloc.free(0, p).unwrap();
}
