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
//! versioned, each slot carries a checksum and its process's start time, a
//! lock that is not granted within `LOCK_WAIT` is given up. The worst a
//! corrupt or hostile file can do is make a process release cache it
//! holds: never free live memory, crash or hang. And it heals: a process
//! that finds the file truncated, its header damaged or its own slot
//! corrupt rebuilds what is missing under the lock at its next publication,
//! and every live process claims its slot again at its own (one reclaim
//! interval); slots of dead, reused or forged pids are cleared by the next
//! writer and never shown. Readers that only watch (`scan`) skip and name
//! what they cannot use.
//!
//! Three files: format.rs (the layout of a file and a slot, entries
//! encoded and checked), file.rs (this process's slot: joining, locking,
//! publishing, asking), scan.rs (reading every registry of a folder for
//! `top` and the exporter). Cooperation, which decides when to publish and
//! ask, is beside it (src/cooperation.rs).
#![forbid(unsafe_code)]

mod file;
mod format;
mod scan;
#[cfg(test)]
mod tests;

pub use crate::proc_info::process_start;
pub use file::{default_dir, now_ms, Asked, Registry, RegistryError};
pub use format::{is_device_key, printable, write_file, Entry, BEATS_MISSED, BEAT_SLACK_MS, FILE_BYTES, SLOTS, VERSION};
pub use scan::{scan, slot_pids, DeviceRegistry, Scan, ScanError, MAX_FILES};
