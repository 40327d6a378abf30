//! Scaling across threads: cached alloc+free pairs per second with 1, 2
//! and 4 threads, all on one stream or each on its own, with threads'
//! caches (the default), without, and with 16 stream shards instead, in
//! the same run.
//! (`iter_custom`: each sample times N pairs per thread, all threads
//! running at once; throughput = threads x N / time.)

use std::hint::black_box;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use tidepool::{Allocator, Config, Stream};

fn pairs_on_threads(alloc: &Arc<Allocator>, threads: u64, one_stream: bool, iters: u64) -> Duration {
    let barrier = Arc::new(Barrier::new(threads as usize + 1));
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let (alloc, barrier) = (alloc.clone(), barrier.clone());
            std::thread::spawn(move || {
                let stream = if one_stream { Stream::DEFAULT } else { Stream(t + 1) };
                let keep = alloc.allocate(0, 512, stream).unwrap();
                barrier.wait();
                for _ in 0..iters {
                    let p = alloc.allocate(0, black_box(512), stream).unwrap();
                    alloc.free_on_stream(0, black_box(p), stream).unwrap();
                }
                alloc.free_on_stream(0, keep, stream).unwrap();
            })
        })
        .collect();
    barrier.wait();
    let start = Instant::now();
    for h in handles {
        h.join().unwrap();
    }
    start.elapsed()
}

fn scaling(c: &mut Criterion) {
    let mut group = c.benchmark_group("threads");
    for (name, conf) in [("caches", ""), ("no_caches", "thread_cache_blocks:0"), ("shards_16", "stream_shards:16")] {
        let config =
            Config::builder().conf("release_after_ms:off,headroom_mb:0").unwrap().conf(conf).unwrap().host(1, 1 << 40).build().unwrap();
        let alloc = Arc::new(Allocator::new(config).unwrap());
        for one_stream in [true, false] {
            for threads in [1u64, 2, 4] {
                let streams = if one_stream { "one_stream" } else { "own_streams" };
                group.throughput(Throughput::Elements(threads));
                group.bench_function(BenchmarkId::new(format!("{name}/{streams}"), threads), |b| {
                    b.iter_custom(|iters| pairs_on_threads(&alloc, threads, one_stream, iters))
                });
            }
        }
    }
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(30).warm_up_time(Duration::from_millis(500)).measurement_time(Duration::from_secs(2));
    targets = scaling
}
criterion_main!(benches);
