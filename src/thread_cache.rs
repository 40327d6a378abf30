//! Threads' caches of freed blocks: the cached path without the device's
//! lock. A thread that frees a block it allocated (of the shared pools,
//! not used on other streams, within the cache's bounds) keeps it in its
//! own cache, lent by the heap (`heap/lent.rs`), and its next request of
//! the same size on the same stream takes it back: one atomic
//! read-modify-write, no lock, no shared cache line. This file is the
//! owner's side, kept in thread-local storage: which entry holds which
//! size, and which handed-out blocks it may take back without asking the
//! heap. The heap's side (counting, peaks, taking blocks back) and the
//! protocol between them are in `heap/lent.rs` and `cache_slot.rs`.
//!
//! Every figure stays as without caches: the heap folds the caches' counts
//! in when it is read and keeps the peaks exact. Bounds: `thread_cache_blocks`
//! entries and `thread_cache_mb` bytes per thread and device. A thread's
//! cache goes back to the heap at every statistics read, snapshot, release
//! (`empty_cache`, an out-of-memory), tag pause, at the reclaimer's pass
//! after a pass without use, and when the thread exits.
#![forbid(unsafe_code)]

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};

use crate::addr_map::AddrMap;
use crate::cache_slot::CacheSlot;
use crate::device::Device;
use crate::error::AllocError;
use crate::heap::FreedOrLent;
use crate::types::Stream;

/// The bounds of each thread's cache on a device, and the allocator they
/// belong to.
#[derive(Clone)]
pub(crate) struct Bounds {
    /// Tells one allocator's caches from another's in the same thread.
    pub allocator: u64,
    pub blocks: usize,
    pub bytes: u64,
}

impl Bounds {
    /// Bounds for a new allocator, with its own id.
    pub fn new(blocks: usize, bytes: u64) -> Bounds {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        Bounds { allocator: NEXT.fetch_add(1, Ordering::Relaxed), blocks, bytes }
    }
}

/// What a cached block serves: requests of exactly `requested` bytes on `stream`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
struct Class {
    requested: u64,
    size: u64,
    stream: Stream,
    kind: usize,
}

/// One thread's cache on one device of one allocator.
struct OwnerCache {
    allocator: u64,
    device: usize,
    slot: Arc<CacheSlot>,
    /// The slot's index in the heap.
    index: u32,
    /// What each entry holds, where `occupied` has its bit.
    entries: Vec<Entry>,
    occupied: u64,
    /// The bytes of the occupied entries.
    bytes: u64,
    /// The entry the next free evicts when all are occupied (round robin).
    evict_next: usize,
    /// The slot's news when last looked at (`cache_slot.rs`).
    news: u64,
    /// Blocks handed out from the cache, by address: their index in `classes`.
    live: AddrMap,
    /// The block handed out last (0: none) and its class, kept out of
    /// `live` until the next hand-out: a pair frees it before then.
    last_out: (u64, u32),
    classes: Vec<Class>,
    class_index: HashMap<Class, u32>,
    max_bytes: u64,
    /// For giving everything back when the thread exits.
    devices: Weak<[Device]>,
}

/// What an entry holds: its class, and the request it serves copied from
/// the class (the search for a request reads the entries alone).
#[derive(Clone, Copy, Debug, Default)]
struct Entry {
    requested: u64,
    stream: Stream,
    class: u32,
}

impl OwnerCache {
    /// The cache of this thread on `devices[device]`, registered there.
    fn new(bounds: &Bounds, devices: &Arc<[Device]>, device: usize) -> OwnerCache {
        let slot = Arc::new(CacheSlot::new(bounds.blocks));
        let index = devices[device].register_slot(slot.clone());
        OwnerCache {
            allocator: bounds.allocator,
            device,
            slot,
            index,
            entries: vec![Entry::default(); bounds.blocks],
            occupied: 0,
            bytes: 0,
            evict_next: 0,
            news: 0,
            live: AddrMap::default(),
            last_out: (0, 0),
            classes: Vec::new(),
            class_index: HashMap::new(),
            max_bytes: bounds.bytes,
            devices: Arc::downgrade(devices),
        }
    }

    /// Looks at what the heap did since the last look, if anything.
    #[inline(always)]
    fn catch_up_if_news(&mut self) {
        if self.slot.news() != self.news {
            self.catch_up();
        }
    }

    /// After the heap did something: forgets the blocks other threads
    /// freed (the heap has them back) and looks at which entries are
    /// still occupied.
    #[cold]
    fn catch_up(&mut self) {
        self.news = self.slot.news();
        for addr in self.slot.take_remote() {
            self.forget(addr);
        }
        let (mut occupied, mut bytes) = (0, 0);
        for (i, entry) in self.entries.iter().enumerate() {
            if self.slot.entry(i) != 0 {
                occupied |= 1 << i;
                bytes += self.classes[entry.class as usize].size;
            }
        }
        (self.occupied, self.bytes) = (occupied, bytes);
    }

    /// Notes `addr`, of class `index`, as handed out.
    #[inline(always)]
    fn remember(&mut self, addr: u64, index: u32) {
        let (last, last_index) = std::mem::replace(&mut self.last_out, (addr, index));
        if last != 0 {
            self.live.insert(last, last_index);
        }
    }

    /// Forgets `addr` as handed out; its class if it was.
    #[inline(always)]
    fn forget(&mut self, addr: u64) -> Option<u32> {
        if self.last_out.0 == addr && addr != 0 {
            let index = self.last_out.1;
            self.last_out = (0, 0);
            return Some(index);
        }
        self.live.remove(addr)
    }

    /// The class of `addr` if it was handed out.
    #[inline(always)]
    fn handed_out(&self, addr: u64) -> Option<u32> {
        if self.last_out.0 == addr && addr != 0 {
            return Some(self.last_out.1);
        }
        self.live.get(addr)
    }

    /// The occupied entry serving a request of `size` bytes on `stream`.
    #[inline(always)]
    fn find(&self, size: u64, stream: Stream) -> Option<usize> {
        let mut bits = self.occupied;
        while bits != 0 {
            let i = bits.trailing_zeros() as usize;
            let entry = &self.entries[i];
            if entry.requested == size && entry.stream == stream {
                return Some(i);
            }
            bits &= bits - 1;
        }
        None
    }

    /// An empty entry and the bytes the cache can still take.
    #[inline(always)]
    fn room(&self) -> Option<(usize, u64)> {
        let empty = (!self.occupied).trailing_zeros() as usize;
        (empty < self.entries.len()).then(|| (empty, self.max_bytes.saturating_sub(self.bytes)))
    }

    /// Notes that entry `i` now holds a block of `class`.
    #[inline(always)]
    fn fill(&mut self, i: usize, class: Class) {
        let index = match self.class_index.get(&class) {
            Some(&index) => index,
            None => {
                self.classes.push(class);
                self.class_index.insert(class, (self.classes.len() - 1) as u32);
                (self.classes.len() - 1) as u32
            }
        };
        self.fill_with(i, index);
    }

    #[inline(always)]
    fn fill_with(&mut self, i: usize, index: u32) {
        let class = self.classes[index as usize];
        self.entries[i] = Entry { requested: class.requested, stream: class.stream, class: index };
        self.occupied |= 1 << i;
        self.bytes += class.size;
    }

    /// Notes that entry `i`, occupied, is now empty.
    #[inline(always)]
    fn empty(&mut self, i: usize) {
        self.occupied &= !(1 << i);
        self.bytes -= self.classes[self.entries[i].class as usize].size;
    }
}

impl Drop for OwnerCache {
    /// The thread exits: its cached blocks go back and those it handed out
    /// become plain ones.
    fn drop(&mut self) {
        if let Some(devices) = self.devices.upgrade() {
            devices[self.device].retire_slot(self.index);
        }
    }
}

thread_local! {
    static CACHES: RefCell<Vec<OwnerCache>> = const { RefCell::new(Vec::new()) };
}

/// Runs `f` on this thread's cache for (`allocator`, `device`), if it has
/// one (and the thread is not exiting).
#[inline(always)]
fn with_cache<R>(allocator: u64, device: usize, f: impl FnOnce(&mut OwnerCache) -> Option<R>) -> Option<R> {
    CACHES
        .try_with(|caches| {
            let mut caches = caches.try_borrow_mut().ok()?;
            let cache = caches.iter_mut().find(|c| c.allocator == allocator && c.device == device)?;
            cache.catch_up_if_news();
            f(cache)
        })
        .ok()
        .flatten()
}

impl Bounds {
    /// A request of `size` bytes on `stream` served from this thread's
    /// cache: `Ok` with the address, else `Err` with the slot's index
    /// when the cache holds a block for it but is disarmed (`None`: it holds none).
    #[inline(always)]
    pub fn allocate(&self, device: usize, size: u64, stream: Stream) -> Result<u64, Option<u32>> {
        with_cache(self.allocator, device, |cache| {
            let Some(i) = cache.find(size, stream) else {
                return Some(Err(None));
            };
            let slot = &cache.slot;
            if !slot.begin_hand_out() {
                return Some(Err(Some(cache.index)));
            }
            // Armed without a break since the entries were last synced (only
            // this thread arms): entry `i` still holds its block.
            let addr = slot.entry(i);
            let entry = cache.entries[i];
            let class = cache.classes[entry.class as usize];
            slot.set_entry(i, 0);
            slot.count_up(class.kind, [1, class.size, class.requested]);
            slot.end_hand_out();
            cache.empty(i);
            cache.remember(addr, entry.class);
            Some(Ok(addr))
        })
        .unwrap_or(Err(None))
    }

    /// Frees `ptr` into this thread's cache if the cache handed it out, is
    /// armed and has room; `size`, when the caller states one, must be the
    /// size requested. False: the heap must free it (`free_slow`).
    #[inline(always)]
    pub fn free(&self, device: usize, ptr: u64, size: Option<u64>) -> bool {
        with_cache(self.allocator, device, |cache| {
            let index = cache.handed_out(ptr)?;
            let class = cache.classes[index as usize];
            if size.is_some_and(|s| s != class.requested) || !cache.slot.is_armed() {
                return None;
            }
            let (entry, room) = cache.room()?;
            if class.size > room {
                return None;
            }
            cache.forget(ptr);
            cache.fill_with(entry, index);
            // The entry first: a recall that takes it then counts the free
            // later, never a free of a block it does not find.
            cache.slot.set_entry(entry, ptr);
            cache.slot.count_down(class.kind, [1, class.size, class.requested]);
            Some(())
        })
        .is_some()
    }

    /// The free of `ptr` through `devices[device]`'s heap, which lends the
    /// block to this thread's cache when it may (the cache registered on
    /// first use). `size`: as the caller states it (a different one is
    /// counted as a mismatch).
    pub fn free_slow(&self, devices: &Arc<[Device]>, device: usize, ptr: u64, size: Option<u64>) -> Result<u64, AllocError> {
        let dev = &devices[device];
        let lent = CACHES.try_with(|caches| {
            let mut caches = caches.try_borrow_mut().ok()?;
            let position = match caches.iter().position(|c| c.allocator == self.allocator && c.device == device) {
                Some(position) => position,
                None => {
                    // Caches of allocators since dropped have nothing left to give back.
                    caches.retain(|c| c.devices.strong_count() > 0);
                    caches.push(OwnerCache::new(self, devices, device));
                    caches.len() - 1
                }
            };
            let cache = &mut caches[position];
            cache.catch_up_if_news();
            cache.forget(ptr);
            // An empty entry, else the next in turn, whose block goes back.
            let (entry, room) = cache.room().unwrap_or_else(|| {
                let victim = cache.evict_next;
                cache.evict_next = (victim + 1) % cache.entries.len();
                let victim_size = cache.classes[cache.entries[victim].class as usize].size;
                (victim, cache.max_bytes.saturating_sub(cache.bytes - victim_size))
            });
            let result = dev.free_or_lend(ptr, cache.index, Some(entry), room, size);
            if let Ok(FreedOrLent::Lent(lent)) = &result {
                if cache.occupied & (1 << entry) != 0 {
                    cache.empty(entry); // evicted
                }
                cache.fill(entry, Class { requested: lent.requested, size: lent.size, stream: lent.stream, kind: lent.kind as usize });
            }
            Some(result)
        });
        let result = match lent {
            Ok(Some(result)) => result,
            // The thread is exiting, or this is a free from inside the cache's own drop.
            _ => dev.free_or_lend(ptr, u32::MAX, None, 0, size),
        };
        result.map(|outcome| outcome.requested())
    }
}
