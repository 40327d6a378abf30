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
//! Each device works in its primary context, made current on the calling
//! thread when it is not (PyTorch's threads have it already; a plain Rust
//! program's do not). Every driver result is mapped in `check`: out of
//! memory becomes the engine's OutOfMemory (release and retry), anything
//! else an error naming the call and the code.

use std::ffi::{c_char, CStr};

use parking_lot::Mutex;

use cudarc::driver::sys;

use super::{Backend, BackendError, MemInfo};
use crate::Stream;

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
}

pub struct CudaBackend {
    devices: Vec<Device>,
    stream_ordered: bool,
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
            devices.push(Device { ordinal: device, context: context as usize, uuid, pool, events: Mutex::new(Vec::new()) });
        }
        Ok(CudaBackend { devices, stream_ordered })
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

    fn allocate(&self, device: usize, size: u64, stream: Stream) -> Result<u64, BackendError> {
        self.enter(device, "cuMemAlloc")?;
        let bytes = usize::try_from(size).map_err(|_| BackendError::OutOfMemory)?;
        let mut ptr: sys::CUdeviceptr = 0;
        let pool = self.devices[device].pool;
        if pool != 0 {
            // SAFETY: the context is current, `pool` was created for this
            // device, `stream` is the requester's; the driver writes the address.
            check(
                unsafe { sys::cuMemAllocFromPoolAsync(&mut ptr, bytes, pool as sys::CUmemoryPool, stream.0 as sys::CUstream) },
                "cuMemAllocFromPoolAsync",
            )?;
        } else {
            // SAFETY: the device's context is current; the driver writes the address into a local.
            check(unsafe { sys::cuMemAlloc_v2(&mut ptr, bytes) }, "cuMemAlloc_v2")?;
        }
        Ok(ptr)
    }

    fn release(&self, device: usize, base: u64, _size: u64, stream: Stream) -> Result<(), BackendError> {
        self.enter(device, "cuMemFree")?;
        let pool = self.devices[device].pool;
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

    fn synchronize_stream(&self, device: usize, stream: Stream) -> Result<(), BackendError> {
        self.enter(device, "cuStreamSynchronize")?;
        // SAFETY: `stream` is a CUstream the caller used for its work on this
        // device (PyTorch's record_stream); 0 is the legacy default stream.
        check(unsafe { sys::cuStreamSynchronize(stream.0 as sys::CUstream) }, "cuStreamSynchronize")
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
        check(unsafe { sys::cuEventRecord(event, stream.0 as sys::CUstream) }, "cuEventRecord")?;
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
