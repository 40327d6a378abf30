//! Replay's driver calls are the backend's: a trace played live on the
//! `cuda` backend over simgpu makes exactly the calls `tidepool replay`
//! reports for it, with and without expandable segments, in allocations
//! page by page, of 8 MiB or as large as each run and split when reused,
//! pages moved and given back included.

use tidepool_tools::trace::replay::{replay, Policy, ReplayOptions};
use tidepool_tools::trace::Event;

use crate::common;
use crate::common::simgpu::{child_prints, cuda_allocator, Simgpu};

/// The child side: a trace played on the `cuda` backend over simgpu makes
/// exactly the driver calls that `tidepool replay` reports for it.
#[test]
#[ignore = "child process: run by replay_counts_the_driver_calls_the_cuda_backend_makes"]
fn child_replay_driver_calls() {
    common::child_only();
    let file = common::repo_root().join("examples/traces").join(std::env::var("TIDEPOOL_TEST_TRACE").unwrap());
    let trace = tidepool_tools::trace::load(&file).unwrap();
    let conf = std::env::var("TIDEPOOL_TEST_CONF").unwrap_or_default();
    let policy = if conf.contains("expandable:true") { Policy::Expandable } else { Policy::Tidepool };
    let options = ReplayOptions { capacity: 1 << 40, policy, conf: conf.clone(), samples: 0, record_to: None };
    let replayed = replay(&trace, &options).unwrap().driver_calls;

    // The heap's placement, which replay plays: threads' caches off.
    let alloc = cuda_allocator("thread_cache_blocks:0");
    let sim = Simgpu::load();
    // SAFETY: a simgpu entry point with no arguments.
    let before = unsafe { (sim.memory_calls)() };
    let mut ptrs = vec![0u64; trace.allocs as usize];
    for event in &trace.events {
        match *event {
            Event::Alloc { id, size, .. } => ptrs[id as usize] = alloc.allocate(0, size as usize, tidepool::Stream::DEFAULT).unwrap().0,
            Event::Free { id } => alloc.free(0, tidepool::DevicePtr(ptrs[id as usize])).unwrap(),
        }
    }
    // SAFETY: as above.
    let live = unsafe { (sim.memory_calls)() } - before;
    let moves = alloc.stats(0).unwrap().events.num_pages_unmapped;
    println!("driver calls: live {live}, replay {replayed} ({conf}: {moves} pages unmapped or moved)");
    if file.ends_with("kv-generate.csv") {
        assert!(moves > 0, "the decoding trace moves pages or gives them back");
    }
    assert_eq!(live as u64, replayed);
}

#[test]
fn replay_counts_the_driver_calls_the_cuda_backend_makes() {
    // The decoding trace moves pages and gives them back as its caches grow.
    for (trace, conf) in [
        ("transformer-varlen-train.csv", ""),
        ("transformer-varlen-train.csv", "expandable:true"),
        ("kv-generate.csv", "expandable:true"),
        ("kv-generate.csv", "expandable:true,expandable_allocation_mb:8"),
        ("kv-generate.csv", "expandable:true,expandable_allocation_mb:unlimited,expandable_split_allocations:true"),
    ] {
        child_prints(
            "child_replay_driver_calls",
            "8G",
            &[("TIDEPOOL_TEST_TRACE", trace), ("TIDEPOOL_TEST_CONF", conf)],
            "driver calls: live",
        );
    }
}
