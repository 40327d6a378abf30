//! The lock tidepool's own data sits behind: std's mutex, which on Linux is
//! one futex word and keeps no state anywhere else. A fork child can take
//! and release the locks it makes as any process does, whatever its
//! parent's threads were doing; parking_lot's locks share a process-wide
//! table of waiting threads whose buckets a thread that does not exist in
//! the child may have held (docs/architecture.md#fork).
//!
//! A panic while the lock is held does not poison it: the allocator goes
//! on, as with parking_lot before (its own invariants are checked by
//! `validate`, not by poisoning).
#![forbid(unsafe_code)]

use std::sync::PoisonError;

pub use std::sync::MutexGuard;

/// `std::sync::Mutex` whose `lock` returns the guard.
#[derive(Default, Debug)]
pub struct Mutex<T>(std::sync::Mutex<T>);

impl<T> Mutex<T> {
    pub const fn new(value: T) -> Mutex<T> {
        Mutex(std::sync::Mutex::new(value))
    }

    /// Waits for the lock and takes it.
    #[inline]
    pub fn lock(&self) -> MutexGuard<'_, T> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}
