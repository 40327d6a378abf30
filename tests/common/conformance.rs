//! One conformance suite for every backend: what any allocator, over any
//! driver, must do. Each check takes a fresh allocator over a device of
//! `capacity` bytes whose memory the test can write (host memory, or
//! simgpu's stand-in device memory).

use super::{check, fill, MIB};
use tidepool::{AllocError, Allocator, Stream};

/// Runs every check; `make` builds a fresh allocator with extra
/// TIDEPOOL_CONF; `streams` are two distinct streams valid for the backend.
/// On a real GPU (TIDEPOOL_TEST_DEVICE_MEMORY=1) blocks cannot be written
/// from the host: the byte patterns are skipped (cuda/check's kernels
/// check them there).
pub fn run(make: &dyn Fn(&str) -> Allocator, capacity: u64, streams: [Stream; 2]) {
    if std::env::var_os("TIDEPOOL_TEST_DEVICE_MEMORY").is_none() {
        allocations_hold_their_bytes_and_never_overlap(&make(""));
    }
    a_freed_block_is_reused_on_its_stream_only(&make(""), streams);
    the_device_fills_up_then_the_cache_makes_room(&make(""), capacity);
    empty_cache_gives_everything_back(&make(""));
}

fn allocations_hold_their_bytes_and_never_overlap(alloc: &Allocator) {
    let sizes = [1u64, 512, 4000, 100_000, 1 << 20, 3 << 20, 12 << 20];
    let ptrs: Vec<_> = sizes.iter().map(|&s| alloc.allocate(0, s as usize, Stream::DEFAULT).unwrap()).collect();
    for (i, (&p, &s)) in ptrs.iter().zip(&sizes).enumerate() {
        fill(p, s, i as u64);
    }
    for (i, (&p, &s)) in ptrs.iter().zip(&sizes).enumerate() {
        assert_eq!(check(p, s, i as u64), Ok(()), "block {i} was overwritten");
        alloc.free(0, p).unwrap();
    }
    alloc.validate().unwrap();
}

fn a_freed_block_is_reused_on_its_stream_only(alloc: &Allocator, [one, two]: [Stream; 2]) {
    let a = alloc.allocate(0, 4096, one).unwrap();
    alloc.free(0, a).unwrap();
    assert_eq!(alloc.allocate(0, 4096, one).unwrap(), a);
    let b = alloc.allocate(0, 4096, two).unwrap();
    assert_ne!(alloc.segment_of(0, a).unwrap(), alloc.segment_of(0, b).unwrap());
    alloc.validate().unwrap();
}

fn the_device_fills_up_then_the_cache_makes_room(alloc: &Allocator, capacity: u64) {
    let half = capacity / 2 + MIB;
    let a = alloc.allocate(0, half as usize, Stream::DEFAULT).unwrap();
    // A live block after `a`, so that an expandable segment cannot grow
    // the freed `a` in place either.
    let c = alloc.allocate(0, (2 * MIB) as usize, Stream::DEFAULT).unwrap();
    alloc.free(0, a).unwrap();
    // The cached half does not fit beside another half: released, then
    // retried (expandable segments move its pages before growing past
    // their high-water mark, so there is nothing to retry).
    let b = alloc.allocate(0, (half + 4 * MIB) as usize, Stream::DEFAULT).unwrap();
    let s = alloc.stats(0).unwrap();
    if alloc.device(0).unwrap().is_expandable() {
        // Each of the allocations `a` was mapped in moved or went back.
        assert_eq!(s.events.num_alloc_retries, 0);
        assert!(s.events.num_device_free >= 1, "{:?}", s.events);
    } else {
        assert_eq!((s.events.num_alloc_retries, s.events.num_device_free), (1, 1));
    }
    // More than the device: a clear out-of-memory, nothing leaked.
    let err = alloc.allocate(0, capacity as usize, Stream::DEFAULT).unwrap_err();
    assert!(matches!(err, AllocError::OutOfMemory(_)), "{err:?}");
    alloc.free(0, b).unwrap();
    alloc.free(0, c).unwrap();
    alloc.validate().unwrap();
}

fn empty_cache_gives_everything_back(alloc: &Allocator) {
    let before = alloc.backend().mem_info(0).unwrap().free;
    let p = alloc.allocate(0, (8 * MIB) as usize, Stream::DEFAULT).unwrap();
    alloc.free(0, p).unwrap();
    assert!(alloc.stats(0).unwrap().reserved_bytes.all.current >= 8 * MIB, "the freed block stays cached");
    alloc.empty_cache();
    assert_eq!(alloc.stats(0).unwrap().reserved_bytes.all.current, 0);
    // A real driver's free figure moves with everything else on the GPU.
    if std::env::var_os("TIDEPOOL_TEST_DEVICE_MEMORY").is_none() {
        assert_eq!(alloc.backend().mem_info(0).unwrap().free, before);
    }
}
