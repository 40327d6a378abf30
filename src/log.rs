//! The one way tidepool writes to stderr: its warnings and out-of-memory
//! reports, printed inside other people's processes.
#![forbid(unsafe_code)]

use std::fmt;
use std::io::Write;

/// Writes one line to stderr. A stderr that cannot be written (a closed
/// pipe, a full disk) loses the line, where `eprintln!` would panic.
pub(crate) fn log_line(message: impl fmt::Display) {
    let _ = writeln!(std::io::stderr(), "{message}");
}
