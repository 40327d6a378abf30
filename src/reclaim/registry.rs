//! The registry that lets tidepool processes on one device help each other.
//!
//! One small file per device (named by a key all processes agree on, such
//! as a GPU's UUID) in a directory only this user can read (mode 0700/0600).
//! Each process owns a slot and, at every reclaimer pass, publishes its pid,
//! a heartbeat and its figures, and reads the others' slots. A process about
//! to fail posts the bytes it needs; the others' reclaimers see the request
//! within one interval and give back their idle cached segments.
//!
//! The file is untrusted input: every read is bounds-checked, the header is
//! versioned, a lock that is not granted within `LOCK_WAIT` is given up. The
//! worst a corrupt or hostile file can do is make a process release cache
//! it holds: never free live memory, crash or hang.
#![forbid(unsafe_code)]

use std::fs::{File, OpenOptions};
use std::io::ErrorKind;
use std::os::unix::fs::{DirBuilderExt, FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

const MAGIC: &[u8; 8] = b"TIDEPOOL";
const VERSION: u32 = 1;
pub const SLOTS: usize = 64;
const HEADER: u64 = 16;
const SLOT: u64 = 112;
/// How long to wait for the registry's lock before giving up this time.
const LOCK_WAIT: Duration = Duration::from_millis(50);

/// One process's entry, as published.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Entry {
    pub pid: u32,
    pub device: u32,
    /// Milliseconds since the Unix epoch at the last publication.
    pub heartbeat_ms: u64,
    pub reserved: u64,
    pub allocated: u64,
    pub cached_free: u64,
    /// Fragmentation in thousandths.
    pub fragmentation_milli: u64,
    /// Bytes this process needs and could not get (0: none).
    pub request_bytes: u64,
    /// Requests of other processes this one answered by releasing cache.
    pub requests_served: u64,
    /// Bytes given back to the driver, by `Reason` (index).
    pub released: [u64; 6],
}

impl Entry {
    fn encode(&self) -> [u8; SLOT as usize] {
        let mut out = [0u8; SLOT as usize];
        out[0..4].copy_from_slice(&self.pid.to_le_bytes());
        out[4..8].copy_from_slice(&self.device.to_le_bytes());
        let fields = [
            self.heartbeat_ms,
            self.reserved,
            self.allocated,
            self.cached_free,
            self.fragmentation_milli,
            self.request_bytes,
            self.requests_served,
        ];
        for (i, value) in fields.iter().chain(self.released.iter()).enumerate() {
            out[8 + 8 * i..16 + 8 * i].copy_from_slice(&value.to_le_bytes());
        }
        out
    }

    fn decode(raw: &[u8; SLOT as usize]) -> Entry {
        let u64_at = |i: usize| u64::from_le_bytes(raw[8 + 8 * i..16 + 8 * i].try_into().expect("8 bytes"));
        Entry {
            pid: u32::from_le_bytes(raw[0..4].try_into().expect("4 bytes")),
            device: u32::from_le_bytes(raw[4..8].try_into().expect("4 bytes")),
            heartbeat_ms: u64_at(0),
            reserved: u64_at(1),
            allocated: u64_at(2),
            cached_free: u64_at(3),
            fragmentation_milli: u64_at(4),
            request_bytes: u64_at(5),
            requests_served: u64_at(6),
            released: std::array::from_fn(|i| u64_at(7 + i)),
        }
    }
}

/// Why the registry could not be used (cooperation is then off for it).
#[derive(Debug)]
pub struct RegistryError(pub String);

impl std::fmt::Display for RegistryError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// Whether a process with this pid runs (on this machine).
pub fn alive(pid: u32) -> bool {
    pid != 0 && Path::new(&format!("/proc/{pid}")).exists()
}

/// The default directory: `$XDG_RUNTIME_DIR/tidepool`, else `/tmp/tidepool-<uid>`.
pub fn default_dir() -> PathBuf {
    match std::env::var_os("XDG_RUNTIME_DIR") {
        Some(dir) if !dir.is_empty() => PathBuf::from(dir).join("tidepool"),
        _ => {
            // The owner of our own /proc entry is our uid.
            let uid = std::fs::metadata("/proc/self").map(|m| std::os::unix::fs::MetadataExt::uid(&m)).unwrap_or(0);
            PathBuf::from(format!("/tmp/tidepool-{uid}"))
        }
    }
}

/// This process's slot in one device's registry.
#[derive(Debug)]
pub struct Registry {
    file: File,
    path: PathBuf,
    slot: usize,
    pid: u32,
}

impl Registry {
    /// Opens (creating if needed) the registry of `key` in `dir` and claims a slot.
    pub fn join(dir: &Path, key: &str) -> Result<Registry, RegistryError> {
        let fail = |what: &str, e: std::io::Error| RegistryError(format!("registry {}: {what}: {e}", dir.display()));
        std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir).map_err(|e| fail("cannot create", e))?;
        let path = dir.join(format!("{key}.registry"));
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .open(&path)
            .map_err(|e| fail("cannot open", e))?;
        let mut registry = Registry { file, path, slot: 0, pid: std::process::id() };
        registry.with_lock(|r| {
            r.check_or_init_header()?;
            let slot = (0..SLOTS)
                .find(|&i| {
                    let e = r.read_slot(i);
                    e.pid == 0 || !alive(e.pid)
                })
                .ok_or_else(|| RegistryError("registry full: 64 processes on one device".into()))?;
            r.slot = slot;
            r.write_slot(slot, &Entry { pid: r.pid, heartbeat_ms: now_ms(), ..Entry::default() })
        })?;
        Ok(registry)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Runs `f` under the registry's exclusive lock, waiting at most LOCK_WAIT.
    fn with_lock<T>(&mut self, f: impl FnOnce(&mut Registry) -> Result<T, RegistryError>) -> Result<T, RegistryError> {
        let start = Instant::now();
        loop {
            match self.file.try_lock() {
                Ok(()) => break,
                Err(std::fs::TryLockError::WouldBlock) if start.elapsed() < LOCK_WAIT => {
                    std::thread::sleep(Duration::from_millis(1))
                }
                Err(std::fs::TryLockError::WouldBlock) => {
                    return Err(RegistryError("registry locked by another process for too long".into()))
                }
                Err(std::fs::TryLockError::Error(e)) => return Err(RegistryError(format!("registry lock: {e}"))),
            }
        }
        let result = f(self);
        let _ = self.file.unlock();
        result
    }

    fn check_or_init_header(&mut self) -> Result<(), RegistryError> {
        let mut header = [0u8; HEADER as usize];
        match self.file.read_exact_at(&mut header, 0) {
            Err(e) if e.kind() == ErrorKind::UnexpectedEof => {
                let mut fresh = [0u8; HEADER as usize];
                fresh[0..8].copy_from_slice(MAGIC);
                fresh[8..12].copy_from_slice(&VERSION.to_le_bytes());
                fresh[12..16].copy_from_slice(&(SLOTS as u32).to_le_bytes());
                self.file.write_all_at(&fresh, 0).map_err(|e| RegistryError(format!("registry write: {e}")))?;
                self.file.set_len(HEADER + SLOT * SLOTS as u64).map_err(|e| RegistryError(format!("registry size: {e}")))
            }
            Err(e) => Err(RegistryError(format!("registry read: {e}"))),
            Ok(()) => {
                let version = u32::from_le_bytes(header[8..12].try_into().expect("4 bytes"));
                let slots = u32::from_le_bytes(header[12..16].try_into().expect("4 bytes"));
                if &header[0..8] != MAGIC || version != VERSION || slots as usize != SLOTS {
                    return Err(RegistryError(format!(
                        "{} is not a version {VERSION} tidepool registry (found version {version}, {slots} slots)",
                        self.path.display()
                    )));
                }
                Ok(())
            }
        }
    }

    /// A slot, or an empty entry if the file is short or unreadable.
    fn read_slot(&self, slot: usize) -> Entry {
        let mut raw = [0u8; SLOT as usize];
        match self.file.read_exact_at(&mut raw, HEADER + SLOT * slot as u64) {
            Ok(()) => Entry::decode(&raw),
            Err(_) => Entry::default(),
        }
    }

    fn write_slot(&self, slot: usize, entry: &Entry) -> Result<(), RegistryError> {
        self.file
            .write_all_at(&entry.encode(), HEADER + SLOT * slot as u64)
            .map_err(|e| RegistryError(format!("registry write: {e}")))
    }

    /// Publishes this process's figures (its request and service counts
    /// are kept from the slot), clears dead processes' slots, and returns
    /// the bytes other live processes are asking for.
    pub fn publish(&mut self, mut mine: Entry) -> Result<u64, RegistryError> {
        self.with_lock(|r| {
            r.check_or_init_header()?;
            let previous = r.read_slot(r.slot);
            if previous.pid != r.pid {
                // Our slot was taken over (a hostile or confused writer): claim it again.
                mine.request_bytes = 0;
            } else {
                mine.request_bytes = previous.request_bytes;
                mine.requests_served = mine.requests_served.max(previous.requests_served);
            }
            mine.pid = r.pid;
            mine.heartbeat_ms = now_ms();
            r.write_slot(r.slot, &mine)?;
            let mut asked = 0u64;
            for slot in (0..SLOTS).filter(|&s| s != r.slot) {
                let other = r.read_slot(slot);
                if other.pid == 0 {
                    continue;
                }
                if !alive(other.pid) {
                    r.write_slot(slot, &Entry::default())?;
                    continue;
                }
                asked = asked.saturating_add(other.request_bytes);
            }
            Ok(asked)
        })
    }

    /// Posts (or, with 0, withdraws) this process's request for memory.
    pub fn request(&mut self, bytes: u64) -> Result<(), RegistryError> {
        self.with_lock(|r| {
            let mut mine = r.read_slot(r.slot);
            mine.pid = r.pid;
            mine.request_bytes = bytes;
            r.write_slot(r.slot, &mine)
        })
    }

    /// Every live entry (for `tidepool top`).
    pub fn entries(&mut self) -> Result<Vec<Entry>, RegistryError> {
        self.with_lock(|r| Ok((0..SLOTS).map(|s| r.read_slot(s)).filter(|e| alive(e.pid)).collect()))
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        let pid = self.pid;
        if pid != std::process::id() {
            return; // a fork child: the slot is the parent's
        }
        let _ = self.with_lock(|r| {
            if r.read_slot(r.slot).pid == pid {
                r.write_slot(r.slot, &Entry::default())?;
            }
            Ok(())
        });
    }
}

/// Reads the live entries of every registry in `dir` without joining:
/// (registry file, entries).
pub fn scan(dir: &Path) -> Vec<(PathBuf, Vec<Entry>)> {
    let Ok(listing) = std::fs::read_dir(dir) else { return Vec::new() };
    let mut out = Vec::new();
    for item in listing.flatten() {
        let path = item.path();
        if path.extension().is_none_or(|e| e != "registry") {
            continue;
        }
        let Ok(file) = File::open(&path) else { continue };
        let mut header = [0u8; HEADER as usize];
        if file.read_exact_at(&mut header, 0).is_err() || &header[0..8] != MAGIC {
            continue;
        }
        let entries = (0..SLOTS)
            .filter_map(|slot| {
                let mut raw = [0u8; SLOT as usize];
                file.read_exact_at(&mut raw, HEADER + SLOT * slot as u64).ok()?;
                let entry = Entry::decode(&raw);
                alive(entry.pid).then_some(entry)
            })
            .collect();
        out.push((path, entries));
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("tidepool-registry-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }

    #[test]
    fn entries_round_trip_through_their_encoding() {
        let e = Entry {
            pid: 7,
            device: 1,
            heartbeat_ms: 2,
            reserved: 3,
            allocated: 4,
            cached_free: 5,
            fragmentation_milli: 6,
            request_bytes: 8,
            requests_served: 9,
            released: [10, 11, 12, 13, 14, 15],
        };
        assert_eq!(Entry::decode(&e.encode()), e);
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
    fn dead_processes_are_cleared() {
        let dir = dir("dead");
        let mut a = Registry::join(&dir, "dev").unwrap();
        // A slot of a process that no longer exists, asking for memory.
        let ghost = Entry { pid: u32::MAX - 1, request_bytes: 1 << 30, ..Entry::default() };
        a.write_slot(5, &ghost).unwrap();
        assert_eq!(a.publish(Entry::default()).unwrap(), 0, "a dead process's request is ignored");
        assert_eq!(a.read_slot(5), Entry::default(), "and its slot cleared");
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
        assert!(a.publish(Entry::default()).unwrap_err().0.contains("locked"));
        assert!(start.elapsed() < Duration::from_millis(500));
        squatter.unlock().unwrap();
        assert!(a.publish(Entry::default()).is_ok());
        drop(a);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_hostile_registry_is_refused_or_harmless() {
        let dir = dir("hostile");
        std::fs::create_dir_all(&dir).unwrap();
        // Random bytes: wrong magic, refused.
        let path = dir.join("junk.registry");
        std::fs::write(&path, (0..5000u32).map(|i| (i * 7919 % 251) as u8).collect::<Vec<_>>()).unwrap();
        assert!(Registry::join(&dir, "junk").unwrap_err().0.contains("not a version"));
        // Right header, wrong version: refused.
        let mut bad = Vec::from(&MAGIC[..]);
        bad.extend_from_slice(&99u32.to_le_bytes());
        bad.extend_from_slice(&64u32.to_le_bytes());
        std::fs::write(dir.join("v99.registry"), &bad).unwrap();
        assert!(Registry::join(&dir, "v99").is_err());
        // Right header, huge counts and a live pid (ours) asking for everything:
        // the worst outcome is a request to release cache.
        let mut a = Registry::join(&dir, "huge").unwrap();
        let liar = Entry { pid: std::process::id(), request_bytes: u64::MAX, reserved: u64::MAX, ..Entry::default() };
        for slot in 0..SLOTS {
            if slot != a.slot {
                a.write_slot(slot, &liar).unwrap();
            }
        }
        assert_eq!(a.publish(Entry::default()).unwrap(), u64::MAX, "saturates, no overflow");
        // A truncated file reads as empty slots, not a crash.
        a.file.set_len(HEADER + 3).unwrap();
        assert!(a.publish(Entry::default()).is_ok());
        assert!(scan(&dir).iter().all(|(_, entries)| entries.len() <= SLOTS));
        drop(a);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
