//! Expandable segments (`expandable:true`, the default) on the host backend:
//! blocks pack across what would be segment boundaries, pages inside free
//! holes go back to the driver while live blocks sit on both sides, a map
//! failing midway leaves the heap consistent, a request lands where pages
//! are mapped when it can, a heap with room grows and moves nothing, one
//! that cannot grow (a full device, a cap) moves the pages of its holes to
//! where the growth needs them, and the release policies reach holes.

use crate::common;

use std::sync::Arc;

use common::{check, fill, host_allocator, reserved, MIB};
use tidepool::backend::host::{FaultKind, HostBackend};
use tidepool::backend::Backend;
use tidepool::heap::reserve::Reserve;
use tidepool::heap::DeviceHeap;
use tidepool::reclaim::policy::{Policy as Release, Reason};
use tidepool::reclaim::Clock;
use tidepool::{AllocError, Allocator, Config, DevicePtr, Stream};

const S: Stream = Stream::DEFAULT;
const S2: Stream = Stream(2);

/// Expandable segments whose physical allocations are one page each: the
/// finest grain pages move and go back at (the tests of moving pages
/// count them one by one).
const PAGE_BY_PAGE: &str = "expandable:true,expandable_allocation_mb:2";

fn alloc(a: &Allocator, size: u64) -> DevicePtr {
    a.allocate(0, size as usize, S).unwrap()
}

#[test]
fn blocks_pack_across_segment_boundaries() {
    // Three 11 MiB blocks: a segment each (rounded to 12 MiB) without
    // expandable segments, 33 MiB of pages (34 MiB at 2 MiB) with them.
    for (conf, expected) in [("expandable:false", 36 * MIB), ("expandable:true", 34 * MIB)] {
        let (a, _) = host_allocator(1, 1 << 30, conf);
        let ptrs: Vec<_> = (0..3).map(|_| alloc(&a, 11 * MIB)).collect();
        assert_eq!(reserved(&a), expected, "{conf:?}");
        if conf == "expandable:true" {
            assert_eq!(ptrs[1].0 - ptrs[0].0, 11 * MIB, "adjacent in one range");
        }
        a.validate().unwrap();
    }
}

#[test]
fn a_hole_between_live_blocks_gives_its_pages_back_and_its_address_space_is_reused() {
    let (a, backend) = host_allocator(1, 1 << 30, "expandable:true");
    let left = alloc(&a, 4 * MIB);
    let hole = alloc(&a, 64 * MIB);
    let right = alloc(&a, 4 * MIB);
    fill(left, 4 * MIB, 1);
    fill(right, 4 * MIB, 3);
    assert_eq!(reserved(&a), 72 * MIB);
    a.free(0, hole).unwrap();
    assert_eq!(reserved(&a), 72 * MIB, "freeing alone keeps the pages cached");
    a.empty_cache();
    let stats = a.stats(0).unwrap();
    assert_eq!(stats.reserved_bytes.all.current, 8 * MIB, "the hole's 32 pages went back");
    assert_eq!(stats.events.num_pages_unmapped, 32);
    assert_eq!(backend.mem_info(0).unwrap().free, (1 << 30) - 8 * MIB);
    assert_eq!((check(left, 4 * MIB, 1), check(right, 4 * MIB, 3)), (Ok(()), Ok(())), "neighbours intact");
    a.validate().unwrap();
    // The snapshot shows the two mapped runs, as PyTorch shows its own expandable segments.
    let snapshot = a.snapshot(0).unwrap();
    let runs: Vec<_> = snapshot.iter().map(|s| (s.address, s.size, s.expandable, s.blocks.len())).collect();
    assert_eq!(runs, [(left.0, 4 * MIB, true, 1), (right.0, 4 * MIB, true, 1)]);

    let again = alloc(&a, 64 * MIB);
    assert_eq!(again, hole, "the hole's address space serves the next block");
    fill(again, 64 * MIB, 2);
    assert_eq!(reserved(&a), 72 * MIB);
    a.validate().unwrap();
}

#[test]
fn release_unmaps_only_whole_pages_inside_free_blocks() {
    let (a, _) = host_allocator(1, 1 << 30, "expandable:true");
    // [1.5 MiB live][5 MiB free][1.5 MiB live]: of the free block, only the
    // pages lying entirely inside it (2-4 MiB, 4-6 MiB) can go.
    let first = alloc(&a, 3 * MIB / 2);
    let middle = alloc(&a, 5 * MIB);
    let last = alloc(&a, 3 * MIB / 2);
    a.free(0, middle).unwrap();
    a.empty_cache();
    let stats = a.stats(0).unwrap();
    assert_eq!(stats.reserved_bytes.all.current, 4 * MIB);
    assert_eq!(stats.inactive_split_bytes.all.current, MIB, "the free halves of the two edge pages");
    a.validate().unwrap();
    a.free(0, first).unwrap();
    a.free(0, last).unwrap();
    a.empty_cache();
    let stats = a.stats(0).unwrap();
    assert_eq!((stats.reserved_bytes.all.current, stats.segment.all.current), (0, 0), "an empty range goes back whole");
    a.validate().unwrap();
}

/// [A 4][B 8][C 1.5][D 8][E 4] MiB with B and D's inner pages unmapped and
/// C freed: one free block whose pages are unmapped, mapped (C's), unmapped.
fn block_over_two_unmapped_runs(a: &Allocator) -> u64 {
    let _left = alloc(a, 4 * MIB);
    let b = alloc(a, 8 * MIB);
    let c = alloc(a, 3 * MIB / 2);
    let d = alloc(a, 8 * MIB);
    let _right = alloc(a, 4 * MIB);
    a.free(0, b).unwrap();
    a.free(0, d).unwrap();
    a.empty_cache();
    a.free(0, c).unwrap();
    a.stats(0).unwrap(); // merges the stash: B, C and D become one block
    a.validate().unwrap();
    8 * MIB + 3 * MIB / 2 + 8 * MIB
}

#[test]
fn a_map_failing_midway_undoes_the_pages_it_mapped() {
    let (a, backend) = host_allocator(1, 1 << 30, "expandable:true");
    let size = block_over_two_unmapped_runs(&a);
    let before = (reserved(&a), backend.vm_calls());
    backend.faults().set_kind(FaultKind::DriverError);
    backend.faults().fail_nth_allocate(2);
    assert!(matches!(a.allocate(0, size as usize, S), Err(AllocError::Backend(_))));
    let after = backend.vm_calls();
    assert_eq!((after.0 - before.1 .0, after.1 - before.1 .1), (2, 1), "two runs tried, the first unmapped again");
    assert_eq!(reserved(&a), before.0, "nothing new is held");
    assert_eq!(backend.mem_info(0).unwrap().free, (1 << 30) - before.0, "nothing leaked in the driver");
    a.validate().unwrap();

    // Out of memory midway instead: release, retry, and the request is served.
    backend.faults().set_kind(FaultKind::OutOfMemory);
    backend.faults().fail_nth_allocate(2);
    let ptr = alloc(&a, size);
    fill(ptr, size, 9);
    assert_eq!(a.stats(0).unwrap().events.num_alloc_retries, 1);
    a.validate().unwrap();
}

#[test]
fn a_failed_unmap_keeps_the_page_mapped_and_counted() {
    let (a, backend) = host_allocator(1, 1 << 30, "expandable:true");
    // A one-page hole whose unmap fails: the page stays mapped and counted.
    let _left = alloc(&a, 4 * MIB);
    let hole = alloc(&a, 2 * MIB);
    let _right = alloc(&a, 4 * MIB);
    a.free(0, hole).unwrap();
    backend.faults().fail_nth_release(1);
    a.empty_cache();
    assert_eq!(reserved(&a), 10 * MIB);
    assert_eq!(backend.mem_info(0).unwrap().free, (1 << 30) - 10 * MIB);
    a.validate().unwrap();
    a.empty_cache();
    assert_eq!(reserved(&a), 8 * MIB);
    a.validate().unwrap();
}

#[test]
fn a_run_whose_unmap_fails_goes_back_page_by_page() {
    let (a, backend) = host_allocator(1, 1 << 30, PAGE_BY_PAGE);
    let _left = alloc(&a, 4 * MIB);
    let hole = alloc(&a, 16 * MIB);
    let _right = alloc(&a, 4 * MIB);
    a.free(0, hole).unwrap();
    let unmaps = backend.vm_calls().1;
    backend.faults().fail_nth_release(1);
    a.empty_cache();
    // The hole's eight pages form one run: its unmap failed, and each page
    // then went back on its own.
    assert_eq!(backend.vm_calls().1 - unmaps, 1 + 8);
    assert_eq!(reserved(&a), 8 * MIB);
    assert_eq!(backend.mem_info(0).unwrap().free, (1 << 30) - 8 * MIB);
    a.validate().unwrap();
}

#[test]
fn a_capacity_is_met_by_unmapping_holes_before_failing() {
    // 64 MiB device: after freeing the 40 MiB middle of [8][40][8], a 48 MiB
    // request fits once the hole's pages go back. With whole segments it
    // cannot: the 8 MiB blocks pin a 20 MiB segment, and 20 + 48 > 64.
    for (conf, fits) in [("expandable:true", true), ("expandable:false", false)] {
        let (a, _) = host_allocator(1, 64 * MIB, conf);
        let _left = alloc(&a, 8 * MIB);
        let hole = alloc(&a, 40 * MIB);
        let _right = alloc(&a, 8 * MIB);
        a.free(0, hole).unwrap();
        match a.allocate(0, 48 << 20, S) {
            Ok(big) => fill(big, 48 * MIB, 4),
            Err(err) => assert!(matches!(err, AllocError::OutOfMemory(_))),
        }
        let stats = a.stats(0).unwrap();
        assert_eq!(stats.events.num_ooms == 0, fits, "{conf:?}");
        assert!(stats.reserved_bytes.all.current <= 64 * MIB);
        a.validate().unwrap();
    }
}

#[test]
fn a_request_the_device_cannot_hold_fails_without_mapping_pages_first() {
    // 1 GiB device, 256 MiB live: requests of 2 GiB (more than the device)
    // and of 900 MiB (more than it has free, less than its size) fail with
    // the same figures as before, having asked the driver for no page
    // (mapping what the device had, then giving it all back, on every rung
    // of the out-of-memory ladder, was 773 calls each in allocations of
    // 8 MiB, 3,077 page by page). A request that fits is served after.
    for conf in ["", PAGE_BY_PAGE] {
        let (a, backend) = host_allocator(1, 1 << 30, conf);
        let live = alloc(&a, 256 * MIB);
        for size in [2u64 << 30, 900 * MIB] {
            let before = backend.device_driver_calls(0);
            let err = a.allocate(0, size as usize, S).unwrap_err();
            assert!(matches!(err, AllocError::OutOfMemory(_)), "{conf:?}: {err:?}");
            let after = backend.device_driver_calls(0);
            // (An address range may be reserved for it and given back: no memory.)
            assert_eq!(
                (after.create, after.map),
                (before.create, before.map),
                "{conf:?}: {size} B: pages made for a request that cannot fit"
            );
            assert!(after.total() - before.total() <= 3, "{conf:?}: {size} B: {before:?} then {after:?}");
        }
        let stats = a.stats(0).unwrap();
        assert_eq!((stats.events.num_ooms, stats.reserved_bytes.all.current), (2, 256 * MIB), "{conf:?}");
        let fits = alloc(&a, 700 * MIB);
        fill(fits, 700 * MIB, 3);
        a.free(0, fits).unwrap();
        a.free(0, live).unwrap();
        a.validate().unwrap();
    }
}

#[test]
fn a_steady_loop_maps_and_unmaps_nothing_after_its_first_step() {
    let (a, _) = host_allocator(1, 1 << 40, "expandable:true");
    let weights: Vec<_> = [30 * MIB, 7 * MIB, 300 * 1024, 12 * MIB].iter().map(|&s| alloc(&a, s)).collect();
    let mut after_first = None;
    // Sequence lengths vary every step; the first step is the longest.
    for (step, len) in [1024u64, 640, 896, 512, 1024, 768, 960, 576].into_iter().enumerate() {
        let mut activations: Vec<_> = (0..12).map(|layer| alloc(&a, len * (3 * 1024 + layer * 512))).collect();
        let grads: Vec<_> = weights.iter().map(|_| alloc(&a, 5 * MIB + len * 100)).collect();
        while let Some(ptr) = activations.pop() {
            a.free(0, ptr).unwrap();
        }
        for ptr in grads {
            a.free(0, ptr).unwrap();
        }
        let events = a.stats(0).unwrap().events;
        let counts = (events.num_pages_mapped, events.num_pages_unmapped);
        if step == 0 {
            assert!(counts.0 > 0 && counts.1 == 0);
            after_first = Some(counts);
        }
        assert_eq!(Some(counts), after_first, "step {step} mapped or unmapped pages");
    }
    a.validate().unwrap();
}

#[test]
fn a_backend_without_virtual_memory_keeps_whole_segments() {
    let (a, _) = host_allocator(1, 1 << 30, "expandable:true");
    assert!(a.device(0).unwrap().is_expandable());
    // A backend without virtual memory keeps whole segments.
    let mut heap = DeviceHeap::new(0, Default::default(), Arc::new(NoVm));
    let err = heap.set_expandable(true).unwrap_err();
    assert!(err.to_string().contains("cannot map pages"), "{err}");
    assert!(!heap.is_expandable());
}

/// A backend that only knows whole segments.
struct NoVm;

impl Backend for NoVm {
    fn name(&self) -> &'static str {
        "novm"
    }
    fn device_count(&self) -> usize {
        1
    }
    fn driver_calls_on(&self, _: usize) -> u64 {
        0 // no driver behind it
    }
    fn allocate(&self, _: usize, _: u64, _: Stream) -> Result<u64, tidepool::backend::BackendError> {
        Err(tidepool::backend::BackendError::OutOfMemory)
    }
    fn release(&self, _: usize, _: u64, _: u64, _: Stream) -> Result<(), tidepool::backend::BackendError> {
        Ok(())
    }
    fn mem_info(&self, _: usize) -> Result<tidepool::backend::MemInfo, tidepool::backend::BackendError> {
        Ok(tidepool::backend::MemInfo { free: 0, total: 0 })
    }
    fn shared_device_key(&self, _: usize) -> Option<String> {
        None
    }
}

/// A heap with expandable segments on the host backend whose idle pages
/// go back after 1 s of `clock`, with its shared reserved count.
fn heap_releasing_after_1_s() -> (DeviceHeap, Arc<Clock>, Arc<Reserve>) {
    let mut heap = DeviceHeap::new(0, Default::default(), Arc::new(HostBackend::new(1, 1 << 30)));
    let reserve = Arc::new(Reserve::default());
    heap.share_reserve(reserve.clone());
    heap.set_expandable(true).unwrap();
    let clock = Clock::new();
    let policy = Release { release_after_ms: 1_000, headroom: 0, headroom_min_idle_ms: 0, max_reserved: u64::MAX };
    heap.set_policy(policy, clock.clone());
    (heap, clock, reserve)
}

#[test]
fn the_release_policies_give_back_the_pages_of_holes_between_live_blocks() {
    let (mut heap, clock, reserve) = heap_releasing_after_1_s();
    let _left = heap.allocate(4 * MIB, S).unwrap();
    let old_hole = heap.allocate(16 * MIB, S).unwrap();
    let _middle = heap.allocate(4 * MIB, S).unwrap();
    let new_hole = heap.allocate(8 * MIB, S).unwrap();
    let _right = heap.allocate(4 * MIB, S).unwrap();
    clock.set(100);
    heap.free(old_hole).unwrap();
    heap.stats(); // merges the stash: the hole is idle from now
    clock.set(700);
    heap.free(new_hole).unwrap();
    heap.stats();

    // Idle decay: only the hole idle for 1 s goes, while live blocks sit on both sides.
    clock.set(1_050);
    assert_eq!(heap.reclaim().bytes, 0);
    clock.set(1_150);
    assert_eq!(heap.reclaim().bytes, 16 * MIB);
    let stats = heap.stats();
    assert_eq!(stats.released(Reason::IdleDecay).bytes, 16 * MIB);
    assert_eq!(stats.reserved_bytes.all.current, 20 * MIB);
    heap.validate().unwrap();

    // A budget below what is reserved: the other hole goes at once.
    reserve.set_limit(Some(16 * MIB));
    heap.release_over_budget();
    let stats = heap.stats();
    assert_eq!(stats.released(Reason::Budget).bytes, 8 * MIB);
    assert_eq!(stats.reserved_bytes.all.current, 12 * MIB);
    heap.validate().unwrap();
}

#[test]
fn a_stashed_block_taken_back_leaves_its_free_neighbour_as_idle_as_best_fit_would() {
    // [S 4][N 4][C 4] MiB: N is freed at 0 ms, S at 900 ms and taken back
    // at once. Without the stash S and N merge and split again: N's pages
    // are idle from 900 ms, so at 1,100 ms nothing is idle for a second.
    for stash in [true, false] {
        let (mut heap, clock, _) = heap_releasing_after_1_s();
        heap.set_stash(stash);
        let [s, n, _c] = [0; 3].map(|_| heap.allocate(4 * MIB, S).unwrap());
        heap.free(n).unwrap();
        heap.stats();
        clock.set(900);
        heap.free(s).unwrap();
        assert_eq!(heap.allocate(4 * MIB, S).unwrap(), s);
        clock.set(1_100);
        assert_eq!(heap.reclaim().bytes, 0, "stash {stash}");
        assert_eq!(heap.stats().reserved_bytes.all.current, 12 * MIB, "stash {stash}");
        heap.validate().unwrap();
    }
}

#[test]
fn a_pool_that_cannot_grow_takes_the_free_pages_of_another_pools_holes() {
    // A 72 MiB device, full: the large pool caches a 64 MiB hole.
    let (a, _) = host_allocator(1, 72 * MIB, PAGE_BY_PAGE);
    let left = alloc(&a, 4 * MIB);
    let hole = alloc(&a, 64 * MIB);
    let right = alloc(&a, 4 * MIB);
    fill(left, 4 * MIB, 1);
    a.free(0, hole).unwrap();
    // Now the small pool needs 20 MiB.
    let small: Vec<_> = (0..20).map(|_| alloc(&a, MIB)).collect();
    let stats = a.stats(0).unwrap();
    assert_eq!(stats.reserved_bytes.all.peak, 72 * MIB, "the peak did not rise");
    assert_eq!(stats.events.num_pages_unmapped, 10, "the hole gave a page for each 2 MiB small segment");
    assert_eq!(stats.reserved_bytes.all.current, 8 * MIB + 20 * MIB + 44 * MIB, "and caches the rest");
    assert_eq!((check(left, 4 * MIB, 1), stats.events.num_ooms), (Ok(()), 0));
    a.validate().unwrap();
    for p in small.into_iter().chain([left, right]) {
        a.free(0, p).unwrap();
    }
    a.validate().unwrap();
}

#[test]
fn a_heap_with_room_grows_and_its_holes_keep_their_pages() {
    // The same on a large device: nothing moves, the small pool's segments
    // are new memory and the hole stays mapped for the next step.
    let (a, backend) = host_allocator(1, 1 << 30, PAGE_BY_PAGE);
    let (_left, hole, _right) = (alloc(&a, 4 * MIB), alloc(&a, 64 * MIB), alloc(&a, 4 * MIB));
    a.free(0, hole).unwrap();
    let _small: Vec<_> = (0..20).map(|_| alloc(&a, MIB)).collect();
    let stats = a.stats(0).unwrap();
    assert_eq!((stats.events.num_pages_unmapped, backend.vm_moves()), (0, (0, 0)));
    assert_eq!(stats.reserved_bytes.all.current, 72 * MIB + 20 * MIB);
    // The hole's pages serve the next request of its size with no driver call.
    let calls = backend.driver_calls().total();
    assert_eq!(alloc(&a, 64 * MIB), hole);
    assert_eq!(backend.driver_calls().total(), calls);
    a.validate().unwrap();
}

#[test]
fn a_request_lands_in_a_mapped_hole_that_fits_rather_than_where_pages_must_be_mapped() {
    // [A 4][B 12, unmapped][C 4][D 16, mapped][E 14]: best fit for 12 MiB is
    // B, but its pages would have to be mapped; D holds mapped pages enough.
    let (a, backend) = host_allocator(1, 1 << 30, PAGE_BY_PAGE);
    let _a = alloc(&a, 4 * MIB);
    let b = alloc(&a, 12 * MIB);
    let _c = alloc(&a, 4 * MIB);
    a.free(0, b).unwrap();
    a.empty_cache();
    let d = alloc(&a, 16 * MIB);
    let _e = alloc(&a, 14 * MIB);
    a.free(0, d).unwrap();
    a.stats(0).unwrap(); // merges the stash: D is a hole in its bin
    let calls = backend.driver_calls().total();
    assert_eq!(alloc(&a, 12 * MIB), d);
    assert_eq!(backend.driver_calls().total(), calls, "no driver call");
    assert_eq!(reserved(&a), 38 * MIB);
    a.validate().unwrap();
}

#[test]
fn a_request_carved_from_a_free_block_that_cannot_grow_takes_the_cached_pages_further_in_it() {
    // [A 4][X 16 unmapped][C 4 mapped][Y 48 mapped][the range's tail], all
    // but A one free block: 56 MiB reserved, and a cap of 56 MiB. A 24 MiB
    // request lands at X, whose 8 pages must be mapped, while the block it
    // is carved from caches 44 MiB of pages past where it ends.
    let (a, backend) = host_allocator(1, 1 << 30, &format!("{PAGE_BY_PAGE},max_reserved_mb:56"));
    let _a = alloc(&a, 4 * MIB);
    let x = alloc(&a, 16 * MIB);
    let c = alloc(&a, 4 * MIB);
    a.free(0, x).unwrap();
    a.empty_cache();
    let y = alloc(&a, 48 * MIB);
    a.free(0, c).unwrap();
    a.free(0, y).unwrap();
    assert_eq!(reserved(&a), 56 * MIB);
    let free_before = backend.mem_info(0).unwrap().free;
    let carved = alloc(&a, 24 * MIB);
    assert_eq!(carved, x);
    let stats = a.stats(0).unwrap();
    assert_eq!(stats.reserved_bytes.all.peak, 56 * MIB, "the peak did not rise");
    assert_eq!(backend.vm_moves(), (1, 16 * MIB), "X's 8 pages took the memory of 8 of Y's, next to each other: one move");
    assert_eq!(reserved(&a), 56 * MIB, "the rest of Y's pages stay cached");
    assert_eq!(backend.mem_info(0).unwrap().free, free_before);
    fill(carved, 24 * MIB, 5);
    assert_eq!(check(carved, 24 * MIB, 5), Ok(()), "the moved pages are usable");
    a.validate().unwrap();
}

/// Stream 1: [A 4][B 12 unmapped][C 4]; stream 2: [D 16 mapped, free][E
/// 14]: 38 MiB reserved, and a 12 MiB request on stream 1 lands on B, whose
/// 6 pages must be mapped (D, another stream's, is never where it lands).
fn a_hole_with_pages_and_a_hole_without(a: &Allocator) -> DevicePtr {
    let _a = alloc(a, 4 * MIB);
    let b = alloc(a, 12 * MIB);
    let _c = alloc(a, 4 * MIB);
    a.free(0, b).unwrap();
    a.empty_cache();
    let d = a.allocate(0, (16 * MIB) as usize, S2).unwrap();
    let _e = a.allocate(0, (14 * MIB) as usize, S2).unwrap();
    a.free_on_stream(0, d, S2).unwrap();
    a.stats(0).unwrap(); // merges the stash: D is a hole in its bin
    b
}

#[test]
fn on_a_full_device_a_hole_s_memory_moves_to_the_new_pages_with_one_map_and_one_unmap_per_page_and_one_grant() {
    let (a, backend) = host_allocator(1, 38 * MIB, PAGE_BY_PAGE);
    let b = a_hole_with_pages_and_a_hole_without(&a);
    let free_before = backend.mem_info(0).unwrap().free;
    let calls_before = backend.driver_calls();
    let again = alloc(&a, 12 * MIB);
    assert_eq!(again, b);
    // B's 6 pages take the memory of 6 of D's 8 (next to each other, in one
    // move); the other 2 stay cached.
    assert_eq!(backend.vm_moves(), (1, 12 * MIB), "one move for the 6 pages");
    let calls = backend.driver_calls();
    assert_eq!(calls.unmap - calls_before.unmap, 6, "an unmap per page");
    assert_eq!(calls.map - calls_before.map, 6, "a map per page");
    assert_eq!(calls.set_access - calls_before.set_access, 1, "access granted once, to the 6 pages together");
    assert_eq!(calls.create, calls_before.create, "no new memory");
    assert_eq!(backend.mem_info(0).unwrap().free, free_before, "no memory taken, none given back");
    fill(again, 12 * MIB, 7);
    assert_eq!(check(again, 12 * MIB, 7), Ok(()), "the moved pages are usable");
    assert_eq!(reserved(&a), 38 * MIB);
    a.validate().unwrap();
}

#[test]
fn with_room_or_with_moves_off_a_growth_maps_new_pages_and_the_hole_keeps_its_own() {
    // A device with room: nothing moves. The replay's model of PyTorch's
    // expandable segments moves nothing even on a full device (it fails).
    let config = Config::builder().conf("release_after_ms:off,headroom_mb:0").unwrap().host(1, 1 << 30);
    let config = Config { move_pages: false, ..config.build().unwrap() };
    let backend = Arc::new(HostBackend::new(1, 1 << 30));
    for a in [Allocator::with_backend(config, backend.clone()), host_allocator(1, 1 << 30, PAGE_BY_PAGE).0] {
        let b = a_hole_with_pages_and_a_hole_without(&a);
        let moves = backend.vm_moves();
        let again = alloc(&a, 12 * MIB);
        assert_eq!(again, b);
        assert_eq!(backend.vm_moves(), moves);
        assert_eq!(reserved(&a), 34 * MIB + 16 * MIB, "D's 8 pages stay mapped beside B's 6 new ones");
        a.validate().unwrap();
    }
}

#[test]
fn with_pages_larger_than_the_drivers_nothing_moves_and_growth_maps_new_pages() {
    // Donors and destinations must share one page size (tags' ranges keep
    // the driver's): a heap with larger pages maps new ones instead.
    let config = Config::builder().conf("release_after_ms:off,headroom_mb:0,expandable:true").unwrap().host(1, 1 << 30);
    let config = Config { expandable_page: Some(20 * MIB), ..config.build().unwrap() };
    let backend = Arc::new(HostBackend::new(1, 1 << 30));
    let a = Allocator::with_backend(config, backend.clone());
    let (_a, b, _c) = (alloc(&a, 20 * MIB), alloc(&a, 40 * MIB), alloc(&a, 20 * MIB));
    a.free(0, b).unwrap();
    let d = alloc(&a, 60 * MIB); // past the high-water mark, B's two pages idle
    fill(d, 60 * MIB, 9);
    assert_eq!(check(d, 60 * MIB, 9), Ok(()));
    assert_eq!(backend.vm_moves(), (0, 0));
    assert_eq!(reserved(&a), 140 * MIB);
    a.validate().unwrap();
}

#[test]
fn pages_larger_than_the_backends_map_that_much_at_a_time_and_bad_sizes_are_refused() {
    let backend = Arc::new(HostBackend::new(1, 1 << 30));
    let mut heap = DeviceHeap::new(0, Default::default(), backend.clone());
    assert!(heap.set_expandable_page(20 * MIB).is_err(), "expandable segments are off");
    heap.set_expandable(true).unwrap();
    for bad in [0, 3 * MIB, MIB] {
        let err = heap.set_expandable_page(bad).unwrap_err();
        assert!(err.to_string().contains("not a multiple of the backend's"), "{bad}: {err}");
    }
    let err = heap.set_expandable_page(1 << 41).unwrap_err();
    assert!(err.to_string().contains("larger than a range"), "{err}");
    heap.set_expandable_page(20 * MIB).unwrap();
    // 30 MiB takes two 20 MiB pages: two maps and their access in one run.
    let p = heap.allocate(30 * MIB, Stream::DEFAULT).unwrap();
    assert_eq!(heap.stats().reserved_bytes.all.current, 40 * MIB);
    assert_eq!(backend.vm_calls().0, 1, "one run");
    assert!(heap.set_expandable_page(2 * MIB).is_err(), "only before the first allocation");
    heap.free(p).unwrap();
    heap.validate().unwrap();
}

#[test]
fn when_the_backend_cannot_move_the_hole_gives_its_pages_back_and_new_ones_are_mapped() {
    let (a, backend) = host_allocator(1, 38 * MIB, PAGE_BY_PAGE);
    let b = a_hole_with_pages_and_a_hole_without(&a);
    backend.faults().set_kind(FaultKind::DriverError);
    backend.faults().fail_nth_allocate(1); // the move
    let again = alloc(&a, 12 * MIB);
    assert_eq!(again, b);
    assert_eq!(backend.vm_moves(), (1, 0), "the move was tried and failed");
    fill(again, 12 * MIB, 3);
    assert_eq!(reserved(&a), 38 * MIB, "the same memory as with the move");
    assert_eq!(backend.mem_info(0).unwrap().free, 0, "nothing leaked in the driver");
    a.validate().unwrap();
}

#[test]
fn a_heap_that_cannot_grow_releases_whole_free_small_segments_first() {
    let (a, _) = host_allocator(1, 24 * MIB, "expandable:true");
    let large = alloc(&a, 4 * MIB);
    let small: Vec<_> = (0..20).map(|_| alloc(&a, MIB)).collect();
    assert_eq!(a.stats(0).unwrap().segment.small_pool.current, 10);
    for p in small {
        a.free(0, p).unwrap();
    }
    // Ten whole free 2 MiB segments cached; the large pool needs 20 MiB.
    let grown = alloc(&a, 20 * MIB);
    let stats = a.stats(0).unwrap();
    assert_eq!(stats.segment.small_pool.current, 0, "the small pool's free segments went back");
    assert_eq!(stats.reserved_bytes.all.peak, 24 * MIB, "the peak did not rise");
    assert_eq!(stats.reserved_bytes.all.current, 24 * MIB);
    for p in [large, grown] {
        a.free(0, p).unwrap();
    }
    a.validate().unwrap();
}

/// Device 0 of `a` with two holes, [4][H1][4][H2][R]: H1 (`h1` MiB)
/// given back, H2 (`h2`) cached, R `h1` + 4 MiB (too large for H1).
/// Requests of `h1` and `h2` MiB in turn fit only their own hole, and the
/// heap holds one hole but not both (`8 + h1 + 4 + h2` MiB reserved).
/// Returns the pages unmapped so far (`empty_cache`'s).
fn two_holes_each_request_fits_one(a: &Allocator, h1: u64, h2: u64) -> u64 {
    let _l = alloc(a, 4 * MIB);
    let first = alloc(a, h1 * MIB);
    let _m = alloc(a, 4 * MIB);
    a.free(0, first).unwrap();
    a.empty_cache();
    let second = alloc(a, h2 * MIB);
    let _r = alloc(a, (h1 + 4) * MIB);
    a.free(0, second).unwrap();
    a.stats(0).unwrap().events.num_pages_unmapped
}

/// Runs `steps` requests of `h1` and `h2` MiB in turn, each freed at once;
/// returns the driver calls made so far after each and the most reserved.
fn alternate(a: &Allocator, steps: usize, h1: u64, h2: u64) -> (Vec<u64>, u64) {
    let mut calls = Vec::new();
    let mut most = 0;
    for step in 0..steps {
        let p = alloc(a, if step % 2 == 0 { h1 * MIB } else { h2 * MIB });
        most = most.max(reserved(a));
        a.free(0, p).unwrap();
        let e = a.stats(0).unwrap().events;
        calls.push(e.num_device_alloc + e.num_device_free);
    }
    (calls, most)
}

#[test]
fn with_room_a_loop_of_two_sizes_lands_both_in_the_mapped_hole_and_makes_no_driver_call() {
    // H1 16 MiB unmapped, H2 18 MiB mapped: a 16 MiB request fits H1 best,
    // but H2 holds mapped pages enough for it.
    let (a, backend) = host_allocator(1, 1 << 30, PAGE_BY_PAGE);
    let emptied = two_holes_each_request_fits_one(&a, 16, 18);
    let before = backend.driver_calls().total();
    let (_, most) = alternate(&a, 40, 16, 18);
    let stats = a.stats(0).unwrap();
    assert_eq!(stats.events.num_pages_unmapped, emptied, "nothing unmapped, nothing moved");
    assert_eq!(backend.driver_calls().total(), before, "no driver call");
    assert_eq!(most, 46 * MIB);
    a.validate().unwrap();
}

/// A request too large for the mapped hole: stream 1 [4][H1 18
/// unmapped][4], stream 2 [H2 16 mapped][4], 28 MiB reserved; the heap may
/// hold 30 (a device or a cap), so an 18 MiB request on stream 1 takes
/// H2's 8 pages and one new. Then requests of 18 and 16 MiB in turn land
/// in H1, mapped, with no driver call.
fn a_request_too_large_for_the_mapped_hole(a: &Allocator, backend: &HostBackend) {
    let _l = alloc(a, 4 * MIB);
    let h1 = alloc(a, 18 * MIB);
    let _m = alloc(a, 4 * MIB);
    a.free(0, h1).unwrap();
    a.empty_cache();
    let h2 = a.allocate(0, (16 * MIB) as usize, S2).unwrap();
    let _r = a.allocate(0, (4 * MIB) as usize, S2).unwrap();
    a.free_on_stream(0, h2, S2).unwrap();
    let emptied = a.stats(0).unwrap().events.num_pages_unmapped;
    assert_eq!(reserved(a), 28 * MIB);
    let (calls, most) = alternate(a, 40, 18, 16);
    let stats = a.stats(0).unwrap();
    assert_eq!(backend.vm_moves(), (1, 16 * MIB), "H2's pages moved to H1 once");
    assert_eq!(stats.events.num_pages_unmapped - emptied, 8);
    assert_eq!(calls.iter().min(), calls.iter().max(), "then no driver call: {calls:?}");
    assert_eq!((most, stats.events.num_ooms), (30 * MIB, 0));
    a.validate().unwrap();
}

#[test]
fn on_a_full_device_a_request_too_large_for_the_mapped_hole_takes_its_pages_and_never_passes_the_device() {
    let backend = Arc::new(HostBackend::new(1, 30 * MIB));
    let config = Config::builder().conf(&format!("release_after_ms:off,headroom_mb:0,{PAGE_BY_PAGE}")).unwrap().host(1, 30 * MIB);
    let a = Allocator::with_backend(config.build().unwrap(), backend.clone());
    a_request_too_large_for_the_mapped_hole(&a, &backend);
}

#[test]
fn under_a_cap_a_request_too_large_for_the_mapped_hole_takes_its_pages_to_keep_within_it() {
    let (a, backend) = host_allocator(1, 1 << 30, &format!("{PAGE_BY_PAGE},max_reserved_mb:30"));
    a_request_too_large_for_the_mapped_hole(&a, &backend);
}

#[test]
fn a_large_block_is_mapped_in_allocations_of_its_grain_with_one_grant_of_access() {
    // (conf, allocations of the 4 MiB block, of the 1 GiB block)
    for (conf, small, allocations) in [
        ("expandable:true", 1, 128),
        ("expandable:true,expandable_allocation_mb:8", 1, 128),
        ("expandable:true,expandable_allocation_mb:64", 1, 16),
        ("expandable:true,expandable_allocation_mb:unlimited", 1, 1),
        (PAGE_BY_PAGE, 2, 512),
    ] {
        let (a, backend) = host_allocator(1, 4 << 30, conf);
        let _left = alloc(&a, 4 * MIB);
        let big = alloc(&a, 1 << 30);
        let calls = backend.driver_calls();
        // One `vm_map` for each block: a grant of access each.
        assert_eq!((calls.create, calls.map, calls.set_access), (small + allocations, small + allocations, 2), "{conf}");
        assert_eq!((calls.address_reserve, calls.unmap, calls.release), (1, 0, 0), "{conf}");
        fill(big, 1 << 30, 4);
        a.free(0, big).unwrap();
        a.empty_cache();
        let calls = backend.driver_calls();
        assert_eq!((calls.unmap, calls.release), (allocations, allocations), "{conf}: the block's allocations go back whole");
        assert_eq!(reserved(&a), 4 * MIB, "{conf}");
        a.validate().unwrap();
    }
}

#[test]
fn a_block_s_edge_pages_are_allocations_of_their_own_so_its_inside_goes_back_whatever_its_neighbours_hold() {
    // [3][10][3] MiB on 2 MiB pages: the middle block shares page 1 with
    // the left one and page 6 with the right one; its inside (pages 2 to 5)
    // is one allocation of its own (in allocations of up to 8 MiB).
    let (a, backend) = host_allocator(1, 1 << 30, "expandable:true,expandable_allocation_mb:8");
    let left = alloc(&a, 3 * MIB);
    let middle = alloc(&a, 10 * MIB);
    let right = alloc(&a, 3 * MIB);
    fill(left, 3 * MIB, 1);
    fill(right, 3 * MIB, 2);
    assert_eq!(reserved(&a), 16 * MIB);
    a.free(0, middle).unwrap();
    a.empty_cache();
    assert_eq!(reserved(&a), 8 * MIB, "the inside's 4 pages went back, the edge pages stay with the neighbours");
    assert_eq!(backend.driver_calls().unmap, 1, "in one call");
    assert_eq!((check(left, 3 * MIB, 1), check(right, 3 * MIB, 2)), (Ok(()), Ok(())));
    a.validate().unwrap();
}

#[test]
fn a_donor_larger_than_the_pages_to_map_gives_its_memory_back_before_new_memory_is_taken() {
    // A full device, in allocations of up to 64 MiB: D's 8 pages are one,
    // they cannot move into B's 6. D goes back before B's pages are taken,
    // so the peak does not rise either.
    let (a, backend) = host_allocator(1, 38 * MIB, "expandable:true,expandable_allocation_mb:64");
    let b = a_hole_with_pages_and_a_hole_without(&a);
    let again = alloc(&a, 12 * MIB);
    assert_eq!(again, b);
    let stats = a.stats(0).unwrap();
    assert_eq!(stats.reserved_bytes.all.peak, 38 * MIB, "the peak did not rise");
    assert_eq!(stats.reserved_bytes.all.current, 34 * MIB, "D's 16 MiB went back, B's 12 MiB came");
    assert_eq!(backend.vm_moves(), (0, 0));
    fill(again, 12 * MIB, 6);
    assert_eq!(check(again, 12 * MIB, 6), Ok(()));
    a.validate().unwrap();
}

#[test]
fn expandable_allocation_mb_refuses_what_is_not_a_size() {
    for bad in ["0", "lots", "-2", "99999999999999999999"] {
        let err = Config::builder().set("expandable_allocation_mb", bad).unwrap_err();
        assert!(err.to_string().contains("expandable_allocation_mb"), "{bad}: {err}");
    }
    let (config, warnings) = Config::parse("expandable:true,expandable_allocation_mb:0");
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert_eq!(config.expandable_allocation, tidepool::config::DEFAULT_EXPANDABLE_ALLOCATION, "the default kept");
    let (config, warnings) = Config::parse("expandable_allocation_mb:unlimited");
    assert_eq!((config.expandable_allocation, warnings.len()), (u64::MAX, 0));
}

/// [A 4][B 32][C 4] MiB in allocations as large as each block: B is one
/// allocation of 16 pages. B is freed and a 6 MiB request lands at its
/// start.
fn a_freed_large_allocation_carved_smaller(conf: &str) -> (Allocator, DevicePtr) {
    let (a, backend) = host_allocator(1, 1 << 30, conf);
    let _a = alloc(&a, 4 * MIB);
    let b = alloc(&a, 32 * MIB);
    let _c = alloc(&a, 4 * MIB);
    a.free(0, b).unwrap();
    let before = backend.driver_calls();
    let again = alloc(&a, 6 * MIB);
    assert_eq!(again, b);
    let calls = backend.driver_calls();
    let made = (calls.create - before.create, calls.unmap - before.unmap, calls.release - before.release);
    let split = conf.contains("expandable_split_allocations:true");
    let expected = if split { (1, 1, 1) } else { (0, 0, 0) };
    assert_eq!(made, expected, "{conf}: (allocations made, unmapped, released) for the 6 MiB block");
    (a, again)
}

#[test]
fn with_split_allocations_a_block_carved_from_a_freed_large_allocation_maps_its_own_pages() {
    const UNLIMITED: &str = "expandable:true,expandable_allocation_mb:unlimited";
    // Without: the 6 MiB block reuses B's allocation, whose other 26 MiB
    // stay held by it, even through empty_cache.
    let (a, _) = a_freed_large_allocation_carved_smaller(UNLIMITED);
    a.empty_cache();
    assert_eq!(reserved(&a), 40 * MIB, "B's allocation is pinned by the 6 MiB block");
    a.validate().unwrap();
    // With: B's allocation goes back and the block maps its 3 pages.
    let (a, again) = a_freed_large_allocation_carved_smaller(&format!("{UNLIMITED},expandable_split_allocations:true"));
    assert_eq!(reserved(&a), 14 * MIB, "the block holds its own 6 MiB, the rest of B none");
    fill(again, 6 * MIB, 3);
    assert_eq!(check(again, 6 * MIB, 3), Ok(()), "the new pages are usable");
    let stats = a.stats(0).unwrap();
    assert_eq!(stats.reserved_bytes.all.peak, 40 * MIB, "given back before the new pages were taken");
    a.validate().unwrap();
}

#[test]
fn split_allocations_leave_a_capture_s_memory_where_it_is() {
    // During a capture nothing goes back: the 6 MiB block is carved from B
    // as it is.
    let (a, backend) = host_allocator(1, 1 << 30, "expandable:true,expandable_allocation_mb:unlimited,expandable_split_allocations:true");
    let graph = tidepool::PrivatePoolId(5, 0);
    a.begin_private(0, graph).unwrap();
    let b = alloc(&a, 32 * MIB);
    let _c = alloc(&a, 4 * MIB);
    a.end_private(0, graph).unwrap();
    a.free(0, b).unwrap();
    a.stats(0).unwrap();
    let before = backend.driver_calls();
    a.begin_private(0, graph).unwrap();
    let again = alloc(&a, 6 * MIB);
    assert_eq!(again, b);
    assert_eq!(backend.driver_calls().unmap, before.unmap, "nothing unmapped during the capture");
    a.end_private(0, graph).unwrap();
    assert_eq!(reserved(&a), 36 * MIB);
    a.validate().unwrap();
}
