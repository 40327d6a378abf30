//! `CacheSlot`: what one thread's cache of freed blocks on one device
//! shares with the rest of the process. The thread (its owner,
//! `thread_cache.rs`) serves requests from it without the heap's lock; the
//! heap (`heap/lent.rs`), under its lock, counts what the cache did, takes
//! the blocks back and tells the owner of frees made by other threads.
//!
//! The protocol, all of it through these atomics:
//! - `state` is `ARMED` while the owner may hand out cached blocks. The
//!   owner hands one out only after switching `ARMED` to `BUSY` (its one
//!   atomic read-modify-write per request), and sets `ARMED` again after.
//!   The heap stops handing out by switching `ARMED` to `DISARMED`
//!   (`disarm`, waiting out a `BUSY` owner); only the heap arms again, at
//!   the owner's request, under its lock. So while a slot is disarmed its
//!   `ups` do not move, and the heap can count them exactly.
//! - `entries` holds the cached blocks' addresses (0: empty). Only the
//!   owner fills an empty entry (a plain store, frees need no
//!   read-modify-write); only a disarmed slot's entries are emptied by the
//!   heap (`take_entries`), and only a `BUSY` owner empties one.
//! - `ups` and `downs` are sums the owner alone writes: what its hand-outs
//!   added to the allocation, allocated-bytes and requested-bytes gauges of
//!   each pool kind, and what its frees took away. The heap folds the
//!   difference since it last looked into its own gauges (`absorb`).
//! - `remote` lists lent blocks freed by other threads (through the heap),
//!   for the owner to forget.
//! - `news` counts what the heap did that the owner must look at: entries
//!   emptied, blocks freed by other threads (one load tells the owner it
//!   has nothing to look at).
//!
//! The slot also keeps the owner's own records (`owner`, `cache_owner.rs`),
//! which no one else reads: a slot outlives its thread, so the owner
//! reaches them through its `&'static` slot.
#![forbid(unsafe_code)]

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};

use crate::sync::Mutex;

use crate::cache_owner::{Owner, MAX_ENTRIES};
use crate::fork::LeakedList;

/// The slot of no cache: what an unused place in a thread's caches points at.
pub static UNUSED: CacheSlot = CacheSlot::new();

/// Every slot made so far. A slot is claimed (`in_use`) by the thread
/// whose cache it is and released when that thread exits; a fork child
/// finds the slots of its parent's threads claimed and leaves them so.
static SLOTS: LeakedList<CacheSlot> = LeakedList::new();

/// A slot for a new thread's cache: a released one, disarmed and emptied,
/// else a new one. Slots live as long as the process (one per thread and
/// device that used a cache at the same time, at most). No lock: a fork
/// child takes one whatever its parent's threads were doing (`fork.rs`).
pub fn take() -> &'static CacheSlot {
    let claim = |slot: &CacheSlot| slot.in_use.compare_exchange(false, true, Ordering::AcqRel, Ordering::Relaxed).is_ok();
    if let Some(slot) = SLOTS.iter().find(|slot| claim(slot)) {
        slot.state.store(DISARMED, Ordering::Release);
        slot.entries.iter().for_each(|e| e.store(0, Ordering::Release));
        slot.remote.lock().clear();
        slot.owner.reset();
        return slot;
    }
    let fresh = CacheSlot::new();
    fresh.in_use.store(true, Ordering::Relaxed);
    SLOTS.push(fresh)
}

/// Gives back a slot no heap and no thread uses any more.
pub fn give_back(slot: &'static CacheSlot) {
    slot.in_use.store(false, Ordering::Release);
}

/// The owner may hand out cached blocks.
pub const ARMED: u8 = 0;
/// The owner is handing one out.
pub const BUSY: u8 = 1;
/// The heap has stopped hand-outs until it arms the slot again.
pub const DISARMED: u8 = 2;

/// The gauges a hand-out moves: `allocation`, `allocated_bytes`, `requested_bytes`.
pub const GAUGES: usize = 3;

/// Per gauge, per pool kind (small, large).
pub type Amounts = [[u64; 2]; GAUGES];

/// What one thread's cache shares (see the top of this file). Aligned so
/// that two threads' slots share no cache line.
#[repr(align(128))]
pub struct CacheSlot {
    state: AtomicU8,
    entries: [AtomicU64; MAX_ENTRIES],
    /// Per pool kind, per gauge (one kind's three sums side by side).
    ups: [[AtomicU64; GAUGES]; 2],
    downs: [[AtomicU64; GAUGES]; 2],
    news: AtomicU64,
    remote: Mutex<Vec<u64>>,
    /// Claimed by a thread's cache (`take`), released when it exits (`give_back`).
    in_use: AtomicBool,
    /// The owner's records, for the owner alone.
    pub owner: Owner,
}

impl CacheSlot {
    /// A disarmed slot, every entry empty.
    pub const fn new() -> CacheSlot {
        CacheSlot {
            state: AtomicU8::new(DISARMED),
            entries: [const { AtomicU64::new(0) }; MAX_ENTRIES],
            ups: [const { [const { AtomicU64::new(0) }; GAUGES] }; 2],
            downs: [const { [const { AtomicU64::new(0) }; GAUGES] }; 2],
            news: AtomicU64::new(0),
            remote: Mutex::new(Vec::new()),
            in_use: AtomicBool::new(false),
            owner: Owner::new(),
        }
    }

    // The owner's side.

    /// Starts a hand-out: true when the slot was armed (it is now busy).
    #[inline(always)]
    pub fn begin_hand_out(&self) -> bool {
        self.state.compare_exchange(ARMED, BUSY, Ordering::Acquire, Ordering::Relaxed).is_ok()
    }

    /// Ends a hand-out begun by `begin_hand_out`.
    #[inline(always)]
    pub fn end_hand_out(&self) {
        self.state.store(ARMED, Ordering::Release);
    }

    /// The address in entry `index` (0: empty).
    #[inline(always)]
    pub fn entry(&self, index: usize) -> u64 {
        self.entries[index % MAX_ENTRIES].load(Ordering::Acquire)
    }

    /// Fills the empty entry `index` (owner, any state) or empties it (owner, busy).
    #[inline(always)]
    pub fn set_entry(&self, index: usize, addr: u64) {
        self.entries[index % MAX_ENTRIES].store(addr, Ordering::Release);
    }

    /// Adds `amounts` (allocation, bytes, requested) of `kind` to the hand-outs' sums.
    #[inline(always)]
    pub fn count_up(&self, kind: usize, amounts: [u64; GAUGES]) {
        add(&self.ups[kind & 1], amounts);
    }

    /// Adds `amounts` of `kind` to the frees' sums.
    #[inline(always)]
    pub fn count_down(&self, kind: usize, amounts: [u64; GAUGES]) {
        add(&self.downs[kind & 1], amounts);
    }

    /// The count of the heap's doings the owner must look at (it changed:
    /// `take_remote`, and the entries may have been emptied).
    #[inline(always)]
    pub fn news(&self) -> u64 {
        self.news.load(Ordering::Acquire)
    }

    /// The lent blocks other threads freed since the last call.
    pub fn take_remote(&self) -> Vec<u64> {
        std::mem::take(&mut *self.remote.lock())
    }

    // The heap's side, under its lock.

    pub fn is_armed(&self) -> bool {
        self.state.load(Ordering::Acquire) != DISARMED
    }

    /// Stops hand-outs, waiting for one under way to end. Afterwards `ups`
    /// stay as they are until the slot is armed again.
    pub fn disarm(&self) {
        loop {
            match self.state.compare_exchange(ARMED, DISARMED, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) | Err(DISARMED) => return,
                Err(_) => std::thread::yield_now(), // BUSY: a hand-out of a few instructions
            }
        }
    }

    /// Lets the owner hand out again (the heap, under its lock, at the
    /// owner's request: no one else can be arming or disarming).
    pub fn arm(&self) {
        self.state.store(ARMED, Ordering::Release);
    }

    /// Empties every entry of a disarmed slot; returns the addresses taken.
    pub fn take_entries(&self) -> Vec<u64> {
        debug_assert!(!self.is_armed(), "entries are taken from a disarmed slot only");
        let taken = self.entries.iter().map(|e| e.swap(0, Ordering::AcqRel)).filter(|&a| a != 0).collect();
        self.news.fetch_add(1, Ordering::AcqRel);
        taken
    }

    /// Whether `addr` is in one of the entries.
    pub fn holds(&self, addr: u64) -> bool {
        self.entries.iter().any(|e| e.load(Ordering::Acquire) == addr)
    }

    /// Whether no entry holds a block.
    pub fn is_empty(&self) -> bool {
        self.entries.iter().all(|e| e.load(Ordering::Acquire) == 0)
    }

    /// The addresses in the entries now.
    pub fn cached(&self) -> Vec<u64> {
        self.entries.iter().map(|e| e.load(Ordering::Acquire)).filter(|&a| a != 0).collect()
    }

    /// The hand-outs' and the frees' sums. Read the frees first: of a
    /// disarmed slot, whose hand-outs do not move, the two then describe a
    /// moment (frees made between the reads are of blocks already counted up).
    pub fn sums(&self) -> (Amounts, Amounts) {
        let read =
            |sums: &[[AtomicU64; GAUGES]; 2]| std::array::from_fn(|gauge| [0, 1].map(|kind| sums[kind][gauge].load(Ordering::Acquire)));
        let downs = read(&self.downs);
        (read(&self.ups), downs)
    }

    /// How many hand-outs and frees the owner made: unchanged between two
    /// reclaimer passes, the cache is idle.
    pub fn activity(&self) -> u64 {
        let count = |sums: &[[AtomicU64; GAUGES]; 2]| sums[0][0].load(Ordering::Relaxed) + sums[1][0].load(Ordering::Relaxed);
        count(&self.ups) + count(&self.downs)
    }

    /// Tells the owner that `addr`, a block it was lent, was freed by another thread.
    pub fn push_remote(&self, addr: u64) {
        self.remote.lock().push(addr);
        self.news.fetch_add(1, Ordering::AcqRel);
    }
}

/// Adds `amounts` to `sums`, which only the owner writes (no read-modify-write needed).
#[inline(always)]
fn add(sums: &[AtomicU64; GAUGES], amounts: [u64; GAUGES]) {
    for (sum, amount) in sums.iter().zip(amounts) {
        sum.store(sum.load(Ordering::Relaxed) + amount, Ordering::Release);
    }
}

impl Default for CacheSlot {
    fn default() -> CacheSlot {
        CacheSlot::new()
    }
}
