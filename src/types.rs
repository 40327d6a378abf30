//! The handles every layer passes around: a stream and a device address.
//! They live here, at the bottom, so that the backends and the heaps name
//! them without reaching up to the allocator (lib.rs re-exports them).
#![forbid(unsafe_code)]

/// An opaque stream handle (a `CUstream`); 0 is the default stream.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Stream(pub u64);

impl Stream {
    pub const DEFAULT: Stream = Stream(0);
}

/// A device address returned by [`crate::allocator::Allocator::allocate`]; 0 for a 0-byte request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DevicePtr(pub u64);

impl DevicePtr {
    pub const NULL: DevicePtr = DevicePtr(0);

    pub fn is_null(self) -> bool {
        self.0 == 0
    }
}
