//! cudarc interop (feature `cudarc`): cudarc's copies and kernel launches
//! on tidepool buffers, in the stream order cudarc expects, over simgpu in
//! a child process (the cuda backend and cudarc share its primary context).
#![cfg(feature = "cudarc")]
#![allow(clippy::missing_transmute_annotations)]

mod common;

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaStream, LaunchConfig, PushKernelArg};
use tidepool::{Allocator, Config, Stream};

/// The layer kernel of examples/rust_runtime.rs (simgpu runs it on the host).
const LAYER_PTX: &str = include_str!("../examples/layer.ptx");

/// Runs the (ignored) child test `name` over simgpu; asserts it ran, passed
/// and printed `expected`.
fn on_simgpu(name: &str, expected: &str) {
    let dir = common::simgpu_dir();
    let (ok, text) = common::child_output(common::child_command(name).env("LD_LIBRARY_PATH", &dir).env("SIMGPU_CAPACITY", "256M"));
    assert!(ok && text.contains(expected), "{name}:\n{text}");
}

/// The cuda backend's allocator and a cudarc context and stream on device 0.
fn setup() -> (Allocator, Arc<CudaContext>, Arc<CudaStream>) {
    let config = Config::builder().conf("backend:cuda,release_after_ms:off,headroom_mb:0").unwrap().build().unwrap();
    let alloc = Allocator::new(config).unwrap();
    let ctx = CudaContext::new(0).unwrap();
    let stream = ctx.new_stream().unwrap();
    (alloc, ctx, stream)
}

#[test]
#[ignore = "child process: run by cudarc_copies_reach_a_buffer_and_come_back"]
fn child_copies() {
    common::child_only();
    let (alloc, ctx, stream) = setup();
    assert_eq!(Stream::from(&stream).0, stream.cu_stream() as u64);
    let host: Vec<f32> = (0..100_000).map(|i| i as f32 * 0.25).collect();
    let mut buf = alloc.alloc_buffer_on::<f32>(&stream, host.len()).unwrap();
    assert_eq!(buf.stream(), Stream::from(&stream));
    stream.memcpy_htod(&host, &mut buf).unwrap();
    assert_eq!(stream.clone_dtoh(&buf).unwrap(), host);
    #[allow(deprecated)]
    let old_name = stream.memcpy_dtov(&buf).unwrap();
    assert_eq!(old_name, host);
    // A buffer made from the raw handle works the same (cudarc's wrapper is made on demand).
    let mut raw = alloc.alloc_buffer::<f32>(0, host.len(), Stream::from(&stream)).unwrap();
    stream.memcpy_dtod(&buf, &mut raw).unwrap();
    let mut back = vec![0f32; host.len()];
    stream.memcpy_dtoh(&raw, &mut back).unwrap();
    assert_eq!(back, host);
    stream.memset_zeros(&mut raw).unwrap();
    assert!(stream.clone_dtoh(&raw).unwrap().iter().all(|&v| v == 0.0));
    // The backend's own copies see what cudarc wrote.
    assert_eq!(buf.to_vec().unwrap(), host);
    ctx.check_err().unwrap();
    drop((buf, raw));
    assert_eq!(alloc.stats(0).unwrap().allocated_bytes.all.current, 0);
    println!("copies: ok");
}

#[test]
fn cudarc_copies_reach_a_buffer_and_come_back() {
    on_simgpu("child_copies", "copies: ok");
}

#[test]
#[ignore = "child process: run by a_kernel_given_buffers_as_arguments_computes_what_the_host_does"]
fn child_kernel() {
    common::child_only();
    let (alloc, ctx, stream) = setup();
    let module = ctx.load_module(cudarc::nvrtc::Ptx::from_src(LAYER_PTX)).unwrap();
    let layer = module.load_function("tidepool_layer").unwrap();
    let n = 5000usize;
    let host: Vec<f32> = (0..n).map(|i| (i % 97) as f32).collect();
    let mut x = alloc.alloc_buffer_on::<f32>(&stream, n).unwrap();
    stream.memcpy_htod(&host, &mut x).unwrap();
    let mut y = alloc.alloc_buffer_on::<f32>(&stream, n).unwrap();
    let (w, b, count) = (2.0f32, 3.0f32, n as u32);
    let mut launch = stream.launch_builder(&layer);
    launch.arg(&x).arg(&mut y).arg(&w).arg(&b).arg(&count);
    // SAFETY: tidepool_layer(const float*, float*, float, float, unsigned)
    // touches in[i] and out[i] for i < n, both buffers of n floats.
    unsafe { launch.launch(LaunchConfig::for_num_elems(count)) }.unwrap();
    let want: Vec<f32> = host.iter().map(|v| v * w + b).collect();
    assert_eq!(stream.clone_dtoh(&y).unwrap(), want);
    ctx.check_err().unwrap();
    println!("kernel: ok");
}

#[test]
fn a_kernel_given_buffers_as_arguments_computes_what_the_host_does() {
    on_simgpu("child_kernel", "kernel: ok");
}

/// simgpu's test entry points for queueing work on a stream.
struct Queue {
    enqueue_sleep: unsafe extern "C" fn(u64, i64) -> i32,
    enqueue_fill: unsafe extern "C" fn(u64, u64, usize, u8, u64) -> i32,
}

impl Queue {
    fn load() -> Queue {
        let (sleep, fill) = (common::simgpu_symbol(c"simgpu_enqueue_sleep"), common::simgpu_symbol(c"simgpu_enqueue_fill"));
        // SAFETY: both are cast to their C signatures in cuda/simgpu/simgpu.c.
        unsafe { Queue { enqueue_sleep: std::mem::transmute(sleep), enqueue_fill: std::mem::transmute(fill) } }
    }
}

#[test]
#[ignore = "child process: run by a_copy_on_another_stream_waits_for_the_buffers_stream_and_holds_its_block"]
fn child_other_stream() {
    common::child_only();
    let (alloc, ctx, own) = setup();
    let other = ctx.new_stream().unwrap();
    let queue = Queue::load();
    const N: usize = 1 << 20;
    let buf = alloc.alloc_buffer_on::<u8>(&own, N).unwrap();
    // Written on its own stream, late; read by cudarc on another stream:
    // the copy waits for the write.
    // SAFETY: queues a sleep and a fill of the live buffer on its stream.
    unsafe {
        (queue.enqueue_sleep)(buf.stream().0, 200_000);
        (queue.enqueue_fill)(buf.stream().0, buf.as_device_ptr().0, N, 7, 0);
    }
    assert!(other.clone_dtoh(&buf).unwrap().iter().all(|&v| v == 7), "the other stream did not wait for the buffer's");

    // Cleared by cudarc on the other stream, late, then dropped: the block
    // is not reused before that clear has run.
    let mut buf = buf;
    // SAFETY: queues a sleep on a stream made above.
    unsafe { (queue.enqueue_sleep)(Stream::from(&other).0, 300_000) };
    other.memset_zeros(&mut buf).unwrap();
    let ptr = buf.as_device_ptr();
    drop(buf);
    let meanwhile = alloc.alloc_buffer_on::<u8>(&own, N).unwrap();
    assert_ne!(meanwhile.as_device_ptr(), ptr, "reused while the other stream may still write it");
    other.synchronize().unwrap();
    // Kernels: `use_on` does what cudarc's copies do.
    meanwhile.use_on(&other).unwrap();
    ctx.check_err().unwrap();
    drop(meanwhile);
    alloc.validate().unwrap();
    println!("other stream: ok");
}

#[test]
fn a_copy_on_another_stream_waits_for_the_buffers_stream_and_holds_its_block() {
    on_simgpu("child_other_stream", "other stream: ok");
}
