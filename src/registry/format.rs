//! The layout of a registry file (little endian): a 16-byte header
//! (`TIDEPOOL`, version u32, slot count u32), then `SLOTS` slots of `SLOT`
//! bytes, each an `Entry` with its checksum; the names registry files
//! have; whether the process of a slot lives; reading a file whole.
//!
//! A slot, version 5: pid u32, device u32, the `U64_FIELDS` u64 figures of
//! `Entry` in its order, the process name (16 bytes, NUL padded),
//! `answered_ms` u64, the process's start time u64 (clock ticks after
//! boot, as /proc/PID/stat gives it: a pid reused by another process does
//! not match), the interval at which it publishes (ms, u64: a heartbeat
//! older than a few of them shows a process that stopped, or a slot
//! written by no tidepool process), and the FNV-1a checksum of everything
//! before it. A slot whose pid is 0 is free. Older versions (1: 112-byte
//! slots, 2: 192 bytes without the start time, 3: 200 bytes without the
//! interval, 4: 208 bytes without the driver calls) are refused while one
//! of their processes lives and rewritten once none does.

use std::fs::File;
use std::io::ErrorKind;
use std::os::unix::fs::FileExt;
use std::path::Path;

use crate::proc_info::is_running;

pub(super) const MAGIC: &[u8; 8] = b"TIDEPOOL";
pub const VERSION: u32 = 5;
pub const SLOTS: usize = 64;
pub(super) const HEADER: u64 = 16;
pub(super) const SLOT: u64 = 216;
/// The bytes of a whole registry file.
pub const FILE_BYTES: u64 = HEADER + SLOT * SLOTS as u64;
/// The u64 figures of a slot, after pid and device.
pub(super) const U64_FIELDS: usize = 20;
pub(super) const COMM_AT: usize = 8 + 8 * U64_FIELDS;
pub(super) const ANSWERED_AT: usize = COMM_AT + 16;
pub(super) const START_AT: usize = ANSWERED_AT + 8;
pub(super) const INTERVAL_AT: usize = START_AT + 8;
pub(super) const CHECKSUM_AT: usize = SLOT as usize - 8;
/// The slot size of each older version, to tell whether an old file is
/// still in use (a slot's pid comes first in every version).
pub(super) const OLD_SLOTS: [(u32, u64); 4] = [(1, 112), (2, 192), (3, 200), (4, 208)];
/// A heartbeat counts as life for this many of its process's intervals
/// (`Entry::is_beating`), plus `BEAT_SLACK_MS`: a reclaimer pass that runs
/// late (a release under way) is not taken for a stopped process.
pub const BEATS_MISSED: u64 = 3;
pub const BEAT_SLACK_MS: u64 = 100;
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
    /// Memory driver calls made on the device (`num_driver_calls`).
    pub driver_calls: u64,
    /// The process's name (`/proc/PID/comm`), NUL padded.
    pub comm: [u8; 16],
    /// The heartbeat of the last publication that saw another process's
    /// request, stamped once the cache was given back (0: never).
    pub answered_ms: u64,
    /// When the process started (clock ticks after boot, /proc/PID/stat):
    /// with the pid, which process this is.
    pub start_ticks: u64,
    /// How often the process publishes (its reclaim interval, ms): the
    /// most its heartbeat may age between two publications.
    pub interval_ms: u64,
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
            self.driver_calls,
        ]
    }

    pub(super) fn encode(&self) -> [u8; SLOT as usize] {
        let mut out = [0u8; SLOT as usize];
        out[0..4].copy_from_slice(&self.pid.to_le_bytes());
        out[4..8].copy_from_slice(&self.device.to_le_bytes());
        for (i, value) in self.figures().iter().enumerate() {
            out[8 + 8 * i..16 + 8 * i].copy_from_slice(&value.to_le_bytes());
        }
        out[COMM_AT..COMM_AT + 16].copy_from_slice(&self.comm);
        out[ANSWERED_AT..ANSWERED_AT + 8].copy_from_slice(&self.answered_ms.to_le_bytes());
        out[START_AT..START_AT + 8].copy_from_slice(&self.start_ticks.to_le_bytes());
        out[INTERVAL_AT..INTERVAL_AT + 8].copy_from_slice(&self.interval_ms.to_le_bytes());
        let sum = fnv1a(&out[..CHECKSUM_AT]);
        out[CHECKSUM_AT..].copy_from_slice(&sum.to_le_bytes());
        out
    }

    /// The entry of a slot; `None` when its checksum does not match (a
    /// free slot, all zero, decodes to the default entry).
    pub(super) fn decode(raw: &[u8]) -> Option<Entry> {
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
            driver_calls: f[19],
            comm: raw[COMM_AT..COMM_AT + 16].try_into().expect("16 bytes"),
            answered_ms: u64_at(ANSWERED_AT),
            start_ticks: u64_at(START_AT),
            interval_ms: u64_at(INTERVAL_AT),
        })
    }

    /// Whether the process that wrote this slot still runs: its pid lives
    /// and started when the slot says (not a reused pid, not a forgery
    /// naming another process).
    pub fn is_live(&self) -> bool {
        is_running(self.pid, self.start_ticks)
    }

    /// Whether the process published recently enough to be running, at
    /// wall-clock time `now_ms`: its heartbeat is at most `BEATS_MISSED` of
    /// its intervals (10 ms to 60 s) and `BEAT_SLACK_MS` old. A process
    /// stopped (SIGSTOP, a frozen container), hung, or a slot written by no
    /// tidepool process stops beating; so does a heartbeat ahead of the
    /// clock (written before the wall clock stepped back), until its
    /// process publishes again.
    pub fn is_beating(&self, now_ms: u64) -> bool {
        let interval = self.interval_ms.clamp(10, 60_000);
        now_ms.checked_sub(self.heartbeat_ms).is_some_and(|age| age <= BEATS_MISSED * interval + BEAT_SLACK_MS)
    }

    /// The process name as text, safe to print: invalid UTF-8 replaced,
    /// control characters escaped (`printable`). A process names itself,
    /// escape sequences included.
    pub fn comm(&self) -> String {
        let end = self.comm.iter().position(|&b| b == 0).unwrap_or(self.comm.len());
        printable(&String::from_utf8_lossy(&self.comm[..end]))
    }

    /// `inactive_split / reserved` ([`crate::stats::Stats::fragmentation`]).
    pub fn fragmentation(&self) -> f64 {
        crate::stats::fragmentation(self.inactive_split, self.reserved)
    }
}

/// This process's name, as `/proc/self/comm` gives it (at most 15 bytes).
pub(super) fn own_comm() -> [u8; 16] {
    let mut comm = [0u8; 16];
    if let Ok(text) = std::fs::read("/proc/self/comm") {
        let text = text.strip_suffix(b"\n").unwrap_or(&text);
        let n = text.len().min(15);
        comm[..n].copy_from_slice(&text[..n]);
    }
    comm
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
pub(super) fn read_all_at(file: &File, buf: &mut [u8]) -> std::io::Result<usize> {
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

/// `text` safe to print on a terminal, as `ps` shows names: each control
/// character (escape sequences, newlines) as `\xNN`, everything else as
/// it is. For what other processes write: their names, and the names of
/// files in a shared folder.
pub fn printable(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            c if c.is_control() => out.push_str(&format!("\\x{:02x}", c as u32)),
            c => out.push(c),
        }
    }
    out
}

/// Whether `key` is a device key as tidepool names registries (`scan`
/// reads only those): `cuda-` and 32 hex digits, `cuda-ordinal-` and a
/// number, `host-`, 16 hex digits, `-` and a number, or a GPU's UUID as
/// nvidia-smi prints it (`GPU-` and 8-4-4-4-12 hex digits).
pub fn is_device_key(key: &str) -> bool {
    let hex = |s: &str, n: usize| s.len() == n && s.bytes().all(|b| b.is_ascii_hexdigit());
    let number = |s: &str| !s.is_empty() && s.len() <= 6 && s.bytes().all(|b| b.is_ascii_digit());
    if let Some(rest) = key.strip_prefix("cuda-ordinal-") {
        return number(rest);
    }
    if let Some(rest) = key.strip_prefix("cuda-") {
        return hex(rest, 32);
    }
    if let Some(rest) = key.strip_prefix("host-") {
        return rest.split_once('-').is_some_and(|(hash, device)| hex(hash, 16) && number(device));
    }
    if let Some(rest) = key.strip_prefix("GPU-") {
        let parts: Vec<&str> = rest.split('-').collect();
        return parts.len() == 5 && parts.iter().zip([8, 4, 4, 4, 12]).all(|(part, n)| hex(part, n));
    }
    false
}
