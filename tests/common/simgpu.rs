//! simgpu's streams, events and test entry points, looked up in the
//! libcuda.so a child test process loaded (simgpu, through LD_LIBRARY_PATH)
//! and cast to the C signatures cuda/simgpu/simgpu.c declares; and the
//! child tests that run over it.

use std::ffi::{c_void, CStr};

pub struct Simgpu {
    pub stream_create: unsafe extern "C" fn(*mut u64, u32) -> i32,
    pub stream_synchronize: unsafe extern "C" fn(u64) -> i32,
    pub enqueue_sleep: unsafe extern "C" fn(u64, i64) -> i32,
    pub enqueue_fill: unsafe extern "C" fn(u64, u64, usize, u8, u64) -> i32,
    pub enqueue_set_owner: unsafe extern "C" fn(u64, u64, usize, u64) -> i32,
    pub event_create: unsafe extern "C" fn(*mut u64, u32) -> i32,
    pub event_record: unsafe extern "C" fn(u64, u64) -> i32,
    pub stream_wait_event: unsafe extern "C" fn(u64, u64, u32) -> i32,
    pub violations: unsafe extern "C" fn() -> i64,
    pub event_queries: unsafe extern "C" fn() -> i64,
    pub relaxed_allocs: unsafe extern "C" fn(*mut i32) -> i64,
    pub relaxed_unmaps: unsafe extern "C" fn() -> i64,
    pub set_capturing: unsafe extern "C" fn(u64, i32) -> i32,
    pub owner_overflows: unsafe extern "C" fn() -> i64,
    pub memory_calls: unsafe extern "C" fn() -> i64,
    pub host_allocs: unsafe extern "C" fn(*mut i64) -> i64,
    pub vm_calls: unsafe extern "C" fn(*mut i64, *mut i64),
}

/// `name`'s address as the function pointer type `F`.
///
/// # Safety
/// `F` must be the C signature simgpu.c gives `name`.
unsafe fn symbol<F: Copy>(name: &CStr) -> F {
    let address: *mut c_void = super::simgpu_symbol(name);
    assert_eq!(std::mem::size_of::<F>(), std::mem::size_of::<*mut c_void>());
    // SAFETY: a function pointer of the caller's signature, the size of an address.
    unsafe { std::mem::transmute_copy(&address) }
}

impl Simgpu {
    pub fn load() -> Simgpu {
        // SAFETY: each field's type is its symbol's signature in cuda/simgpu/simgpu.c.
        unsafe {
            Simgpu {
                stream_create: symbol(c"cuStreamCreate"),
                stream_synchronize: symbol(c"cuStreamSynchronize"),
                enqueue_sleep: symbol(c"simgpu_enqueue_sleep"),
                enqueue_fill: symbol(c"simgpu_enqueue_fill"),
                enqueue_set_owner: symbol(c"simgpu_enqueue_set_owner"),
                event_create: symbol(c"cuEventCreate"),
                event_record: symbol(c"cuEventRecord"),
                stream_wait_event: symbol(c"cuStreamWaitEvent"),
                violations: symbol(c"simgpu_violations"),
                event_queries: symbol(c"simgpu_event_queries"),
                relaxed_allocs: symbol(c"simgpu_relaxed_allocs"),
                relaxed_unmaps: symbol(c"simgpu_relaxed_unmaps"),
                set_capturing: symbol(c"simgpu_set_capturing"),
                owner_overflows: symbol(c"simgpu_owner_overflows"),
                memory_calls: symbol(c"simgpu_memory_calls"),
                host_allocs: symbol(c"simgpu_host_allocs"),
                vm_calls: symbol(c"simgpu_vm_calls"),
            }
        }
    }

    /// A new simgpu stream.
    pub fn stream(&self) -> u64 {
        let mut s = 0u64;
        // SAFETY: simgpu writes a new stream handle into a local.
        assert_eq!(unsafe { (self.stream_create)(&mut s, 0) }, 0);
        s
    }
}

// ---- child tests over simgpu ----------------------------------------------

/// Runs the (ignored) child test `name` of this binary in a child process
/// with `env`: whether it ran and passed, and what it printed.
pub fn child(name: &str, env: &[(&str, &str)]) -> (bool, String) {
    super::child_output(super::child_command(name).envs(env.iter().copied()))
}

/// Runs the child test `name` over simgpu (a device of `capacity`, plus
/// `env`); asserts that it passed and returns what it printed.
pub fn on_simgpu(name: &str, capacity: &str, env: &[(&str, &str)]) -> String {
    let dir = super::simgpu_dir();
    let mut all = vec![("LD_LIBRARY_PATH", dir.to_str().unwrap()), ("SIMGPU_CAPACITY", capacity)];
    all.extend_from_slice(env);
    let (ok, text) = child(name, &all);
    assert!(ok, "{name} failed:\n{text}");
    text
}

/// Runs the child test `name` over simgpu (as `on_simgpu`) and asserts
/// that it printed `expected`.
pub fn child_prints(name: &str, capacity: &str, env: &[(&str, &str)], expected: &str) {
    let text = on_simgpu(name, capacity, env);
    assert!(text.contains(expected), "{name} with {env:?}: {expected:?} not printed:\n{text}");
}

/// The backend a child runs on: TIDEPOOL_TEST_BACKEND, `cuda` by default.
pub fn child_backend() -> String {
    std::env::var("TIDEPOOL_TEST_BACKEND").unwrap_or_else(|_| "cuda".into())
}

/// An allocator over the child's CUDA backend, with TIDEPOOL_TEST_CONF and `conf`.
pub fn cuda_allocator(conf: &str) -> tidepool::Allocator {
    let base = format!("backend:{},release_after_ms:off,headroom_mb:0", child_backend());
    let extra = std::env::var("TIDEPOOL_TEST_CONF").unwrap_or_default();
    let config = tidepool::Config::builder().conf(&base).unwrap().conf(&extra).unwrap().conf(conf).unwrap().build().unwrap();
    tidepool::Allocator::new(config).unwrap()
}
