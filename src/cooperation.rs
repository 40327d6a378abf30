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
//!
//! A registry that cannot be joined when the allocator starts (locked for
//! a moment by another process, a folder being made) is joined at a later
//! reclaimer pass, backing off up to `JOIN_BACKOFF_MAX`: until then this
//! process neither publishes nor asks, and says so once. A registry that
//! another tidepool rewrites to a format this one does not know, while
//! this process is in it, is left at once, with a warning that names the
//! file and what this process stops doing; it is joined again once the
//! file is of this version (the newer processes gone, the file removed).
#![forbid(unsafe_code)]

use std::path::PathBuf;
use std::time::{Duration, Instant};

use crate::sync::Mutex;

use crate::backend::Backend;
use crate::config::Config;
use crate::error::AllocError;
use crate::registry::{self, Entry, Registry};
use crate::stats::{Events, Released};

/// How long the asking thread sleeps between two tries.
const POLL: Duration = Duration::from_millis(5);

/// The longest wait between two tries to join a registry that could not
/// be joined (the waits double from one reclaimer pass up to this).
const JOIN_BACKOFF_MAX: Duration = Duration::from_millis(400);

/// One device's registry slot and the cooperation counters it keeps
/// (`num_coop_*`, `coop_last_wait_ms`: added to the device's statistics).
pub(crate) struct Cooperation {
    oom_wait: Duration,
    /// How often this process publishes (its reclaim interval).
    interval_ms: u64,
    /// The registry's folder and key.
    dir: PathBuf,
    key: String,
    state: Mutex<State>,
}

struct State {
    /// None until joined (`join_again`).
    registry: Option<Registry>,
    /// When to try to join next, and the wait after that one fails.
    next_join: Instant,
    join_backoff: Duration,
    events: Events,
    /// Threads of this process waiting on its posted request (one request
    /// per process: withdrawn when the last of them is done).
    askers: u32,
}

/// Withdraws the process's request once its last asker is done, however
/// it is done (a retry that panics included).
struct Asking<'a>(&'a Cooperation);

impl Drop for Asking<'_> {
    fn drop(&mut self) {
        let mut state = self.0.state.lock();
        state.askers -= 1;
        if let (0, Some(registry)) = (state.askers, state.registry.as_mut()) {
            let _ = registry.request(0);
        }
    }
}

impl Cooperation {
    /// The slot of this process for `device`, when cooperation is on and
    /// the device can be shared. A registry that cannot be joined now is
    /// reported once and joined at a later reclaimer pass.
    pub fn join(config: &Config, backend: &dyn Backend, device: usize) -> Option<Cooperation> {
        if !config.cooperative {
            return None;
        }
        let key = backend.shared_device_key(device)?;
        let dir = config.registry_dir.clone().unwrap_or_else(registry::default_dir);
        let backoff = Duration::from_millis(config.reclaim_interval_ms);
        let state = State { registry: None, next_join: Instant::now(), join_backoff: backoff, events: Events::default(), askers: 0 };
        let cooperation = Cooperation {
            oom_wait: Duration::from_millis(config.oom_wait_ms),
            interval_ms: config.reclaim_interval_ms,
            dir,
            key,
            state: Mutex::new(state),
        };
        if let Err(err) = cooperation.join_again(&mut cooperation.state.lock()) {
            crate::log::warn_once(
                "cooperation",
                &[format!("device {device}: off until its registry can be joined (tried again as the reclaimer runs): {err}")],
            );
        }
        Some(cooperation)
    }

    /// Joins the registry when it is not joined and a try is due; a failure
    /// puts the next try further off (up to `JOIN_BACKOFF_MAX`).
    fn join_again(&self, state: &mut State) -> Result<(), registry::RegistryError> {
        if state.registry.is_some() || Instant::now() < state.next_join {
            return Ok(());
        }
        match Registry::join(&self.dir, &self.key, self.interval_ms) {
            Ok(registry) => {
                state.registry = Some(registry);
                Ok(())
            }
            Err(err) => {
                state.next_join = Instant::now() + state.join_backoff;
                state.join_backoff = (state.join_backoff * 2).min(JOIN_BACKOFF_MAX);
                Err(err)
            }
        }
    }

    /// The value of a registry operation (`None`: not joined, or it
    /// failed). A registry rewritten to a format this process does not
    /// know is left, once, with a warning (see the top of this file);
    /// other failures (a lock held too long) pass.
    fn checked<T>(&self, state: &mut State, result: Option<Result<T, registry::RegistryError>>) -> Option<T> {
        match result? {
            Ok(value) => Some(value),
            Err(err @ registry::RegistryError::Version { .. }) => {
                crate::log::warn_once(
                    "cooperation",
                    &[format!(
                        "{err}: another tidepool rewrote it; this process (registry version {}) stops writing to it, so it no \
                         longer shows in tidepool top or the exporter and neither asks the other processes for memory nor \
                         answers them, until the file is of its version again",
                        registry::VERSION
                    )],
                );
                state.registry = None;
                state.next_join = Instant::now() + JOIN_BACKOFF_MAX;
                None
            }
            Err(_) => None,
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
        let asked = {
            let mut state = self.state.lock();
            let _ = self.join_again(&mut state);
            let published = state.registry.as_mut().map(|registry| registry.publish(entry));
            self.checked(&mut state, published).unwrap_or(0)
        };
        if asked == 0 {
            return Released::default();
        }
        let answer = give_back();
        let mut state = self.state.lock();
        if answer.bytes > 0 || answer.segments > 0 {
            state.events.num_coop_served += 1;
        }
        let marked = state.registry.as_mut().map(Registry::mark_answered);
        self.checked(&mut state, marked);
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
            let asked = state.registry.as_mut().map(|registry| registry.ask(need));
            let asked = self.checked(&mut state, asked)??;
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
            let answered = {
                let mut state = self.state.lock();
                let answered = state.registry.as_mut().map(|registry| registry.answered(&asked));
                self.checked(&mut state, answered).unwrap_or(true)
            };
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
        let scratch = tempfile::Builder::new().prefix("tidepool-coop-askers-").tempdir().unwrap();
        let dir = scratch.path().join("registry");
        let registry = Registry::join(&dir, "dev", 100).unwrap();
        // Another process's slot (the same pid: alive) with cache to give back.
        let mut helper = Registry::join(&dir, "dev", 100).unwrap();
        helper.publish(Entry { cached_free: 1 << 20, ..Entry::default() }).unwrap();
        let state = State { registry: Some(registry), next_join: Instant::now(), join_backoff: POLL, events: Events::default(), askers: 0 };
        let coop = Cooperation {
            oom_wait: Duration::from_secs(5),
            interval_ms: 100,
            dir: dir.clone(),
            key: "dev".into(),
            state: Mutex::new(state),
        };
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
    }
}
