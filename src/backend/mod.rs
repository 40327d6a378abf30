//! The backend trait: the only interface between the engine and a driver.
//!
//! A backend hands out and takes back whole segments of device memory and
//! reports how much memory the device has. It knows nothing of blocks,
//! pools or streams beyond passing the stream of a request through.
//!
//! Backends that support virtual memory also reserve address ranges and map
//! physical memory into them one run of pages at a time, in allocations of
//! one or more pages that go back, or move, only whole (the `vm_*` calls):
//! the expandable segments of `heap/expandable.rs`.

pub(crate) mod cuda;
pub mod host;

use std::fmt;

use crate::types::Stream;

/// Free and total memory of one device, as the driver reports it (this sees
/// every process on the device).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemInfo {
    pub free: u64,
    pub total: u64,
}

/// Why a backend call failed.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum BackendError {
    /// The device has no room for the segment; the engine releases cache and retries.
    OutOfMemory,
    /// Any other failure, naming the call that failed and the driver's code.
    Driver { call: &'static str, code: i64, message: String },
}

impl fmt::Display for BackendError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BackendError::OutOfMemory => write!(f, "the device is out of memory"),
            BackendError::Driver { call, code, message } => write!(f, "{call} failed with code {code}: {message}"),
        }
    }
}

impl std::error::Error for BackendError {}

/// Host memory holding device contents while their pages are given back
/// (a paused tag's offload); freed when dropped.
pub trait HostMemory: Send {
    fn bytes(&self) -> &[u8];
    fn bytes_mut(&mut self) -> &mut [u8];
}

/// The bytes of a host allocation a backend owns (pinned memory, a
/// mapping), as slices: what each `HostMemory` hands out.
struct HostRegion {
    addr: usize,
    len: usize,
}

impl HostRegion {
    /// # Safety
    /// `[addr, addr + len)` must be readable and writable host memory that
    /// the owner of the region keeps, unaliased, for as long as the region.
    unsafe fn new(addr: usize, len: usize) -> HostRegion {
        HostRegion { addr, len }
    }

    fn bytes(&self) -> &[u8] {
        // SAFETY: `new`'s contract: the memory lives and is ours while the
        // region does; the borrow of self keeps it unaliased by `&mut`.
        unsafe { std::slice::from_raw_parts(self.addr as *const u8, self.len) }
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `bytes`, and `&mut self` makes this the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.addr as *mut u8, self.len) }
    }
}

/// A source of device memory segments. Implementations are thread-safe: the
/// engine calls them from any thread, under the lock of one device's heap.
pub trait Backend: Send + Sync {
    /// A short name for reports ("host", "cuda", ...).
    fn name(&self) -> &'static str;
    /// Number of devices this backend serves; devices are `0..device_count()`.
    fn device_count(&self) -> usize;
    /// A new segment of exactly `size` bytes on `device`, for use on `stream`.
    /// Returns its base address (never 0).
    fn allocate(&self, device: usize, size: u64, stream: Stream) -> Result<u64, BackendError>;
    /// Returns a segment obtained from `allocate` with the same size; its
    /// last use was on `stream` (a stream-ordered driver frees it there).
    fn release(&self, device: usize, base: u64, size: u64, stream: Stream) -> Result<(), BackendError>;
    /// Free and total memory of `device`.
    fn mem_info(&self, device: usize) -> Result<MemInfo, BackendError>;
    /// A name for `device` that every process sharing it agrees on (a GPU's
    /// UUID), or None when no other process can share it.
    fn shared_device_key(&self, device: usize) -> Option<String>;
    /// The memory driver calls this backend has made on `device` so far,
    /// successful or failed: `cuMemAlloc` and `cuMemFree` (or the
    /// stream-ordered `cuMemAllocFromPoolAsync` and `cuMemFreeAsync`) for
    /// segments, `cuMemAddressReserve` and `cuMemAddressFree`,
    /// `cuMemCreate` and `cuMemRelease`, `cuMemMap` and `cuMemUnmap`,
    /// `cuMemSetAccess` (those made to undo a failed step included); for a
    /// backend that stands in for a driver, the calls the `cuda` backend
    /// would have made. Never reset: statistics (`num_driver_calls`) count
    /// from it. Every backend answers (no default), so that no real one
    /// reports a steady 0.
    fn driver_calls_on(&self, device: usize) -> u64;
    /// Waits until the work queued on `stream` so far has run. Backends
    /// without asynchronous work have nothing to wait for.
    fn synchronize_stream(&self, _device: usize, _stream: Stream) -> Result<(), BackendError> {
        Ok(())
    }

    /// An event marking the work queued on `stream` so far (from a pool of
    /// reusable events), or None when the backend has no asynchronous work.
    fn record_event(&self, _device: usize, _stream: Stream) -> Result<Option<u64>, BackendError> {
        Ok(None)
    }

    /// Whether the work before `event` has run (without waiting).
    fn event_done(&self, _device: usize, _event: u64) -> Result<bool, BackendError> {
        Ok(true)
    }

    /// Waits until the work before `event` has run.
    fn wait_event(&self, _device: usize, _event: u64) -> Result<(), BackendError> {
        Ok(())
    }

    /// The page size of virtual memory on `device`, or None when the
    /// backend cannot map pages (expandable segments then stay off).
    fn vm_page_size(&self, _device: usize) -> Option<u64> {
        None
    }

    /// Whether this kind of backend grows by mapping pages where the device
    /// can (`cuda`, `host`), rather than through a pool of the driver's
    /// (`cuda_async`): expandable segments, on by default, are off without
    /// a word on one that does not.
    fn maps_pages(&self) -> bool {
        false
    }

    /// Reserves `size` bytes of address space (a multiple of the page size)
    /// on `device`, backed by nothing. Returns its base, page-aligned.
    fn vm_reserve(&self, _device: usize, _size: u64) -> Result<u64, BackendError> {
        Err(vm_unsupported("vm_reserve"))
    }

    /// Gives back a range from `vm_reserve`, with no page of it mapped.
    fn vm_free(&self, _device: usize, _base: u64, _size: u64) -> Result<(), BackendError> {
        Err(vm_unsupported("vm_free"))
    }

    /// Backs the pages from `addr` of a reserved range (page-aligned, all
    /// unmapped) with new physical memory, in allocations of the sizes
    /// `sizes` lists in address order (each a multiple of the page: one
    /// `cuMemCreate` and one `cuMemMap` each, then access granted over the
    /// whole run), readable and writable by the device. All or nothing: on
    /// failure nothing of the run stays mapped.
    fn vm_map(&self, _device: usize, _addr: u64, _sizes: &[u64]) -> Result<(), BackendError> {
        Err(vm_unsupported("vm_map"))
    }

    /// Unmaps `[addr, addr + len)`, whole allocations made by `vm_map` whose
    /// last use on the device has completed, and frees their physical
    /// memory. A range that begins or ends inside an allocation is refused,
    /// and nothing changes.
    fn vm_unmap(&self, _device: usize, _addr: u64, _len: u64) -> Result<(), BackendError> {
        Err(vm_unsupported("vm_unmap"))
    }

    /// Moves the physical memory of the mapped pages `[from, from + len)`
    /// (whole allocations, whose last use on the device has completed) to
    /// the unmapped pages `[to, to + len)` of a reserved range, allocation
    /// by allocation: afterwards `from` is unmapped and `to` mapped,
    /// readable and writable by the device; contents are not kept. On
    /// failure nothing has changed. The backends here move the memory
    /// itself, so a move needs no free memory; by default, `vm_map` of new
    /// memory (one allocation) then `vm_unmap`, which needs `len` bytes free
    /// for a moment.
    fn vm_move(&self, device: usize, from: u64, to: u64, len: u64) -> Result<(), BackendError> {
        self.vm_map(device, to, &[len])?;
        if let Err(err) = self.vm_unmap(device, from, len) {
            let _ = self.vm_unmap(device, to, len);
            return Err(err);
        }
        Ok(())
    }

    /// Copies `src` from the host to `dst` on `device`, in the order of
    /// `stream` (after the work queued on it), and returns once the copy is
    /// done. `[dst, dst + src.len())` lies inside a live block (the caller,
    /// `Buffer`, checks).
    fn copy_to_device(&self, _device: usize, _dst: u64, _src: &[u8], _stream: Stream) -> Result<(), BackendError> {
        Err(BackendError::Driver { call: "copy_to_device", code: 801, message: "this backend cannot copy".into() })
    }

    /// Copies `dst.len()` bytes at `src` on `device` to the host, in the
    /// order of `stream`, and returns once the copy is done.
    /// `[src, src + dst.len())` lies inside a live block (the caller checks).
    fn copy_to_host(&self, _device: usize, _src: u64, _dst: &mut [u8], _stream: Stream) -> Result<(), BackendError> {
        Err(BackendError::Driver { call: "copy_to_host", code: 801, message: "this backend cannot copy".into() })
    }

    /// `len` bytes of host memory (`len > 0`) to copy device contents into
    /// and back from with `copy_to_host` and `copy_to_device`. Out of host
    /// memory is `OutOfMemory`, and nothing is held. The default is
    /// ordinary anonymous memory, committed as it is written.
    fn host_memory(&self, len: u64) -> Result<Box<dyn HostMemory>, BackendError> {
        host::HostBuffer::new(len).map(|b| Box::new(b) as Box<dyn HostMemory>)
    }

    /// Whether work queued on `stream` is being captured into a CUDA graph
    /// now (a pause must not synchronize or unmap under it). Backends
    /// without graphs say no.
    fn stream_capturing(&self, _device: usize, _stream: Stream) -> bool {
        false
    }

    /// Returns a completed event to the pool.
    fn recycle_event(&self, _device: usize, _event: u64) {}

    /// Makes future work on `stream` wait for the work before `event`,
    /// without waiting on the host.
    fn stream_wait_event(&self, _device: usize, _stream: Stream, _event: u64) -> Result<(), BackendError> {
        Ok(())
    }
}

fn vm_unsupported(call: &'static str) -> BackendError {
    BackendError::Driver { call, code: 801, message: "this backend has no virtual memory management".into() }
}
