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
//! The owner's side is in two thread-locals: the hot one (`HOT`: the
//! entries, what was handed out last; plain data, so reaching it costs no
//! check of a destructor's state) and the cold one (`COLD`: the blocks
//! handed out before the last, the sizes seen, and the destructor that
//! gives everything back when the thread exits). A thread keeps caches for
//! at most `HOT_CACHES` (allocator, device) pairs; requests on others go
//! to the heap. Slots live as long as the process and are used again by
//! later threads (`cache_slot::take`), so the hot side holds a plain
//! reference to its slot.
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
use crate::cache_slot::{self, CacheSlot, MAX_ENTRIES};
use crate::device::Device;
use crate::error::AllocError;
use crate::heap::FreedOrLent;
use crate::types::Stream;

/// The most (allocator, device) pairs one thread keeps caches for.
pub const HOT_CACHES: usize = 4;

/// The bounds of each thread's cache on a device, and the allocator they
/// belong to.
#[derive(Clone)]
pub(crate) struct Bounds {
    /// Tells one allocator's caches from another's in the same thread (never 0).
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
    const NONE: Held = Held { class: Class { requested: 0, size: 0, stream: Stream::DEFAULT, kind: 0 }, index: 0, bucket: 0 };

    fn new(class: Class, index: u32) -> Held {
        Held { class, index, bucket: bucket(class.requested, class.stream) as u32 }
    }
}

/// The hot side of one thread's cache on one device of one allocator.
#[derive(Clone, Copy)]
struct HotCache {
    /// 0: this place holds no cache.
    allocator: u64,
    device: usize,
    slot: &'static CacheSlot,
    /// The slot's index in the heap.
    index: u32,
    /// What each entry holds, where `occupied` has its bit; `usable` has
    /// a bit for each of the `thread_cache_blocks` entries.
    entries: [Held; MAX_ENTRIES],
    occupied: u64,
    usable: u64,
    /// By a hash of the request (`bucket`): the entries that may serve it,
    /// so that a request looks at one entry, not at all of them.
    buckets: [u64; MAX_ENTRIES],
    /// The bytes of the occupied entries, and the most they may be.
    bytes: u64,
    max_bytes: u64,
    /// The entry the next free evicts when all are occupied (round robin).
    evict_next: usize,
    /// The slot's news when last looked at (`cache_slot.rs`).
    news: u64,
    /// The block handed out last (0: none) and the entry it came from,
    /// kept out of the cold side's `live` until the next hand-out (a pair
    /// frees it before then). That entry's record stays as it was until
    /// the entry is filled again, which first moves the block to `live`.
    last_out: (u64, u32),
}

impl HotCache {
    const NONE: HotCache = HotCache {
        allocator: 0,
        device: 0,
        slot: &cache_slot::UNUSED,
        index: 0,
        entries: [Held::NONE; MAX_ENTRIES],
        occupied: 0,
        usable: 0,
        buckets: [0; MAX_ENTRIES],
        bytes: 0,
        max_bytes: 0,
        evict_next: 0,
        news: 0,
        last_out: (0, 0),
    };

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
        for (i, held) in self.entries.iter().enumerate() {
            if self.slot.entry(i) != 0 {
                occupied |= 1 << i;
                bytes += held.class.size;
            }
        }
        (self.occupied, self.bytes) = (occupied, bytes);
    }

    /// Hands out the block of an entry serving `size` bytes on `stream`.
    #[inline(always)]
    fn take(&mut self, size: u64, stream: Stream) -> Cached {
        let Some(i) = self.find(size, stream) else {
            return Cached::Miss;
        };
        let slot = self.slot;
        if !slot.begin_hand_out() {
            return Cached::Disarmed(self.index);
        }
        // Armed without a break since the entries were last synced (only
        // this thread arms): entry `i` still holds its block.
        let addr = slot.entry(i);
        let class = &self.entries[i % MAX_ENTRIES].class;
        slot.set_entry(i, 0);
        slot.count_up(class.kind, [1, class.size, class.requested]);
        slot.end_hand_out();
        self.empty(i);
        self.remember(addr, i);
        Cached::Hit(addr)
    }

    /// Notes `addr`, from entry `i`, as handed out.
    #[inline(always)]
    fn remember(&mut self, addr: u64, i: usize) {
        let (last, entry) = std::mem::replace(&mut self.last_out, (addr, i as u32));
        if last != 0 {
            self.remember_earlier(last, entry);
        }
    }

    /// Notes `addr`, handed out before the last hand-out from entry `i`,
    /// on the cold side.
    #[cold]
    #[inline(never)]
    fn remember_earlier(&self, addr: u64, i: u32) {
        let index = self.entries[i as usize % MAX_ENTRIES].index;
        with_cold(self, |cold| cold.live.insert(addr, index));
    }

    /// Forgets `addr` (not 0) as handed out.
    #[inline(always)]
    fn forget(&mut self, addr: u64) {
        if self.last_out.0 == addr {
            self.last_out.0 = 0;
        } else {
            with_cold(self, |cold| cold.live.remove(addr));
        }
    }

    /// Frees `ptr` into an empty entry if this cache handed it out before
    /// the last hand-out, is armed and has room for it.
    #[cold]
    #[inline(never)]
    fn free_earlier(&mut self, ptr: u64, size: Option<u64>) -> Option<()> {
        let held = self.handed_out_earlier(ptr)?;
        let class = held.class;
        if size.is_some_and(|s| s != class.requested) || !self.slot.is_armed() {
            return None;
        }
        let (entry, room) = self.room()?;
        if class.size > room {
            return None;
        }
        self.forget(ptr);
        self.fill(entry, held);
        self.publish_free(entry, ptr);
        Some(())
    }

    /// What `addr` is, if this cache handed it out before the last hand-out.
    fn handed_out_earlier(&self, addr: u64) -> Option<Held> {
        with_cold(self, |cold| {
            let index = cold.live.get(addr)?;
            Some(Held::new(cold.classes[index as usize], index))
        })
        .flatten()
    }

    /// The occupied entry serving a request of `size` bytes on `stream`.
    #[inline(always)]
    fn find(&self, size: u64, stream: Stream) -> Option<usize> {
        let mut bits = self.occupied & self.buckets[bucket(size, stream)];
        while bits != 0 {
            let i = bits.trailing_zeros() as usize % MAX_ENTRIES;
            let class = &self.entries[i].class;
            if class.requested == size && class.stream == stream {
                return Some(i);
            }
            bits &= bits - 1;
        }
        None
    }

    /// An empty entry and the bytes the cache can still take.
    #[inline(always)]
    fn room(&self) -> Option<(usize, u64)> {
        let empty = self.usable & !self.occupied;
        (empty != 0).then(|| (empty.trailing_zeros() as usize, self.max_bytes.saturating_sub(self.bytes)))
    }

    /// Notes that entry `i` now holds `held`.
    #[inline(always)]
    fn fill(&mut self, i: usize, held: Held) {
        let i = i % MAX_ENTRIES;
        if self.last_out.0 != 0 && self.last_out.1 as usize == i {
            // The record of the block handed out last is about to go.
            let (last, index) = (self.last_out.0, self.entries[i].index);
            with_cold(self, |cold| cold.live.insert(last, index));
            self.last_out.0 = 0;
        }
        self.buckets[self.entries[i].bucket as usize % MAX_ENTRIES] &= !(1 << i);
        self.buckets[held.bucket as usize % MAX_ENTRIES] |= 1 << i;
        self.entries[i] = held;
        self.occupy(i);
    }

    /// Notes that entry `i`, empty, holds its block again.
    #[inline(always)]
    fn occupy(&mut self, i: usize) {
        let i = i % MAX_ENTRIES;
        self.occupied |= 1 << i;
        self.bytes += self.entries[i].class.size;
    }

    /// Puts `ptr`, just freed, in entry `i` (noted as occupied) for the heap to see.
    #[inline(always)]
    fn publish_free(&self, i: usize, ptr: u64) {
        let class = &self.entries[i % MAX_ENTRIES].class;
        // The entry first: a recall that takes it then counts the free
        // later, never a free of a block it does not find.
        self.slot.set_entry(i, ptr);
        self.slot.count_down(class.kind, [1, class.size, class.requested]);
    }

    /// Notes that entry `i`, occupied, is now empty.
    #[inline(always)]
    fn empty(&mut self, i: usize) {
        let i = i % MAX_ENTRIES;
        self.occupied &= !(1 << i);
        self.bytes -= self.entries[i].class.size;
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
    allocator: u64,
    device: usize,
    slot: &'static CacheSlot,
    index: u32,
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

impl Drop for ColdCache {
    /// The thread exits (or the allocator was dropped): its cached blocks
    /// go back and those it handed out become plain ones; the slot is
    /// free for another thread.
    fn drop(&mut self) {
        let _ = HOT.try_with(|hot| {
            if let Ok(mut hot) = hot.try_borrow_mut() {
                if let Some(cache) = hot.iter_mut().find(|c| c.allocator == self.allocator && c.device == self.device) {
                    *cache = HotCache::NONE;
                }
            }
        });
        if let Some(devices) = self.devices.upgrade() {
            devices[self.device].retire_slot(self.index);
        }
        cache_slot::give_back(self.slot);
    }
}

thread_local! {
    static HOT: RefCell<[HotCache; HOT_CACHES]> = const { RefCell::new([HotCache::NONE; HOT_CACHES]) };
    static COLD: RefCell<Vec<ColdCache>> = const { RefCell::new(Vec::new()) };
}

/// Runs `f` on this thread's hot cache for (`allocator`, `device`), if it
/// has one.
///
/// Speed depends on what `f` and this function inline: LLVM inlines
/// `LocalKey::with` into the allocator's `allocate` and `free` only while
/// the closure is small, and the call it costs otherwise is ~100
/// instructions a 512 B pair (243 against 147 measured with callgrind).
/// So the branches a pair does not take stay out of line (`other_place`,
/// `remember_earlier`, `free_earlier`, `catch_up`); check with
/// `docs/benchmarks.md`'s callgrind recipe after changing this path.
#[inline(always)]
fn with_hot<R>(allocator: u64, device: usize, f: impl FnOnce(&mut HotCache) -> Option<R>) -> Option<R> {
    HOT.with(|hot| {
        let mut hot = hot.try_borrow_mut().ok()?;
        let position = place(&hot, allocator, device)?;
        let cache = &mut hot[position % HOT_CACHES];
        cache.catch_up_if_news();
        f(cache)
    })
}

/// The place of the cache for (`allocator`, `device`) in `hot`: the first
/// looked at inline, the others out of line (so that the hot path stays
/// small enough to be inlined where it is used).
#[inline(always)]
fn place(hot: &[HotCache; HOT_CACHES], allocator: u64, device: usize) -> Option<usize> {
    if hot[0].allocator == allocator && hot[0].device == device {
        return Some(0);
    }
    other_place(hot, allocator, device)
}

/// `place`'s out-of-line part.
#[inline(never)]
fn other_place(hot: &[HotCache; HOT_CACHES], allocator: u64, device: usize) -> Option<usize> {
    hot.iter().position(|c| c.allocator == allocator && c.device == device)
}

/// Runs `f` on the cold side of `hot` (none once the thread is exiting).
#[inline(never)]
fn with_cold<R>(hot: &HotCache, f: impl FnOnce(&mut ColdCache) -> R) -> Option<R> {
    COLD.try_with(|cold| {
        let mut cold = cold.try_borrow_mut().ok()?;
        cold.iter_mut().find(|c| c.allocator == hot.allocator && c.device == hot.device).map(f)
    })
    .ok()
    .flatten()
}

impl Bounds {
    /// A request of `size` bytes on `stream` served from this thread's cache.
    #[inline(always)]
    pub fn allocate(&self, device: usize, size: u64, stream: Stream) -> Cached {
        with_hot(self.allocator, device, |cache| Some(cache.take(size, stream))).unwrap_or(Cached::Miss)
    }

    /// Frees `ptr` (not 0) into this thread's cache if the cache handed it
    /// out, is armed and has room; `size`, when the caller states one, must
    /// be the size requested. False: the heap must free it (`free_slow`).
    #[inline(always)]
    pub fn free(&self, device: usize, ptr: u64, size: Option<u64>) -> bool {
        with_hot(self.allocator, device, |cache| {
            if cache.last_out.0 == ptr {
                // A pair: the block goes back to the entry it came from,
                // still empty and still holding its record.
                let i = cache.last_out.1 as usize % MAX_ENTRIES;
                let class = &cache.entries[i].class;
                let fits = cache.bytes + class.size <= cache.max_bytes;
                if size.is_some_and(|s| s != class.requested) || !fits || !cache.slot.is_armed() {
                    return None;
                }
                cache.last_out.0 = 0;
                cache.occupy(i);
                cache.publish_free(i, ptr);
                return Some(());
            }
            cache.free_earlier(ptr, size)
        })
        .is_some()
    }

    /// The free of `ptr` through `devices[device]`'s heap, which lends the
    /// block to this thread's cache when it may (the cache registered on
    /// first use). `size`: as the caller states it (a different one is
    /// counted as a mismatch).
    pub fn free_slow(&self, devices: &Arc<[Device]>, device: usize, ptr: u64, size: Option<u64>) -> Result<u64, AllocError> {
        let dev = &devices[device];
        let lent = HOT.with(|hot| {
            let mut hot = hot.try_borrow_mut().ok()?;
            let position = match hot.iter().position(|c| c.allocator == self.allocator && c.device == device) {
                Some(position) => position,
                None => self.open(&mut hot, devices, device)?,
            };
            let cache = &mut hot[position];
            cache.catch_up_if_news();
            cache.forget(ptr);
            // An empty entry, else the next in turn, whose block goes back.
            let (entry, room) = cache.room().unwrap_or_else(|| {
                let victim = cache.evict_next;
                cache.evict_next = (victim + 1) % (cache.usable.count_ones() as usize);
                let victim_size = cache.entries[victim].class.size;
                (victim, cache.max_bytes.saturating_sub(cache.bytes - victim_size))
            });
            let result = dev.free_or_lend(ptr, cache.index, Some(entry), room, size);
            if let Ok(FreedOrLent::Lent(lent)) = &result {
                if cache.occupied & (1 << entry) != 0 {
                    cache.empty(entry); // evicted
                }
                let class = Class { requested: lent.requested, size: lent.size, stream: lent.stream, kind: lent.kind as usize };
                let index = with_cold(cache, |cold| cold.class_index(class))?;
                cache.fill(entry, Held::new(class, index));
            }
            Some(result)
        });
        let result = match lent {
            Some(result) => result,
            // No room for another cache, the thread is exiting, or this is a
            // free from inside a cache's own drop.
            None => dev.free_or_lend(ptr, u32::MAX, None, 0, size),
        };
        result.map(|outcome| outcome.requested())
    }

    /// Opens this thread's cache on `devices[device]` in an empty place of
    /// `hot`, registered with the device; its place (None: no place, or the
    /// thread is exiting).
    #[cold]
    fn open(&self, hot: &mut [HotCache; HOT_CACHES], devices: &Arc<[Device]>, device: usize) -> Option<usize> {
        COLD.try_with(|cold| {
            let mut cold = cold.try_borrow_mut().ok()?;
            // Caches of allocators since dropped have nothing left to give
            // back: their places are free again.
            let (dead, kept): (Vec<ColdCache>, Vec<ColdCache>) = cold.drain(..).partition(|c| c.devices.strong_count() == 0);
            *cold = kept;
            drop(cold);
            for gone in &dead {
                hot.iter_mut().filter(|c| c.allocator == gone.allocator).for_each(|c| *c = HotCache::NONE);
            }
            drop(dead);
            let position = hot.iter().position(|c| c.allocator == 0)?;
            let slot = cache_slot::take();
            let index = devices[device].register_slot(slot);
            hot[position] = HotCache {
                allocator: self.allocator,
                device,
                slot,
                index,
                usable: u64::MAX >> (MAX_ENTRIES - self.blocks.clamp(1, MAX_ENTRIES)),
                max_bytes: self.bytes,
                news: slot.news(),
                ..HotCache::NONE
            };
            let devices = Arc::downgrade(devices);
            let record = ColdCache {
                allocator: self.allocator,
                device,
                slot,
                index,
                live: AddrMap::default(),
                classes: Vec::new(),
                class_index: HashMap::new(),
                devices,
            };
            COLD.with(|cold| cold.borrow_mut().push(record));
            Some(position)
        })
        .ok()
        .flatten()
    }
}
