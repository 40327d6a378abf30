//! Private pools (PyTorch's CUDA graph pools and `MemPool`s): what a graph
//! captured allocates serves no one else and stays while the graph lives,
//! and nothing a capture forbids (releasing memory) happens while one may be
//! underway.

use crate::common;

use common::{host_allocator, reserved, MIB};
use tidepool::{Allocator, DevicePtr, PrivatePoolId, Stream};

const S: Stream = Stream::DEFAULT;
const GRAPH: PrivatePoolId = PrivatePoolId(1, 0);

fn alloc_free(alloc: &Allocator, size: u64) -> DevicePtr {
    let ptr = alloc.allocate(0, size as usize, S).unwrap();
    alloc.free(0, ptr).unwrap();
    ptr
}

#[test]
fn a_capture_allocates_from_its_own_pool_and_keeps_it_to_itself() {
    let (alloc, _) = host_allocator(1, 1 << 30, "");
    let eager = alloc_free(&alloc, 4 * MIB);

    alloc.begin_private(0, GRAPH).unwrap();
    let captured = alloc_free(&alloc, 4 * MIB);
    assert_ne!(captured, eager, "the capture took a block cached for eager work");
    assert_eq!(alloc_free(&alloc, 4 * MIB), captured, "within the capture its own freed blocks serve again");
    alloc.validate().unwrap();
    alloc.end_private(0, GRAPH).unwrap();

    // The graph replays `captured`: eager work must never get it.
    for _ in 0..3 {
        assert_eq!(alloc_free(&alloc, 4 * MIB), eager);
    }
    let big = alloc.allocate(0, 8 * MIB as usize, S).unwrap();
    assert!(big.0 < captured.0 || big.0 >= captured.0 + 4 * MIB, "eager work landed in the graph's block");
    alloc.free(0, big).unwrap();
    alloc.validate().unwrap();
}

#[test]
fn the_memory_of_a_live_graph_is_never_released_and_goes_once_it_is() {
    let (alloc, _) = host_allocator(1, 1 << 30, "");
    alloc.begin_private(0, GRAPH).unwrap();
    alloc_free(&alloc, 64 * MIB);
    alloc.end_private(0, GRAPH).unwrap();
    let kept = reserved(&alloc);
    assert!(kept >= 64 * MIB);

    alloc.empty_cache();
    alloc.device(0).unwrap().reclaim();
    assert_eq!(reserved(&alloc), kept, "released memory a live graph replays into");

    alloc.release_private(0, GRAPH).unwrap();
    alloc.empty_cache();
    assert_eq!(reserved(&alloc), 0, "the graph is gone: its memory is cached memory like any");
    alloc.validate().unwrap();
}

#[test]
fn nothing_is_released_while_a_capture_may_be_underway() {
    let (alloc, _) = host_allocator(1, 1 << 30, "");
    alloc_free(&alloc, 32 * MIB);
    let cached = reserved(&alloc);
    alloc.begin_private(0, GRAPH).unwrap();
    assert_eq!(alloc.empty_cache().bytes, 0, "cudaFree during a capture invalidates it");
    alloc.device(0).unwrap().reclaim();
    assert_eq!(reserved(&alloc), cached);
    alloc.end_private(0, GRAPH).unwrap();
    assert_eq!(alloc.empty_cache().bytes, cached, "once no capture is underway, eager cache goes as usual");
    alloc.release_private(0, GRAPH).unwrap();
    alloc.validate().unwrap();
}

#[test]
fn a_full_device_during_a_capture_fails_rather_than_release_or_borrow() {
    let (alloc, _) = host_allocator(1, 64 * MIB, "");
    alloc_free(&alloc, 48 * MIB);
    alloc.begin_private(0, GRAPH).unwrap();
    let err = alloc.allocate(0, 32 * MIB as usize, S).unwrap_err().to_string();
    assert!(err.contains("CUDA graph capture"), "the report does not say why the cache could not help: {err}");
    alloc.end_private(0, GRAPH).unwrap();
    let after = alloc.allocate(0, 32 * MIB as usize, S).unwrap();
    alloc.free(0, after).unwrap();
    alloc.release_private(0, GRAPH).unwrap();
    alloc.validate().unwrap();
}

#[test]
fn a_pool_used_inside_a_capture_stays_until_every_private_pool_is_released() {
    let (alloc, _) = host_allocator(1, 1 << 30, "");
    let pool = PrivatePoolId(0, 7);
    alloc.begin_private(0, GRAPH).unwrap();
    alloc.begin_private(0, pool).unwrap(); // `with torch.cuda.use_mem_pool(pool)` inside the capture
    let in_pool = alloc_free(&alloc, 16 * MIB);
    alloc.end_private(0, pool).unwrap();
    alloc.release_private(0, pool).unwrap();
    let in_graph = alloc_free(&alloc, 16 * MIB);
    assert_ne!(in_graph, in_pool, "the graph's allocations went to the inner pool after it closed");
    alloc.end_private(0, GRAPH).unwrap();
    let kept = reserved(&alloc);
    alloc.empty_cache();
    assert_eq!(reserved(&alloc), kept, "the inner pool's memory went while the graph that replays it lives");
    alloc.release_private(0, GRAPH).unwrap();
    alloc.empty_cache();
    assert_eq!(reserved(&alloc), 0);
    alloc.validate().unwrap();
}

#[test]
fn graph_memory_shows_in_snapshots_under_its_pool() {
    let (alloc, _) = host_allocator(1, 1 << 30, "");
    alloc.begin_private(0, GRAPH).unwrap();
    let ptr = alloc.allocate(0, MIB as usize, S).unwrap();
    alloc.end_private(0, GRAPH).unwrap();
    let segments = alloc.snapshot(0).unwrap();
    let holding = segments.iter().find(|s| s.blocks.iter().any(|b| b.address == ptr.0)).unwrap();
    assert_eq!(holding.private, Some(GRAPH));
    alloc.free(0, ptr).unwrap();
    alloc.release_private(0, GRAPH).unwrap();
}

#[test]
fn unbalanced_calls_are_refused_and_change_nothing() {
    let (alloc, _) = host_allocator(1, 1 << 30, "");
    assert!(alloc.end_private(0, GRAPH).is_err(), "ended a pool never begun");
    assert!(alloc.release_private(0, GRAPH).is_err(), "released a pool never begun");
    assert!(alloc.begin_private(3, GRAPH).is_err(), "no device 3");
    alloc.begin_private(0, GRAPH).unwrap();
    let err = alloc.release_private(0, GRAPH).unwrap_err().to_string();
    assert!(err.contains("still open"), "{err}");
    alloc.validate().unwrap();
    alloc.end_private(0, GRAPH).unwrap();
    assert!(alloc.end_private(0, GRAPH).is_err(), "ended twice");
    alloc.release_private(0, GRAPH).unwrap();
    assert!(alloc.release_private(0, GRAPH).is_err(), "released more often than begun");
    alloc.validate().unwrap();
}

#[test]
fn expandable_segments_keep_a_live_graphs_pages_mapped() {
    let (alloc, _) = host_allocator(1, 1 << 30, "expandable:true");
    alloc.begin_private(0, GRAPH).unwrap();
    let ptrs: Vec<_> = (0..3).map(|_| alloc.allocate(0, 16 * MIB as usize, S).unwrap()).collect();
    alloc.free(0, ptrs[1]).unwrap(); // a hole the graph replays into
    alloc.end_private(0, GRAPH).unwrap();
    let kept = reserved(&alloc);
    alloc.empty_cache();
    assert_eq!(reserved(&alloc), kept, "unmapped the pages of a hole a live graph writes");
    // Eager growth does not take them either.
    let eager = alloc.allocate(0, 40 * MIB as usize, S).unwrap();
    assert!(reserved(&alloc) >= kept + 40 * MIB);
    alloc.free(0, eager).unwrap();
    alloc.release_private(0, GRAPH).unwrap();
    alloc.empty_cache();
    assert_eq!(reserved(&alloc), 32 * MIB, "only the live blocks' pages are left");
    for p in [ptrs[0], ptrs[2]] {
        alloc.free(0, p).unwrap();
    }
    alloc.validate().unwrap();
}
