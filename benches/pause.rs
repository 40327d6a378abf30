//! Pause and resume of a tag with offload, against plain memcpy of the
//! same bytes in the same run (host backend): 1,000 live blocks holding
//! `TIDEPOOL_BENCH_PAUSE_MIB` MiB (default 4096, the 4 GiB) are
//! copied out to host memory and their pages given back, then mapped again
//! and copied back. The baseline copies the same blocks out to one host
//! buffer and back with `copy_from_slice`. Criterion reports both as bytes
//! per second (each iteration moves the tag's bytes twice).
//!
//! And the discarding pause (no copies): its cost is the page calls alone.
//!
//! Peak memory: the blocks, plus as much again in host memory (the offload
//! or the baseline's buffer, not both at once).

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use tidepool::{Allocator, Config, DevicePtr, Stream};

const BLOCKS: usize = 1_000;

fn total_bytes() -> u64 {
    let mib: u64 = std::env::var("TIDEPOOL_BENCH_PAUSE_MIB").ok().and_then(|v| v.parse().ok()).unwrap_or(4096);
    mib << 20
}

/// An allocator holding `BLOCKS` blocks of `total / BLOCKS` bytes each under
/// the tag "bench", every byte written.
fn populated(total: u64) -> (Allocator, Vec<DevicePtr>, usize) {
    let config = Config::builder().conf("release_after_ms:off,headroom_mb:0").unwrap().host(1, 2 * total + (1 << 30)).build().unwrap();
    let alloc = Allocator::new(config).unwrap();
    let size = (total / BLOCKS as u64) as usize & !4095;
    let _region = tidepool::tag::region("bench").unwrap();
    let blocks: Vec<DevicePtr> = (0..BLOCKS).map(|_| alloc.allocate(0, size, Stream::DEFAULT).unwrap()).collect();
    let backend = alloc.backend().clone();
    for (i, p) in blocks.iter().enumerate() {
        backend.copy_to_device(0, p.0, &vec![i as u8; size], Stream::DEFAULT).unwrap();
    }
    (alloc, blocks, size)
}

fn pause_resume(c: &mut Criterion) {
    let total = total_bytes();
    let (alloc, blocks, size) = populated(total);
    let backend = alloc.backend().clone();
    let moved = 2 * (size * BLOCKS) as u64;

    let mut group = c.benchmark_group(format!("pause_resume_offload/{}MiB_in_{BLOCKS}_blocks", total >> 20));
    group.throughput(Throughput::Bytes(moved));
    group.bench_function("memcpy_out_and_back", |b| {
        let mut host = vec![0u8; size * BLOCKS];
        b.iter(|| {
            for (p, chunk) in blocks.iter().zip(host.chunks_mut(size)) {
                backend.copy_to_host(0, p.0, chunk, Stream::DEFAULT).unwrap();
            }
            for (p, chunk) in blocks.iter().zip(host.chunks(size)) {
                backend.copy_to_device(0, p.0, chunk, Stream::DEFAULT).unwrap();
            }
            black_box(&host);
        })
    });
    group.bench_function("tidepool_pause_offload_and_resume", |b| {
        b.iter(|| {
            alloc.pause("bench", Some(0), true).unwrap();
            alloc.resume("bench", Some(0)).unwrap();
        })
    });
    group.finish();

    let mut group = c.benchmark_group(format!("pause_resume_discard/{}MiB_in_{BLOCKS}_blocks", total >> 20));
    group.bench_function("tidepool_pause_discard_and_resume", |b| {
        b.iter(|| {
            alloc.pause("bench", Some(0), false).unwrap();
            alloc.resume("bench", Some(0)).unwrap();
        })
    });
    group.finish();
    alloc.validate().unwrap();
    for p in blocks {
        alloc.free(0, p).unwrap();
    }
}

fn config() -> Criterion {
    Criterion::default().sample_size(10).warm_up_time(Duration::from_millis(500)).measurement_time(Duration::from_secs(5))
}

criterion_group! { name = benches; config = config(); targets = pause_resume }
criterion_main!(benches);
