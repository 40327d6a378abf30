//! Eight threads hammer one allocator with random sizes on their own and
//! shared streams; every block carries a pattern that is checked at free.
//! Overlapping blocks or a torn heap show up as a damaged pattern or a
//! failed `validate()`. With expandable segments, one thread also empties
//! the cache now and then, unmapping free pages under the others' feet.

use crate::common;

use std::sync::Arc;

use common::{check, fill, host_allocator, Rng, KIB, MIB};
use tidepool::{DevicePtr, Stream};

const THREADS: u64 = 8;
const OPS_PER_THREAD: u64 = 100_000;
const MAX_LIVE_PER_THREAD: usize = 64;

fn random_size(rng: &mut Rng) -> u64 {
    match rng.below(100) {
        0..=79 => 1 + rng.below(4 * KIB),
        80..=97 => 1 + rng.below(256 * KIB),
        _ => 1 + rng.below(24 * MIB),
    }
}

#[test]
fn eight_threads_with_random_sizes_never_corrupt_each_others_blocks() {
    hammer("", OPS_PER_THREAD);
}

#[test]
fn eight_threads_on_expandable_segments_never_corrupt_each_others_blocks() {
    hammer("expandable:true", OPS_PER_THREAD / 5);
}

fn hammer(conf: &str, ops: u64) {
    let (alloc, _) = host_allocator(1, 4 << 30, conf);
    let releases = conf.contains("expandable");
    let alloc = Arc::new(alloc);
    let threads: Vec<_> = (0..THREADS)
        .map(|t| {
            let alloc = alloc.clone();
            std::thread::spawn(move || {
                let mut rng = Rng(0x9E37_79B9 ^ ((t + 1) * 0x1234_5678_9ABC));
                // Half the threads share the default stream, half have their own.
                let stream = if t % 2 == 0 { Stream::DEFAULT } else { Stream(100 + t) };
                let mut live: Vec<(DevicePtr, u64, u64)> = Vec::with_capacity(MAX_LIVE_PER_THREAD);
                for op in 0..ops {
                    if releases && t == 0 && op % 1000 == 999 {
                        alloc.empty_cache();
                    }
                    let must_free = live.len() == MAX_LIVE_PER_THREAD;
                    if !live.is_empty() && (must_free || rng.below(2) == 0) {
                        let (ptr, len, tag) = live.swap_remove(rng.below(live.len() as u64) as usize);
                        check(ptr, len, tag).unwrap_or_else(|at| panic!("thread {t}: block {ptr:?} damaged at {at}"));
                        alloc.free(0, ptr).unwrap();
                    } else {
                        let len = random_size(&mut rng);
                        let ptr = alloc.allocate(0, len as usize, stream).unwrap();
                        let tag = t << 32 | op;
                        fill(ptr, len, tag);
                        live.push((ptr, len, tag));
                    }
                }
                for (ptr, len, tag) in live {
                    check(ptr, len, tag).unwrap();
                    alloc.free(0, ptr).unwrap();
                }
            })
        })
        .collect();
    for thread in threads {
        thread.join().unwrap();
    }
    alloc.validate().unwrap();
    let stats = alloc.stats(0).unwrap();
    assert_eq!(stats.allocated_bytes.all.current, 0);
    assert_eq!(stats.num_allocs, stats.num_frees);
    // Every free in the loop follows its allocation, so at least half the ops allocated.
    assert!(stats.num_allocs >= THREADS * ops / 2, "{} allocations", stats.num_allocs);
    if releases {
        assert!(stats.events.num_pages_unmapped > 0);
    }
    alloc.empty_cache();
    assert_eq!(alloc.stats(0).unwrap().reserved_bytes.all.current, 0);
}
