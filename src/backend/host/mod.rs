//! The `host` backend: device memory stood in for by anonymous host mappings.
//!
//! Each segment is an `mmap(MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE)`:
//! real, distinct, writable addresses that cost no resident memory until
//! touched, so tests can write patterns into blocks and a 60 GiB trace
//! replays in address space alone. Each simulated device has a capacity;
//! growing past it is refused like a real out-of-memory.
//!
//! With a shared capacity file (`host_shared`), the capacity is counted
//! across every process that names the same file, as several processes
//! share one GPU, each process's share given back when it ends (`shared.rs`).
//!
//! Virtual memory, for expandable segments: a range is reserved with an
//! inaccessible `PROT_NONE` mapping, pages are committed by mapping fresh
//! read-write memory over them (`MAP_FIXED`) and released by mapping
//! `PROT_NONE` over them again, which drops their contents. Pages count
//! against the capacity while mapped; reserved ranges count for nothing.
//! The backend keeps the allocations each `vm_map` made, refuses to unmap
//! or move part of one, as the driver does, and counts, device by device,
//! the driver calls the `cuda` backend would make for the same requests
//! (`device_driver_calls`, `driver_calls` for all devices).
//!
//! Test hooks (`faults()`) fail the Nth call, fail every call, or add
//! latency. The allocate hooks also hit `vm_map` (both take memory), the
//! release hooks `vm_unmap`; `fail_host_memory` refuses host memory
//! (`host_memory`, a paused tag's offload).
//!
//! Unbacked (`HostBackend::unbacked`): addresses without memory, for a
//! replay, which never touches a block: every call is checked, counted and
//! claimed against the capacity as above, but nothing is mapped (no system
//! call), and copies are refused.
//!
//! `HostBuffer` is the host memory every backend without pinned memory
//! hands out for offloads: an anonymous mapping, zero pages until written.

mod shared;

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use crate::sync::Mutex;

use self::shared::SharedCapacity;
use super::{Backend, BackendError, HostMemory, HostRegion, MemInfo};
use crate::page_map::PageMap;
use crate::types::Stream;

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
    /// Refuse host memory (`host_memory`).
    host_memory_always: AtomicBool,
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
    /// Refuses host memory (`host_memory`) while `on`.
    pub fn fail_host_memory(&self, on: bool) {
        self.host_memory_always.store(on, Ordering::SeqCst);
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

/// The driver calls the `cuda` backend makes, counted for the same requests.
#[derive(Default)]
struct DriverCallCounts {
    mem_alloc: AtomicU64,
    mem_free: AtomicU64,
    address_reserve: AtomicU64,
    address_free: AtomicU64,
    create: AtomicU64,
    release: AtomicU64,
    map: AtomicU64,
    unmap: AtomicU64,
    set_access: AtomicU64,
}

/// The driver calls the `cuda` backend would have made for the requests a
/// `HostBackend` served (on one device, or all): what a replay reports as
/// driver calls.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DriverCalls {
    /// `cuMemAlloc` and `cuMemFree`: segments.
    pub mem_alloc: u64,
    pub mem_free: u64,
    /// `cuMemAddressReserve` and `cuMemAddressFree`: ranges of address space.
    pub address_reserve: u64,
    pub address_free: u64,
    /// `cuMemCreate` and `cuMemRelease`: physical allocations.
    pub create: u64,
    pub release: u64,
    /// `cuMemMap` and `cuMemUnmap`: an allocation placed or taken away.
    pub map: u64,
    pub unmap: u64,
    /// `cuMemSetAccess`: once per run mapped or moved.
    pub set_access: u64,
}

impl DriverCalls {
    /// Every call.
    pub fn total(&self) -> u64 {
        self.mem_alloc
            + self.mem_free
            + self.address_reserve
            + self.address_free
            + self.create
            + self.release
            + self.map
            + self.unmap
            + self.set_access
    }
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

    /// The failure and latency injection hooks.
    pub fn faults(&self) -> &Faults {
        &self.faults
    }

    /// Successful and failed allocate calls so far, on every device.
    pub fn allocate_calls(&self) -> u64 {
        self.driver_calls().mem_alloc
    }

    /// Release calls so far, on every device.
    pub fn release_calls(&self) -> u64 {
        self.driver_calls().mem_free
    }

    /// Successful `vm_reserve` calls so far.
    pub fn vm_reserve_calls(&self) -> u64 {
        self.vm_reserve_calls.load(Ordering::Relaxed)
    }

    /// `vm_map` and `vm_unmap` calls so far.
    pub fn vm_calls(&self) -> (u64, u64) {
        (self.vm_map_calls.load(Ordering::Relaxed), self.vm_unmap_calls.load(Ordering::Relaxed))
    }

    /// `vm_move` calls so far, and the bytes they moved.
    pub fn vm_moves(&self) -> (u64, u64) {
        (self.vm_move_calls.load(Ordering::Relaxed), self.vm_moved_bytes.load(Ordering::Relaxed))
    }

    /// The driver calls the `cuda` backend would have made so far, on
    /// every device (a call naming no device of this backend makes none).
    pub fn driver_calls(&self) -> DriverCalls {
        (0..self.devices.len()).map(|device| self.device_driver_calls(device)).fold(DriverCalls::default(), |sum, d| DriverCalls {
            mem_alloc: sum.mem_alloc + d.mem_alloc,
            mem_free: sum.mem_free + d.mem_free,
            address_reserve: sum.address_reserve + d.address_reserve,
            address_free: sum.address_free + d.address_free,
            create: sum.create + d.create,
            release: sum.release + d.release,
            map: sum.map + d.map,
            unmap: sum.unmap + d.unmap,
            set_access: sum.set_access + d.set_access,
        })
    }

    /// The driver calls the `cuda` backend would have made so far on
    /// `device` (none for a device this backend does not have).
    pub fn device_driver_calls(&self, device: usize) -> DriverCalls {
        let Some(HostDevice { calls: d, .. }) = self.devices.get(device) else { return DriverCalls::default() };
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        DriverCalls {
            mem_alloc: get(&d.mem_alloc),
            mem_free: get(&d.mem_free),
            address_reserve: get(&d.address_reserve),
            address_free: get(&d.address_free),
            create: get(&d.create),
            release: get(&d.release),
            map: get(&d.map),
            unmap: get(&d.unmap),
            set_access: get(&d.set_access),
        }
    }

    /// As the driver: each allocation of `sizes` made (`cuMemCreate`) and
    /// mapped from `addr` in turn; the first that does not fit ends it, and
    /// the ones made go.
    fn map_each(&self, device: usize, addr: u64, sizes: &[u64]) -> Result<(), BackendError> {
        let mut made: Vec<(u64, u64)> = Vec::new();
        let mut failed = None;
        let mut at = addr;
        for &each in sizes {
            self.calls(device).create.fetch_add(1, Ordering::Relaxed);
            if !self.claim(device, each) {
                failed = Some(BackendError::OutOfMemory);
                break;
            }
            self.calls(device).map.fetch_add(1, Ordering::Relaxed);
            // SAFETY: [at, at + each) lies in a range this backend reserved
            // and the engine maps only pages it holds no mapping of;
            // MAP_FIXED replaces the inaccessible placeholder there and
            // nothing else.
            if unsafe { self.place(Some(at), each as usize, libc::PROT_READ | libc::PROT_WRITE) }.is_none() {
                self.unclaim(device, each, true);
                failed = Some(BackendError::OutOfMemory);
                break;
            }
            made.push((at, each));
            at += each;
        }
        let Some(err) = failed else { return Ok(()) };
        for (at, each) in made {
            self.calls(device).unmap.fetch_add(1, Ordering::Relaxed);
            self.calls(device).release.fetch_add(1, Ordering::Relaxed);
            // SAFETY: mapped just above, used by nothing yet.
            unsafe { self.place(Some(at), each as usize, libc::PROT_NONE) };
            self.unclaim(device, each, true);
        }
        Err(err)
    }

    /// The driver calls counted on `device`, a device of this backend.
    fn calls(&self, device: usize) -> &DriverCallCounts {
        &self.devices[device].calls
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
        self.faults.delay();
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
        self.faults.delay();
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
        const CALL: &str = "mmap(PROT_NONE)";
        self.device(device, CALL)?;
        self.calls(device).address_reserve.fetch_add(1, Ordering::Relaxed);
        let len = usize::try_from(size).map_err(|_| BackendError::OutOfMemory)?;
        // Over-reserve by a page so the range can start on a page boundary.
        let padded = len.checked_add(HOST_PAGE as usize).ok_or(BackendError::OutOfMemory)?;
        // SAFETY: an inaccessible anonymous mapping at an address of the
        // kernel's choosing touches no existing memory; checked below.
        let Some(addr) = (unsafe { self.place(None, padded, libc::PROT_NONE) }) else {
            return Err(BackendError::OutOfMemory);
        };
        let start = addr;
        let base = start.next_multiple_of(HOST_PAGE);
        let (head, tail) = ((base - start) as usize, padded - (base - start) as usize - len);
        // SAFETY: both trims lie inside the mapping just made, outside [base, base + len).
        unsafe {
            if head > 0 {
                self.unplace(addr, head);
            }
            if tail > 0 {
                self.unplace(base + size, tail);
            }
        }
        self.vm_reserve_calls.fetch_add(1, Ordering::Relaxed);
        self.vm_ranges.lock().add(base, size);
        Ok(base)
    }

    fn vm_free(&self, device: usize, base: u64, size: u64) -> Result<(), BackendError> {
        const CALL: &str = "munmap";
        self.device(device, CALL)?;
        self.calls(device).address_free.fetch_add(1, Ordering::Relaxed);
        self.vm_ranges.lock().remove(base, size).map_err(|message| invalid_value(CALL, message))?;
        // SAFETY: the range was reserved above (just checked, and forgotten
        // now) with no page of it mapped, and the engine holds no block in it.
        let rc = unsafe { self.unplace(base, size as usize) };
        if rc != 0 {
            return Err(os_error(CALL));
        }
        Ok(())
    }

    fn vm_map(&self, device: usize, addr: u64, sizes: &[u64]) -> Result<(), BackendError> {
        const CALL: &str = "mmap(MAP_FIXED)";
        self.vm_map_calls.fetch_add(1, Ordering::Relaxed);
        self.faults.delay();
        self.device(device, CALL)?;
        if sizes.is_empty() || sizes.iter().any(|&n| n == 0 || !n.is_multiple_of(HOST_PAGE) || n / HOST_PAGE > u64::from(u32::MAX)) {
            return Err(invalid_value(CALL, format!("allocations of {sizes:?} bytes")));
        }
        let total = sizes.iter().sum();
        let mut ranges = self.vm_ranges.lock();
        let (range, first, _) = ranges.unmapped(addr, total).map_err(|message| invalid_value(CALL, message))?;
        let always = self.faults.allocate_always.load(Ordering::SeqCst);
        if Faults::countdown_hits(&self.faults.allocate_countdown) || always {
            self.calls(device).create.fetch_add(1, Ordering::Relaxed);
            return Err(self.faults.injected(CALL));
        }
        if self.unbacked.is_some() && self.claim(device, total) {
            // Unbacked, when all of them fit, there is nothing to place: the
            // allocations are made and mapped in one count.
            self.calls(device).create.fetch_add(sizes.len() as u64, Ordering::Relaxed);
            self.calls(device).map.fetch_add(sizes.len() as u64, Ordering::Relaxed);
        } else {
            self.map_each(device, addr, sizes)?;
        }
        self.calls(device).set_access.fetch_add(1, Ordering::Relaxed);
        mark_mapped(&mut ranges.ranges[range].1, first, sizes);
        Ok(())
    }

    fn vm_unmap(&self, device: usize, addr: u64, len: u64) -> Result<(), BackendError> {
        const CALL: &str = "mmap(PROT_NONE, MAP_FIXED)";
        self.vm_unmap_calls.fetch_add(1, Ordering::Relaxed);
        self.faults.delay();
        self.device(device, CALL)?;
        let mut ranges = self.vm_ranges.lock();
        let (range, first, count) = ranges.whole(addr, len).map_err(|message| invalid_value(CALL, message))?;
        if Faults::countdown_hits(&self.faults.release_countdown) {
            self.calls(device).unmap.fetch_add(1, Ordering::Relaxed);
            return Err(self.faults.injected(CALL));
        }
        // SAFETY: [addr, addr + len) holds pages mapped by `vm_map` that no
        // block uses; an inaccessible placeholder replaces them, dropping
        // their contents, and the range stays reserved.
        let placed = unsafe { self.place(Some(addr), len as usize, libc::PROT_NONE) };
        if placed.is_none() {
            return Err(os_error(CALL));
        }
        let pages = &mut ranges.ranges[range].1;
        let n = pages.allocation_count(first, count);
        pages.set_unmapped(first, count);
        self.calls(device).unmap.fetch_add(n, Ordering::Relaxed);
        self.calls(device).release.fetch_add(n, Ordering::Relaxed);
        self.unclaim(device, len, true);
        Ok(())
    }

    fn vm_move(&self, device: usize, from: u64, to: u64, len: u64) -> Result<(), BackendError> {
        const CALL: &str = "mmap(MAP_FIXED)";
        self.vm_move_calls.fetch_add(1, Ordering::Relaxed);
        self.faults.delay();
        self.device(device, CALL)?;
        let mut ranges = self.vm_ranges.lock();
        let refused = |message| invalid_value(CALL, message);
        let (source, first, count) = ranges.whole(from, len).map_err(refused)?;
        let (target, to_first, _) = ranges.unmapped(to, len).map_err(refused)?;
        if Faults::countdown_hits(&self.faults.allocate_countdown) || self.faults.allocate_always.load(Ordering::SeqCst) {
            self.calls(device).unmap.fetch_add(1, Ordering::Relaxed);
            self.calls(device).map.fetch_add(1, Ordering::Relaxed);
            return Err(self.faults.injected(CALL));
        }
        // The device's count does not change: the memory only moves.
        // SAFETY: [to, to + len) lies in a range this backend reserved and
        // holds no mapping (the engine's page map says so); MAP_FIXED
        // replaces the inaccessible placeholder there and nothing else.
        if unsafe { self.place(Some(to), len as usize, libc::PROT_READ | libc::PROT_WRITE) }.is_none() {
            return Err(BackendError::OutOfMemory);
        }
        // SAFETY: [from, from + len) holds pages mapped by this backend that
        // no block uses; a placeholder replaces them and the range stays
        // reserved.
        if unsafe { self.place(Some(from), len as usize, libc::PROT_NONE) }.is_none() {
            // SAFETY: `to` was mapped just above and nothing uses it yet.
            let _ = unsafe { self.place(Some(to), len as usize, libc::PROT_NONE) };
            return Err(os_error(CALL));
        }
        // Each allocation unmapped from `from` and mapped at `to`, then
        // access granted over the run.
        let moved: Vec<(u64, u64)> = ranges.ranges[source].1.allocations_in(first, count).collect();
        ranges.ranges[source].1.set_unmapped(first, count);
        for &(page, n) in &moved {
            ranges.ranges[target].1.set_mapped(to_first + (page - first), n, n);
        }
        let n = moved.len() as u64;
        self.calls(device).unmap.fetch_add(n, Ordering::Relaxed);
        self.calls(device).map.fetch_add(n, Ordering::Relaxed);
        self.calls(device).set_access.fetch_add(1, Ordering::Relaxed);
        self.vm_moved_bytes.fetch_add(len, Ordering::Relaxed);
        Ok(())
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

/// An anonymous private mapping of `len` bytes with protection `prot`, at
/// `fixed` (replacing whatever was mapped there) or where the kernel
/// chooses; its address, or None when mmap fails.
///
/// # Safety
/// With `fixed`, `[fixed, fixed + len)` must be address space this backend
/// reserved, holding nothing anyone still uses.
unsafe fn map_anonymous(fixed: Option<u64>, len: usize, prot: libc::c_int) -> Option<u64> {
    let flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE | if fixed.is_some() { libc::MAP_FIXED } else { 0 };
    let at = fixed.map_or(std::ptr::null_mut(), |addr| addr as *mut libc::c_void);
    // SAFETY: an anonymous mapping reads no file; at a fixed address it
    // replaces only what the caller vouches for.
    let addr = unsafe { libc::mmap(at, len, prot, flags, -1, 0) };
    (addr != libc::MAP_FAILED).then_some(addr as u64)
}

/// Host memory from an anonymous private mapping (zero pages until
/// written), unmapped when dropped.
pub struct HostBuffer {
    region: HostRegion,
}

impl HostBuffer {
    /// `len` bytes (`len > 0`); `OutOfMemory` when the kernel refuses.
    pub fn new(len: u64) -> Result<HostBuffer, BackendError> {
        let len = usize::try_from(len).ok().filter(|&l| l > 0).ok_or(BackendError::OutOfMemory)?;
        // SAFETY: a new mapping where the kernel chooses replaces nothing.
        let addr = unsafe { map_anonymous(None, len, libc::PROT_READ | libc::PROT_WRITE) }.ok_or(BackendError::OutOfMemory)?;
        // Written whole by the offload: huge pages make that one fault per
        // 2 MiB instead of per 4 KiB (a hint; refused, nothing changes).
        // SAFETY: advice on the mapping just made, which this buffer owns.
        unsafe { libc::madvise(addr as *mut libc::c_void, len, libc::MADV_HUGEPAGE) };
        // SAFETY: the mapping just made is read-write and this buffer's
        // alone until it unmaps it on drop.
        Ok(HostBuffer { region: unsafe { HostRegion::new(addr as usize, len) } })
    }
}

impl HostMemory for HostBuffer {
    fn bytes(&self) -> &[u8] {
        self.region.bytes()
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        self.region.bytes_mut()
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        // SAFETY: the mapping was made in `new`, is unmapped once, and no
        // slice into it outlives the borrow of self that made it.
        unsafe { libc::munmap(self.region.addr as *mut libc::c_void, self.region.len) };
    }
}

/// The ranges `vm_reserve` made, in address order, each with a page map
/// of the allocations `vm_map` placed in it: what the driver knows, so that
/// the backend refuses what the driver refuses (a map over mapped pages or
/// outside a reservation, an unmap or move of part of an allocation) and
/// counts the calls it makes per allocation. A page map reads a range's
/// allocations in address order a word of 64 pages at a time.
#[derive(Default)]
struct Reserved {
    ranges: Vec<(u64, PageMap)>,
}

impl Reserved {
    fn add(&mut self, base: u64, size: u64) {
        let at = self.ranges.partition_point(|(b, _)| *b < base);
        self.ranges.insert(at, (base, PageMap::new(size.next_multiple_of(HOST_PAGE), HOST_PAGE)));
    }

    /// Forgets the range reserved at `base`, refused while a page of it is mapped.
    fn remove(&mut self, base: u64, size: u64) -> Result<(), String> {
        let at = self.ranges.partition_point(|(b, _)| *b < base);
        match self.ranges.get(at) {
            Some((b, pages)) if *b == base && pages.page_count() == size.div_ceil(HOST_PAGE) => {
                if pages.mapped_bytes() > 0 {
                    return Err(format!("the range at {base:#x} still has {} bytes mapped", pages.mapped_bytes()));
                }
                self.ranges.remove(at);
                Ok(())
            }
            _ => Err(format!("no range of {size} bytes is reserved at {base:#x}")),
        }
    }

    /// The range holding `[addr, addr + len)` (whole pages): its index, the first page and the pages.
    fn locate(&self, addr: u64, len: u64) -> Result<(usize, u64, u64), String> {
        let outside = || format!("[{addr:#x}, {:#x}) is not whole pages of one reserved range", addr.saturating_add(len));
        if len == 0 || !addr.is_multiple_of(HOST_PAGE) || !len.is_multiple_of(HOST_PAGE) {
            return Err(outside());
        }
        let at = self.ranges.partition_point(|(b, _)| *b <= addr).checked_sub(1).ok_or_else(outside)?;
        let (base, pages) = &self.ranges[at];
        let (first, count) = ((addr - base) / HOST_PAGE, len / HOST_PAGE);
        if first + count > pages.page_count() {
            return Err(outside());
        }
        Ok((at, first, count))
    }

    /// As `locate`, for pages none of which is mapped.
    fn unmapped(&self, addr: u64, len: u64) -> Result<(usize, u64, u64), String> {
        let (at, first, count) = self.locate(addr, len)?;
        if self.ranges[at].1.next_mapped(first, first + count) < first + count {
            return Err(format!("[{addr:#x}, {:#x}) holds mapped pages", addr + len));
        }
        Ok((at, first, count))
    }

    /// As `locate`, for pages that are whole allocations.
    fn whole(&self, addr: u64, len: u64) -> Result<(usize, u64, u64), String> {
        let (at, first, count) = self.locate(addr, len)?;
        if !self.ranges[at].1.whole(first, count) {
            return Err(format!("[{addr:#x}, {:#x}) is not whole allocations", addr + len));
        }
        Ok((at, first, count))
    }
}

/// Marks allocations of `sizes` bytes, side by side from `first`, mapped in
/// `pages`: allocations of one size in one mark.
fn mark_mapped(pages: &mut PageMap, first: u64, sizes: &[u64]) {
    let mut page = first;
    for same in sizes.chunk_by(|a, b| a == b) {
        let each = same[0] / HOST_PAGE;
        pages.set_mapped(page, each * same.len() as u64, each);
        page += each * same.len() as u64;
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
        backend.release(0, a, 4 << 20, Stream::DEFAULT).unwrap();
        backend.release(0, b, 4 << 20, Stream::DEFAULT).unwrap();
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
        assert!(backend.release(0, a, 1 << 20, Stream::DEFAULT).is_err());
        backend.release(0, a, 1 << 20, Stream::DEFAULT).unwrap();
        backend.release(0, b, 1 << 20, Stream::DEFAULT).unwrap();
        assert_eq!(backend.mem_info(0).unwrap().free, 1 << 30);
    }

    #[test]
    fn a_shared_capacity_is_counted_across_backends() {
        let scratch = tempfile::Builder::new().prefix("tidepool-shared-test-").tempdir().unwrap();
        let path = scratch.path().join("capacity");
        let a = HostBackend::shared(1, 8 << 20, &path).unwrap();
        let b = HostBackend::shared(1, 8 << 20, &path).unwrap();
        let x = a.allocate(0, 6 << 20, Stream::DEFAULT).unwrap();
        assert_eq!(b.mem_info(0).unwrap().free, 2 << 20, "b sees a's use");
        assert_eq!(b.allocate(0, 4 << 20, Stream::DEFAULT), Err(BackendError::OutOfMemory));
        a.release(0, x, 6 << 20, Stream::DEFAULT).unwrap();
        let y = b.allocate(0, 4 << 20, Stream::DEFAULT).unwrap();
        assert_eq!(a.mem_info(0).unwrap().free, 4 << 20);
        b.release(0, y, 4 << 20, Stream::DEFAULT).unwrap();
        assert_eq!(a.shared_device_key(0), b.shared_device_key(0));
        assert!(HostBackend::new(1, 1).shared_device_key(0).is_none());
    }

    #[test]
    fn mapped_pages_are_writable_and_counted_and_unmapping_drops_them() {
        let backend = HostBackend::new(1, 4 * HOST_PAGE);
        let base = backend.vm_reserve(0, 64 * HOST_PAGE).unwrap();
        assert_eq!(base % HOST_PAGE, 0);
        assert_eq!(backend.mem_info(0).unwrap().free, 4 * HOST_PAGE, "a reservation costs no capacity");
        let page = base + 10 * HOST_PAGE;
        backend.vm_map(0, page, &[HOST_PAGE, HOST_PAGE]).unwrap();
        assert_eq!(backend.mem_info(0).unwrap().free, 2 * HOST_PAGE);
        // SAFETY: two pages mapped read-write just above.
        unsafe { std::ptr::write_bytes(page as *mut u8, 0xCD, 2 * HOST_PAGE as usize) };
        assert_eq!(backend.vm_map(0, base, &[HOST_PAGE; 3]), Err(BackendError::OutOfMemory), "over capacity");
        backend.vm_unmap(0, page, 2 * HOST_PAGE).unwrap();
        backend.vm_map(0, page, &[HOST_PAGE]).unwrap();
        // SAFETY: the page was mapped again just above.
        assert_eq!(unsafe { *(page as *const u8) }, 0, "a page mapped again starts fresh");
        backend.vm_unmap(0, page, HOST_PAGE).unwrap();
        backend.vm_free(0, base, 64 * HOST_PAGE).unwrap();
        assert_eq!(backend.mem_info(0).unwrap().free, 4 * HOST_PAGE);
        assert_eq!(backend.vm_calls(), (3, 2));
    }

    #[test]
    fn an_unbacked_backend_checks_counts_and_claims_as_the_other_but_maps_nothing() {
        let backend = HostBackend::unbacked(1, 4 * HOST_PAGE);
        let a = backend.allocate(0, HOST_PAGE, Stream::DEFAULT).unwrap();
        let base = backend.vm_reserve(0, 64 * HOST_PAGE).unwrap();
        assert!(a >= UNBACKED_BASE && base >= a + HOST_PAGE && base.is_multiple_of(HOST_PAGE), "distinct, aligned: {a:#x} {base:#x}");
        backend.vm_map(0, base, &[2 * HOST_PAGE]).unwrap();
        assert_eq!(backend.mem_info(0).unwrap().free, HOST_PAGE, "claimed against the capacity");
        assert_eq!(backend.vm_map(0, base + 2 * HOST_PAGE, &[2 * HOST_PAGE]), Err(BackendError::OutOfMemory));
        assert!(backend.vm_unmap(0, base, HOST_PAGE).is_err(), "half of an allocation is refused, as the driver does");
        backend.vm_move(0, base, base + 8 * HOST_PAGE, 2 * HOST_PAGE).unwrap();
        let mut out = [0u8; 4];
        let err = backend.copy_to_host(0, base + 8 * HOST_PAGE, &mut out, Stream::DEFAULT).unwrap_err();
        assert!(err.to_string().contains("unbacked"), "{err}");
        assert!(backend.copy_to_device(0, a, &out, Stream::DEFAULT).is_err());
        backend.vm_unmap(0, base + 8 * HOST_PAGE, 2 * HOST_PAGE).unwrap();
        backend.vm_free(0, base, 64 * HOST_PAGE).unwrap();
        backend.release(0, a, HOST_PAGE, Stream::DEFAULT).unwrap();
        assert_eq!(backend.mem_info(0).unwrap().free, 4 * HOST_PAGE);
        let calls = backend.driver_calls();
        assert_eq!((calls.mem_alloc, calls.address_reserve, calls.create, calls.map, calls.unmap, calls.release), (1, 1, 2, 2, 2, 1));
    }

    #[test]
    fn what_the_driver_refuses_is_refused_and_changes_nothing() {
        let backend = HostBackend::unbacked(1, 64 * HOST_PAGE);
        let a = backend.vm_reserve(0, 16 * HOST_PAGE).unwrap();
        let b = backend.vm_reserve(0, 16 * HOST_PAGE).unwrap();
        backend.vm_map(0, a, &[4 * HOST_PAGE, HOST_PAGE]).unwrap();
        let refused = |r: Result<(), BackendError>, says: &str| {
            let err = r.unwrap_err().to_string();
            assert!(err.contains(says), "{err}");
        };
        refused(backend.vm_map(0, a + 4 * HOST_PAGE, &[2 * HOST_PAGE]), "holds mapped pages");
        refused(backend.vm_map(0, a + 15 * HOST_PAGE, &[2 * HOST_PAGE]), "not whole pages of one reserved range");
        refused(backend.vm_map(0, a - 64 * HOST_PAGE, &[HOST_PAGE]), "not whole pages of one reserved range");
        refused(backend.vm_unmap(0, a, 2 * HOST_PAGE), "not whole allocations");
        refused(backend.vm_unmap(0, a + HOST_PAGE, 4 * HOST_PAGE), "not whole allocations");
        refused(backend.vm_unmap(0, a, 6 * HOST_PAGE), "not whole allocations");
        refused(backend.vm_unmap(0, a + 1, HOST_PAGE), "not whole pages");
        refused(backend.vm_move(0, a, a + 2 * HOST_PAGE, 4 * HOST_PAGE), "holds mapped pages");
        refused(backend.vm_move(0, a + HOST_PAGE, b, 4 * HOST_PAGE), "not whole allocations");
        refused(backend.vm_free(0, a, 16 * HOST_PAGE), "still has");
        refused(backend.vm_free(0, a + HOST_PAGE, 15 * HOST_PAGE), "no range");
        assert_eq!(backend.mem_info(0).unwrap().free, 59 * HOST_PAGE, "nothing claimed or given back");
        let before = backend.driver_calls();
        // Both allocations move to the other range in one call, then go back
        // whole: two unmaps, two maps, one grant; two unmaps and releases.
        backend.vm_move(0, a, b + 8 * HOST_PAGE, 5 * HOST_PAGE).unwrap();
        refused(backend.vm_unmap(0, b + 8 * HOST_PAGE, 2 * HOST_PAGE), "not whole allocations");
        backend.vm_unmap(0, b + 8 * HOST_PAGE, 5 * HOST_PAGE).unwrap();
        let after = backend.driver_calls();
        assert_eq!((after.unmap - before.unmap, after.map - before.map, after.set_access - before.set_access), (4, 2, 1));
        assert_eq!(after.release - before.release, 2);
        backend.vm_free(0, a, 16 * HOST_PAGE).unwrap();
        backend.vm_free(0, b, 16 * HOST_PAGE).unwrap();
        assert_eq!(backend.mem_info(0).unwrap().free, 64 * HOST_PAGE);
    }

    #[test]
    fn driver_calls_are_counted_on_the_device_they_are_made_on() {
        let backend = HostBackend::new(2, 16 * HOST_PAGE);
        let a = backend.allocate(1, HOST_PAGE, Stream::DEFAULT).unwrap();
        let base = backend.vm_reserve(1, 8 * HOST_PAGE).unwrap();
        backend.vm_map(1, base, &[HOST_PAGE, 2 * HOST_PAGE]).unwrap();
        backend.faults().fail_nth_allocate(1);
        assert!(backend.allocate(1, HOST_PAGE, Stream::DEFAULT).is_err(), "a failed call counts too");
        assert!(backend.allocate(2, HOST_PAGE, Stream::DEFAULT).is_err(), "no device 2: no call made");
        // Device 1: alloc, failed alloc, reserve, 2 creates, 2 maps, 1 grant.
        assert_eq!((backend.driver_calls_on(0), backend.driver_calls_on(1), backend.driver_calls_on(2)), (0, 8, 0));
        let b = backend.allocate(0, HOST_PAGE, Stream::DEFAULT).unwrap();
        backend.release(0, b, HOST_PAGE, Stream::DEFAULT).unwrap();
        backend.vm_unmap(1, base, 3 * HOST_PAGE).unwrap();
        backend.vm_free(1, base, 8 * HOST_PAGE).unwrap();
        backend.release(1, a, HOST_PAGE, Stream::DEFAULT).unwrap();
        let (zero, one) = (backend.device_driver_calls(0), backend.device_driver_calls(1));
        assert_eq!((zero.total(), one.total()), (2, 14), "{zero:?} {one:?}");
        assert_eq!((one.mem_alloc, one.mem_free, one.unmap, one.release, one.address_free), (2, 1, 2, 2, 1));
        assert_eq!(backend.driver_calls().total(), 16, "all devices together, as a replay counts them");
    }

    #[test]
    fn a_missing_device_is_an_error_not_a_panic() {
        let backend = HostBackend::new(2, 1 << 30);
        assert!(matches!(backend.allocate(2, 512, Stream::DEFAULT), Err(BackendError::Driver { code: 101, .. })));
        assert!(backend.mem_info(7).is_err());
    }
}
