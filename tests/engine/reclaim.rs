//! The background reclaimer end to end, with real time: idle segments go
//! back, a steady loop is never churned, budget and headroom hold, and the
//! thread stops with its allocator.

use crate::common;

use std::time::{Duration, Instant};

use common::{host_allocator, reserved, MIB};
use tidepool::reclaim::policy::Reason;
use tidepool::{AllocError, Allocator, Stream};

const S0: Stream = Stream::DEFAULT;

#[test]
fn idle_segments_go_back_after_release_after_ms() {
    let (alloc, _) = host_allocator(1, 1 << 30, "release_after_ms:1500,reclaim_interval_ms:20");
    assert!(alloc.has_reclaimer());
    let keep = alloc.allocate(0, 4096, S0).unwrap();
    let working_set: Vec<_> =
        [30 * MIB, 12 * MIB, 3 * MIB, 512 * 1024].iter().map(|&s| alloc.allocate(0, s as usize, S0).unwrap()).collect();
    for p in working_set {
        alloc.free(0, p).unwrap();
    }
    let cached = reserved(&alloc);
    assert!(cached > 40 * MIB);
    // Not before the deadline (well before it, on a loaded machine too)...
    std::thread::sleep(Duration::from_millis(150));
    assert_eq!(reserved(&alloc), cached, "released before release_after_ms");
    // ...but soon after it.
    assert!(common::eventually(Duration::from_secs(10), || reserved(&alloc) == 2 * MIB), "reserved {}", reserved(&alloc));
    let s = alloc.stats(0).unwrap();
    assert_eq!(s.released(Reason::IdleDecay).bytes, cached - 2 * MIB);
    assert!(s.events.num_reclaims > 0);
    alloc.free(0, keep).unwrap();
    alloc.validate().unwrap();
}

#[test]
fn a_steady_loop_is_never_churned() {
    // The decay (2 s) is far longer than a step (30 ms), as it is in training.
    let (alloc, _) = host_allocator(1, 1 << 30, "release_after_ms:2000,reclaim_interval_ms:20");
    let step = |alloc: &Allocator| {
        let ptrs: Vec<_> = [8 * MIB, 2 * MIB, 100_000].iter().map(|&s| alloc.allocate(0, s as usize, S0).unwrap()).collect();
        for p in ptrs {
            alloc.free(0, p).unwrap();
        }
    };
    step(&alloc);
    let warm = alloc.stats(0).unwrap().events.num_device_alloc;
    let start = Instant::now();
    while start.elapsed() < Duration::from_millis(800) {
        step(&alloc);
        std::thread::sleep(Duration::from_millis(30));
    }
    let s = alloc.stats(0).unwrap();
    assert_eq!(s.events.num_device_alloc - warm, 0, "device allocations per step after warm-up");
    assert_eq!(s.events.num_device_free, 0);
}

#[test]
fn the_budget_releases_cache_first_and_fails_only_for_live_memory() {
    // Whole segments: the cached one must go (expandable segments would
    // carve the 50 MiB from its pages: tests/engine/expandable.rs).
    let (alloc, _) = host_allocator(1, 1 << 30, "expandable:false,max_reserved_mb:64");
    let a = alloc.allocate(0, (40 * MIB) as usize, S0).unwrap();
    alloc.free(0, a).unwrap();
    let b = alloc.allocate(0, (50 * MIB) as usize, S0).unwrap();
    assert_eq!(reserved(&alloc), 50 * MIB, "the cached 40 MiB went to make room");
    let err = alloc.allocate(0, (20 * MIB) as usize, S0).unwrap_err();
    // 70 MiB live is over the 64 MiB budget, and the report names the budget, not a memory fraction.
    let AllocError::OutOfMemory(report) = &err else { panic!("{err:?}") };
    assert_eq!((report.reserved_limit, report.limit_is_budget), (Some(64 * MIB), true));
    assert!(err.to_string().contains("raise max_reserved_mb"), "{err}");
    assert!(!err.to_string().contains("memory fraction"), "{err}");
    let s = alloc.stats(0).unwrap();
    assert_eq!(s.released(Reason::OutOfMemory).bytes, 40 * MIB);
    alloc.free(0, b).unwrap();
    alloc.validate().unwrap();
}

#[test]
fn headroom_releases_idle_cache_when_the_device_runs_low() {
    let (alloc, backend) = host_allocator(1, 100 * MIB, "release_after_ms:off,headroom_mb:50,reclaim_interval_ms:20");
    let a = alloc.allocate(0, (60 * MIB) as usize, S0).unwrap();
    alloc.free(0, a).unwrap();
    assert_eq!(tidepool::backend::Backend::mem_info(&*backend, 0).unwrap().free, 40 * MIB);
    // Segments idle under a second are spared; after that, released.
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(reserved(&alloc), 60 * MIB);
    assert!(common::eventually(Duration::from_secs(5), || reserved(&alloc) == 0));
    assert_eq!(alloc.stats(0).unwrap().released(Reason::Headroom).bytes, 60 * MIB);
}

#[test]
fn without_a_policy_nothing_is_released_and_no_thread_runs() {
    let (alloc, _) = host_allocator(1, 100 * MIB, "");
    assert!(!alloc.has_reclaimer());
    let a = alloc.allocate(0, (60 * MIB) as usize, S0).unwrap();
    alloc.free(0, a).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(reserved(&alloc), 60 * MIB);
}

#[test]
fn dropping_the_allocator_stops_its_reclaimer_at_once() {
    let (alloc, _) = host_allocator(1, 1 << 30, "release_after_ms:60000,reclaim_interval_ms:60000");
    assert!(alloc.has_reclaimer());
    let start = Instant::now();
    drop(alloc);
    // Not woken, it would sleep out its 60 s interval.
    assert!(start.elapsed() < Duration::from_secs(5), "the thread was not woken to stop");
}

#[test]
fn pressure_is_answered_within_a_couple_of_intervals() {
    // A segment idle for over a second, then another process (here: another
    // heap's growth on the same device) leaves less than the headroom free.
    let (alloc, backend) = host_allocator(1, 100 * MIB, "release_after_ms:off,headroom_mb:30,reclaim_interval_ms:20");
    let a = alloc.allocate(0, (40 * MIB) as usize, S0).unwrap();
    alloc.free(0, a).unwrap();
    std::thread::sleep(Duration::from_millis(1100));
    assert_eq!(reserved(&alloc), 40 * MIB, "no pressure yet: the cache stays");
    let other = tidepool::backend::Backend::allocate(&*backend, 0, 40 * MIB, S0).unwrap();
    let signal = Instant::now();
    assert!(common::eventually(Duration::from_secs(5), || reserved(&alloc) == 0));
    let latency = signal.elapsed();
    eprintln!("pressure to release: {latency:?} with a 20 ms interval");
    // A couple of intervals, with room for a loaded machine; without the
    // pressure check nothing would go back at all (release_after_ms is off).
    assert!(latency < Duration::from_secs(2), "{latency:?}");
    tidepool::backend::Backend::release(&*backend, 0, other, 40 * MIB, S0).unwrap();
}
