//! A tight cached alloc+free loop, for profilers (perf, callgrind).
//! `cargo run --release --example pair_loop -- [size|mixed] [iterations] [TIDEPOOL_CONF]`
//! `mixed` allocates 512 B, 3 MiB and 64 KiB, then frees them, each iteration:
//! requests that go through the bins rather than the stash.
use tidepool::{Allocator, Config, Stream};

fn main() {
    let mut args = std::env::args().skip(1);
    let sizes: Vec<usize> = match args.next().as_deref() {
        Some("mixed") => vec![512, 3 << 20, 64 << 10],
        other => vec![other.and_then(|a| a.parse().ok()).unwrap_or(512)],
    };
    let iters: u64 = args.next().and_then(|a| a.parse().ok()).unwrap_or(10_000_000);
    let conf = args.next().unwrap_or_default();
    let config = Config::builder().conf(&conf).expect("a valid TIDEPOOL_CONF string").host(1, 1 << 40).build().unwrap();
    let alloc = Allocator::new(config).unwrap();
    let keep = alloc.allocate(0, 512, Stream::DEFAULT).unwrap();
    let mut ptrs = Vec::with_capacity(sizes.len());
    let start = std::time::Instant::now();
    for _ in 0..iters {
        for &size in &sizes {
            ptrs.push(alloc.allocate(0, std::hint::black_box(size), Stream::DEFAULT).unwrap());
        }
        for p in ptrs.drain(..) {
            alloc.free(0, std::hint::black_box(p)).unwrap();
        }
    }
    let ns = start.elapsed().as_nanos() as f64 / iters as f64;
    println!("{sizes:?} B: {ns:.1} ns per iteration");
    let start = std::time::Instant::now();
    let mut raw = Vec::with_capacity(sizes.len());
    alloc
        .with_heap(0, |h| {
            for _ in 0..iters {
                for &size in &sizes {
                    raw.push(h.allocate(std::hint::black_box(size as u64), Stream::DEFAULT).unwrap());
                }
                for p in raw.drain(..) {
                    h.free(std::hint::black_box(p)).unwrap();
                }
            }
        })
        .unwrap();
    let ns = start.elapsed().as_nanos() as f64 / iters as f64;
    println!("{sizes:?} B: {ns:.1} ns per iteration without the lock");
    alloc.free(0, keep).unwrap();
}
