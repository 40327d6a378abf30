//! The one way tidepool writes to stderr: its warnings and out-of-memory
//! reports, printed inside other people's processes.
#![forbid(unsafe_code)]

use std::collections::HashSet;
use std::fmt;
use std::io::Write;
use std::sync::OnceLock;

use parking_lot::Mutex;

/// The most lines one batch of warnings prints; the rest are counted in one.
pub(crate) const MAX_WARNING_LINES: usize = 20;

/// Writes one line to stderr. A stderr that cannot be written (a closed
/// pipe, a full disk) loses the line, where `eprintln!` would panic.
pub(crate) fn log_line(message: impl fmt::Display) {
    let _ = writeln!(std::io::stderr(), "{message}");
}

/// Prints the `warnings` about `what` that this process has not printed
/// yet, as `tidepool: warning: WHAT: WARNING`: at most
/// `MAX_WARNING_LINES`, then one line that counts the rest. A warning is
/// printed once however often it comes (each reader of the environment
/// finds the same ones).
pub(crate) fn warn_once(what: &str, warnings: &[String]) {
    static PRINTED: OnceLock<Mutex<HashSet<String>>> = OnceLock::new();
    let mut printed = PRINTED.get_or_init(Mutex::default).lock();
    let new: Vec<&String> = warnings.iter().filter(|w| printed.insert(format!("{what}: {w}"))).collect();
    for warning in new.iter().take(MAX_WARNING_LINES) {
        log_line(format_args!("tidepool: warning: {what}: {warning}"));
    }
    if new.len() > MAX_WARNING_LINES {
        log_line(format_args!("tidepool: warning: {what}: and {} more", new.len() - MAX_WARNING_LINES));
    }
}
