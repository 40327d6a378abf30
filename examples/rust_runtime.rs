//! A Rust runtime on tidepool: an inference-like loop with a buffer per
//! layer, a different sequence length every step, every buffer dropped
//! when its step is done; host data copied in and out, the results checked
//! against the same layers computed on the host, and tidepool's statistics
//! printed at the end.
//!
//! Without the `cudarc` feature the layers run on the host through the
//! backend's copies (`Buffer::copy_from_host` / `copy_to_host`):
//!   `cargo run --example rust_runtime` (backend:host unless TIDEPOOL_CONF says otherwise)
//! With it, host data goes through cudarc (`memcpy_htod`, `clone_dtoh`)
//! and each layer is a kernel launched with the buffers as arguments,
//! from PTX written below (no NVRTC):
//!   `cargo run --features cudarc --example rust_runtime` (backend:cuda: a GPU, or simgpu)
//! Arguments: `[steps] [layers]` (default 24 and 6).
//!
//! The allocator is `tidepool::global()`, the one the C ABI uses: a Rust
//! extension in a PyTorch process with tidepool installed shares its cache.

/// Elements per token of a sequence.
const HIDDEN: usize = 256;

/// Layer `l`'s weight and bias: powers of two and small integers, so that
/// device and host agree to the bit (no rounding).
fn layer_params(l: usize) -> (f32, f32) {
    (if l.is_multiple_of(2) { 2.0 } else { 0.5 }, (l % 3) as f32)
}

/// The sequence length of `step`: from 16 to 512 tokens, varying.
fn seq_len(step: usize) -> usize {
    16 + (step * 7919 + 13) % 497
}

/// The input of `step`: exact small values.
fn input(step: usize, n: usize) -> Vec<f32> {
    (0..n).map(|i| ((i * 31 + step) % 1024) as f32).collect()
}

/// What the layers compute, on the host.
fn reference(mut x: Vec<f32>, layers: usize) -> Vec<f32> {
    for l in 0..layers {
        let (w, b) = layer_params(l);
        for v in &mut x {
            *v = *v * w + b;
        }
    }
    x
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let steps: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(24);
    let layers: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(6);
    if std::env::var_os("TIDEPOOL_CONF").is_none() {
        // Before the first use of global(), on the only thread.
        let backend = if cfg!(feature = "cudarc") { "cuda" } else { "host" };
        std::env::set_var("TIDEPOOL_CONF", format!("backend:{backend}"));
    }
    let alloc = tidepool::global()?;
    let checked = run(alloc, steps, layers)?;

    let s = alloc.stats(0)?;
    println!("rust_runtime: {steps} steps of {layers} layers on backend {}, {checked} values equal to the host's", alloc.backend().name());
    println!(
        "tidepool: {} buffers from {} driver allocations; peak {} B allocated, {} B reserved; now {} B allocated, {} B cached",
        s.num_allocs,
        s.events.num_device_alloc,
        s.allocated_bytes.all.peak,
        s.reserved_bytes.all.peak,
        s.allocated_bytes.all.current,
        s.cached_free_bytes
    );
    assert_eq!(s.allocated_bytes.all.current, 0, "every buffer was dropped");
    Ok(())
}

/// Checks `got` against the host's result for `step`; returns how many values matched.
fn check(step: usize, got: &[f32], want: &[f32]) -> Result<usize, Box<dyn std::error::Error>> {
    match got.iter().zip(want).position(|(g, w)| g != w) {
        None if got.len() == want.len() => Ok(got.len()),
        at => Err(format!("step {step}: the result differs from the host's at {at:?}").into()),
    }
}

/// The layers through the backend's copies, computed on the host.
#[cfg(not(feature = "cudarc"))]
fn run(alloc: &'static tidepool::Allocator, steps: usize, layers: usize) -> Result<usize, Box<dyn std::error::Error>> {
    let stream = tidepool::Stream::DEFAULT;
    let mut checked = 0;
    for step in 0..steps {
        let n = seq_len(step) * HIDDEN;
        let host = input(step, n);
        let mut x = alloc.alloc_buffer::<f32>(0, n, stream)?;
        x.copy_from_host(&host)?;
        for l in 0..layers {
            let (w, b) = layer_params(l);
            let mut y = alloc.alloc_buffer::<f32>(0, n, stream)?;
            let values: Vec<f32> = x.to_vec()?.iter().map(|v| v * w + b).collect();
            y.copy_from_host(&values)?;
            x = y; // the layer's input buffer is dropped here
        }
        checked += check(step, &x.to_vec()?, &reference(host, layers))?;
    }
    Ok(checked)
}

/// The layer kernel: out[i] = in[i] * w + b for i < n.
#[cfg(feature = "cudarc")]
const LAYER_PTX: &str = include_str!("layer.ptx");

/// The layers as kernels on a cudarc stream, host data through cudarc.
#[cfg(feature = "cudarc")]
fn run(alloc: &'static tidepool::Allocator, steps: usize, layers: usize) -> Result<usize, Box<dyn std::error::Error>> {
    use cudarc::driver::{CudaContext, LaunchConfig, PushKernelArg};

    let ctx = CudaContext::new(0).map_err(|e| format!("CudaContext::new: {e:?}"))?;
    let stream = ctx.new_stream().map_err(|e| format!("new_stream: {e:?}"))?;
    let module = ctx.load_module(cudarc::nvrtc::Ptx::from_src(LAYER_PTX)).map_err(|e| format!("load_module: {e:?}"))?;
    let layer = module.load_function("tidepool_layer").map_err(|e| format!("load_function: {e:?}"))?;
    let mut checked = 0;
    for step in 0..steps {
        let n = seq_len(step) * HIDDEN;
        let host = input(step, n);
        let mut x = alloc.alloc_buffer_on::<f32>(&stream, n)?;
        stream.memcpy_htod(&host, &mut x).map_err(|e| format!("memcpy_htod: {e:?}"))?;
        for l in 0..layers {
            let (w, b) = layer_params(l);
            let mut y = alloc.alloc_buffer_on::<f32>(&stream, n)?;
            let count = n as u32;
            let mut launch = stream.launch_builder(&layer);
            launch.arg(&x).arg(&mut y).arg(&w).arg(&b).arg(&count);
            // SAFETY: tidepool_layer takes (const float*, float*, float, float,
            // unsigned) and touches in[i], out[i] for i < n, both buffers of n floats.
            unsafe { launch.launch(LaunchConfig::for_num_elems(count)) }.map_err(|e| format!("launch: {e:?}"))?;
            x = y; // freed on the stream: the kernel that reads it runs first
        }
        let out = stream.clone_dtoh(&x).map_err(|e| format!("clone_dtoh: {e:?}"))?;
        checked += check(step, &out, &reference(host, layers))?;
    }
    ctx.check_err().map_err(|e| format!("cudarc: {e:?}"))?;
    Ok(checked)
}
