//! `Buffer<T>` and `global()`: typed buffers that free themselves on their
//! stream (on the host backend here, on the cuda backend over simgpu in a
//! child process), and the process-wide allocator shared with the C ABI
//! (in child processes, which read TIDEPOOL_CONF at first use).

// The simgpu entry points are looked up by name and cast to the C
// signatures declared in cuda/simgpu/simgpu.c.
#![allow(clippy::missing_transmute_annotations)]

use crate::common;

use std::process::Command;

use common::{host_allocator, simgpu_dir, MIB};
use tidepool::{AllocError, Allocator, Buffer, Config, DevicePtr, Stream};

#[test]
fn a_buffer_holds_len_elements_and_gives_its_block_back_when_dropped() {
    let (alloc, _) = host_allocator(1, 64 * MIB, "");
    let stream = Stream(7);
    let buf = alloc.alloc_buffer::<f32>(0, 1000, stream).unwrap();
    assert_eq!((buf.len(), buf.byte_len(), buf.device(), buf.stream()), (1000, 4000, 0, stream));
    assert!(!buf.is_empty() && !buf.as_device_ptr().is_null());
    let s = alloc.stats(0).unwrap();
    assert_eq!((s.requested_bytes.all.current, s.allocated_bytes.all.current), (4000, 4096));
    let ptr = buf.as_device_ptr();
    drop(buf);
    assert_eq!(alloc.stats(0).unwrap().allocated_bytes.all.current, 0);
    // Freed on its stream: the next request there gets the block back.
    assert_eq!(alloc.alloc_buffer::<u8>(0, 4000, stream).unwrap().as_device_ptr(), ptr);
    alloc.validate().unwrap();
}

#[test]
fn host_data_copied_in_comes_back_out_through_the_backend() {
    let (alloc, _) = host_allocator(1, 64 * MIB, "");
    let values: Vec<i64> = (0..10_000).map(|i| i * i - 7).collect();
    let mut buf = alloc.alloc_buffer::<i64>(0, values.len(), Stream::DEFAULT).unwrap();
    buf.copy_from_host(&values).unwrap();
    assert_eq!(buf.to_vec().unwrap(), values);
    let mut head = [0i64; 3];
    buf.copy_to_host(&mut head).unwrap();
    assert_eq!(head, [-7, -6, -3]);
    let too_long = vec![0i64; values.len() + 1];
    assert!(matches!(buf.copy_from_host(&too_long), Err(AllocError::InvalidArgument(_))));
    assert!(matches!(buf.copy_to_host(&mut vec![0i64; values.len() + 1]), Err(AllocError::InvalidArgument(_))));
}

#[test]
fn a_zero_length_buffer_is_empty_and_takes_no_memory() {
    let (alloc, _) = host_allocator(1, 64 * MIB, "");
    let empty = alloc.alloc_buffer::<f64>(0, 0, Stream::DEFAULT).unwrap();
    assert!(empty.is_empty() && empty.as_device_ptr().is_null());
    assert_eq!((empty.len(), empty.byte_len()), (0, 0));
    let zero_sized = alloc.alloc_buffer::<()>(0, 1 << 20, Stream::DEFAULT).unwrap();
    assert_eq!((zero_sized.len(), zero_sized.byte_len()), (1 << 20, 0));
    assert!(zero_sized.as_device_ptr().is_null());
    empty.record_stream(Stream(3)).unwrap();
    assert_eq!(empty.to_vec().unwrap(), Vec::<f64>::new());
    let s = alloc.stats(0).unwrap();
    assert_eq!((s.num_allocs, s.reserved_bytes.all.current), (0, 0));
    drop((empty, zero_sized));
    assert_eq!(alloc.stats(0).unwrap().events.num_invalid_frees, 0);
}

#[test]
fn a_length_whose_byte_size_overflows_is_refused_not_wrapped() {
    let (alloc, _) = host_allocator(1, 64 * MIB, "");
    // usize::MAX / 4 + 1 floats would wrap to 0 bytes.
    let err = alloc.alloc_buffer::<f32>(0, usize::MAX / 4 + 1, Stream::DEFAULT).unwrap_err();
    assert!(matches!(&err, AllocError::InvalidArgument(m) if m.to_string().contains("f32")), "{err}");
    assert_eq!(alloc.stats(0).unwrap().num_allocs, 0);
}

#[test]
fn a_buffer_the_device_cannot_hold_returns_the_oom_report() {
    let (alloc, _) = host_allocator(1, 64 * MIB, "");
    let _held = alloc.alloc_buffer::<u8>(0, (40 * MIB) as usize, Stream::DEFAULT).unwrap();
    match alloc.alloc_buffer::<u8>(0, (40 * MIB) as usize, Stream::DEFAULT) {
        Err(AllocError::OutOfMemory(report)) => {
            assert_eq!((report.device, report.requested), (0, 40 * MIB));
            assert!(report.to_string().contains("out of memory on device 0"), "{report}");
        }
        other => panic!("expected the OOM report, got {other:?}"),
    }
    alloc.validate().unwrap();
}

#[test]
fn a_buffer_moved_to_another_thread_is_freed_there() {
    fn send<T: Send>(_: &T) {}
    let (alloc, _) = host_allocator(1, 64 * MIB, "");
    let buffers: Vec<Buffer<'_, u32>> = (0..8).map(|i| alloc.alloc_buffer::<u32>(0, 1000 + i, Stream(i as u64)).unwrap()).collect();
    send(&buffers[0]);
    assert_eq!(alloc.stats(0).unwrap().num_allocs, 8);
    std::thread::scope(|scope| {
        for buf in buffers {
            scope.spawn(move || drop(buf));
        }
    });
    let s = alloc.stats(0).unwrap();
    assert_eq!((s.allocated_bytes.all.current, s.num_frees), (0, 8));
    alloc.validate().unwrap();
}

// ---- over simgpu and in child processes --------------------------------

/// Runs the (ignored) child test `name` of this binary in a child process
/// with `env`; asserts that it ran and passed and returns what it printed.
fn child(name: &str, env: &[(&str, &str)]) -> String {
    let (ok, text) = common::child_output(common::child_command(name).envs(env.iter().copied()));
    assert!(ok, "{name} failed:\n{text}");
    text
}

/// The simgpu entry points these tests use.
struct Simgpu {
    stream_create: unsafe extern "C" fn(*mut u64, u32) -> i32,
    stream_synchronize: unsafe extern "C" fn(u64) -> i32,
    event_create: unsafe extern "C" fn(*mut u64, u32) -> i32,
    event_record: unsafe extern "C" fn(u64, u64) -> i32,
    stream_wait_event: unsafe extern "C" fn(u64, u64, u32) -> i32,
    enqueue_sleep: unsafe extern "C" fn(u64, i64) -> i32,
    enqueue_fill: unsafe extern "C" fn(u64, u64, usize, u8, u64) -> i32,
    enqueue_set_owner: unsafe extern "C" fn(u64, u64, usize, u64) -> i32,
    violations: unsafe extern "C" fn() -> i64,
}

impl Simgpu {
    fn load() -> Simgpu {
        let sym = common::simgpu_symbol;
        // SAFETY: each symbol is cast to its C signature in cuda/simgpu/simgpu.c.
        unsafe {
            Simgpu {
                stream_create: std::mem::transmute(sym(c"cuStreamCreate")),
                stream_synchronize: std::mem::transmute(sym(c"cuStreamSynchronize")),
                event_create: std::mem::transmute(sym(c"cuEventCreate")),
                event_record: std::mem::transmute(sym(c"cuEventRecord")),
                stream_wait_event: std::mem::transmute(sym(c"cuStreamWaitEvent")),
                enqueue_sleep: std::mem::transmute(sym(c"simgpu_enqueue_sleep")),
                enqueue_fill: std::mem::transmute(sym(c"simgpu_enqueue_fill")),
                enqueue_set_owner: std::mem::transmute(sym(c"simgpu_enqueue_set_owner")),
                violations: std::mem::transmute(sym(c"simgpu_violations")),
            }
        }
    }

    fn stream(&self) -> Stream {
        let mut s = 0u64;
        // SAFETY: simgpu writes a new stream handle into a local.
        assert_eq!(unsafe { (self.stream_create)(&mut s, 0) }, 0);
        Stream(s)
    }

    /// Makes `waiter` wait for the work queued on `on` so far.
    fn join(&self, waiter: Stream, on: Stream) {
        let mut event = 0u64;
        // SAFETY: plain simgpu calls on streams made by `stream` and a new event.
        unsafe {
            assert_eq!((self.event_create)(&mut event, 0), 0);
            assert_eq!((self.event_record)(event, on.0), 0);
            assert_eq!((self.stream_wait_event)(waiter.0, event, 0), 0);
        }
    }

    /// Names `tag` the owner of the buffer's block in its stream's order,
    /// as a new allocation's first work would be.
    fn own(&self, buf: &Buffer<'_, u8>, tag: u64) {
        // SAFETY: queues work on the live block of `buf`, on its stream.
        unsafe { (self.enqueue_set_owner)(buf.stream().0, buf.as_device_ptr().0, buf.len(), tag) };
    }

    /// Queues on `stream`, after `micros` of sleep, a write of the whole
    /// buffer by `tag` (a violation if `tag` no longer owns it then).
    fn write_late(&self, stream: Stream, buf: &Buffer<'_, u8>, micros: i64, tag: u64) {
        // SAFETY: queues work on `stream` over the live block of `buf`.
        unsafe {
            (self.enqueue_sleep)(stream.0, micros);
            (self.enqueue_fill)(stream.0, buf.as_device_ptr().0, buf.len(), tag as u8, tag);
        }
    }

    fn synchronize(&self, streams: &[Stream]) {
        for s in streams {
            // SAFETY: waits for a stream made by `stream`.
            unsafe { (self.stream_synchronize)(s.0) };
        }
    }

    fn violations(&self) -> i64 {
        // SAFETY: reads simgpu's counter.
        unsafe { (self.violations)() }
    }
}

/// The child side: buffers dropped with work still queued, on their own
/// stream and on another recorded with `record_stream`; simgpu's detector
/// counts writes that land in memory another allocation owns by then.
#[test]
#[ignore = "child process: run by a_dropped_buffer_is_not_reused_until_its_streams_work_is_done"]
fn child_drop_frees_on_the_buffers_stream() {
    common::child_only();
    const SIZE: usize = MIB as usize;
    let config = Config::builder().conf("backend:cuda,release_after_ms:off,headroom_mb:0").unwrap().build().unwrap();
    let alloc = Allocator::new(config).unwrap();
    let sim = Simgpu::load();
    let (s, t) = (sim.stream(), sim.stream());

    // Dropped while its stream still has 200 ms of work on it: a buffer
    // on another stream does not get the block before that work ran
    // (pools are per stream; a block lent across streams waits for an event).
    let a = alloc.alloc_buffer::<u8>(0, SIZE, s).unwrap();
    sim.own(&a, 1);
    sim.write_late(s, &a, 200_000, 1);
    let a_ptr = a.as_device_ptr();
    drop(a);
    let b = alloc.alloc_buffer::<u8>(0, SIZE, t).unwrap();
    sim.own(&b, 2);
    sim.write_late(t, &b, 0, 2);
    // On its own stream the block comes back at once: later work there runs after.
    let c = alloc.alloc_buffer::<u8>(0, SIZE, s).unwrap();
    assert_eq!(c.as_device_ptr(), a_ptr, "freed on its stream, reused in that stream's order");
    sim.own(&c, 3);
    sim.write_late(s, &c, 0, 3);

    // Used on another stream and recorded: not reused until that stream ran.
    let d = alloc.alloc_buffer::<u8>(0, SIZE, s).unwrap();
    sim.own(&d, 4);
    sim.join(t, s);
    sim.write_late(t, &d, 200_000, 4);
    d.record_stream(t).unwrap();
    let d_ptr = d.as_device_ptr();
    drop(d);
    let e = alloc.alloc_buffer::<u8>(0, SIZE, s).unwrap();
    assert_ne!(e.as_device_ptr(), d_ptr, "reused while the recorded stream may still write it");
    sim.own(&e, 5);
    sim.write_late(s, &e, 0, 5);
    sim.synchronize(&[s, t]);
    let with_records = sim.violations();

    // The control: the same without record_stream is caught by the detector.
    let f = alloc.alloc_buffer::<u8>(0, SIZE, s).unwrap();
    sim.own(&f, 6);
    sim.join(t, s);
    sim.write_late(t, &f, 200_000, 6);
    drop(f);
    let g = alloc.alloc_buffer::<u8>(0, SIZE, s).unwrap();
    sim.own(&g, 7);
    sim.synchronize(&[s, t]);
    let without = sim.violations() - with_records;
    drop((b, c, e, g));
    assert_eq!(alloc.stats(0).unwrap().allocated_bytes.all.current, 0);
    alloc.validate().unwrap();
    println!("violations: {with_records} with record_stream, {without} without");
}

#[test]
fn a_dropped_buffer_is_not_reused_until_its_streams_work_is_done() {
    let dir = simgpu_dir();
    let text = child("child_drop_frees_on_the_buffers_stream", &[("LD_LIBRARY_PATH", dir.to_str().unwrap()), ("SIMGPU_CAPACITY", "256M")]);
    let at = text.find("violations: ").unwrap_or_else(|| panic!("{text}")) + "violations: ".len();
    let counts: Vec<i64> = text[at..].split_whitespace().filter_map(|w| w.parse().ok()).take(2).collect();
    assert_eq!(counts[0], 0, "a block was reused under queued work:\n{text}");
    assert!(counts[1] > 0, "the detector missed the reuse without record_stream: the check would prove nothing:\n{text}");
}

/// The child side: `global()` is the allocator behind the C ABI: what Rust
/// allocates the C statistics count, and the reverse.
#[test]
#[ignore = "child process: run by global_is_the_allocator_the_c_abi_uses_whoever_comes_first"]
fn child_global_is_the_c_abis_allocator() {
    use tidepool::ffi::{tidepool_free, tidepool_get_stats, tidepool_malloc, tidepool_stats, TIDEPOOL_OK};
    common::child_only();
    let c_allocated = || {
        let mut stats = tidepool_stats { size: std::mem::size_of::<tidepool_stats>() as u32, ..Default::default() };
        assert_eq!(tidepool_get_stats(0, &mut stats), TIDEPOOL_OK);
        (stats.allocated_bytes, stats.num_allocs)
    };
    // Rust first: global() makes the allocator the C ABI then uses.
    let alloc = tidepool::global().unwrap();
    assert!(std::ptr::eq(alloc, tidepool::global().unwrap()));
    assert_eq!(alloc.backend().name(), "host");
    let buf = alloc.alloc_buffer::<f32>(0, 1024, Stream::DEFAULT).unwrap();
    assert_eq!(c_allocated(), (4096, 1), "the C ABI sees the Rust buffer");
    let ptr = tidepool_malloc(8192, 0, std::ptr::null_mut());
    assert!(!ptr.is_null());
    let s = alloc.stats(0).unwrap();
    assert_eq!((s.allocated_bytes.all.current, s.num_allocs), (4096 + 8192, 2), "Rust sees the C allocation");
    drop(buf);
    assert_eq!(c_allocated().0, 8192);
    tidepool_free(ptr, 8192, 0, std::ptr::null_mut());
    assert_eq!(alloc.stats(0).unwrap().allocated_bytes.all.current, 0);

    // A fork child gets a fresh allocator; the parent's buffers drop quietly there.
    let parents = alloc.alloc_buffer::<u8>(0, 1 << 20, Stream::DEFAULT).unwrap();
    // SAFETY: the child below only allocates through tidepool and malloc
    // (glibc resets its own locks in the child) and leaves with _exit.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        let code = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let Ok(fresh) = tidepool::global() else { return 2 };
            if std::ptr::eq(fresh, alloc) || alloc.stats(0).is_ok() {
                return 3;
            }
            let Ok(own) = fresh.alloc_buffer::<u8>(0, 4096, Stream::DEFAULT) else { return 4 };
            if fresh.stats(0).map(|s| s.allocated_bytes.all.current) != Ok(4096) || c_allocated().0 != 4096 {
                return 5;
            }
            drop(own);
            drop(parents); // the parent's allocator refuses: nothing happens, nothing panics
            0
        }))
        .unwrap_or(9);
        // SAFETY: leaves the child at once, running no destructors or exit handlers.
        unsafe { libc::_exit(code) };
    }
    let mut status = 0;
    // SAFETY: waits for the child made above.
    unsafe { libc::waitpid(pid, &mut status, 0) };
    assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0, "fork child failed check {}", libc::WEXITSTATUS(status));
    assert_eq!(c_allocated().0, 1 << 20, "the parent's buffer is still the parent's");
    drop(parents);
    assert_eq!(c_allocated().0, 0);
    println!("global: ok");
}

/// The child side, C first: the C ABI makes the allocator, global() returns it.
#[test]
#[ignore = "child process: run by global_is_the_allocator_the_c_abi_uses_whoever_comes_first"]
fn child_the_c_abi_first() {
    common::child_only();
    let ptr = tidepool::ffi::tidepool_malloc(512, 0, std::ptr::null_mut());
    assert!(!ptr.is_null());
    let alloc = tidepool::global().unwrap();
    assert_eq!(alloc.stats(0).unwrap().allocated_bytes.all.current, 512);
    assert!(alloc.free(0, DevicePtr(ptr as u64)).is_ok(), "the C allocation is the global allocator's to free");
    println!("global: ok");
}

#[test]
fn global_is_the_allocator_the_c_abi_uses_whoever_comes_first() {
    let conf = [("TIDEPOOL_CONF", "backend:host,host_capacity_mb:256")];
    for name in ["child_global_is_the_c_abis_allocator", "child_the_c_abi_first"] {
        let text = child(name, &conf);
        assert!(text.contains("global: ok"), "{name}:\n{text}");
    }
}

/// Runs examples/rust_runtime with this build's features: over the host
/// backend without `cudarc`, over simgpu (cudarc copies, the PTX kernel
/// run by simgpu on the host) with it.
#[test]
fn the_rust_runtime_example_computes_what_the_host_does() {
    let mut command = Command::new(env!("CARGO"));
    command.args(["run", "--quiet", "--example", "rust_runtime", "--manifest-path", concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml")]);
    let expected = if cfg!(feature = "cudarc") {
        command.args(["--features", "cudarc"]).env("LD_LIBRARY_PATH", simgpu_dir()).env("TIDEPOOL_CONF", "backend:cuda");
        "on backend cuda"
    } else {
        command.env("TIDEPOOL_CONF", "backend:host");
        "on backend host"
    };
    let out = common::contained(command.args(["--", "12", "4"])).output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "rust_runtime failed:\n{text}");
    assert!(text.contains(expected) && text.contains("equal to the host's"), "{text}");
    assert!(text.contains("now 0 B allocated"), "{text}");
}
