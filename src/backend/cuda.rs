//! The `cuda` and `cuda_async` backends, through cudarc with the driver
//! loaded at run time (no CUDA toolkit to build; drivers of CUDA 12 and 13).
//!
//! `cuda`: segments from `cuMemAlloc_v2`, back with `cuMemFree_v2` (which
//! waits for the whole device). `cuda_async`: segments from
//! `cuMemAllocFromPoolAsync` on the requesting stream, out of a memory pool
//! tidepool creates per device, back with `cuMemFreeAsync` on the segment's
//! last stream followed by `cuMemPoolTrimTo`, so releasing never stalls the
//! device.
//!
//! Virtual memory (expandable segments, `cuda` only): ranges from
//! `cuMemAddressReserve`, and each page (the allocation granularity, 2 MiB
//! on current GPUs) its own physical allocation (`cuMemCreate`), mapped with
//! `cuMemMap` and opened with `cuMemSetAccess`, so that any page can go back
//! alone (`cuMemUnmap` + `cuMemRelease`): the driver unmaps only whole mappings.
//!
//! Offload memory (a paused tag's contents) is pinned host memory from
//! `cuMemHostAlloc`, freed with `cuMemFreeHost`, so the copies of a pause
//! and a resume run at the bus's speed.
//!
//! Every memory call (`cuMemAlloc`/`cuMemFree` or the stream-ordered pair,
//! `cuMemAddressReserve`/`cuMemAddressFree`, `cuMemCreate`/`cuMemRelease`,
//! `cuMemMap`/`cuMemUnmap`, `cuMemSetAccess`) is counted on its device as it
//! is made, failed or not (`driver_calls_on`), as the host backend models
//! them and as simgpu counts them.
//!
//! Each device works in its primary context, made current on the calling
//! thread when it is not (PyTorch's threads have it already; a plain Rust
//! program's do not). Every driver result is mapped in `check`: out of
//! memory becomes the engine's OutOfMemory (release and retry), anything
//! else an error naming the call and the code.

use std::collections::BTreeMap;
use std::ffi::{c_char, CStr};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::sync::Mutex;

use cudarc::driver::sys;

use super::{Backend, BackendError, HostMemory, HostRegion, MemInfo};
use crate::log::log_line;
use crate::types::Stream;

/// One device: its ordinal, primary context, identity and (cuda_async) pool.
struct Device {
    ordinal: sys::CUdevice,
    /// The primary context, as an address (a raw pointer is not Send).
    context: usize,
    uuid: [u8; 16],
    /// The memory pool of `cuda_async`, as an address; 0 for `cuda`.
    pool: usize,
    /// Events ready for reuse, as addresses.
    events: Mutex<Vec<usize>>,
    /// The virtual memory page size; 0 when pages cannot be mapped.
    vm_page: u64,
    /// The physical allocations mapped, by address: each one's handle and length.
    vm_handles: Mutex<BTreeMap<u64, (sys::CUmemGenericAllocationHandle, u64)>>,
    /// The memory driver calls made on this device (`Backend::driver_calls_on`).
    driver_calls: AtomicU64,
}

impl Device {
    /// Counts one memory driver call on this device: called right before
    /// each one, which counts whether it succeeds or fails.
    fn count_call(&self) {
        self.driver_calls.fetch_add(1, Ordering::Relaxed);
    }
}

/// A physical allocation mapped whole at `addr`.
#[derive(Clone, Copy)]
struct Allocation {
    addr: u64,
    handle: sys::CUmemGenericAllocationHandle,
    len: u64,
}

pub struct CudaBackend {
    devices: Vec<Device>,
    stream_ordered: bool,
    /// Whether the driver has `cuThreadExchangeStreamCaptureMode` and `cuStreamIsCapturing`.
    capture_modes: bool,
    capture_status: bool,
}

/// Makes the calling thread's stream capture mode relaxed while it lives:
/// a capture in global mode (PyTorch's default) forbids `cuMemAlloc` and
/// the mapping calls from any thread, though new memory during a capture is
/// safe when, as in private pools, it is not freed while the graph lives
/// (PyTorch's own allocator does the same).
struct RelaxedCapture(Option<sys::CUstreamCaptureMode>);

impl RelaxedCapture {
    fn new(backend: &CudaBackend) -> RelaxedCapture {
        if !backend.capture_modes {
            return RelaxedCapture(None);
        }
        let mut mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
        // SAFETY: swaps this thread's capture mode with a local; restored on drop.
        let swapped = unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut mode) } == sys::CUresult::CUDA_SUCCESS;
        RelaxedCapture(swapped.then_some(mode))
    }
}

impl Drop for RelaxedCapture {
    fn drop(&mut self) {
        if let Some(mut mode) = self.0 {
            // SAFETY: puts back the mode swapped out in `new`, on the same thread.
            unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut mode) };
        }
    }
}

/// The driver's name for an error code.
fn error_name(code: sys::CUresult) -> String {
    let mut name: *const c_char = std::ptr::null();
    // SAFETY: cuGetErrorName writes a pointer to a static string or leaves it null.
    let rc = unsafe { sys::cuGetErrorName(code, &mut name) };
    if rc != sys::CUresult::CUDA_SUCCESS || name.is_null() {
        return format!("error {}", code as i64);
    }
    // SAFETY: the driver returns a NUL-terminated static string.
    unsafe { CStr::from_ptr(name) }.to_string_lossy().into_owned()
}

/// The one place driver results become errors.
fn check(result: sys::CUresult, call: &'static str) -> Result<(), BackendError> {
    match result {
        sys::CUresult::CUDA_SUCCESS => Ok(()),
        sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => Err(BackendError::OutOfMemory),
        other => Err(BackendError::Driver { call, code: other as i64, message: error_name(other) }),
    }
}

/// Whether the loaded driver exports `symbol` (cudarc panics on a missing one).
fn has_symbol(symbol: &[u8]) -> bool {
    // SAFETY: looking a name up in the already loaded driver library has no
    // side effect; the symbol is not called here.
    unsafe { sys::culib().get::<unsafe extern "C" fn()>(symbol).is_ok() }
}

impl CudaBackend {
    /// Loads the driver, initialises it and retains every device's primary
    /// context; with `stream_ordered`, creates a memory pool per device.
    pub fn new(stream_ordered: bool) -> Result<CudaBackend, BackendError> {
        // SAFETY: probing for the library only tries to dlopen it.
        if !unsafe { sys::is_culib_present() } {
            return Err(BackendError::Driver {
                call: "dlopen(libcuda.so)",
                code: -1,
                message: "no CUDA driver found: libcuda.so could not be loaded; backend:host runs without a GPU".into(),
            });
        }
        // SAFETY: cuInit takes flags 0 and may be called more than once.
        check(unsafe { sys::cuInit(0) }, "cuInit")?;
        let mut count = 0;
        // SAFETY: writes the device count into a local.
        check(unsafe { sys::cuDeviceGetCount(&mut count) }, "cuDeviceGetCount")?;
        let mut devices = Vec::new();
        for ordinal in 0..count {
            let mut device: sys::CUdevice = 0;
            // SAFETY: `ordinal` is below the count the driver gave.
            check(unsafe { sys::cuDeviceGet(&mut device, ordinal) }, "cuDeviceGet")?;
            let mut context: sys::CUcontext = std::ptr::null_mut();
            // SAFETY: retains the device's primary context; it stays retained
            // for the life of the process, as PyTorch's does.
            check(unsafe { sys::cuDevicePrimaryCtxRetain(&mut context, device) }, "cuDevicePrimaryCtxRetain")?;
            let mut uuid = [0u8; 16];
            if has_symbol(b"cuDeviceGetUuid_v2\0") {
                let mut raw = sys::CUuuid_st { bytes: [0; 16] };
                // SAFETY: writes 16 bytes into a local CUuuid.
                check(unsafe { sys::cuDeviceGetUuid_v2(&mut raw, device) }, "cuDeviceGetUuid_v2")?;
                uuid = raw.bytes.map(|b| b as u8);
            }
            let pool = if stream_ordered { Self::create_pool(device, context)? } else { 0 };
            // Expandable segments are for `cuda`; `cuda_async` has the driver's own pool.
            let vm_page = if stream_ordered { 0 } else { Self::vm_granularity(device, context) };
            devices.push(Device {
                ordinal: device,
                context: context as usize,
                uuid,
                pool,
                events: Mutex::new(Vec::new()),
                vm_page,
                vm_handles: Mutex::new(BTreeMap::new()),
                driver_calls: AtomicU64::new(0),
            });
        }
        Ok(CudaBackend {
            devices,
            stream_ordered,
            capture_modes: has_symbol(b"cuThreadExchangeStreamCaptureMode\0"),
            capture_status: has_symbol(b"cuStreamIsCapturing\0"),
        })
    }

    /// A stream-ordered allocation on a stream being captured would become
    /// a node of the graph, memory only its replays may use, which the cache
    /// would then hand to anyone: refused, with what to do instead.
    fn refuse_capturing_stream(&self, stream: Stream) -> Result<(), BackendError> {
        if !self.capture_status {
            return Ok(());
        }
        let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        // SAFETY: `stream` is the requester's stream handle; the driver writes a local.
        check(unsafe { sys::cuStreamIsCapturing(stream.0 as sys::CUstream, &mut status) }, "cuStreamIsCapturing")?;
        if status == sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE {
            return Ok(());
        }
        Err(BackendError::Driver {
            call: "cuMemAllocFromPoolAsync",
            code: -1,
            message: "backend:cuda_async cannot take new memory on a stream being captured into a CUDA graph: \
                      use backend:cuda, or run the captured step once before capturing so the cache holds its memory"
                .into(),
        })
    }

    /// A device memory pool of tidepool's own (not the device's default pool,
    /// which other code in the process may trim or configure).
    fn create_pool(device: sys::CUdevice, context: sys::CUcontext) -> Result<usize, BackendError> {
        // SAFETY: makes the device's retained primary context current on this thread.
        check(unsafe { sys::cuCtxSetCurrent(context) }, "cuCtxSetCurrent")?;
        // SAFETY: CUmemPoolProps is plain data; all zero is its documented
        // default, completed below with the allocation type and location.
        let mut props: sys::CUmemPoolProps = unsafe { std::mem::zeroed() };
        props.allocType = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        props.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        props.location.id = device;
        let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
        // SAFETY: `props` is a valid pool description; the driver writes the pool handle.
        check(unsafe { sys::cuMemPoolCreate(&mut pool, &props) }, "cuMemPoolCreate")?;
        Ok(pool as usize)
    }

    /// The allocation granularity of device memory, or 0 when the driver
    /// has no virtual memory management (or reports an unusable size).
    fn vm_granularity(device: sys::CUdevice, context: sys::CUcontext) -> u64 {
        let calls: [&[u8]; 7] = [
            b"cuMemGetAllocationGranularity\0",
            b"cuMemAddressReserve\0",
            b"cuMemCreate\0",
            b"cuMemMap\0",
            b"cuMemSetAccess\0",
            b"cuMemUnmap\0",
            b"cuMemRelease\0",
        ];
        if !calls.iter().all(|c| has_symbol(c)) {
            return 0;
        }
        // SAFETY: makes the device's retained primary context current on this thread.
        if unsafe { sys::cuCtxSetCurrent(context) } != sys::CUresult::CUDA_SUCCESS {
            return 0;
        }
        let prop = page_properties(device);
        let mut granularity = 0usize;
        let option = sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM;
        // SAFETY: `prop` describes device memory of this device; the driver writes one size.
        let rc = unsafe { sys::cuMemGetAllocationGranularity(&mut granularity, &prop, option) };
        let page = granularity as u64;
        if rc == sys::CUresult::CUDA_SUCCESS && page.is_power_of_two() {
            page
        } else {
            0
        }
    }

    /// The allocations making up `[addr, addr + len)` of `device` exactly,
    /// as (address, handle, length), or the error `call` gives for a range
    /// that begins or ends inside one or holds unmapped pages.
    fn allocations_in(&self, device: usize, addr: u64, len: u64, call: &'static str) -> Result<Vec<Allocation>, BackendError> {
        let handles = self.devices[device].vm_handles.lock();
        let mut out = Vec::new();
        let mut at = addr;
        for (&start, &(handle, n)) in handles.range(addr..addr + len) {
            if start != at {
                break;
            }
            out.push(Allocation { addr: start, handle, len: n });
            at = start + n;
        }
        if at != addr + len || len == 0 {
            return Err(BackendError::Driver {
                call,
                code: sys::CUresult::CUDA_ERROR_INVALID_VALUE as i64,
                message: format!("[{addr:#x}, {:#x}) is not whole allocations of this backend", addr + len),
            });
        }
        Ok(out)
    }

    /// Unmaps the allocations `whole` of `device` and frees them. All or
    /// nothing, as the engine counts on: when one cannot be unmapped, the
    /// ones unmapped before it are mapped again with their memory and the
    /// error is returned. An allocation the driver will not free once
    /// unmapped counts as unmapped (its addresses are free again), with a
    /// warning.
    fn unmap_allocations(&self, device: usize, whole: &[Allocation]) -> Result<(), BackendError> {
        let d = &self.devices[device];
        let mut unmapped = Vec::new();
        for a in whole {
            d.count_call();
            // SAFETY: `a` is an allocation this backend mapped whole, and the
            // engine unmaps it only once no work uses it.
            match check(unsafe { sys::cuMemUnmap(a.addr, a.len as usize) }, "cuMemUnmap") {
                Ok(()) => unmapped.push(*a),
                Err(err) => {
                    self.map_again(device, &unmapped);
                    return Err(err);
                }
            }
        }
        let mut handles = d.vm_handles.lock();
        for a in unmapped {
            handles.remove(&a.addr);
            d.count_call();
            // SAFETY: `a.handle` is no longer mapped anywhere; this is its one release.
            if let Err(err) = check(unsafe { sys::cuMemRelease(a.handle) }, "cuMemRelease") {
                log_line(format_args!("tidepool: warning: device {device}: the memory unmapped at {:#x} was not freed: {err}", a.addr));
            }
        }
        Ok(())
    }

    /// Maps each allocation of `device` again at its address, readable and
    /// writable: undoes unmaps that a failure made void.
    fn map_again(&self, device: usize, allocations: &[Allocation]) {
        let d = &self.devices[device];
        let prop = page_properties(d.ordinal);
        for a in allocations {
            d.count_call();
            // SAFETY: `a.addr` was unmapped just before from `a.handle`, which
            // is still alive; nothing else maps there meanwhile (the heap's lock).
            let result = check(unsafe { sys::cuMemMap(a.addr, a.len as usize, 0, a.handle, 0) }, "cuMemMap")
                .and_then(|()| grant_access(d, &prop, a.addr, a.len));
            if let Err(err) = result {
                log_line(format_args!("tidepool: warning: device {device}: the memory at {:#x} could not be mapped again: {err}", a.addr));
            }
        }
    }

    fn device(&self, device: usize, call: &'static str) -> Result<&Device, BackendError> {
        self.devices.get(device).ok_or_else(|| BackendError::Driver {
            call,
            code: sys::CUresult::CUDA_ERROR_INVALID_DEVICE as i64,
            message: format!("no device {device}; the driver has {}", self.devices.len()),
        })
    }

    /// Makes `device`'s primary context current on this thread if it is not.
    fn enter(&self, device: usize, call: &'static str) -> Result<(), BackendError> {
        let wanted = self.device(device, call)?.context as sys::CUcontext;
        let mut current: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: reads this thread's current context into a local.
        check(unsafe { sys::cuCtxGetCurrent(&mut current) }, "cuCtxGetCurrent")?;
        if current != wanted {
            // SAFETY: `wanted` is a primary context retained in `new` and never released.
            check(unsafe { sys::cuCtxSetCurrent(wanted) }, "cuCtxSetCurrent")?;
        }
        Ok(())
    }
}

impl Backend for CudaBackend {
    fn name(&self) -> &'static str {
        if self.stream_ordered {
            "cuda_async"
        } else {
            "cuda"
        }
    }

    fn device_count(&self) -> usize {
        self.devices.len()
    }

    fn driver_calls_on(&self, device: usize) -> u64 {
        self.devices.get(device).map_or(0, |d| d.driver_calls.load(Ordering::Relaxed))
    }

    fn allocate(&self, device: usize, size: u64, stream: Stream) -> Result<u64, BackendError> {
        self.enter(device, "cuMemAlloc")?;
        let bytes = usize::try_from(size).map_err(|_| BackendError::OutOfMemory)?;
        let mut ptr: sys::CUdeviceptr = 0;
        let d = &self.devices[device];
        let pool = d.pool;
        if pool != 0 {
            self.refuse_capturing_stream(stream)?;
            d.count_call();
            // SAFETY: the context is current, `pool` was created for this
            // device, `stream` is the requester's; the driver writes the address.
            check(
                unsafe { sys::cuMemAllocFromPoolAsync(&mut ptr, bytes, pool as sys::CUmemoryPool, stream.0 as sys::CUstream) },
                "cuMemAllocFromPoolAsync",
            )?;
        } else {
            let _relaxed = RelaxedCapture::new(self);
            d.count_call();
            // SAFETY: the device's context is current; the driver writes the address into a local.
            check(unsafe { sys::cuMemAlloc_v2(&mut ptr, bytes) }, "cuMemAlloc_v2")?;
        }
        Ok(ptr)
    }

    fn release(&self, device: usize, base: u64, _size: u64, stream: Stream) -> Result<(), BackendError> {
        self.enter(device, "cuMemFree")?;
        let d = &self.devices[device];
        // One call either way: cuMemFree_v2, or cuMemFreeAsync (the trim
        // that follows it takes back no address and is not counted).
        d.count_call();
        let pool = d.pool;
        if pool != 0 {
            // SAFETY: `base` came from this device's pool and is released once,
            // in the order of the stream it was last used on.
            check(unsafe { sys::cuMemFreeAsync(base, stream.0 as sys::CUstream) }, "cuMemFreeAsync")?;
            // SAFETY: `pool` is this device's pool; trimming only returns free memory.
            check(unsafe { sys::cuMemPoolTrimTo(pool as sys::CUmemoryPool, 0) }, "cuMemPoolTrimTo")
        } else {
            // SAFETY: `base` came from cuMemAlloc_v2 on this device and the engine
            // releases it once, with no block of it in use.
            check(unsafe { sys::cuMemFree_v2(base) }, "cuMemFree_v2")
        }
    }

    fn mem_info(&self, device: usize) -> Result<MemInfo, BackendError> {
        self.enter(device, "cuMemGetInfo_v2")?;
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: the device's context is current; the driver writes two sizes into locals.
        check(unsafe { sys::cuMemGetInfo_v2(&mut free, &mut total) }, "cuMemGetInfo_v2")?;
        Ok(MemInfo { free: free as u64, total: total as u64 })
    }

    fn vm_page_size(&self, device: usize) -> Option<u64> {
        self.devices.get(device).map(|d| d.vm_page).filter(|&page| page > 0)
    }

    fn maps_pages(&self) -> bool {
        !self.stream_ordered
    }

    fn vm_reserve(&self, device: usize, size: u64) -> Result<u64, BackendError> {
        self.enter(device, "cuMemAddressReserve")?;
        let page = self.devices[device].vm_page as usize;
        let mut base: sys::CUdeviceptr = 0;
        let _relaxed = RelaxedCapture::new(self);
        self.devices[device].count_call();
        // SAFETY: reserves address space only (no memory); the driver writes its base.
        check(unsafe { sys::cuMemAddressReserve(&mut base, size as usize, page, 0, 0) }, "cuMemAddressReserve")?;
        Ok(base)
    }

    fn vm_free(&self, device: usize, base: u64, size: u64) -> Result<(), BackendError> {
        self.enter(device, "cuMemAddressFree")?;
        self.devices[device].count_call();
        // SAFETY: `base`/`size` is a range from vm_reserve with no page mapped.
        check(unsafe { sys::cuMemAddressFree(base, size as usize) }, "cuMemAddressFree")
    }

    fn vm_map(&self, device: usize, addr: u64, sizes: &[u64]) -> Result<(), BackendError> {
        self.enter(device, "cuMemCreate")?;
        let d = &self.devices[device];
        if sizes.is_empty() || sizes.iter().any(|&n| n == 0 || !n.is_multiple_of(d.vm_page)) {
            return Err(BackendError::Driver {
                call: "cuMemCreate",
                code: sys::CUresult::CUDA_ERROR_INVALID_VALUE as i64,
                message: format!("allocations of {sizes:?} bytes"),
            });
        }
        let len: u64 = sizes.iter().sum();
        let prop = page_properties(d.ordinal);
        let mut made = Vec::new();
        let mut result = Ok(());
        let _relaxed = RelaxedCapture::new(self);
        let mut at = addr;
        for &each in sizes {
            let mut handle: sys::CUmemGenericAllocationHandle = 0;
            d.count_call();
            // SAFETY: `prop` describes pages of this device's memory; the driver writes the handle.
            result = check(unsafe { sys::cuMemCreate(&mut handle, each as usize, &prop, 0) }, "cuMemCreate");
            if result.is_err() {
                break;
            }
            d.count_call();
            // SAFETY: `[at, at + each)` is unmapped in a range reserved by vm_reserve.
            result = check(unsafe { sys::cuMemMap(at, each as usize, 0, handle, 0) }, "cuMemMap");
            if result.is_err() {
                d.count_call();
                // SAFETY: the handle was never mapped; this is its one release.
                unsafe { sys::cuMemRelease(handle) };
                break;
            }
            made.push(Allocation { addr: at, handle, len: each });
            at += each;
        }
        if result.is_ok() {
            result = grant_access(d, &prop, addr, len);
        }
        if result.is_err() {
            // All or nothing: the allocations made so far go back.
            for a in &made {
                d.count_call();
                // SAFETY: mapped just above, used by nothing yet.
                if let Err(err) = check(unsafe { sys::cuMemUnmap(a.addr, a.len as usize) }, "cuMemUnmap") {
                    log_line(format_args!(
                        "tidepool: warning: device {device}: memory mapped at {:#x} could not be unmapped: {err}",
                        a.addr
                    ));
                    d.vm_handles.lock().insert(a.addr, (a.handle, a.len));
                    continue;
                }
                d.count_call();
                // SAFETY: unmapped just above; its one release.
                unsafe { sys::cuMemRelease(a.handle) };
            }
            return result;
        }
        let mut handles = d.vm_handles.lock();
        for a in made {
            handles.insert(a.addr, (a.handle, a.len));
        }
        Ok(())
    }

    fn vm_move(&self, device: usize, from: u64, to: u64, len: u64) -> Result<(), BackendError> {
        self.enter(device, "cuMemMap")?;
        let whole = self.allocations_in(device, from, len, "cuMemUnmap")?;
        let d = &self.devices[device];
        let prop = page_properties(d.ordinal);
        let _relaxed = RelaxedCapture::new(self);
        // Each allocation is unmapped from `from` (its memory stays with its
        // handle), then mapped at `to`. A failure undoes what was done
        // before it, so that nothing has changed: unmaps by mapping again,
        // maps by unmapping (the one undo that can itself fail, reported).
        let mut unmapped = Vec::new();
        for a in &whole {
            d.count_call();
            // SAFETY: `a` is an allocation this backend mapped whole, which
            // the engine moves only once no work uses it; the handle is not
            // released, so its memory stays.
            if let Err(err) = check(unsafe { sys::cuMemUnmap(a.addr, a.len as usize) }, "cuMemUnmap") {
                self.map_again(device, &unmapped);
                return Err(err);
            }
            unmapped.push(*a);
        }
        let mut mapped = Vec::new();
        let mut result = Ok(());
        for a in &unmapped {
            let at = to + (a.addr - from);
            d.count_call();
            // SAFETY: `[at, at + a.len)` is unmapped in a range reserved by
            // vm_reserve; `a.handle` is live memory of this device, mapped
            // nowhere now.
            result = check(unsafe { sys::cuMemMap(at, a.len as usize, 0, a.handle, 0) }, "cuMemMap");
            if result.is_err() {
                break;
            }
            mapped.push((at, a.len));
        }
        let result = result.and_then(|()| grant_access(d, &prop, to, len));
        if let Err(err) = result {
            for (at, n) in mapped {
                d.count_call();
                // SAFETY: mapped just above; its handle stays alive and is
                // mapped at `from` again below.
                if let Err(undo) = check(unsafe { sys::cuMemUnmap(at, n as usize) }, "cuMemUnmap") {
                    log_line(format_args!(
                        "tidepool: warning: device {device}: memory moved to {at:#x} could not be unmapped again: {undo}"
                    ));
                }
            }
            self.map_again(device, &unmapped);
            return Err(err);
        }
        let mut handles = d.vm_handles.lock();
        for a in unmapped {
            handles.remove(&a.addr);
            handles.insert(to + (a.addr - from), (a.handle, a.len));
        }
        Ok(())
    }

    fn vm_unmap(&self, device: usize, addr: u64, len: u64) -> Result<(), BackendError> {
        self.enter(device, "cuMemUnmap")?;
        let whole = self.allocations_in(device, addr, len, "cuMemUnmap")?;
        // The engine unmaps during a capture only to undo a growth that
        // failed midway (pages no work has used), as vm_map maps: relaxed.
        let _relaxed = RelaxedCapture::new(self);
        self.unmap_allocations(device, &whole)
    }

    fn synchronize_stream(&self, device: usize, stream: Stream) -> Result<(), BackendError> {
        self.enter(device, "cuStreamSynchronize")?;
        // SAFETY: `stream` is a CUstream the caller used for its work on this
        // device (PyTorch's record_stream); 0 is the legacy default stream.
        check(unsafe { sys::cuStreamSynchronize(stream.0 as sys::CUstream) }, "cuStreamSynchronize")
    }

    fn copy_to_device(&self, device: usize, dst: u64, src: &[u8], stream: Stream) -> Result<(), BackendError> {
        self.enter(device, "cuMemcpyHtoDAsync_v2")?;
        let s = stream.0 as sys::CUstream;
        // SAFETY: per the trait's contract, [dst, dst + src.len()) is in a
        // live block of this device; `src` stays borrowed until the stream
        // has run the copy (synchronized below).
        check(unsafe { sys::cuMemcpyHtoDAsync_v2(dst, src.as_ptr().cast(), src.len(), s) }, "cuMemcpyHtoDAsync_v2")?;
        // SAFETY: `stream` is the caller's stream on this device.
        check(unsafe { sys::cuStreamSynchronize(s) }, "cuStreamSynchronize")
    }

    fn copy_to_host(&self, device: usize, src: u64, dst: &mut [u8], stream: Stream) -> Result<(), BackendError> {
        self.enter(device, "cuMemcpyDtoHAsync_v2")?;
        let s = stream.0 as sys::CUstream;
        // SAFETY: per the trait's contract, [src, src + dst.len()) is in a
        // live block of this device; `dst` stays borrowed until the stream
        // has run the copy (synchronized below).
        check(unsafe { sys::cuMemcpyDtoHAsync_v2(dst.as_mut_ptr().cast(), src, dst.len(), s) }, "cuMemcpyDtoHAsync_v2")?;
        // SAFETY: `stream` is the caller's stream on this device.
        check(unsafe { sys::cuStreamSynchronize(s) }, "cuStreamSynchronize")
    }

    fn stream_capturing(&self, device: usize, stream: Stream) -> bool {
        if !self.capture_status || self.enter(device, "cuStreamIsCapturing").is_err() {
            return false;
        }
        let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        // SAFETY: `stream` is a stream the caller allocated on; the driver writes a local.
        let rc = unsafe { sys::cuStreamIsCapturing(stream.0 as sys::CUstream, &mut status) };
        rc == sys::CUresult::CUDA_SUCCESS && status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE
    }

    fn host_memory(&self, len: u64) -> Result<Box<dyn HostMemory>, BackendError> {
        self.enter(0, "cuMemHostAlloc")?;
        let bytes = usize::try_from(len).map_err(|_| BackendError::OutOfMemory)?;
        let mut ptr: *mut std::ffi::c_void = std::ptr::null_mut();
        // SAFETY: a context is current; the driver writes the address of
        // `bytes` bytes of pinned host memory, portable: pinned for every
        // device's context (CU_MEMHOSTALLOC_PORTABLE).
        check(unsafe { sys::cuMemHostAlloc(&mut ptr, bytes, 1) }, "cuMemHostAlloc")?;
        if ptr.is_null() {
            return Err(BackendError::OutOfMemory);
        }
        // SAFETY: cuMemHostAlloc gave `bytes` bytes at `ptr`, which the
        // PinnedHost owns until it frees them on drop.
        let region = unsafe { HostRegion::new(ptr as usize, bytes) };
        Ok(Box::new(PinnedHost { region, context: self.devices[0].context }))
    }

    fn record_event(&self, device: usize, stream: Stream) -> Result<Option<u64>, BackendError> {
        self.enter(device, "cuEventRecord")?;
        let reused = self.devices[device].events.lock().pop();
        let event = match reused {
            Some(event) => event as sys::CUevent,
            None => {
                let mut event: sys::CUevent = std::ptr::null_mut();
                let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
                // SAFETY: the context is current; the driver writes a new event handle.
                check(unsafe { sys::cuEventCreate(&mut event, flags) }, "cuEventCreate")?;
                event
            }
        };
        // SAFETY: `event` belongs to this device's context; `stream` is the caller's.
        if let Err(err) = check(unsafe { sys::cuEventRecord(event, stream.0 as sys::CUstream) }, "cuEventRecord") {
            // Not recorded: the event goes back to the pool for the next try.
            self.devices[device].events.lock().push(event as usize);
            return Err(err);
        }
        Ok(Some(event as u64))
    }

    fn event_done(&self, device: usize, event: u64) -> Result<bool, BackendError> {
        self.enter(device, "cuEventQuery")?;
        // SAFETY: `event` came from record_event and has not been recycled.
        match unsafe { sys::cuEventQuery(event as sys::CUevent) } {
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            other => check(other, "cuEventQuery").map(|()| true),
        }
    }

    fn wait_event(&self, device: usize, event: u64) -> Result<(), BackendError> {
        self.enter(device, "cuEventSynchronize")?;
        // SAFETY: `event` came from record_event and has not been recycled.
        check(unsafe { sys::cuEventSynchronize(event as sys::CUevent) }, "cuEventSynchronize")
    }

    fn stream_wait_event(&self, device: usize, stream: Stream, event: u64) -> Result<(), BackendError> {
        self.enter(device, "cuStreamWaitEvent")?;
        // SAFETY: `event` came from record_event; `stream` is the requester's.
        check(unsafe { sys::cuStreamWaitEvent(stream.0 as sys::CUstream, event as sys::CUevent, 0) }, "cuStreamWaitEvent")
    }

    fn recycle_event(&self, device: usize, event: u64) {
        if let Some(d) = self.devices.get(device) {
            d.events.lock().push(event as usize);
        }
    }

    fn shared_device_key(&self, device: usize) -> Option<String> {
        let d = self.devices.get(device)?;
        if d.uuid == [0; 16] {
            return Some(format!("cuda-ordinal-{}", d.ordinal));
        }
        Some(format!("cuda-{}", d.uuid.iter().map(|b| format!("{b:02x}")).collect::<String>()))
    }
}

/// Pinned host memory from `cuMemHostAlloc`, freed in the context that
/// allocated it.
struct PinnedHost {
    region: HostRegion,
    context: usize,
}

impl HostMemory for PinnedHost {
    fn bytes(&self) -> &[u8] {
        self.region.bytes()
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        self.region.bytes_mut()
    }
}

impl Drop for PinnedHost {
    fn drop(&mut self) {
        // SAFETY: `context` is a primary context retained for the process's
        // life; `addr` came from cuMemHostAlloc in it and is freed once.
        unsafe {
            sys::cuCtxSetCurrent(self.context as sys::CUcontext);
            sys::cuMemFreeHost(self.region.addr as *mut std::ffi::c_void);
        }
    }
}

/// Lets the device of `prop` (`device`'s) read and write [addr, addr + len),
/// pages just mapped by the caller: one call, counted on `device`.
fn grant_access(device: &Device, prop: &sys::CUmemAllocationProp, addr: u64, len: u64) -> Result<(), BackendError> {
    device.count_call();
    let access = sys::CUmemAccessDesc { location: prop.location, flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE };
    // SAFETY: the caller mapped [addr, addr + len); one access descriptor.
    check(unsafe { sys::cuMemSetAccess(addr, len as usize, &access, 1) }, "cuMemSetAccess")
}

/// One page of pinned device memory on `device`, for cuMemCreate and the
/// granularity query.
fn page_properties(device: sys::CUdevice) -> sys::CUmemAllocationProp {
    // SAFETY: CUmemAllocationProp is plain data; all zero is its documented
    // default (no handle types, no flags), completed below.
    let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = device;
    prop
}
