//! Writing a whole file to a path the user named (snapshots, the
//! out-of-memory snapshot), inside someone else's process: it replaces
//! nothing that is not a file of its own.
//!
//! What the path names decides how it is written:
//! - nothing, or a regular file: a temporary file beside it, written,
//!   flushed to disk, then renamed over it, so that a reader never sees half
//!   a file and two writers never write into one; a file that was there
//!   keeps its permissions;
//! - a symbolic link: its target, as `open(path, "wb")` would (a chain of
//!   links is followed to its end; a link to nothing creates its target);
//! - a FIFO: written into, never replaced, when a process reads it (else an
//!   error, at once: no reader means no one to wait for);
//! - a device (`/dev/null`, a terminal, `/dev/full`): written into, never
//!   replaced;
//! - a directory: an error.
//!
//! Every failure (no space, no permission, no such folder) is returned to
//! the caller (with the link's target, when it wrote through one); nothing
//! is left behind.
#![forbid(unsafe_code)]

use std::fs::{File, OpenOptions, Permissions};
use std::io::{self, ErrorKind, Write};
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// The most symbolic links followed from a path, as the kernel's limit.
const MAX_LINKS: usize = 40;

/// The longest a write into a FIFO waits for its reader to read.
const FIFO_PATIENCE: Duration = Duration::from_secs(30);

/// Writes `bytes` as the whole content of `path` (see the top of this file).
pub fn write_whole(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let target = follow_links(path)?;
    let result = match std::fs::symlink_metadata(&target) {
        Err(err) if err.kind() == ErrorKind::NotFound => replace(&target, bytes, None),
        Err(err) => Err(err),
        Ok(meta) if meta.is_file() => replace(&target, bytes, Some(meta.permissions())),
        Ok(meta) if meta.is_dir() => Err(io::Error::new(ErrorKind::IsADirectory, "is a directory")),
        Ok(meta) if meta.file_type().is_fifo() => write_fifo(&target, bytes),
        Ok(meta) if meta.file_type().is_char_device() || meta.file_type().is_block_device() => write_device(&target, bytes),
        Ok(_) => Err(io::Error::new(ErrorKind::InvalidInput, "is a socket, not a file")),
    };
    if target == path {
        return result;
    }
    result.map_err(|err| io::Error::new(err.kind(), format!("{err} (writing through a link to {})", target.display())))
}

/// Where `path` leads through its symbolic links (itself when it is none);
/// a relative link is read from the link's folder.
fn follow_links(path: &Path) -> io::Result<PathBuf> {
    let mut current = path.to_path_buf();
    for _ in 0..MAX_LINKS {
        match std::fs::symlink_metadata(&current) {
            Ok(meta) if meta.file_type().is_symlink() => {
                let target = std::fs::read_link(&current)?;
                current = match current.parent() {
                    Some(folder) if target.is_relative() => folder.join(target),
                    _ => target,
                };
            }
            _ => return Ok(current),
        }
    }
    Err(io::Error::new(ErrorKind::InvalidInput, format!("{}: more than {MAX_LINKS} symbolic links", path.display())))
}

/// A regular file (or nothing) at `path`: replaced by a temporary file of
/// this writer's own, written beside it.
fn replace(path: &Path, bytes: &[u8], permissions: Option<Permissions>) -> io::Result<()> {
    static WRITES: AtomicU64 = AtomicU64::new(0);
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(format!(".{}.{}.tidepool-tmp", std::process::id(), WRITES.fetch_add(1, Ordering::Relaxed)));
    let tmp = PathBuf::from(tmp);
    let written = OpenOptions::new().write(true).create_new(true).open(&tmp).and_then(|mut file| {
        file.write_all(bytes)?;
        if let Some(permissions) = permissions {
            file.set_permissions(permissions)?;
        }
        file.sync_all()
    });
    written.and_then(|()| std::fs::rename(&tmp, path)).inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })
}

/// A FIFO: opened without waiting (no reader is an error), written as its
/// reader reads, for at most `FIFO_PATIENCE`.
fn write_fifo(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let mut file = match OpenOptions::new().write(true).custom_flags(libc::O_NONBLOCK).open(path) {
        Err(err) if err.raw_os_error() == Some(libc::ENXIO) => {
            return Err(io::Error::new(ErrorKind::NotConnected, "a FIFO that no process reads"));
        }
        other => other?,
    };
    let start = Instant::now();
    let mut rest = bytes;
    while !rest.is_empty() {
        match file.write(rest) {
            Ok(0) => return Err(io::Error::new(ErrorKind::WriteZero, "the FIFO took no more")),
            Ok(n) => rest = &rest[n..],
            Err(err) if err.kind() == ErrorKind::WouldBlock && start.elapsed() < FIFO_PATIENCE => {
                std::thread::sleep(Duration::from_millis(1));
            }
            Err(err) if err.kind() == ErrorKind::WouldBlock => {
                return Err(io::Error::new(ErrorKind::TimedOut, "the FIFO's reader stopped reading"));
            }
            Err(err) if err.kind() == ErrorKind::Interrupted => {}
            Err(err) => return Err(err),
        }
    }
    Ok(())
}

/// A device: written into as it is (a terminal, `/dev/null`; `/dev/full`
/// answers that it has no space).
fn write_device(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let mut file: File = OpenOptions::new().write(true).open(path)?;
    file.write_all(bytes)?;
    file.flush()
}
