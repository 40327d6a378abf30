//! The registry's tests: entries through their encoding, joining,
//! publishing, asking, and hostile or old files.

use std::fs::File;
use std::os::unix::fs::{DirBuilderExt, FileExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::file::*;
use super::format::*;
use super::scan::*;

fn dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tidepool-registry-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// Makes `dir` as `join` would: this user's alone.
fn make_private(dir: &Path) {
    std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir).unwrap();
}

#[test]
fn counters_are_published_as_the_device_counts_them_reset_included() {
    let dir = dir("counters");
    let mut a = Registry::join(&dir, "dev").unwrap();
    let served = |a: &mut Registry| a.entries().unwrap().into_iter().find(|e| e.pid == a.pid).unwrap().requests_served;
    a.publish(Entry { requests_served: 5, ..Entry::default() }).unwrap();
    assert_eq!(served(&mut a), 5);
    a.publish(Entry { requests_served: 0, ..Entry::default() }).unwrap(); // reset_accumulated_memory_stats
    assert_eq!(served(&mut a), 0);
    drop(a);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_directory_others_can_use_is_refused() {
    use std::os::unix::fs::PermissionsExt;
    let dir = dir("shared");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
    let err = Registry::join(&dir, "dev").unwrap_err().to_string();
    assert!(err.contains("only this user") && err.contains("mode 777"), "{err}");
    assert!(!dir.join("dev.registry").exists(), "nothing was created in it");
    // A link to a private directory is not one either.
    let private = dir.with_extension("private");
    make_private(&private);
    let link = dir.with_extension("link");
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(&private, &link).unwrap();
    assert!(Registry::join(&link, "dev").unwrap_err().to_string().contains("only this user"));
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
        comm,
        answered_ms: 22,
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
    let dir = dir("request");
    let mut a = Registry::join(&dir, "dev").unwrap();
    let mut b = Registry::join(&dir, "dev").unwrap();
    // Both slots belong to this pid here; slots differ.
    assert_ne!(a.slot, b.slot);
    a.request(100).unwrap();
    assert_eq!(b.publish(Entry::default()).unwrap(), 100);
    a.request(0).unwrap();
    assert_eq!(b.publish(Entry::default()).unwrap(), 0);
    let mode = std::fs::metadata(a.path()).unwrap().permissions();
    assert_eq!(std::os::unix::fs::PermissionsExt::mode(&mode) & 0o777, 0o600);
    drop((a, b));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_request_is_posted_only_when_someone_can_help_and_answered_once() {
    let dir = dir("ask");
    let mut a = Registry::join(&dir, "dev").unwrap();
    let mut b = Registry::join(&dir, "dev").unwrap();
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
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn an_answer_stamped_before_the_request_never_counts_even_after_the_clock_steps_back() {
    let dir = dir("clock-step");
    let mut a = Registry::join(&dir, "dev").unwrap();
    let mut b = Registry::join(&dir, "dev").unwrap();
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
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn dead_processes_are_cleared() {
    let dir = dir("dead");
    let mut a = Registry::join(&dir, "dev").unwrap();
    // A slot of a process that no longer exists, asking for memory.
    let ghost = Entry { pid: u32::MAX - 1, request_bytes: 1 << 30, ..Entry::default() };
    a.write_slot(5, &ghost).unwrap();
    assert!(slot_pids(a.path()).unwrap().contains(&ghost.pid), "its slot, before");
    assert_eq!(a.publish(Entry::default()).unwrap(), 0, "a dead process's request is ignored");
    assert_eq!(a.read_slot(5), Some(Entry::default()), "and its slot cleared");
    assert_eq!(slot_pids(a.path()).unwrap(), vec![std::process::id()], "only this process's slot is left");
    drop(a);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_registry_locked_forever_by_another_process_does_not_hang() {
    let dir = dir("locked");
    let mut a = Registry::join(&dir, "dev").unwrap();
    let squatter = File::open(a.path()).unwrap();
    squatter.lock().unwrap();
    let start = Instant::now();
    assert!(a.publish(Entry::default()).unwrap_err().to_string().contains("locked"));
    // LOCK_WAIT is 50 ms; the bound leaves room for a loaded machine.
    assert!(start.elapsed() < Duration::from_secs(2));
    squatter.unlock().unwrap();
    assert!(a.publish(Entry::default()).is_ok());
    drop(a);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_hostile_registry_is_refused_or_harmless() {
    let dir = dir("hostile");
    make_private(&dir);
    // Random bytes: wrong magic, refused.
    let path = dir.join("junk.registry");
    std::fs::write(&path, (0..5000u32).map(|i| (i * 7919 % 251) as u8).collect::<Vec<_>>()).unwrap();
    assert!(Registry::join(&dir, "junk").unwrap_err().to_string().contains("not a version"));
    // Right header, wrong version: refused.
    let mut bad = Vec::from(&MAGIC[..]);
    bad.extend_from_slice(&99u32.to_le_bytes());
    bad.extend_from_slice(&64u32.to_le_bytes());
    std::fs::write(dir.join("v99.registry"), &bad).unwrap();
    assert!(Registry::join(&dir, "v99").is_err());
    // Right header, huge counts and a live pid (ours) asking for everything:
    // the worst outcome is a request to release cache.
    let mut a = Registry::join(&dir, "huge").unwrap();
    let liar = Entry { pid: std::process::id(), request_bytes: u64::MAX, reserved: u64::MAX, heartbeat_ms: now_ms(), ..Entry::default() };
    let others_publish = |a: &mut Registry, entry: &Entry| {
        for slot in (0..SLOTS).filter(|&slot| slot != a.slot) {
            a.write_slot(slot, entry).unwrap();
        }
        a.publish(Entry::default()).unwrap()
    };
    assert_eq!(others_publish(&mut a, &liar), u64::MAX, "saturates, no overflow");
    // The same requests from processes that showed no life for longer
    // than REQUEST_FRESH_MS (stopped mid-wait): not honoured.
    let stale = Entry { heartbeat_ms: now_ms() - REQUEST_FRESH_MS - 1000, ..liar };
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
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn scan_reads_live_entries_and_names_every_file_it_skips() {
    let dir = dir("scan");
    let mut a = Registry::join(&dir, "good").unwrap();
    a.publish(Entry { allocated: 5, reserved: 10, inactive_split: 2, ..Entry::default() }).unwrap();
    // A slot of ours with a damaged checksum is skipped and counted.
    let mut raw = Entry { pid: std::process::id(), reserved: 1, ..Entry::default() }.encode();
    raw[20] ^= 1;
    a.file.write_all_at(&raw, HEADER + SLOT * 9).unwrap();
    std::fs::write(dir.join("junk.registry"), b"not a registry at all, just some text").unwrap();
    std::fs::write(dir.join("short.registry"), &a_header(VERSION)[..5]).unwrap();
    let mut truncated = a_header(VERSION);
    truncated.resize(HEADER as usize + 100, 0);
    std::fs::write(dir.join("truncated.registry"), truncated).unwrap();
    std::fs::write(dir.join("v1.registry"), a_header(1)).unwrap();
    std::fs::write(dir.join("v3.registry"), a_header(3)).unwrap();
    std::fs::write(dir.join("empty.registry"), b"").unwrap();
    std::fs::write(dir.join("not-a-registry.txt"), b"ignored").unwrap();
    std::os::unix::fs::symlink(a.path(), dir.join("link.registry")).unwrap();
    let fifo = dir.join("fifo.registry");
    assert!(std::process::Command::new("mkfifo").arg(&fifo).status().unwrap().success());
    let start = Instant::now();
    let found = scan(&dir);
    assert!(start.elapsed() < Duration::from_secs(5), "a FIFO does not block the scan");
    let mut errors: Vec<(String, ScanError)> =
        found.errors.iter().map(|(p, e)| (p.file_name().unwrap().to_string_lossy().into_owned(), *e)).collect();
    errors.sort();
    assert_eq!(
        errors,
        [
            ("fifo.registry".to_string(), ScanError::Unreadable),
            ("good.registry".to_string(), ScanError::Corrupt),
            ("junk.registry".to_string(), ScanError::Version),
            ("link.registry".to_string(), ScanError::Unreadable),
            ("short.registry".to_string(), ScanError::Truncated),
            ("truncated.registry".to_string(), ScanError::Truncated),
            ("v1.registry".to_string(), ScanError::Version),
            ("v3.registry".to_string(), ScanError::Version),
        ]
    );
    let keys: Vec<&str> = found.registries.iter().map(|r| r.key.as_str()).collect();
    assert_eq!(keys, ["empty", "good"]);
    let good = &found.registries[1].entries;
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
    let _ = std::fs::remove_dir_all(&dir);
}

fn a_header(version: u32) -> Vec<u8> {
    let mut header = Vec::from(&MAGIC[..]);
    header.extend_from_slice(&version.to_le_bytes());
    header.extend_from_slice(&(SLOTS as u32).to_le_bytes());
    header
}

#[test]
fn a_version_1_file_is_taken_over_once_its_processes_are_gone() {
    let dir = dir("v1");
    make_private(&dir);
    let mut v1 = a_header(1);
    v1.resize((HEADER + V1_SLOT * SLOTS as u64) as usize, 0);
    // A live process (this one) in slot 3: refused.
    v1[(HEADER + V1_SLOT * 3) as usize..][..4].copy_from_slice(&std::process::id().to_le_bytes());
    std::fs::write(dir.join("dev.registry"), &v1).unwrap();
    assert!(Registry::join(&dir, "dev").unwrap_err().to_string().contains("not a version 2"));
    // Only dead processes: rewritten as version 2.
    v1[(HEADER + V1_SLOT * 3) as usize..][..4].copy_from_slice(&(u32::MAX - 1).to_le_bytes());
    std::fs::write(dir.join("dev.registry"), &v1).unwrap();
    let a = Registry::join(&dir, "dev").unwrap();
    assert_eq!(std::fs::metadata(a.path()).unwrap().len(), FILE_BYTES);
    assert_eq!(scan(&dir).registries[0].entries.len(), 1);
    drop(a);
    let _ = std::fs::remove_dir_all(&dir);
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
