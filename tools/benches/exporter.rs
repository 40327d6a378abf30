//! One scrape of `tidepool exporter` on a busy node: 64 processes, each on
//! all 8 devices (512 registry slots in 8 files), read from disk and
//! rendered in both formats. The target is under 10 ms a scrape.
//!
//! The processes are 64 real `sleep` children (the exporter shows only
//! live pids); their slots are written with `registry::write_file`.

use std::process::{Child, Command};

use criterion::{criterion_group, criterion_main, Criterion};
use tidepool::registry::{self, Entry};
use tidepool_tools::exporter::exposition::Format;
use tidepool_tools::exporter::Exporter;

const PROCESSES: usize = 64;
const DEVICES: usize = 8;

/// Children that live while the benchmark runs, killed on drop.
struct Sleepers(Vec<Child>);

impl Drop for Sleepers {
    fn drop(&mut self) {
        for child in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn node(dir: &std::path::Path) -> Sleepers {
    let sleepers = Sleepers((0..PROCESSES).map(|_| Command::new("sleep").arg("600").spawn().expect("sleep")).collect());
    std::fs::create_dir_all(dir).unwrap();
    for device in 0..DEVICES {
        let entries: Vec<Entry> = sleepers
            .0
            .iter()
            .enumerate()
            .map(|(i, child)| {
                let mut comm = [0u8; 16];
                comm[..6].copy_from_slice(b"python");
                let gib = 1u64 << 30;
                Entry {
                    pid: child.id(),
                    start_ticks: registry::process_start(child.id()).unwrap(),
                    device: device as u32,
                    heartbeat_ms: registry::now_ms() - i as u64,
                    // Beating for three minutes (a benchmark's length).
                    interval_ms: 60_000,
                    reserved: 10 * gib + i as u64 * 4096,
                    allocated: 8 * gib,
                    cached_free: 2 * gib,
                    inactive_split: gib / 3,
                    largest_free_block: gib,
                    requests_posted: 3,
                    ooms: 1,
                    device_total: 80 * gib,
                    device_free: 5 * gib,
                    released: [1 << 20, 2 << 20, 0, 4 << 20, 5 << 20, 6 << 20],
                    comm,
                    ..Entry::default()
                }
            })
            .collect();
        let key = format!("cuda-{:032x}", 0xabcdef00_u128 + device as u128);
        registry::write_file(&dir.join(format!("{key}.registry")), &entries).unwrap();
    }
    sleepers
}

fn scrape(c: &mut Criterion) {
    let dir = std::env::temp_dir().join(format!("tidepool-bench-exporter-{}", std::process::id()));
    let _sleepers = node(&dir);
    let exporter = Exporter::new(vec![dir.clone()], "node-1".into());
    let text = exporter.scrape(Format::Text);
    assert_eq!(text.lines().filter(|l| l.starts_with("tidepool_allocated_bytes{")).count(), PROCESSES * DEVICES);
    eprintln!("one scrape: {} series lines, {} bytes", text.lines().filter(|l| !l.starts_with('#')).count(), text.len());
    let mut group = c.benchmark_group("exporter");
    group.bench_function("scrape 64 processes x 8 devices (text)", |b| b.iter(|| exporter.scrape(Format::Text)));
    group.bench_function("scrape 64 processes x 8 devices (openmetrics)", |b| b.iter(|| exporter.scrape(Format::OpenMetrics)));
    group.finish();
    let _ = std::fs::remove_dir_all(&dir);
}

criterion_group!(benches, scrape);
criterion_main!(benches);
