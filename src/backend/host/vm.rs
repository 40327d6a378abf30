//! The host backend's virtual memory, for expandable segments: a range is
//! reserved with an inaccessible `PROT_NONE` mapping, pages are committed
//! by mapping fresh read-write memory over them (`MAP_FIXED`) and released
//! by mapping `PROT_NONE` over them again, which drops their contents.
//! Pages count against the capacity while mapped; reserved ranges count
//! for nothing. `Reserved` keeps the allocations each `vm_map` made, so the
//! backend refuses to unmap or move part of one, as the driver does, and
//! counts the driver calls the `cuda` backend would make per allocation.

use std::sync::atomic::Ordering;

use super::faults::Faults;
use super::{invalid_value, os_error, HostBackend, HOST_PAGE};
use crate::backend::BackendError;
use crate::page_map::PageMap;

impl HostBackend {
    /// `Backend::vm_reserve`.
    pub(super) fn reserve_range(&self, device: usize, size: u64) -> Result<u64, BackendError> {
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

    /// `Backend::vm_free`.
    pub(super) fn free_range(&self, device: usize, base: u64, size: u64) -> Result<(), BackendError> {
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

    /// `Backend::vm_map`.
    pub(super) fn map_pages(&self, device: usize, addr: u64, sizes: &[u64]) -> Result<(), BackendError> {
        const CALL: &str = "mmap(MAP_FIXED)";
        self.vm_map_calls.fetch_add(1, Ordering::Relaxed);
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

    /// `Backend::vm_unmap`.
    pub(super) fn unmap_pages(&self, device: usize, addr: u64, len: u64) -> Result<(), BackendError> {
        const CALL: &str = "mmap(PROT_NONE, MAP_FIXED)";
        self.vm_unmap_calls.fetch_add(1, Ordering::Relaxed);
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

    /// `Backend::vm_move`.
    pub(super) fn move_pages(&self, device: usize, from: u64, to: u64, len: u64) -> Result<(), BackendError> {
        const CALL: &str = "mmap(MAP_FIXED)";
        self.vm_move_calls.fetch_add(1, Ordering::Relaxed);
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
}

/// The ranges `vm_reserve` made, in address order, each with a page map
/// of the allocations `vm_map` placed in it: what the driver knows, so that
/// the backend refuses what the driver refuses (a map over mapped pages or
/// outside a reservation, an unmap or move of part of an allocation) and
/// counts the calls it makes per allocation. A page map reads a range's
/// allocations in address order a word of 64 pages at a time.
#[derive(Default)]
pub(super) struct Reserved {
    ranges: Vec<(u64, PageMap)>,
}

impl Reserved {
    pub(super) fn add(&mut self, base: u64, size: u64) {
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
