//! Stream shards (`stream_shards`): several heaps per device, streams spread
//! over them, so threads on different streams do not contend. The same
//! guarantees hold: conformance, no overlap under threads, device-wide caps,
//! and statistics that add up.

use crate::common;

use std::sync::Arc;

use common::{check, conformance, fill, host_allocator, Rng, MIB};
use tidepool::{DevicePtr, Stream};

#[test]
fn the_conformance_suite_holds_with_stream_shards() {
    for extra in ["", "expandable:true"] {
        let make = |conf: &str| host_allocator(1, 256 * MIB, &format!("stream_shards:4,{extra},{conf}")).0;
        conformance::run(&make, 256 * MIB, [Stream(1), Stream(2)]);
    }
}

#[test]
fn statistics_add_up_over_the_shards() {
    let (alloc, _) = host_allocator(1, 1 << 30, "expandable:false,stream_shards:4");
    let a = alloc.allocate(0, 4096, Stream(1)).unwrap();
    let b = alloc.allocate(0, 3 * MIB as usize, Stream(2)).unwrap();
    let s = alloc.stats(0).unwrap();
    assert_eq!(s.allocated_bytes.all.current, 4096 + 3 * MIB);
    assert_eq!(s.reserved_bytes.all.current, 2 * MIB + 20 * MIB, "a segment per stream's shard");
    assert_eq!(s.num_allocs, 2);
    // Freed without naming the stream: found in its shard all the same.
    alloc.free(0, a).unwrap();
    alloc.free_on_stream(0, b, Stream(2)).unwrap();
    assert!(alloc.free(0, b).is_err(), "a double free is still refused");
    assert_eq!(alloc.stats(0).unwrap().allocated_bytes.all.current, 0);
    alloc.validate().unwrap();
}

#[test]
fn the_peak_reserved_is_the_devices_not_the_sum_of_the_shards() {
    let (alloc, _) = host_allocator(1, 1 << 30, "stream_shards:4");
    // Streams 1 and 2 go to different shards (as above); each holds 40 MiB in turn.
    for stream in [Stream(1), Stream(2)] {
        let p = alloc.allocate(0, (40 * MIB) as usize, stream).unwrap();
        alloc.free(0, p).unwrap();
        alloc.empty_cache();
    }
    let s = alloc.stats(0).unwrap();
    assert_eq!(s.reserved_bytes.all.current, 0);
    assert_eq!(s.reserved_bytes.all.peak, 40 * MIB, "never more than one 40 MiB segment at once");
    assert_eq!(s.reserved_bytes.large_pool.peak, 80 * MIB, "per pool kind, still the sum over the shards");
    let p = alloc.allocate(0, (10 * MIB) as usize, Stream(1)).unwrap();
    alloc.reset_peak_stats(0).unwrap();
    assert_eq!(alloc.stats(0).unwrap().reserved_bytes.all.peak, alloc.stats(0).unwrap().reserved_bytes.all.current, "reset to now");
    alloc.free(0, p).unwrap();
    alloc.validate().unwrap();
}

#[test]
fn a_full_device_takes_the_cache_of_the_other_shards() {
    // With expandable segments, what the other shard gives back is pages.
    for conf in ["stream_shards:4", "stream_shards:4,expandable:true"] {
        let (alloc, _) = host_allocator(1, 64 * MIB, conf);
        let a = alloc.allocate(0, (40 * MIB) as usize, Stream(1)).unwrap();
        alloc.free(0, a).unwrap();
        let b = alloc.allocate(0, (40 * MIB) as usize, Stream(2)).unwrap();
        let s = alloc.stats(0).unwrap();
        assert_eq!((s.reserved_bytes.all.current, s.events.num_ooms, s.events.num_device_free), (40 * MIB, 0, 1), "{conf}");
        alloc.free(0, b).unwrap();
        alloc.validate().unwrap();
    }
}

#[test]
fn the_memory_fraction_caps_the_device_not_each_shard() {
    let (alloc, _) = host_allocator(1, 100 * MIB, "stream_shards:4");
    alloc.set_memory_fraction(0, 0.5).unwrap();
    let a = alloc.allocate(0, (30 * MIB) as usize, Stream(1)).unwrap();
    assert!(alloc.allocate(0, (30 * MIB) as usize, Stream(2)).is_err(), "60 MiB over a 50 MiB cap");
    alloc.free(0, a).unwrap();
}

#[test]
fn threads_on_sharded_streams_never_overlap() {
    let (alloc, _) = host_allocator(1, 4 << 30, "stream_shards:4");
    let alloc = Arc::new(alloc);
    let threads: Vec<_> = (0..6u64)
        .map(|t| {
            let alloc = alloc.clone();
            std::thread::spawn(move || {
                let mut rng = Rng(t + 11);
                let stream = Stream(t % 3 + 1);
                let mut live: Vec<(DevicePtr, u64, u64)> = Vec::new();
                for op in 0..30_000u64 {
                    if !live.is_empty() && (live.len() >= 32 || rng.below(2) == 0) {
                        let (p, len, tag) = live.swap_remove(rng.below(live.len() as u64) as usize);
                        check(p, len, tag).unwrap();
                        alloc.free_on_stream(0, p, stream).unwrap();
                    } else {
                        let limit = if rng.below(10) == 0 { 3 * MIB } else { 8192 };
                        let len = 1 + rng.below(limit);
                        let p = alloc.allocate(0, len as usize, stream).unwrap();
                        fill(p, len, t << 32 | op);
                        live.push((p, len, t << 32 | op));
                    }
                }
                for (p, len, tag) in live {
                    check(p, len, tag).unwrap();
                    alloc.free(0, p).unwrap();
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    alloc.validate().unwrap();
    assert_eq!(alloc.stats(0).unwrap().allocated_bytes.all.current, 0);
}
