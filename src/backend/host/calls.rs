//! The host backend's call counting: the driver calls the `cuda` backend
//! would make for the same requests, counted device by device
//! (`device_driver_calls`, `driver_calls` for all devices: what a replay
//! reports), and the backend's own calls of each kind (`vm_calls`,
//! `vm_moves`, ...) that tests read.

use std::sync::atomic::{AtomicU64, Ordering};

use super::{HostBackend, HostDevice};

/// The driver calls the `cuda` backend makes, counted for the same requests.
#[derive(Default)]
pub(super) struct DriverCallCounts {
    pub(super) mem_alloc: AtomicU64,
    pub(super) mem_free: AtomicU64,
    pub(super) address_reserve: AtomicU64,
    pub(super) address_free: AtomicU64,
    pub(super) create: AtomicU64,
    pub(super) release: AtomicU64,
    pub(super) map: AtomicU64,
    pub(super) unmap: AtomicU64,
    pub(super) set_access: AtomicU64,
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

impl HostBackend {
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

    /// The driver calls counted on `device`, a device of this backend.
    pub(super) fn calls(&self, device: usize) -> &DriverCallCounts {
        &self.devices[device].calls
    }
}
