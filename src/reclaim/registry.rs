//! The registry that lets tidepool processes on one device help each other
//! and be watched (`tidepool top`, `tidepool exporter`).
//!
//! One small file per device (named by a key all processes agree on, such
//! as a GPU's UUID) in a directory only this user can read (mode 0700/0600).
//! Each process owns a slot and, at every reclaimer pass, publishes its pid,
//! name, a heartbeat and its figures, and reads the others' slots. A process
//! about to fail posts the bytes it needs, but only when another live slot
//! shows memory it could give back (`Registry::ask`); the others'
//! reclaimers see the request within one interval, give back their idle
//! cached segments and stamp their slot as answered, so the asking process
//! knows when waiting longer is for nothing (`Registry::answered`).
//!
//! The file is untrusted input: every read is bounds-checked, the header is
//! versioned, each slot carries a checksum, a lock that is not granted
//! within `LOCK_WAIT` is given up. The worst a corrupt or hostile file can
//! do is make a process release cache it holds: never free live memory,
//! crash or hang. Readers that only watch (`scan`) skip and name what they
//! cannot use.
//!
//! Layout, version 2 (little endian): a 16-byte header (`TIDEPOOL`,
//! version u32, slot count u32), then `SLOTS` slots of `SLOT` bytes: pid
//! u32, device u32, the `U64_FIELDS` u64 figures of `Entry` in its order,
//! the process name (16 bytes, NUL padded), `answered_ms` u64 (once the
//! spare bytes: 0 from writers that predate it), and the FNV-1a checksum of
//! everything before it. A slot whose pid is 0 is free.
//! Version 1 (112-byte slots without name, checksum or the newer figures)
//! is refused while one of its processes lives and rewritten once none does.
#![forbid(unsafe_code)]

use std::fs::{File, OpenOptions};
use std::io::ErrorKind;
use std::os::unix::fs::{DirBuilderExt, FileExt, FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

const MAGIC: &[u8; 8] = b"TIDEPOOL";
pub const VERSION: u32 = 2;
pub const SLOTS: usize = 64;
const HEADER: u64 = 16;
const SLOT: u64 = 192;
/// The bytes of a whole registry file.
pub const FILE_BYTES: u64 = HEADER + SLOT * SLOTS as u64;
/// The u64 figures of a slot, after pid and device.
const U64_FIELDS: usize = 19;
const COMM_AT: usize = 8 + 8 * U64_FIELDS;
const ANSWERED_AT: usize = COMM_AT + 16;
const CHECKSUM_AT: usize = SLOT as usize - 8;
/// Version 1's slot size, to tell whether an old file is still in use.
const V1_SLOT: u64 = 112;
/// How long to wait for the registry's lock before giving up this time.
const LOCK_WAIT: Duration = Duration::from_millis(50);
/// A request counts only while its process showed life this recently: one
/// that waits refreshes its heartbeat as it polls (`answered`), so a
/// request left by a process stopped mid-wait (SIGSTOP, a frozen cgroup)
/// stops making the others release their cache. A heartbeat ahead of the
/// reader's clock (written before the wall clock stepped back) shows no
/// life: a stopped asker's request does not outlive a step back.
pub const REQUEST_FRESH_MS: u64 = 10_000;
/// Files `scan` reads in one directory at most (the rest are counted).
pub const MAX_FILES: usize = 256;

/// One process's entry, as published.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Entry {
    pub pid: u32,
    /// The device's index in that process (its `CUDA_VISIBLE_DEVICES` order).
    pub device: u32,
    /// Milliseconds since the Unix epoch at the last publication.
    pub heartbeat_ms: u64,
    pub reserved: u64,
    pub allocated: u64,
    pub cached_free: u64,
    /// Of `cached_free`, the bytes inside partly used segments
    /// (`inactive_split_bytes`): fragmentation is this over `reserved`.
    pub inactive_split: u64,
    pub largest_free_block: u64,
    /// Bytes this process needs and could not get (0: none).
    pub request_bytes: u64,
    /// Requests of other processes this one answered by releasing cache.
    pub requests_served: u64,
    /// Requests for memory this process posted to the others.
    pub requests_posted: u64,
    /// Requests that failed for lack of memory.
    pub ooms: u64,
    /// The device's total and free bytes at the last publication (0: unknown).
    pub device_total: u64,
    pub device_free: u64,
    /// Bytes of paused tags (given back, addresses kept: not in `reserved`).
    pub paused: u64,
    /// Bytes given back to the driver, by `Reason` (index).
    pub released: [u64; 6],
    /// The process's name (`/proc/PID/comm`), NUL padded.
    pub comm: [u8; 16],
    /// The heartbeat of the last publication that saw another process's
    /// request, stamped once the cache was given back (0: never).
    pub answered_ms: u64,
}

/// FNV-1a, 64 bits: the slot checksum.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3))
}

impl Entry {
    fn figures(&self) -> [u64; U64_FIELDS] {
        let r = &self.released;
        [
            self.heartbeat_ms,
            self.reserved,
            self.allocated,
            self.cached_free,
            self.inactive_split,
            self.largest_free_block,
            self.request_bytes,
            self.requests_served,
            self.requests_posted,
            self.ooms,
            self.device_total,
            self.device_free,
            self.paused,
            r[0],
            r[1],
            r[2],
            r[3],
            r[4],
            r[5],
        ]
    }

    fn encode(&self) -> [u8; SLOT as usize] {
        let mut out = [0u8; SLOT as usize];
        out[0..4].copy_from_slice(&self.pid.to_le_bytes());
        out[4..8].copy_from_slice(&self.device.to_le_bytes());
        for (i, value) in self.figures().iter().enumerate() {
            out[8 + 8 * i..16 + 8 * i].copy_from_slice(&value.to_le_bytes());
        }
        out[COMM_AT..COMM_AT + 16].copy_from_slice(&self.comm);
        out[ANSWERED_AT..ANSWERED_AT + 8].copy_from_slice(&self.answered_ms.to_le_bytes());
        let sum = fnv1a(&out[..CHECKSUM_AT]);
        out[CHECKSUM_AT..].copy_from_slice(&sum.to_le_bytes());
        out
    }

    /// The entry of a slot; `None` when its checksum does not match (a
    /// free slot, all zero, decodes to the default entry).
    fn decode(raw: &[u8]) -> Option<Entry> {
        let raw: &[u8; SLOT as usize] = raw.try_into().ok()?;
        let u32_at = |at: usize| u32::from_le_bytes(raw[at..at + 4].try_into().expect("4 bytes"));
        let u64_at = |at: usize| u64::from_le_bytes(raw[at..at + 8].try_into().expect("8 bytes"));
        let pid = u32_at(0);
        if pid == 0 {
            return Some(Entry::default());
        }
        if u64_at(CHECKSUM_AT) != fnv1a(&raw[..CHECKSUM_AT]) {
            return None;
        }
        let f: [u64; U64_FIELDS] = std::array::from_fn(|i| u64_at(8 + 8 * i));
        Some(Entry {
            pid,
            device: u32_at(4),
            heartbeat_ms: f[0],
            reserved: f[1],
            allocated: f[2],
            cached_free: f[3],
            inactive_split: f[4],
            largest_free_block: f[5],
            request_bytes: f[6],
            requests_served: f[7],
            requests_posted: f[8],
            ooms: f[9],
            device_total: f[10],
            device_free: f[11],
            paused: f[12],
            released: [f[13], f[14], f[15], f[16], f[17], f[18]],
            comm: raw[COMM_AT..COMM_AT + 16].try_into().expect("16 bytes"),
            answered_ms: u64_at(ANSWERED_AT),
        })
    }

    /// The process name as text (invalid UTF-8 replaced).
    pub fn comm(&self) -> String {
        let end = self.comm.iter().position(|&b| b == 0).unwrap_or(self.comm.len());
        String::from_utf8_lossy(&self.comm[..end]).into_owned()
    }

    /// `inactive_split / reserved` ([`crate::Stats::fragmentation`]).
    pub fn fragmentation(&self) -> f64 {
        crate::stats::fragmentation(self.inactive_split, self.reserved)
    }
}

/// This process's name, as `/proc/self/comm` gives it (at most 15 bytes).
fn own_comm() -> [u8; 16] {
    let mut comm = [0u8; 16];
    if let Ok(text) = std::fs::read("/proc/self/comm") {
        let text = text.strip_suffix(b"\n").unwrap_or(&text);
        let n = text.len().min(15);
        comm[..n].copy_from_slice(&text[..n]);
    }
    comm
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

/// This process's user: the owner of its own /proc entry.
fn own_uid() -> std::io::Result<u32> {
    std::fs::metadata("/proc/self").map(|m| m.uid())
}

/// The default directory: `$XDG_RUNTIME_DIR/tidepool`, else `/tmp/tidepool-<uid>`.
pub fn default_dir() -> PathBuf {
    match std::env::var_os("XDG_RUNTIME_DIR") {
        Some(dir) if !dir.is_empty() => PathBuf::from(dir).join("tidepool"),
        _ => PathBuf::from(format!("/tmp/tidepool-{}", own_uid().unwrap_or(0))),
    }
}

/// This process's slot in one device's registry.
#[derive(Debug)]
pub struct Registry {
    file: File,
    path: PathBuf,
    slot: usize,
    pid: u32,
    comm: [u8; 16],
    /// The heartbeat of the last publication that saw a request (0: none
    /// since the last `mark_answered`).
    saw_request_ms: u64,
}

/// A request posted by `Registry::ask`: when, and which slots could help.
#[derive(Clone, Debug)]
pub struct Asked {
    pub posted_ms: u64,
    /// (slot, pid, answer stamp at the time of asking) of each live
    /// process that showed memory to give back.
    pub helpers: Vec<(usize, u32, u64)>,
}

impl Registry {
    /// Opens (creating if needed) the registry of `key` in `dir` and claims a slot.
    pub fn join(dir: &Path, key: &str) -> Result<Registry, RegistryError> {
        let fail = |what: &str, e: std::io::Error| RegistryError(format!("registry {}: {what}: {e}", dir.display()));
        std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir).map_err(|e| fail("cannot create", e))?;
        // A directory made in advance by someone else (in /tmp, say) would
        // let them read and write every slot: it must be this user's alone.
        let me = own_uid().map_err(|e| fail("cannot tell this user", e))?;
        let meta = std::fs::symlink_metadata(dir).map_err(|e| fail("cannot stat", e))?;
        if !meta.is_dir() || meta.uid() != me || meta.mode() & 0o077 != 0 {
            return Err(RegistryError(format!(
                "registry {}: not a directory that only this user (uid {me}) can use (owner {}, mode {:o}); \
                 remove it, or set registry_dir",
                dir.display(),
                meta.uid(),
                meta.mode() & 0o7777
            )));
        }
        let path = dir.join(format!("{key}.registry"));
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&path)
            .map_err(|e| fail("cannot open", e))?;
        let meta = file.metadata().map_err(|e| fail("cannot stat", e))?;
        if !meta.file_type().is_file() {
            return Err(RegistryError(format!("{} is not a regular file", path.display())));
        }
        if meta.uid() != me {
            return Err(RegistryError(format!("{} belongs to uid {}, not this user ({me})", path.display(), meta.uid())));
        }
        let comm = own_comm();
        let mut registry = Registry { file, path, slot: 0, pid: std::process::id(), comm, saw_request_ms: 0 };
        registry.with_lock(|r| {
            r.check_or_init_header()?;
            let slot = (0..SLOTS)
                .find(|&i| match r.read_slot(i) {
                    Some(e) => e.pid == 0 || !alive(e.pid),
                    None => true, // a corrupt slot is nobody's
                })
                .ok_or_else(|| RegistryError("registry full: 64 processes on one device".into()))?;
            r.slot = slot;
            r.write_slot(slot, &Entry { pid: r.pid, heartbeat_ms: now_ms(), comm: r.comm, ..Entry::default() })
        })?;
        Ok(registry)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Runs `f` under the registry's exclusive lock, waiting at most LOCK_WAIT.
    fn with_lock<T>(&mut self, f: impl FnOnce(&mut Registry) -> Result<T, RegistryError>) -> Result<T, RegistryError> {
        if !lock_within(&self.file, LOCK_WAIT, false) {
            return Err(RegistryError("registry locked by another process for too long".into()));
        }
        let result = f(self);
        let _ = self.file.unlock();
        result
    }

    fn write_header(&mut self) -> Result<(), RegistryError> {
        let mut fresh = [0u8; FILE_BYTES as usize];
        fresh[0..8].copy_from_slice(MAGIC);
        fresh[8..12].copy_from_slice(&VERSION.to_le_bytes());
        fresh[12..16].copy_from_slice(&(SLOTS as u32).to_le_bytes());
        self.file.write_all_at(&fresh, 0).map_err(|e| RegistryError(format!("registry write: {e}")))?;
        self.file.set_len(FILE_BYTES).map_err(|e| RegistryError(format!("registry size: {e}")))
    }

    fn check_or_init_header(&mut self) -> Result<(), RegistryError> {
        let mut header = [0u8; HEADER as usize];
        match self.file.read_exact_at(&mut header, 0) {
            Err(e) if e.kind() == ErrorKind::UnexpectedEof => self.write_header(),
            Err(e) => Err(RegistryError(format!("registry read: {e}"))),
            Ok(()) => {
                let version = u32::from_le_bytes(header[8..12].try_into().expect("4 bytes"));
                let slots = u32::from_le_bytes(header[12..16].try_into().expect("4 bytes"));
                if &header[0..8] == MAGIC && version == VERSION && slots as usize == SLOTS {
                    return Ok(());
                }
                if &header[0..8] == MAGIC && version == 1 && !self.v1_in_use() {
                    // Left by an earlier release whose processes are gone: take it over.
                    return self.write_header();
                }
                Err(RegistryError(format!(
                    "{} is not a version {VERSION} tidepool registry (found version {version}, {slots} slots)",
                    self.path.display()
                )))
            }
        }
    }

    /// Whether a live process holds a slot of this version 1 file.
    fn v1_in_use(&self) -> bool {
        (0..SLOTS as u64).any(|slot| {
            let mut pid = [0u8; 4];
            self.file.read_exact_at(&mut pid, HEADER + V1_SLOT * slot).is_ok() && alive(u32::from_le_bytes(pid))
        })
    }

    /// A slot: `None` when its checksum is wrong, a free entry when the file
    /// is short or unreadable.
    fn read_slot(&self, slot: usize) -> Option<Entry> {
        let mut raw = [0u8; SLOT as usize];
        match self.file.read_exact_at(&mut raw, HEADER + SLOT * slot as u64) {
            Ok(()) => Entry::decode(&raw),
            Err(_) => Some(Entry::default()),
        }
    }

    fn write_slot(&self, slot: usize, entry: &Entry) -> Result<(), RegistryError> {
        let raw = if entry.pid == 0 { [0u8; SLOT as usize] } else { entry.encode() };
        self.file.write_all_at(&raw, HEADER + SLOT * slot as u64).map_err(|e| RegistryError(format!("registry write: {e}")))
    }

    /// Publishes this process's figures (its posted request and answer
    /// stamp are kept from the slot; its counters are the device's, which
    /// restart at `reset_accumulated_memory_stats` as every counter does),
    /// clears dead processes' and corrupt slots, and returns the bytes other
    /// live processes are asking for.
    pub fn publish(&mut self, mut mine: Entry) -> Result<u64, RegistryError> {
        self.with_lock(|r| {
            r.check_or_init_header()?;
            match r.read_slot(r.slot) {
                Some(previous) if previous.pid == r.pid => {
                    mine.request_bytes = previous.request_bytes;
                    mine.answered_ms = previous.answered_ms;
                }
                // Our slot was taken over or damaged (a hostile or confused writer): claim it again.
                _ => mine.request_bytes = 0,
            }
            mine.pid = r.pid;
            mine.comm = r.comm;
            mine.heartbeat_ms = now_ms();
            r.write_slot(r.slot, &mine)?;
            let mut asked = 0u64;
            for slot in (0..SLOTS).filter(|&s| s != r.slot) {
                match r.read_slot(slot) {
                    Some(other) if other.pid == 0 => {}
                    Some(other) if alive(other.pid) => {
                        // A heartbeat later than ours was written before the wall
                        // clock stepped back (we hold the lock, so no writer is
                        // newer): no life since, as far as this clock can tell. A
                        // waiting asker refreshes it at its next poll.
                        let since = mine.heartbeat_ms.checked_sub(other.heartbeat_ms);
                        if since.is_some_and(|ms| ms <= REQUEST_FRESH_MS) {
                            asked = asked.saturating_add(other.request_bytes);
                        }
                    }
                    _ => r.write_slot(slot, &Entry::default())?,
                }
            }
            if asked > 0 {
                r.saw_request_ms = mine.heartbeat_ms;
            }
            Ok(asked)
        })
    }

    /// Stamps this slot as having answered the requests the last
    /// publication saw (call once the cache is given back). Nothing when
    /// that publication saw none.
    pub fn mark_answered(&mut self) -> Result<(), RegistryError> {
        let seen = std::mem::take(&mut self.saw_request_ms);
        if seen == 0 {
            return Ok(());
        }
        self.with_lock(|r| match r.read_slot(r.slot) {
            Some(mut mine) if mine.pid == r.pid => {
                // The stamp of this answer, even below the last one's: the
                // wall clock may have stepped back in between.
                mine.answered_ms = seen;
                r.write_slot(r.slot, &mine)
            }
            _ => Ok(()),
        })
    }

    /// Posts a request for `bytes`, if any other live slot shows memory it
    /// could give back (cached free bytes: whole free segments, or free
    /// pages of holes); `None`, and nothing posted, when no one can help.
    pub fn ask(&mut self, bytes: u64) -> Result<Option<Asked>, RegistryError> {
        self.with_lock(|r| {
            let helpers: Vec<(usize, u32, u64)> = (0..SLOTS)
                .filter(|&s| s != r.slot)
                .filter_map(|s| r.read_slot(s).map(|e| (s, e)))
                .filter(|(_, e)| e.pid != 0 && e.cached_free > 0 && alive(e.pid))
                .map(|(s, e)| (s, e.pid, e.answered_ms))
                .collect();
            if helpers.is_empty() {
                return Ok(None);
            }
            r.write_request(bytes)?;
            // After the write: a publication stamped later has seen the request.
            Ok(Some(Asked { posted_ms: now_ms(), helpers }))
        })
    }

    /// Whether every helper of `asked` has answered it (a publication
    /// after the request, its cache given back since) or is gone. An answer
    /// is a new stamp later than the request: a stamp left from before it
    /// never counts, even one that looks later because the wall clock
    /// stepped back since.
    pub fn answered(&mut self, asked: &Asked) -> Result<bool, RegistryError> {
        self.with_lock(|r| {
            // Still waiting: the request stays fresh (`REQUEST_FRESH_MS`).
            if let Some(mut mine) = r.read_slot(r.slot).filter(|e| e.pid == r.pid) {
                mine.heartbeat_ms = now_ms();
                r.write_slot(r.slot, &mine)?;
            }
            Ok(asked.helpers.iter().all(|&(slot, pid, before)| match r.read_slot(slot) {
                Some(e) if e.pid == pid => (e.answered_ms != before && e.answered_ms > asked.posted_ms) || !alive(pid),
                _ => true, // the slot was left or taken over: that process is gone
            }))
        })
    }

    /// Posts (or, with 0, withdraws) this process's request for memory.
    pub fn request(&mut self, bytes: u64) -> Result<(), RegistryError> {
        self.with_lock(|r| r.write_request(bytes))
    }

    /// Writes `bytes` as this slot's request (the lock held).
    fn write_request(&self, bytes: u64) -> Result<(), RegistryError> {
        let mut mine = self.read_slot(self.slot).filter(|e| e.pid == self.pid).unwrap_or_default();
        mine.pid = self.pid;
        mine.comm = self.comm;
        mine.request_bytes = bytes;
        mine.heartbeat_ms = now_ms();
        self.write_slot(self.slot, &mine)
    }

    /// Every live entry (for tests; tools use `scan`).
    pub fn entries(&mut self) -> Result<Vec<Entry>, RegistryError> {
        self.with_lock(|r| Ok((0..SLOTS).filter_map(|s| r.read_slot(s)).filter(|e| alive(e.pid)).collect()))
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        let pid = self.pid;
        if pid != std::process::id() {
            return; // a fork child: the slot is the parent's
        }
        let _ = self.with_lock(|r| {
            if r.read_slot(r.slot).is_some_and(|e| e.pid == pid) {
                r.write_slot(r.slot, &Entry::default())?;
            }
            Ok(())
        });
    }
}

/// Takes `file`'s lock (shared or exclusive), trying for at most `wait`.
fn lock_within(file: &File, wait: Duration, shared: bool) -> bool {
    let start = Instant::now();
    loop {
        let attempt = if shared { file.try_lock_shared() } else { file.try_lock() };
        match attempt {
            Ok(()) => return true,
            Err(std::fs::TryLockError::WouldBlock) if start.elapsed() < wait => std::thread::sleep(Duration::from_millis(1)),
            Err(_) => return false,
        }
    }
}

/// Why `scan` skipped a registry file or a slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ScanError {
    /// Not a regular file, or it could not be opened or read.
    Unreadable,
    /// Shorter than a whole registry.
    Truncated,
    /// Not a tidepool registry, or of another version or slot count.
    Version,
    /// A slot whose checksum does not match.
    Corrupt,
    /// Locked by a writer for longer than the lock wait.
    Locked,
    /// Past `MAX_FILES` in one directory.
    TooMany,
}

impl ScanError {
    pub const ALL: [ScanError; 6] =
        [ScanError::Unreadable, ScanError::Truncated, ScanError::Version, ScanError::Corrupt, ScanError::Locked, ScanError::TooMany];

    pub fn name(self) -> &'static str {
        match self {
            ScanError::Unreadable => "unreadable",
            ScanError::Truncated => "truncated",
            ScanError::Version => "version",
            ScanError::Corrupt => "corrupt",
            ScanError::Locked => "locked",
            ScanError::TooMany => "too_many",
        }
    }
}

/// One device's registry as `scan` read it.
#[derive(Clone, Debug)]
pub struct DeviceRegistry {
    pub path: PathBuf,
    /// The device's key: the file name without `.registry`.
    pub key: String,
    /// The entries of live processes.
    pub entries: Vec<Entry>,
}

/// What `scan` found in a directory.
#[derive(Clone, Debug, Default)]
pub struct Scan {
    /// Registries by path.
    pub registries: Vec<DeviceRegistry>,
    /// What was skipped, and why (a file, or one slot of it).
    pub errors: Vec<(PathBuf, ScanError)>,
}

/// Reads the live entries of every registry in `dir` without joining,
/// each file in one read under a shared lock; files and slots that cannot
/// be used are skipped and named in `errors`. A missing directory is an
/// empty scan (no process has made it yet).
pub fn scan(dir: &Path) -> Scan {
    let mut out = Scan::default();
    let listing = match std::fs::read_dir(dir) {
        Ok(listing) => listing,
        // No process has made it yet: nothing to show.
        Err(e) if e.kind() == ErrorKind::NotFound => return out,
        // Another user's, or not a directory: an error to show, not "no processes".
        Err(_) => {
            out.errors.push((dir.to_path_buf(), ScanError::Unreadable));
            return out;
        }
    };
    let mut paths: Vec<PathBuf> =
        listing.flatten().map(|item| item.path()).filter(|path| path.extension().is_some_and(|e| e == "registry")).collect();
    paths.sort();
    for (index, path) in paths.into_iter().enumerate() {
        if index >= MAX_FILES {
            out.errors.push((path, ScanError::TooMany));
            continue;
        }
        match read_registry(&path) {
            Ok((entries, corrupt)) => {
                out.errors.extend(std::iter::repeat_n((path.clone(), ScanError::Corrupt), corrupt));
                let key = path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
                out.registries.push(DeviceRegistry { path, key, entries });
            }
            Err(error) => out.errors.push((path, error)),
        }
    }
    out
}

/// The live entries of one registry file and the count of corrupt slots.
fn read_registry(path: &Path) -> Result<(Vec<Entry>, usize), ScanError> {
    let (entries, corrupt) = read_slots(path)?;
    Ok((entries.into_iter().filter(|e| alive(e.pid)).collect(), corrupt))
}

/// The pid of every slot of the registry file at `path` that names a
/// process, live or dead: a dead one's slot is cleared by the next live
/// process that publishes (tests and diagnostics).
pub fn slot_pids(path: &Path) -> Result<Vec<u32>, ScanError> {
    Ok(read_slots(path)?.0.into_iter().map(|e| e.pid).collect())
}

/// Every occupied slot of one registry file, live or dead, and the count
/// of corrupt slots.
fn read_slots(path: &Path) -> Result<(Vec<Entry>, usize), ScanError> {
    // Never follow a link nor wait on a FIFO someone named *.registry.
    let file =
        OpenOptions::new().read(true).custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK).open(path).map_err(|_| ScanError::Unreadable)?;
    let meta = file.metadata().map_err(|_| ScanError::Unreadable)?;
    if !meta.file_type().is_file() || meta.file_type().is_fifo() {
        return Err(ScanError::Unreadable);
    }
    if !lock_within(&file, LOCK_WAIT, true) {
        return Err(ScanError::Locked);
    }
    let mut raw = vec![0u8; FILE_BYTES as usize];
    let read = read_all_at(&file, &mut raw);
    let _ = file.unlock();
    let read = read.map_err(|_| ScanError::Unreadable)?;
    if read == 0 {
        return Ok((Vec::new(), 0)); // just created: its first process is writing the header
    }
    if read < MAGIC.len() {
        return Err(ScanError::Truncated);
    }
    if &raw[0..8] != MAGIC {
        return Err(ScanError::Version);
    }
    if read < HEADER as usize {
        return Err(ScanError::Truncated);
    }
    let version = u32::from_le_bytes(raw[8..12].try_into().expect("4 bytes"));
    let slots = u32::from_le_bytes(raw[12..16].try_into().expect("4 bytes"));
    if version != VERSION || slots as usize != SLOTS {
        return Err(ScanError::Version);
    }
    if read < FILE_BYTES as usize {
        return Err(ScanError::Truncated);
    }
    let mut corrupt = 0;
    let mut entries = Vec::new();
    for slot in raw[HEADER as usize..].chunks_exact(SLOT as usize) {
        match Entry::decode(slot) {
            Some(entry) if entry.pid != 0 => entries.push(entry),
            Some(_) => {}
            None => corrupt += 1,
        }
    }
    Ok((entries, corrupt))
}

/// Writes a whole registry file holding `entries` in its first slots
/// (at most `SLOTS`), replacing `path`: what the readers (`scan`, top, the
/// exporter) are tested and measured against, without a process per entry.
pub fn write_file(path: &Path, entries: &[Entry]) -> std::io::Result<()> {
    let mut raw = vec![0u8; FILE_BYTES as usize];
    raw[0..8].copy_from_slice(MAGIC);
    raw[8..12].copy_from_slice(&VERSION.to_le_bytes());
    raw[12..16].copy_from_slice(&(SLOTS as u32).to_le_bytes());
    for (slot, entry) in raw[HEADER as usize..].chunks_exact_mut(SLOT as usize).zip(entries) {
        slot.copy_from_slice(&entry.encode());
    }
    std::fs::write(path, raw)
}

/// Reads into `buf` from offset 0 until it is full or the file ends; the bytes read.
fn read_all_at(file: &File, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut done = 0;
    while done < buf.len() {
        match file.read_at(&mut buf[done..], done as u64) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(done)
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let err = Registry::join(&dir, "dev").unwrap_err().0;
        assert!(err.contains("only this user") && err.contains("mode 777"), "{err}");
        assert!(!dir.join("dev.registry").exists(), "nothing was created in it");
        // A link to a private directory is not one either.
        let private = dir.with_extension("private");
        make_private(&private);
        let link = dir.with_extension("link");
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(&private, &link).unwrap();
        assert!(Registry::join(&link, "dev").unwrap_err().0.contains("only this user"));
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
        assert!(a.publish(Entry::default()).unwrap_err().0.contains("locked"));
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
        let liar =
            Entry { pid: std::process::id(), request_bytes: u64::MAX, reserved: u64::MAX, heartbeat_ms: now_ms(), ..Entry::default() };
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
        assert!(Registry::join(&dir, "dev").unwrap_err().0.contains("not a version 2"));
        // Only dead processes: rewritten as version 2.
        v1[(HEADER + V1_SLOT * 3) as usize..][..4].copy_from_slice(&(u32::MAX - 1).to_le_bytes());
        std::fs::write(dir.join("dev.registry"), &v1).unwrap();
        let a = Registry::join(&dir, "dev").unwrap();
        assert_eq!(std::fs::metadata(a.path()).unwrap().len(), FILE_BYTES);
        assert_eq!(scan(&dir).registries[0].entries.len(), 1);
        drop(a);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
