//! This process's slot in one device's registry: joining (a private
//! folder, a file of the right version), the file's lock, publishing the
//! process's figures, and asking the others for memory.

use std::fs::{File, OpenOptions};
use std::io::ErrorKind;
use std::os::unix::fs::{DirBuilderExt, FileExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::proc_info::process_start;

use super::format::{own_comm, Entry, FILE_BYTES, HEADER, MAGIC, OLD_SLOTS, SLOT, SLOTS, VERSION};

/// How long to wait for the registry's lock before giving up this time.
pub(super) const LOCK_WAIT: Duration = Duration::from_millis(50);
/// Why the registry could not be used (cooperation is then off for it).
#[derive(Debug)]
#[non_exhaustive]
pub enum RegistryError {
    /// An operation on the registry's folder (`path`) or file failed.
    Io { operation: &'static str, path: Option<PathBuf>, error: std::io::Error },
    /// A folder others could read or write: every slot would be theirs.
    NotPrivate { dir: PathBuf, uid: u32, owner: u32, mode: u32 },
    /// A registry name that is not a regular file.
    NotRegularFile { path: PathBuf },
    /// A registry file of another user.
    NotOwned { path: PathBuf, owner: u32, uid: u32 },
    /// Every slot is taken by a live process.
    Full,
    /// Another process held the lock for longer than the wait.
    Locked,
    /// A file that is not a registry of this version.
    Version { path: PathBuf, version: u32, slots: u32 },
}

impl std::fmt::Display for RegistryError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RegistryError::Io { operation, path: Some(path), error } => write!(f, "registry {}: {operation}: {error}", path.display()),
            RegistryError::Io { operation, path: None, error } => write!(f, "registry {operation}: {error}"),
            RegistryError::NotPrivate { dir, uid, owner, mode } => write!(
                f,
                "registry {}: not a directory that only this user (uid {uid}) can use (owner {owner}, mode {mode:o}); \
                 remove it, or set registry_dir",
                dir.display()
            ),
            RegistryError::NotRegularFile { path } => write!(f, "{} is not a regular file", path.display()),
            RegistryError::NotOwned { path, owner, uid } => write!(f, "{} belongs to uid {owner}, not this user ({uid})", path.display()),
            RegistryError::Full => write!(f, "registry full: {SLOTS} processes on one device"),
            RegistryError::Locked => f.write_str("registry locked by another process for too long"),
            RegistryError::Version { path, version, slots } => {
                write!(f, "{} is not a version {VERSION} tidepool registry (found version {version}, {slots} slots)", path.display())
            }
        }
    }
}

impl std::error::Error for RegistryError {
    /// The system's error, for `Io`.
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            RegistryError::Io { error, .. } => Some(error),
            RegistryError::NotPrivate { .. }
            | RegistryError::NotRegularFile { .. }
            | RegistryError::NotOwned { .. }
            | RegistryError::Full
            | RegistryError::Locked
            | RegistryError::Version { .. } => None,
        }
    }
}

/// The error of a read or write of the registry file (its path is known
/// to whoever reports it).
fn io(operation: &'static str) -> impl Fn(std::io::Error) -> RegistryError {
    move |error| RegistryError::Io { operation, path: None, error }
}

/// The wall-clock time in milliseconds since the Unix epoch: what heartbeats are stamped with.
pub fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// This process's user: the owner of its own /proc entry.
pub(super) fn own_uid() -> std::io::Result<u32> {
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
    pub(super) file: File,
    path: PathBuf,
    pub(super) slot: usize,
    pub(super) pid: u32,
    comm: [u8; 16],
    /// When this process started (`Entry::start_ticks`).
    start_ticks: u64,
    /// How often this process publishes (`Entry::interval_ms`).
    interval_ms: u64,
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
    /// Opens (creating if needed) the registry of `key` in `dir` and claims
    /// a slot, for a process that publishes every `interval_ms`.
    pub fn join(dir: &Path, key: &str, interval_ms: u64) -> Result<Registry, RegistryError> {
        let fail = |operation: &'static str, error| RegistryError::Io { operation, path: Some(dir.to_path_buf()), error };
        std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir).map_err(|e| fail("cannot create", e))?;
        // A directory made in advance by someone else (in /tmp, say) would
        // let them read and write every slot: it must be this user's alone.
        let me = own_uid().map_err(|e| fail("cannot tell this user", e))?;
        let meta = std::fs::symlink_metadata(dir).map_err(|e| fail("cannot stat", e))?;
        if !meta.is_dir() || meta.uid() != me || meta.mode() & 0o077 != 0 {
            return Err(RegistryError::NotPrivate { dir: dir.to_path_buf(), uid: me, owner: meta.uid(), mode: meta.mode() & 0o7777 });
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
            return Err(RegistryError::NotRegularFile { path });
        }
        if meta.uid() != me {
            return Err(RegistryError::NotOwned { path, owner: meta.uid(), uid: me });
        }
        let (pid, comm) = (std::process::id(), own_comm());
        let start_ticks = process_start(pid).unwrap_or(0);
        let mut registry = Registry { file, path, slot: 0, pid, comm, start_ticks, interval_ms, saw_request_ms: 0 };
        registry.with_lock(|r| {
            r.slot = r.free_slot()?;
            r.write_slot(r.slot, &r.own_entry(Entry { heartbeat_ms: now_ms(), ..Entry::default() }))
        })?;
        Ok(registry)
    }

    /// A slot no live process holds: free, dead, forged or corrupt (the
    /// lock held).
    fn free_slot(&self) -> Result<usize, RegistryError> {
        (0..SLOTS)
            .find(|&i| match self.read_slot(i) {
                Some(e) => e.pid == 0 || !e.is_live(),
                None => true, // a corrupt slot is nobody's
            })
            .ok_or(RegistryError::Full)
    }

    /// `entry` as this process's: its pid, name, start time and interval.
    fn own_entry(&self, entry: Entry) -> Entry {
        Entry { pid: self.pid, comm: self.comm, start_ticks: self.start_ticks, interval_ms: self.interval_ms, ..entry }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Runs `f` under the registry's exclusive lock, waiting at most
    /// LOCK_WAIT, on a file made whole and of this version first (`heal`):
    /// a file another tidepool rewrote to a version this one does not know
    /// is never written (`RegistryError::Version`).
    fn with_lock<T>(&mut self, f: impl FnOnce(&mut Registry) -> Result<T, RegistryError>) -> Result<T, RegistryError> {
        if !lock_within(&self.file, LOCK_WAIT, false) {
            return Err(RegistryError::Locked);
        }
        let result = self.heal().and_then(|()| f(self));
        let _ = self.file.unlock();
        result
    }

    /// Writes a fresh header and clears every slot: a new file, or one
    /// rebuilt (its live processes claim their slots again at their next
    /// publication, within one reclaim interval).
    fn write_header(&mut self) -> Result<(), RegistryError> {
        let mut fresh = [0u8; FILE_BYTES as usize];
        fresh[0..8].copy_from_slice(MAGIC);
        fresh[8..12].copy_from_slice(&VERSION.to_le_bytes());
        fresh[12..16].copy_from_slice(&(SLOTS as u32).to_le_bytes());
        self.file.write_all_at(&fresh, 0).map_err(io("write"))?;
        self.file.set_len(FILE_BYTES).map_err(io("size"))
    }

    /// Makes the file a whole registry of this version (the lock held):
    /// a new or damaged file (shorter than its header, a header that is no
    /// tidepool registry's) is rebuilt, a short one extended (its slots
    /// kept), an older version's rewritten once none of its processes
    /// lives. A newer version's, or an older one in use, is refused.
    fn heal(&mut self) -> Result<(), RegistryError> {
        let mut header = [0u8; HEADER as usize];
        match self.file.read_exact_at(&mut header, 0) {
            Err(e) if e.kind() == ErrorKind::UnexpectedEof => return self.write_header(),
            Err(e) => return Err(io("read")(e)),
            Ok(()) => {}
        }
        let version = u32::from_le_bytes(header[8..12].try_into().expect("4 bytes"));
        let slots = u32::from_le_bytes(header[12..16].try_into().expect("4 bytes"));
        if &header[0..8] != MAGIC {
            return self.write_header(); // damaged: not a header at all
        }
        if version == VERSION && slots as usize == SLOTS {
            let len = self.file.metadata().map_err(io("stat"))?.len();
            if len < FILE_BYTES {
                self.file.set_len(FILE_BYTES).map_err(io("size"))?; // truncated: the missing slots are free
            }
            return Ok(());
        }
        match OLD_SLOTS.iter().find(|(old, _)| *old == version) {
            // Left by an earlier release whose processes are gone: take it over.
            Some(&(_, slot)) if !self.old_version_in_use(slot) => self.write_header(),
            _ => Err(RegistryError::Version { path: self.path.clone(), version, slots }),
        }
    }

    /// Whether a live process holds a slot of this older file, whose slots
    /// are `slot` bytes (each starts with its pid in every version).
    fn old_version_in_use(&self, slot: u64) -> bool {
        (0..SLOTS as u64).any(|i| {
            let mut pid = [0u8; 4];
            let pid = self.file.read_exact_at(&mut pid, HEADER + slot * i).is_ok().then(|| u32::from_le_bytes(pid));
            pid.is_some_and(|pid| pid != 0 && process_start(pid).is_some())
        })
    }

    /// A slot: `None` when its checksum is wrong, a free entry when the file
    /// is short or unreadable.
    pub(super) fn read_slot(&self, slot: usize) -> Option<Entry> {
        let mut raw = [0u8; SLOT as usize];
        match self.file.read_exact_at(&mut raw, HEADER + SLOT * slot as u64) {
            Ok(()) => Entry::decode(&raw),
            Err(_) => Some(Entry::default()),
        }
    }

    pub(super) fn write_slot(&self, slot: usize, entry: &Entry) -> Result<(), RegistryError> {
        let raw = if entry.pid == 0 { [0u8; SLOT as usize] } else { entry.encode() };
        self.file.write_all_at(&raw, HEADER + SLOT * slot as u64).map_err(io("write"))
    }

    /// Publishes this process's figures (its posted request and answer
    /// stamp are kept from the slot; its counters are the device's, which
    /// restart at `reset_accumulated_memory_stats` as every counter does),
    /// clears dead processes' and corrupt slots, and returns the bytes other
    /// live processes are asking for.
    pub fn publish(&mut self, mut mine: Entry) -> Result<u64, RegistryError> {
        self.with_lock(|r| {
            match r.read_slot(r.slot) {
                Some(previous) if previous.pid == r.pid => {
                    mine.request_bytes = previous.request_bytes;
                    mine.answered_ms = previous.answered_ms;
                }
                // Another live process took the slot (it found it free after
                // the file was rebuilt): this process moves to a free one.
                Some(other) if other.pid != 0 && other.is_live() => {
                    r.slot = r.free_slot()?;
                    mine.request_bytes = 0;
                }
                // Our slot was cleared, taken over or damaged (a rebuild, a
                // hostile or confused writer): claim it again.
                _ => mine.request_bytes = 0,
            }
            let mine = r.own_entry(Entry { heartbeat_ms: now_ms(), ..mine });
            r.write_slot(r.slot, &mine)?;
            let mut asked = 0u64;
            for slot in (0..SLOTS).filter(|&s| s != r.slot) {
                match r.read_slot(slot) {
                    Some(other) if other.pid == 0 => {}
                    Some(other) if other.is_live() => {
                        // A request counts only while its process beats: one
                        // that waits refreshes its heartbeat as it polls
                        // (`answered`), so a request left by a process stopped
                        // mid-wait (SIGSTOP, a frozen cgroup) stops making the
                        // others release their cache; so does one stamped
                        // before the wall clock stepped back (it looks ahead
                        // of ours, and we hold the lock: no writer is newer).
                        if other.is_beating(mine.heartbeat_ms) {
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

    /// Posts a request for `bytes`, if any other live slot that still beats
    /// shows memory it could give back (cached free bytes: whole free
    /// segments, or free pages of holes); `None`, and nothing posted, when
    /// no one can help. A process stopped or hung, or a slot no tidepool
    /// process writes, is not waited for.
    pub fn ask(&mut self, bytes: u64) -> Result<Option<Asked>, RegistryError> {
        self.with_lock(|r| {
            let now = now_ms();
            let helpers: Vec<(usize, u32, u64)> = (0..SLOTS)
                .filter(|&s| s != r.slot)
                .filter_map(|s| r.read_slot(s).map(|e| (s, e)))
                .filter(|(_, e)| e.pid != 0 && e.cached_free > 0 && e.is_beating(now) && e.is_live())
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
    /// after the request, its cache given back since), is gone or has
    /// stopped beating (stopped or hung since it was asked). An answer
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
            let now = now_ms();
            Ok(asked.helpers.iter().all(|&(slot, pid, before)| match r.read_slot(slot) {
                Some(e) if e.pid == pid => {
                    (e.answered_ms != before && e.answered_ms > asked.posted_ms) || !e.is_beating(now) || !e.is_live()
                }
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
        let mine = self.read_slot(self.slot).filter(|e| e.pid == self.pid).unwrap_or_default();
        self.write_slot(self.slot, &self.own_entry(Entry { request_bytes: bytes, heartbeat_ms: now_ms(), ..mine }))
    }

    /// Every live entry (for tests; tools use `scan`).
    pub fn entries(&mut self) -> Result<Vec<Entry>, RegistryError> {
        self.with_lock(|r| Ok((0..SLOTS).filter_map(|s| r.read_slot(s)).filter(Entry::is_live).collect()))
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
pub(super) fn lock_within(file: &File, wait: Duration, shared: bool) -> bool {
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
