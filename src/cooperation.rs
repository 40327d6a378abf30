//! Asking the other processes on a device for memory after an
//! out-of-memory, with no heap locked while waiting.
//!
//! The request is posted only when the registry shows another live process
//! holding memory it could give back; the asking thread then sleeps with
//! every heap unlocked (the device's other threads keep allocating and
//! freeing, and this process's reclaimer keeps answering the others),
//! retakes the lock to retry, and stops as soon as every process asked has
//! answered (one reclaim interval of theirs) or `oom_wait_ms` has passed.
#![forbid(unsafe_code)]

use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::error::AllocError;
use crate::heap::DeviceHeap;

/// How long the asking thread sleeps between two tries.
const POLL: Duration = Duration::from_millis(5);

/// Asks the other processes for `need` bytes through `registry_heap` (the
/// device's heap holding its registry slot) and calls `retry` (which locks
/// what it needs) until it succeeds, fails otherwise than by an
/// out-of-memory, every process asked has answered, or the wait is over.
/// `None` when no one was asked: the out-of-memory stands at once.
#[cold]
#[inline(never)]
pub(crate) fn ask_and_retry<T>(
    registry_heap: &Mutex<DeviceHeap>,
    need: u64,
    mut retry: impl FnMut() -> Result<T, AllocError>,
) -> Option<Result<T, AllocError>> {
    let (asked, wait) = {
        let mut heap = registry_heap.lock();
        (heap.ask_others(need)?, heap.oom_wait())
    };
    let start = Instant::now();
    let result = loop {
        std::thread::sleep(POLL);
        // Read before the retry: an answer seen here is in what the retry finds.
        let answered = registry_heap.lock().others_answered(&asked);
        match retry() {
            Err(AllocError::OutOfMemory(_)) if !answered && start.elapsed() < wait => continue,
            other => break other,
        }
    };
    registry_heap.lock().end_asking(result.is_ok().then(|| start.elapsed()));
    Some(result)
}
