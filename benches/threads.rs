//! Scaling across threads: cached alloc+free pairs per second with one
//! thread, and with two threads on distinct streams, in the same run.
//! (`iter_custom`: each sample times N pairs per thread, all threads
//! running at once; throughput = threads x N / time.)

use std::hint::black_box;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use tidepool::{Allocator, Config, Stream};

fn pairs_on_threads(alloc: &Arc<Allocator>, threads: u64, iters: u64) -> Duration {
    let barrier = Arc::new(Barrier::new(threads as usize + 1));
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let (alloc, barrier) = (alloc.clone(), barrier.clone());
            std::thread::spawn(move || {
                let stream = Stream(t + 1);
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
    // One heap per device (the default), then 16 stream shards.
    for shards in [1, 16] {
        let conf = format!("release_after_ms:off,headroom_mb:0,stream_shards:{shards}");
        let config = Config::builder().conf(&conf).unwrap().host(1, 1 << 40).build().unwrap();
        let alloc = Arc::new(Allocator::new(config).unwrap());
        for threads in [1u64, 2] {
            group.throughput(Throughput::Elements(threads));
            group.bench_function(BenchmarkId::new(format!("shards_{shards}"), threads), |b| {
                b.iter_custom(|iters| pairs_on_threads(&alloc, threads, iters))
            });
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
