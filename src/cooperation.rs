//! This process's slot among the tidepool processes sharing one GPU, and
//! what it does with it: publishing the device's figures at every
//! reclaimer pass, answering the others' requests for memory, and asking
//! them after an out-of-memory, with no heap locked while waiting.
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

use crate::backend::Backend;
use crate::config::Config;
use crate::error::AllocError;
use crate::registry::{self, Entry, Registry};
use crate::stats::{Events, Released};

/// How long the asking thread sleeps between two tries.
const POLL: Duration = Duration::from_millis(5);

/// One device's registry slot and the cooperation counters it keeps
/// (`num_coop_*`, `coop_last_wait_ms`: added to the device's statistics).
pub(crate) struct Cooperation {
    oom_wait: Duration,
    state: Mutex<State>,
}

struct State {
    registry: Registry,
    events: Events,
    /// Threads of this process waiting on its posted request (one request
    /// per process: withdrawn when the last of them is done).
    askers: u32,
}

impl State {
    fn new(registry: Registry) -> State {
        State { registry, events: Events::default(), askers: 0 }
    }
}

/// Withdraws the process's request once its last asker is done, however
/// it is done (a retry that panics included).
struct Asking<'a>(&'a Cooperation);

impl Drop for Asking<'_> {
    fn drop(&mut self) {
        let mut state = self.0.state.lock();
        state.askers -= 1;
        if state.askers == 0 {
            let _ = state.registry.request(0);
        }
    }
}

impl Cooperation {
    /// The slot of this process for `device`, when cooperation is on and
    /// the device can be shared; a registry that cannot be used is reported
    /// and cooperation stays off for the device.
    pub fn join(config: &Config, backend: &dyn Backend, device: usize) -> Option<Cooperation> {
        if !config.cooperative {
            return None;
        }
        let key = backend.shared_device_key(device)?;
        let dir = config.registry_dir.clone().unwrap_or_else(registry::default_dir);
        match Registry::join(&dir, &key) {
            Ok(registry) => {
                Some(Cooperation { oom_wait: Duration::from_millis(config.oom_wait_ms), state: Mutex::new(State::new(registry)) })
            }
            Err(err) => {
                crate::log::log_line(format_args!("tidepool: warning: cooperation off for device {device}: {err}"));
                None
            }
        }
    }

    /// The counters kept here.
    pub fn events(&self) -> Events {
        self.state.lock().events
    }

    /// Zeroes the accumulated counters (the last wait stays).
    pub fn reset_accumulated(&self) {
        let mut state = self.state.lock();
        state.events = state.events.accumulations_reset();
    }

    /// Publishes the device's figures; when some process asks for memory,
    /// `give_back` releases this process's idle cache of the device and the
    /// askers are told that this process has answered.
    pub fn publish_and_answer(&self, entry: Entry, give_back: impl FnOnce() -> Released) -> Released {
        let asked = self.state.lock().registry.publish(entry).unwrap_or(0);
        if asked == 0 {
            return Released::default();
        }
        let answer = give_back();
        let mut state = self.state.lock();
        if answer.bytes > 0 || answer.segments > 0 {
            state.events.num_coop_served += 1;
        }
        let _ = state.registry.mark_answered();
        answer
    }

    /// Asks the other processes for `need` bytes and calls `retry` (which
    /// locks what it needs) until it succeeds, fails otherwise than by an
    /// out-of-memory, every process asked has answered, or the wait is over.
    /// `None` when no one was asked: the out-of-memory stands at once.
    #[cold]
    #[inline(never)]
    pub fn ask_and_retry<T>(&self, need: u64, mut retry: impl FnMut() -> Result<T, AllocError>) -> Option<Result<T, AllocError>> {
        if self.oom_wait.is_zero() {
            return None;
        }
        let asked = {
            let mut state = self.state.lock();
            let asked = state.registry.ask(need).ok()??;
            state.events.num_coop_requests += 1;
            state.askers += 1;
            asked
        };
        let asking = Asking(self);
        let start = Instant::now();
        let result = loop {
            std::thread::sleep(POLL);
            // Read before the retry: an answer seen here is in what the retry
            // finds. A registry that cannot be read counts as answered.
            let answered = self.state.lock().registry.answered(&asked).unwrap_or(true);
            match retry() {
                Err(AllocError::OutOfMemory(_)) if !answered && start.elapsed() < self.oom_wait => continue,
                other => break other,
            }
        };
        if result.is_ok() {
            let mut state = self.state.lock();
            state.events.num_coop_satisfied += 1;
            state.events.coop_last_wait_ms = start.elapsed().as_millis() as u64;
        }
        drop(asking);
        Some(result)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;

    fn oom() -> AllocError {
        AllocError::OutOfMemory(Box::default())
    }

    #[test]
    fn two_threads_asking_at_once_share_the_request_until_the_last_is_done() {
        let dir = std::env::temp_dir().join(format!("tidepool-coop-askers-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let registry = Registry::join(&dir, "dev").unwrap();
        // Another process's slot (the same pid: alive) with cache to give back.
        let mut helper = Registry::join(&dir, "dev").unwrap();
        helper.publish(Entry { cached_free: 1 << 20, ..Entry::default() }).unwrap();
        let coop = Cooperation { oom_wait: Duration::from_secs(5), state: Mutex::new(State::new(registry)) };
        let (a_waits, b_posted) = (mpsc::channel::<()>(), mpsc::channel::<()>());
        let (a_done, seen_after_a) = (mpsc::channel::<()>(), mpsc::channel::<u64>());
        std::thread::scope(|scope| {
            let coop = &coop;
            scope.spawn(move || {
                let result = coop.ask_and_retry(100, || {
                    a_waits.0.send(()).unwrap();
                    b_posted.1.recv().unwrap();
                    Ok(())
                });
                assert!(matches!(result, Some(Ok(()))));
                a_done.0.send(()).unwrap();
            });
            a_waits.1.recv().unwrap();
            let mut calls = 0;
            let result = coop.ask_and_retry(200, || {
                calls += 1;
                if calls == 1 {
                    b_posted.0.send(()).unwrap();
                    return Err(oom());
                }
                // A is done: this thread's request must still be posted.
                a_done.1.recv().unwrap();
                seen_after_a.0.send(helper.publish(Entry { cached_free: 1 << 20, ..Entry::default() }).unwrap()).unwrap();
                Ok(())
            });
            assert!(matches!(result, Some(Ok(()))));
        });
        assert_eq!(seen_after_a.1.recv().unwrap(), 200, "the first asker to finish withdrew the other's request");
        // Both done: withdrawn.
        assert_eq!(helper.publish(Entry::default()).unwrap(), 0);
        drop((coop, helper));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
