//! The cached path allocates no host memory: a counting global allocator
//! sees no call during thousands of cached pairs once the heap is warm.
//! And the one-block stash is invisible: what it delays is merged before
//! any request of another size or any look at the statistics.

use crate::common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use common::{host_allocator, KIB, MIB};
use tidepool::{Allocator, Stream};

struct Counting;

thread_local! {
    /// Allocations made by this thread (other tests run on other threads).
    static HOST_ALLOCATIONS: Cell<u64> = const { Cell::new(0) };
}

fn count() {
    HOST_ALLOCATIONS.with(|c| c.set(c.get() + 1));
}

fn counted() -> u64 {
    HOST_ALLOCATIONS.with(Cell::get)
}

// SAFETY: forwards every call to the system allocator unchanged; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count();
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as the caller's.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count();
        // SAFETY: same contract as the caller's.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn churn(alloc: &Allocator, sizes: &[usize], rounds: usize) {
    for _ in 0..rounds {
        let ptrs: Vec<_> = sizes.iter().map(|&s| alloc.allocate(0, s, Stream::DEFAULT).unwrap()).collect();
        for p in ptrs.into_iter().rev() {
            alloc.free(0, p).unwrap();
        }
    }
}

#[test]
fn cached_allocations_and_frees_make_no_host_allocation() {
    let (alloc, _) = host_allocator(1, 1 << 30, "");
    let sizes = [512, 3000, 64 * KIB as usize, 4 * MIB as usize, 64 * MIB as usize];
    let mut ptrs = Vec::with_capacity(sizes.len());
    churn(&alloc, &sizes, 3); // warm: segments, block records, map capacity
    let before = counted();
    for _ in 0..2_000 {
        for &size in &sizes {
            ptrs.push(alloc.allocate(0, size, Stream::DEFAULT).unwrap());
        }
        for p in ptrs.drain(..).rev() {
            alloc.free(0, p).unwrap();
        }
        let p = alloc.allocate(0, 512, Stream::DEFAULT).unwrap();
        alloc.free(0, p).unwrap();
    }
    let after = counted();
    assert_eq!(after - before, 0, "the cached path allocated host memory");
}

#[test]
fn a_stashed_block_is_merged_before_a_request_of_another_size() {
    let (alloc, _) = host_allocator(1, 1 << 30, "thread_cache_blocks:0");
    let a = alloc.allocate(0, 4096, Stream::DEFAULT).unwrap();
    alloc.free(0, a).unwrap();
    // 8 KiB fits only once the stashed 4 KiB block is merged back into the
    // segment: it must come from the same place, not a new segment.
    let b = alloc.allocate(0, 8192, Stream::DEFAULT).unwrap();
    assert_eq!(b, a);
    assert_eq!(alloc.stats(0).unwrap().events.num_device_alloc, 1);
    alloc.validate().unwrap();
}

#[test]
fn a_large_block_comes_back_where_best_fit_puts_it_not_where_the_stash_held_it() {
    // [A 4][B 4][C 4][free 8] MiB in one 20 MiB segment. A is freed, then B:
    // merged, A and B are one free 8 MiB block at A, which best fit picks
    // (the lowest of the two 8 MiB blocks); the stash would hand B back.
    // The model of PyTorch, which has no stash, puts it at A too.
    for conf in ["thread_cache_blocks:0", "thread_cache_blocks:0,stash:false"] {
        let (alloc, _) = host_allocator(1, 1 << 30, conf);
        let [a, b, _c] = [0; 3].map(|_| alloc.allocate(0, 4 * MIB as usize, Stream::DEFAULT).unwrap());
        alloc.free(0, a).unwrap();
        alloc.free(0, b).unwrap();
        assert_eq!(alloc.allocate(0, 4 * MIB as usize, Stream::DEFAULT).unwrap(), a, "{conf:?}");
        alloc.validate().unwrap();
    }
}

#[test]
fn a_small_block_comes_back_where_best_fit_puts_it_so_a_whole_segment_can_go_back() {
    // Two 2 MiB small segments: [X 1][N 1] and [Z 1][W 1] MiB. N, Z and X
    // are freed in that order: merged, X and N are the whole first segment
    // and Z is the exact fit for the next 1 MiB request; the stash would
    // hand X back and pin both segments. Afterwards only the second
    // segment is held, as in the model of PyTorch.
    for conf in ["thread_cache_blocks:0", "thread_cache_blocks:0,stash:false"] {
        let (alloc, _) = host_allocator(1, 1 << 30, conf);
        let [x, n, z, _w] = [0; 4].map(|_| alloc.allocate(0, MIB as usize, Stream::DEFAULT).unwrap());
        assert_eq!(alloc.stats(0).unwrap().segment.small_pool.current, 2);
        for p in [n, z, x] {
            alloc.free(0, p).unwrap();
        }
        assert_eq!(alloc.allocate(0, MIB as usize, Stream::DEFAULT).unwrap(), z, "{conf:?}");
        alloc.empty_cache();
        assert_eq!(alloc.stats(0).unwrap().reserved_bytes.small_pool.current, 2 * MIB, "{conf:?}");
        alloc.validate().unwrap();
    }
}

#[test]
fn the_rest_of_a_block_taken_back_goes_first_of_its_size_as_best_fit_puts_it() {
    // One small segment: [X 1024][N 512][Y 512][O 512][Z 512][free]. N is
    // freed, then O, then X. Merged, X and N serve the next 1 KiB request
    // and split: the rest, N, goes back ahead of O (the free block of its
    // size freed last comes first), so the next 512 B request gets N. The
    // stash, handing back X alone, would leave O first.
    for conf in ["thread_cache_blocks:0", "thread_cache_blocks:0,stash:false"] {
        let (alloc, _) = host_allocator(1, 1 << 30, conf);
        let x = alloc.allocate(0, 1024, Stream::DEFAULT).unwrap();
        let [n, _y, o, _z] = [0; 4].map(|_| alloc.allocate(0, 512, Stream::DEFAULT).unwrap());
        for p in [n, o, x] {
            alloc.free(0, p).unwrap();
        }
        assert_eq!(alloc.allocate(0, 1024, Stream::DEFAULT).unwrap(), x, "{conf:?}");
        assert_eq!(alloc.allocate(0, 512, Stream::DEFAULT).unwrap(), n, "{conf:?}");
        alloc.validate().unwrap();
    }
}

#[test]
fn statistics_see_a_freed_block_as_merged() {
    let (alloc, _) = host_allocator(1, 1 << 30, "");
    let keep = alloc.allocate(0, 512, Stream::DEFAULT).unwrap();
    let a = alloc.allocate(0, 4096, Stream::DEFAULT).unwrap();
    alloc.free(0, a).unwrap();
    let s = alloc.stats(0).unwrap();
    assert_eq!(s.inactive_split.all.current, 1, "one free block after the live 512 B, merged");
    assert_eq!(s.largest_free_block_bytes, 2 * MIB - 512);
    assert_eq!(s.cached_free_bytes, 2 * MIB - 512);
    alloc.free(0, keep).unwrap();
    alloc.validate().unwrap();
}

#[test]
fn the_allocator_is_send_and_sync() {
    fn shareable<T: Send + Sync>() {}
    shareable::<Allocator>();
}
