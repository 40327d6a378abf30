//! Threads' caches of freed blocks: the cached path without the device's
//! lock. A thread that frees a block it allocated (of the shared pools,
//! not used on other streams, within the cache's bounds) keeps it in its
//! own cache, lent by the heap (`heap/lent.rs`), and its next request of
//! the same size on the same stream takes it back: one atomic
//! read-modify-write, no lock, no shared cache line. This file is the
//! owner's side: which entry holds which size, and which handed-out blocks
//! it may take back without asking the heap. The heap's side (counting, peaks, taking blocks back) and the
//! protocol between them are in `heap/lent.rs` and `cache_slot.rs`.
//!
//! The owner's side: a thread-local of plain data (`PLACES`: which slot
//! serves which (allocator, device), at most `HOT_CACHES` of them per
//! thread; requests on others go to the heap), the owner's records kept in
//! the slot itself (`cache_owner.rs`: the entries' classes, what was handed
//! out last), so that the cached path runs on a `&'static` slot outside
//! any thread-local closure, and a cold thread-local (`COLD`: the blocks
//! handed out before the last, the sizes seen, and the destructor that
//! gives everything back when the thread exits). Slots live as long as the
//! process and are used again by later threads (`cache_slot::take`).
//!
//! Every figure stays as without caches: the heap folds the caches' counts
//! in when it is read and keeps the peaks exact. Bounds: `thread_cache_blocks`
//! entries and `thread_cache_mb` bytes per thread and device. A thread's
//! cache goes back to the heap at every statistics read, snapshot, release
//! (`empty_cache`, an out-of-memory), tag pause, at the reclaimer's pass
//! after a pass without use, and when the thread exits.
#![forbid(unsafe_code)]

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};

use crate::addr_map::AddrMap;
use crate::cache_owner::{Owner, MAX_ENTRIES};
use crate::cache_slot::{self, CacheSlot};
use crate::device::Device;
use crate::error::AllocError;
use crate::fork;
use crate::heap::FreedOrLent;
use crate::types::Stream;

/// The most (allocator, device) pairs one thread keeps caches for.
pub const HOT_CACHES: usize = 4;

/// One allocator's thread caches: the allocator they belong to, the bounds
/// of each thread's cache on a device, and the cached path itself
/// (`allocate`, `free`, `free_unnamed`, and `free_slow` when a cache cannot
/// take a free).
#[derive(Clone)]
pub(crate) struct ThreadCaches {
    /// Tells one allocator's caches from another's in the same thread (never 0).
    pub allocator: u64,
    pub blocks: usize,
    pub bytes: u64,
}

impl ThreadCaches {
    /// The thread caches of a new allocator, with its own id.
    pub fn new(blocks: usize, bytes: u64) -> ThreadCaches {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        ThreadCaches { allocator: NEXT.fetch_add(1, Ordering::Relaxed), blocks, bytes }
    }
}

/// What a thread's cache answers a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Cached {
    /// A block's address.
    Hit(u64),
    /// The cache holds no block for it.
    Miss,
    /// The cache holds one but the heap disarmed it: slot `index` must be armed again first.
    Disarmed(u32),
}

/// What a thread's cache did with a free that names no device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Unnamed {
    /// Freed into the cache.
    Cached,
    /// The cache of `device` handed it out but cannot keep it: the heap of
    /// that device must free it (`free_slow`).
    Heap(usize),
    /// No cache of this thread handed it out (or it was freed since).
    Unknown,
}

/// What a cached block serves: requests of exactly `requested` bytes on `stream`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Class {
    requested: u64,
    size: u64,
    stream: Stream,
    kind: usize,
}

/// A class and its index in `ColdCache::classes`: what an entry holds,
/// and what the owner remembers of a block it handed out.
#[derive(Clone, Copy, Debug)]
struct Held {
    class: Class,
    index: u32,
    /// `bucket(class.requested, class.stream)`.
    bucket: u32,
}

impl Held {
    fn new(class: Class, index: u32) -> Held {
        Held { class, index, bucket: bucket(class.requested, class.stream) as u32 }
    }
}

/// Which of this thread's caches serves which allocator and device.
#[derive(Clone, Copy)]
struct Place {
    /// 0: this place holds no cache.
    allocator: u64,
    device: usize,
    slot: &'static CacheSlot,
}

impl Place {
    const NONE: Place = Place { allocator: 0, device: 0, slot: &cache_slot::UNUSED };
}

/// One of this thread's caches, as the cached path reaches it: its slot,
/// whose `owner` holds the entries' records (one word: it is passed in a
/// register, never copied through the stack on the way to a cold call).
#[derive(Clone, Copy)]
struct HotCache {
    slot: &'static CacheSlot,
}

impl HotCache {
    /// The owner's records.
    #[inline(always)]
    fn own(self) -> &'static Owner {
        &self.slot.owner
    }

    /// Looks at what the heap did since the last look, if anything.
    #[inline(always)]
    fn catch_up_if_news(self) {
        if self.slot.news() != self.own().news.get() {
            self.catch_up();
        }
    }

    /// After the heap did something: forgets the blocks other threads
    /// freed (the heap has them back) and looks at which entries are
    /// still occupied.
    #[cold]
    #[inline(never)]
    fn catch_up(self) {
        let own = self.own();
        own.news.set(self.slot.news());
        for addr in self.slot.take_remote() {
            self.forget(addr);
        }
        let (mut occupied, mut bytes) = (0, 0);
        for (i, record) in own.entries.iter().enumerate() {
            if self.slot.entry(i) != 0 {
                occupied |= 1 << i;
                bytes += record.size.get();
            }
        }
        own.occupied.set(occupied);
        own.bytes.set(bytes);
    }

    /// Hands out the block of an entry serving `size` bytes on `stream`.
    #[inline(always)]
    fn take(self, size: u64, stream: Stream) -> Cached {
        let Some(i) = self.find(size, stream) else {
            return Cached::Miss;
        };
        let slot = self.slot;
        if !slot.begin_hand_out() {
            return Cached::Disarmed(self.own().heap_index.get() as u32);
        }
        // Armed without a break since the entries were last synced (only
        // this thread arms): entry `i` still holds its block.
        let addr = slot.entry(i);
        let record = &self.own().entries[i];
        slot.set_entry(i, 0);
        slot.count_up(record.kind.get() as usize, [1, record.size.get(), record.requested.get()]);
        slot.end_hand_out();
        self.empty(i);
        self.remember(addr, i);
        Cached::Hit(addr)
    }

    /// Notes `addr`, from entry `i`, as handed out.
    #[inline(always)]
    fn remember(self, addr: u64, i: usize) {
        let own = self.own();
        let (last, entry) = (own.last_out.get(), own.last_entry.get());
        own.last_out.set(addr);
        own.last_entry.set(i as u64);
        if last != 0 {
            self.remember_earlier(last, entry as usize);
        }
    }

    /// Notes `addr`, handed out before the last hand-out from entry `i`,
    /// on the cold side.
    #[cold]
    #[inline(never)]
    fn remember_earlier(self, addr: u64, i: usize) {
        let class = self.own().entries[i % MAX_ENTRIES].class.get() as u32;
        with_cold(self, |cold| cold.live.insert(addr, class));
    }

    /// Forgets `addr` (not 0) as handed out.
    #[inline(always)]
    fn forget(self, addr: u64) {
        let own = self.own();
        if own.last_out.get() == addr {
            own.last_out.set(0);
        } else {
            with_cold(self, |cold| cold.live.remove(addr));
        }
    }

    /// Frees `ptr`, the block handed out last, into the entry it came
    /// from (still empty, its record kept) if the cache is armed, has room
    /// for it and `size` (when stated) is the size requested. Forgets it
    /// either way.
    #[inline(always)]
    fn free_last(self, ptr: u64, size: Option<u64>) -> bool {
        let own = self.own();
        own.last_out.set(0);
        let i = own.last_entry.get() as usize % MAX_ENTRIES;
        let record = &own.entries[i];
        let fits = own.bytes.get() + record.size.get() <= own.max_bytes.get();
        if size.is_some_and(|s| s != record.requested.get()) || !fits || !self.slot.is_armed() {
            return false;
        }
        self.occupy(i);
        self.publish_free(i, ptr);
        true
    }

    /// Frees `ptr` into an empty entry if this cache handed it out before
    /// the last hand-out, is armed and has room for it. Forgets it either
    /// way (one look at the cold side).
    #[cold]
    #[inline(never)]
    fn free_earlier(self, ptr: u64, size: Option<u64>) -> bool {
        let held = with_cold(self, |cold| {
            let index = cold.live.remove(ptr)?;
            Some(Held::new(*cold.classes.get(index as usize)?, index))
        });
        let Some(held) = held.flatten() else {
            return false;
        };
        let class = held.class;
        let Some((entry, room)) = self.room() else {
            return false;
        };
        if size.is_some_and(|s| s != class.requested) || class.size > room || !self.slot.is_armed() {
            return false;
        }
        self.fill(entry, held);
        self.publish_free(entry, ptr);
        true
    }

    /// The occupied entry serving a request of `size` bytes on `stream`.
    #[inline(always)]
    fn find(self, size: u64, stream: Stream) -> Option<usize> {
        let own = self.own();
        let mut bits = own.occupied.get() & own.buckets[bucket(size, stream)].get();
        while bits != 0 {
            let i = bits.trailing_zeros() as usize % MAX_ENTRIES;
            let record = &own.entries[i];
            if record.requested.get() == size && record.stream.get() == stream.0 {
                return Some(i);
            }
            bits &= bits - 1;
        }
        None
    }

    /// An empty entry and the bytes the cache can still take.
    #[inline(always)]
    fn room(self) -> Option<(usize, u64)> {
        let own = self.own();
        let empty = own.usable.get() & !own.occupied.get();
        (empty != 0).then(|| (empty.trailing_zeros() as usize, own.max_bytes.get().saturating_sub(own.bytes.get())))
    }

    /// Notes that entry `i` now holds `held`.
    fn fill(self, i: usize, held: Held) {
        let i = i % MAX_ENTRIES;
        let own = self.own();
        let record = &own.entries[i];
        if own.last_out.get() != 0 && own.last_entry.get() as usize == i {
            // The record of the block handed out last is about to go.
            let (last, class) = (own.last_out.get(), record.class.get() as u32);
            with_cold(self, |cold| cold.live.insert(last, class));
            own.last_out.set(0);
        }
        let old = &own.buckets[record.bucket.get() as usize % MAX_ENTRIES];
        old.set(old.get() & !(1 << i));
        let new = &own.buckets[held.bucket as usize % MAX_ENTRIES];
        new.set(new.get() | 1 << i);
        let class = held.class;
        record.requested.set(class.requested);
        record.size.set(class.size);
        record.stream.set(class.stream.0);
        record.kind.set(class.kind as u64);
        record.class.set(held.index as u64);
        record.bucket.set(held.bucket as u64);
        self.occupy(i);
    }

    /// Notes that entry `i`, empty, holds its block again.
    #[inline(always)]
    fn occupy(self, i: usize) {
        let own = self.own();
        own.occupied.set(own.occupied.get() | 1 << (i % MAX_ENTRIES));
        own.bytes.set(own.bytes.get() + own.entries[i % MAX_ENTRIES].size.get());
    }

    /// Notes that entry `i`, occupied, is now empty.
    #[inline(always)]
    fn empty(self, i: usize) {
        let own = self.own();
        own.occupied.set(own.occupied.get() & !(1 << (i % MAX_ENTRIES)));
        own.bytes.set(own.bytes.get() - own.entries[i % MAX_ENTRIES].size.get());
    }

    /// Puts `ptr`, just freed, in entry `i` (noted as occupied) for the heap to see.
    #[inline(always)]
    fn publish_free(self, i: usize, ptr: u64) {
        let record = &self.own().entries[i % MAX_ENTRIES];
        // The entry first: a recall that takes it then counts the free
        // later, never a free of a block it does not find.
        self.slot.set_entry(i, ptr);
        self.slot.count_down(record.kind.get() as usize, [1, record.size.get(), record.requested.get()]);
    }

    /// Checks `cache_owner.rs`'s invariants, after catching up with the
    /// heap's news; and, since nothing is news then, that the occupied
    /// entries are those holding a block and `bytes` their sizes. Another
    /// thread's recall (a statistics read, `empty_cache`) may empty the
    /// entries while this looks; it is news once done (at once: the heap
    /// empties every entry, then counts the news), so a mismatch is looked
    /// at again after the news.
    fn validate(self) -> Result<(), String> {
        let mut result = Ok(());
        for _ in 0..1000 {
            self.catch_up_if_news();
            let seen = self.own().news.get();
            result = self.check();
            if result.is_ok() {
                return result;
            }
            let waiting = std::time::Instant::now();
            while self.slot.news() == seen && waiting.elapsed() < std::time::Duration::from_millis(100) {
                std::thread::yield_now();
            }
            if self.slot.news() == seen {
                return result;
            }
        }
        result
    }

    /// `validate`'s checks, on the records as they are.
    fn check(self) -> Result<(), String> {
        let own = self.own();
        let (occupied, usable) = (own.occupied.get(), own.usable.get());
        if occupied & !usable != 0 {
            return Err(format!("thread cache: entries {occupied:#x} occupied outside the usable {usable:#x}"));
        }
        for (bucket, members) in own.buckets.iter().enumerate() {
            let mut bits = members.get();
            while bits != 0 {
                let i = bits.trailing_zeros() as usize % MAX_ENTRIES;
                if own.entries[i].bucket.get() != bucket as u64 {
                    return Err(format!("thread cache: entry {i} is in bucket {bucket}, not its own"));
                }
                bits &= bits - 1;
            }
        }
        let mut bytes = 0;
        for (i, record) in own.entries.iter().enumerate() {
            let bit = 1u64 << i;
            if (occupied & bit != 0) != (self.slot.entry(i) != 0) {
                return Err(format!("thread cache: entry {i} occupied {} but holds {:#x}", occupied & bit != 0, self.slot.entry(i)));
            }
            if occupied & bit != 0 {
                bytes += record.size.get();
                if own.buckets[record.bucket.get() as usize % MAX_ENTRIES].get() & bit == 0 {
                    return Err(format!("thread cache: occupied entry {i} is missing from its bucket"));
                }
            }
        }
        if bytes != own.bytes.get() || bytes > own.max_bytes.get() {
            return Err(format!("thread cache: {} bytes noted, {bytes} held, at most {}", own.bytes.get(), own.max_bytes.get()));
        }
        let last = own.last_entry.get() as usize % MAX_ENTRIES;
        if own.last_out.get() != 0 && occupied & (1 << last) != 0 {
            return Err(format!("thread cache: entry {last} is occupied but still names the block handed out last"));
        }
        Ok(())
    }
}

/// The bucket of a request of `size` bytes on `stream` (a multiplicative hash).
#[inline(always)]
fn bucket(size: u64, stream: Stream) -> usize {
    ((size ^ stream.0.rotate_left(32)).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 58) as usize % MAX_ENTRIES
}

/// The cold side of one thread's cache: what the hot side needs seldom,
/// and its thread's exit.
struct ColdCache {
    device: usize,
    slot: &'static CacheSlot,
    /// The fork count when it was opened: in a fork child the cache, its
    /// slot and its heap are the parent's, and are left as they are.
    generation: u64,
    /// Blocks handed out before the last, by address: their index in `classes`.
    live: AddrMap,
    classes: Vec<Class>,
    class_index: HashMap<Class, u32>,
    /// For giving everything back when the thread exits.
    devices: Weak<[Device]>,
}

impl ColdCache {
    /// The index of `class` in `classes`, added if new.
    fn class_index(&mut self, class: Class) -> u32 {
        if let Some(&index) = self.class_index.get(&class) {
            return index;
        }
        self.classes.push(class);
        let index = (self.classes.len() - 1) as u32;
        self.class_index.insert(class, index);
        index
    }
}

impl ColdCache {
    /// Whether it was opened in a parent of this process (before a fork).
    fn inherited(&self) -> bool {
        self.generation != fork::fork_generation()
    }
}

impl Drop for ColdCache {
    /// The thread exits (or the allocator was dropped): its cached blocks
    /// go back and those it handed out become plain ones; the slot is
    /// free for another thread, once no place of this thread names it.
    /// In a fork child, a cache opened by the parent only leaves its
    /// place: its heap may have been locked by a thread the child does not
    /// have, and its blocks are the parent's (`fork.rs`).
    fn drop(&mut self) {
        let _ = PLACES.try_with(|places| {
            for place in places {
                if std::ptr::eq(place.get().slot, self.slot) {
                    place.set(Place::NONE);
                }
            }
        });
        if self.inherited() {
            return;
        }
        if let Some(devices) = self.devices.upgrade() {
            devices[self.device].retire_slot(self.slot.owner.heap_index.get() as u32);
        }
        cache_slot::give_back(self.slot);
    }
}

thread_local! {
    /// This thread's caches. Plain data with no destructor: reaching it
    /// costs no check of a destructor's state, and the closure that reads
    /// a place is small enough to be inlined (the cached path itself runs
    /// outside any thread-local closure, on the slot).
    static PLACES: [Cell<Place>; HOT_CACHES] = const { [const { Cell::new(Place::NONE) }; HOT_CACHES] };
    static COLD: RefCell<Vec<ColdCache>> = const { RefCell::new(Vec::new()) };
}

/// This thread's cache for (`allocator`, `device`), if it has one, caught
/// up with the heap's news. The first place is looked at inline, the
/// others out of line, so that the cached path stays small where it is
/// inlined (callgrind: ~150 instructions a 512 B pair inlined, ~240 when
/// it was a call).
#[inline(always)]
fn hot_cache(allocator: u64, device: usize) -> Option<HotCache> {
    let first = PLACES.with(|places| places[0].get());
    let slot = if first.allocator == allocator && first.device == device { first.slot } else { other_place(allocator, device)? };
    let cache = HotCache { slot };
    cache.catch_up_if_news();
    Some(cache)
}

/// `hot_cache`'s search of the other places. The cache found moves to the
/// first place: a thread that uses one allocator and device at a time
/// finds its cache there.
#[inline(never)]
fn other_place(allocator: u64, device: usize) -> Option<&'static CacheSlot> {
    PLACES.with(|places| {
        let found = places.iter().position(|c| c.get().allocator == allocator && c.get().device == device)?;
        places[0].swap(&places[found]);
        Some(places[0].get().slot)
    })
}

/// Runs `f` on the cold side of `hot` (none once the thread is exiting).
#[inline(never)]
fn with_cold<R>(hot: HotCache, f: impl FnOnce(&mut ColdCache) -> R) -> Option<R> {
    COLD.try_with(|cold| {
        let mut cold = cold.try_borrow_mut().ok()?;
        cold.iter_mut().find(|c| std::ptr::eq(c.slot, hot.slot)).map(f)
    })
    .ok()
    .flatten()
}

impl ThreadCaches {
    /// A request of `size` bytes on `stream` served from this thread's cache.
    #[inline(always)]
    pub fn allocate(&self, device: usize, size: u64, stream: Stream) -> Cached {
        match hot_cache(self.allocator, device) {
            Some(cache) => cache.take(size, stream),
            None => Cached::Miss,
        }
    }

    /// Frees `ptr` (not 0) into this thread's cache if the cache handed it
    /// out, is armed and has room; `size`, when the caller states one, must
    /// be the size requested. False: the heap must free it (`free_slow`);
    /// the cache has forgotten it then.
    #[inline(always)]
    pub fn free(&self, device: usize, ptr: u64, size: Option<u64>) -> bool {
        let Some(cache) = hot_cache(self.allocator, device) else {
            return false;
        };
        if cache.own().last_out.get() == ptr {
            return cache.free_last(ptr, size);
        }
        cache.free_earlier(ptr, size)
    }

    /// Frees `ptr` (not 0), which names no device, into the cache of this
    /// thread that handed it out and has not seen it freed, if any: the
    /// device is then that cache's. The first place's last hand-out is
    /// looked at inline (a cached pair's free), the rest out of line; each
    /// cache catches up with the heap first, so that a block another thread
    /// freed is not taken for this one's.
    #[inline(always)]
    pub fn free_unnamed(&self, ptr: u64) -> Unnamed {
        let first = PLACES.with(|places| places[0].get());
        if first.allocator == self.allocator {
            let cache = HotCache { slot: first.slot };
            cache.catch_up_if_news();
            if cache.own().last_out.get() == ptr {
                return if cache.free_last(ptr, None) { Unnamed::Cached } else { Unnamed::Heap(first.device) };
            }
        }
        self.free_unnamed_cold(ptr)
    }

    /// `free_unnamed` past the first place's last hand-out: every place of
    /// this allocator, its last hand-out and the blocks handed out before.
    #[inline(never)]
    fn free_unnamed_cold(&self, ptr: u64) -> Unnamed {
        let places: [Place; HOT_CACHES] = PLACES.with(|places| std::array::from_fn(|i| places[i].get()));
        let known = places.iter().filter(|place| place.allocator == self.allocator).find_map(|place| {
            let cache = HotCache { slot: place.slot };
            cache.catch_up_if_news();
            let known = cache.own().last_out.get() == ptr || with_cold(cache, |cold| cold.live.get(ptr).is_some()).unwrap_or(false);
            known.then_some(place.device)
        });
        match known {
            Some(device) if self.free(device, ptr, None) => Unnamed::Cached,
            Some(device) => Unnamed::Heap(device),
            None => Unnamed::Unknown,
        }
    }

    /// Checks this thread's caches of this allocator (`HotCache::validate`;
    /// other threads' records only their threads can read).
    pub fn validate_this_thread(&self) -> Result<(), String> {
        PLACES.with(|places| {
            places.iter().map(Cell::get).filter(|p| p.allocator == self.allocator).try_for_each(|p| HotCache { slot: p.slot }.validate())
        })
    }

    /// The free of `ptr` through `devices[device]`'s heap, which lends the
    /// block to this thread's cache when it may (the cache registered on
    /// first use). `size`: as the caller states it (a different one is
    /// counted as a mismatch).
    pub fn free_slow(&self, devices: &Arc<[Device]>, device: usize, ptr: u64, size: Option<u64>) -> Result<u64, AllocError> {
        let dev = &devices[device];
        let Some(cache) = hot_cache(self.allocator, device).or_else(|| self.open(devices, device)) else {
            // No room for another cache, or the thread is exiting.
            return dev.free_or_lend(ptr, u32::MAX, None, 0, size).map(|outcome| outcome.requested());
        };
        // `free` forgot `ptr`: it looked at this cache first.
        let own = cache.own();
        // An empty entry, else the next in turn, whose block goes back.
        let (entry, room) = cache.room().unwrap_or_else(|| {
            let victim = own.evict_next.get() as usize % MAX_ENTRIES;
            own.evict_next.set(((victim + 1) % own.usable.get().count_ones() as usize) as u64);
            let victim_size = own.entries[victim].size.get();
            (victim, own.max_bytes.get().saturating_sub(own.bytes.get() - victim_size))
        });
        let result = dev.free_or_lend(ptr, own.heap_index.get() as u32, Some(entry), room, size);
        if let Ok(FreedOrLent::Lent(lent)) = &result {
            if own.occupied.get() & (1 << entry) != 0 {
                cache.empty(entry); // evicted
            }
            let class = Class { requested: lent.requested, size: lent.size, stream: lent.stream, kind: lent.kind as usize };
            // No class index once the thread is exiting: the block is then
            // never taken for one handed out earlier (a plain free instead).
            let index = with_cold(cache, |cold| cold.class_index(class)).unwrap_or(u32::MAX);
            cache.fill(entry, Held::new(class, index));
        }
        result.map(|outcome| outcome.requested())
    }

    /// Opens this thread's cache on `devices[device]` in an empty place,
    /// registered with the device (None: no place, or the thread is
    /// exiting).
    #[cold]
    fn open(&self, devices: &Arc<[Device]>, device: usize) -> Option<HotCache> {
        COLD.try_with(|cold| {
            let mut cold = cold.try_borrow_mut().ok()?;
            // Caches of allocators since dropped have nothing left to give
            // back, and those a fork child inherited are not its own: their
            // places are free again (their drop empties them).
            let (dead, kept): (Vec<ColdCache>, Vec<ColdCache>) =
                cold.drain(..).partition(|c| c.devices.strong_count() == 0 || c.inherited());
            *cold = kept;
            drop(cold);
            drop(dead);
            let position = PLACES.with(|places| places.iter().position(|c| c.get().allocator == 0))?;
            let slot = cache_slot::take();
            let index = devices[device].register_slot(slot);
            let own = &slot.owner;
            own.usable.set(u64::MAX >> (MAX_ENTRIES - self.blocks.clamp(1, MAX_ENTRIES)));
            own.max_bytes.set(self.bytes);
            own.news.set(slot.news());
            own.heap_index.set(index as u64);
            PLACES.with(|places| places[position].set(Place { allocator: self.allocator, device, slot }));
            let record = ColdCache {
                device,
                slot,
                generation: fork::fork_generation(),
                live: AddrMap::default(),
                classes: Vec::new(),
                class_index: HashMap::new(),
                devices: Arc::downgrade(devices),
            };
            COLD.with(|cold| cold.borrow_mut().push(record));
            Some(HotCache { slot })
        })
        .ok()
        .flatten()
    }
}
