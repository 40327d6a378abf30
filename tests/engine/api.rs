//! The engine's behaviour through the public API, on the host backend.

use crate::common;

use common::{host_allocator, KIB, MIB};
use tidepool::backend::host::FaultKind;
use tidepool::backend::Backend;
use tidepool::{AllocError, DevicePtr, InvalidFree, Stream};

const S0: Stream = Stream::DEFAULT;

#[test]
fn small_requests_are_rounded_to_512_bytes_and_carved_from_one_2_mib_segment() {
    let (alloc, _) = host_allocator(1, 1 << 30, "");
    let a = alloc.allocate(0, 1000, S0).unwrap();
    let b = alloc.allocate(0, 1, S0).unwrap();
    assert_eq!(b.0, a.0 + 1024, "the second block follows the first in the same segment");
    let s = alloc.stats(0).unwrap();
    assert_eq!(s.reserved_bytes.small_pool.current, 2 * MIB);
    assert_eq!(s.allocated_bytes.all.current, 1024 + 512);
    assert_eq!(s.requested_bytes.all.current, 1001);
    assert_eq!(s.events.num_device_alloc, 1);
    assert_eq!(s.inactive_split_bytes.all.current, 2 * MIB - 1536);
    alloc.validate().unwrap();
}

#[test]
fn dropping_the_allocator_gives_its_cached_memory_back_and_keeps_live_blocks() {
    for conf in ["", "expandable:true"] {
        for keep_one in [false, true] {
            let (alloc, backend) = host_allocator(1, 1 << 30, conf);
            let kept = keep_one.then(|| alloc.allocate(0, 4 * MIB as usize, S0).unwrap());
            kept.inspect(|&p| common::fill(p, 4 * MIB, 7));
            for size in [512, 3 * MIB, 64 * MIB] {
                let p = alloc.allocate(0, size as usize, S0).unwrap();
                alloc.free(0, p).unwrap();
            }
            assert!(common::reserved(&alloc) >= 64 * MIB, "{conf:?}: memory is cached before the drop");
            drop(alloc);
            let free = backend.mem_info(0).unwrap().free;
            match kept {
                None => assert_eq!(free, 1 << 30, "{conf:?}: every cached byte went back"),
                Some(p) => {
                    assert!(free < 1 << 30 && free > (1 << 30) - 64 * MIB, "{conf:?}: only the live block's memory stays");
                    assert_eq!(common::check(p, 4 * MIB, 7), Ok(()), "{conf:?}: the live block is intact");
                }
            }
        }
    }
}

#[test]
fn a_freed_block_is_reused_by_the_next_request_that_fits_without_a_driver_call() {
    let (alloc, backend) = host_allocator(1, 1 << 30, "");
    let a = alloc.allocate(0, 300 * KIB as usize, S0).unwrap();
    alloc.free(0, a).unwrap();
    let calls = backend.allocate_calls();
    for _ in 0..100 {
        let b = alloc.allocate(0, 300 * KIB as usize, S0).unwrap();
        assert_eq!(b, a);
        alloc.free(0, b).unwrap();
    }
    assert_eq!(backend.allocate_calls(), calls);
    alloc.validate().unwrap();
}

#[test]
fn blocks_freed_on_one_stream_are_not_reused_by_another_stream() {
    let (alloc, _) = host_allocator(1, 1 << 30, "");
    let a = alloc.allocate(0, 4096, Stream(7)).unwrap();
    alloc.free(0, a).unwrap();
    let b = alloc.allocate(0, 4096, Stream(8)).unwrap();
    let s = alloc.stats(0).unwrap();
    assert_eq!(s.events.num_device_alloc, 2, "stream 8 must not take stream 7's cached segment");
    assert_ne!(alloc.segment_of(0, a).unwrap(), alloc.segment_of(0, b).unwrap());
    let c = alloc.allocate(0, 4096, Stream(7)).unwrap();
    assert_eq!(c, a, "stream 7 reuses its own block");
    alloc.validate().unwrap();
}

#[test]
fn freeing_merges_neighbours_until_the_segment_is_whole_and_releasable() {
    let (alloc, _) = host_allocator(1, 1 << 30, "");
    let blocks: Vec<_> = (0..3).map(|_| alloc.allocate(0, 100 * KIB as usize, S0).unwrap()).collect();
    alloc.free(0, blocks[1]).unwrap();
    let s = alloc.stats(0).unwrap();
    assert_eq!(s.inactive_split.all.current, 2, "the hole in the middle and the tail");
    alloc.free(0, blocks[0]).unwrap();
    alloc.validate().unwrap();
    assert_eq!(alloc.stats(0).unwrap().inactive_split.all.current, 2, "first two merged, tail separate");
    alloc.free(0, blocks[2]).unwrap();
    let s = alloc.stats(0).unwrap();
    assert_eq!(s.inactive_split.all.current, 0);
    assert_eq!(s.largest_free_block_bytes, 2 * MIB);
    assert_eq!(s.fragmentation(), 0.0, "a whole free segment is releasable, not fragmented");
    let released = alloc.empty_cache();
    assert_eq!((released.segments, released.bytes), (1, 2 * MIB));
    assert_eq!(alloc.stats(0).unwrap().reserved_bytes.all.current, 0);
    alloc.validate().unwrap();
}

#[test]
fn holes_in_partly_used_segments_show_as_inactive_split_and_fragmentation() {
    let (alloc, _) = host_allocator(1, 1 << 30, "");
    let blocks: Vec<_> = (0..8).map(|_| alloc.allocate(0, 256 * KIB as usize, S0).unwrap()).collect();
    for b in blocks.iter().step_by(2) {
        alloc.free(0, *b).unwrap();
    }
    let s = alloc.stats(0).unwrap();
    assert_eq!(s.inactive_split_bytes.all.current, 4 * 256 * KIB);
    assert_eq!(s.largest_free_block_bytes, 256 * KIB);
    assert_eq!(s.reserved_bytes.all.current, 2 * MIB);
    assert!((s.fragmentation() - 0.5).abs() < 1e-9, "{}", s.fragmentation());
    alloc.validate().unwrap();
}

/// The case the old definition (1 - largest free block / cached free) got
/// wrong: an idle process whose cache is whole free segments of several
/// sizes read as 90 % fragmented, though every byte of it can go back at once.
#[test]
fn an_idle_process_holding_only_whole_free_segments_is_not_fragmented() {
    let (alloc, _) = host_allocator(1, 1 << 30, "expandable:false");
    let sizes = [2 * MIB, 12 * MIB, 22 * MIB, 40 * MIB];
    let blocks: Vec<_> = sizes.iter().map(|&size| alloc.allocate(0, size as usize, S0).unwrap()).collect();
    for b in blocks {
        alloc.free(0, b).unwrap();
    }
    let s = alloc.stats(0).unwrap();
    assert!(s.cached_free_bytes > 2 * s.largest_free_block_bytes, "the cache is several segments");
    assert_eq!(s.inactive_split_bytes.all.current, 0);
    assert_eq!(s.fragmentation(), 0.0);
    // And every cached byte goes back at once.
    alloc.empty_cache();
    assert_eq!(alloc.stats(0).unwrap().reserved_bytes.all.current, 0);
}

#[test]
fn large_requests_share_20_mib_segments_below_10_mib_and_get_their_own_above() {
    let (alloc, _) = host_allocator(1, 1 << 30, "expandable:false");
    let a = alloc.allocate(0, (3 * MIB) as usize, S0).unwrap();
    let b = alloc.allocate(0, (3 * MIB) as usize, S0).unwrap();
    assert_eq!(alloc.segment_of(0, a).unwrap(), alloc.segment_of(0, b).unwrap());
    assert_eq!(alloc.segment_of(0, a).unwrap().unwrap().1, 20 * MIB);
    // 15 MiB does not fit the 14 MiB left: its own segment, rounded to 16 MiB.
    let c = alloc.allocate(0, (15 * MIB - 100) as usize, S0).unwrap();
    assert_eq!(alloc.segment_of(0, c).unwrap().unwrap(), (c, 16 * MIB));
    let s = alloc.stats(0).unwrap();
    assert_eq!(s.reserved_bytes.large_pool.current, 36 * MIB);
    assert_eq!(s.allocated_bytes.large_pool.current, 6 * MIB + 16 * MIB, "a 1 MiB remainder is not split off");
    alloc.validate().unwrap();
}

#[test]
fn max_split_size_keeps_big_cached_blocks_whole() {
    let (alloc, _) = host_allocator(1, 1 << 30, "expandable:false,max_split_size_mb:32");
    let big = alloc.allocate(0, (64 * MIB) as usize, S0).unwrap();
    alloc.free(0, big).unwrap();
    // A 12 MiB request would split the cached 64 MiB block without the option.
    let small = alloc.allocate(0, (12 * MIB) as usize, S0).unwrap();
    assert_ne!(alloc.segment_of(0, small).unwrap().unwrap().0, big);
    // A 50 MiB request may take the 64 MiB block whole (within 20 MiB), unsplit.
    let again = alloc.allocate(0, (50 * MIB) as usize, S0).unwrap();
    assert_eq!(again, big);
    assert_eq!(alloc.stats(0).unwrap().allocated_bytes.all.current, 12 * MIB + 64 * MIB);
    alloc.validate().unwrap();
}

#[test]
fn a_refused_growth_releases_the_cache_and_retries_once() {
    let (alloc, backend) = host_allocator(1, 64 * MIB, "expandable:false");
    let a = alloc.allocate(0, (40 * MIB) as usize, S0).unwrap();
    alloc.free(0, a).unwrap();
    // 50 MiB does not fit next to the cached 40 MiB segment: release it, retry.
    let b = alloc.allocate(0, (50 * MIB) as usize, S0).unwrap();
    let s = alloc.stats(0).unwrap();
    assert_eq!((s.events.num_alloc_retries, s.events.num_ooms, s.events.num_device_free), (1, 0, 1));
    assert_eq!(s.reserved_bytes.all.current, 50 * MIB);
    assert_eq!(backend.mem_info(0).unwrap().free, 14 * MIB);
    alloc.free(0, b).unwrap();
    alloc.validate().unwrap();
}

#[test]
fn out_of_memory_reports_the_figures_and_leaks_nothing() {
    let (alloc, backend) = host_allocator(1, 64 * MIB, "");
    let live = alloc.allocate(0, (30 * MIB) as usize, S0).unwrap();
    let small = alloc.allocate(0, 4096, S0).unwrap();
    let before = alloc.stats(0).unwrap();
    let err = alloc.allocate(0, (40 * MIB) as usize, S0).unwrap_err();
    let AllocError::OutOfMemory(report) = &err else { panic!("expected OutOfMemory, got {err:?}") };
    assert_eq!(report.requested, 40 * MIB);
    assert_eq!(report.allocated, 30 * MIB + 4096);
    assert_eq!(report.reserved, 32 * MIB);
    assert_eq!(report.device_total, Some(64 * MIB));
    let text = err.to_string();
    assert!(text.contains("out of memory") && text.contains("batch size"), "{text}");
    let after = alloc.stats(0).unwrap();
    assert_eq!(after.events.num_ooms, 1);
    assert_eq!(after.reserved_bytes.all.current, before.reserved_bytes.all.current);
    assert_eq!(backend.mem_info(0).unwrap().free, 32 * MIB);
    alloc.free(0, live).unwrap();
    alloc.free(0, small).unwrap();
    alloc.empty_cache();
    assert_eq!(backend.mem_info(0).unwrap().free, 64 * MIB);
    alloc.validate().unwrap();
}

#[test]
fn a_request_larger_than_the_device_is_out_of_memory_with_nothing_leaked() {
    let (alloc, backend) = host_allocator(1, 64 * MIB, "");
    let err = alloc.allocate(0, (1u64 << 40) as usize, S0).unwrap_err();
    assert!(matches!(err, AllocError::OutOfMemory(_)), "{err:?}");
    assert_eq!(backend.mem_info(0).unwrap().free, 64 * MIB);
    assert_eq!(alloc.stats(0).unwrap().reserved_bytes.all.current, 0);
    alloc.validate().unwrap();
}

#[test]
fn an_injected_refusal_is_absorbed_by_the_retry() {
    let (alloc, backend) = host_allocator(1, 1 << 30, "");
    backend.faults().fail_nth_allocate(1);
    alloc.allocate(0, 4096, S0).unwrap();
    assert_eq!(alloc.stats(0).unwrap().events.num_alloc_retries, 1);
    alloc.validate().unwrap();
}

#[test]
fn a_driver_error_is_returned_with_its_call_and_changes_nothing() {
    let (alloc, backend) = host_allocator(1, 1 << 30, "");
    backend.faults().set_kind(FaultKind::DriverError);
    backend.faults().fail_nth_allocate(1);
    let err = alloc.allocate(0, 4096, S0).unwrap_err();
    assert!(matches!(err, AllocError::Backend(_)), "{err:?}");
    assert!(err.to_string().contains("mmap failed"), "{err}");
    let s = alloc.stats(0).unwrap();
    assert_eq!((s.reserved_bytes.all.current, s.num_allocs, s.events.num_ooms), (0, 0, 0));
    alloc.validate().unwrap();
}

#[test]
fn a_failed_release_leaves_the_segment_cached_and_consistent() {
    let (alloc, backend) = host_allocator(1, 1 << 30, "");
    let a = alloc.allocate(0, 4096, S0).unwrap();
    alloc.free(0, a).unwrap();
    backend.faults().fail_nth_release(1);
    assert_eq!(alloc.empty_cache().segments, 0);
    assert_eq!(alloc.stats(0).unwrap().reserved_bytes.all.current, 2 * MIB);
    alloc.validate().unwrap();
    assert_eq!(alloc.empty_cache().segments, 1);
    alloc.validate().unwrap();
}

#[test]
fn empty_cache_releases_only_whole_free_segments() {
    let (alloc, _) = host_allocator(1, 1 << 30, "");
    let pinned = alloc.allocate(0, 512, S0).unwrap();
    let big = alloc.allocate(0, (30 * MIB) as usize, S0).unwrap();
    alloc.free(0, big).unwrap();
    let released = alloc.empty_cache();
    assert_eq!((released.segments, released.bytes), (1, 30 * MIB));
    assert_eq!(alloc.stats(0).unwrap().reserved_bytes.all.current, 2 * MIB, "the pinned segment stays");
    alloc.free(0, pinned).unwrap();
    alloc.validate().unwrap();
}

#[test]
fn freeing_a_foreign_pointer_is_an_error_that_changes_nothing() {
    let (alloc, _) = host_allocator(1, 1 << 30, "");
    let a = alloc.allocate(0, 4096, S0).unwrap();
    let before = alloc.stats(0).unwrap();
    let err = alloc.free(0, DevicePtr(0xdead_0000)).unwrap_err();
    assert_eq!(err, AllocError::InvalidFree { ptr: 0xdead_0000, reason: InvalidFree::Foreign });
    let after = alloc.stats(0).unwrap();
    assert_eq!(after.events.num_invalid_frees, 1);
    assert_eq!(after.allocated_bytes, before.allocated_bytes);
    alloc.free(0, a).unwrap();
    alloc.validate().unwrap();
}

#[test]
fn a_double_free_is_an_error_that_changes_nothing() {
    let (alloc, _) = host_allocator(1, 1 << 30, "");
    let a = alloc.allocate(0, 4096, S0).unwrap();
    let keep = alloc.allocate(0, 4096, S0).unwrap();
    alloc.free(0, a).unwrap();
    let before = alloc.stats(0).unwrap();
    let err = alloc.free(0, a).unwrap_err();
    assert_eq!(err, AllocError::InvalidFree { ptr: a.0, reason: InvalidFree::NotLive });
    assert!(err.to_string().contains("double free"));
    let after = alloc.stats(0).unwrap();
    assert_eq!(after.events.num_invalid_frees, 1);
    assert_eq!((after.num_frees, after.allocated_bytes), (before.num_frees, before.allocated_bytes));
    alloc.free(0, keep).unwrap();
    alloc.validate().unwrap();
}

#[test]
fn freeing_a_pointer_inside_a_live_block_is_refused() {
    let (alloc, _) = host_allocator(1, 1 << 30, "");
    let a = alloc.allocate(0, 4096, S0).unwrap();
    let err = alloc.free(0, DevicePtr(a.0 + 512)).unwrap_err();
    assert_eq!(err, AllocError::InvalidFree { ptr: a.0 + 512, reason: InvalidFree::Interior { block: a.0 } });
    alloc.free(0, a).unwrap();
    alloc.validate().unwrap();
}

#[test]
fn a_zero_byte_request_returns_null_without_error() {
    let (alloc, _) = host_allocator(1, 1 << 30, "");
    assert_eq!(alloc.allocate(0, 0, S0), Ok(DevicePtr::NULL));
    assert_eq!(alloc.free(0, DevicePtr::NULL), Ok(()));
    let s = alloc.stats(0).unwrap();
    assert_eq!((s.num_allocs, s.reserved_bytes.all.current), (0, 0));
}

#[test]
fn sizes_near_usize_max_are_too_large_without_overflow() {
    for conf in ["roundup_power2_divisions:8", "expandable:true"] {
        let (alloc, backend) = host_allocator(1, 1 << 30, conf);
        for size in [usize::MAX, usize::MAX - 511, usize::MAX / 2 + 1, (1usize << 63) + 12345, 1 << 41] {
            let err = alloc.allocate(0, size, S0).unwrap_err();
            assert!(matches!(err, AllocError::TooLarge { .. } | AllocError::OutOfMemory(_)), "{conf}: size {size}: {err:?}");
        }
        assert!(matches!(alloc.allocate(0, usize::MAX, S0), Err(AllocError::TooLarge { .. })));
        assert_eq!(backend.mem_info(0).unwrap().free, 1 << 30);
        alloc.validate().unwrap();
    }
}

#[test]
fn a_device_out_of_range_is_an_error() {
    let (alloc, _) = host_allocator(2, 1 << 30, "");
    let err = alloc.allocate(2, 512, S0).unwrap_err();
    assert_eq!(err, AllocError::InvalidDevice { device: 2, device_count: 2 });
    assert!(alloc.free(5, DevicePtr(0x1000)).is_err());
    assert!(alloc.stats(9).is_err());
    let on_one = alloc.allocate(1, 512, S0).unwrap();
    assert!(alloc.free(0, on_one).is_err(), "a pointer of device 1 is foreign to device 0");
    alloc.free(1, on_one).unwrap();
}

#[test]
fn a_wrong_size_at_free_is_counted_and_the_recorded_size_used() {
    let (alloc, _) = host_allocator(1, 1 << 30, "");
    let a = alloc.allocate(0, 3000, S0).unwrap();
    assert_eq!(alloc.free_sized(0, a, 12, S0).unwrap(), 3000);
    let s = alloc.stats(0).unwrap();
    assert_eq!((s.events.num_size_mismatches, s.allocated_bytes.all.current), (1, 0));
}

#[test]
fn peaks_track_the_high_water_mark_until_reset() {
    let (alloc, _) = host_allocator(1, 1 << 30, "");
    let a = alloc.allocate(0, (8 * MIB) as usize, S0).unwrap();
    alloc.free(0, a).unwrap();
    let s = alloc.stats(0).unwrap();
    assert_eq!((s.allocated_bytes.all.peak, s.allocated_bytes.all.current), (8 * MIB, 0));
    alloc.reset_peak_stats(0).unwrap();
    assert_eq!(alloc.stats(0).unwrap().allocated_bytes.all.peak, 0);
}

#[test]
fn resetting_peaks_makes_each_peak_the_current_value() {
    let (alloc, _) = host_allocator(1, 1 << 30, "");
    let keep = alloc.allocate(0, 4096, S0).unwrap();
    let big = alloc.allocate(0, (30 * MIB) as usize, S0).unwrap();
    alloc.free(0, big).unwrap();
    alloc.empty_cache();
    let before = alloc.stats(0).unwrap();
    assert!(before.allocated_bytes.all.peak > before.allocated_bytes.all.current);
    alloc.reset_peak_stats(0).unwrap();
    let s = alloc.stats(0).unwrap();
    for (name, gauge) in s.gauges() {
        for stat in [&gauge.all, &gauge.small_pool, &gauge.large_pool] {
            assert_eq!(stat.peak, stat.current, "{name}");
        }
    }
    assert_eq!((s.allocated_bytes.all.peak, s.reserved_bytes.all.peak), (4096, 2 * MIB));
    assert_eq!(s.allocated_bytes.all.allocated, before.allocated_bytes.all.allocated, "sums stay");
    alloc.free(0, keep).unwrap();
    alloc.validate().unwrap();
}

#[test]
fn resetting_accumulated_stats_zeroes_the_sums_and_counters_and_keeps_current_values() {
    let (alloc, _) = host_allocator(1, 64 * MIB, "");
    let keep = alloc.allocate(0, 4096, S0).unwrap();
    let big = alloc.allocate(0, (30 * MIB) as usize, S0).unwrap();
    alloc.free(0, big).unwrap();
    assert!(alloc.allocate(0, (100 * MIB) as usize, S0).is_err());
    let before = alloc.stats(0).unwrap();
    assert_eq!((before.events.num_ooms, before.events.num_alloc_retries), (1, 1));
    assert!(before.events.num_device_alloc > 0 && before.events.num_device_free > 0);
    alloc.reset_accumulated_stats(0).unwrap();
    let s = alloc.stats(0).unwrap();
    for (name, gauge) in s.gauges() {
        for stat in [&gauge.all, &gauge.small_pool, &gauge.large_pool] {
            assert_eq!((stat.allocated, stat.freed), (0, 0), "{name}");
        }
    }
    assert_eq!(s.events, tidepool::Events::default());
    assert_eq!((s.num_allocs, s.num_frees), (0, 0));
    assert_eq!((s.allocated_bytes.all.current, s.reserved_bytes.all.current), (4096, 2 * MIB), "current values stay");
    assert_eq!(s.allocated_bytes.all.peak, before.allocated_bytes.all.peak, "peaks stay");
    // Counting goes on from zero.
    alloc.free(0, keep).unwrap();
    let s = alloc.stats(0).unwrap();
    assert_eq!((s.num_frees, s.allocated_bytes.all.freed, s.allocated_bytes.all.allocated), (1, 4096, 0));
    assert!(alloc.reset_accumulated_stats(3).is_err() && alloc.reset_peak_stats(3).is_err(), "no device 3");
    alloc.validate().unwrap();
}

#[test]
fn a_memory_fraction_caps_what_the_heap_reserves() {
    let (alloc, _) = host_allocator(1, 100 * MIB, "expandable:false");
    let a = alloc.allocate(0, (40 * MIB) as usize, S0).unwrap();
    alloc.free(0, a).unwrap();
    alloc.set_memory_fraction(0, 0.5).unwrap();
    // 40 MiB cached + 46 MiB would pass the 50 MiB cap: the cache goes first.
    let b = alloc.allocate(0, (45 * MIB) as usize, S0).unwrap();
    let s = alloc.stats(0).unwrap();
    assert_eq!((s.reserved_bytes.all.current, s.events.num_alloc_retries), (46 * MIB, 1));
    // Live memory itself over the cap: out of memory, and the report says why.
    let err = alloc.allocate(0, (30 * MIB) as usize, S0).unwrap_err();
    let AllocError::OutOfMemory(report) = &err else { panic!("{err:?}") };
    assert_eq!((report.reserved_limit, report.limit_is_budget), (Some(50 * MIB), false));
    assert!(err.to_string().contains("memory fraction"), "{err}");
    alloc.set_memory_fraction(0, 1.0).unwrap();
    let c = alloc.allocate(0, (30 * MIB) as usize, S0).unwrap();
    alloc.free(0, b).unwrap();
    alloc.free(0, c).unwrap();
    alloc.validate().unwrap();
}

#[test]
fn a_memory_fraction_outside_zero_to_one_is_refused() {
    let (alloc, _) = host_allocator(1, 100 * MIB, "");
    for bad in [-0.1, 1.5, f64::NAN, f64::INFINITY] {
        assert!(matches!(alloc.set_memory_fraction(0, bad), Err(AllocError::InvalidArgument(_))), "{bad}");
    }
    assert!(matches!(alloc.set_memory_fraction(3, 0.5), Err(AllocError::InvalidDevice { .. })));
}

#[test]
fn record_stream_needs_a_live_block_and_is_forgotten_at_free() {
    let (alloc, _) = host_allocator(2, 1 << 30, "");
    // NULL (an empty tensor's storage, which PyTorch passes on) holds no
    // block: nothing to note, before the first allocation and after.
    assert_eq!(alloc.record_stream(DevicePtr(0), Stream(9)), Ok(()));
    let a = alloc.allocate(1, 4096, Stream(5)).unwrap();
    assert_eq!(alloc.record_stream(DevicePtr(0), Stream(9)), Ok(()));
    assert!(alloc.device(1).unwrap().recorded_streams(DevicePtr(0)).is_empty());
    alloc.record_stream(a, Stream(9)).unwrap();
    alloc.record_stream(a, Stream(9)).unwrap();
    alloc.record_stream(a, Stream(5)).unwrap(); // its own stream: nothing to record
    assert_eq!(alloc.device(1).unwrap().recorded_streams(a), vec![Stream(9)]);
    alloc.free(1, a).unwrap();
    assert!(alloc.device(1).unwrap().recorded_streams(a).is_empty());
    assert_eq!(alloc.record_stream(a, Stream(9)), Err(AllocError::UnknownPointer { ptr: a.0 }));
    assert_eq!(alloc.record_stream(DevicePtr(0x40), Stream(9)), Err(AllocError::UnknownPointer { ptr: 0x40 }));
}

#[test]
fn find_segment_names_the_device_base_and_size() {
    let (alloc, _) = host_allocator(2, 1 << 30, "");
    let a = alloc.allocate(1, 4096, S0).unwrap();
    let b = alloc.allocate(1, 4096, S0).unwrap();
    assert_eq!(alloc.find_segment(DevicePtr(b.0 + 100)), Some((1, a, 2 * MIB)));
    assert_eq!(alloc.find_segment(DevicePtr(0x40)), None);
}

#[test]
fn a_snapshot_lists_segments_with_their_blocks_in_address_order() {
    let (alloc, _) = host_allocator(1, 1 << 30, "");
    let a = alloc.allocate(0, 1000, Stream(3)).unwrap();
    let b = alloc.allocate(0, 2048, Stream(3)).unwrap();
    alloc.free(0, a).unwrap();
    let snapshot = alloc.snapshot(0).unwrap();
    assert_eq!(snapshot.len(), 1);
    let segment = &snapshot[0];
    assert_eq!((segment.address, segment.size, segment.stream), (a.0, 2 * MIB, Stream(3)));
    let blocks: Vec<_> = segment.blocks.iter().map(|b| (b.address, b.size, b.requested, b.allocated)).collect();
    assert_eq!(blocks, vec![(a.0, 1024, 0, false), (b.0, 2048, 2048, true), (b.0 + 2048, 2 * MIB - 3072, 0, false)]);
}

#[test]
fn a_full_device_lends_another_streams_cached_block_instead_of_failing() {
    let (alloc, _) = host_allocator(1, 64 * MIB, "expandable:false");
    let a = alloc.allocate(0, (40 * MIB) as usize, Stream(1)).unwrap();
    alloc.free(0, a).unwrap();
    // 40 MiB cached for stream 1 + 30 MiB new would not fit: stream 2 borrows.
    let b = alloc.allocate(0, (30 * MIB) as usize, Stream(2)).unwrap();
    assert_eq!(b, a, "carved from stream 1's cached segment");
    let s = alloc.stats(0).unwrap();
    assert_eq!((s.events.num_cross_stream_reuses, s.events.num_device_alloc, s.events.num_device_free), (1, 1, 0));
    alloc.free(0, b).unwrap();
    // Back in stream 1's pool, whole again.
    assert_eq!(alloc.allocate(0, (40 * MIB) as usize, Stream(1)).unwrap(), a);
    alloc.validate().unwrap();
}

#[test]
fn lending_across_streams_can_be_turned_off() {
    let (alloc, _) = host_allocator(1, 64 * MIB, "expandable:false,lend_across_streams:false");
    let a = alloc.allocate(0, (40 * MIB) as usize, Stream(1)).unwrap();
    alloc.free(0, a).unwrap();
    // No lending: stream 1's cache is released and stream 2 grows instead.
    alloc.allocate(0, (30 * MIB) as usize, Stream(2)).unwrap();
    let s = alloc.stats(0).unwrap();
    assert_eq!((s.events.num_cross_stream_reuses, s.events.num_device_free, s.events.num_alloc_retries), (0, 1, 1));
}

/// The child side: reads TIDEPOOL_CONF as every allocator does, 1,000 times.
#[test]
#[ignore = "child process: run by a_bad_configuration_warns_once_and_at_most_about_twenty_lines"]
fn child_reads_the_configuration_a_thousand_times() {
    common::child_only();
    for _ in 0..1000 {
        let _ = tidepool::Config::from_env();
    }
    println!("child: read");
}

#[test]
fn a_bad_configuration_warns_once_and_at_most_about_twenty_lines() {
    let warnings = |conf: &str| {
        let mut command = common::child_command("child_reads_the_configuration_a_thousand_times");
        let (ok, text) = common::child_output(command.env("TIDEPOOL_CONF", conf));
        assert!(ok, "{text}");
        text.lines().filter(|l| l.starts_with("tidepool: warning: TIDEPOOL_CONF:")).map(str::to_string).collect::<Vec<_>>()
    };
    // One typo, read a thousand times: one line.
    assert_eq!(
        warnings("colour:blue,expandable:true"),
        ["tidepool: warning: TIDEPOOL_CONF: ignoring \"colour:blue\": unknown option \"colour\"; run `tidepool config` for the list"]
    );
    // 10 KB of unknown keys: twenty lines and one that counts the rest.
    let junk: Vec<String> = (0..1000).map(|i| format!("junk_key_{i}:1")).collect();
    let junk = junk.join(",");
    assert!(junk.len() >= 10_000);
    let lines = warnings(&junk);
    assert_eq!(lines.len(), 21, "{lines:?}");
    assert_eq!(lines[20], "tidepool: warning: TIDEPOOL_CONF: and 980 more");
}
