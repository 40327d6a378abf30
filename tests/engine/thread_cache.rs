//! Threads' caches of their own frees (`thread_cache_blocks`): the figures
//! stay those of the same calls without caches, blocks stay on their
//! stream, caches go back to the heap when they must, and bad frees are
//! still refused.

use std::sync::Arc;

use tidepool::error::AllocError;
use tidepool::stats::Stats;
use tidepool::{Allocator, DevicePtr, Stream};

use crate::common::{host_allocator, reserved, Rng};

const MIB: u64 = 1 << 20;

/// The figures that cached hand-outs and frees move, and their peaks,
/// where placement does not change them.
fn counted(stats: &Stats) -> Vec<(String, u64)> {
    let mut out = Vec::new();
    for (name, gauge) in [("allocation", &stats.allocation), ("requested_bytes", &stats.requested_bytes)] {
        for (pool, stat) in [("all", &gauge.all), ("small", &gauge.small_pool), ("large", &gauge.large_pool)] {
            for (field, value) in [("current", stat.current), ("peak", stat.peak), ("allocated", stat.allocated), ("freed", stat.freed)] {
                out.push((format!("{name}.{pool}.{field}"), value));
            }
        }
    }
    // Small blocks are always cut to their rounded size; a large one may
    // keep a remainder too small to split, which depends on placement,
    // which caches change.
    let small = &stats.allocated_bytes.small_pool;
    for (field, value) in [("current", small.current), ("peak", small.peak), ("allocated", small.allocated), ("freed", small.freed)] {
        out.push((format!("allocated_bytes.small.{field}"), value));
    }
    out.push(("num_allocs".into(), stats.num_allocs));
    out.push(("num_frees".into(), stats.num_frees));
    out
}

/// A random sequence of allocations and frees of a few sizes (so that the
/// caches serve most of them), with figures read, peaks and accumulated
/// counts reset along the way; every read returns.
fn play(alloc: &Allocator, seed: u64) -> Vec<Vec<(String, u64)>> {
    let sizes = [512, 700, 4096, 64 << 10, MIB + 512, 4 * MIB];
    let mut rng = Rng(seed);
    let mut live: Vec<DevicePtr> = Vec::new();
    let mut reads = Vec::new();
    for op in 0..3_000 {
        if !live.is_empty() && rng.chance(48) {
            let ptr = live.swap_remove(rng.below(live.len() as u64) as usize);
            alloc.free(0, ptr).unwrap();
        } else {
            let size = sizes[rng.below(sizes.len() as u64) as usize] as usize;
            live.push(alloc.allocate(0, size, Stream::DEFAULT).unwrap());
        }
        match op % 500 {
            499 => reads.push(counted(&alloc.stats(0).unwrap())),
            250 => alloc.reset_peak_stats(0).unwrap(),
            400 => alloc.reset_accumulated_stats(0).unwrap(),
            _ => {}
        }
    }
    for ptr in live {
        alloc.free(0, ptr).unwrap();
    }
    reads.push(counted(&alloc.stats(0).unwrap()));
    alloc.validate().unwrap();
    reads
}

#[test]
fn every_figure_is_the_one_without_caches_for_the_same_calls() {
    for seed in [1, 2, 3] {
        let (cached, _) = host_allocator(1, 1 << 34, "");
        let (plain, _) = host_allocator(1, 1 << 34, "thread_cache_blocks:0");
        assert_eq!(play(&cached, seed), play(&plain, seed), "seed {seed}");
    }
}

#[test]
fn a_thread_gets_its_freed_block_back_and_another_threads_growth_sets_an_exact_peak() {
    let (alloc, _) = host_allocator(1, 1 << 30, "");
    let alloc = Arc::new(alloc);
    // A thread frees two 512 B blocks into its cache and takes them back
    // twice: cached hand-outs, at the peak of 1 KiB.
    let worker = {
        let alloc = alloc.clone();
        std::thread::spawn(move || {
            for _ in 0..3 {
                let (a, b) = (alloc.allocate(0, 512, Stream::DEFAULT).unwrap(), alloc.allocate(0, 512, Stream::DEFAULT).unwrap());
                alloc.free(0, a).unwrap();
                alloc.free(0, b).unwrap();
            }
            let again = alloc.allocate(0, 512, Stream::DEFAULT).unwrap();
            alloc.free(0, again).unwrap();
            again
        })
    };
    let again = worker.join().unwrap();
    // The worker has exited: its cache went back to the heap. Another
    // thread now grows past the old peak: the peak is exactly what is live.
    let blocks: Vec<_> = (0..3).map(|_| alloc.allocate(0, 512, Stream::DEFAULT).unwrap()).collect();
    assert!(blocks.contains(&again), "the exited thread's cached block serves others");
    let stats = alloc.stats(0).unwrap();
    assert_eq!((stats.allocated_bytes.all.current, stats.allocated_bytes.all.peak), (1536, 1536));
    assert_eq!((stats.num_allocs, stats.num_frees), (10, 7));
    blocks.into_iter().for_each(|p| alloc.free(0, p).unwrap());
    alloc.validate().unwrap();
}

#[test]
fn a_live_thread_s_cache_does_not_raise_the_peak_another_thread_sets() {
    let (alloc, _) = host_allocator(1, 1 << 30, "");
    let alloc = Arc::new(alloc);
    let (to_worker, worker_gets) = std::sync::mpsc::channel::<()>();
    let (to_main, main_gets) = std::sync::mpsc::channel::<()>();
    let worker = {
        let alloc = alloc.clone();
        std::thread::spawn(move || {
            // 4 MiB held, then freed into the cache: the peak is 4 MiB and
            // the cache could hand it out again at any time.
            let big = alloc.allocate(0, 4 * MIB as usize, Stream::DEFAULT).unwrap();
            alloc.free(0, big).unwrap();
            let big = alloc.allocate(0, 4 * MIB as usize, Stream::DEFAULT).unwrap();
            alloc.free(0, big).unwrap();
            to_main.send(()).unwrap();
            worker_gets.recv().unwrap();
            // Still cached: taken back, at the peak the main thread left.
            let back = alloc.allocate(0, 4 * MIB as usize, Stream::DEFAULT).unwrap();
            alloc.free(0, back).unwrap();
        })
    };
    main_gets.recv().unwrap();
    // 3 MiB live here while the worker's 4 MiB block waits in its cache:
    // the peak stays 4 MiB (never 7), then grows to exactly 6.
    let a = alloc.allocate(0, 3 * MIB as usize, Stream::DEFAULT).unwrap();
    let b = alloc.allocate(0, 3 * MIB as usize, Stream::DEFAULT).unwrap();
    let stats = alloc.stats(0).unwrap();
    assert_eq!(stats.allocated_bytes.all.peak, 6 * MIB);
    assert_eq!(stats.allocated_bytes.large_pool.peak, 6 * MIB);
    to_worker.send(()).unwrap();
    worker.join().unwrap();
    let stats = alloc.stats(0).unwrap();
    assert_eq!((stats.allocated_bytes.all.current, stats.allocated_bytes.all.peak), (6 * MIB, 10 * MIB));
    alloc.free(0, a).unwrap();
    alloc.free(0, b).unwrap();
    alloc.validate().unwrap();
}

#[test]
fn a_cached_block_serves_only_its_own_stream_and_size() {
    let (alloc, _) = host_allocator(1, 1 << 30, "stash:false");
    let other = Stream(7);
    // The other stream's pool has room already: nothing grows (growth
    // would take cached blocks back first).
    let _held = alloc.allocate(0, 4096, other).unwrap();
    let a = alloc.allocate(0, 4096, Stream::DEFAULT).unwrap();
    let _after = alloc.allocate(0, 4096, Stream::DEFAULT).unwrap();
    alloc.free(0, a).unwrap();
    assert_ne!(alloc.allocate(0, 4096, other).unwrap(), a, "another stream's cached block");
    assert_ne!(alloc.allocate(0, 4000, Stream::DEFAULT).unwrap(), a, "a request of another size");
    assert_eq!(alloc.allocate(0, 4096, Stream::DEFAULT).unwrap(), a, "the same size on the same stream");
    alloc.validate().unwrap();
}

#[test]
fn empty_cache_and_exiting_threads_leave_nothing_cached() {
    let (alloc, _) = host_allocator(1, 1 << 30, "");
    let alloc = Arc::new(alloc);
    let handed_out = {
        let alloc = alloc.clone();
        std::thread::spawn(move || {
            let blocks: Vec<_> = (0..8).map(|_| alloc.allocate(0, 64 << 10, Stream::DEFAULT).unwrap()).collect();
            blocks.into_iter().for_each(|p| alloc.free(0, p).unwrap());
            // One block handed out from the cache outlives the thread.
            alloc.allocate(0, 64 << 10, Stream::DEFAULT).unwrap()
        })
        .join()
        .unwrap()
    };
    alloc.free(0, handed_out).unwrap();
    assert_eq!(alloc.empty_cache().bytes, 2 * MIB, "the exited thread's blocks came back");
    assert_eq!(reserved(&alloc), 0);

    // A live thread's cache goes back at empty_cache.
    let p = alloc.allocate(0, 4 * MIB as usize, Stream::DEFAULT).unwrap();
    alloc.free(0, p).unwrap();
    let held = reserved(&alloc);
    assert!(held >= 4 * MIB);
    assert_eq!(alloc.empty_cache().bytes, held);
    assert_eq!(reserved(&alloc), 0);
    alloc.validate().unwrap();
}

#[test]
fn the_reclaimer_takes_back_a_cache_left_idle() {
    let (alloc, _) = host_allocator(1, 1 << 30, "");
    let p = alloc.allocate(0, 4096, Stream::DEFAULT).unwrap();
    alloc.free(0, p).unwrap();
    let device = alloc.device(0).unwrap();
    device.reclaim(); // notes the cache's use
    assert_eq!(alloc.segment_of(0, p).unwrap().map(|(_, size)| size), Some(2 * MIB));
    device.reclaim(); // no use since: the block goes back, and its segment is whole and free
    let snapshot = alloc.snapshot(0).unwrap();
    assert!(snapshot[0].blocks.iter().all(|b| !b.allocated), "{snapshot:?}");
    alloc.validate().unwrap();
}

#[test]
fn bounds_hold_and_blocks_past_them_go_to_the_heap() {
    let (alloc, _) = host_allocator(1, 1 << 30, "thread_cache_blocks:2,thread_cache_mb:1");
    let blocks: Vec<_> = (0..4).map(|_| alloc.allocate(0, 512 << 10, Stream::DEFAULT).unwrap()).collect();
    blocks.iter().for_each(|&p| alloc.free(0, p).unwrap());
    // Two 512 KiB blocks fit in the cache (1 MiB, 2 entries); the others
    // merged in the heap: a request for 1 MiB finds them there.
    let merged = alloc.allocate(0, MIB as usize, Stream::DEFAULT).unwrap();
    assert!(merged == blocks[2] || merged == blocks[0], "{merged:?} {blocks:?}");
    let stats = alloc.stats(0).unwrap();
    assert_eq!(stats.segment.all.current, 1, "nothing grew");
    alloc.validate().unwrap();
}

#[test]
fn double_frees_and_foreign_pointers_are_still_refused() {
    let (alloc, _) = host_allocator(1, 1 << 30, "");
    let p = alloc.allocate(0, 4096, Stream::DEFAULT).unwrap();
    alloc.free(0, p).unwrap(); // into the cache
    assert!(matches!(alloc.free(0, p), Err(AllocError::InvalidFree { .. })), "a double free of a cached block");
    let q = alloc.allocate(0, 4096, Stream::DEFAULT).unwrap(); // from the cache
    assert_eq!(q, p);
    alloc.free(0, q).unwrap();
    // Freed again from another thread, where the block is in this thread's cache.
    let alloc = Arc::new(alloc);
    let other = alloc.clone();
    let refused = std::thread::spawn(move || other.free(0, q)).join().unwrap();
    assert!(matches!(refused, Err(AllocError::InvalidFree { .. })), "{refused:?}");
    assert!(matches!(alloc.free(0, DevicePtr(0x1000)), Err(AllocError::InvalidFree { .. })));
    assert_eq!(alloc.stats(0).unwrap().events.num_invalid_frees, 3);
    alloc.validate().unwrap();
}

#[test]
fn a_block_handed_out_by_one_thread_is_freed_by_another() {
    let (alloc, _) = host_allocator(1, 1 << 30, "");
    let alloc = Arc::new(alloc);
    let p = alloc.allocate(0, 4096, Stream::DEFAULT).unwrap();
    alloc.free(0, p).unwrap();
    let q = alloc.allocate(0, 4096, Stream::DEFAULT).unwrap(); // handed out by this thread's cache
    let other = alloc.clone();
    std::thread::spawn(move || other.free(0, q).unwrap()).join().unwrap();
    // This thread forgets it: freeing it again is a double free.
    assert!(matches!(alloc.free(0, q), Err(AllocError::InvalidFree { .. })));
    let stats = alloc.stats(0).unwrap();
    assert_eq!((stats.allocated_bytes.all.current, stats.num_allocs, stats.num_frees), (0, 2, 2));
    alloc.validate().unwrap();
}

#[test]
fn record_stream_and_captures_bypass_the_cache() {
    let (alloc, _) = host_allocator(1, 1 << 30, "stash:false");
    // A block used on another stream is not cached: its free waits for that stream.
    let p = alloc.allocate(0, 4096, Stream::DEFAULT).unwrap();
    alloc.free(0, p).unwrap();
    let q = alloc.allocate(0, 4096, Stream::DEFAULT).unwrap();
    alloc.record_stream(q, Stream(9)).unwrap();
    alloc.free(0, q).unwrap();
    alloc.validate().unwrap();
    // During a capture, requests come from the private pool, not the cache.
    let r = alloc.allocate(0, 8192, Stream::DEFAULT).unwrap();
    alloc.free(0, r).unwrap();
    alloc.begin_private(0, tidepool::PrivatePoolId(1, 1)).unwrap();
    let captured = alloc.allocate(0, 8192, Stream::DEFAULT).unwrap();
    assert_ne!(captured, r, "a capture took a cached block");
    alloc.free(0, captured).unwrap();
    alloc.end_private(0, tidepool::PrivatePoolId(1, 1)).unwrap();
    assert_eq!(alloc.allocate(0, 8192, Stream::DEFAULT).unwrap(), r, "the cache serves again after the capture");
    alloc.validate().unwrap();
}

#[test]
fn two_threads_on_one_stream_keep_exact_counts() {
    let (alloc, _) = host_allocator(1, 1 << 30, "");
    let alloc = Arc::new(alloc);
    let threads: Vec<_> = (0..2)
        .map(|_| {
            let alloc = alloc.clone();
            std::thread::spawn(move || {
                for _ in 0..20_000 {
                    let p = alloc.allocate(0, 512, Stream::DEFAULT).unwrap();
                    alloc.free(0, p).unwrap();
                }
            })
        })
        .collect();
    threads.into_iter().for_each(|t| t.join().unwrap());
    let stats = alloc.stats(0).unwrap();
    assert_eq!((stats.num_allocs, stats.num_frees, stats.allocated_bytes.all.current), (40_000, 40_000, 0));
    assert!(stats.allocated_bytes.all.peak <= 1024, "peak {}", stats.allocated_bytes.all.peak);
    alloc.validate().unwrap();
}

/// Threads that run closures one at a time, in the order given: a random
/// sequence of calls spread over several threads, still one sequence.
struct Workers {
    jobs: Vec<std::sync::mpsc::Sender<Box<dyn FnOnce() + Send>>>,
    handles: Vec<std::thread::JoinHandle<()>>,
}

impl Workers {
    fn new(count: usize) -> Workers {
        let (mut jobs, mut handles) = (Vec::new(), Vec::new());
        for _ in 0..count {
            let (send, receive) = std::sync::mpsc::channel::<Box<dyn FnOnce() + Send>>();
            jobs.push(send);
            handles.push(std::thread::spawn(move || receive.into_iter().for_each(|job| job())));
        }
        Workers { jobs, handles }
    }

    /// Runs `job` on thread `thread` and returns its result.
    fn run<R: Send + 'static>(&self, thread: usize, job: impl FnOnce() -> R + Send + 'static) -> R {
        let (send, receive) = std::sync::mpsc::channel();
        self.jobs[thread].send(Box::new(move || send.send(job()).unwrap())).unwrap();
        receive.recv().unwrap()
    }

    /// Ends the threads (their caches go back to the heap).
    fn join(self) {
        drop(self.jobs);
        self.handles.into_iter().for_each(|h| h.join().unwrap());
    }
}

mod model {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    use crate::common::{check, fill};

    #[derive(Clone, Debug)]
    enum Op {
        Alloc { thread: usize, size: u64 },
        Free { thread: usize, pick: usize },
        DoubleFree { thread: usize, pick: usize },
        Stats,
    }

    fn op() -> impl Strategy<Value = Op> {
        let size = prop_oneof![Just(512u64), Just(4096), Just(65_536), Just(MIB + 512), Just(3 * MIB), 1u64..(6 * MIB)];
        prop_oneof![
            10 => (0usize..3, size).prop_map(|(thread, size)| Op::Alloc { thread, size }),
            8 => (0usize..3, any::<usize>()).prop_map(|(thread, pick)| Op::Free { thread, pick }),
            1 => (0usize..3, any::<usize>()).prop_map(|(thread, pick)| Op::DoubleFree { thread, pick }),
            1 => Just(Op::Stats),
        ]
    }

    /// Every block handed out lies apart from the others and keeps its
    /// contents; every figure read equals what is live; a double free on
    /// any thread is refused; the heap stays valid.
    fn run(ops: Vec<Op>) -> Result<(), TestCaseError> {
        let (alloc, _) = host_allocator(1, 1 << 34, "thread_cache_blocks:4,thread_cache_mb:8");
        let alloc = Arc::new(alloc);
        let workers = Workers::new(3);
        let mut live: BTreeMap<u64, (u64, u64, u64)> = BTreeMap::new(); // addr -> (block, requested, tag)
        let mut freed = Vec::new();
        let mut refused = 0;
        for (step, op) in ops.into_iter().enumerate() {
            match op {
                Op::Alloc { thread, size } => {
                    let a = alloc.clone();
                    let ptr = workers.run(thread, move || a.allocate(0, size as usize, Stream::DEFAULT).unwrap());
                    let block = alloc.device(0).unwrap().live_size(ptr).expect("a block handed out is live");
                    if let Some((&addr, &(len, _, _))) = live.range(..ptr.0).next_back() {
                        prop_assert!(addr + len <= ptr.0, "overlaps the block at {:#x}", addr);
                    }
                    if let Some((&addr, _)) = live.range(ptr.0..).next() {
                        prop_assert!(ptr.0 + block <= addr, "overlaps the block at {:#x}", addr);
                    }
                    fill(ptr, size, step as u64);
                    live.insert(ptr.0, (block, size, step as u64));
                }
                Op::Free { thread, pick } if !live.is_empty() => {
                    let addr = *live.keys().nth(pick % live.len()).unwrap();
                    let (_, requested, tag) = live.remove(&addr).unwrap();
                    prop_assert_eq!(check(DevicePtr(addr), requested, tag), Ok(()));
                    let a = alloc.clone();
                    workers.run(thread, move || a.free(0, DevicePtr(addr)).unwrap());
                    freed.push(addr);
                }
                Op::DoubleFree { thread, pick } if !freed.is_empty() => {
                    let addr = freed[pick % freed.len()];
                    if !live.contains_key(&addr) {
                        let a = alloc.clone();
                        let result = workers.run(thread, move || a.free(0, DevicePtr(addr)));
                        prop_assert!(matches!(result, Err(AllocError::InvalidFree { .. })), "{:?}", result);
                        refused += 1;
                    }
                }
                Op::Stats => {
                    let stats = alloc.stats(0).unwrap();
                    prop_assert_eq!(stats.allocation.all.current, live.len() as u64);
                    prop_assert_eq!(stats.requested_bytes.all.current, live.values().map(|v| v.1).sum::<u64>());
                    prop_assert_eq!(stats.allocated_bytes.all.current, live.values().map(|v| v.0).sum::<u64>());
                    prop_assert_eq!(stats.events.num_invalid_frees, refused);
                    alloc.validate().map_err(TestCaseError::fail)?;
                    // Each thread's own records, which only it can read.
                    for thread in 0..3 {
                        let a = alloc.clone();
                        workers.run(thread, move || a.validate()).map_err(TestCaseError::fail)?;
                    }
                }
                _ => {}
            }
        }
        for (addr, (_, requested, tag)) in std::mem::take(&mut live) {
            prop_assert_eq!(check(DevicePtr(addr), requested, tag), Ok(()));
            alloc.free(0, DevicePtr(addr)).unwrap();
        }
        workers.join();
        alloc.validate().map_err(TestCaseError::fail)?;
        let stats = alloc.stats(0).unwrap();
        prop_assert_eq!((stats.allocated_bytes.all.current, stats.num_allocs), (0, stats.num_frees));
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 150, ..ProptestConfig::default() })]

        #[test]
        fn calls_spread_over_threads_agree_with_a_model_of_live_ranges(ops in prop::collection::vec(op(), 1..120)) {
            run(ops)?;
        }
    }
}

#[test]
fn evicting_a_block_freed_into_the_cache_after_it_was_armed_keeps_the_figures() {
    // Two entries. `a` is handed out by the cache, then the cache is
    // armed again (its claim: what it holds then, not `a`), then `a` comes
    // back into it, and fuller caches evict it: the heap must take it back
    // without counting it out of a claim it was never in.
    let (alloc, _) = host_allocator(1, 1 << 30, "thread_cache_blocks:2");
    // Peaks (of bytes and of blocks) well above what follows: the cache
    // stays armed throughout.
    let many: Vec<_> = (0..8).map(|_| alloc.allocate(0, 128 << 10, Stream::DEFAULT).unwrap()).collect();
    many.into_iter().for_each(|p| alloc.free(0, p).unwrap());
    alloc.stats(0).unwrap();
    let a = alloc.allocate(0, 64 << 10, Stream::DEFAULT).unwrap();
    alloc.free(0, a).unwrap();
    let a = alloc.allocate(0, 64 << 10, Stream::DEFAULT).unwrap();
    alloc.stats(0).unwrap(); // takes the cache back and folds it in
    let b = alloc.allocate(0, 4096, Stream::DEFAULT).unwrap();
    alloc.free(0, b).unwrap(); // lent, the cache armed again
    alloc.free(0, a).unwrap(); // into the cache's second entry
    for size in [8192, 12288, 16384] {
        let p = alloc.allocate(0, size, Stream::DEFAULT).unwrap();
        alloc.free(0, p).unwrap(); // each evicts the entry in turn
    }
    let stats = alloc.stats(0).unwrap();
    assert_eq!((stats.allocated_bytes.all.current, stats.allocation.all.current), (0, 0));
    assert_eq!(stats.allocated_bytes.all.peak, MIB);
    assert_eq!(stats.allocation.all.peak, 8);
    alloc.validate().unwrap();
}

#[test]
fn one_thread_uses_more_allocators_and_devices_than_it_keeps_caches_for() {
    // Three allocators of two devices each: six (allocator, device) pairs
    // on a thread that keeps caches for four (the others go through the
    // heap), used in random turns, so that the caches change places; one
    // allocator is dropped midway and replaced (its places go to others).
    let new = || host_allocator(2, 1 << 32, "thread_cache_blocks:4").0;
    let mut allocs: Vec<Allocator> = (0..3).map(|_| new()).collect();
    let mut live: Vec<Vec<(usize, DevicePtr, u64)>> = vec![Vec::new(); 3];
    let sizes = [512u64, 4096, 64 << 10];
    let mut rng = Rng(7);
    for step in 0..4_000 {
        let k = rng.below(3) as usize;
        if step == 2_000 {
            live[k].drain(..).for_each(|(device, ptr, _)| allocs[k].free(device, ptr).unwrap());
            allocs[k] = new();
        }
        if !live[k].is_empty() && rng.chance(50) {
            let pick = rng.below(live[k].len() as u64) as usize;
            let (device, ptr, _) = live[k].swap_remove(pick);
            allocs[k].free(device, ptr).unwrap();
        } else {
            let (device, size) = (rng.below(2) as usize, sizes[rng.below(3) as usize]);
            live[k].push((device, allocs[k].allocate(device, size as usize, Stream::DEFAULT).unwrap(), size));
        }
        if step % 250 != 249 {
            continue;
        }
        for (k, alloc) in allocs.iter().enumerate() {
            alloc.validate().unwrap_or_else(|e| panic!("step {step}, allocator {k}: {e}"));
            for device in 0..2 {
                let mine: Vec<u64> = live[k].iter().filter(|l| l.0 == device).map(|l| l.2).collect();
                let stats = alloc.stats(device).unwrap();
                let counted = (stats.allocation.all.current, stats.requested_bytes.all.current);
                assert_eq!(counted, (mine.len() as u64, mine.iter().sum()), "step {step}, allocator {k}, device {device}");
            }
        }
    }
    for (k, alloc) in allocs.iter().enumerate() {
        live[k].drain(..).for_each(|(device, ptr, _)| alloc.free(device, ptr).unwrap());
        alloc.validate().unwrap();
        assert_eq!(alloc.stats(0).unwrap().allocation.all.current + alloc.stats(1).unwrap().allocation.all.current, 0);
    }
}
