//! The C ABI (ffi/tidepool.h): from C and C++ programs, under valgrind,
//! over simgpu; the header against the library; out of memory, its
//! snapshot and observers; tags; the C++ entry points PyTorch calls.
//!
//! One test binary, one module per file (cargo links each binary once).

#[path = "../common/mod.rs"]
mod common;
#[path = "../common/pickle_doc.rs"]
mod pickle_doc;

mod c;
mod header;
mod oom;
mod tags;
mod torch_alloc;
