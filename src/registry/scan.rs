//! Reading every registry of a folder without joining (`tidepool top`,
//! the exporter): the live entries of each device (a running process's
//! slot whose heartbeat beats), and what was skipped.

use std::fs::OpenOptions;
use std::io::ErrorKind;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use super::file::{lock_within, now_ms, LOCK_WAIT};
use super::format::{is_device_key, read_all_at, Entry, FILE_BYTES, HEADER, MAGIC, SLOT, SLOTS, VERSION};

/// Registry files `scan` reads in one directory at most: the most
/// recently written (every live process writes its device's at each
/// reclaimer pass); the rest are named once, as one `TooMany`.
pub const MAX_FILES: usize = 256;

/// Why `scan` skipped a registry file or a slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[non_exhaustive]
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
    /// A slot of a running pid whose heartbeat stopped (`Entry::is_beating`):
    /// a process stopped or hung, or a slot no tidepool process writes.
    Stale,
}

impl ScanError {
    pub const ALL: [ScanError; 7] = [
        ScanError::Unreadable,
        ScanError::Truncated,
        ScanError::Version,
        ScanError::Corrupt,
        ScanError::Locked,
        ScanError::TooMany,
        ScanError::Stale,
    ];

    pub fn name(self) -> &'static str {
        match self {
            ScanError::Unreadable => "unreadable",
            ScanError::Truncated => "truncated",
            ScanError::Version => "version",
            ScanError::Corrupt => "corrupt",
            ScanError::Locked => "locked",
            ScanError::TooMany => "too_many",
            ScanError::Stale => "stale",
        }
    }
}

/// One device's registry as `scan` read it.
#[derive(Clone, Debug)]
pub struct DeviceRegistry {
    pub path: PathBuf,
    /// The device's key: the file name without `.registry`.
    pub key: String,
    /// The entries of running processes whose heartbeat beats.
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
/// be used are skipped and named in `errors`. Only files named as tidepool
/// names registries (`<device key>.registry`, `is_device_key`) are read,
/// the most recently written first and at most `MAX_FILES`: a folder
/// filled with junk neither hides a device nor makes the scan slow. A
/// missing directory is an empty scan (no process has made it yet).
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
    let mut files: Vec<(std::time::SystemTime, PathBuf)> = listing
        .flatten()
        .filter(|item| {
            let name = item.file_name();
            let name = name.to_str().unwrap_or("");
            name.strip_suffix(".registry").is_some_and(is_device_key)
        })
        .map(|item| (item.metadata().and_then(|m| m.modified()).unwrap_or(std::time::UNIX_EPOCH), item.path()))
        .collect();
    // Newest first; ties (and the list shown) in name order.
    files.sort_by(|a, b| b.0.cmp(&a.0).then_with(|| a.1.cmp(&b.1)));
    if files.len() > MAX_FILES {
        files.truncate(MAX_FILES);
        out.errors.push((dir.to_path_buf(), ScanError::TooMany));
    }
    files.sort_by(|a, b| a.1.cmp(&b.1));
    for (_, path) in files {
        match read_registry(&path) {
            Ok((entries, corrupt, stale)) => {
                out.errors.extend(std::iter::repeat_n((path.clone(), ScanError::Corrupt), corrupt));
                out.errors.extend(std::iter::repeat_n((path.clone(), ScanError::Stale), stale));
                let key = path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
                out.registries.push(DeviceRegistry { path, key, entries });
            }
            Err(error) => out.errors.push((path, error)),
        }
    }
    out
}

/// The entries of one registry file whose processes run and beat, and the
/// counts of corrupt slots and of stale ones (running, not beating). Dead
/// processes' slots are nobody's: not counted.
fn read_registry(path: &Path) -> Result<(Vec<Entry>, usize, usize), ScanError> {
    let (entries, corrupt) = read_slots(path)?;
    let now = now_ms();
    let (beating, stale): (Vec<Entry>, Vec<Entry>) = entries.into_iter().filter(Entry::is_live).partition(|e| e.is_beating(now));
    Ok((beating, corrupt, stale.len()))
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
