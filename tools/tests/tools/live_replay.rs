//! Replay's driver calls are the backend's: a trace played live on the
//! `cuda` backend over simgpu makes exactly the calls `tidepool replay`
//! reports for it, with and without expandable segments, in allocations
//! page by page, of 8 MiB or as large as each run and split when reused,
//! pages moved and given back included; and the planner's repeated steps
//! played live, threads' caches on, make none after their second step.

use tidepool_tools::trace::replay::{replay, Model, ReplayOptions};
use tidepool_tools::trace::Event;

use crate::common;
use crate::common::simgpu::{child_prints, cuda_allocator, Simgpu};

/// The child side: a trace played on the `cuda` backend over simgpu makes
/// exactly the driver calls that `tidepool replay` reports for it.
#[test]
#[ignore = "child process: run by replay_counts_the_driver_calls_the_cuda_backend_makes"]
fn child_replay_driver_calls() {
    common::child_only();
    let file = common::repo_root().join(std::env::var("TIDEPOOL_TEST_TRACE").unwrap());
    let trace = tidepool_tools::trace::load(&file).unwrap();
    let conf = std::env::var("TIDEPOOL_TEST_CONF").unwrap_or_default();
    // The device simgpu has (SIMGPU_CAPACITY, in MiB).
    let capacity_mib: u64 = std::env::var("SIMGPU_CAPACITY").unwrap().trim_end_matches('M').parse().unwrap();
    let model = if conf.contains("expandable:false") { Model::WholeSegments } else { Model::Tidepool };
    let options = ReplayOptions { capacity: capacity_mib << 20, model, conf: conf.clone(), samples: 0, record_to: None };
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
    if capacity_mib < 1024 {
        assert!(moves > 0, "the step moves pages or gives them back on a device it fills");
    }
    assert_eq!(live as u64, replayed);
}

#[test]
fn replay_counts_the_driver_calls_the_cuda_backend_makes() {
    // On a device of 1022 MiB, the bert step (1,076 MiB reserved on an
    // unlimited one) moves pages and gives them back.
    let bert = "tools/tests/traces/steps/bert-fp16-mixed.csv";
    for (trace, capacity, conf) in [
        ("examples/traces/transformer-varlen-train.csv", "8192M", "expandable:false"),
        ("examples/traces/transformer-varlen-train.csv", "8192M", ""),
        ("examples/traces/kv-generate.csv", "8192M", ""),
        (bert, "1022M", ""),
        (bert, "1022M", "expandable_allocation_mb:2"),
        (bert, "1022M", "expandable_allocation_mb:unlimited,expandable_split_allocations:true"),
    ] {
        child_prints(
            "child_replay_driver_calls",
            capacity,
            &[("TIDEPOOL_TEST_TRACE", trace), ("TIDEPOOL_TEST_CONF", conf)],
            "driver calls: live",
        );
    }
}

/// The child side: the planner's repeated steps played live with tidepool's
/// default configuration, threads' caches on, make no driver call after
/// step 2 (nor after step 3: the count of each is asserted).
#[test]
#[ignore = "child process: run by a_repeated_step_played_live_makes_no_driver_call_after_its_second"]
fn child_steps_played_live() {
    common::child_only();
    let sim = Simgpu::load();
    // SAFETY: a simgpu entry point with no arguments.
    let calls = || unsafe { (sim.memory_calls)() };
    for entry in std::fs::read_dir(common::repo_root().join("tools/tests/traces/steps")).unwrap() {
        let file = entry.unwrap().path();
        if file.extension().is_none_or(|e| e != "csv") {
            continue;
        }
        let trace = tidepool_tools::trace::load(&file).unwrap();
        let step = |n: usize| trace.marks.iter().find(|m| m.label == format!("step {n}")).unwrap().event;
        let (second, third) = (step(2), step(3));
        assert_eq!(trace.warm_up().events, second);
        let alloc = cuda_allocator("");
        assert!(alloc.device(0).unwrap().is_expandable(), "expandable segments by default");
        let mut ptrs = vec![0u64; trace.allocs as usize];
        let (mut after_second, mut after_third) = (0, 0);
        for (index, event) in trace.events.iter().enumerate() {
            if index == second {
                after_second = calls();
            }
            if index == third {
                after_third = calls();
            }
            match *event {
                Event::Alloc { id, size, .. } => ptrs[id as usize] = alloc.allocate(0, size as usize, tidepool::Stream::DEFAULT).unwrap().0,
                Event::Free { id } => alloc.free(0, tidepool::DevicePtr(ptrs[id as usize])).unwrap(),
            }
        }
        let (after_second, after_third) = (calls() - after_second, calls() - after_third);
        println!("{}: {after_second} driver calls after step 2, {after_third} after step 3", file.display());
        assert_eq!((after_second, after_third), (0, 0), "{}", file.display());
        alloc.validate().unwrap();
    }
    println!("steps played live: ok");
}

#[test]
fn a_repeated_step_played_live_makes_no_driver_call_after_its_second() {
    child_prints("child_steps_played_live", "8192M", &[], "steps played live: ok");
}
