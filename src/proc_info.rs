//! What /proc says of a process: when it started, which tells a live
//! process from a dead one whose pid was reused (or forged). Registries
//! and the host backend's shared capacity record it beside a pid.
#![forbid(unsafe_code)]

/// When process `pid` started, in clock ticks after boot (field 22 of
/// /proc/PID/stat); None when there is no such process.
pub fn process_start(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The name (field 2) is in parentheses and may hold spaces and ")":
    // the fields after it start at the last ")".
    let after_name = &stat[stat.rfind(')')? + 1..];
    after_name.split_whitespace().nth(19)?.parse().ok()
}

/// Whether the process that recorded (`pid`, `start`) still runs: the pid
/// lives and started then.
pub fn is_running(pid: u32, start: u64) -> bool {
    pid != 0 && process_start(pid) == Some(start)
}
