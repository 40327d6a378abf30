//! The cached path: one allocation and its free, served from the cache
//! (the thread's cache, and without it the heap's), next to glibc's
//! malloc+free, mimalloc's, the `offset-allocator` crate's allocate+free
//! (an O(1) bitmap sub-allocator of one address range, the algorithmic
//! peer) and the raw host backend (mmap+munmap) of the same size, all in
//! one run so the ratios compare like with like.
//!
//! The heap holds 1,000 or 100,000 live blocks around the pair, with as
//! many free holes between them (every other block of 2N freed), so the
//! pools are full of blocks: the case that makes list-based pools slow.
//!
//! `python3 benches/table.py` turns the medians into docs/benchmarks.md's table.

use std::alloc::GlobalAlloc;
use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use mimalloc::MiMalloc;
use tidepool::backend::host::HostBackend;
use tidepool::backend::Backend;
use tidepool::{Allocator, Config, DevicePtr, Stream};

const SIZES: [(&str, usize); 4] = [("512B", 512), ("64KiB", 64 << 10), ("4MiB", 4 << 20), ("64MiB", 64 << 20)];

/// An allocator with `live` blocks of 512 B to 8 KiB live and about as many free holes.
fn populated(live: usize, conf: &str) -> (Allocator, Vec<DevicePtr>) {
    let config = quiet().conf(conf).unwrap().build().unwrap();
    let alloc = Allocator::new(config).unwrap();
    let mut seed = 0x2545_F491_4F6C_DD1Du64;
    let mut blocks = Vec::with_capacity(2 * live);
    for _ in 0..2 * live {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        let size = 512 + (seed % (8 << 10)) as usize;
        blocks.push(alloc.allocate(0, size, Stream::DEFAULT).unwrap());
    }
    let mut kept = Vec::with_capacity(live);
    for (i, ptr) in blocks.into_iter().enumerate() {
        if i % 2 == 0 {
            alloc.free(0, ptr).unwrap();
        } else {
            kept.push(ptr);
        }
    }
    (alloc, kept)
}

fn cached_pair(c: &mut Criterion) {
    let heaps = [
        ("tidepool_1k_live", populated(1_000, "")),
        ("tidepool_100k_live", populated(100_000, "")),
        ("tidepool_no_thread_cache_1k_live", populated(1_000, "thread_cache_blocks:0")),
    ];
    let mut offsets = offset_allocator::Allocator::<u32>::new(1 << 30);
    let backend = HostBackend::new(1, 1 << 40);
    for (size_name, size) in SIZES {
        let mut group = c.benchmark_group(format!("cached_pair/{size_name}"));
        for (name, (alloc, _live)) in &heaps {
            // Warm the cache: the first request of this size grows the heap.
            let p = alloc.allocate(0, size, Stream::DEFAULT).unwrap();
            alloc.free(0, p).unwrap();
            group.bench_function(BenchmarkId::from_parameter(name), |b| {
                b.iter(|| {
                    let p = alloc.allocate(0, black_box(size), Stream::DEFAULT).unwrap();
                    alloc.free(0, black_box(p)).unwrap();
                })
            });
        }
        group.bench_function(BenchmarkId::from_parameter("glibc_malloc_free"), |b| {
            b.iter(|| {
                // SAFETY: a plain malloc/free pair; the pointer is not used.
                unsafe { libc::free(black_box(libc::malloc(black_box(size)))) }
            })
        });
        group.bench_function(BenchmarkId::from_parameter("mimalloc"), |b| {
            let layout = std::alloc::Layout::from_size_align(size, 16).unwrap();
            b.iter(|| {
                // SAFETY: a plain alloc/dealloc pair of one layout; the pointer is not used.
                unsafe { GlobalAlloc::dealloc(&MiMalloc, black_box(GlobalAlloc::alloc(&MiMalloc, layout)), layout) }
            })
        });
        group.bench_function(BenchmarkId::from_parameter("offset_allocator"), |b| {
            b.iter(|| {
                let allocation = offsets.allocate(black_box(size as u32)).unwrap();
                offsets.free(black_box(allocation));
            })
        });
        group.bench_function(BenchmarkId::from_parameter("host_backend_mmap_munmap"), |b| {
            b.iter(|| {
                let base = backend.allocate(0, black_box(size as u64), Stream::DEFAULT).unwrap();
                backend.release(0, black_box(base), size as u64, Stream::DEFAULT).unwrap();
            })
        });
        group.finish();
    }
    for (_, (alloc, live)) in heaps {
        for ptr in live {
            alloc.free(0, ptr).unwrap();
        }
        alloc.validate().unwrap();
    }
}

/// A loop of requests on each allocator, as one group: a feature's cost
/// to the cached path, off and on, measured in the same run. Each
/// iteration allocates `sizes` in order and frees them in order; with one
/// size that is the cached pair (the stash), with several every request
/// but the last goes through the bins (best fit, split, merge).
fn off_and_on(c: &mut Criterion, group: &str, allocators: [(&str, Config); 2], sizes: &[usize]) {
    let mut group = c.benchmark_group(group);
    for (name, config) in allocators {
        let alloc = Allocator::new(config).unwrap();
        let keep = alloc.allocate(0, 512, Stream::DEFAULT).unwrap();
        let mut ptrs = Vec::with_capacity(sizes.len());
        group.bench_function(BenchmarkId::from_parameter(name), |b| {
            b.iter(|| {
                for &size in sizes {
                    ptrs.push(alloc.allocate(0, black_box(size), Stream::DEFAULT).unwrap());
                }
                for p in ptrs.drain(..) {
                    alloc.free(0, black_box(p)).unwrap();
                }
            })
        });
        alloc.free(0, keep).unwrap();
        alloc.validate().unwrap();
    }
    group.finish();
}

fn quiet() -> tidepool::config::ConfigBuilder {
    Config::builder().conf("release_after_ms:off,headroom_mb:0").unwrap().host(1, 1 << 40)
}

/// TIDEPOOL_TRACE, recording to /dev/null so the file does not grow.
fn recording(c: &mut Criterion) {
    off_and_on(c, "recording", [("off", quiet().build().unwrap()), ("on", quiet().trace("/dev/null").build().unwrap())], &[512]);
}

/// The background reclaimer, waking every 10 ms.
fn reclaimer(c: &mut Criterion) {
    let on = quiet().conf("release_after_ms:50,reclaim_interval_ms:10").unwrap().build().unwrap();
    off_and_on(c, "reclaimer", [("off", quiet().build().unwrap()), ("on", on)], &[512]);
}

/// Expandable segments: the cached pair, and a loop of three sizes whose
/// requests go through the bins (and the page check of expandable segments).
fn expandable(c: &mut Criterion) {
    let both = || [("off", quiet().conf("expandable:false").unwrap().build().unwrap()), ("on", quiet().build().unwrap())];
    off_and_on(c, "expandable_pair", both(), &[512]);
    off_and_on(c, "expandable_mixed", both(), &[512, 3 << 20, 64 << 10]);
}

fn config() -> Criterion {
    Criterion::default().sample_size(40).warm_up_time(Duration::from_millis(400)).measurement_time(Duration::from_millis(1500))
}

/// Threads' caches: the mixed three-size loop through the bins, off and on.
fn thread_caches(c: &mut Criterion) {
    let both = || [("off", quiet().conf("thread_cache_blocks:0").unwrap().build().unwrap()), ("on", quiet().build().unwrap())];
    off_and_on(c, "thread_cache_mixed", both(), &[512, 3 << 20, 64 << 10]);
}

criterion_group! { name = benches; config = config(); targets = cached_pair, recording, reclaimer, expandable, thread_caches }
criterion_main!(benches);
