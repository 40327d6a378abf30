//! `tidepool exporter` against the real thing: a Prometheus server
//! (Debian's `prometheus` package; `./test.sh` installs it) scrapes it on
//! loopback while two tidepool processes share one simgpu device, and
//! `promtool check metrics` reads its output. Without prometheus or
//! promtool the tests that need them skip with a message, except under
//! `CI=true`, where their absence fails.
//!
//! Also: bad registry files are skipped and counted, never a crash; a
//! client that sends nothing is dropped at the timeout; the connection
//! bound holds; 1,000 scrapes from 32 concurrent clients leave memory
//! flat and every response well formed. Every server a test starts is
//! stopped by a guard, also when the test fails; everything is on
//! 127.0.0.1 and bounded in time.

use crate::common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tidepool::registry::{self, Entry};
use tidepool::{Allocator, Config, Stream};

const MIB: u64 = 1 << 20;

/// The path of `tool` (prometheus or promtool) on PATH; None (with a
/// message) where it is missing outside CI; under CI a missing tool fails.
fn tool(name: &str) -> Option<PathBuf> {
    common::tool(name, "Debian's prometheus package: apt-get install prometheus")
}

/// A child process killed and reaped when the guard goes, test failed or not.
struct Guard {
    child: Child,
    name: &'static str,
}

impl Drop for Guard {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Guard {
    fn pid(&self) -> u32 {
        self.child.id()
    }

    fn rss_kib(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid())).unwrap();
        let line = status.lines().find(|l| l.starts_with("VmRSS:")).expect("VmRSS");
        line.split_whitespace().nth(1).unwrap().parse().unwrap()
    }

    fn open_files(&self) -> usize {
        std::fs::read_dir(format!("/proc/{}/fd", self.pid())).unwrap().count()
    }

    fn assert_running(&mut self) {
        assert!(self.child.try_wait().unwrap().is_none(), "{} exited", self.name);
    }
}

/// `tidepool exporter` on a port the kernel picks, and its address.
fn exporter(dirs: &[&Path], extra: &[&str]) -> (Guard, SocketAddr) {
    let mut command = Command::new(env!("CARGO_BIN_EXE_tidepool"));
    command.args(["exporter", "--listen", "127.0.0.1:0"]);
    for dir in dirs {
        command.arg("--registry-dir").arg(dir);
    }
    let mut child = command.args(extra).stdout(Stdio::piped()).stderr(Stdio::null()).spawn().unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let guard = Guard { child, name: "tidepool exporter" };
    let addr = line.split_whitespace().nth(4).and_then(|a| a.trim_end_matches(',').parse().ok());
    let addr = addr.unwrap_or_else(|| panic!("the exporter printed {line:?}"));
    (guard, addr)
}

/// A response: status, headers (lowercase names), body.
struct Response {
    status: u16,
    headers: Vec<(String, String)>,
    body: String,
}

impl Response {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str())
    }
}

/// One HTTP/1.0 request on a new connection (the server closes it after
/// the response, so the body is what comes before EOF).
fn request(addr: SocketAddr, method: &str, target: &str, headers: &[(&str, &str)]) -> std::io::Result<Response> {
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    let mut text = format!("{method} {target} HTTP/1.0\r\nHost: {addr}\r\n");
    for (name, value) in headers {
        text += &format!("{name}: {value}\r\n");
    }
    text += "\r\n";
    stream.write_all(text.as_bytes())?;
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw)?;
    let raw = String::from_utf8(raw).map_err(|_| std::io::Error::other("not UTF-8"))?;
    let (head, body) = raw.split_once("\r\n\r\n").ok_or_else(|| std::io::Error::other(format!("no header end in {raw:?}")))?;
    let mut lines = head.lines();
    let status = lines.next().and_then(|l| l.split_whitespace().nth(1)).and_then(|s| s.parse().ok());
    let status = status.ok_or_else(|| std::io::Error::other(format!("bad status line in {head:?}")))?;
    let headers = lines.filter_map(|l| l.split_once(':')).map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_string())).collect();
    Ok(Response { status, headers, body: body.to_string() })
}

fn metrics(addr: SocketAddr) -> String {
    let response = request(addr, "GET", "/metrics", &[]).unwrap();
    assert_eq!(response.status, 200, "{}", response.body);
    response.body
}

/// The value of the sample of `name` whose labels include every one of `labels`.
fn sample(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    text.lines().filter(|l| !l.starts_with('#')).find_map(|line| {
        let (series, value) = line.rsplit_once(' ')?;
        let rest = series.strip_prefix(name)?;
        if !(rest.is_empty() || rest.starts_with('{')) {
            return None;
        }
        labels.iter().all(|(k, v)| rest.contains(&format!("{k}=\"{v}\""))).then(|| value.parse().ok())?
    })
}

/// Pipes `text` into `promtool check metrics`; its output on failure.
fn promtool_check(promtool: &Path, text: &str) -> Result<(), String> {
    let mut child = Command::new(promtool)
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(text.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    if out.status.success() {
        Ok(())
    } else {
        Err(format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)))
    }
}

fn percent_encode(text: &str) -> String {
    text.bytes()
        .map(|b| if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) { (b as char).to_string() } else { format!("%{b:02X}") })
        .collect()
}

/// A Prometheus server on loopback scraping `target` every 500 ms, with
/// its data in a temporary directory.
struct Prometheus {
    guard: Guard,
    addr: SocketAddr,
    dir: tempfile::TempDir,
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        // The server goes first; its directory (the `dir` guard) after.
        let _ = self.guard.child.kill();
        let _ = self.guard.child.wait();
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

impl Prometheus {
    fn start(binary: &Path, target: SocketAddr) -> Prometheus {
        let mut log = String::new();
        // The port is free when chosen; another process may take it before
        // Prometheus binds it, so a server that exits at once is started again.
        for _ in 0..3 {
            let dir = common::scratch_dir("exporter-prometheus");
            let config = dir.path().join("prometheus.yml");
            std::fs::write(
                &config,
                format!(
                    "global:\n  scrape_interval: 500ms\n  scrape_timeout: 400ms\nscrape_configs:\n  - job_name: tidepool\n    \
                     static_configs:\n      - targets: ['{target}']\n"
                ),
            )
            .unwrap();
            let addr: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
            let child = Command::new(binary)
                .arg(format!("--config.file={}", config.display()))
                .arg(format!("--storage.tsdb.path={}", dir.path().join("data").display()))
                .arg(format!("--web.listen-address={addr}"))
                .arg("--log.level=warn")
                .stdout(Stdio::null())
                .stderr(Stdio::from(std::fs::File::create(dir.path().join("log")).unwrap()))
                .spawn()
                .unwrap();
            let mut server = Prometheus { guard: Guard { child, name: "prometheus" }, addr, dir };
            let start = Instant::now();
            while start.elapsed() < Duration::from_secs(30) && server.guard.child.try_wait().unwrap().is_none() {
                if request(addr, "GET", "/-/ready", &[]).is_ok_and(|r| r.status == 200) {
                    return server;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            log = std::fs::read_to_string(server.dir.path().join("log")).unwrap_or_default();
        }
        panic!("prometheus did not start: {log}");
    }

    /// The JSON of an instant query.
    fn query(&self, promql: &str) -> String {
        let response = request(self.addr, "GET", &format!("/api/v1/query?query={}", percent_encode(promql)), &[]).unwrap();
        assert_eq!(response.status, 200, "{}", response.body);
        assert!(response.body.contains("\"status\":\"success\""), "{}", response.body);
        response.body
    }

    /// The values of an instant query's result (one per series).
    fn values(&self, promql: &str) -> Vec<f64> {
        let json = self.query(promql);
        json.split("\"value\":[").skip(1).filter_map(|rest| rest.split('"').nth(1).and_then(|v| v.parse().ok())).collect()
    }

    /// Queries until `check` holds for the values, or panics after `timeout`.
    fn wait_for(&self, promql: &str, timeout: Duration, check: impl Fn(&[f64]) -> bool) -> Vec<f64> {
        let start = Instant::now();
        loop {
            let values = self.values(promql);
            if check(&values) {
                return values;
            }
            assert!(
                start.elapsed() < timeout,
                "{promql}: still {values:?} after {timeout:?}; targets: {}",
                request(self.addr, "GET", "/api/v1/targets", &[]).map(|r| r.body).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

/// A tidepool process on simgpu: runs only when spawned by the test below.
/// Allocates what TIDEPOOL_TEST_EXPORTER_MIB says, frees a block so that its
/// cache is not empty, writes what its own statistics report (its driver
/// calls, which are those simgpu saw), and waits for its stop file.
#[test]
#[ignore = "child process: run by prometheus_scrapes_every_process_on_a_shared_simgpu_device_and_sees_an_exited_one_go_stale"]
fn exporter_process_holds_memory() {
    let (Ok(conf), Ok(dir), Ok(mib)) = (
        std::env::var("TIDEPOOL_TEST_EXPORTER_CONF"),
        std::env::var("TIDEPOOL_TEST_EXPORTER_DIR"),
        std::env::var("TIDEPOOL_TEST_EXPORTER_MIB"),
    ) else {
        panic!("a child-process test: its parent test sets TIDEPOOL_TEST_EXPORTER_CONF, _DIR and _MIB");
    };
    let dir = PathBuf::from(dir);
    let mib: u64 = mib.parse().unwrap();
    let alloc = Allocator::new(Config::builder().conf(&conf).unwrap().build().unwrap()).unwrap();
    let held = alloc.allocate(0, (mib * MIB) as usize, Stream::DEFAULT).unwrap();
    let cached = alloc.allocate(0, (3 * MIB) as usize, Stream::DEFAULT).unwrap();
    alloc.free(0, cached).unwrap();
    let stats = alloc.stats(0).unwrap();
    // SAFETY: a simgpu entry point with no arguments.
    let simgpu_calls = unsafe { (common::simgpu::Simgpu::load().memory_calls)() } as u64;
    assert_eq!(stats.events.num_driver_calls, simgpu_calls, "the driver calls simgpu saw");
    assert!(simgpu_calls > 0);
    let me = std::process::id();
    common::write_whole(
        &dir.join(format!("{me}.stats")),
        format!("{} {} {}", stats.allocated_bytes.all.current, stats.reserved_bytes.all.current, stats.events.num_driver_calls),
    );
    let stop = dir.join(format!("{me}.stop"));
    let start = Instant::now();
    while !stop.exists() && start.elapsed() < Duration::from_secs(60) {
        std::thread::sleep(Duration::from_millis(20));
    }
    alloc.free(0, held).unwrap();
}

/// Spawns `exporter_process_holds_memory` over simgpu; its guard and the
/// (allocated, reserved, driver calls) it reports.
fn tidepool_process(dir: &Path, simgpu: &Path, mib: u64) -> (Guard, u64, u64, u64) {
    let conf = format!(
        "backend:cuda,registry_dir:{},release_after_ms:off,headroom_mb:0,reclaim_interval_ms:50,cooperative:true",
        dir.join("registry").display()
    );
    let child = common::child_command("exporter_process_holds_memory")
        .env("TIDEPOOL_TEST_EXPORTER_CONF", conf)
        .env("TIDEPOOL_TEST_EXPORTER_DIR", dir)
        .env("TIDEPOOL_TEST_EXPORTER_MIB", mib.to_string())
        .env("LD_LIBRARY_PATH", simgpu)
        .env("SIMGPU_SHARED", dir.join("simgpu-used"))
        .env("SIMGPU_CAPACITY", "1024M")
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let guard = Guard { child, name: "tidepool process" };
    let stats = dir.join(format!("{}.stats", guard.pid()));
    let start = Instant::now();
    while !stats.exists() {
        assert!(start.elapsed() < Duration::from_secs(30), "the tidepool process did not start");
        std::thread::sleep(Duration::from_millis(10));
    }
    let text = std::fs::read_to_string(stats).unwrap();
    let figures: Vec<u64> = text.split(' ').map(|f| f.parse().unwrap()).collect();
    (guard, figures[0], figures[1], figures[2])
}

#[test]
fn prometheus_scrapes_every_process_on_a_shared_simgpu_device_and_sees_an_exited_one_go_stale() {
    let (Some(prometheus), Some(promtool)) = (tool("prometheus"), tool("promtool")) else { return };
    let scratch = common::scratch_dir("exporter-prometheus-scenario");
    let dir = scratch.path();
    let simgpu = common::simgpu_dir();
    let (mut a, a_allocated, a_reserved, a_calls) = tidepool_process(dir, &simgpu, 100);
    let (b, b_allocated, _, b_calls) = tidepool_process(dir, &simgpu, 200);
    assert_ne!(a_allocated, b_allocated);
    let (mut exporter, addr) = exporter(&[&dir.join("registry")], &["--timeout", "2"]);
    let server = Prometheus::start(&prometheus, addr);

    // Each pid's series equals what the process's own statistics say.
    for (process, allocated) in [(&a, a_allocated), (&b, b_allocated)] {
        let query = format!("tidepool_allocated_bytes{{job=\"tidepool\",pid=\"{}\"}}", process.pid());
        server.wait_for(&query, Duration::from_secs(20), |v| v == [allocated as f64]);
    }
    let query = format!("tidepool_reserved_bytes{{pid=\"{}\"}}", a.pid());
    server.wait_for(&query, Duration::from_secs(5), |v| v == [a_reserved as f64]);
    // Each process's driver calls, as simgpu counted them in that process.
    for (process, calls) in [(&a, a_calls), (&b, b_calls)] {
        let query = format!("tidepool_driver_calls_total{{pid=\"{}\"}}", process.pid());
        server.wait_for(&query, Duration::from_secs(5), |v| v == [calls as f64]);
    }
    let device = "GPU-73696d67-7075-0000-0000-000000000000"; // simgpu's UUID
    server.wait_for(&format!("tidepool_processes{{device=\"{device}\"}}"), Duration::from_secs(5), |v| v == [2.0]);
    server.wait_for(&format!("tidepool_device_total_bytes{{device=\"{device}\"}}"), Duration::from_secs(5), |v| v == [1024.0 * MIB as f64]);
    server.wait_for("sum(tidepool_released_bytes_total)", Duration::from_secs(5), |v| v.len() == 1);
    server.wait_for("up{job=\"tidepool\"}", Duration::from_secs(5), |v| v == [1.0]);

    // The text promtool reads passes its checks.
    let text = metrics(addr);
    assert!(sample(&text, "tidepool_allocated_bytes", &[("pid", &b.pid().to_string()), ("device", device)]).is_some(), "{text}");
    promtool_check(&promtool, &text).unwrap_or_else(|problems| panic!("promtool check metrics:\n{problems}\n{text}"));

    // Process A exits: its series go stale at the next scrape.
    std::fs::write(dir.join(format!("{}.stop", a.pid())), b"").unwrap();
    assert!(a.child.wait().unwrap().success(), "process A failed");
    let query = format!("tidepool_allocated_bytes{{pid=\"{}\"}}", a.pid());
    server.wait_for(&query, Duration::from_secs(10), |v| v.is_empty());
    server.wait_for(&format!("tidepool_processes{{device=\"{device}\"}}"), Duration::from_secs(5), |v| v == [1.0]);
    let query = format!("tidepool_allocated_bytes{{pid=\"{}\"}}", b.pid());
    assert_eq!(server.values(&query), [b_allocated as f64], "process B is still there");
    exporter.assert_running();

    // Every query of the guide's alert rules and of its dashboard is valid
    // PromQL over these series.
    for query in guide_queries() {
        server.query(&query);
    }

    drop(b); // killed, not exited: its slot stays, but its pid is gone
    let start = Instant::now();
    while sample(&metrics(addr), "tidepool_allocated_bytes", &[]).is_some() {
        assert!(start.elapsed() < Duration::from_secs(20), "a killed process's series stayed");
        std::thread::sleep(Duration::from_millis(50));
    }
    drop((server, exporter));
}

/// A registry directory with `n` live processes (sleep children, killed on
/// drop) on one device, one named with characters label values must escape.
fn busy_registry(dir: &Path, n: usize) -> Vec<Guard> {
    let sleepers: Vec<Guard> = (0..n).map(|_| Guard { child: Command::new("sleep").arg("300").spawn().unwrap(), name: "sleep" }).collect();
    let entries: Vec<Entry> = sleepers
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let mut comm = [0u8; 16];
            let name: &[u8] = if i == 0 { b"we\"ird\\na\nme" } else { b"python3" };
            comm[..name.len()].copy_from_slice(name);
            Entry {
                pid: s.pid(),
                start_ticks: registry::process_start(s.pid()).unwrap(),
                // A slot of a process that publishes every minute, just now:
                // it beats (a heartbeat older than three intervals would not).
                heartbeat_ms: registry::now_ms(),
                interval_ms: 60_000,
                reserved: (i as u64 + 2) * 100 * MIB,
                allocated: (i as u64 + 1) * 100 * MIB,
                cached_free: 100 * MIB,
                inactive_split: 10 * MIB,
                largest_free_block: 60 * MIB,
                device_total: 80 << 30,
                device_free: 1 << 30,
                paused: 7 * MIB,
                released: [1, 2, 3, 4, 5, 6],
                driver_calls: 40 + i as u64,
                comm,
                ..Entry::default()
            }
        })
        .collect();
    registry::write_file(&dir.join(format!("cuda-{:032x}.registry", 0x1234u128)), &entries).unwrap();
    sleepers
}

#[test]
fn the_exporter_output_passes_promtool_and_escapes_label_values() {
    let Some(promtool) = tool("promtool") else { return };
    let scratch = common::scratch_dir("exporter-promtool");
    let dir = scratch.path();
    let sleepers = busy_registry(dir, 3);
    let (_exporter, addr) = exporter(&[dir], &[]);
    let text = metrics(addr);
    // The name's newline is escaped as every control character is (`printable`).
    assert!(text.contains(r#"comm="we\"ird\\na\\x0ame""#), "{text}");
    let second = [("pid", sleepers[1].pid().to_string())];
    let second: Vec<(&str, &str)> = second.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let fragmentation = sample(&text, "tidepool_fragmentation_ratio", &second).unwrap();
    assert!((fragmentation - 10.0 / 300.0).abs() < 1e-9, "inactive split over reserved: {fragmentation}");
    assert_eq!(sample(&text, "tidepool_inactive_split_bytes", &second), Some((10 * MIB) as f64));
    assert_eq!(sample(&text, "tidepool_largest_free_block_bytes", &second), Some((60 * MIB) as f64));
    assert_eq!(sample(&text, "tidepool_paused_bytes", &second), Some((7 * MIB) as f64));
    assert_eq!(sample(&text, "tidepool_released_bytes_total", &[second[0], ("reason", "cooperation")]), Some(6.0));
    assert_eq!(sample(&text, "tidepool_driver_calls_total", &second), Some(41.0));
    assert!(text.contains("# TYPE tidepool_driver_calls_total counter\n"), "{text}");
    promtool_check(&promtool, &text).unwrap_or_else(|problems| panic!("promtool check metrics:\n{problems}\n{text}"));

    // The textfile: the same text, written whole, no temporary file left.
    let textfile = dir.join("out").join("tidepool.prom");
    std::fs::create_dir_all(textfile.parent().unwrap()).unwrap();
    let status = Command::new(env!("CARGO_BIN_EXE_tidepool"))
        .args(["exporter", "--once", "--registry-dir"])
        .arg(dir)
        .arg("--textfile")
        .arg(&textfile)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .unwrap();
    assert!(status.success());
    let written = std::fs::read_to_string(&textfile).unwrap();
    promtool_check(&promtool, &written).unwrap_or_else(|problems| panic!("promtool check metrics (textfile):\n{problems}"));
    assert_eq!(sample(&written, "tidepool_processes", &[]), Some(3.0));
    let left: Vec<_> = std::fs::read_dir(textfile.parent().unwrap()).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(left, ["tidepool.prom"], "only the finished file");
    // --once serves nothing: with --listen it is refused rather than binding and leaving.
    let out = Command::new(env!("CARGO_BIN_EXE_tidepool"))
        .args(["exporter", "--once", "--listen", "127.0.0.1:0", "--textfile"])
        .arg(&textfile)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.contains("give no --listen") && out.stdout.is_empty(), "{stderr}");
}

#[test]
fn two_allocators_in_one_process_are_one_series_with_their_figures_added() {
    let scratch = common::scratch_dir("exporter-one-process");
    let dir = scratch.path();
    let sleeper = Guard { child: Command::new("sleep").arg("300").spawn().unwrap(), name: "sleep" };
    let mut comm = [0u8; 16];
    comm[..7].copy_from_slice(b"python3");
    let slot = |allocated: u64, largest: u64, heartbeat_ms: u64, ooms: u64| Entry {
        driver_calls: 10 * ooms,
        pid: sleeper.pid(),
        start_ticks: registry::process_start(sleeper.pid()).unwrap(),
        heartbeat_ms,
        interval_ms: 60_000,
        reserved: allocated + 10 * MIB,
        allocated,
        cached_free: 10 * MIB,
        inactive_split: 2 * MIB,
        largest_free_block: largest,
        ooms,
        device_total: 80 << 30,
        device_free: heartbeat_ms,
        released: [1, 2, 3, 4, 5, 6],
        comm,
        ..Entry::default()
    };
    // Heartbeats of the last minute, in whole seconds (the metric is in seconds).
    let latest = registry::now_ms() / 1000 * 1000;
    let entries = [slot(100 * MIB, 8 * MIB, latest - 5000, 1), slot(300 * MIB, 6 * MIB, latest, 2)];
    registry::write_file(&dir.join(format!("cuda-{:032x}.registry", 0x77u128)), &entries).unwrap();
    let (_exporter, addr) = exporter(&[dir], &[]);
    let text = metrics(addr);
    well_formed(&text).unwrap_or_else(|problem| panic!("{problem}\n{text}"));
    let pid = sleeper.pid().to_string();
    let this = [("pid", pid.as_str())];
    assert_eq!(sample(&text, "tidepool_allocated_bytes", &this), Some((400 * MIB) as f64));
    assert_eq!(sample(&text, "tidepool_reserved_bytes", &this), Some((420 * MIB) as f64));
    assert_eq!(sample(&text, "tidepool_largest_free_block_bytes", &this), Some((8 * MIB) as f64));
    assert_eq!(sample(&text, "tidepool_fragmentation_ratio", &this), Some(4.0 / 420.0));
    assert_eq!(sample(&text, "tidepool_ooms_total", &this), Some(3.0));
    assert_eq!(sample(&text, "tidepool_driver_calls_total", &this), Some(30.0));
    assert_eq!(sample(&text, "tidepool_released_bytes_total", &[this[0], ("reason", "cooperation")]), Some(12.0));
    assert_eq!(sample(&text, "tidepool_last_publish_timestamp_seconds", &this), Some((latest / 1000) as f64));
    assert_eq!(sample(&text, "tidepool_device_free_bytes", &[]), Some(latest as f64), "as the latest publisher saw it");
    assert_eq!(sample(&text, "tidepool_processes", &[]), Some(1.0));
    if let Some(promtool) = tool("promtool") {
        promtool_check(&promtool, &text).unwrap_or_else(|problems| panic!("promtool check metrics:\n{problems}\n{text}"));
    }
}

#[test]
fn registry_files_that_are_truncated_corrupt_or_of_another_version_are_skipped_and_counted() {
    let scratch = common::scratch_dir("exporter-bad-input");
    let dir = scratch.path();
    let _sleepers = busy_registry(dir, 2);
    // Registries of other devices (named as tidepool names them), each damaged.
    let device = |n: u128| dir.join(format!("cuda-{n:032x}.registry"));
    let mut header = b"TIDEPOOL".to_vec();
    header.extend_from_slice(&registry::VERSION.to_le_bytes());
    header.extend_from_slice(&64u32.to_le_bytes());
    std::fs::write(device(1), &header[..]).unwrap();
    let mut future = b"TIDEPOOL".to_vec();
    future.extend_from_slice(&7u32.to_le_bytes());
    future.resize(64 << 10, 0xff);
    std::fs::write(device(2), future).unwrap();
    std::fs::write(device(3), (0..20_000u32).map(|i| (i * 7919 % 251) as u8).collect::<Vec<_>>()).unwrap();
    // A whole file of the right version whose live slot's bytes were damaged.
    let mut damaged = std::fs::read(device(0x1234)).unwrap();
    damaged[16 + 40] ^= 0xff; // slot 0, a figure
    std::fs::write(device(4), damaged).unwrap();
    // Not named as a registry: not read at all.
    std::fs::write(dir.join("garbage.registry"), b"junk").unwrap();

    let (mut exporter, addr) = exporter(&[dir, &dir.join("missing")], &[]);
    let errors = |text: &str, reason: &str| sample(text, "tidepool_exporter_registry_errors_total", &[("reason", reason)]);
    let first = metrics(addr);
    assert_eq!(errors(&first, "truncated"), Some(1.0), "{first}");
    assert_eq!(errors(&first, "version"), Some(2.0), "{first}");
    assert_eq!(errors(&first, "corrupt"), Some(1.0), "{first}");
    assert_eq!(errors(&first, "locked"), Some(0.0));
    // The good file's processes are served; the damaged copy's other slot too.
    assert_eq!(sample(&first, "tidepool_processes", &[("device", "GPU-00000000-0000-0000-0000-000000001234")]), Some(2.0));
    assert_eq!(sample(&first, "tidepool_processes", &[("device", "GPU-00000000-0000-0000-0000-000000000004")]), Some(1.0), "{first}");
    assert_eq!(first.lines().filter(|l| l.starts_with("tidepool_allocated_bytes{")).count(), 3, "{first}");
    // Counted again at each scrape that meets them; the exporter keeps going.
    let second = metrics(addr);
    assert_eq!(errors(&second, "truncated"), Some(2.0));
    exporter.assert_running();
}

#[test]
fn only_get_of_metrics_and_the_index_are_served() {
    let scratch = common::scratch_dir("exporter-routes");
    let dir = scratch.path();
    let (_exporter, addr) = exporter(&[dir], &[]);
    let index = request(addr, "GET", "/", &[]).unwrap();
    assert_eq!(index.status, 200);
    assert!(index.body.contains("href=\"/metrics\""), "{}", index.body);
    let text = request(addr, "GET", "/metrics", &[("Accept", "text/plain;version=0.0.4")]).unwrap();
    assert_eq!(text.header("content-type"), Some("text/plain; version=0.0.4; charset=utf-8"));
    assert!(text.body.contains("# TYPE tidepool_ooms_total counter"));
    let om = request(addr, "GET", "/metrics", &[("Accept", "application/openmetrics-text;version=1.0.0,text/plain;q=0.5")]).unwrap();
    assert_eq!(om.header("content-type"), Some("application/openmetrics-text; version=1.0.0; charset=utf-8"));
    assert!(om.body.contains("# TYPE tidepool_ooms counter") && om.body.ends_with("# EOF\n"), "{}", om.body);
    let head = request(addr, "HEAD", "/metrics", &[]).unwrap();
    assert_eq!((head.status, head.body.as_str()), (200, ""));
    assert_eq!(request(addr, "GET", "/metrics/extra", &[]).unwrap().status, 404);
    assert_eq!(request(addr, "GET", "/index.html", &[]).unwrap().status, 404);
    for method in ["POST", "PUT", "DELETE", "OPTIONS"] {
        let refused = request(addr, method, "/metrics", &[]).unwrap();
        assert_eq!(refused.status, 405, "{method}");
        assert_eq!(refused.header("allow"), Some("GET, HEAD"));
    }
}

#[test]
fn a_client_that_connects_and_sends_nothing_is_dropped_at_the_timeout() {
    let scratch = common::scratch_dir("exporter-silent");
    let dir = scratch.path();
    let (_exporter, addr) = exporter(&[dir], &["--timeout", "1"]);
    let dropped_after = |slow: bool| {
        let mut stream = TcpStream::connect(addr).unwrap();
        stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let start = Instant::now();
        if slow {
            // Headers dribbled a byte at a time never finish in time either.
            stream.set_nonblocking(true).unwrap();
            let mut buf = [0u8; 256];
            for byte in b"GET /metrics HTTP/1.1\r\nX-Slow: ".iter().cycle() {
                if stream.write_all(&[*byte]).is_err() {
                    break;
                }
                match stream.read(&mut buf) {
                    Ok(_) => break,
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                    Err(_) => break,
                }
                assert!(start.elapsed() < Duration::from_secs(10), "a slow client was never dropped");
                std::thread::sleep(Duration::from_millis(100));
            }
        } else {
            let mut rest = Vec::new();
            let _ = stream.read_to_end(&mut rest);
        }
        start.elapsed()
    };
    let silent = dropped_after(false);
    assert!(silent >= Duration::from_millis(900) && silent < Duration::from_secs(4), "dropped after {silent:?}");
    let slow = dropped_after(true);
    assert!(slow >= Duration::from_millis(900) && slow < Duration::from_secs(4), "dropped after {slow:?}");
    assert_eq!(request(addr, "GET", "/metrics", &[]).unwrap().status, 200, "and others are served");
}

#[test]
fn past_the_bound_the_oldest_idle_connection_makes_room_and_a_scrape_is_served_at_once() {
    let scratch = common::scratch_dir("exporter-bound");
    let dir = scratch.path();
    let (_exporter, addr) = exporter(&[dir], &["--timeout", "5", "--max-connections", "4"]);
    let idle: Vec<TcpStream> = (0..4).map(|_| TcpStream::connect(addr).unwrap()).collect();
    std::thread::sleep(Duration::from_millis(100));
    let start = Instant::now();
    assert_eq!(request(addr, "GET", "/metrics", &[]).unwrap().status, 200);
    let waited = start.elapsed();
    assert!(waited < Duration::from_millis(1000), "waited {waited:?} behind idle connections");
    // The oldest idle connection was closed to make room; the others are still open.
    let closed = |mut stream: &TcpStream| {
        stream.set_nonblocking(true).unwrap();
        matches!(stream.read(&mut [0u8; 16]), Ok(0))
    };
    let states: Vec<bool> = idle.iter().map(closed).collect();
    assert_eq!(states, [true, false, false, false], "the oldest idle connection goes first");
}

/// Raises this process's open-file limit to at least `wanted` where the
/// hard limit allows; what it is now.
fn open_files_limit(wanted: u64) -> u64 {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit and setrlimit read and write the struct given.
    unsafe {
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit);
        if limit.rlim_cur < wanted {
            limit.rlim_cur = wanted.min(limit.rlim_max);
            libc::setrlimit(libc::RLIMIT_NOFILE, &limit);
        }
    }
    limit.rlim_cur
}

#[test]
fn a_thousand_idle_connections_and_twenty_slow_clients_do_not_delay_a_scrape() {
    let scratch = common::scratch_dir("exporter-starved");
    let dir = scratch.path();
    let _sleepers = busy_registry(dir, 4);
    let (mut exporter, addr) = exporter(&[dir], &[]);
    metrics(addr); // the server's own files (its runtime's) opened before counting
    let (before_rss, before_files) = (exporter.rss_kib(), exporter.open_files());
    // 1,000 connections that send nothing (fewer where this process may not open so many files).
    let idle_count = (open_files_limit(1300).saturating_sub(200) as usize).min(1000);
    let idle: Vec<TcpStream> = (0..idle_count).map(|_| TcpStream::connect(addr).unwrap()).collect();
    // 20 clients sending their headers a byte a second, held open.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let slow: Vec<_> = (0..20)
        .map(|_| {
            let stop = stop.clone();
            std::thread::spawn(move || {
                for byte in b"GET /metrics HTTP/1.1\r\nX-Slow: ".iter().cycle() {
                    // Reconnect when dropped: the attack goes on.
                    let Ok(mut stream) = TcpStream::connect(addr) else { return };
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) && stream.write_all(&[*byte]).is_ok() {
                        std::thread::sleep(Duration::from_secs(1));
                    }
                    if stop.load(std::sync::atomic::Ordering::Relaxed) {
                        return;
                    }
                }
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(500));
    let mut slowest = Duration::ZERO;
    for _ in 0..100 {
        let start = Instant::now();
        let text = metrics(addr);
        slowest = slowest.max(start.elapsed());
        assert_eq!(text.lines().filter(|l| l.starts_with("tidepool_allocated_bytes{")).count(), 4, "every process present");
    }
    let (rss, files) = (exporter.rss_kib(), exporter.open_files());
    eprintln!(
        "100 scrapes beside {idle_count} idle connections and 20 slow clients: slowest {slowest:?}; exporter RSS {before_rss} -> {rss} KiB, \
         open files {before_files} -> {files}"
    );
    assert!(slowest < Duration::from_millis(100), "a scrape took {slowest:?}");
    // The default --max-connections, and a newcomer waiting for a closed one's room.
    assert!(files <= before_files + 64 + 1, "open files grew from {before_files} to {files}: past --max-connections");
    assert!(rss <= before_rss + 16 * 1024, "memory grew from {before_rss} KiB to {rss} KiB");
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    drop(idle);
    for thread in slow {
        thread.join().unwrap();
    }
    exporter.assert_running();
}

/// The kernel's count of connections a full listen queue dropped (all
/// sockets of this network namespace), from /proc/net/netstat.
fn listen_overflows() -> u64 {
    let text = std::fs::read_to_string("/proc/net/netstat").unwrap_or_default();
    let lines: Vec<&str> = text.lines().filter(|l| l.starts_with("TcpExt:")).collect();
    let [names, values] = lines[..] else { return 0 };
    let at = names.split_whitespace().position(|n| n == "ListenOverflows");
    at.and_then(|i| values.split_whitespace().nth(i)).and_then(|v| v.parse().ok()).unwrap_or(0)
}

/// A load test: it measures time with four threads flooding the machine,
/// so it runs alone, after the suite (`./test.sh`); beside the suite's other
/// tests on two cores it would measure them.
#[test]
#[ignore = "a load test, run alone after the suite by ./test.sh"]
fn a_flood_of_connects_and_partial_requests_fails_no_scrape_and_delays_none_past_100_ms() {
    let scratch = common::scratch_dir("exporter-flood");
    let dir = scratch.path();
    let _sleepers = busy_registry(dir, 4);
    let (mut exporter, addr) = exporter(&[dir], &[]);
    metrics(addr);
    // Four threads connect, send part of a request and close, 7,000 times
    // a second in all, in bursts: each connects as fast as it can for 50 ms,
    // then rests until its average is 7,000 a second again. They run at the
    // lowest priority: a flood comes from other machines, whose CPU the
    // exporter does not share (here all share two cores).
    const RATE: u64 = 7000;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flood: Vec<_> = (0..4)
        .map(|_| {
            let stop = stop.clone();
            std::thread::spawn(move || {
                // SAFETY: sets this thread's nice value; no memory is involved.
                unsafe { libc::setpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t, 19) };
                let (start, mut connects, mut slowest) = (Instant::now(), 0u64, Duration::ZERO);
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let burst = Instant::now();
                    while burst.elapsed() < Duration::from_millis(50) {
                        let connecting = Instant::now();
                        if let Ok(mut stream) = TcpStream::connect(addr) {
                            slowest = slowest.max(connecting.elapsed());
                            let _ = stream.write_all(b"GET /metrics HTTP/1.1\r\nHost: flood\r\n");
                            connects += 1;
                        }
                    }
                    let due = start + Duration::from_micros(connects * 4_000_000 / RATE);
                    std::thread::sleep(due.saturating_duration_since(Instant::now()));
                }
                (connects, slowest)
            })
        })
        .collect();
    let overflows_before = listen_overflows();
    std::thread::sleep(Duration::from_millis(200));
    let start = Instant::now();
    let (mut slowest, mut failures) = (Duration::ZERO, Vec::new());
    for i in 0..100 {
        let asked = Instant::now();
        match request(addr, "GET", "/metrics", &[]) {
            Ok(r) if r.status == 200 && r.body.lines().filter(|l| l.starts_with("tidepool_allocated_bytes{")).count() == 4 => {}
            Ok(r) => failures.push(format!("scrape {i}: status {} body {:?}", r.status, &r.body[..r.body.len().min(80)])),
            Err(err) => failures.push(format!("scrape {i}: {err}")),
        }
        slowest = slowest.max(asked.elapsed());
        // One every 100 ms: the flood lasts 10 s.
        std::thread::sleep((start + Duration::from_millis(100 * (i + 1))).saturating_duration_since(Instant::now()));
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (mut connects, mut slowest_connect) = (0, Duration::ZERO);
    for thread in flood {
        let (n, slowest) = thread.join().unwrap();
        (connects, slowest_connect) = (connects + n, slowest_connect.max(slowest));
    }
    let seconds = start.elapsed().as_secs_f64() + 0.2;
    eprintln!(
        "a flood of {:.0} connects a second for {seconds:.1} s (slowest connect {slowest_connect:?}): 100 scrapes, slowest \
         {slowest:?}, {} failed; listen queue overflows {}",
        connects as f64 / seconds,
        failures.len(),
        listen_overflows() - overflows_before
    );
    assert!(failures.is_empty(), "{failures:#?}");
    assert!(slowest < Duration::from_millis(100), "a scrape took {slowest:?}");
    // No connect of the flood was dropped by a full listen queue (the
    // kernel would have made it wait a second to try again), and the flood
    // got through (at its rate, where the machine's other tests leave it the CPU).
    assert!(slowest_connect < Duration::from_millis(500), "a connect waited {slowest_connect:?}");
    assert!(connects as f64 / seconds > 0.5 * RATE as f64, "{connects} connects in {seconds:.1} s");
    exporter.assert_running();
}

/// Whether `text` is a well-formed text exposition: every line a comment
/// or `name{labels} value`, every sample's family described, the scrape whole.
fn well_formed(text: &str) -> Result<(), String> {
    let (mut described, mut series_seen) = (std::collections::HashSet::new(), std::collections::HashSet::new());
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            described.insert(rest.split(' ').next().unwrap_or("").to_string());
            continue;
        }
        if line.starts_with("# HELP ") {
            continue;
        }
        let (series, value) = line.rsplit_once(' ').ok_or_else(|| format!("no value: {line:?}"))?;
        value.parse::<f64>().map_err(|_| format!("bad value: {line:?}"))?;
        let name = series.split('{').next().unwrap();
        if !described.contains(name) {
            return Err(format!("undescribed sample: {line:?}"));
        }
        if series.contains('{') && !series.ends_with('}') {
            return Err(format!("unclosed labels: {line:?}"));
        }
        if !series_seen.insert(series) {
            return Err(format!("duplicate series: {line:?}"));
        }
    }
    if !text.ends_with('\n') || !text.contains("tidepool_exporter_scrape_duration_seconds{") {
        return Err("cut short".into());
    }
    Ok(())
}

#[test]
fn a_thousand_scrapes_from_32_concurrent_clients_leave_memory_flat_and_every_response_well_formed() {
    let scratch = common::scratch_dir("exporter-load");
    let dir = scratch.path();
    let _sleepers = busy_registry(dir, 16);
    let (mut exporter, addr) = exporter(&[dir], &[]);
    let scrapes = |total: usize| {
        let threads: Vec<_> = (0..32)
            .map(|t| {
                std::thread::spawn(move || {
                    for _ in (t..total).step_by(32) {
                        let response = request(addr, "GET", "/metrics", &[]).unwrap();
                        assert_eq!(response.status, 200);
                        let length: usize = response.header("content-length").unwrap().parse().unwrap();
                        assert_eq!(length, response.body.len(), "whole body");
                        well_formed(&response.body).unwrap();
                        assert_eq!(response.body.lines().filter(|l| l.starts_with("tidepool_allocated_bytes{")).count(), 16);
                    }
                })
            })
            .collect();
        for thread in threads {
            thread.join().unwrap();
        }
    };
    scrapes(200); // warm up: threads, buffers and allocator arenas reach their working size
    let before = exporter.rss_kib();
    let start = Instant::now();
    scrapes(1000);
    let elapsed = start.elapsed();
    let after = exporter.rss_kib();
    eprintln!("1000 scrapes from 32 clients in {elapsed:?}; exporter RSS {before} KiB before, {after} KiB after");
    assert!(after <= before + 2048, "memory grew from {before} KiB to {after} KiB over 1000 scrapes");
    exporter.assert_running();
}

/// The fenced block that follows `<!-- name -->` in docs/monitoring.md.
fn guide_block(name: &str) -> String {
    let guide = std::fs::read_to_string(common::repo_root().join("docs/monitoring.md")).unwrap();
    let after = guide.split_once(&format!("<!-- {name} -->")).unwrap_or_else(|| panic!("no {name} in the guide")).1;
    let body = after.split_once("```yaml\n").unwrap().1;
    body.split_once("```").unwrap().0.to_string()
}

/// Every PromQL expression of the guide's alert rules and of the Grafana
/// dashboard, with the dashboard's variables set to match everything.
fn guide_queries() -> Vec<String> {
    let mut queries = Vec::new();
    let rules = guide_block("tidepool-rules.yml");
    let mut lines = rules.lines().peekable();
    while let Some(line) = lines.next() {
        if line.trim() == "expr: |" {
            let mut expr = String::new();
            while lines.peek().is_some_and(|l| l.starts_with("          ")) {
                expr += lines.next().unwrap().trim();
                expr += " ";
            }
            queries.push(expr);
        }
    }
    assert_eq!(queries.len(), 3, "the three alert rules");
    let path = common::repo_root().join("docs/monitoring/tidepool-dashboard.json");
    let dashboard: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let panels = dashboard["panels"].as_array().unwrap();
    for panel in panels {
        for target in panel["targets"].as_array().unwrap() {
            let expr = target["expr"].as_str().unwrap();
            queries.push(expr.replace("$hostname", ".*").replace("$device", ".*").replace("$__rate_interval", "1m"));
        }
    }
    assert!(panels.len() >= 6 && queries.len() > 12);
    let titles: Vec<&str> = panels.iter().map(|p| p["title"].as_str().unwrap()).collect();
    for needed in ["Reserved vs allocated", "Fragmentation", "by reason", "Driver calls"] {
        assert!(titles.iter().any(|t| t.contains(needed)), "the dashboard shows {needed}: {titles:?}");
    }
    queries
}

#[test]
fn the_guides_scrape_config_and_alert_rules_pass_promtool_and_the_alerts_fire_when_they_should() {
    let Some(promtool) = tool("promtool") else { return };
    let scratch = common::scratch_dir("exporter-rules");
    let dir = scratch.path();
    std::fs::write(dir.join("prometheus.yml"), guide_block("prometheus.yml")).unwrap();
    std::fs::write(dir.join("tidepool-rules.yml"), guide_block("tidepool-rules.yml")).unwrap();
    let labels = |device: &str, pid: u32, comm: &str| {
        format!("{{hostname=\"n1\",device=\"{device}\",device_index=\"0\",pid=\"{pid}\",comm=\"{comm}\"}}")
    };
    let gib4 = 4u64 << 30;
    let series = |name: &str, labels: &str, values: &str| format!("      - series: '{name}{labels}'\n        values: '{values}'\n");
    let mut input = String::new();
    // Device A: "train" (pid 1) runs out of memory from minute 2; "idle" (pid 2) holds 4 GiB of whole free segments.
    input += &series("tidepool_ooms_total", &labels("GPU-a", 1, "train"), "0 0 1 2 2 2 2 2 2 2 2");
    input += &series("tidepool_cached_free_bytes", &labels("GPU-a", 1, "train"), "0x10");
    input += &series("tidepool_inactive_split_bytes", &labels("GPU-a", 1, "train"), "0x10");
    input += &series("tidepool_ooms_total", &labels("GPU-a", 2, "idle"), "0x10");
    input += &series("tidepool_cached_free_bytes", &labels("GPU-a", 2, "idle"), &format!("{gib4}x10"));
    input += &series("tidepool_inactive_split_bytes", &labels("GPU-a", 2, "idle"), "0x10");
    // Device B: the same cache, nobody short of memory: no alert.
    input += &series("tidepool_ooms_total", &labels("GPU-b", 3, "idle"), "0x10");
    input += &series("tidepool_cached_free_bytes", &labels("GPU-b", 3, "idle"), &format!("{gib4}x10"));
    input += &series("tidepool_inactive_split_bytes", &labels("GPU-b", 3, "idle"), "0x10");
    // Device C: "frag" (pid 5) is half fragments and asks the others at minute 2;
    // "calm" (pid 6) is as fragmented but never waits: no alert.
    for (pid, comm, asks) in [(5, "frag", "0 0 1 1 1 1 1 1 1 1 1"), (6, "calm", "0x10")] {
        input += &series("tidepool_fragmentation_ratio", &labels("GPU-c", pid, comm), "0.5x10");
        input += &series("tidepool_memory_request_bytes", &labels("GPU-c", pid, comm), "0x10");
        input += &series("tidepool_cooperation_requests_total", &labels("GPU-c", pid, comm), asks);
    }
    // Device D: "churn" (pid 7) makes 60 driver calls a minute for 45
    // minutes; "steady" (pid 8) makes 500 in its first 3 minutes (the
    // warm-up), then none.
    input += &series("tidepool_driver_calls_total", &labels("GPU-d", 7, "churn"), "0+60x45");
    input += &series("tidepool_driver_calls_total", &labels("GPU-d", 8, "steady"), "0 200 400 500x42");
    let expect = |alert: &str, at: &str, fires: Option<(&str, u32, &str, String)>| {
        let mut text = format!("      - eval_time: {at}\n        alertname: {alert}\n        exp_alerts:");
        match fires {
            None => text += " []\n",
            Some((device, pid, comm, summary)) => {
                let (severity, description) = if alert.contains("Fragmented") {
                    (
                        "warning",
                        "Keep expandable segments on (the default; free pages inside holes go back) or set max_split_size_mb for this job.",
                    )
                } else if alert.contains("Churn") {
                    (
                        "info",
                        "A steady step makes none once its cache is warm: look for a budget or memory fraction below the step's peak, \
                         headroom_mb, cooperation with another process, memory used less often than release_after_ms, or empty_cache every step.",
                    )
                } else {
                    (
                        "warning",
                        "Keep cooperative:true (the default) and the registry directory shared by both jobs, or lower release_after_ms for the holder.",
                    )
                };
                text += &format!(
                    "\n          - exp_labels: {{severity: {severity}, hostname: n1, device: {device}, device_index: \"0\", pid: \"{pid}\", comm: {comm}}}\n\
                     \x20           exp_annotations:\n              summary: \"{summary}\"\n              description: \"{description}\"\n"
                );
            }
        }
        text
    };
    let idle_alert = "TidepoolIdleCacheWhileAnotherOOMs";
    let frag_alert = "TidepoolFragmentedWhileWaiting";
    let mut tests = String::new();
    tests += &expect(idle_alert, "1m", None);
    let idle_summary = "idle (2) on n1 holds 4GiB of cache while another process on the device runs out of memory".to_string();
    tests += &expect(idle_alert, "5m", Some(("GPU-a", 2, "idle", idle_summary)));
    tests += &expect(frag_alert, "3m", None); // asking, but not yet for 2 minutes
    let frag_summary = "frag (5) on n1 waits for memory while 50% of its memory is fragments".to_string();
    tests += &expect(frag_alert, "5m", Some(("GPU-c", 5, "frag", frag_summary)));
    // Churn: pending from the second minute, firing once it has lasted 30
    // minutes; the steady process, flat after its warm-up, never.
    let churn_alert = "TidepoolDriverCallChurn";
    tests += &expect(churn_alert, "20m", None);
    let churn_summary = "churn (7) on n1 still makes 1 memory driver calls a second after 30 minutes".to_string();
    tests += &expect(churn_alert, "40m", Some(("GPU-d", 7, "churn", churn_summary)));
    let unit = format!(
        "rule_files:\n  - tidepool-rules.yml\nevaluation_interval: 1m\ntests:\n  - interval: 1m\n    input_series:\n{input}    alert_rule_test:\n{tests}"
    );
    std::fs::write(dir.join("tidepool-rules.test.yml"), &unit).unwrap();
    for args in [
        &["check", "config", "prometheus.yml"][..],
        &["check", "rules", "tidepool-rules.yml"],
        &["test", "rules", "tidepool-rules.test.yml"],
    ] {
        let out = Command::new(&promtool).args(args).current_dir(dir).output().unwrap();
        assert!(
            out.status.success(),
            "promtool {}:\n{}{}\n{unit}",
            args.join(" "),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

#[test]
fn listen_takes_a_host_name() {
    let scratch = common::scratch_dir("exporter-listen");
    let empty = scratch.path();
    let mut child = Command::new(env!("CARGO_BIN_EXE_tidepool"))
        .args(["exporter", "--listen", "localhost:0", "--registry-dir"])
        .arg(empty)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let _guard = Guard { child, name: "tidepool exporter" };
    assert!(line.starts_with("tidepool exporter: listening on ") && line.contains("/metrics"), "{line:?}");
    let refused = Command::new(env!("CARGO_BIN_EXE_tidepool")).args(["exporter", "--listen", "no port here"]).output().unwrap();
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success() && stderr.contains("expected ADDR:PORT or HOST:PORT"), "{stderr}");
}
