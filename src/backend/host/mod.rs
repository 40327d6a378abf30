//! The `host` backend: device memory stood in for by anonymous host mappings.
//! This file owns the simulated devices (their capacity and what is claimed
//! of it), where memory is placed, and the `Backend` implementation that
//! dispatches to the files beside it.
//!
//! Each segment is an `mmap(MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE)`:
//! real, distinct, writable addresses that cost no resident memory until
//! touched, so tests can write patterns into blocks and a 60 GiB trace
//! replays in address space alone. Each simulated device has a capacity;
//! growing past it is refused like a real out-of-memory.
//!
//! Unbacked (`HostBackend::unbacked`): addresses without memory, for a
//! replay, which never touches a block: every call is checked, counted and
//! claimed against the capacity as above, but nothing is mapped (no system
//! call), and copies are refused.
//!
//! Beside it, one job each:
//! - `faults.rs`: fault injection (`faults()`: fail the Nth call, every
//!   call, refuse host memory);
//! - `shared.rs`: the shared capacity file (`host_shared`), the capacity
//!   counted across every process that names it;
//! - `calls.rs`: call counting (the driver calls the `cuda` backend would
//!   make, device by device);
//! - `vm.rs`: virtual memory bookkeeping (reserved ranges, mapped
//!   allocations, what the driver refuses), for expandable segments;
//! - `buffer.rs`: `HostBuffer`, host memory for offloads;
//! - `tests.rs`: the backend's tests.

mod buffer;
mod calls;
mod faults;
mod shared;
#[cfg(test)]
mod tests;
mod vm;

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::sync::Mutex;

use self::buffer::map_anonymous;
pub use self::buffer::HostBuffer;
use self::calls::DriverCallCounts;
pub use self::calls::DriverCalls;
pub use self::faults::{FaultKind, Faults};
use self::shared::SharedCapacity;
use self::vm::Reserved;
use super::{Backend, BackendError, HostMemory, MemInfo};
use crate::types::Stream;

struct HostDevice {
    capacity: u64,
    used: AtomicU64,
    /// The driver calls the `cuda` backend would have made on this device.
    calls: DriverCallCounts,
}

/// Simulated devices on host memory.
pub struct HostBackend {
    devices: Vec<HostDevice>,
    shared: Option<SharedCapacity>,
    faults: Faults,
    vm_reserve_calls: AtomicU64,
    vm_map_calls: AtomicU64,
    vm_unmap_calls: AtomicU64,
    vm_move_calls: AtomicU64,
    vm_moved_bytes: AtomicU64,
    /// The reserved ranges and the allocations `vm_map` made in them.
    vm_ranges: Mutex<Reserved>,
    /// Unbacked: the next address handed out (None: real mappings).
    unbacked: Option<AtomicU64>,
}

/// The host's stand-in for the driver's mapping granularity.
pub const HOST_PAGE: u64 = 2 << 20;

/// Where an unbacked backend's addresses start (never dereferenced).
const UNBACKED_BASE: u64 = 1 << 44;

impl HostBackend {
    /// `devices` devices of `capacity` bytes each.
    pub fn new(devices: usize, capacity: u64) -> HostBackend {
        HostBackend {
            devices: (0..devices).map(|_| HostDevice { capacity, used: AtomicU64::new(0), calls: DriverCallCounts::default() }).collect(),
            shared: None,
            faults: Faults::default(),
            vm_reserve_calls: AtomicU64::new(0),
            vm_map_calls: AtomicU64::new(0),
            vm_unmap_calls: AtomicU64::new(0),
            vm_move_calls: AtomicU64::new(0),
            vm_moved_bytes: AtomicU64::new(0),
            vm_ranges: Mutex::new(Reserved::default()),
            unbacked: None,
        }
    }

    /// `devices` devices of `capacity` bytes each whose addresses have no
    /// memory behind them (a replay's): nothing is mapped, copies fail.
    pub fn unbacked(devices: usize, capacity: u64) -> HostBackend {
        HostBackend { unbacked: Some(AtomicU64::new(UNBACKED_BASE)), ..HostBackend::new(devices, capacity) }
    }

    /// Places `len` bytes with protection `prot` at `fixed` or anywhere:
    /// an anonymous mapping, or, unbacked, the next free addresses.
    ///
    /// # Safety
    /// As `map_anonymous`.
    unsafe fn place(&self, fixed: Option<u64>, len: usize, prot: libc::c_int) -> Option<u64> {
        match (&self.unbacked, fixed) {
            (Some(_), Some(addr)) => Some(addr),
            (Some(next), None) => {
                let len = (len as u64).checked_next_multiple_of(HOST_PAGE)?;
                next.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |at| at.checked_add(len)).ok()
            }
            // SAFETY: the caller's.
            (None, _) => unsafe { map_anonymous(fixed, len, prot) },
        }
    }

    /// Unmaps `[addr, addr + len)` (nothing, unbacked); the system's answer.
    ///
    /// # Safety
    /// The range must be one this backend placed, used by nothing.
    unsafe fn unplace(&self, addr: u64, len: usize) -> libc::c_int {
        if self.unbacked.is_some() {
            return 0;
        }
        // SAFETY: the caller's.
        unsafe { libc::munmap(addr as *mut libc::c_void, len) }
    }

    /// Refuses a copy on an unbacked backend.
    fn touchable(&self, call: &'static str) -> Result<(), BackendError> {
        match self.unbacked {
            Some(_) => Err(BackendError::Driver { call, code: 1, message: "an unbacked host backend holds no memory to copy".into() }),
            None => Ok(()),
        }
    }

    /// Devices whose capacity every process naming `path` shares.
    pub fn shared(devices: usize, capacity: u64, path: &Path) -> std::io::Result<HostBackend> {
        Ok(HostBackend { shared: Some(SharedCapacity::open(path, devices)?), ..HostBackend::new(devices, capacity) })
    }

    /// The failure injection hooks.
    pub fn faults(&self) -> &Faults {
        &self.faults
    }

    fn device(&self, device: usize, call: &'static str) -> Result<&HostDevice, BackendError> {
        self.devices.get(device).ok_or_else(|| BackendError::Driver {
            call,
            code: 101, // CUDA_ERROR_INVALID_DEVICE
            message: format!("no device {device}; the host backend has {}", self.devices.len()),
        })
    }

    /// Claims `size` bytes of `device`'s capacity; false when it would not fit.
    fn claim(&self, device: usize, size: u64) -> bool {
        let dev = &self.devices[device];
        if let Some(shared) = &self.shared {
            if !shared.charge(device, size as i128, dev.capacity).unwrap_or(false) {
                return false;
            }
        }
        let claimed = dev
            .used
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |used| used.checked_add(size).filter(|&total| total <= dev.capacity))
            .is_ok();
        if !claimed {
            self.unclaim(device, size, false);
        }
        claimed
    }

    /// Gives back a claim (of the shared count too, and of this process's when `local`).
    fn unclaim(&self, device: usize, size: u64, local: bool) {
        if let Some(shared) = &self.shared {
            let _ = shared.charge(device, -(size as i128), u64::MAX);
        }
        if local {
            self.devices[device].used.fetch_sub(size, Ordering::SeqCst);
        }
    }
}

impl Backend for HostBackend {
    fn name(&self) -> &'static str {
        "host"
    }

    fn device_count(&self) -> usize {
        self.devices.len()
    }

    fn driver_calls_on(&self, device: usize) -> u64 {
        self.device_driver_calls(device).total()
    }

    fn allocate(&self, device: usize, size: u64, _stream: Stream) -> Result<u64, BackendError> {
        const CALL: &str = "mmap";
        let dev = self.device(device, CALL)?;
        dev.calls.mem_alloc.fetch_add(1, Ordering::Relaxed);
        let always = self.faults.allocate_always.load(Ordering::SeqCst);
        if Faults::countdown_hits(&self.faults.allocate_countdown) || always {
            return Err(self.faults.injected(CALL));
        }
        let len = usize::try_from(size).map_err(|_| BackendError::OutOfMemory)?;
        if size == 0 || dev.capacity < size || !self.claim(device, size) {
            return Err(BackendError::OutOfMemory);
        }
        // SAFETY: an anonymous private mapping at an address of the kernel's
        // choosing touches no existing memory; the result is checked below.
        let Some(addr) = (unsafe { self.place(None, len, libc::PROT_READ | libc::PROT_WRITE) }) else {
            self.unclaim(device, size, true);
            // The address space itself is exhausted: that is this device's OOM.
            return Err(BackendError::OutOfMemory);
        };
        Ok(addr)
    }

    fn release(&self, device: usize, base: u64, size: u64, _stream: Stream) -> Result<(), BackendError> {
        const CALL: &str = "munmap";
        self.device(device, CALL)?.calls.mem_free.fetch_add(1, Ordering::Relaxed);
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
        let rc = unsafe { self.unplace(base, len) };
        if rc != 0 {
            return Err(os_error(CALL));
        }
        self.unclaim(device, size, true);
        Ok(())
    }

    fn maps_pages(&self) -> bool {
        true
    }

    fn vm_page_size(&self, _device: usize) -> Option<u64> {
        Some(HOST_PAGE)
    }

    fn vm_reserve(&self, device: usize, size: u64) -> Result<u64, BackendError> {
        self.reserve_range(device, size)
    }

    fn vm_free(&self, device: usize, base: u64, size: u64) -> Result<(), BackendError> {
        self.free_range(device, base, size)
    }

    fn vm_map(&self, device: usize, addr: u64, sizes: &[u64]) -> Result<(), BackendError> {
        self.map_pages(device, addr, sizes)
    }

    fn vm_unmap(&self, device: usize, addr: u64, len: u64) -> Result<(), BackendError> {
        self.unmap_pages(device, addr, len)
    }

    fn vm_move(&self, device: usize, from: u64, to: u64, len: u64) -> Result<(), BackendError> {
        self.move_pages(device, from, to, len)
    }

    fn copy_to_device(&self, device: usize, dst: u64, src: &[u8], _stream: Stream) -> Result<(), BackendError> {
        self.device(device, "copy_to_device")?;
        self.touchable("copy_to_device")?;
        // SAFETY: per the trait's contract, [dst, dst + src.len()) lies in a
        // live block, that is in a read-write mapping of this backend that no
        // Rust reference points into; `src` is host memory, so no overlap.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst as *mut u8, src.len()) };
        Ok(())
    }

    fn copy_to_host(&self, device: usize, src: u64, dst: &mut [u8], _stream: Stream) -> Result<(), BackendError> {
        self.device(device, "copy_to_host")?;
        self.touchable("copy_to_host")?;
        // SAFETY: per the trait's contract, [src, src + dst.len()) lies in a
        // live block, a readable mapping of this backend, distinct from `dst`.
        unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    fn host_memory(&self, len: u64) -> Result<Box<dyn HostMemory>, BackendError> {
        if self.faults.host_memory_always.load(Ordering::SeqCst) {
            return Err(BackendError::OutOfMemory);
        }
        HostBuffer::new(len).map(|b| Box::new(b) as Box<dyn HostMemory>)
    }

    fn mem_info(&self, device: usize) -> Result<MemInfo, BackendError> {
        let dev = self.device(device, "mem_info")?;
        let used = match &self.shared {
            Some(shared) => shared.used(device).map_err(|e| BackendError::Driver {
                call: "mem_info",
                code: e.raw_os_error().unwrap_or(-1) as i64,
                message: format!("cannot read the shared capacity file: {e}"),
            })?,
            None => dev.used.load(Ordering::SeqCst),
        };
        Ok(MemInfo { free: dev.capacity.saturating_sub(used), total: dev.capacity })
    }

    fn shared_device_key(&self, device: usize) -> Option<String> {
        let shared = self.shared.as_ref()?;
        let path = shared.path.canonicalize().unwrap_or_else(|_| shared.path.clone());
        // A stable name for (file, device): FNV-1a of the path.
        let hash =
            path.as_os_str().as_encoded_bytes().iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3));
        Some(format!("host-{hash:016x}-{device}"))
    }
}

/// The driver's refusal of a request it finds wrong (a range it does not
/// hold as asked), as `call`'s error.
fn invalid_value(call: &'static str, message: String) -> BackendError {
    BackendError::Driver { call, code: 1 /* CUDA_ERROR_INVALID_VALUE */, message }
}

/// The last OS error as a backend error of `call`.
fn os_error(call: &'static str) -> BackendError {
    let err = std::io::Error::last_os_error();
    BackendError::Driver { call, code: err.raw_os_error().unwrap_or(-1) as i64, message: err.to_string() }
}
