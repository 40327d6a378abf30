//! The `host` backend: device memory stood in for by anonymous host mappings.
//!
//! Each segment is an `mmap(MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE)`:
//! real, distinct, writable addresses that cost no resident memory until
//! touched, so tests can write patterns into blocks and a 60 GiB trace
//! replays in address space alone. Each simulated device has a capacity;
//! growing past it is refused like a real out-of-memory.
//!
//! Test hooks (`faults()`) fail the Nth call, fail every call, or add latency.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use super::{Backend, BackendError, MemInfo};
use crate::Stream;

/// How an injected failure presents itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FaultKind {
    /// As if the device were full.
    OutOfMemory,
    /// As if the driver failed for another reason.
    DriverError,
}

/// Failure and latency injection, shared by all devices of one backend.
/// Every field can be changed at any time from any thread.
#[derive(Debug, Default)]
pub struct Faults {
    /// Fail the allocate call this many calls from now (1 = the next); 0: off.
    allocate_countdown: AtomicU64,
    /// Fail every allocate call.
    allocate_always: AtomicBool,
    /// Fail the release call this many calls from now; 0: off.
    release_countdown: AtomicU64,
    /// Injected failures are driver errors rather than out-of-memory.
    as_driver_error: AtomicBool,
    /// Added to every allocate and release call, in nanoseconds.
    latency_ns: AtomicU64,
}

impl Faults {
    /// Fails the `n`th allocate call from now (`n >= 1`; 0 turns it off).
    pub fn fail_nth_allocate(&self, n: u64) {
        self.allocate_countdown.store(n, Ordering::SeqCst);
    }
    /// Fails every allocate call while `on`.
    pub fn fail_every_allocate(&self, on: bool) {
        self.allocate_always.store(on, Ordering::SeqCst);
    }
    /// Fails the `n`th release call from now (`n >= 1`; 0 turns it off).
    pub fn fail_nth_release(&self, n: u64) {
        self.release_countdown.store(n, Ordering::SeqCst);
    }
    /// What injected failures look like.
    pub fn set_kind(&self, kind: FaultKind) {
        self.as_driver_error.store(kind == FaultKind::DriverError, Ordering::SeqCst);
    }
    /// Latency added to every allocate and release.
    pub fn set_latency(&self, latency: Duration) {
        self.latency_ns.store(latency.as_nanos().min(u64::MAX as u128) as u64, Ordering::SeqCst);
    }

    /// Counts one call down; true when this call must fail.
    fn countdown_hits(counter: &AtomicU64) -> bool {
        counter
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| if n == 0 { None } else { Some(n - 1) })
            .map(|before| before == 1)
            .unwrap_or(false)
    }

    fn delay(&self) {
        let ns = self.latency_ns.load(Ordering::Relaxed);
        if ns > 0 {
            std::thread::sleep(Duration::from_nanos(ns));
        }
    }

    fn injected(&self, call: &'static str) -> BackendError {
        if self.as_driver_error.load(Ordering::SeqCst) {
            BackendError::Driver { call, code: -1, message: "failure injected by a test".into() }
        } else {
            BackendError::OutOfMemory
        }
    }
}

struct HostDevice {
    capacity: u64,
    used: AtomicU64,
}

/// Simulated devices on host memory.
pub struct HostBackend {
    devices: Vec<HostDevice>,
    faults: Faults,
    allocate_calls: AtomicU64,
    release_calls: AtomicU64,
}

impl HostBackend {
    /// `devices` devices of `capacity` bytes each.
    pub fn new(devices: usize, capacity: u64) -> HostBackend {
        HostBackend {
            devices: (0..devices).map(|_| HostDevice { capacity, used: AtomicU64::new(0) }).collect(),
            faults: Faults::default(),
            allocate_calls: AtomicU64::new(0),
            release_calls: AtomicU64::new(0),
        }
    }

    /// The failure and latency injection hooks.
    pub fn faults(&self) -> &Faults {
        &self.faults
    }

    /// Successful and failed allocate calls so far.
    pub fn allocate_calls(&self) -> u64 {
        self.allocate_calls.load(Ordering::Relaxed)
    }

    /// Release calls so far.
    pub fn release_calls(&self) -> u64 {
        self.release_calls.load(Ordering::Relaxed)
    }

    fn device(&self, device: usize, call: &'static str) -> Result<&HostDevice, BackendError> {
        self.devices.get(device).ok_or_else(|| BackendError::Driver {
            call,
            code: 101, // CUDA_ERROR_INVALID_DEVICE
            message: format!("no device {device}; the host backend has {}", self.devices.len()),
        })
    }

    /// Claims `size` bytes of `dev`'s capacity; false when it would not fit.
    fn claim(dev: &HostDevice, size: u64) -> bool {
        dev.used
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |used| {
                used.checked_add(size).filter(|&total| total <= dev.capacity)
            })
            .is_ok()
    }
}

impl Backend for HostBackend {
    fn name(&self) -> &'static str {
        "host"
    }

    fn device_count(&self) -> usize {
        self.devices.len()
    }

    fn allocate(&self, device: usize, size: u64, _stream: Stream) -> Result<u64, BackendError> {
        const CALL: &str = "mmap";
        self.allocate_calls.fetch_add(1, Ordering::Relaxed);
        self.faults.delay();
        let dev = self.device(device, CALL)?;
        let always = self.faults.allocate_always.load(Ordering::SeqCst);
        if Faults::countdown_hits(&self.faults.allocate_countdown) || always {
            return Err(self.faults.injected(CALL));
        }
        let len = usize::try_from(size).map_err(|_| BackendError::OutOfMemory)?;
        if size == 0 || !Self::claim(dev, size) {
            return Err(BackendError::OutOfMemory);
        }
        // SAFETY: an anonymous private mapping at an address of the kernel's
        // choosing touches no existing memory; the result is checked below.
        let addr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if addr == libc::MAP_FAILED {
            dev.used.fetch_sub(size, Ordering::SeqCst);
            // The address space itself is exhausted: that is this device's OOM.
            return Err(BackendError::OutOfMemory);
        }
        Ok(addr as u64)
    }

    fn release(&self, device: usize, base: u64, size: u64) -> Result<(), BackendError> {
        const CALL: &str = "munmap";
        self.release_calls.fetch_add(1, Ordering::Relaxed);
        self.faults.delay();
        let dev = self.device(device, CALL)?;
        if Faults::countdown_hits(&self.faults.release_countdown) {
            return Err(self.faults.injected(CALL));
        }
        let len = usize::try_from(size).map_err(|_| BackendError::Driver {
            call: CALL,
            code: libc::EINVAL as i64,
            message: format!("segment size {size} does not fit the address space"),
        })?;
        // SAFETY: the engine only releases a range it obtained from
        // `allocate` above with this same size, exactly once, and holds no
        // block inside it any more.
        let rc = unsafe { libc::munmap(base as *mut libc::c_void, len) };
        if rc != 0 {
            let err = std::io::Error::last_os_error();
            return Err(BackendError::Driver {
                call: CALL,
                code: err.raw_os_error().unwrap_or(-1) as i64,
                message: err.to_string(),
            });
        }
        dev.used.fetch_sub(size, Ordering::SeqCst);
        Ok(())
    }

    fn mem_info(&self, device: usize) -> Result<MemInfo, BackendError> {
        let dev = self.device(device, "mem_info")?;
        let used = dev.used.load(Ordering::SeqCst);
        Ok(MemInfo { free: dev.capacity.saturating_sub(used), total: dev.capacity })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segments_are_distinct_writable_and_counted_against_capacity() {
        let backend = HostBackend::new(1, 8 << 20);
        let a = backend.allocate(0, 4 << 20, Stream::DEFAULT).unwrap();
        let b = backend.allocate(0, 4 << 20, Stream::DEFAULT).unwrap();
        assert_ne!(a, b);
        assert_eq!(backend.mem_info(0).unwrap(), MemInfo { free: 0, total: 8 << 20 });
        assert_eq!(backend.allocate(0, 512, Stream::DEFAULT), Err(BackendError::OutOfMemory));
        // SAFETY: `a` is a live 4 MiB read-write mapping made above.
        unsafe { std::ptr::write_bytes(a as *mut u8, 0xAB, 4 << 20) };
        backend.release(0, a, 4 << 20).unwrap();
        backend.release(0, b, 4 << 20).unwrap();
        assert_eq!(backend.mem_info(0).unwrap().free, 8 << 20);
    }

    #[test]
    fn injected_failures_hit_the_nth_call_or_every_call() {
        let backend = HostBackend::new(1, 1 << 30);
        backend.faults().fail_nth_allocate(2);
        let a = backend.allocate(0, 1 << 20, Stream::DEFAULT).unwrap();
        assert_eq!(backend.allocate(0, 1 << 20, Stream::DEFAULT), Err(BackendError::OutOfMemory));
        let b = backend.allocate(0, 1 << 20, Stream::DEFAULT).unwrap();
        backend.faults().fail_every_allocate(true);
        backend.faults().set_kind(FaultKind::DriverError);
        assert!(matches!(backend.allocate(0, 1 << 20, Stream::DEFAULT), Err(BackendError::Driver { .. })));
        backend.faults().fail_nth_release(1);
        assert!(backend.release(0, a, 1 << 20).is_err());
        backend.release(0, a, 1 << 20).unwrap();
        backend.release(0, b, 1 << 20).unwrap();
        assert_eq!(backend.mem_info(0).unwrap().free, 1 << 30);
    }

    #[test]
    fn a_missing_device_is_an_error_not_a_panic() {
        let backend = HostBackend::new(2, 1 << 30);
        assert!(matches!(backend.allocate(2, 512, Stream::DEFAULT), Err(BackendError::Driver { code: 101, .. })));
        assert!(backend.mem_info(7).is_err());
    }
}
