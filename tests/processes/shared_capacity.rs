//! The host backend's shared capacity (`host_shared`), as a GPU shares its
//! memory between processes: what a process holds is given back when it
//! ends, whether it exits or is killed.

use crate::common;

use std::path::PathBuf;
use std::time::Duration;

use tidepool::backend::host::HostBackend;
use tidepool::backend::Backend;
use tidepool::Stream;

const MIB: u64 = 1 << 20;
const CAPACITY: u64 = 1 << 30;

/// A process that holds `TIDEPOOL_TEST_HOLD` MiB of the shared capacity
/// (never freed), says so with the file `ready-N`, then exits once the
/// file `go` appears, or, with `TIDEPOOL_TEST_KILLED`, waits to be killed.
#[test]
#[ignore = "child process: run by the_shared_capacity_held_by_processes_that_exit_or_are_killed_returns_to_zero"]
fn child_holds_shared_capacity() {
    common::child_only();
    let dir = PathBuf::from(std::env::var("TIDEPOOL_TEST_DIR").unwrap());
    let alloc = common::conf_allocator(&std::env::var("TIDEPOOL_TEST_CONF").unwrap());
    let hold: u64 = std::env::var("TIDEPOOL_TEST_HOLD").unwrap().parse().unwrap();
    let block = alloc.allocate(0, (hold * MIB) as usize, Stream::DEFAULT).unwrap();
    std::fs::write(dir.join(format!("ready-{}", std::env::var("TIDEPOOL_TEST_INDEX").unwrap())), b"").unwrap();
    let wait = if std::env::var_os("TIDEPOOL_TEST_KILLED").is_some() { 120 } else { 30 };
    assert!(common::wait_for_file(&dir.join("go"), Duration::from_secs(wait)), "never told to go");
    // Leaves with the block still allocated: its process's end gives it back.
    std::mem::forget((alloc, block));
}

#[test]
fn the_shared_capacity_held_by_processes_that_exit_or_are_killed_returns_to_zero() {
    let scratch = common::scratch_dir("shared-capacity");
    let dir = scratch.path();
    let file = dir.join("capacity");
    let conf = format!("backend:host,host_capacity_mb:1024,host_shared:{},cooperative:false", file.display());
    let children: Vec<_> = (0..6)
        .map(|i| {
            let mut env = vec![
                ("TIDEPOOL_TEST_DIR", dir.display().to_string()),
                ("TIDEPOOL_TEST_CONF", conf.clone()),
                ("TIDEPOOL_TEST_HOLD", "50".to_string()),
                ("TIDEPOOL_TEST_INDEX", i.to_string()),
            ];
            if i % 2 == 1 {
                env.push(("TIDEPOOL_TEST_KILLED", "1".to_string()));
            }
            common::spawn_child("child_holds_shared_capacity", &env)
        })
        .collect();
    for i in 0..6 {
        assert!(common::wait_for_file(&dir.join(format!("ready-{i}")), Duration::from_secs(30)), "child {i} did not start");
    }
    // This process shares the file too (holding nothing): it sees the six.
    let observer = HostBackend::shared(1, CAPACITY, &file).unwrap();
    assert_eq!(observer.mem_info(0).unwrap().free, CAPACITY - 6 * 50 * MIB);
    std::fs::write(dir.join("go"), b"").unwrap();
    for (i, mut child) in children.into_iter().enumerate() {
        if i % 2 == 1 {
            child.kill().unwrap(); // SIGKILL: no exit handler, no destructor
        }
        let status = child.wait().unwrap();
        assert!(i % 2 == 1 || status.success(), "child {i}: {status}");
    }
    assert_eq!(observer.mem_info(0).unwrap().free, CAPACITY, "what ended processes held is free again");
    // And it can be taken whole: the ended processes' charges are cleared.
    let all = observer.allocate(0, CAPACITY, Stream::DEFAULT).unwrap();
    assert_eq!(observer.mem_info(0).unwrap().free, 0);
    observer.release(0, all, CAPACITY, Stream::DEFAULT).unwrap();
}
