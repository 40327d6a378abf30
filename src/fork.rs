//! Fork safety: what a fork child may still use of its parent's tidepool,
//! and how the rest is left alone (docs/architecture.md#fork).
//!
//! `fork()` copies the whole process but only the thread that called it:
//! every lock another thread held stays held in the child, by no one.
//! tidepool's answer has three parts, each kept here or named here:
//! - **The fork count.** An allocator, a thread's cache and a registry slot
//!   remember the count they were made under; in a child the count has
//!   moved on and they are abandoned, never touched (no lock taken, no
//!   driver called, no memory given back: it is the parent's). The C ABI's
//!   allocator is made afresh in the child (`process.rs`).
//! - **Process locks** (`ProcessLock`), for the little data a child needs
//!   from its parent (the tag names, the warnings printed, the OOM
//!   observers): `pthread_atfork` holds them all while the process forks,
//!   so the child inherits them released and consistent. They are leaves:
//!   held for a few instructions, never while taking another lock or
//!   calling out. One gate does it: every process lock is taken under the
//!   gate's read side, and the fork handler takes its write side, which
//!   waits for every process lock to be released and keeps new ones out.
//! - **Nothing else is shared between threads behind a lock a child
//!   needs**: the heaps are per allocator (abandoned), the threads' cache
//!   slots are found and claimed with atomics (`LeakedList`, `cache_slot.rs`),
//!   stderr is written without std's lock (`log.rs`), and the locks
//!   themselves keep no state outside their word (`sync.rs`).
//!
//! Unsafe code here: registering the fork handlers with libc, and the
//! nodes of `LeakedList`, which are leaked and so live for the process.

use std::cell::RefCell;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicPtr, AtomicU64, Ordering};
use std::sync::{Once, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};

use crate::sync::{Mutex, MutexGuard};

static AT_FORK: Once = Once::new();
/// Forks this process has gone through, as seen from the child side.
static FORK_GENERATION: AtomicU64 = AtomicU64::new(0);
/// Read while a process lock is held; written while the process forks.
static GATE: RwLock<()> = RwLock::new(());

thread_local! {
    /// The gate's write side, from the fork's start to its end on both sides.
    static FORKING: RefCell<Option<RwLockWriteGuard<'static, ()>>> = const { RefCell::new(None) };
}

extern "C" fn before_fork() {
    let gate = GATE.write().unwrap_or_else(PoisonError::into_inner);
    // A thread tearing down its thread-locals cannot fork through here:
    // the gate is released at once then (nothing held, as before).
    let _ = FORKING.try_with(|held| *held.borrow_mut() = Some(gate));
}

extern "C" fn after_fork_in_parent() {
    let _ = FORKING.try_with(|held| held.borrow_mut().take());
}

extern "C" fn after_fork_in_child() {
    FORK_GENERATION.fetch_add(1, Ordering::AcqRel);
    let _ = FORKING.try_with(|held| held.borrow_mut().take());
}

/// Registers the fork handlers (idempotent) and returns the fork count now.
pub fn watch_forks() -> u64 {
    AT_FORK.call_once(|| {
        // SAFETY: registers handlers that neither panic nor unwind: they
        // take and release one lock and add to an atomic.
        unsafe { libc::pthread_atfork(Some(before_fork), Some(after_fork_in_parent), Some(after_fork_in_child)) };
    });
    fork_generation()
}

/// The forks counted so far (0 in a process that was not forked since
/// `watch_forks` was first called).
#[inline]
pub fn fork_generation() -> u64 {
    FORK_GENERATION.load(Ordering::Relaxed)
}

/// A lock on data that a fork child needs as its parent left it: held by
/// the fork handler while the process forks, so a child never inherits it
/// held. A leaf: whoever holds one takes no other lock and calls nothing
/// that might (see the top of this file).
pub struct ProcessLock<T> {
    inner: Mutex<T>,
}

/// A held process lock (the gate's read side with it).
pub struct ProcessGuard<'a, T> {
    // Released first: the data, then the gate.
    data: MutexGuard<'a, T>,
    _gate: RwLockReadGuard<'static, ()>,
}

impl<T> ProcessLock<T> {
    pub const fn new(value: T) -> ProcessLock<T> {
        ProcessLock { inner: Mutex::new(value) }
    }

    /// Waits for the lock (and for a fork under way to end) and takes it.
    pub fn lock(&self) -> ProcessGuard<'_, T> {
        watch_forks();
        let gate = GATE.read().unwrap_or_else(PoisonError::into_inner);
        ProcessGuard { data: self.inner.lock(), _gate: gate }
    }
}

impl<T> Deref for ProcessGuard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.data
    }
}

impl<T> DerefMut for ProcessGuard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        &mut self.data
    }
}

/// A list of values that live as long as the process, grown at its head
/// and walked without a lock (a fork child walks and grows it whatever the
/// parent's threads were doing). Nothing is ever removed.
pub struct LeakedList<T: 'static> {
    head: AtomicPtr<Node<T>>,
}

struct Node<T: 'static> {
    value: T,
    /// The node pushed before this one (null: none); set before the node is published.
    next: *const Node<T>,
}

impl<T: Sync> LeakedList<T> {
    pub const fn new() -> LeakedList<T> {
        LeakedList { head: AtomicPtr::new(std::ptr::null_mut()) }
    }

    /// Adds `value` at the head; returns it, for the life of the process.
    pub fn push(&self, value: T) -> &'static T {
        let node: &'static mut Node<T> = Box::leak(Box::new(Node { value, next: std::ptr::null() }));
        let mut head = self.head.load(Ordering::Acquire);
        loop {
            node.next = head;
            match self.head.compare_exchange_weak(head, node, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => break,
                Err(now) => head = now,
            }
        }
        // Leaked: never freed or moved; once published, only read.
        let node: &'static Node<T> = node;
        &node.value
    }

    /// The values, newest first.
    pub fn iter(&self) -> impl Iterator<Item = &'static T> {
        let mut next: *const Node<T> = self.head.load(Ordering::Acquire);
        std::iter::from_fn(move || {
            // SAFETY: a non-null pointer in the list names a leaked node,
            // published (Release) after it was written, read after an Acquire
            // load of the head or of the link that named it.
            let node: &'static Node<T> = unsafe { next.as_ref() }?;
            next = node.next;
            Some(&node.value)
        })
    }
}

// SAFETY: the list hands out shared references only, to values that are
// `Sync`; its raw links are written before publication and never after.
unsafe impl<T: Sync> Sync for LeakedList<T> {}
unsafe impl<T: Sync + Send> Send for LeakedList<T> {}
