//! The host backend's shared capacity (`host_shared`): one file through
//! which every process that names it shares each device's capacity, as
//! processes share one GPU, and, as on a GPU, what a process holds is given
//! back when it ends, cleanly or killed.
//!
//! The file (little endian): a 16-byte header (`TPHOSTSC`, version u32,
//! device columns u32), then `SLOTS` slots of `SLOT` bytes, one per
//! process: pid u32, 4 bytes unused, the process's start time u64 (clock
//! ticks after boot, as /proc/PID/stat gives it: a reused pid does not
//! match), then the bytes it holds of each of `MAX_DEVICES` devices (u64
//! each). A slot whose pid is 0 is free.
//!
//! Every change happens under the file's exclusive lock: a process charges
//! its own slot, and a slot whose process no longer runs counts for
//! nothing and is cleared by the next charge (its capacity is free again).
//! Reads take the shared lock and count live processes only. A file of
//! another format (the older one: a bare u64 per device, which never knew
//! who held what) is rewritten in this one; a file of a newer version is
//! refused.

use std::fs::File;
use std::io::{self, ErrorKind};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use crate::proc_info::{is_running, process_start};
use crate::sync::Mutex;

const MAGIC: &[u8; 8] = b"TPHOSTSC";
const VERSION: u32 = 2;
/// The devices one file counts.
pub const MAX_DEVICES: usize = 16;
/// The processes one file counts at once.
const SLOTS: usize = 256;
const HEADER: usize = 16;
const SLOT: usize = 16 + 8 * MAX_DEVICES;
const FILE_BYTES: usize = HEADER + SLOTS * SLOT;

/// One process's view of a shared capacity file.
pub struct SharedCapacity {
    pub path: PathBuf,
    file: File,
    pid: u32,
    start: u64,
    /// Keeps this process's threads apart: the file's lock belongs to the
    /// open file, which they share, so it orders processes only.
    threads: Mutex<()>,
}

/// A slot as read: whose it is and what it holds.
struct Slot {
    pid: u32,
    start: u64,
    held: [u64; MAX_DEVICES],
}

impl Slot {
    fn read(table: &[u8], index: usize) -> Slot {
        let raw = &table[HEADER + index * SLOT..][..SLOT];
        let u64_at = |at: usize| u64::from_le_bytes(raw[at..at + 8].try_into().expect("8 bytes"));
        Slot {
            pid: u32::from_le_bytes(raw[0..4].try_into().expect("4 bytes")),
            start: u64_at(8),
            held: std::array::from_fn(|device| u64_at(16 + 8 * device)),
        }
    }

    fn encode(&self) -> [u8; SLOT] {
        let mut raw = [0u8; SLOT];
        raw[0..4].copy_from_slice(&self.pid.to_le_bytes());
        raw[8..16].copy_from_slice(&self.start.to_le_bytes());
        for (device, bytes) in self.held.iter().enumerate() {
            raw[16 + 8 * device..24 + 8 * device].copy_from_slice(&bytes.to_le_bytes());
        }
        raw
    }
}

impl SharedCapacity {
    /// Opens (or makes) the file at `path` for a backend of `devices` devices.
    pub fn open(path: &Path, devices: usize) -> io::Result<SharedCapacity> {
        if devices > MAX_DEVICES {
            return Err(io::Error::new(ErrorKind::InvalidInput, format!("a shared capacity counts at most {MAX_DEVICES} devices")));
        }
        let file = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(false).mode(0o600).open(path)?;
        let pid = std::process::id();
        let start = process_start(pid).unwrap_or(0);
        let shared = SharedCapacity { path: path.to_path_buf(), file, pid, start, threads: Mutex::new(()) };
        shared.locked(false, |table| match table.get(..8) {
            Some(magic) if magic == MAGIC && version(table) > VERSION => Err(io::Error::new(
                ErrorKind::InvalidData,
                format!("written by a newer tidepool (version {} of its format; this one reads {VERSION})", version(table)),
            )),
            Some(magic) if magic == MAGIC && table.len() == FILE_BYTES => Ok(()),
            _ => shared.initialize(),
        })?;
        Ok(shared)
    }

    /// Writes an empty table of this format over whatever the file holds.
    fn initialize(&self) -> io::Result<()> {
        let mut raw = vec![0u8; FILE_BYTES];
        raw[0..8].copy_from_slice(MAGIC);
        raw[8..12].copy_from_slice(&VERSION.to_le_bytes());
        raw[12..16].copy_from_slice(&(MAX_DEVICES as u32).to_le_bytes());
        self.file.set_len(0)?;
        self.file.write_all_at(&raw, 0)
    }

    /// Runs `f` on the whole file, read under its lock (shared or exclusive)
    /// and, within this process, one thread at a time. The file is read at
    /// its offsets, not through the position its handle shares.
    fn locked<R>(&self, shared: bool, f: impl FnOnce(&[u8]) -> io::Result<R>) -> io::Result<R> {
        let _one_thread = self.threads.lock();
        if shared {
            self.file.lock_shared()?;
        } else {
            self.file.lock()?;
        }
        let result = self.read_table().and_then(|table| f(&table));
        self.file.unlock()?;
        result
    }

    /// The file's first `FILE_BYTES` bytes (fewer when it is shorter).
    fn read_table(&self) -> io::Result<Vec<u8>> {
        let mut table = vec![0u8; FILE_BYTES];
        let mut filled = 0;
        while filled < FILE_BYTES {
            match self.file.read_at(&mut table[filled..], filled as u64) {
                Ok(0) => break,
                Ok(n) => filled += n,
                Err(err) if err.kind() == ErrorKind::Interrupted => {}
                Err(err) => return Err(err),
            }
        }
        table.truncate(filled);
        Ok(table)
    }

    /// The bytes of `device` held by the processes that still run.
    pub fn used(&self, device: usize) -> io::Result<u64> {
        self.locked(true, |table| {
            let slots = (0..SLOTS).map(|i| Slot::read(table, i));
            Ok(slots.filter(|s| s.pid != 0 && self.is_live(s)).map(|s| s.held[device]).sum())
        })
    }

    /// Adds `delta` to what this process holds of `device` if the sum over
    /// every live process stays within `capacity` (and this process's own
    /// share above zero); false otherwise. Clears the slots of processes
    /// that no longer run on the way.
    pub fn charge(&self, device: usize, delta: i128, capacity: u64) -> io::Result<bool> {
        self.locked(false, |table| {
            if table.len() != FILE_BYTES {
                return Err(io::Error::new(ErrorKind::InvalidData, "the shared capacity file was cut short"));
            }
            let (mut others, mut mine, mut free) = (0u128, None, None);
            for index in 0..SLOTS {
                let slot = Slot::read(table, index);
                if slot.pid == 0 {
                    free = free.or(Some(index));
                } else if (slot.pid, slot.start) == (self.pid, self.start) {
                    mine = Some((index, slot));
                } else if self.is_live(&slot) {
                    others += slot.held[device] as u128;
                } else {
                    // Its process ended: what it held is free again.
                    self.write_slot(index, &Slot { pid: 0, start: 0, held: [0; MAX_DEVICES] })?;
                    free = free.or(Some(index));
                }
            }
            let (index, mut slot) = match (mine, free) {
                (Some(found), _) => found,
                (None, Some(index)) => (index, Slot { pid: self.pid, start: self.start, held: [0; MAX_DEVICES] }),
                (None, None) => return Err(io::Error::other(format!("{SLOTS} processes already share this capacity"))),
            };
            let own = slot.held[device] as i128 + delta;
            if own < 0 || others as i128 + own > capacity as i128 {
                return Ok(false);
            }
            slot.held[device] = own as u64;
            self.write_slot(index, &slot)?;
            Ok(true)
        })
    }

    /// Whether the process of `slot` runs (this one always does).
    fn is_live(&self, slot: &Slot) -> bool {
        (slot.pid, slot.start) == (self.pid, self.start) || is_running(slot.pid, slot.start)
    }

    fn write_slot(&self, index: usize, slot: &Slot) -> io::Result<()> {
        self.file.write_all_at(&slot.encode(), (HEADER + index * SLOT) as u64)
    }
}

/// The format version a table says it has.
fn version(table: &[u8]) -> u32 {
    table.get(8..12).map_or(0, |v| u32::from_le_bytes(v.try_into().expect("4 bytes")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch() -> tempfile::TempDir {
        tempfile::Builder::new().prefix("tidepool-shared-capacity-").tempdir().unwrap()
    }

    /// A slot written as another process would: `pid` started at `start`, holding `held` of device 0.
    fn forge(path: &Path, index: usize, pid: u32, start: u64, held: u64) {
        let mut slot = Slot { pid, start, held: [0; MAX_DEVICES] };
        slot.held[0] = held;
        let file = std::fs::OpenOptions::new().write(true).open(path).unwrap();
        file.write_all_at(&slot.encode(), (HEADER + index * SLOT) as u64).unwrap();
    }

    #[test]
    fn a_slot_whose_process_ended_counts_for_nothing_and_the_next_charge_clears_it() {
        let dir = scratch();
        let path = dir.path().join("capacity");
        let shared = SharedCapacity::open(&path, 1).unwrap();
        // The parent of this process lives: it counts. A pid with another
        // start time (reused, or forged) and a pid that runs nothing do not.
        let parent = std::os::unix::process::parent_id();
        forge(&path, 10, parent, process_start(parent).unwrap(), 100);
        forge(&path, 11, parent, process_start(parent).unwrap() + 1, 1000);
        forge(&path, 12, u32::MAX - 7, 5, 1000);
        assert_eq!(shared.used(0).unwrap(), 100);
        assert!(shared.charge(0, 900, 1000).unwrap(), "the ended ones' 2000 bytes are free");
        assert!(!shared.charge(0, 1, 1000).unwrap(), "full: 100 + 900");
        let table = std::fs::read(&path).unwrap();
        assert_eq!((Slot::read(&table, 11).pid, Slot::read(&table, 12).pid), (0, 0), "cleared");
        assert_eq!(Slot::read(&table, 10).held[0], 100, "the live one's stays");
        assert!(shared.charge(0, -900, u64::MAX).unwrap());
        assert!(!shared.charge(0, -1, u64::MAX).unwrap(), "never below zero");
        assert_eq!(shared.used(0).unwrap(), 100);
    }

    #[test]
    fn an_older_file_is_rewritten_and_a_newer_one_refused() {
        let dir = scratch();
        let path = dir.path().join("capacity");
        // The older format: a bare u64 per device, nobody's.
        std::fs::write(&path, 123u64.to_le_bytes()).unwrap();
        let shared = SharedCapacity::open(&path, 2).unwrap();
        assert_eq!((shared.used(0).unwrap(), shared.used(1).unwrap()), (0, 0));
        assert_eq!(std::fs::metadata(&path).unwrap().len(), FILE_BYTES as u64);
        let mut table = std::fs::read(&path).unwrap();
        table[8..12].copy_from_slice(&(VERSION + 1).to_le_bytes());
        std::fs::write(&path, &table).unwrap();
        let err = SharedCapacity::open(&path, 1).err().unwrap();
        assert!(err.to_string().contains("newer tidepool"), "{err}");
        assert!(SharedCapacity::open(&dir.path().join("other"), MAX_DEVICES + 1).is_err());
    }

    #[test]
    fn threads_of_one_process_charging_at_once_lose_no_charge() {
        // The file's lock orders processes, not the threads of one (they
        // share the open file): each charge must still see the last.
        let dir = scratch();
        let shared = std::sync::Arc::new(SharedCapacity::open(&dir.path().join("capacity"), 1).unwrap());
        let (threads, charges) = (4, 300);
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                let shared = shared.clone();
                std::thread::spawn(move || {
                    for _ in 0..charges {
                        assert!(shared.charge(0, 3 << 20, u64::MAX).unwrap());
                        assert!(shared.charge(0, -(1 << 20), u64::MAX).unwrap());
                    }
                })
            })
            .collect();
        for worker in workers {
            worker.join().unwrap();
        }
        assert_eq!(shared.used(0).unwrap(), threads * charges * (2 << 20));
    }
}
