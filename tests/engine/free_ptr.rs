//! `Allocator::free_ptr`: a free that names no device, size or stream (the
//! C ABI's `tidepool_free_ptr`). It finds the device (the thread's cache,
//! else the heaps that hold the address), frees on the block's own stream,
//! and refuses a bad pointer as the named free does, counted where the
//! address lies: with threads' caches on and off, stream shards, several
//! devices, and a block freed by a thread other than the one it came from.

use std::collections::BTreeMap;

use tidepool::{AllocError, Allocator, DevicePtr, InvalidFree, Stream};

use crate::common::{check, fill, host_allocator, Rng};

const MIB: u64 = 1 << 20;

/// The configurations free_ptr must work under.
const CONFS: [&str; 4] = ["", "thread_cache_blocks:0", "stream_shards:2", "expandable:false"];

fn invalid_frees(alloc: &Allocator, device: usize) -> u64 {
    alloc.stats(device).unwrap().events.num_invalid_frees
}

#[test]
fn free_ptr_frees_on_the_device_that_holds_the_block_with_exact_figures() {
    for conf in CONFS {
        let (alloc, _backend) = host_allocator(3, 256 * MIB, conf);
        let mut rng = Rng(7);
        // (device, stream, requested) by address, and the figures each free kind must leave.
        let mut live: BTreeMap<u64, (usize, u64, u64)> = BTreeMap::new();
        for step in 0..4000u64 {
            if live.is_empty() || rng.below(100) < 55 {
                let device = rng.below(3) as usize;
                let stream = rng.below(3);
                let size = [512, 4096, 100_000, 3 * MIB, 512][rng.below(5) as usize];
                let ptr = alloc.allocate(device, size as usize, Stream(stream)).unwrap();
                fill(ptr, size.min(4096), step);
                live.insert(ptr.0, (device, step, size));
            } else {
                let pick = rng.below(live.len() as u64) as usize;
                let (&addr, &(device, tag, size)) = live.iter().nth(pick).unwrap();
                assert_eq!(check(DevicePtr(addr), size.min(4096), tag), Ok(()), "{conf}: block {addr:#x} damaged");
                live.remove(&addr);
                if rng.below(2) == 0 {
                    alloc.free_ptr(DevicePtr(addr)).unwrap();
                } else {
                    alloc.free(device, DevicePtr(addr)).unwrap();
                }
            }
            if step % 97 == 0 {
                alloc.validate().unwrap();
                for device in 0..3 {
                    let stats = alloc.stats(device).unwrap();
                    let mine = live.values().filter(|l| l.0 == device);
                    assert_eq!(stats.requested_bytes.all.current, mine.clone().map(|l| l.2).sum::<u64>(), "{conf}: device {device}");
                    assert_eq!(stats.allocation.all.current, mine.count() as u64, "{conf}: device {device}");
                    assert_eq!(stats.events.num_invalid_frees, 0, "{conf}");
                    assert_eq!(stats.events.num_size_mismatches, 0, "{conf}");
                }
            }
        }
        for &addr in live.keys() {
            alloc.free_ptr(DevicePtr(addr)).unwrap();
        }
        alloc.empty_cache();
        alloc.validate().unwrap();
        for device in 0..3 {
            let stats = alloc.stats(device).unwrap();
            assert_eq!((stats.allocation.all.current, stats.reserved_bytes.all.current), (0, 0), "{conf}: device {device}");
            assert_eq!(stats.num_allocs, stats.num_frees, "{conf}: device {device}");
        }
    }
}

#[test]
fn free_ptr_refuses_what_is_not_a_live_block_and_counts_it_where_it_lies() {
    for conf in CONFS {
        let (alloc, _backend) = host_allocator(2, 256 * MIB, conf);
        assert_eq!(alloc.free_ptr(DevicePtr::NULL), Ok(()), "{conf}: NULL is nothing");
        // Foreign: on no device; counted on device 0.
        let err = alloc.free_ptr(DevicePtr(0x1000)).unwrap_err();
        assert_eq!(err, AllocError::InvalidFree { ptr: 0x1000, reason: InvalidFree::Foreign }, "{conf}");
        assert_eq!((invalid_frees(&alloc, 0), invalid_frees(&alloc, 1)), (1, 0), "{conf}");
        // A block on device 1: a double free and an interior pointer are device 1's.
        let keep = alloc.allocate(1, 4096, Stream(3)).unwrap();
        let p = alloc.allocate(1, 4096, Stream(3)).unwrap();
        alloc.free_ptr(p).unwrap();
        let err = alloc.free_ptr(p).unwrap_err();
        assert!(matches!(err, AllocError::InvalidFree { reason: InvalidFree::NotLive, .. }), "{conf}: double free: {err:?}");
        assert_eq!((invalid_frees(&alloc, 0), invalid_frees(&alloc, 1)), (1, 1), "{conf}");
        let err = alloc.free_ptr(DevicePtr(keep.0 + 512)).unwrap_err();
        assert_eq!(err, AllocError::InvalidFree { ptr: keep.0 + 512, reason: InvalidFree::Interior { block: keep.0 } }, "{conf}");
        assert_eq!((invalid_frees(&alloc, 0), invalid_frees(&alloc, 1)), (1, 2), "{conf}");
        // Nothing changed: keep is live, and freed once.
        assert_eq!(alloc.stats(1).unwrap().allocation.all.current, 1, "{conf}");
        alloc.free_ptr(keep).unwrap();
        assert_eq!(alloc.stats(1).unwrap().allocation.all.current, 0, "{conf}");
        alloc.validate().unwrap();
    }
}

#[test]
fn free_ptr_frees_on_the_blocks_own_stream() {
    for conf in CONFS {
        let (alloc, _backend) = host_allocator(2, 256 * MIB, conf);
        let p = alloc.allocate(1, 8192, Stream(7)).unwrap();
        alloc.free_ptr(p).unwrap();
        // Stream 7's next request of that size gets it back; stream 0's does not.
        let other = alloc.allocate(1, 8192, Stream::DEFAULT).unwrap();
        assert_ne!(other, p, "{conf}: a block of stream 7 went to stream 0");
        let again = alloc.allocate(1, 8192, Stream(7)).unwrap();
        assert_eq!(again, p, "{conf}: stream 7's block is cached for stream 7");
        alloc.free_ptr(other).unwrap();
        alloc.free_ptr(again).unwrap();
        alloc.validate().unwrap();
    }
}

#[test]
fn free_ptr_frees_blocks_other_threads_allocated_and_cached_hand_outs_earlier_than_the_last() {
    let (alloc, _backend) = host_allocator(2, 256 * MIB, "");
    // On this thread: the cache hands out blocks of one size on each
    // device; they are freed out of order, the last hand-out not first.
    for _ in 0..50 {
        let blocks: Vec<DevicePtr> = (0..6).map(|i| alloc.allocate(i % 2, 4096, Stream::DEFAULT).unwrap()).collect();
        for &p in blocks.iter().rev().skip(1).chain(blocks.last()) {
            alloc.free_ptr(p).unwrap();
        }
    }
    let blocks: Vec<(usize, u64)> = (0..64).map(|i| (i % 2, alloc.allocate(i % 2, 512 << (i % 4), Stream(1)).unwrap().0)).collect();
    std::thread::scope(|scope| {
        scope.spawn(|| {
            for &(_, addr) in &blocks {
                alloc.free_ptr(DevicePtr(addr)).unwrap();
            }
            alloc.validate().unwrap();
        });
    });
    alloc.validate().unwrap();
    for device in 0..2 {
        let stats = alloc.stats(device).unwrap();
        assert_eq!(stats.allocation.all.current, 0);
        assert_eq!(stats.num_allocs, stats.num_frees);
        assert_eq!(stats.events.num_invalid_frees, 0);
    }
}
