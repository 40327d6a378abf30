//! A tight cached alloc+free loop, for profilers (perf, callgrind).
//! `cargo run --release --example pair_loop -- [size] [iterations]`
use tidepool::{Allocator, Config, Stream};

fn main() {
    let mut args = std::env::args().skip(1);
    let size: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(512);
    let iters: u64 = args.next().and_then(|a| a.parse().ok()).unwrap_or(10_000_000);
    let alloc = Allocator::new(Config::builder().host(1, 1 << 40).build().unwrap()).unwrap();
    let keep = alloc.allocate(0, 512, Stream::DEFAULT).unwrap();
    let start = std::time::Instant::now();
    for _ in 0..iters {
        let p = alloc.allocate(0, std::hint::black_box(size), Stream::DEFAULT).unwrap();
        alloc.free(0, std::hint::black_box(p)).unwrap();
    }
    let ns = start.elapsed().as_nanos() as f64 / iters as f64;
    println!("{size} B: {ns:.1} ns per cached pair");
    let start = std::time::Instant::now();
    alloc.with_heap(0, |h| {
        for _ in 0..iters {
            let p = h.allocate(std::hint::black_box(size as u64), Stream::DEFAULT).unwrap();
            h.free(std::hint::black_box(p)).unwrap();
        }
    }).unwrap();
    let ns = start.elapsed().as_nanos() as f64 / iters as f64;
    println!("{size} B: {ns:.1} ns per cached pair without the lock");
    alloc.free(0, keep).unwrap();
}
#[allow(dead_code)]
fn unused() {}
