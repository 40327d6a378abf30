//! Two processes on one device (host backend with a shared capacity file):
//! A holds 60 % of the device as idle cache; B asks for 70 %. With
//! cooperation B gets it within a second because A's reclaimer answers B's
//! request; without it B fails. Both outcomes are asserted. With expandable
//! segments, A's idle cache is a hole between two live blocks, and what A
//! gives back is the hole's pages.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use tidepool::reclaim::policy::Reason;
use tidepool::{AllocError, Allocator, Config, Stream};

const MIB: u64 = 1 << 20;

fn conf(dir: &Path, cooperative: bool) -> String {
    format!(
        "backend:host,host_shared:{},registry_dir:{},host_capacity_mb:1024,release_after_ms:off,headroom_mb:0,\
         reclaim_interval_ms:20,cooperative:{cooperative},oom_wait_ms:1500",
        dir.join("capacity").display(),
        dir.join("registry").display()
    )
}

fn allocator(conf: &str) -> Allocator {
    Allocator::new(Config::builder().conf(conf).unwrap().build().unwrap()).unwrap()
}

fn wait_for(path: &Path, timeout: Duration) -> bool {
    let start = Instant::now();
    while start.elapsed() < timeout {
        if path.exists() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    false
}

/// Process A: runs only when spawned by the test below.
#[test]
fn process_a_holds_idle_cache() {
    let (Ok(conf), Ok(dir)) = (std::env::var("TIDEPOOL_TEST_COOP_CONF"), std::env::var("TIDEPOOL_TEST_COOP_DIR")) else {
        return;
    };
    let dir = PathBuf::from(dir);
    let alloc = allocator(&conf);
    // With expandable segments the cache is a hole between two live blocks.
    let pins = conf.contains("expandable:true");
    let left = pins.then(|| alloc.allocate(0, (8 * MIB) as usize, Stream::DEFAULT).unwrap());
    let block = alloc.allocate(0, (600 * MIB) as usize, Stream::DEFAULT).unwrap();
    let right = pins.then(|| alloc.allocate(0, (8 * MIB) as usize, Stream::DEFAULT).unwrap());
    alloc.free(0, block).unwrap();
    std::fs::write(dir.join("ready"), b"").unwrap();
    assert!(wait_for(&dir.join("done"), Duration::from_secs(20)));
    let served = alloc.stats(0).unwrap().events.num_coop_served;
    std::fs::write(dir.join("served"), served.to_string()).unwrap();
    for pin in [left, right].into_iter().flatten() {
        alloc.free(0, pin).unwrap();
    }
    alloc.validate().unwrap();
}

fn spawn_a(dir: &Path, conf: &str) -> Child {
    spawn("process_a_holds_idle_cache", dir, conf, &[])
}

/// Runs the test `name` of this binary as another process.
fn spawn(name: &str, dir: &Path, conf: &str, env: &[(&str, String)]) -> Child {
    let mut command = Command::new(std::env::current_exe().unwrap());
    command
        .args(["--exact", name, "--test-threads=1", "--nocapture"])
        .env("TIDEPOOL_TEST_COOP_CONF", conf)
        .env("TIDEPOOL_TEST_COOP_DIR", dir)
        .stdout(std::process::Stdio::piped());
    for (k, v) in env {
        command.env(k, v);
    }
    command.spawn().unwrap()
}

/// Process B of the CUDA variant: asks for 70 % of the device.
#[test]
fn process_b_asks_for_memory() {
    let (Ok(conf), Ok(dir)) = (std::env::var("TIDEPOOL_TEST_COOP_CONF"), std::env::var("TIDEPOOL_TEST_COOP_DIR")) else {
        return;
    };
    let dir = PathBuf::from(dir);
    assert!(wait_for(&dir.join("ready"), Duration::from_secs(20)), "process A did not start");
    let alloc = allocator(&conf);
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
    let dir = std::env::temp_dir().join(format!("tidepool-coop-simgpu-{}-{cooperative}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let conf = format!(
        "backend:cuda,registry_dir:{},release_after_ms:off,headroom_mb:0,reclaim_interval_ms:20,cooperative:{cooperative},oom_wait_ms:1500",
        dir.join("registry").display()
    );
    let env = [
        ("LD_LIBRARY_PATH", common::simgpu_dir().display().to_string()),
        ("SIMGPU_SHARED", dir.join("simgpu-used").display().to_string()),
        ("SIMGPU_CAPACITY", "1024M".to_string()),
    ];
    let a = spawn("process_a_holds_idle_cache", &dir, &conf, &env);
    let b = spawn("process_b_asks_for_memory", &dir, &conf, &env);
    let b_out = b.wait_with_output().unwrap();
    let a_out = a.wait_with_output().unwrap();
    assert!(a_out.status.success() && b_out.status.success(), "{:?} {:?}", a_out, b_out);
    let _ = std::fs::remove_dir_all(&dir);
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
    let dir = std::env::temp_dir().join(format!("tidepool-coop-{}-{cooperative}-{}", std::process::id(), extra.len()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let conf = format!("{},{extra}", conf(&dir, cooperative));
    let a = spawn_a(&dir, &conf);
    assert!(wait_for(&dir.join("ready"), Duration::from_secs(20)), "process A did not start");
    let b = allocator(&conf);
    let start = Instant::now();
    let result = b.allocate(0, (700 * MIB) as usize, Stream::DEFAULT).map(|p| b.free(0, p).unwrap());
    let waited = start.elapsed();
    let stats = b.stats(0).unwrap();
    std::fs::write(dir.join("done"), b"").unwrap();
    assert!(a.wait_with_output().unwrap().status.success(), "process A failed");
    let served = std::fs::read_to_string(dir.join("served")).unwrap().parse().unwrap();
    drop(b);
    let _ = std::fs::remove_dir_all(&dir);
    (result, waited, served, stats)
}

#[test]
fn a_process_about_to_fail_gets_the_idle_cache_of_another() {
    let (result, waited, served, stats) = scenario(true, "");
    assert!(result.is_ok(), "with cooperation: {result:?}");
    assert!(waited < Duration::from_secs(1), "waited {waited:?}");
    assert_eq!((stats.events.num_coop_requests, stats.events.num_coop_satisfied), (1, 1));
    assert_eq!(served, 1, "process A answered one request");
    eprintln!("request to memory: {waited:?} (B's count: {} ms)", stats.events.coop_last_wait_ms);
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
    assert!(waited < Duration::from_secs(1), "waited {waited:?}");
    assert_eq!((stats.events.num_coop_satisfied, served), (1, 1));
    let (result, _, served, _) = scenario(false, "expandable:true");
    assert!(matches!(result, Err(AllocError::OutOfMemory(_))) && served == 0, "{result:?}");
}

#[test]
fn top_lists_the_processes_of_the_registry() {
    let dir = std::env::temp_dir().join(format!("tidepool-top-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let conf = conf(&dir, true);
    let alloc = allocator(&conf);
    let p = alloc.allocate(0, (5 * MIB) as usize, Stream::DEFAULT).unwrap();
    // One reclaimer pass (20 ms) publishes the figures.
    std::thread::sleep(Duration::from_millis(200));
    let top = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_tidepool"))
            .arg("top")
            .args(args)
            .env("TIDEPOOL_CONF", format!("registry_dir:{}", dir.join("registry").display()))
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let json = top(&["--once", "--json"]);
    let me = format!("\"pid\":{}", std::process::id());
    assert!(json.contains(&me), "{json}");
    assert!(json.contains(&format!("\"allocated_bytes\":{}", 5 * MIB)), "{json}");
    assert!(json.contains("\"released_bytes\":{\"idle_decay\":0"), "{json}");
    // A 5 MiB block in a 20 MiB segment: the 15 MiB tail is free inside a
    // partly used segment (fragmentation 0.75), and the process is named.
    assert!(json.contains(&format!("\"inactive_split_bytes\":{},\"largest_free_block_bytes\":{}", 15 * MIB, 15 * MIB)), "{json}");
    assert!(json.contains("\"fragmentation\":0.750") && json.contains("\"comm\":\"cooperation-"), "{json}");
    assert!(json.contains("\"skipped\":[]"), "{json}");
    let table = top(&["--once"]);
    assert!(table.contains(&std::process::id().to_string()) && table.contains("5.00 MiB"), "{table}");
    alloc.free(0, p).unwrap();
    drop(alloc);
    // The process left: its slot is gone.
    assert!(!top(&["--once", "--json"]).contains(&me));
    let _ = std::fs::remove_dir_all(&dir);
}
