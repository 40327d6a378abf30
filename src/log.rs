//! The one way tidepool writes to stderr: its warnings and out-of-memory
//! reports, printed inside other people's processes.
//!
//! A line goes out in one `write` to the file descriptor, not through
//! std's `Stderr`, whose lock a fork child may inherit held by a thread it
//! does not have (`fork.rs`); one write per line also keeps the lines of
//! several threads whole.
#![forbid(unsafe_code)]

use std::collections::HashSet;
use std::fmt;
use std::io::Write;
use std::os::fd::AsFd;

use crate::fork::ProcessLock;

/// The most lines one batch of warnings prints; the rest are counted in one.
pub(crate) const MAX_WARNING_LINES: usize = 20;

/// Writes one line to stderr. A stderr that cannot be written (a closed
/// pipe, a full disk) loses the line, where `eprintln!` would panic.
pub(crate) fn log_line(message: impl fmt::Display) {
    let line = format!("{message}\n");
    // A file of its own on the same descriptor (a dup: std's stderr lock is
    // not taken), closed when dropped.
    if let Ok(fd) = std::io::stderr().as_fd().try_clone_to_owned() {
        let _ = std::fs::File::from(fd).write_all(line.as_bytes());
    }
}

/// Prints the `warnings` about `what` that this process has not printed
/// yet, as `tidepool: warning: WHAT: WARNING`: at most
/// `MAX_WARNING_LINES`, then one line that counts the rest. A warning is
/// printed once however often it comes (each reader of the environment
/// finds the same ones).
pub(crate) fn warn_once(what: &str, warnings: &[String]) {
    static PRINTED: ProcessLock<Option<HashSet<String>>> = ProcessLock::new(None);
    let new: Vec<&String> = {
        let mut printed = PRINTED.lock();
        let printed = printed.get_or_insert_with(HashSet::new);
        warnings.iter().filter(|w| printed.insert(format!("{what}: {w}"))).collect()
    };
    for warning in new.iter().take(MAX_WARNING_LINES) {
        log_line(format_args!("tidepool: warning: {what}: {warning}"));
    }
    if new.len() > MAX_WARNING_LINES {
        log_line(format_args!("tidepool: warning: {what}: and {} more", new.len() - MAX_WARNING_LINES));
    }
}
