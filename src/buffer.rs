//! `Buffer<T>`: typed device memory that frees itself. A buffer owns one
//! block of `len` elements of `T` on one device, for use on one stream; it
//! borrows the allocator that made it and gives the block back on drop,
//! on its stream.
//!
//! Choices:
//! - **A borrow, not an `Arc`**: `Buffer<'a, T>` holds `&'a Allocator`.
//!   It costs nothing per buffer (no reference count touched on every
//!   allocation and drop, the cached pair stays as cheap as `allocate` +
//!   `free`), and it works with every way an allocator is held: a local
//!   one, one in an `Arc`, and the process-wide [`crate::process::global()`], whose
//!   buffers are `Buffer<'static, T>` and can be stored anywhere and sent
//!   to any thread. The borrow checker, not a count, proves that no buffer
//!   outlives its allocator.
//! - **Zero length is an empty buffer, not an error**: no block is
//!   taken, [`Buffer::as_device_ptr`] is [`DevicePtr::NULL`] and dropping
//!   it does nothing, as `allocate(0)` returns NULL and as cudarc's
//!   `CudaStream::null()` gives an empty slice; a zero-sized `T` is the
//!   same. Code that sizes buffers from data (an empty batch) needs no
//!   special case.
//! - **`len * size_of::<T>()` that overflows is an error**
//!   (`AllocError::InvalidArgument`), never a wrapped, smaller block.
//! - Dropping never panics and never blocks: a failed free (the allocator
//!   belongs to the parent of a forked process) leaves the block to that
//!   allocator. Work queued on the buffer's stream before the drop runs
//!   before any later request on that stream can be given the memory
//!   (stream order); streams recorded with [`Buffer::record_stream`] are
//!   waited for through events before the block is reused at all.
#![forbid(unsafe_code)]

use std::fmt;
use std::marker::PhantomData;

use crate::allocator::Allocator;
use crate::error::{AllocError, InvalidArgument};
use crate::types::{DevicePtr, Stream};

/// `len` elements of `T` in device memory on `device`, for use on
/// `stream`; freed on that stream when dropped. Made by
/// [`Allocator::alloc_buffer`]. Not `Copy` or `Clone` (it owns its block);
/// `Send`, so it may be dropped on another thread.
///
/// ```
/// use tidepool::{Allocator, Config, Stream};
///
/// let alloc = Allocator::new(Config::builder().host(1, 1 << 30).build().unwrap()).unwrap();
/// let mut x = alloc.alloc_buffer::<f32>(0, 1024, Stream::DEFAULT).unwrap();
/// x.copy_from_host(&vec![1.5; 1024]).unwrap();
/// assert_eq!(x.to_vec().unwrap()[1023], 1.5);
/// assert_eq!(alloc.stats(0).unwrap().allocated_bytes.all.current, 4096);
/// drop(x); // back to the cache, on its stream
/// assert_eq!(alloc.stats(0).unwrap().allocated_bytes.all.current, 0);
/// ```
pub struct Buffer<'a, T> {
    alloc: &'a Allocator,
    ptr: DevicePtr,
    len: usize,
    device: usize,
    stream: Stream,
    /// cudarc's view of `stream`, made the first time cudarc asks for it
    /// (see `cudarc_interop.rs`).
    #[cfg(feature = "cudarc")]
    pub(crate) cuda_stream: std::sync::OnceLock<std::sync::Arc<cudarc::driver::CudaStream>>,
    _elements: PhantomData<T>,
}

impl Allocator {
    /// A buffer of `len` elements of `T` on `device` for use on `stream`,
    /// from the cache (its bytes are not initialised). Errors as
    /// [`Allocator::allocate`]: `OutOfMemory` carries the report; `len`
    /// whose byte size overflows is `InvalidArgument`. `len` 0 gives an
    /// empty buffer.
    #[inline]
    pub fn alloc_buffer<T>(&self, device: usize, len: usize, stream: Stream) -> Result<Buffer<'_, T>, AllocError> {
        let Some(bytes) = len.checked_mul(std::mem::size_of::<T>()) else {
            return Err(overflow::<T>(len));
        };
        let ptr = self.allocate(device, bytes, stream)?;
        Ok(Buffer {
            alloc: self,
            ptr,
            len,
            device,
            stream,
            #[cfg(feature = "cudarc")]
            cuda_stream: std::sync::OnceLock::new(),
            _elements: PhantomData,
        })
    }
}

#[cold]
fn overflow<T>(len: usize) -> AllocError {
    let size = std::mem::size_of::<T>();
    AllocError::InvalidArgument(InvalidArgument::BufferTooLarge { len, element: std::any::type_name::<T>(), element_size: size })
}

impl<'a, T> Buffer<'a, T> {
    /// The number of elements.
    #[inline]
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer holds no element (no memory either).
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The size in bytes: `len * size_of::<T>()`.
    #[inline]
    pub fn byte_len(&self) -> usize {
        self.len * std::mem::size_of::<T>()
    }

    /// The device the memory is on.
    #[inline]
    pub fn device(&self) -> usize {
        self.device
    }

    /// The stream the buffer was allocated for, and is freed on.
    #[inline]
    pub fn stream(&self) -> Stream {
        self.stream
    }

    /// The allocator the buffer came from.
    #[inline]
    pub fn allocator(&self) -> &'a Allocator {
        self.alloc
    }

    /// The device address of the first element, for kernel arguments and
    /// driver calls; NULL for an empty buffer. Valid while the buffer lives.
    #[inline]
    pub fn as_device_ptr(&self) -> DevicePtr {
        self.ptr
    }

    /// The address as a place in the buffer, for kernel arguments passed by
    /// reference (cudarc's `LaunchArgs`).
    #[cfg(feature = "cudarc")]
    pub(crate) fn device_address(&self) -> &u64 {
        &self.ptr.0
    }

    /// Notes that the buffer is used on `stream` too (PyTorch's
    /// `record_stream`): when it is dropped, its memory is not reused
    /// until the work queued on `stream` by then has run. The buffer's own
    /// stream needs no recording; neither does an empty buffer.
    pub fn record_stream(&self, stream: Stream) -> Result<(), AllocError> {
        if self.ptr.is_null() || stream == self.stream {
            return Ok(());
        }
        self.alloc.record_stream(self.ptr, stream)
    }

    /// Copies `src` into the first `src.len()` elements, in the order of
    /// the buffer's stream (after the work queued on it), returning once
    /// the copy is done. Through the backend: a driver copy on `cuda`, a
    /// plain copy on `host`. `src` longer than the buffer is refused.
    pub fn copy_from_host(&mut self, src: &[T]) -> Result<(), AllocError>
    where
        T: Plain,
    {
        self.check_fits(src.len())?;
        if src.is_empty() || std::mem::size_of::<T>() == 0 {
            return Ok(());
        }
        let mut bytes = Vec::with_capacity(std::mem::size_of_val(src));
        T::put_bytes(src, &mut bytes);
        let backend = self.alloc.backend();
        backend.copy_to_device(self.device, self.ptr.0, &bytes, self.stream).map_err(AllocError::Backend)
    }

    /// Copies the first `dst.len()` elements into `dst`, in the order of
    /// the buffer's stream (after the work queued on it), returning once
    /// the copy is done. `dst` longer than the buffer is refused.
    pub fn copy_to_host(&self, dst: &mut [T]) -> Result<(), AllocError>
    where
        T: Plain,
    {
        self.check_fits(dst.len())?;
        if dst.is_empty() || std::mem::size_of::<T>() == 0 {
            return Ok(());
        }
        let mut bytes = vec![0u8; std::mem::size_of_val(dst)];
        let backend = self.alloc.backend();
        backend.copy_to_host(self.device, self.ptr.0, &mut bytes, self.stream).map_err(AllocError::Backend)?;
        T::take_bytes(&bytes, dst);
        Ok(())
    }

    /// The elements, copied to a new vector (see `copy_to_host`).
    pub fn to_vec(&self) -> Result<Vec<T>, AllocError>
    where
        T: Plain,
    {
        let mut out = vec![T::ZERO; self.len];
        self.copy_to_host(&mut out)?;
        Ok(out)
    }

    fn check_fits(&self, elements: usize) -> Result<(), AllocError> {
        if elements > self.len {
            return Err(AllocError::InvalidArgument(InvalidArgument::CopyTooLarge { elements, len: self.len }));
        }
        Ok(())
    }
}

impl<T> Drop for Buffer<'_, T> {
    #[inline]
    fn drop(&mut self) {
        // An error here means the block is not ours to free any more (a
        // fork child holding its parent's buffer): nothing to do, and
        // nothing that may panic.
        let _ = self.alloc.free_on_stream(self.device, self.ptr, self.stream);
    }
}

impl<T> fmt::Debug for Buffer<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Buffer")
            .field("type", &std::any::type_name::<T>())
            .field("ptr", &format_args!("{:#x}", self.ptr.0))
            .field("len", &self.len)
            .field("device", &self.device)
            .field("stream", &format_args!("{:#x}", self.stream.0))
            .finish()
    }
}

mod sealed {
    pub trait Sealed {}
}

/// Element types whose values are plain bytes (every bit pattern is a
/// value), so a buffer of them can be copied to and from the host:
/// the integer and floating-point primitives.
pub trait Plain: Copy + sealed::Sealed {
    /// The all-zero value.
    const ZERO: Self;
    /// Appends the native-endian bytes of `values` to `out`.
    fn put_bytes(values: &[Self], out: &mut Vec<u8>);
    /// Reads `out.len()` values from native-endian `bytes`.
    fn take_bytes(bytes: &[u8], out: &mut [Self]);
}

macro_rules! plain {
    ($($t:ty),*) => {$(
        impl sealed::Sealed for $t {}
        impl Plain for $t {
            const ZERO: Self = 0 as $t;
            fn put_bytes(values: &[Self], out: &mut Vec<u8>) {
                for v in values {
                    out.extend_from_slice(&v.to_ne_bytes());
                }
            }
            fn take_bytes(bytes: &[u8], out: &mut [Self]) {
                const N: usize = std::mem::size_of::<$t>();
                for (v, chunk) in out.iter_mut().zip(bytes.chunks_exact(N)) {
                    let mut raw = [0u8; N];
                    raw.copy_from_slice(chunk);
                    *v = <$t>::from_ne_bytes(raw);
                }
            }
        }
    )*};
}

plain!(u8, i8, u16, i16, u32, i32, u64, i64, u128, i128, usize, isize, f32, f64);
