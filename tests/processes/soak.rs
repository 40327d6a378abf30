//! The soak: four processes, four threads each, on one simgpu device whose
//! capacity they share (SIMGPU_SHARED), for a bounded time
//! (TIDEPOOL_SOAK_SECS: 30 s under CI=true, 10 s otherwise). Random sizes
//! and streams, `record_stream` with work queued on the other stream,
//! `empty_cache`, a memory fraction in one process, expandable segments in
//! two, threads' caches and cooperation on in all (tight cache bounds in
//! one); the device is too small for all of them, so requests fail,
//! processes ask each other and answer. One process is
//! killed with SIGKILL partway and started again.
//!
//! Checked: every block's byte pattern is intact when it is freed; each
//! process's `validate()` passes at the end; the killed process's registry
//! slot and simgpu slot are cleared and its device memory comes back while
//! the others keep allocating; at the end the device's whole capacity is
//! free. Printed: operations per second, out-of-memory errors, cooperation
//! requests, the requests served and the last wait.

use crate::common;

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use common::simgpu::Simgpu;
use common::{check, fill, Rng, KIB, MIB};
use tidepool::{AllocError, Allocator, DevicePtr, Stream};

const THREADS: u64 = 4;
/// Blocks one thread holds at most.
const LIVE_PER_THREAD: usize = 48;
const CAPACITY: &str = "2G";

fn unix_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_millis() as u64
}

/// What one worker thread did.
#[derive(Default)]
struct Counts {
    ops: u64,
    ooms: u64,
}

/// A size: mostly small, some of a few MiB, a few large.
fn pick_size(rng: &mut Rng) -> usize {
    (match rng.below(10) {
        0..=5 => 512 + rng.below(256 * KIB),
        6..=8 => MIB + rng.below(8 * MIB),
        _ => 16 * MIB + rng.below(32 * MIB),
    }) as usize
}

/// Frees a live block after checking its pattern.
fn free_checked(alloc: &Allocator, (ptr, size, stream, tag): (DevicePtr, usize, Stream, u64)) {
    if let Err(offset) = check(ptr, size as u64, tag) {
        panic!("block {ptr:?} of {size} bytes (tag {tag}) was overwritten at offset {offset}");
    }
    alloc.free_on_stream(0, ptr, stream).unwrap();
}

/// One worker thread: random operations until `deadline`.
fn run_thread(alloc: &Allocator, sim: &Simgpu, streams: &[Stream], seed: u64, deadline: Instant, ops: &AtomicU64) -> Counts {
    let mut rng = Rng(seed);
    let mut counts = Counts::default();
    let mut live: Vec<(DevicePtr, usize, Stream, u64)> = Vec::new();
    let mut tag = seed << 20;
    while counts.ops % 64 != 0 || Instant::now() < deadline {
        counts.ops += 1;
        ops.fetch_add(1, Ordering::Relaxed);
        match rng.below(100) {
            0..=54 => {
                let (size, stream) = (pick_size(&mut rng), streams[rng.below(streams.len() as u64) as usize]);
                match alloc.allocate(0, size, stream) {
                    Ok(ptr) => {
                        tag += 1;
                        fill(ptr, size as u64, tag);
                        live.push((ptr, size, stream, tag));
                    }
                    Err(AllocError::OutOfMemory(_)) => {
                        counts.ooms += 1;
                        // Make room: give back half of what this thread holds.
                        for _ in 0..live.len().div_ceil(2) {
                            free_checked(alloc, live.swap_remove(rng.below(live.len() as u64) as usize));
                        }
                    }
                    Err(other) => panic!("allocate({size}): {other}"),
                }
                if live.len() > LIVE_PER_THREAD {
                    free_checked(alloc, live.swap_remove(rng.below(live.len() as u64) as usize));
                }
            }
            55..=89 if !live.is_empty() => free_checked(alloc, live.swap_remove(rng.below(live.len() as u64) as usize)),
            90..=94 if !live.is_empty() => {
                // Used on another stream too, with work queued there: its
                // memory is not reused until that work is done.
                let (ptr, _, own, _) = live[rng.below(live.len() as u64) as usize];
                let other = streams[rng.below(streams.len() as u64) as usize];
                if other != own {
                    // SAFETY: queues a sleep on a stream made by this process.
                    unsafe { (sim.enqueue_sleep)(other.0, 50) };
                    alloc.record_stream(ptr, other).unwrap();
                }
            }
            95..=96 => {
                alloc.empty_cache();
            }
            97 => {
                alloc.stats(0).unwrap();
            }
            98 if counts.ops % 16 == 0 => alloc.validate().unwrap(),
            _ => {}
        }
    }
    for block in live {
        free_checked(alloc, block);
    }
    counts
}

/// The child side: one soak process (its configuration from the parent).
#[test]
#[ignore = "child process: run by four_processes_share_one_device_through_a_kill"]
fn child_soak_worker() {
    common::child_only();
    let conf = std::env::var("TIDEPOOL_TEST_CONF").unwrap();
    let secs: f64 = std::env::var("TIDEPOOL_SOAK_SECS").unwrap().parse().unwrap();
    let seed: u64 = std::env::var("TIDEPOOL_SOAK_SEED").unwrap().parse().unwrap();
    let alloc = common::conf_allocator(&conf);
    if let Ok(fraction) = std::env::var("TIDEPOOL_SOAK_FRACTION") {
        alloc.set_memory_fraction(0, fraction.parse().unwrap()).unwrap();
    }
    let sim = Simgpu::load();
    let streams: Vec<Stream> = std::iter::once(Stream::DEFAULT).chain((0..3).map(|_| Stream(sim.stream()))).collect();
    let start = Instant::now();
    let deadline = start + Duration::from_secs_f64(secs);
    let ops = AtomicU64::new(0);
    let done = AtomicBool::new(false);
    println!("ready");
    let counts: Vec<Counts> = std::thread::scope(|scope| {
        // A heartbeat: the parent checks that the others go on past a kill.
        scope.spawn(|| {
            while !done.load(Ordering::Relaxed) {
                println!("tick {} {}", unix_ms(), ops.load(Ordering::Relaxed));
                std::thread::sleep(Duration::from_millis(250));
            }
        });
        let workers: Vec<_> = (0..THREADS)
            .map(|t| {
                let (alloc, sim, streams, ops) = (&alloc, &sim, &streams, &ops);
                scope.spawn(move || run_thread(alloc, sim, streams, seed * 16 + t + 1, deadline, ops))
            })
            .collect();
        let counts = workers.into_iter().map(|w| w.join().unwrap()).collect();
        done.store(true, Ordering::Relaxed);
        counts
    });
    for s in &streams[1..] {
        // SAFETY: waits for the queued work of a stream made above.
        unsafe { (sim.stream_synchronize)(s.0) };
    }
    alloc.validate().unwrap();
    let stats = alloc.stats(0).unwrap();
    assert_eq!(stats.allocated_bytes.all.current, 0, "every block was freed");
    let e = stats.events;
    let (total, ooms): (u64, u64) = (counts.iter().map(|c| c.ops).sum(), counts.iter().map(|c| c.ooms).sum());
    println!(
        "soak: {total} ops in {:.1} s ({:.0} ops/s), {ooms} out of memory, cooperation: {} requests, {} satisfied, {} served, last wait {} ms",
        start.elapsed().as_secs_f64(),
        total as f64 / start.elapsed().as_secs_f64(),
        e.num_coop_requests,
        e.num_coop_satisfied,
        e.num_coop_served,
        e.coop_last_wait_ms,
    );
}

/// The child side: prints the device's free and total bytes.
#[test]
#[ignore = "child process: run by four_processes_share_one_device_through_a_kill"]
fn child_soak_probe() {
    common::child_only();
    let alloc = common::conf_allocator("backend:cuda");
    let info = alloc.backend().mem_info(0).unwrap();
    println!("free {} total {}", info.free, info.total);
}

/// The pids of the processes holding slots in simgpu's shared file (its
/// layout in cuda/simgpu/simgpu.c: a 16-byte header, then 128 slots of a
/// 4-byte pid, 4 spare bytes and 16 byte counts).
fn simgpu_pids(shared: &Path) -> Vec<i32> {
    const HEADER: usize = 16;
    const SLOT: usize = 8 + 8 * 16;
    let raw = std::fs::read(shared).unwrap();
    (0..128)
        .filter_map(|i| raw.get(HEADER + SLOT * i..HEADER + SLOT * i + 4))
        .map(|pid| i32::from_le_bytes(pid.try_into().unwrap()))
        .filter(|&pid| pid != 0)
        .collect()
}

struct Soak {
    dir: PathBuf,
    env: Vec<(&'static str, String)>,
}

impl Soak {
    /// Starts worker `index` for `secs` seconds; returns once it is ready.
    fn spawn(&self, index: u64, secs: f64) -> (Child, BufReader<std::process::ChildStdout>) {
        // Two expandable, one capped by a memory fraction with threads'
        // caches of tight bounds (they fill and evict), one plain; threads'
        // caches on in all four.
        let extra = ["", "expandable:true", "thread_cache_blocks:4,thread_cache_mb:2", "expandable:true"][index as usize];
        let conf = format!(
            "backend:cuda,registry_dir:{},cooperative:true,reclaim_interval_ms:20,oom_wait_ms:300,release_after_ms:200,{extra}",
            self.dir.join("registry").display()
        );
        let mut command = common::child_command("child_soak_worker");
        command
            .envs(self.env.iter().map(|(k, v)| (*k, v.as_str())))
            .env("TIDEPOOL_TEST_CONF", conf)
            .env("TIDEPOOL_SOAK_SECS", secs.to_string())
            .env("TIDEPOOL_SOAK_SEED", (index + 1).to_string())
            .stdout(Stdio::piped());
        if index == 2 {
            command.env("TIDEPOOL_SOAK_FRACTION", "0.3");
        }
        let mut child = command.spawn().unwrap();
        let mut out = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        while out.read_line(&mut line).unwrap() > 0 && !line.contains("ready") {
            line.clear();
        }
        assert!(line.contains("ready"), "worker {index} did not start");
        (child, out)
    }

    /// Waits for a worker to end: asserts that it passed; returns its output.
    fn finish(&self, index: u64, (child, mut out): (Child, BufReader<std::process::ChildStdout>)) -> String {
        let mut text = String::new();
        out.read_to_string(&mut text).unwrap();
        let mut stderr = String::new();
        let output = child.wait_with_output().unwrap();
        stderr.push_str(&String::from_utf8_lossy(&output.stderr));
        assert!(output.status.success() && text.contains("test result: ok. 1 passed"), "worker {index} failed:\n{text}\n{stderr}");
        text
    }
}

/// The heartbeats of a worker's output: (unix ms, operations so far).
fn ticks(text: &str) -> Vec<(u64, u64)> {
    text.lines()
        .filter_map(|l| l.strip_prefix("tick "))
        .filter_map(|l| l.split_once(' '))
        .map(|(ms, ops)| (ms.parse().unwrap(), ops.parse().unwrap()))
        .collect()
}

#[test]
fn four_processes_share_one_device_through_a_kill() {
    let secs: f64 =
        std::env::var("TIDEPOOL_SOAK_SECS").ok().and_then(|s| s.parse().ok()).unwrap_or(if common::in_ci() { 30.0 } else { 10.0 });
    let scratch = common::scratch_dir("soak");
    let dir = scratch.path();
    let shared = dir.join("simgpu-used");
    let soak = Soak {
        env: vec![
            ("LD_LIBRARY_PATH", common::simgpu_dir().display().to_string()),
            ("SIMGPU_SHARED", shared.display().to_string()),
            ("SIMGPU_CAPACITY", CAPACITY.to_string()),
        ],
        dir: dir.to_path_buf(),
    };
    let start = Instant::now();
    let mut workers: Vec<_> = (0..4).map(|i| Some(soak.spawn(i, secs))).collect();

    // Partway, worker 1 (expandable) dies by SIGKILL while holding memory.
    std::thread::sleep(Duration::from_secs_f64(secs * 0.4));
    let (mut victim, _) = workers[1].take().unwrap();
    let pid = victim.id();
    assert!(simgpu_pids(&shared).contains(&(pid as i32)), "the victim holds device memory in simgpu's count");
    let registry = std::fs::read_dir(dir.join("registry"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|e| e == "registry"))
        .expect("a registry file");
    assert!(tidepool::registry::slot_pids(&registry).unwrap().contains(&pid), "the victim has a registry slot");
    victim.kill().unwrap();
    victim.wait().unwrap();
    let killed_at = unix_ms();
    // The others clear its slots as they go on: its memory is free again.
    assert!(
        common::eventually(Duration::from_secs(10), || !simgpu_pids(&shared).contains(&(pid as i32))),
        "simgpu still counts the killed process's memory"
    );
    assert!(
        common::eventually(Duration::from_secs(10), || !tidepool::registry::slot_pids(&registry).unwrap().contains(&pid)),
        "the killed process's registry slot was not cleared"
    );
    // Started again for the rest of the time.
    let left = (secs - start.elapsed().as_secs_f64()).max(2.0);
    workers[1] = Some(soak.spawn(1, left));

    let outputs: Vec<String> = workers.into_iter().enumerate().map(|(i, w)| soak.finish(i as u64, w.unwrap())).collect();
    for (i, text) in outputs.iter().enumerate() {
        let summary = text.lines().find(|l| l.starts_with("soak: ")).unwrap_or_else(|| panic!("worker {i} printed no summary:\n{text}"));
        eprintln!("worker {i}: {summary}");
        if i != 1 {
            // It kept allocating after the kill.
            let ticks = ticks(text);
            let at_kill = ticks.iter().filter(|t| t.0 <= killed_at).map(|t| t.1).max().unwrap_or(0);
            let last = ticks.iter().map(|t| t.1).max().unwrap_or(0);
            assert!(last > at_kill, "worker {i} stopped at the kill ({at_kill} ops then, {last} at the end)");
        }
    }
    // Every process gone: the whole capacity is free.
    let mut probe = common::child_command("child_soak_probe");
    let (ok, text) = common::child_output(probe.envs(soak.env.iter().map(|(k, v)| (*k, v.as_str()))));
    assert!(ok, "{text}");
    let line =
        text.lines().find_map(|l| l.find("free ").map(|at| &l[at..])).unwrap_or_else(|| panic!("the probe printed nothing:\n{text}"));
    let figures: Vec<u64> = line.split_whitespace().filter_map(|w| w.parse().ok()).collect();
    assert_eq!(figures[0], figures[1], "the device's whole capacity is free at the end: {line}");
}
