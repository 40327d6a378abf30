//! The registry's tests: entries through their encoding, joining,
//! publishing, asking, and hostile or old files.

use std::fs::File;
use std::os::unix::fs::{DirBuilderExt, FileExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::proc_info::process_start;

use super::file::*;
use super::format::*;
use super::scan::*;

/// A device key as a host backend names one (`scan` reads only such names).
const KEY: &str = "host-0000000000000abc-0";

/// Another device's key, `n`.
fn key(n: u32) -> String {
    format!("host-0000000000000abc-{n}")
}

/// A folder `name` for one test (not made yet), inside a temporary folder
/// removed with everything in it when the returned guard drops.
fn dir(name: &str) -> (tempfile::TempDir, PathBuf) {
    let scratch = tempfile::Builder::new().prefix("tidepool-registry-").tempdir().unwrap();
    let dir = scratch.path().join(name);
    (scratch, dir)
}

/// Makes `dir` as `join` would: this user's alone.
fn make_private(dir: &Path) {
    std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir).unwrap();
}

#[test]
fn counters_are_published_as_the_device_counts_them_reset_included() {
    let (_scratch, dir) = dir("counters");
    let mut a = Registry::join(&dir, "dev", 100).unwrap();
    let served = |a: &mut Registry| a.entries().unwrap().into_iter().find(|e| e.pid == a.pid).unwrap().requests_served;
    a.publish(Entry { requests_served: 5, ..Entry::default() }).unwrap();
    assert_eq!(served(&mut a), 5);
    a.publish(Entry { requests_served: 0, ..Entry::default() }).unwrap(); // reset_accumulated_memory_stats
    assert_eq!(served(&mut a), 0);
    drop(a);
}

#[test]
fn a_directory_others_can_use_is_refused() {
    use std::os::unix::fs::PermissionsExt;
    let (_scratch, dir) = dir("shared");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
    let err = Registry::join(&dir, "dev", 100).unwrap_err().to_string();
    assert!(err.contains("only this user") && err.contains("mode 777"), "{err}");
    assert!(!dir.join("dev.registry").exists(), "nothing was created in it");
    // A link to a private directory is not one either.
    let private = dir.with_extension("private");
    make_private(&private);
    let link = dir.with_extension("link");
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(&private, &link).unwrap();
    assert!(Registry::join(&link, "dev", 100).unwrap_err().to_string().contains("only this user"));
    for path in [&dir, &private] {
        let _ = std::fs::remove_dir_all(path);
    }
    let _ = std::fs::remove_file(&link);
}

#[test]
fn entries_round_trip_through_their_encoding() {
    let mut comm = [0u8; 16];
    comm[..6].copy_from_slice(b"python");
    let e = Entry {
        pid: 7,
        device: 1,
        heartbeat_ms: 2,
        reserved: 3,
        allocated: 4,
        cached_free: 5,
        inactive_split: 6,
        largest_free_block: 16,
        request_bytes: 8,
        requests_served: 9,
        requests_posted: 17,
        ooms: 18,
        device_total: 19,
        device_free: 20,
        paused: 21,
        released: [10, 11, 12, 13, 14, 15],
        driver_calls: 25,
        comm,
        answered_ms: 22,
        start_ticks: 23,
        interval_ms: 24,
    };
    assert_eq!(Entry::decode(&e.encode()), Some(e));
    assert_eq!(e.comm(), "python");
    assert_eq!(Entry::decode(&[0u8; SLOT as usize]), Some(Entry::default()), "a free slot");
    // Any flipped byte of a used slot is caught by the checksum.
    for at in 0..SLOT as usize {
        let mut raw = e.encode();
        raw[at] ^= 0x40;
        let decoded = Entry::decode(&raw);
        assert!(decoded.is_none() || decoded.is_some_and(|d| d.pid == 0), "byte {at}");
    }
}

#[test]
fn a_request_is_seen_by_the_other_processes() {
    let (_scratch, dir) = dir("request");
    let mut a = Registry::join(&dir, "dev", 100).unwrap();
    let mut b = Registry::join(&dir, "dev", 100).unwrap();
    // Both slots belong to this pid here; slots differ.
    assert_ne!(a.slot, b.slot);
    a.request(100).unwrap();
    assert_eq!(b.publish(Entry::default()).unwrap(), 100);
    a.request(0).unwrap();
    assert_eq!(b.publish(Entry::default()).unwrap(), 0);
    let mode = std::fs::metadata(a.path()).unwrap().permissions();
    assert_eq!(std::os::unix::fs::PermissionsExt::mode(&mode) & 0o777, 0o600);
    drop((a, b));
}

#[test]
fn a_request_is_posted_only_when_someone_can_help_and_answered_once() {
    let (_scratch, dir) = dir("ask");
    let mut a = Registry::join(&dir, "dev", 100).unwrap();
    let mut b = Registry::join(&dir, "dev", 100).unwrap();
    b.publish(Entry { allocated: 5, ..Entry::default() }).unwrap();
    assert!(a.ask(100).unwrap().is_none(), "b holds no cache: nothing posted");
    assert_eq!(b.publish(Entry { cached_free: 7, ..Entry::default() }).unwrap(), 0);
    let asked = a.ask(100).unwrap().expect("b shows cache");
    assert_eq!(asked.helpers, [(b.slot, std::process::id(), 0)]);
    assert!(!a.answered(&asked).unwrap(), "b has not seen it yet");
    std::thread::sleep(Duration::from_millis(3));
    assert_eq!(b.publish(Entry { cached_free: 7, ..Entry::default() }).unwrap(), 100);
    assert!(!a.answered(&asked).unwrap(), "seen, not yet given back");
    b.mark_answered().unwrap();
    assert!(a.answered(&asked).unwrap());
    // The stamp survives later publications; a helper that leaves has answered too.
    b.publish(Entry::default()).unwrap();
    assert!(a.answered(&asked).unwrap());
    let asked_again = Asked { posted_ms: u64::MAX - 1, ..asked };
    assert!(!a.answered(&asked_again).unwrap());
    drop(b);
    assert!(a.answered(&asked_again).unwrap());
    drop(a);
}

#[test]
fn an_answer_stamped_before_the_request_never_counts_even_after_the_clock_steps_back() {
    let (_scratch, dir) = dir("clock-step");
    let mut a = Registry::join(&dir, "dev", 100).unwrap();
    let mut b = Registry::join(&dir, "dev", 100).unwrap();
    b.publish(Entry { cached_free: 7, ..Entry::default() }).unwrap();
    // b answered an earlier request an hour "ahead": the wall clock has since stepped back.
    let mut slot = b.read_slot(b.slot).unwrap();
    slot.answered_ms = now_ms() + 3_600_000;
    b.write_slot(b.slot, &slot).unwrap();
    let asked = a.ask(100).unwrap().expect("b shows cache");
    assert!(!a.answered(&asked).unwrap(), "the old answer is not this one");
    std::thread::sleep(Duration::from_millis(3));
    assert_eq!(b.publish(Entry { cached_free: 7, ..Entry::default() }).unwrap(), 100);
    b.mark_answered().unwrap();
    assert!(a.answered(&asked).unwrap(), "b's new answer, stamped after the request, counts");
    drop((a, b));
}

#[test]
fn dead_processes_are_cleared() {
    let (_scratch, dir) = dir("dead");
    let mut a = Registry::join(&dir, "dev", 100).unwrap();
    // A slot of a process that no longer exists, asking for memory.
    let ghost = Entry { pid: u32::MAX - 1, request_bytes: 1 << 30, ..Entry::default() };
    a.write_slot(5, &ghost).unwrap();
    assert!(slot_pids(a.path()).unwrap().contains(&ghost.pid), "its slot, before");
    assert_eq!(a.publish(Entry::default()).unwrap(), 0, "a dead process's request is ignored");
    assert_eq!(a.read_slot(5), Some(Entry::default()), "and its slot cleared");
    assert_eq!(slot_pids(a.path()).unwrap(), vec![std::process::id()], "only this process's slot is left");
    drop(a);
}

#[test]
fn a_registry_locked_forever_by_another_process_does_not_hang() {
    let (_scratch, dir) = dir("locked");
    let mut a = Registry::join(&dir, "dev", 100).unwrap();
    let squatter = File::open(a.path()).unwrap();
    squatter.lock().unwrap();
    let start = Instant::now();
    assert!(a.publish(Entry::default()).unwrap_err().to_string().contains("locked"));
    // LOCK_WAIT is 50 ms; the bound leaves room for a loaded machine.
    assert!(start.elapsed() < Duration::from_secs(2));
    squatter.unlock().unwrap();
    assert!(a.publish(Entry::default()).is_ok());
    drop(a);
}

#[test]
fn a_hostile_registry_is_refused_or_harmless() {
    let (_scratch, dir) = dir("hostile");
    make_private(&dir);
    // Random bytes: no header at all, so the file is rebuilt, whole.
    let path = dir.join("junk.registry");
    std::fs::write(&path, (0..5000u32).map(|i| (i * 7919 % 251) as u8).collect::<Vec<_>>()).unwrap();
    let rebuilt = Registry::join(&dir, "junk", 100).unwrap();
    assert_eq!(std::fs::metadata(&path).unwrap().len(), FILE_BYTES);
    assert_eq!(slot_pids(&path).unwrap(), [std::process::id()]);
    drop(rebuilt);
    // Right header, a version still to come: refused (a newer tidepool's).
    let mut bad = Vec::from(&MAGIC[..]);
    bad.extend_from_slice(&99u32.to_le_bytes());
    bad.extend_from_slice(&64u32.to_le_bytes());
    std::fs::write(dir.join("v99.registry"), &bad).unwrap();
    assert!(Registry::join(&dir, "v99", 100).is_err());
    // Right header, huge counts and a live pid (ours) asking for everything:
    // the worst outcome is a request to release cache.
    let mut a = Registry::join(&dir, "huge", 100).unwrap();
    let (pid, start_ticks) = (std::process::id(), process_start(std::process::id()).unwrap());
    let liar = Entry {
        pid,
        start_ticks,
        request_bytes: u64::MAX,
        reserved: u64::MAX,
        heartbeat_ms: now_ms(),
        interval_ms: 1000,
        ..Entry::default()
    };
    let others_publish = |a: &mut Registry, entry: &Entry| {
        for slot in (0..SLOTS).filter(|&slot| slot != a.slot) {
            a.write_slot(slot, entry).unwrap();
        }
        a.publish(Entry::default()).unwrap()
    };
    assert_eq!(others_publish(&mut a, &liar), u64::MAX, "saturates, no overflow");
    // The same requests from processes that stopped beating (stopped
    // mid-wait: no heartbeat for three of their intervals): not honoured.
    let stale = Entry { heartbeat_ms: now_ms() - BEATS_MISSED * 1000 - BEAT_SLACK_MS - 50, ..liar };
    assert_eq!(others_publish(&mut a, &stale), 0);
    // Heartbeats from before the wall clock stepped back an hour look an
    // hour ahead: those requests are not honoured either.
    let ahead = Entry { heartbeat_ms: now_ms() + 3_600_000, ..liar };
    assert_eq!(others_publish(&mut a, &ahead), 0);
    // A truncated file reads as empty slots, not a crash.
    a.file.set_len(HEADER + 3).unwrap();
    assert!(a.publish(Entry::default()).is_ok());
    assert!(scan(&dir).registries.iter().all(|r| r.entries.len() <= SLOTS));
    drop(a);
}

#[test]
fn scan_reads_live_entries_and_names_every_file_it_skips() {
    let (_scratch, dir) = dir("scan");
    let mut a = Registry::join(&dir, KEY, 100).unwrap();
    a.publish(Entry { allocated: 5, reserved: 10, inactive_split: 2, ..Entry::default() }).unwrap();
    // A slot of ours with a damaged checksum is skipped and counted.
    let mut raw = Entry { pid: std::process::id(), reserved: 1, ..Entry::default() }.encode();
    raw[20] ^= 1;
    a.file.write_all_at(&raw, HEADER + SLOT * 9).unwrap();
    let file = |n: u32| dir.join(format!("{}.registry", key(n)));
    std::fs::write(file(1), b"not a registry at all, just some text").unwrap();
    std::fs::write(file(2), &a_header(VERSION)[..5]).unwrap();
    let mut truncated = a_header(VERSION);
    truncated.resize(HEADER as usize + 100, 0);
    std::fs::write(file(3), truncated).unwrap();
    std::fs::write(file(4), a_header(1)).unwrap();
    std::fs::write(file(5), a_header(VERSION + 1)).unwrap();
    std::fs::write(file(6), b"").unwrap();
    std::os::unix::fs::symlink(a.path(), file(7)).unwrap();
    assert!(std::process::Command::new("mkfifo").arg(file(8)).status().unwrap().success());
    // Not named as tidepool names registries: not read, not named.
    std::fs::write(dir.join("junk.registry"), b"ignored").unwrap();
    std::fs::write(dir.join("not-a-registry.txt"), b"ignored").unwrap();
    let start = Instant::now();
    let found = scan(&dir);
    assert!(start.elapsed() < Duration::from_secs(5), "a FIFO does not block the scan");
    let mut errors: Vec<(String, ScanError)> =
        found.errors.iter().map(|(p, e)| (p.file_stem().unwrap().to_string_lossy().into_owned(), *e)).collect();
    errors.sort();
    assert_eq!(
        errors,
        [
            (key(0), ScanError::Corrupt),
            (key(1), ScanError::Version),
            (key(2), ScanError::Truncated),
            (key(3), ScanError::Truncated),
            (key(4), ScanError::Version),
            (key(5), ScanError::Version),
            (key(7), ScanError::Unreadable),
            (key(8), ScanError::Unreadable),
        ]
    );
    let keys: Vec<&str> = found.registries.iter().map(|r| r.key.as_str()).collect();
    assert_eq!(keys, [key(0), key(6)]);
    let good = &found.registries[0].entries;
    assert_eq!(good.len(), 1);
    assert_eq!((good[0].pid, good[0].allocated, good[0].reserved), (std::process::id(), 5, 10));
    assert_eq!(good[0].fragmentation(), 0.2);
    assert!(!good[0].comm().is_empty(), "the process's name is published");
    drop(a);
    assert!(scan(&dir).registries.iter().all(|r| r.entries.is_empty()), "a process that left is gone");
    // A directory that is not there yet shows nothing; one that cannot
    // be read (here: a file) is an error, not "no processes".
    let missing = scan(&dir.join("nobody-yet"));
    assert!(missing.registries.is_empty() && missing.errors.is_empty());
    let not_a_dir = scan(&dir.join("not-a-registry.txt"));
    assert_eq!(not_a_dir.errors, [(dir.join("not-a-registry.txt"), ScanError::Unreadable)]);
}

#[test]
fn device_keys_are_the_names_tidepool_gives_registries() {
    for good in
        ["cuda-0123456789abcdef0123456789abcdef", "cuda-ordinal-3", "host-00000000deadbeef-0", "GPU-1f2e3d4c-5b6a-7980-a1b2-c3d4e5f60718"]
    {
        assert!(is_device_key(good), "{good}");
    }
    for bad in ["", "dev", "junk", "cuda-12", "cuda-ordinal-", "host-xyz-0", "host-00000000deadbeef", "GPU-1f2e3d4c", "../cuda-ordinal-1"] {
        assert!(!is_device_key(bad), "{bad}");
    }
}

#[test]
fn ten_thousand_junk_files_hide_no_device_and_keep_the_scan_fast() {
    let (_scratch, dir) = dir("junk-files");
    let mut a = Registry::join(&dir, KEY, 100).unwrap();
    // Written long ago: older than the device's file, which its process rewrites.
    let old = std::time::SystemTime::now() - Duration::from_secs(3600);
    for i in 0..10_000u32 {
        let name = if i % 2 == 0 { format!("junk-{i}.registry") } else { format!("{}.registry", key(1000 + i)) };
        let file = File::create(dir.join(name)).unwrap();
        file.set_modified(old).unwrap();
    }
    a.publish(Entry { allocated: 7, ..Entry::default() }).unwrap();
    let start = Instant::now();
    let found = scan(&dir);
    let took = start.elapsed();
    let mine: Vec<&Entry> = found.registries.iter().flat_map(|r| &r.entries).collect();
    assert!(mine.len() == 1 && mine[0].allocated == 7, "the device is shown");
    // The key-shaped junk past MAX_FILES is named once, as the folder's.
    assert_eq!(found.errors.iter().filter(|(_, e)| *e == ScanError::TooMany).count(), 1);
    assert!(found.errors.len() <= MAX_FILES + 1, "{}", found.errors.len());
    assert!(took < Duration::from_secs(2), "{took:?}");
    drop(a);
}

#[test]
fn a_slot_whose_pid_was_reused_or_forged_is_neither_shown_nor_kept() {
    let (_scratch, dir) = dir("forged");
    let mut a = Registry::join(&dir, KEY, 100).unwrap();
    let me = std::process::id();
    let start = process_start(me).unwrap();
    // A dead pid; this process's pid with another start time (a reused
    // pid, or a forgery naming a live process).
    let dead = Entry { pid: u32::MAX - 1, start_ticks: 1, heartbeat_ms: now_ms(), ..Entry::default() };
    let forged = Entry { pid: me, start_ticks: start + 1, heartbeat_ms: now_ms(), request_bytes: 1 << 30, ..Entry::default() };
    a.write_slot(10, &dead).unwrap();
    a.write_slot(11, &forged).unwrap();
    let shown: Vec<u64> = scan(&dir).registries.iter().flat_map(|r| r.entries.iter().map(|e| e.start_ticks)).collect();
    assert_eq!(shown, [start], "only this process's own slot");
    assert_eq!(a.publish(Entry::default()).unwrap(), 0, "the forged request is not honoured");
    assert_eq!(slot_pids(a.path()).unwrap(), [me], "the next writer cleared both");
    drop(a);
}

#[test]
fn a_damaged_file_is_rebuilt_by_its_next_writer_and_every_process_claims_its_slot_again() {
    let (_scratch, dir) = dir("heal");
    let mut a = Registry::join(&dir, KEY, 100).unwrap();
    let mut b = Registry::join(&dir, KEY, 100).unwrap();
    let publish_both = |a: &mut Registry, b: &mut Registry| {
        a.publish(Entry { allocated: 1, ..Entry::default() }).unwrap();
        b.publish(Entry { allocated: 2, ..Entry::default() }).unwrap();
    };
    let shown = || {
        let found = scan(&dir);
        let mut figures: Vec<u64> = found.registries.iter().flat_map(|r| r.entries.iter().map(|e| e.allocated)).collect();
        figures.sort();
        (figures, found.errors)
    };
    publish_both(&mut a, &mut b);
    assert_eq!(shown(), (vec![1, 2], vec![]));
    let slot_of_a = HEADER + SLOT * a.slot as u64;
    type Damage<'a> = &'a dyn Fn(&File);
    let damages: [(&str, Damage); 4] = [
        ("truncated to nothing", &|f| f.set_len(0).unwrap()),
        ("truncated to 100 bytes", &|f| f.set_len(100).unwrap()),
        ("its header overwritten", &|f| f.write_all_at(b"GARBAGE!GARBAGE!", 0).unwrap()),
        ("a slot overwritten", &|f| f.write_all_at(&[0x5a; SLOT as usize], slot_of_a).unwrap()),
    ];
    for (what, damage) in damages {
        damage(&File::options().write(true).open(a.path()).unwrap());
        publish_both(&mut a, &mut b);
        assert_eq!(shown(), (vec![1, 2], vec![]), "after the file was {what}");
    }
    drop((a, b));
}

fn a_header(version: u32) -> Vec<u8> {
    let mut header = Vec::from(&MAGIC[..]);
    header.extend_from_slice(&version.to_le_bytes());
    header.extend_from_slice(&(SLOTS as u32).to_le_bytes());
    header
}

#[test]
fn an_older_version_is_taken_over_once_its_processes_are_gone() {
    for (version, slot) in OLD_SLOTS {
        let (_scratch, dir) = dir(&format!("v{version}"));
        make_private(&dir);
        let mut old = a_header(version);
        old.resize((HEADER + slot * SLOTS as u64) as usize, 0);
        // A live process (this one) in slot 3: refused.
        old[(HEADER + slot * 3) as usize..][..4].copy_from_slice(&std::process::id().to_le_bytes());
        std::fs::write(dir.join(format!("{KEY}.registry")), &old).unwrap();
        assert!(Registry::join(&dir, KEY, 100).unwrap_err().to_string().contains(&format!("not a version {VERSION}")), "version {version}");
        // Only dead processes: rewritten as this version.
        old[(HEADER + slot * 3) as usize..][..4].copy_from_slice(&(u32::MAX - 1).to_le_bytes());
        std::fs::write(dir.join(format!("{KEY}.registry")), &old).unwrap();
        let a = Registry::join(&dir, KEY, 100).unwrap();
        assert_eq!(std::fs::metadata(a.path()).unwrap().len(), FILE_BYTES);
        assert_eq!(scan(&dir).registries[0].entries.len(), 1, "version {version}");
        drop(a);
    }
}

#[test]
fn names_are_printable_whatever_a_process_calls_itself() {
    assert_eq!(printable("\x1b[2J\x1b[31mx"), "\\x1b[2J\\x1b[31mx");
    assert_eq!(printable("a\nb\t\u{7f}\u{9b}c"), "a\\x0ab\\x09\\x7f\\x9bc");
    assert_eq!(printable("python3 é ü"), "python3 é ü");
    let mut comm = [0u8; 16];
    comm[..4].copy_from_slice(b"\x1b]0;");
    assert_eq!(Entry { comm, ..Entry::default() }.comm(), "\\x1b]0;");
}
