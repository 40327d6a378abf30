//! Two processes on one device (host backend with a shared capacity file):
//! A holds 60 % of the device as idle cache; B asks for 70 %. With
//! cooperation B gets it within a few reclaimer intervals (well before its
//! wait would end) because A's reclaimer answers B's request; without it B
//! fails. Both outcomes are asserted. With expandable
//! segments, A's idle cache is a hole between two live blocks, and what A
//! gives back is the hole's pages.
//!
//! While a request waits for the other processes no heap is locked: another
//! thread's free returns at once and serves the waiting request. With no
//! other process holding cache an out-of-memory is reported at once.

use crate::common;

use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use tidepool::reclaim::policy::Reason;
use tidepool::{AllocError, Stream};

const MIB: u64 = 1 << 20;
/// conf's oom_wait_ms: a request answered well within it was answered.
const OOM_WAIT: Duration = Duration::from_secs(5);

/// Process A: runs only when spawned by the tests below.
#[test]
#[ignore = "child process: run by scenario and scenario_on_simgpu (five tests)"]
fn process_a_holds_idle_cache() {
    let (Ok(conf), Ok(dir)) = (std::env::var("TIDEPOOL_TEST_COOP_CONF"), std::env::var("TIDEPOOL_TEST_COOP_DIR")) else {
        panic!("a child-process test: its parent test sets TIDEPOOL_TEST_COOP_CONF and TIDEPOOL_TEST_COOP_DIR");
    };
    let dir = PathBuf::from(dir);
    let alloc = common::conf_allocator(&conf);
    // With expandable segments the cache is a hole between two live blocks.
    let pins = conf.contains("expandable:true");
    let stream = stream_of(&conf);
    let left = pins.then(|| alloc.allocate(0, (8 * MIB) as usize, stream).unwrap());
    let block = alloc.allocate(0, (600 * MIB) as usize, stream).unwrap();
    let right = pins.then(|| alloc.allocate(0, (8 * MIB) as usize, stream).unwrap());
    alloc.free_on_stream(0, block, stream).unwrap();
    // Asked only once the registry shows the cache: after one reclaimer pass.
    if conf.contains("cooperative:true") {
        assert!(published(&conf, |e| e.cached_free > 0), "the cache was never published");
    }
    std::fs::write(dir.join("ready"), b"").unwrap();
    assert!(common::wait_for_file(&dir.join("done"), Duration::from_secs(20)));
    let served = alloc.stats(0).unwrap().events.num_coop_served;
    common::write_whole(&dir.join("served"), served.to_string());
    for pin in [left, right].into_iter().flatten() {
        alloc.free_on_stream(0, pin, stream).unwrap();
    }
    alloc.validate().unwrap();
}

/// The stream A and B use: with stream shards, one that is not served by
/// the device's first shard.
fn stream_of(conf: &str) -> Stream {
    if conf.contains("stream_shards") {
        Stream(1)
    } else {
        Stream::DEFAULT
    }
}

/// Waits (at most 10 s) until this process's registry entry satisfies
/// `ready` (its reclaimer publishes once per interval).
fn published(conf: &str, ready: impl Fn(&tidepool::registry::Entry) -> bool) -> bool {
    let dir = conf.split(',').find_map(|kv| kv.strip_prefix("registry_dir:")).map(PathBuf::from).expect("registry_dir in conf");
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(10) {
        let scan = tidepool::registry::scan(&dir);
        let mine = scan.registries.iter().flat_map(|r| &r.entries).find(|e| e.pid == std::process::id());
        if mine.is_some_and(&ready) {
            return true;
        }
        if start.elapsed() > Duration::from_secs(9) {
            eprintln!("{mine:?} {:?}", scan.errors);
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    false
}

/// A helper process for the tests below: holds `TIDEPOOL_TEST_COOP_HOLD`
/// MiB live and, with `TIDEPOOL_TEST_COOP_SPLIT`, a 2 MiB block alone in a
/// 20 MiB segment (18 MiB of cache it cannot give back), publishes, and
/// waits for `done`. Runs only when spawned.
#[test]
#[ignore = "child process: run by spawn_h (three tests)"]
fn process_h_holds_memory() {
    let (Ok(conf), Ok(dir)) = (std::env::var("TIDEPOOL_TEST_COOP_CONF"), std::env::var("TIDEPOOL_TEST_COOP_DIR")) else {
        panic!("a child-process test: its parent test sets TIDEPOOL_TEST_COOP_CONF and TIDEPOOL_TEST_COOP_DIR");
    };
    let dir = PathBuf::from(dir);
    // Cache that cannot go back: a 2 MiB block alone in a whole 20 MiB segment.
    let split = std::env::var_os("TIDEPOOL_TEST_COOP_SPLIT").is_some();
    let alloc = common::conf_allocator(&if split { format!("{conf},expandable:false") } else { conf.clone() });
    let hold: usize = std::env::var("TIDEPOOL_TEST_COOP_HOLD").unwrap().parse().unwrap();
    let live = alloc.allocate(0, hold * MIB as usize, Stream::DEFAULT).unwrap();
    let split = split.then(|| alloc.allocate(0, (2 * MIB) as usize, Stream::DEFAULT).unwrap());
    let cached = if split.is_some() { 18 * MIB } else { 0 };
    assert!(published(&conf, |e| e.allocated > 0 && e.cached_free == cached), "the figures were never published");
    std::fs::write(dir.join("ready"), b"").unwrap();
    if let Ok(ask) = std::env::var("TIDEPOOL_TEST_COOP_ASK") {
        // Asks for `ask` MiB once told to go; writes how it ended and when.
        assert!(common::wait_for_file(&dir.join("go"), Duration::from_secs(30)));
        let start = Instant::now();
        let result = alloc.allocate(0, ask.parse::<usize>().unwrap() * MIB as usize, Stream::DEFAULT);
        let ended = if result.is_ok() { "ok" } else { "oom" };
        common::write_whole(&dir.join("asked"), format!("{ended} {}", start.elapsed().as_millis()));
    }
    assert!(common::wait_for_file(&dir.join("done"), Duration::from_secs(30)));
    let served = alloc.stats(0).unwrap().events.num_coop_served;
    common::write_whole(&dir.join("served"), served.to_string());
    alloc.free(0, live).unwrap();
    if let Some(p) = split {
        alloc.free(0, p).unwrap();
    }
}

/// Sends SIG`name` to `child` (kill(1): the tests hold no unsafe code).
fn signal(child: &Child, name: &str) {
    let status = Command::new("kill").arg(format!("-{name}")).arg(child.id().to_string()).status().expect("kill(1) is needed");
    assert!(status.success(), "kill -{name} failed");
}

/// Continues a stopped child when dropped, a failed assertion included.
struct Stopped<'a>(&'a Child);

impl Drop for Stopped<'_> {
    fn drop(&mut self) {
        // No assertion here: this may run while a failed one unwinds.
        let _ = Command::new("kill").arg("-CONT").arg(self.0.id().to_string()).status();
    }
}

/// Starts `process_h_holds_memory` and waits until it has published.
fn spawn_h(dir: &Path, conf: &str, hold_mib: u64, split: bool) -> Child {
    spawn_h_with(dir, conf, hold_mib, split, vec![])
}

fn spawn_h_with(dir: &Path, conf: &str, hold_mib: u64, split: bool, mut env: Vec<(&str, String)>) -> Child {
    env.push(("TIDEPOOL_TEST_COOP_HOLD", hold_mib.to_string()));
    if split {
        env.push(("TIDEPOOL_TEST_COOP_SPLIT", "1".to_string()));
    }
    let h = spawn("process_h_holds_memory", dir, conf, &env);
    assert!(common::wait_for_file(&dir.join("ready"), Duration::from_secs(20)), "process H did not start");
    h
}

/// Ends `process_h_holds_memory`; the requests it answered by giving memory back.
fn finish_h(dir: &Path, h: Child) -> u64 {
    std::fs::write(dir.join("done"), b"").unwrap();
    assert!(h.wait_with_output().unwrap().status.success(), "process H failed");
    std::fs::read_to_string(dir.join("served")).unwrap().parse().unwrap()
}

#[test]
fn a_free_while_a_request_waits_for_others_returns_at_once_and_serves_it() {
    let scratch = common::scratch_dir("coop-unlocked");
    let dir = scratch.path();
    // H shows cache (none of it can go back) and, stopped, never answers;
    // publishing every 2 s, it counts as running for three of them after
    // its last publication: B would wait for it the whole 6 s.
    let conf_b = format!("{},oom_wait_ms:6000", common::shared_host_conf(dir, true));
    let h = spawn_h(dir, &format!("{},reclaim_interval_ms:2000", common::shared_host_conf(dir, true)), 0, true);
    signal(&h, "STOP");
    let stopped = Stopped(&h);
    let b = common::conf_allocator(&conf_b);
    let oom_wait = Duration::from_millis(6000);
    let held = b.allocate(0, (600 * MIB) as usize, Stream::DEFAULT).unwrap();
    let (waited, result, free_took) = std::thread::scope(|s| {
        let waiter = s.spawn(|| {
            let start = Instant::now();
            let result = b.allocate(0, (600 * MIB) as usize, Stream::DEFAULT);
            (start.elapsed(), result)
        });
        // Once the waiter has asked (reading the stats locks every heap of
        // the device: it returns while the request waits)...
        let start = Instant::now();
        while b.stats(0).unwrap().events.num_coop_requests == 0 {
            assert!(start.elapsed() < Duration::from_secs(10), "the request was never posted");
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(start.elapsed() < oom_wait / 2, "the stats waited {:?} for the heap lock", start.elapsed());
        std::thread::sleep(Duration::from_millis(20));
        // ...another thread's free on the same device does not wait for it.
        let start = Instant::now();
        b.free(0, held).unwrap();
        let free_took = start.elapsed();
        let (waited, result) = waiter.join().unwrap();
        (waited, result, free_took)
    });
    eprintln!("free while a request waits: {free_took:?}; the request waited {waited:?}");
    // Generous for a loaded machine; the old wait under the lock took the
    // rest of oom_wait (6 s).
    assert!(free_took < Duration::from_secs(1), "the free took {free_took:?}");
    let ptr = result.expect("the waiting request is served by the free");
    assert_eq!(ptr, held, "from the block just freed");
    assert!(waited < oom_wait / 2, "waited {waited:?}");
    let stats = b.stats(0).unwrap();
    assert_eq!((stats.events.num_coop_requests, stats.events.num_coop_satisfied, stats.events.num_ooms), (1, 1, 0));
    b.free(0, ptr).unwrap();
    b.validate().unwrap();
    drop(stopped);
    assert_eq!(finish_h(dir, h), 0, "H gave nothing back");
    drop(b);
}

#[test]
fn a_stopped_process_and_a_forged_slot_do_not_hold_up_an_out_of_memory() {
    use tidepool::backend::{host::HostBackend, Backend};
    use tidepool::registry::{self, Entry};
    let scratch = common::scratch_dir("coop-stale");
    let dir = scratch.path();
    // Every 50 ms (stale after three missed and the slack: 250 ms), so that
    // the live helper, starved of a core for a moment on a loaded machine,
    // is not taken for a stopped one; oom_wait_ms 5000.
    let interval_ms = 50;
    let conf = format!("{},reclaim_interval_ms:{interval_ms}", common::shared_host_conf(dir, true));
    let oom_wait = Duration::from_millis(5000);
    // A forged slot, there before anyone joins: a running pid (a sleep)
    // with its real start time, showing 1 GiB of cache, its heartbeat a
    // minute old.
    let key = HostBackend::shared(1, 1 << 30, &dir.join("capacity")).unwrap().shared_device_key(0).unwrap();
    std::fs::DirBuilder::new().mode(0o700).create(dir.join("registry")).unwrap();
    let mut sleeper = Command::new("sleep").arg("60").spawn().unwrap();
    let forged = Entry {
        pid: sleeper.id(),
        start_ticks: registry::process_start(sleeper.id()).unwrap(),
        heartbeat_ms: registry::now_ms() - 60_000,
        interval_ms: 20,
        cached_free: 1 << 30,
        ..Entry::default()
    };
    registry::write_file(&dir.join("registry").join(format!("{key}.registry")), &[forged]).unwrap();
    // Two helpers showing 18 MiB of cache each (none of it can go back):
    // one stopped, one running.
    let (stopped_dir, live_dir) = (dir.join("stopped"), dir.join("live"));
    for d in [&stopped_dir, &live_dir] {
        std::fs::create_dir(d).unwrap();
    }
    let stopped_h = spawn_h(&stopped_dir, &conf, 0, true);
    let live_h = spawn_h(&live_dir, &conf, 0, true);
    signal(&stopped_h, "STOP");
    let stopped = Stopped(&stopped_h);
    // Three of its intervals and the slack: it no longer beats.
    std::thread::sleep(Duration::from_millis(3 * interval_ms + registry::BEAT_SLACK_MS + 100));
    let b = common::conf_allocator(&conf);
    let full = b.allocate(0, (900 * MIB) as usize, Stream::DEFAULT).unwrap();
    let start = Instant::now();
    let result = b.allocate(0, (200 * MIB) as usize, Stream::DEFAULT);
    let waited = start.elapsed();
    eprintln!("an out-of-memory with a stopped process, a forged slot and a live helper: {waited:?}");
    assert!(matches!(result, Err(AllocError::OutOfMemory(_))), "{result:?}");
    // The live helper answers at its next pass (50 ms); the stopped one and
    // the forged slot would have held it for the whole 5 s.
    assert!(waited < oom_wait / 5, "waited {waited:?}");
    let stats = b.stats(0).unwrap();
    assert_eq!((stats.events.num_coop_requests, stats.events.num_ooms), (1, 1));
    // top and the exporter list the running ones only; the other two are stale.
    let scan = registry::scan(&dir.join("registry"));
    let listed: Vec<u32> = scan.registries.iter().flat_map(|r| &r.entries).map(|e| e.pid).collect();
    assert!(listed.contains(&live_h.id()) && listed.contains(&std::process::id()), "{listed:?}");
    assert!(!listed.contains(&stopped_h.id()) && !listed.contains(&sleeper.id()), "{listed:?}");
    assert_eq!(scan.errors.iter().filter(|(_, e)| *e == registry::ScanError::Stale).count(), 2, "{:?}", scan.errors);
    b.free(0, full).unwrap();
    drop(stopped);
    finish_h(&stopped_dir, stopped_h);
    finish_h(&live_dir, live_h);
    let _ = sleeper.kill();
    let _ = sleeper.wait();
    drop(b);
}

#[test]
fn two_processes_asking_each_other_are_both_answered_within_an_interval() {
    let scratch = common::scratch_dir("coop-mutual");
    let dir = scratch.path();
    // Each holds 300 MiB live and 18 MiB of cache it cannot give back (so
    // each asks the other), then both ask for 500 MiB of the 384 MiB free.
    // Each one's reclaimer answers the other while its own request waits:
    // both OOMs come within a few 20 ms intervals, not after the 6 s wait.
    let conf = format!("{},oom_wait_ms:6000", common::shared_host_conf(dir, true));
    let oom_wait = Duration::from_millis(6000);
    let h = spawn_h_with(dir, &conf, 300, true, vec![("TIDEPOOL_TEST_COOP_ASK", "500".into())]);
    // Whole segments: the 2 MiB block splits a 20 MiB segment.
    let p = common::conf_allocator(&format!("{conf},expandable:false"));
    let live = p.allocate(0, (300 * MIB) as usize, Stream::DEFAULT).unwrap();
    let split = p.allocate(0, (2 * MIB) as usize, Stream::DEFAULT).unwrap();
    assert!(published(&conf, |e| e.cached_free == 18 * MIB), "P's cache was never published");
    std::fs::write(dir.join("go"), b"").unwrap();
    let start = Instant::now();
    let result = p.allocate(0, (500 * MIB) as usize, Stream::DEFAULT);
    let waited = start.elapsed();
    assert!(common::wait_for_file(&dir.join("asked"), Duration::from_secs(20)), "H never finished asking");
    let asked = std::fs::read_to_string(dir.join("asked")).unwrap();
    eprintln!("both asking: P's OOM after {waited:?}; H's: {asked} ms");
    assert!(matches!(result, Err(AllocError::OutOfMemory(_))), "{result:?}");
    assert!(waited < oom_wait / 2, "P waited {waited:?}");
    let (ended, h_ms) = asked.split_once(' ').unwrap();
    assert_eq!(ended, "oom");
    assert!(h_ms.parse::<u64>().unwrap() < (oom_wait / 2).as_millis() as u64, "H waited {h_ms} ms");
    let stats = p.stats(0).unwrap();
    assert_eq!((stats.events.num_coop_requests, stats.events.num_coop_satisfied, stats.events.num_ooms), (1, 0, 1));
    p.free(0, live).unwrap();
    p.free(0, split).unwrap();
    assert_eq!(finish_h(dir, h), 0);
    drop(p);
}

#[test]
fn with_no_other_process_holding_cache_an_oom_is_reported_at_once() {
    let scratch = common::scratch_dir("coop-nobody");
    let dir = scratch.path();
    // H holds 100 MiB live and no cache; B fills the rest of the device.
    let conf = format!("{},oom_wait_ms:2000", common::shared_host_conf(dir, true));
    let h = spawn_h(dir, &conf, 100, false);
    let b = common::conf_allocator(&conf);
    let full = b.allocate(0, (900 * MIB) as usize, Stream::DEFAULT).unwrap();
    let start = Instant::now();
    for _ in 0..64 {
        let result = b.allocate(0, (100 * MIB) as usize, Stream::DEFAULT);
        assert!(matches!(result, Err(AllocError::OutOfMemory(_))), "{result:?}");
    }
    let took = start.elapsed();
    eprintln!("64 out-of-memory requests with no one to help: {took:?}");
    // Asking would wait up to 64 x 2 s; reported at once, it takes milliseconds.
    assert!(took < Duration::from_secs(10), "took {took:?}");
    let stats = b.stats(0).unwrap();
    assert_eq!((stats.events.num_ooms, stats.events.num_coop_requests), (64, 0));
    b.free(0, full).unwrap();
    assert_eq!(finish_h(dir, h), 0);
    drop(b);
}

fn spawn_a(dir: &Path, conf: &str) -> Child {
    spawn("process_a_holds_idle_cache", dir, conf, &[])
}

/// Runs the (ignored) test `name` of this binary as another process.
fn spawn(name: &str, dir: &Path, conf: &str, env: &[(&str, String)]) -> Child {
    let mut env = env.to_vec();
    env.extend([("TIDEPOOL_TEST_COOP_CONF", conf.to_string()), ("TIDEPOOL_TEST_COOP_DIR", dir.display().to_string())]);
    common::spawn_child(name, &env)
}

/// Process B of the CUDA variant: asks for 70 % of the device.
#[test]
#[ignore = "child process: run by processes_on_one_simgpu_device_help_each_other"]
fn process_b_asks_for_memory() {
    let (Ok(conf), Ok(dir)) = (std::env::var("TIDEPOOL_TEST_COOP_CONF"), std::env::var("TIDEPOOL_TEST_COOP_DIR")) else {
        panic!("a child-process test: its parent test sets TIDEPOOL_TEST_COOP_CONF and TIDEPOOL_TEST_COOP_DIR");
    };
    let dir = PathBuf::from(dir);
    assert!(common::wait_for_file(&dir.join("ready"), Duration::from_secs(20)), "process A did not start");
    let alloc = common::conf_allocator(&conf);
    let start = Instant::now();
    match alloc.allocate(0, (700 * MIB) as usize, Stream::DEFAULT) {
        Ok(p) => {
            println!("b: ok in {:?}", start.elapsed());
            alloc.free(0, p).unwrap();
        }
        Err(AllocError::OutOfMemory(_)) => println!("b: out of memory"),
        Err(other) => println!("b: error {other}"),
    }
    std::fs::write(dir.join("done"), b"").unwrap();
}

/// Both processes on the `cuda` backend over one simgpu device shared
/// through SIMGPU_SHARED; returns what B printed.
fn scenario_on_simgpu(cooperative: bool) -> String {
    let scratch = common::scratch_dir(&format!("coop-simgpu-{cooperative}"));
    let dir = scratch.path();
    let conf = format!(
        "backend:cuda,registry_dir:{},release_after_ms:off,headroom_mb:0,reclaim_interval_ms:20,cooperative:{cooperative},oom_wait_ms:5000",
        dir.join("registry").display()
    );
    let env = [
        ("LD_LIBRARY_PATH", common::simgpu_dir().display().to_string()),
        ("SIMGPU_SHARED", dir.join("simgpu-used").display().to_string()),
        ("SIMGPU_CAPACITY", "1024M".to_string()),
    ];
    let a = spawn("process_a_holds_idle_cache", dir, &conf, &env);
    let b = spawn("process_b_asks_for_memory", dir, &conf, &env);
    let b_out = b.wait_with_output().unwrap();
    let a_out = a.wait_with_output().unwrap();
    assert!(a_out.status.success() && b_out.status.success(), "{:?} {:?}", a_out, b_out);
    String::from_utf8_lossy(&b_out.stdout).into_owned()
}

#[test]
fn processes_on_one_simgpu_device_help_each_other() {
    let helped = scenario_on_simgpu(true);
    assert!(helped.contains("b: ok"), "{helped}");
    let alone = scenario_on_simgpu(false);
    assert!(alone.contains("b: out of memory"), "{alone}");
}

fn scenario(cooperative: bool, extra: &str) -> (Result<(), AllocError>, Duration, u64, tidepool::Stats) {
    let name = format!("coop-{cooperative}-{}", extra.replace(':', "-"));
    let scratch = common::scratch_dir(name.trim_end_matches('-'));
    let dir = scratch.path();
    let conf = format!("{},{extra}", common::shared_host_conf(dir, cooperative));
    let a = spawn_a(dir, &conf);
    assert!(common::wait_for_file(&dir.join("ready"), Duration::from_secs(20)), "process A did not start");
    let b = common::conf_allocator(&conf);
    let start = Instant::now();
    let stream = stream_of(&conf);
    let result = b.allocate(0, (700 * MIB) as usize, stream).map(|p| b.free_on_stream(0, p, stream).unwrap());
    let waited = start.elapsed();
    let stats = b.stats(0).unwrap();
    std::fs::write(dir.join("done"), b"").unwrap();
    assert!(a.wait_with_output().unwrap().status.success(), "process A failed");
    let served = std::fs::read_to_string(dir.join("served")).unwrap().parse().unwrap();
    drop(b);
    (result, waited, served, stats)
}

#[test]
fn a_process_about_to_fail_gets_the_idle_cache_of_another() {
    let (result, waited, served, stats) = scenario(true, "");
    assert!(result.is_ok(), "with cooperation: {result:?}");
    assert!(waited < OOM_WAIT / 2, "waited {waited:?}: the answer, not the end of the wait");
    assert_eq!((stats.events.num_coop_requests, stats.events.num_coop_satisfied), (1, 1));
    assert_eq!(served, 1, "process A answered one request");
    eprintln!("request to memory: {waited:?} (B's count: {} ms)", stats.events.coop_last_wait_ms);
}

#[test]
fn with_stream_shards_the_cache_of_any_shard_answers_a_request_failing_on_any_shard() {
    // A caches on a shard other than the first, and B fails on one: the
    // device publishes and asks for all its shards.
    let (result, waited, served, stats) = scenario(true, "stream_shards:4");
    assert!(result.is_ok(), "with cooperation: {result:?}");
    assert!(waited < OOM_WAIT / 2, "waited {waited:?}: the answer, not the end of the wait");
    assert_eq!((stats.events.num_coop_requests, stats.events.num_coop_satisfied, served), (1, 1, 1));
}

#[test]
fn without_cooperation_the_same_request_fails() {
    let (result, _, served, stats) = scenario(false, "");
    assert!(matches!(result, Err(AllocError::OutOfMemory(_))), "{result:?}");
    assert_eq!((stats.events.num_coop_requests, served), (0, 0));
    assert_eq!(stats.released(Reason::Cooperation).bytes, 0);
}

#[test]
fn with_expandable_segments_a_hole_between_live_blocks_goes_to_the_other_process() {
    let (result, waited, served, stats) = scenario(true, "expandable:true");
    assert!(result.is_ok(), "with cooperation: {result:?}");
    assert!(waited < OOM_WAIT / 2, "waited {waited:?}: the answer, not the end of the wait");
    assert_eq!((stats.events.num_coop_satisfied, served), (1, 1));
    let (result, _, served, _) = scenario(false, "expandable:true");
    assert!(matches!(result, Err(AllocError::OutOfMemory(_))) && served == 0, "{result:?}");
}

/// A process in a registry that another tidepool rewrites to a newer
/// version: it allocates, runs out of memory (which would ask the others)
/// and exits once told, writing nothing into the newer file.
#[test]
#[ignore = "child process: run by a_registry_rewritten_to_a_newer_version_is_left_with_one_warning_and_never_written"]
fn process_in_a_rewritten_registry() {
    let (Ok(conf), Ok(dir)) = (std::env::var("TIDEPOOL_TEST_COOP_CONF"), std::env::var("TIDEPOOL_TEST_COOP_DIR")) else {
        panic!("a child-process test: its parent test sets TIDEPOOL_TEST_COOP_CONF and TIDEPOOL_TEST_COOP_DIR");
    };
    let dir = PathBuf::from(dir);
    let alloc = common::conf_allocator(&conf);
    let live = alloc.allocate(0, (900 * MIB) as usize, Stream::DEFAULT).unwrap();
    assert!(published(&conf, |e| e.allocated > 0), "never published");
    std::fs::write(dir.join("ready"), b"").unwrap();
    assert!(common::wait_for_file(&dir.join("rewritten"), Duration::from_secs(30)));
    // Reclaimer passes (publications), and out-of-memory requests (asking).
    for _ in 0..10 {
        std::thread::sleep(Duration::from_millis(20));
        assert!(matches!(alloc.allocate(0, (200 * MIB) as usize, Stream::DEFAULT), Err(AllocError::OutOfMemory(_))));
    }
    alloc.free(0, live).unwrap();
    drop(alloc); // leaving the registry would clear its slot
}

#[test]
fn a_registry_rewritten_to_a_newer_version_is_left_with_one_warning_and_never_written() {
    let scratch = common::scratch_dir("coop-newer");
    let dir = scratch.path();
    let conf = common::shared_host_conf(dir, true);
    let child = common::child_command("process_in_a_rewritten_registry")
        .env("TIDEPOOL_TEST_COOP_CONF", &conf)
        .env("TIDEPOOL_TEST_COOP_DIR", dir)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    assert!(common::wait_for_file(&dir.join("ready"), Duration::from_secs(30)), "the process did not start");
    let file = std::fs::read_dir(dir.join("registry")).unwrap().flatten().map(|e| e.path()).next().unwrap();
    // A newer tidepool rewrites it: its version, its slots (here: junk).
    let mut newer = std::fs::read(&file).unwrap();
    newer[8..12].copy_from_slice(&(tidepool::registry::VERSION + 1).to_le_bytes());
    newer[16..].fill(0xa5);
    newer.extend_from_slice(&[0x5a; 4096]);
    std::fs::write(&file, &newer).unwrap();
    std::fs::write(dir.join("rewritten"), b"").unwrap();
    let output = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stderr}");
    assert_eq!(std::fs::read(&file).unwrap(), newer, "the process wrote into the newer file");
    let warnings: Vec<&str> = stderr.lines().filter(|l| l.contains("another tidepool rewrote it")).collect();
    assert_eq!(warnings.len(), 1, "{stderr}");
    eprintln!("{}", warnings[0]);
    assert!(warnings[0].contains(&file.display().to_string()) && warnings[0].contains("stops writing to it"), "{}", warnings[0]);
}
