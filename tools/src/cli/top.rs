//! `tidepool top`: the tidepool processes sharing devices on this machine,
//! read from the registries, as a table refreshed every second or JSON.

use std::io::Write;
use std::path::{Path, PathBuf};

use tidepool::error::human_bytes;
use tidepool::reclaim::policy::Reason;
use tidepool::registry;

use super::{args, out};

/// The tidepool processes sharing devices on this machine, refreshed every second
#[derive(clap::Args)]
#[command(override_usage = "tidepool top [--once] [--json] [--registry-dir DIR]")]
pub struct Args {
    /// One table, then exit
    #[arg(long)]
    once: bool,
    /// One JSON object, then exit
    #[arg(long)]
    json: bool,
    /// The registries' folder (default: TIDEPOOL_CONF's registry_dir)
    #[arg(long, value_name = "DIR")]
    registry_dir: Option<PathBuf>,
}

pub fn run(args: Args) -> Result<(), String> {
    let Args { once, json, registry_dir } = args;
    let dir = args::registry_dir(registry_dir)?;
    if json {
        out!("{}", top_json(&dir));
        return Ok(());
    }
    loop {
        let table = top_table(&dir);
        if once {
            out!("{}", table.trim_end_matches('\n'));
            return Ok(());
        }
        let mut stdout = std::io::stdout();
        if write!(stdout, "\x1b[2J\x1b[H{table}").and_then(|()| stdout.flush()).is_err() {
            return Ok(()); // stdout closed: nothing left to show it to
        }
        std::thread::sleep(std::time::Duration::from_secs(1));
    }
}

fn top_table(dir: &Path) -> String {
    let found = registry::scan(dir);
    // The device column as wide as its longest key (a GPU's is 40 characters).
    let width = found.registries.iter().map(|r| r.key.len()).max().unwrap_or(0).max("device".len());
    let mut out = format!("tidepool processes ({})\n", registry::printable(&dir.display().to_string()));
    out += &format!(
        "{:<width$} {:>8} {:<15} {:>4} {:>11} {:>11} {:>11} {:>6} {:>11} {:>11} {:>11} {:>11} {:>11} {:>11}\n",
        "device",
        "pid",
        "comm",
        "dev",
        "allocated",
        "reserved",
        "cached free",
        "frag",
        "idle decay",
        "headroom",
        "oom",
        "for others",
        "requesting",
        "paused"
    );
    if found.registries.iter().all(|r| r.entries.is_empty()) {
        out += "(none)\n";
    }
    for r in &found.registries {
        for e in &r.entries {
            let released = |reason: Reason| human_bytes(e.released[reason as usize]);
            out += &format!(
                "{:<width$} {:>8} {:<15} {:>4} {:>11} {:>11} {:>11} {:>5.1}% {:>11} {:>11} {:>11} {:>11} {:>11} {:>11}\n",
                r.key,
                e.pid,
                e.comm(),
                e.device,
                human_bytes(e.allocated),
                human_bytes(e.reserved),
                human_bytes(e.cached_free),
                100.0 * e.fragmentation(),
                released(Reason::IdleDecay),
                released(Reason::Headroom),
                released(Reason::OutOfMemory),
                released(Reason::Cooperation),
                if e.request_bytes > 0 { human_bytes(e.request_bytes) } else { "-".into() },
                if e.paused > 0 { human_bytes(e.paused) } else { "-".into() },
            );
        }
    }
    for (path, error) in &found.errors {
        out += &format!("skipped {}: {}\n", registry::printable(&path.display().to_string()), error.name());
    }
    out
}

fn top_json(dir: &Path) -> String {
    let found = registry::scan(dir);
    let mut processes = Vec::new();
    for r in &found.registries {
        for e in &r.entries {
            let released: serde_json::Map<String, serde_json::Value> =
                Reason::ALL.iter().map(|&reason| (reason.name().to_string(), e.released[reason as usize].into())).collect();
            processes.push(serde_json::json!({
                "device_key": r.key,
                "pid": e.pid,
                "comm": e.comm(),
                "device": e.device,
                "heartbeat_ms": e.heartbeat_ms,
                "allocated_bytes": e.allocated,
                "reserved_bytes": e.reserved,
                "cached_free_bytes": e.cached_free,
                "inactive_split_bytes": e.inactive_split,
                "largest_free_block_bytes": e.largest_free_block,
                "fragmentation": (e.fragmentation() * 1000.0).round() / 1000.0,
                "released_bytes": released,
                "requests_served": e.requests_served,
                "requests_posted": e.requests_posted,
                "ooms": e.ooms,
                "driver_calls": e.driver_calls,
                "request_bytes": e.request_bytes,
                "device_total_bytes": e.device_total,
                "device_free_bytes": e.device_free,
                "paused_bytes": e.paused,
            }));
        }
    }
    let skipped: Vec<serde_json::Value> = found
        .errors
        .iter()
        .map(|(path, error)| serde_json::json!({ "file": registry::printable(&path.display().to_string()), "reason": error.name() }))
        .collect();
    let dir = registry::printable(&dir.display().to_string());
    serde_json::json!({ "registry_dir": dir, "processes": processes, "skipped": skipped }).to_string()
}
