//! Giving memory back: the release policy (`policy`, pure) and the
//! background thread that applies it to every heap of an allocator.
//!
//! The thread only wakes every `reclaim_interval_ms`, advances the coarse
//! clock the heaps stamp idle segments with, runs the pass the allocator
//! gave it (each heap applies the policy), and sleeps. The pass holds the
//! allocator weakly and says when it is gone, which stops the thread; a
//! forked child never joins its parent's thread. This module does not know
//! the heaps: layers point down.
#![forbid(unsafe_code)]

pub mod policy;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Milliseconds since the allocator started, advanced by the reclaimer:
/// reading it is one relaxed load, cheap enough for the allocation path.
#[derive(Debug)]
pub struct Clock {
    start: Instant,
    now_ms: AtomicU64,
}

impl Clock {
    pub fn new() -> Arc<Clock> {
        Arc::new(Clock { start: Instant::now(), now_ms: AtomicU64::new(0) })
    }

    #[inline]
    pub fn now_ms(&self) -> u64 {
        self.now_ms.load(Ordering::Relaxed)
    }

    /// Advances the clock to the real time.
    pub fn tick(&self) {
        self.now_ms.store(self.start.elapsed().as_millis() as u64, Ordering::Relaxed);
    }

    /// Sets the time by hand (tests).
    pub fn set(&self, ms: u64) {
        self.now_ms.store(ms, Ordering::Relaxed);
    }
}

/// The background thread of one allocator.
pub struct Reclaimer {
    stop: Arc<(Mutex<bool>, Condvar)>,
    handle: Option<JoinHandle<()>>,
    pid: u32,
}

impl Reclaimer {
    /// Starts the thread, waking every `interval` to run `pass`, which
    /// returns false once there is nothing left to reclaim for (the
    /// allocator is gone).
    pub fn start(pass: impl Fn() -> bool + Send + 'static, clock: Arc<Clock>, interval: Duration) -> std::io::Result<Reclaimer> {
        let stop = Arc::new((Mutex::new(false), Condvar::new()));
        let signal = stop.clone();
        let handle = std::thread::Builder::new().name("tidepool-reclaim".into()).spawn(move || {
            let (lock, wake) = &*signal;
            let mut stopped = lock.lock().unwrap_or_else(|e| e.into_inner());
            loop {
                // Checked before waiting too: a stop may come before the first wait.
                if *stopped {
                    return;
                }
                let (guard, _) = wake.wait_timeout(stopped, interval).unwrap_or_else(|e| e.into_inner());
                stopped = guard;
                if *stopped {
                    return;
                }
                clock.tick();
                // The heaps are locked one at a time, with the stop flag released.
                drop(stopped);
                if !pass() {
                    return;
                }
                stopped = lock.lock().unwrap_or_else(|e| e.into_inner());
            }
        })?;
        Ok(Reclaimer { stop, handle: Some(handle), pid: std::process::id() })
    }
}

impl Drop for Reclaimer {
    fn drop(&mut self) {
        // In a fork child the thread does not exist: nothing to stop or join,
        // and its stop flag's lock may have been held by it at the fork.
        if self.pid != std::process::id() {
            // Not even detached: the handle names a thread of the parent.
            std::mem::forget(self.handle.take());
            return;
        }
        let (lock, wake) = &*self.stop;
        *lock.lock().unwrap_or_else(|e| e.into_inner()) = true;
        wake.notify_all();
        if let Some(handle) = self.handle.take() {
            let _ = handle.join();
        }
    }
}
