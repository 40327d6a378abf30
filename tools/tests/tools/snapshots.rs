//! Snapshots tidepool writes, read back as traces: with history on, a
//! snapshot replays to the run it recorded; written at once to
//! neighbouring names, each is whole; written to what is not a regular
//! file (a symbolic link, a FIFO, a device, a directory, a missing
//! folder), as `open(path, "wb")` would, replacing nothing.

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
    // A path that is a directory: refused, and no temporary file stays.
    let err = tidepool::snapshot::write_snapshot(&alloc, dir.path()).unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::IsADirectory, "{err}");
    let left: Vec<_> = std::fs::read_dir(dir.path().parent().unwrap())
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().ends_with(".tidepool-tmp"))
        .collect();
    assert!(left.is_empty(), "{left:?}");
    alloc.free(0, p).unwrap();
}

/// An allocator with one live block, whose snapshot reads back as one allocation of 1 MiB.
fn one_block() -> (tidepool::Allocator, DevicePtr) {
    let (alloc, _) = host_allocator(1, 1 << 30, "");
    let p = alloc.allocate(0, 1 << 20, Stream::DEFAULT).unwrap();
    (alloc, p)
}

/// Whether `path` holds a snapshot of `one_block`.
fn holds_the_snapshot(path: &std::path::Path) -> bool {
    tidepool_tools::trace::load(path).is_ok_and(|t| t.peak_requested() == 1 << 20)
}

#[test]
fn through_a_symbolic_link_the_snapshot_replaces_its_target_and_the_link_stays() {
    use std::os::unix::fs::{symlink, PermissionsExt};
    let (alloc, _p) = one_block();
    let dir = common::scratch_dir("snapshot-links");
    let (target, link, chain) = (dir.path().join("target.pickle"), dir.path().join("link.pickle"), dir.path().join("chain.pickle"));
    std::fs::write(&target, b"old").unwrap();
    std::fs::set_permissions(&target, std::fs::Permissions::from_mode(0o640)).unwrap();
    symlink("target.pickle", &link).unwrap(); // relative: read from the link's folder
    symlink(&link, &chain).unwrap();
    tidepool::snapshot::write_snapshot(&alloc, &chain).unwrap();
    assert!(holds_the_snapshot(&target));
    assert!(std::fs::symlink_metadata(&link).unwrap().file_type().is_symlink());
    assert!(std::fs::symlink_metadata(&chain).unwrap().file_type().is_symlink());
    assert_eq!(std::fs::metadata(&target).unwrap().permissions().mode() & 0o777, 0o640, "the file keeps its permissions");
    // A link to nothing: its target is made, the link stays a link.
    let dangling = dir.path().join("dangling.pickle");
    symlink("made.pickle", &dangling).unwrap();
    tidepool::snapshot::write_snapshot(&alloc, &dangling).unwrap();
    assert!(holds_the_snapshot(&dir.path().join("made.pickle")));
    assert!(std::fs::symlink_metadata(&dangling).unwrap().file_type().is_symlink());
    // A link into a folder that does not exist: an error naming the target.
    let lost = dir.path().join("lost.pickle");
    symlink("missing/x.pickle", &lost).unwrap();
    let err = tidepool::snapshot::write_snapshot(&alloc, &lost).unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::NotFound, "{err}");
    assert!(err.to_string().contains("missing/x.pickle"), "{err}");
}

#[test]
fn a_fifo_is_written_into_when_read_and_refused_at_once_when_not_and_stays_a_fifo() {
    use std::io::Read;
    use std::os::unix::fs::FileTypeExt;
    let (alloc, _p) = one_block();
    let dir = common::scratch_dir("snapshot-fifo");
    let fifo = dir.path().join("snapshot.fifo");
    let name = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: a NUL-terminated path; mkfifo reads it and makes the FIFO.
    assert_eq!(unsafe { libc::mkfifo(name.as_ptr(), 0o600) }, 0);
    // No reader: an error at once, not a wait.
    let start = std::time::Instant::now();
    let err = tidepool::snapshot::write_snapshot(&alloc, &fifo).unwrap_err();
    assert!(err.to_string().contains("no process reads"), "{err}");
    assert!(start.elapsed() < std::time::Duration::from_secs(2));
    // A reader: it receives the whole snapshot (larger than a pipe's buffer, so read as written).
    let reader = std::thread::spawn({
        let fifo = fifo.clone();
        move || {
            let mut bytes = Vec::new();
            std::fs::File::open(&fifo).unwrap().read_to_end(&mut bytes).unwrap();
            bytes
        }
    });
    alloc.record_history(Some(100_000)).unwrap();
    for _ in 0..3000 {
        let q = alloc.allocate(0, 4096, Stream::DEFAULT).unwrap();
        alloc.free(0, q).unwrap();
    }
    // The reader may not have opened the FIFO yet: try until it has.
    let written = (0..500).find_map(|_| match tidepool::snapshot::write_snapshot(&alloc, &fifo) {
        Ok(()) => Some(()),
        Err(_) => {
            std::thread::sleep(std::time::Duration::from_millis(10));
            None
        }
    });
    assert!(written.is_some(), "the FIFO's reader never opened it");
    let bytes = reader.join().unwrap();
    assert!(bytes.len() > 1 << 16, "{} bytes", bytes.len());
    let copy = dir.path().join("copy.pickle");
    std::fs::write(&copy, &bytes).unwrap();
    assert!(tidepool_tools::trace::load(&copy).is_ok());
    assert!(std::fs::symlink_metadata(&fifo).unwrap().file_type().is_fifo(), "the FIFO was replaced");
}

#[test]
fn a_device_is_written_into_and_survives_dev_full_says_no_space() {
    use std::os::unix::fs::FileTypeExt;
    let (alloc, _p) = one_block();
    tidepool::snapshot::write_snapshot(&alloc, std::path::Path::new("/dev/null")).unwrap();
    // As root (CI) the old writer replaced /dev/full with a regular file.
    let err = tidepool::snapshot::write_snapshot(&alloc, std::path::Path::new("/dev/full")).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::ENOSPC), "{err}");
    for device in ["/dev/full", "/dev/null"] {
        assert!(std::fs::symlink_metadata(device).unwrap().file_type().is_char_device(), "{device} is no longer a device");
    }
    let left: Vec<_> =
        std::fs::read_dir("/dev").unwrap().flatten().filter(|e| e.file_name().to_string_lossy().ends_with(".tidepool-tmp")).collect();
    assert!(left.is_empty(), "{left:?}");
}

#[test]
fn a_path_in_a_missing_folder_is_an_error_and_leaves_nothing() {
    let (alloc, _p) = one_block();
    let dir = common::scratch_dir("snapshot-missing");
    let err = tidepool::snapshot::write_snapshot(&alloc, &dir.path().join("no/such/folder/s.pickle")).unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::NotFound, "{err}");
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
}
