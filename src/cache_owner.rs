//! `Owner`: what only the owner of a thread's cache reads and writes,
//! kept in its slot (`cache_slot.rs`) so that the owner reaches it from a
//! plain `&'static` reference, with no thread-local closure around the
//! cached path (see `thread_cache.rs`): which class each entry serves,
//! which entries are occupied, the entries by a hash of their request,
//! the bytes cached and what was handed out last.
//!
//! One thread at a time uses an `Owner`: the slot's owner, and after it
//! exits the next thread that takes the slot (through the spare list,
//! whose lock orders the two). Its words are atomics only because the
//! slot outlives its thread: relaxed loads and stores, which are plain
//! moves on x86 and ARM. No other thread, the heap included, reads them.
#![forbid(unsafe_code)]

use std::sync::atomic::{AtomicU64, Ordering};

/// The most entries a thread's cache has (`thread_cache_blocks`' bound):
/// the owner keeps which are occupied in one word.
pub const MAX_ENTRIES: usize = 64;

/// A word only the owner reads and writes (see the top of this file).
pub struct Word(AtomicU64);

impl Word {
    pub const fn new() -> Word {
        Word(AtomicU64::new(0))
    }

    #[inline(always)]
    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }

    #[inline(always)]
    pub fn set(&self, value: u64) {
        self.0.store(value, Ordering::Relaxed)
    }
}

/// What an entry's block serves: requests of exactly `requested` bytes on
/// `stream`; a block of `size` bytes from pools of `kind`. The record
/// stays after the entry is emptied, until it is filled again.
pub struct EntryRecord {
    pub requested: Word,
    pub size: Word,
    pub stream: Word,
    pub kind: Word,
    /// The class's index among those the owner has seen (its cold side's).
    pub class: Word,
    /// The bucket of (`requested`, `stream`) in `Owner::buckets`.
    pub bucket: Word,
}

impl EntryRecord {
    const fn new() -> EntryRecord {
        EntryRecord {
            requested: Word::new(),
            size: Word::new(),
            stream: Word::new(),
            kind: Word::new(),
            class: Word::new(),
            bucket: Word::new(),
        }
    }
}

/// The owner's records of one thread's cache on one device. Invariants
/// (kept by `thread_cache.rs`): `occupied` ⊆ `usable`; entry `i`, once
/// filled, is in bucket `entries[i].bucket` and no other; `bytes` is the sum of the
/// occupied entries' sizes (when nothing is news) and at most `max_bytes`.
pub struct Owner {
    pub entries: [EntryRecord; MAX_ENTRIES],
    /// A bit per entry holding a block, as last seen.
    pub occupied: Word,
    /// A bit for each of the `thread_cache_blocks` entries.
    pub usable: Word,
    /// By a hash of the request: the entries that may serve it.
    pub buckets: [Word; MAX_ENTRIES],
    pub bytes: Word,
    pub max_bytes: Word,
    /// The entry the next free evicts when all are occupied (round robin).
    pub evict_next: Word,
    /// The slot's news when last looked at.
    pub news: Word,
    /// The slot's index in its heap.
    pub heap_index: Word,
    /// The block handed out last (0: none) and the entry it came from,
    /// whose record stays as it was until the entry is filled again.
    pub last_out: Word,
    pub last_entry: Word,
}

impl Owner {
    pub const fn new() -> Owner {
        Owner {
            entries: [const { EntryRecord::new() }; MAX_ENTRIES],
            occupied: Word::new(),
            usable: Word::new(),
            buckets: [const { Word::new() }; MAX_ENTRIES],
            bytes: Word::new(),
            max_bytes: Word::new(),
            evict_next: Word::new(),
            news: Word::new(),
            heap_index: Word::new(),
            last_out: Word::new(),
            last_entry: Word::new(),
        }
    }

    /// Forgets everything, for a new owner.
    pub fn reset(&self) {
        for entry in &self.entries {
            for word in [&entry.requested, &entry.size, &entry.stream, &entry.kind, &entry.class, &entry.bucket] {
                word.set(0);
            }
        }
        self.buckets.iter().for_each(|b| b.set(0));
        for word in [
            &self.occupied,
            &self.usable,
            &self.bytes,
            &self.max_bytes,
            &self.evict_next,
            &self.news,
            &self.heap_index,
            &self.last_out,
            &self.last_entry,
        ] {
            word.set(0);
        }
    }
}

impl Default for Owner {
    fn default() -> Owner {
        Owner::new()
    }
}
