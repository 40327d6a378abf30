//! The C ABI called from Rust, each case in a child process of its own
//! (the C ABI's allocator is process-wide, made from TIDEPOOL_CONF):
//! `oom_snapshot` at the first out-of-memory, written or refused, and the
//! statistics resets over every device.

use crate::common;

use std::ffi::c_char;
use std::path::Path;
use std::ptr::null_mut;

use crate::pickle_doc::PickleDoc;
use tidepool::ffi::*;

const MIB: usize = 1 << 20;

/// Runs the (ignored) test `name` of this binary in a child process with
/// TIDEPOOL_CONF set to `conf`; returns whether it ran and passed and what
/// it printed.
fn child(name: &str, conf: &str) -> (bool, String) {
    common::child_output(common::child_command(name).env("TIDEPOOL_CONF", conf))
}

fn last_error() -> String {
    let mut buf = vec![0u8; 4096];
    let len = tidepool_last_error(buf.as_mut_ptr() as *mut c_char, buf.len());
    buf.truncate(len.min(buf.len() - 1));
    String::from_utf8(buf).unwrap()
}

fn stats(device: i32) -> tidepool_stats {
    let mut s = tidepool_stats { size: std::mem::size_of::<tidepool_stats>() as u32, ..Default::default() };
    assert_eq!(tidepool_get_stats(device, &mut s), TIDEPOOL_OK, "{}", last_error());
    s
}

/// The path the snapshot of the child `name` goes to.
fn snapshot_path(name: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("{name}-{}.pickle", std::process::id()))
}

#[test]
fn the_first_out_of_memory_writes_the_oom_snapshot_and_later_ones_do_not() {
    let path = snapshot_path("oom_snapshot");
    let _ = std::fs::remove_file(&path);
    let conf = format!("backend:host,host_capacity_mb:64,history_entries:100,oom_snapshot:{}", path.display());
    let (ok, text) = child("child_writes_the_oom_snapshot", &conf);
    assert!(ok && text.contains("child: ok"), "{text}");
    assert!(!text.contains("warning"), "{text}");
}

#[test]
#[ignore = "child process: run by the_first_out_of_memory_writes_the_oom_snapshot_and_later_ones_do_not"]
fn child_writes_the_oom_snapshot() {
    common::child_only();
    let conf = std::env::var("TIDEPOOL_CONF").unwrap();
    let path = Path::new(conf.rsplit_once("oom_snapshot:").unwrap().1);
    let live = tidepool_malloc(MIB, 0, null_mut());
    assert!(!live.is_null(), "{}", last_error());
    assert!(!path.exists(), "no snapshot before an out-of-memory");
    assert!(tidepool_malloc(1 << 30, 0, null_mut()).is_null());
    assert!(last_error().contains("out of memory"), "the report stays the last error: {}", last_error());
    // The snapshot of that moment: the live block, and the OOM in the history.
    let doc = PickleDoc::parse(std::fs::File::open(path).expect("the snapshot was written")).unwrap();
    let field = |node, key| doc.get(node, key).unwrap();
    let segments = doc.items(field(doc.root(), "segments")).unwrap();
    let blocks: Vec<_> = segments.iter().flat_map(|&s| doc.items(field(s, "blocks")).unwrap().to_vec()).collect();
    let live_blocks: Vec<_> = blocks.iter().filter(|&&b| doc.str(field(b, "state")) == Some("active_allocated")).collect();
    assert_eq!(live_blocks.len(), 1);
    assert_eq!(doc.int(field(*live_blocks[0], "address")), Some(live as i128));
    let trace = doc.items(doc.items(field(doc.root(), "device_traces")).unwrap()[0]).unwrap();
    let ooms: Vec<_> = trace.iter().filter(|&&e| doc.str(field(e, "action")) == Some("oom")).map(|&e| doc.int(field(e, "size"))).collect();
    assert_eq!(ooms, [Some(1 << 30)]);
    // Only the first out-of-memory of the process writes it.
    std::fs::remove_file(path).unwrap();
    assert!(tidepool_malloc(1 << 30, 0, null_mut()).is_null());
    assert!(!path.exists(), "a second out-of-memory wrote the snapshot again");
    tidepool_free(live, MIB, 0, null_mut());
    println!("child: ok");
}

#[test]
fn an_unwritable_oom_snapshot_is_one_warning_and_the_allocator_goes_on() {
    let conf = "backend:host,host_capacity_mb:64,oom_snapshot:/nonexistent-dir/oom.pickle";
    let (ok, text) = child("child_cannot_write_the_oom_snapshot", conf);
    assert!(ok && text.contains("child: ok"), "{text}");
    let warnings: Vec<_> = text.lines().filter(|l| l.contains("warning")).collect();
    assert_eq!(warnings.len(), 1, "{text}");
    assert!(warnings[0].starts_with("tidepool: warning: oom_snapshot: cannot write /nonexistent-dir/oom.pickle: "), "{text}");
}

#[test]
#[ignore = "child process: run by an_unwritable_oom_snapshot_is_one_warning_and_the_allocator_goes_on"]
fn child_cannot_write_the_oom_snapshot() {
    common::child_only();
    assert!(tidepool_malloc(1 << 30, 0, null_mut()).is_null());
    assert!(last_error().contains("out of memory"), "{}", last_error());
    let p = tidepool_malloc(MIB, 0, null_mut());
    assert!(!p.is_null(), "the allocator keeps working: {}", last_error());
    tidepool_free(p, MIB, 0, null_mut());
    assert!(tidepool_malloc(1 << 30, 0, null_mut()).is_null());
    assert_eq!(stats(0).num_ooms, 2);
    println!("child: ok");
}

#[test]
fn statistics_resets_apply_to_one_device_or_to_every_one() {
    let (ok, text) = child("child_resets_statistics", "backend:host,host_devices:2,host_capacity_mb:64");
    assert!(ok && text.contains("child: ok"), "{text}");
}

#[test]
#[ignore = "child process: run by statistics_resets_apply_to_one_device_or_to_every_one"]
fn child_resets_statistics() {
    common::child_only();
    let mut keep = vec![];
    for device in [0, 1] {
        keep.push(tidepool_malloc(4096, device, null_mut()));
        let big = tidepool_malloc(30 * MIB, device, null_mut());
        tidepool_free(big, 30 * MIB, device, null_mut());
        assert!(tidepool_malloc(100 * MIB, device, null_mut()).is_null());
    }
    assert_eq!(tidepool_reset_peak_stats(1), TIDEPOOL_OK);
    assert_eq!(stats(1).peak_allocated_bytes, 4096);
    assert!(stats(0).peak_allocated_bytes > 30 * MIB as u64, "device 0 untouched");
    assert_eq!(tidepool_reset_peak_stats(-1), TIDEPOOL_OK);
    assert_eq!(tidepool_reset_accumulated_stats(-1), TIDEPOOL_OK);
    for device in [0, 1] {
        let s = stats(device);
        assert_eq!((s.peak_allocated_bytes, s.allocated_bytes, s.peak_reserved_bytes, s.reserved_bytes), (4096, 4096, 2 << 20, 2 << 20));
        assert_eq!((s.num_ooms, s.num_allocs, s.num_device_allocs, s.gauges[4].all.allocated), (0, 0, 0, 0), "device {device}");
    }
    for bad in [2, -2, i32::MIN] {
        assert_eq!(tidepool_reset_peak_stats(bad), TIDEPOOL_ERR_INVALID_DEVICE, "device {bad}");
        assert_eq!(tidepool_reset_accumulated_stats(bad), TIDEPOOL_ERR_INVALID_DEVICE, "device {bad}");
        assert!(last_error().contains(&format!("no device {bad}")), "{}", last_error());
    }
    for (device, ptr) in keep.into_iter().enumerate() {
        tidepool_free(ptr, 4096, device as i32, null_mut());
    }
    println!("child: ok");
}

static OBSERVED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

unsafe extern "C" fn count_oom(_device: i32, _requested: usize, _allocated: usize, _free: usize, _user: *mut std::ffi::c_void) {
    OBSERVED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
}

#[test]
fn an_out_of_memory_is_reported_as_one_when_stderr_cannot_be_written() {
    // The child's stderr is a pipe nobody reads: writing the report fails
    // (EPIPE), which must not turn the out-of-memory into another error.
    let mut command = common::child_command("child_oom_with_a_closed_stderr");
    command
        .env("TIDEPOOL_CONF", "backend:host,host_capacity_mb:64")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let mut child = command.spawn().unwrap();
    drop(child.stderr.take());
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && stdout.contains("child: ok"), "{stdout}");
}

#[test]
#[ignore = "child process: run by an_out_of_memory_is_reported_as_one_when_stderr_cannot_be_written"]
fn child_oom_with_a_closed_stderr() {
    common::child_only();
    assert_eq!(tidepool_attach_oom_observer(Some(count_oom), null_mut()), TIDEPOOL_OK);
    assert!(tidepool_malloc(1 << 30, 0, null_mut()).is_null());
    assert!(last_error().contains("out of memory"), "the report is the last error: {}", last_error());
    assert_eq!(OBSERVED.load(std::sync::atomic::Ordering::Relaxed), 1, "the observers ran");
    println!("child: ok");
}
