//! `HostBuffer`, the host memory every backend without pinned memory hands
//! out for offloads (an anonymous mapping, zero pages until written), and
//! the anonymous mapping the host backend places its memory with.

use crate::backend::{BackendError, HostMemory, HostRegion};

/// An anonymous private mapping of `len` bytes with protection `prot`, at
/// `fixed` (replacing whatever was mapped there) or where the kernel
/// chooses; its address, or None when mmap fails.
///
/// # Safety
/// With `fixed`, `[fixed, fixed + len)` must be address space this backend
/// reserved, holding nothing anyone still uses.
pub(super) unsafe fn map_anonymous(fixed: Option<u64>, len: usize, prot: libc::c_int) -> Option<u64> {
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
