//! Snapshots tidepool writes, read back as traces: with history on, a
//! snapshot replays to the run it recorded; written at once to
//! neighbouring names, each is whole.

use tidepool::{DevicePtr, Stream};
use tidepool_tools::trace::Event;

use crate::common;
use crate::common::host_allocator;

/// Replays `trace` through an allocator with history on, writes a snapshot,
/// reads it back as a trace: the same allocations and frees, and the peak
/// reserved the run had.
fn round_trip(file: &str, conf: &str) {
    let trace = tidepool_tools::trace::load(&common::repo_root().join("examples/traces").join(file)).unwrap();
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
    let back = tidepool_tools::trace::load(&path).unwrap();
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
        let back = tidepool_tools::trace::load(path).unwrap();
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
