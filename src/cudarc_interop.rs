//! cudarc interop (cargo feature `cudarc`): a [`Buffer`] is device memory
//! to cudarc 0.19, and cudarc's `CudaStream` is a tidepool [`Stream`].
//!
//! - `DeviceSlice`, `DevicePtr` and `DevicePtrMut` for `Buffer<T>`: what
//!   cudarc's copies take (`stream.memcpy_htod(&host, &mut buf)`,
//!   `clone_dtoh(&buf)`, `memcpy_dtoh`, `memcpy_dtod`, `memset_zeros`).
//! - `PushKernelArg<&Buffer<T>>` and `<&mut Buffer<T>>` for `LaunchArgs`:
//!   `stream.launch_builder(&f).arg(&mut buf)` passes the buffer's address.
//! - `Stream::from(&cuda_stream)`, and `Allocator::alloc_buffer_on(&stream, len)`.
//!
//! Stream order, as cudarc expects it of device memory: work on the
//! buffer's own stream needs nothing (tidepool's blocks are stream-ordered:
//! a block freed on a stream is reused only by later work on that stream,
//! or by another once events say that stream is done with it). A cudarc
//! copy on *another* stream makes that stream wait for the work queued on
//! the buffer's stream (what was written there, and the block's previous
//! owner), and records the stream so that the block is not reused before
//! the copy has run. cudarc's `LaunchArgs` does not show its stream to
//! arguments, so before a kernel on another stream call
//! [`Buffer::use_on`] (the same two steps). Work queued on another stream
//! and then read on the buffer's own is ordered by the caller
//! (`own.join(&other)`), as between any two CUDA streams.
//!
//! This is an FFI module in the sense of the design: cudarc's argument
//! trait is `unsafe`, and wrapping a stream handle is too.

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::driver::{
    sys, CudaContext, CudaStream, DevicePtr, DevicePtrMut, DeviceSlice, DriverError, LaunchArgs, PushKernelArg, SyncOnDrop,
};

use crate::allocator::Allocator;
use crate::backend::BackendError;
use crate::buffer::Buffer;
use crate::error::AllocError;
use crate::fork::ProcessLock;
use crate::types::Stream;

impl From<&CudaStream> for Stream {
    /// The stream's `CUstream` handle (0: the legacy default stream).
    fn from(stream: &CudaStream) -> Stream {
        Stream(stream.cu_stream() as u64)
    }
}

impl From<&Arc<CudaStream>> for Stream {
    fn from(stream: &Arc<CudaStream>) -> Stream {
        Stream::from(&**stream)
    }
}

impl Allocator {
    /// A buffer of `len` elements of `T` on `stream`'s device, for use on
    /// `stream` (`alloc_buffer` with the device and stream cudarc knows).
    pub fn alloc_buffer_on<T>(&self, stream: &Arc<CudaStream>, len: usize) -> Result<Buffer<'_, T>, AllocError> {
        let buffer = self.alloc_buffer(stream.context().ordinal(), len, Stream::from(stream))?;
        let _ = buffer.cuda_stream.set(stream.clone());
        Ok(buffer)
    }
}

impl<T> Buffer<'_, T> {
    /// Readies the buffer for work on `stream`, one other than its own:
    /// `stream` waits for the work queued on the buffer's stream so far,
    /// and the block is not reused before the work `stream` has queued
    /// when the buffer is dropped has run. cudarc's copies do this
    /// themselves; call it before a kernel launch on another stream.
    pub fn use_on(&self, stream: &CudaStream) -> Result<(), AllocError> {
        if !self.is_foreign(stream) {
            return Ok(());
        }
        self.wait_for_own(stream).map_err(|e| driver_error("cuStreamWaitEvent", e))?;
        self.record_stream(Stream::from(stream))
    }

    /// `use_on` from inside cudarc's calls, which cannot fail: a driver
    /// failure goes to the context's error state (`CudaContext::check_err`),
    /// as cudarc's own do. (Recording a stream for a block the buffer owns
    /// fails only in a fork child, where the memory is not its to use.)
    fn used_on(&self, stream: &CudaStream) {
        if self.is_foreign(stream) {
            stream.context().record_err(self.wait_for_own(stream));
            let _ = self.record_stream(Stream::from(stream));
        }
    }

    /// Whether `stream` is another than the buffer's, with memory to order.
    fn is_foreign(&self, stream: &CudaStream) -> bool {
        Stream::from(stream) != self.stream() && !self.is_empty()
    }

    /// Makes `stream` wait for the work queued on the buffer's stream.
    fn wait_for_own(&self, stream: &CudaStream) -> Result<(), DriverError> {
        let own = self.cuda_stream.get_or_init(|| borrowed_stream(stream.context(), self.stream()));
        stream.join(own)
    }
}

/// cudarc's wrapper of the stream handle `stream` in `context`, borrowed
/// (dropping it destroys nothing).
fn borrowed_stream(context: &Arc<CudaContext>, stream: Stream) -> Arc<CudaStream> {
    // SAFETY: `stream` is the handle the buffer was allocated for, a stream
    // of this device's primary context (the one tidepool's cuda backend and
    // cudarc both use); its owner keeps it alive while buffers on it live,
    // and the wrapper never destroys it.
    unsafe { context.wrap_borrowed_stream(stream.0 as sys::CUstream) }
}

/// The primary context of `device` as cudarc holds it, one per device
/// for the process.
fn context(device: usize) -> Result<Arc<CudaContext>, DriverError> {
    // A process lock, so taken only around the map: the driver is called without it.
    static CONTEXTS: ProcessLock<Option<HashMap<usize, Arc<CudaContext>>>> = ProcessLock::new(None);
    if let Some(context) = CONTEXTS.lock().get_or_insert_with(HashMap::new).get(&device) {
        return Ok(context.clone());
    }
    let context = CudaContext::new(device)?;
    // A thread that made one meanwhile wins: one wrapper per device.
    Ok(CONTEXTS.lock().get_or_insert_with(HashMap::new).entry(device).or_insert(context).clone())
}

fn driver_error(call: &'static str, err: DriverError) -> AllocError {
    AllocError::Backend(BackendError::Driver { call, code: err.0 as i64, message: format!("{err:?}") })
}

impl<T> DeviceSlice<T> for Buffer<'_, T> {
    fn len(&self) -> usize {
        Buffer::len(self)
    }

    /// cudarc's wrapper of the buffer's stream: the `CudaStream` it was
    /// allocated with (`alloc_buffer_on`), or one wrapping its handle in
    /// the device's primary context.
    ///
    /// # Panics
    /// When no wrapper was made yet and the driver cannot give the
    /// device's primary context (a buffer of the `host` backend given to
    /// cudarc).
    fn stream(&self) -> &Arc<CudaStream> {
        self.cuda_stream.get_or_init(|| {
            let context = context(self.device())
                .unwrap_or_else(|e| panic!("tidepool: no CUDA context for device {} of this buffer: {e:?}", self.device()));
            borrowed_stream(&context, self.stream())
        })
    }
}

impl<T> DevicePtr<T> for Buffer<'_, T> {
    fn device_ptr<'a>(&'a self, stream: &'a CudaStream) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        self.used_on(stream);
        (self.as_device_ptr().0, SyncOnDrop::Sync(None))
    }
}

impl<T> DevicePtrMut<T> for Buffer<'_, T> {
    fn device_ptr_mut<'a>(&'a mut self, stream: &'a CudaStream) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        self.used_on(stream);
        (self.as_device_ptr().0, SyncOnDrop::Sync(None))
    }
}

// SAFETY: the argument pushed is a reference to the buffer's device address
// (a `u64`, cudarc's `CUdeviceptr`), which lives as long as the borrow of
// the buffer, that is as long as `LaunchArgs` keeps it (`'b: 'a`).
unsafe impl<'a, 'b: 'a, T> PushKernelArg<&'b Buffer<'_, T>> for LaunchArgs<'a> {
    #[inline(always)]
    fn arg(&mut self, arg: &'b Buffer<'_, T>) -> &mut Self {
        self.arg(arg.device_address())
    }
}

// SAFETY: as for `&Buffer`: a reference to the address, borrowed for `'b: 'a`.
unsafe impl<'a, 'b: 'a, T> PushKernelArg<&'b mut Buffer<'_, T>> for LaunchArgs<'a> {
    #[inline(always)]
    fn arg(&mut self, arg: &'b mut Buffer<'_, T>) -> &mut Self {
        self.arg(arg.device_address())
    }
}
