//! A tight cached alloc+free loop, for profilers (perf, callgrind).
//! `cargo run --release --example pair_loop -- [size|mixed|buffer|ptr|c|c-ptr] [iterations] [TIDEPOOL_CONF]`
//! (TIDEPOOL_TRACE=<path> records the loop)
//! `mixed` allocates 512 B, 3 MiB and 64 KiB, then frees them, each iteration:
//! requests that go through the bins rather than the stash. `buffer` takes a
//! 512 B `Buffer<u8>` and drops it. `ptr` frees the 512 B block with
//! `free_ptr` (no device); `c` and `c-ptr` run the pair through the C ABI
//! (`tidepool_malloc`, then `tidepool_free` or `tidepool_free_ptr`) on the
//! process-wide allocator, on the host backend.
use std::ffi::c_void;
use std::hint::black_box;

use tidepool::ffi::{tidepool_free, tidepool_free_ptr, tidepool_malloc};
use tidepool::{Allocator, Config, Stream};

const S: Stream = Stream::DEFAULT;

fn main() {
    let mut args = std::env::args().skip(1);
    let mode = args.next();
    let buffer = mode.as_deref() == Some("buffer");
    let by_ptr = mode.as_deref() == Some("ptr");
    let c_abi = matches!(mode.as_deref(), Some("c" | "c-ptr"));
    let sizes: Vec<usize> = match mode.as_deref() {
        Some("mixed") => vec![512, 3 << 20, 64 << 10],
        Some("buffer" | "ptr" | "c" | "c-ptr") => vec![512],
        other => vec![other.and_then(|a| a.parse().ok()).unwrap_or(512)],
    };
    let iters: u64 = args.next().and_then(|a| a.parse().ok()).unwrap_or(10_000_000);
    let conf = args.next().unwrap_or_default();
    if c_abi {
        c_pairs(mode.as_deref() == Some("c-ptr"), iters, &conf);
        return;
    }
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
    } else if by_ptr {
        for _ in 0..iters {
            let p = alloc.allocate(0, black_box(512), S).unwrap();
            alloc.free_ptr(black_box(p)).unwrap();
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

/// The 512 B pair through the C ABI, freed with `tidepool_free_ptr` or
/// `tidepool_free`, on the host backend under `conf`.
fn c_pairs(by_ptr: bool, iters: u64, conf: &str) {
    std::env::set_var("TIDEPOOL_CONF", format!("backend:host,host_capacity_mb:1048576,{conf}"));
    let stream = std::ptr::null_mut::<c_void>();
    let keep = tidepool_malloc(512, 0, stream);
    let start = std::time::Instant::now();
    for _ in 0..iters {
        let p = tidepool_malloc(black_box(512), 0, stream);
        if by_ptr {
            assert_eq!(tidepool_free_ptr(black_box(p)), 0);
        } else {
            tidepool_free(black_box(p), 512, 0, stream);
        }
    }
    let ns = start.elapsed().as_nanos() as f64 / iters as f64;
    let free = if by_ptr { "tidepool_free_ptr" } else { "tidepool_free" };
    println!("[512] B through the C ABI ({free}): {ns:.1} ns per iteration");
    tidepool_free(keep, 512, 0, stream);
}
