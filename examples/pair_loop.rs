//! A tight cached alloc+free loop, for profilers (perf, callgrind).
//! `cargo run --release --example pair_loop -- [size|mixed|buffer] [iterations] [TIDEPOOL_CONF]`
//! (TIDEPOOL_TRACE=<path> records the loop)
//! `mixed` allocates 512 B, 3 MiB and 64 KiB, then frees them, each iteration:
//! requests that go through the bins rather than the stash. `buffer` takes a
//! 512 B `Buffer<u8>` and drops it.
use std::hint::black_box;

use tidepool::{Allocator, Config, Stream};

const S: Stream = Stream::DEFAULT;

fn main() {
    let mut args = std::env::args().skip(1);
    let mode = args.next();
    let buffer = mode.as_deref() == Some("buffer");
    let sizes: Vec<usize> = match mode.as_deref() {
        Some("mixed") => vec![512, 3 << 20, 64 << 10],
        Some("buffer") => vec![512],
        other => vec![other.and_then(|a| a.parse().ok()).unwrap_or(512)],
    };
    let iters: u64 = args.next().and_then(|a| a.parse().ok()).unwrap_or(10_000_000);
    let conf = args.next().unwrap_or_default();
    let mut builder = Config::builder().conf(&conf).expect("a valid TIDEPOOL_CONF string").host(1, 1 << 40);
    if let Some(path) = std::env::var_os("TIDEPOOL_TRACE").filter(|p| !p.is_empty()) {
        builder = builder.trace(path);
    }
    let config = builder.build().unwrap();
    let alloc = Allocator::new(config).unwrap();
    let keep = alloc.allocate(0, 512, S).unwrap();
    let start = std::time::Instant::now();
    if buffer {
        for _ in 0..iters {
            drop(black_box(alloc.alloc_buffer::<u8>(0, black_box(512), S).unwrap()));
        }
    } else if let [size] = sizes[..] {
        for _ in 0..iters {
            let p = alloc.allocate(0, black_box(size), S).unwrap();
            alloc.free(0, black_box(p)).unwrap();
        }
    } else {
        let mut ptrs = Vec::with_capacity(sizes.len());
        for _ in 0..iters {
            ptrs.extend(sizes.iter().map(|&size| alloc.allocate(0, black_box(size), S).unwrap()));
            for p in ptrs.drain(..) {
                alloc.free(0, black_box(p)).unwrap();
            }
        }
    }
    let ns = start.elapsed().as_nanos() as f64 / iters as f64;
    println!("{sizes:?} B: {ns:.1} ns per iteration");
    alloc.free(0, keep).unwrap();
}
