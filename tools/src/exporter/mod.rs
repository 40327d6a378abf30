//! What `tidepool exporter` serves: every tidepool process of this host,
//! read from the device registries at each scrape, as Prometheus metric
//! families (`tidepool_*`). `Exporter::scrape` only reads and renders, so
//! a benchmark or a test can scrape without a socket; `serve` is the HTTP
//! server and `write_textfile` the textfile writer of `tidepool exporter`.
//!
//! Series of a process on a device carry `device` (the GPU's UUID as
//! nvidia-smi and the DCGM exporter print it, `GPU-xxxxxxxx-...`; for
//! devices without one the registry key), `device_index` (the device's
//! index in that process), `pid`, `comm` and `hostname`; slots of one
//! label set (two allocators in one process) are one series, their figures
//! added (`one_per_series`). A process that
//! exits disappears from the next scrape, so Prometheus marks its series
//! stale. Registry files and slots that cannot be used are skipped and
//! counted in `tidepool_exporter_registry_errors_total{reason}`.
#![forbid(unsafe_code)]

pub mod exposition;
pub mod serve;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Instant;

use exposition::{Format, Kind, Labels, Writer};

use tidepool::reclaim::policy::Reason;
use tidepool::registry::{self, Entry, Scan, ScanError};

/// A family of one sample per process: name, help, and the figure.
type Figure = (&'static str, &'static str, fn(&Entry) -> u64);

/// The gauges of one process on one device, in bytes.
const BYTE_GAUGES: [Figure; 7] = [
    ("tidepool_allocated_bytes", "Bytes in live allocations of the process on the device.", |e| e.allocated),
    ("tidepool_reserved_bytes", "Bytes the process holds from the driver on the device (allocated plus cached).", |e| e.reserved),
    ("tidepool_cached_free_bytes", "Bytes reserved but not in use: the process's cache.", |e| e.cached_free),
    (
        "tidepool_inactive_split_bytes",
        "Cached bytes inside partly used segments: neither releasable nor usable by a request larger than their hole.",
        |e| e.inactive_split,
    ),
    ("tidepool_largest_free_block_bytes", "The largest free block of the process's cache on the device.", |e| e.largest_free_block),
    ("tidepool_memory_request_bytes", "Bytes the process is waiting for from the other processes on the device (0: none).", |e| {
        e.request_bytes
    }),
    ("tidepool_paused_bytes", "Device memory the process's paused tags gave back (addresses kept; not in reserved).", |e| e.paused),
];

/// The counters of one process on one device.
const COUNTERS: [Figure; 4] = [
    ("tidepool_cooperation_requests", "Requests for memory the process posted to the other processes on the device.", |e| {
        e.requests_posted
    }),
    ("tidepool_cooperation_requests_served", "Requests of other processes the process answered by giving back cache.", |e| {
        e.requests_served
    }),
    ("tidepool_ooms", "Allocations that failed for lack of memory.", |e| e.ooms),
    (
        "tidepool_driver_calls",
        "Memory driver calls the process made on the device (cuMemAlloc, cuMemFree, cuMemAddressReserve, cuMemAddressFree, \
         cuMemCreate, cuMemRelease, cuMemMap, cuMemUnmap, cuMemSetAccess), failed ones included: a steady step makes none.",
        |e| e.driver_calls,
    ),
];

/// Reads the registries of some directories and renders them; keeps the
/// count of what it had to skip across scrapes.
#[derive(Debug)]
pub struct Exporter {
    dirs: Vec<PathBuf>,
    hostname: String,
    errors: parking_lot::Mutex<[u64; ScanError::ALL.len()]>,
}

impl Exporter {
    /// An exporter of the registries in `dirs` (repeated ones read once),
    /// labelling every series with `hostname`.
    pub fn new(mut dirs: Vec<PathBuf>, hostname: String) -> Exporter {
        let mut seen = std::collections::HashSet::new();
        dirs.retain(|d| seen.insert(d.canonicalize().unwrap_or_else(|_| d.clone())));
        Exporter { dirs, hostname, errors: parking_lot::Mutex::new([0; ScanError::ALL.len()]) }
    }

    pub fn dirs(&self) -> &[PathBuf] {
        &self.dirs
    }

    /// One scrape: reads every registry now and renders it in `format`.
    pub fn scrape(&self, format: Format) -> String {
        let start = Instant::now();
        let scans: Vec<Scan> = self.dirs.iter().map(|dir| registry::scan(dir)).collect();
        let errors = {
            let mut errors = self.errors.lock();
            for (_, error) in scans.iter().flat_map(|s| &s.errors) {
                errors[ScanError::ALL.iter().position(|e| e == error).expect("listed")] += 1;
            }
            *errors
        };
        self.render(&scans, &errors, format, start)
    }

    /// The families of one scrape, in order: each process's, each
    /// device's, then the exporter's own.
    fn render(&self, scans: &[Scan], errors: &[u64], format: Format, start: Instant) -> String {
        let devices = devices(scans);
        let hostname = self.hostname.as_str();
        let mut w = Writer::new(format);
        write_processes(&mut w, &process_series(&devices, hostname));
        write_devices(&mut w, &devices, hostname);
        let host = Labels::new(&[("hostname", hostname)]);
        w.family(
            "tidepool_exporter_registry_errors",
            Kind::Counter,
            "Registry files or slots the exporter skipped (truncated, corrupt, of another version, ...), by reason.",
        );
        for (error, count) in ScanError::ALL.iter().zip(errors) {
            w.sample(&host.with("reason", error.name()), *count);
        }
        w.family("tidepool_exporter_scrape_duration_seconds", Kind::Gauge, "Time this scrape took to read and render the registries.");
        w.sample(&host, start.elapsed().as_secs_f64());
        w.finish()
    }
}

/// The entries of every registry read, by device label (one device may
/// have registries in several directories), one per label set.
fn devices(scans: &[Scan]) -> BTreeMap<String, Vec<Entry>> {
    let mut devices: BTreeMap<String, Vec<Entry>> = BTreeMap::new();
    for registry in scans.iter().flat_map(|s| &s.registries) {
        devices.entry(device_label(&registry.key)).or_default().extend(registry.entries.iter().copied());
    }
    for entries in devices.values_mut() {
        *entries = one_per_series(std::mem::take(entries));
    }
    devices
}

/// Each process's entry on each device, with its labels.
fn process_series<'a>(devices: &'a BTreeMap<String, Vec<Entry>>, hostname: &'a str) -> Vec<(Labels, &'a Entry)> {
    devices
        .iter()
        .flat_map(|(device, entries)| {
            entries.iter().map(move |e| {
                let labels = Labels::new(&[
                    ("device", device),
                    ("device_index", &e.device.to_string()),
                    ("pid", &e.pid.to_string()),
                    ("comm", &e.comm()),
                    ("hostname", hostname),
                ]);
                (labels, e)
            })
        })
        .collect()
}

/// The families of each process on each device: bytes, fragmentation, the
/// last publication, releases by reason, counters.
fn write_processes(w: &mut Writer, series: &[(Labels, &Entry)]) {
    for (name, help, value) in BYTE_GAUGES {
        w.family(name, Kind::Gauge, help);
        for (labels, e) in series {
            w.sample(labels, value(e));
        }
    }
    w.family(
        "tidepool_fragmentation_ratio",
        Kind::Gauge,
        "Fragmentation: inactive split bytes over reserved bytes (free memory that can neither be released nor serve a large request).",
    );
    for (labels, e) in series {
        w.sample(labels, e.fragmentation());
    }
    w.family("tidepool_last_publish_timestamp_seconds", Kind::Gauge, "When the process last published its figures (Unix time).");
    for (labels, e) in series {
        w.sample(labels, e.heartbeat_ms as f64 / 1000.0);
    }
    w.family("tidepool_released_bytes", Kind::Counter, "Bytes the process gave back to the driver, by reason.");
    for (labels, e) in series {
        for reason in Reason::ALL {
            w.sample(&labels.with("reason", reason.name()), e.released[reason as usize]);
        }
    }
    for (name, help, value) in COUNTERS {
        w.family(name, Kind::Counter, help);
        for (labels, e) in series {
            w.sample(labels, value(e));
        }
    }
}

/// The families of each device: its tidepool processes, and its memory as
/// its most recent publisher saw it.
fn write_devices(w: &mut Writer, devices: &BTreeMap<String, Vec<Entry>>, hostname: &str) {
    let device_labels: Vec<Labels> = devices.keys().map(|device| Labels::new(&[("device", device), ("hostname", hostname)])).collect();
    w.family("tidepool_processes", Kind::Gauge, "tidepool processes using the device.");
    for (labels, entries) in device_labels.iter().zip(devices.values()) {
        w.sample(labels, entries.len() as u64);
    }
    let memory: Vec<Option<&Entry>> =
        devices.values().map(|entries| entries.iter().filter(|e| e.device_total > 0).max_by_key(|e| e.heartbeat_ms)).collect();
    for (name, help, value) in [
        ("tidepool_device_total_bytes", "The device's memory.", (|e: &Entry| e.device_total) as fn(&Entry) -> u64),
        ("tidepool_device_free_bytes", "The device's free memory, as the driver reported it to a tidepool process.", |e| e.device_free),
    ] {
        w.family(name, Kind::Gauge, help);
        for (labels, known) in device_labels.iter().zip(&memory) {
            if let Some(e) = known {
                w.sample(labels, value(e));
            }
        }
    }
}

/// The entries of one device, one per label set: slots that share device
/// index, pid and name (two allocators in one process; two processes of
/// one pid in different pid namespaces) would otherwise be duplicate
/// series, which a scraper rejects. They become one: bytes and counts
/// added, the largest free block and the last publication the largest of
/// theirs, the device's memory as the latest of them saw it.
fn one_per_series(entries: Vec<Entry>) -> Vec<Entry> {
    let mut merged: BTreeMap<(u32, u32, [u8; 16]), Entry> = BTreeMap::new();
    for e in entries {
        let Some(into) = merged.get_mut(&(e.device, e.pid, e.comm)) else {
            merged.insert((e.device, e.pid, e.comm), e);
            continue;
        };
        if e.heartbeat_ms > into.heartbeat_ms {
            (into.heartbeat_ms, into.device_total, into.device_free) = (e.heartbeat_ms, e.device_total, e.device_free);
        }
        into.largest_free_block = into.largest_free_block.max(e.largest_free_block);
        for (sum, add) in [
            (&mut into.reserved, e.reserved),
            (&mut into.allocated, e.allocated),
            (&mut into.cached_free, e.cached_free),
            (&mut into.inactive_split, e.inactive_split),
            (&mut into.request_bytes, e.request_bytes),
            (&mut into.requests_served, e.requests_served),
            (&mut into.requests_posted, e.requests_posted),
            (&mut into.ooms, e.ooms),
            (&mut into.driver_calls, e.driver_calls),
            (&mut into.paused, e.paused),
        ] {
            *sum = sum.saturating_add(add);
        }
        for (sum, add) in into.released.iter_mut().zip(e.released) {
            *sum = sum.saturating_add(add);
        }
    }
    merged.into_values().collect()
}

/// The `device` label of a registry key: a CUDA device's UUID as
/// nvidia-smi and DCGM print it (`GPU-` and 8-4-4-4-12 hex digits), so
/// tidepool's series join DCGM's; any other key as it is.
pub fn device_label(key: &str) -> String {
    match key.strip_prefix("cuda-") {
        Some(hex) if hex.len() == 32 && hex.bytes().all(|b| b.is_ascii_hexdigit()) => {
            format!("GPU-{}-{}-{}-{}-{}", &hex[0..8], &hex[8..12], &hex[12..16], &hex[16..20], &hex[20..32])
        }
        _ => key.to_string(),
    }
}

/// This machine's name (`/proc/sys/kernel/hostname`), or "unknown".
pub fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|name| name.trim().to_string())
        .filter(|name| !name.is_empty())
        .unwrap_or_else(|| "unknown".into())
}

/// Writes a scrape in the text format to `path`: to a hidden temporary file
/// in the same directory first, then renamed over `path`, so a reader
/// (node_exporter's textfile collector reads `*.prom`) never sees half a file.
pub fn write_textfile(exporter: &Exporter, path: &std::path::Path) -> std::io::Result<()> {
    use std::io::Write as _;
    let text = exporter.scrape(Format::Text);
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(std::path::Path::new("."));
    let name = path.file_name().ok_or_else(|| std::io::Error::other("no file name"))?.to_string_lossy();
    let temporary = dir.join(format!(".{name}.{}.tmp", std::process::id()));
    let result = (|| {
        let mut file = std::fs::File::create(&temporary)?;
        file.write_all(text.as_bytes())?;
        file.sync_all()?;
        std::fs::rename(&temporary, path)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&temporary);
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cuda_uuid_key_becomes_the_uuid_nvidia_smi_prints() {
        assert_eq!(device_label("cuda-73696d67707500000000000000000000"), "GPU-73696d67-7075-0000-0000-000000000000");
        assert_eq!(device_label("cuda-ordinal-3"), "cuda-ordinal-3");
        assert_eq!(device_label("host-7a841ef7f782f82d-0"), "host-7a841ef7f782f82d-0");
        assert_eq!(device_label("cuda-zz"), "cuda-zz");
    }
}
