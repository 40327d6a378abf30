//! Blocks lent to threads' caches (`thread_cache.rs`): a block freed by a
//! thread that keeps a cache goes into one of the cache's entries instead of
//! the bins, lent (`BlockState::Lent`), and the thread hands it out again
//! and takes it back without this heap's lock. Its slot (`cache_slot.rs`)
//! says what the thread did; here, under the lock, the heap
//! - counts it: a lent block is free when lent, and the slot's sums of
//!   hand-outs and frees are folded into the gauges (`absorb`) whenever a
//!   figure is read, a peak reset or the slot disarmed;
//! - keeps every peak exact: while a slot is armed, its claim (what its
//!   cached blocks would add to each gauge if all were handed out) is set
//!   aside, and the gauges plus all claims never pass the peaks. A growth
//!   that would pass them disarms the slots and folds their sums in first,
//!   so that the new peak is exact; a slot is armed again only while its
//!   claim fits under the peaks;
//! - takes cached blocks back to the bins (`recall`) before it grows (so
//!   caches never make it take more memory), on every operation that
//!   looks at the whole heap (statistics, snapshots, releases, an
//!   out-of-memory, a tag's pause), for idle caches at the reclaimer's
//!   pass, and when the thread exits (its blocks handed out again then
//!   become plain allocated blocks);
//! - frees a lent block freed by another thread (or by its owner past its
//!   cache's bounds) as any allocated block, after telling the owner.
//!
//! Only blocks of the "default" tag's shared pools are lent: not while a
//! private pool is open (a capture may be underway), not with frees
//! pending on other streams' events, not blocks used on other streams.
//!
//! Invariants, checked by `validate()` (with the slots disarmed and absorbed):
//! - each lent block is on its slot's list, and the lists hold only lent blocks;
//! - the gauges of allocated memory count the lent blocks not in an entry
//!   (handed out again) as allocated, those in an entry as free;
//! - every slot's claim is zero unless it is armed, and the gauges plus the
//!   claims stay within the peaks.
#![forbid(unsafe_code)]

use super::block::{BlockId, BlockState, NIL};
use super::free::Freed;
use super::DeviceHeap;
use crate::cache_slot::{Amounts, CacheSlot};
use crate::error::AllocError;
use crate::size_class::PoolKind;
use crate::tag::TagId;
use crate::types::Stream;

/// What the heap keeps of one thread's cache.
struct SlotRecord {
    slot: &'static CacheSlot,
    /// The slot's sums when last folded into the gauges.
    ups: Amounts,
    downs: Amounts,
    /// Set aside for the slot's cached blocks while it is armed.
    claim: Amounts,
    /// The slot's lent blocks, linked through `link_prev`/`link_next`.
    head: BlockId,
    /// The slot's activity at the reclaimer's last pass.
    activity: u64,
}

/// The caches of threads this heap lends to.
#[derive(Default)]
pub(crate) struct Lending {
    slots: Vec<Option<SlotRecord>>,
    /// Sum of the slots' claims.
    claims: Amounts,
    armed: usize,
}

/// A free the heap answered by lending the block to the freeing thread's cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LentBlock {
    pub size: u64,
    pub requested: u64,
    pub kind: PoolKind,
    pub stream: Stream,
}

/// What a slow free on a thread with a cache did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FreedOrLent {
    Freed(Freed),
    Lent(LentBlock),
}

/// Adds what a block of `kind`, `size` bytes, `requested` asked for,
/// adds to the gauges (one allocation, its bytes, its request).
fn add_block(to: &mut Amounts, kind: PoolKind, size: u64, requested: u64) {
    for (gauge, amount) in to.iter_mut().zip([1, size, requested]) {
        gauge[kind as usize] += amount;
    }
}

impl FreedOrLent {
    /// The bytes the freed block's caller had asked for.
    pub fn requested(&self) -> u64 {
        match self {
            FreedOrLent::Freed(freed) => freed.requested,
            FreedOrLent::Lent(lent) => lent.requested,
        }
    }
}

impl Lending {
    /// The record of slot `index`, if it is registered.
    fn registered(&self, index: u32) -> Option<&SlotRecord> {
        self.slots.get(index as usize)?.as_ref()
    }

    fn registered_mut(&mut self, index: u32) -> Option<&mut SlotRecord> {
        self.slots.get_mut(index as usize)?.as_mut()
    }

    /// The record of the registered slot `index`.
    fn slot(&self, index: u32) -> &SlotRecord {
        self.registered(index).expect("registered slot")
    }

    fn slot_mut(&mut self, index: u32) -> &mut SlotRecord {
        self.registered_mut(index).expect("registered slot")
    }

    /// The slots' indices are below this (registered or not).
    fn index_end(&self) -> u32 {
        self.slots.len() as u32
    }

    /// Whether some slot is armed (an allocation under the lock must then
    /// keep the claims under the peaks).
    #[inline(always)]
    pub(super) fn armed(&self) -> bool {
        self.armed != 0
    }
}

impl DeviceHeap {
    /// Registers a thread's cache; returns the slot's index here.
    pub(crate) fn register_slot(&mut self, slot: &'static CacheSlot) -> u32 {
        // A slot used before keeps its sums: what it did from now on counts.
        let (ups, downs) = slot.sums();
        let record = SlotRecord { slot, ups, downs, claim: Amounts::default(), head: NIL, activity: slot.activity() };
        let slots = &mut self.lending.slots;
        match slots.iter().position(Option::is_none) {
            Some(free) => {
                slots[free] = Some(record);
                free as u32
            }
            None => {
                slots.push(Some(record));
                (slots.len() - 1) as u32
            }
        }
    }

    /// Forgets a thread's cache, called by its thread as it exits: cached
    /// blocks go to the bins, those handed out again become plain
    /// allocated blocks.
    pub(crate) fn retire_slot(&mut self, index: u32) {
        self.recall(index);
        while let Some(id) = self.lending.registered(index).map(|r| r.head).filter(|&h| h != NIL) {
            self.unlink_lent(id);
            self.blocks[id].state = BlockState::Allocated;
        }
        self.lending.slots[index as usize] = None;
    }

    /// The slow free of `ptr` on the thread whose cache is slot `index`
    /// (called by that thread): a plain free, except that an allocated
    /// block of the shared pools, of at most `max_size` bytes, is lent to
    /// the cache's entry `entry`, whose block, if it holds one, comes back
    /// to the bins first (the cache is full: the entry its owner evicts).
    pub(crate) fn free_or_lend(&mut self, ptr: u64, index: u32, entry: Option<usize>, max_size: u64) -> Result<FreedOrLent, AllocError> {
        let found = self.by_addr.get(ptr).filter(|&id| self.blocks[id].is_allocated());
        let (Some(id), Some(entry)) = (found.filter(|&id| self.may_lend(id, max_size)), entry) else {
            return self.free(ptr).map(FreedOrLent::Freed);
        };
        let record = self.lending.slot(index);
        let evicted = record.slot.entry(entry);
        if evicted != 0 {
            self.take_back_entry(index, entry, evicted);
        }
        let freed = self.count_free(id, ptr, true);
        let b = &mut self.blocks[id];
        b.state = BlockState::Lent;
        b.lent_to = index;
        let (kind, pool) = (b.kind, b.pool);
        self.link_lent(index, id);
        let record = self.lending.slot_mut(index);
        record.slot.set_entry(entry, ptr);
        if record.slot.is_armed() {
            // The free made room under the peaks for exactly this claim.
            add_block(&mut record.claim, kind, freed.size, freed.requested);
            add_block(&mut self.lending.claims, kind, freed.size, freed.requested);
        }
        self.arm_slot(index);
        let stream = self.pools[pool].stream;
        Ok(FreedOrLent::Lent(LentBlock { size: freed.size, requested: freed.requested, kind, stream }))
    }

    /// Takes the block at `addr` out of entry `entry` of slot `index`, to
    /// the bins (its owner asks: it is not handing out meanwhile). The slot
    /// is folded in and disarmed first: its claim is recomputed when it is
    /// armed again.
    fn take_back_entry(&mut self, index: u32, entry: usize, addr: u64) {
        self.absorb(index);
        let record = self.lending.slot_mut(index);
        record.slot.set_entry(entry, 0);
        let id = self.by_addr.get(addr).expect("a cached block is in by_addr");
        self.return_to_bins(id);
    }

    /// The cached block `id`, taken out of its entry, goes to the bins.
    fn return_to_bins(&mut self, id: BlockId) {
        self.unlink_lent(id);
        self.blocks[id].requested = 0;
        // A block stashed beside it would no longer be where best fit goes.
        self.flush_stash(self.blocks[id].pool);
        self.bin_freed(id);
    }

    /// Whether threads' caches may hold blocks now: no private pool open
    /// (a capture may be underway), no frees pending on other streams'
    /// events (active memory's peaks are noted under the lock only), no
    /// one watching every event.
    fn lending_allowed(&self) -> bool {
        self.may_release() && self.streams.pending.is_empty() && !self.observers.observed
    }

    /// Whether the allocated block `id` may go to a thread's cache. Not a
    /// block of an expandable segment: held apart from the heap, it moves
    /// best fit's later choices and the layout drifts step after step,
    /// each drift a mapping (the planner's vit and hand-written optimizer
    /// steps made 10 and 19 driver calls in their third and fourth steps
    /// with them lent, none without).
    fn may_lend(&self, id: BlockId, max_size: u64) -> bool {
        let b = &self.blocks[id];
        let pool = &self.pools[b.pool];
        b.size <= max_size
            && pool.tag == TagId::DEFAULT
            && pool.private.is_none()
            && pool.vm.is_none()
            && self.lending_allowed()
            && (self.streams.recorded.is_empty() || !self.streams.recorded.contains_key(&b.addr))
    }

    /// Arms slot `index` at its owner's request, if its claim fits under
    /// the peaks and nothing forbids lending now; true when armed.
    pub(crate) fn arm_slot(&mut self, index: u32) -> bool {
        if !self.lending_allowed() {
            return false;
        }
        let Some(record) = self.lending.registered(index) else {
            return false;
        };
        if record.slot.is_armed() {
            return true;
        }
        self.absorb(index);
        let record = self.lending.slot(index);
        let mut claim = Amounts::default();
        for addr in record.slot.cached() {
            let id = self.by_addr.get(addr).expect("a cached block is in by_addr");
            let b = &self.blocks[id];
            add_block(&mut claim, b.kind, b.size, b.requested);
        }
        if !self.fits_under_peaks(&claim) {
            return false;
        }
        let record = self.lending.slot_mut(index);
        record.claim = claim;
        record.slot.arm();
        for (claims, claim) in self.lending.claims.iter_mut().zip(claim) {
            claims[0] += claim[0];
            claims[1] += claim[1];
        }
        self.lending.armed += 1;
        true
    }

    /// Arms slot `index` (true), or when it may not be armed now, takes
    /// back the blocks it caches, for the heap to serve (false).
    pub(crate) fn arm_or_recall(&mut self, index: u32) -> bool {
        if self.arm_slot(index) {
            return true;
        }
        self.recall(index);
        false
    }

    /// Whether the gauges, plus all claims, plus `more`, stay within the peaks.
    fn fits_under_peaks(&self, more: &Amounts) -> bool {
        let gauges = [&self.stats.allocation, &self.stats.allocated_bytes, &self.stats.requested_bytes];
        gauges.iter().enumerate().all(|(g, gauge)| {
            let claims = self.lending.claims[g];
            let with = [0, 1].map(|k| gauge.current_of(k) + claims[k] + more[g][k]);
            with[0] <= gauge.peak_of(0) && with[1] <= gauge.peak_of(1) && with[0] + with[1] <= gauge.peak_total()
        })
    }

    /// Before an allocation under the lock adds `size` bytes (`requested`
    /// asked for) of `kind`: if that, with the claims, could pass a peak,
    /// every slot is disarmed and folded in, so that the peak the
    /// allocation sets is exact.
    #[cold]
    #[inline(never)]
    pub(super) fn make_room_under_peaks(&mut self, kind: PoolKind, size: u64, requested: u64) {
        let mut more = Amounts::default();
        add_block(&mut more, kind, size, requested);
        if !self.fits_under_peaks(&more) {
            self.disarm_all();
        }
    }

    /// Disarms every slot and folds in what it did.
    pub(super) fn disarm_all(&mut self) {
        for index in 0..self.lending.index_end() {
            if self.lending.registered(index).is_some() {
                self.absorb(index);
            }
        }
    }

    /// Disarms slot `index` and folds its hand-outs and frees since the
    /// last look into the gauges; its claim goes.
    fn absorb(&mut self, index: u32) {
        let record = self.lending.slots[index as usize].as_mut().expect("registered slot"); // (the claims are borrowed too)
        if record.slot.is_armed() {
            record.slot.disarm();
            self.lending.armed -= 1;
        }
        let (ups, downs) = record.slot.sums();
        let gauges = [&mut self.stats.allocation, &mut self.stats.allocated_bytes, &mut self.stats.requested_bytes];
        for (g, gauge) in gauges.into_iter().enumerate() {
            for (k, kind) in [PoolKind::Small, PoolKind::Large].into_iter().enumerate() {
                gauge.absorb(kind, ups[g][k] - record.ups[g][k], downs[g][k] - record.downs[g][k]);
                self.lending.claims[g][k] -= record.claim[g][k];
            }
        }
        (record.ups, record.downs, record.claim) = (ups, downs, Amounts::default());
    }

    /// Takes back the blocks slot `index` caches, to the bins, and folds in
    /// what it did. (Its blocks handed out again stay lent: its owner may
    /// be freeing one right now, unlocked; they are settled when freed.)
    pub(super) fn recall(&mut self, index: u32) {
        self.absorb(index);
        let record = self.lending.slot(index);
        let slot = record.slot;
        for addr in slot.take_entries() {
            let id = self.by_addr.get(addr).expect("a cached block is in by_addr");
            if self.blocks[id].state != BlockState::Lent {
                debug_assert!(false, "slot {index} cached {addr:#x}, not lent to it (a double free raced)");
                continue;
            }
            self.return_to_bins(id);
        }
    }

    /// Takes back every block of every thread's cache.
    pub(super) fn recall_all(&mut self) {
        for index in 0..self.lending.index_end() {
            if self.lending.registered(index).is_some() {
                self.recall(index);
            }
        }
    }

    /// Before the heap grows: takes back every cached block; true when
    /// some came back.
    pub(super) fn recall_cached(&mut self) -> bool {
        let cached = self.lending.slots.iter().flatten().any(|r| !r.slot.is_empty());
        if cached {
            self.recall_all();
        }
        cached
    }

    /// The reclaimer's pass: takes back the blocks of caches whose thread
    /// did nothing since the last pass.
    pub(super) fn recall_idle(&mut self) {
        for index in 0..self.lending.index_end() {
            let Some(record) = self.lending.registered_mut(index) else {
                continue;
            };
            let activity = record.slot.activity();
            let idle = activity == record.activity;
            record.activity = activity;
            if idle && !record.slot.is_empty() {
                self.recall(index);
            }
        }
    }

    /// The lent block `id`, found by a free or a `record_stream`: if it is
    /// in its cache's entries, it is free (false); otherwise it was handed
    /// out again and becomes a plain allocated block, its owner told to
    /// forget it (true).
    /// (The slot is folded in first, so that the gauges count the block
    /// as allocated before the caller frees it: that disarms the slot until
    /// its owner's next request.)
    pub(super) fn settle_lent(&mut self, id: BlockId) -> bool {
        let index = self.blocks[id].lent_to;
        let slot = self.lending.slot(index).slot;
        let addr = self.blocks[id].addr;
        if slot.holds(addr) {
            return false;
        }
        self.absorb(index);
        self.unlink_lent(id);
        self.blocks[id].state = BlockState::Allocated;
        slot.push_remote(addr);
        true
    }

    fn link_lent(&mut self, index: u32, id: BlockId) {
        let record = self.lending.slot_mut(index);
        let head = std::mem::replace(&mut record.head, id);
        self.blocks.link_front(id, head);
    }

    fn unlink_lent(&mut self, id: BlockId) {
        let index = self.blocks[id].lent_to;
        let (prev, next) = self.blocks.unlink(id);
        if prev == NIL {
            self.lending.slot_mut(index).head = next;
        }
    }

    /// Checks the invariants at the top of this file that the block walk
    /// of `validate()` does not; the slots are disarmed and folded in first,
    /// so that `validate()` can count the gauges from the blocks.
    pub(crate) fn validate_lending(&mut self) -> Result<(), String> {
        self.disarm_all();
        for (index, record) in self.lending.slots.iter().enumerate() {
            let Some(record) = record else { continue };
            if record.claim != Amounts::default() {
                return Err(format!("slot {index} is disarmed but claims {:?}", record.claim));
            }
            for (id, b) in self.blocks.walk_list(record.head) {
                if b.state != BlockState::Lent || b.lent_to != index as u32 {
                    return Err(format!("block {id} on slot {index}'s list is {:?} (lent to {})", b.state, b.lent_to));
                }
            }
            for addr in record.slot.cached() {
                let lent = self
                    .by_addr
                    .get(addr)
                    .is_some_and(|id| self.blocks[id].state == BlockState::Lent && self.blocks[id].lent_to == index as u32);
                if !lent {
                    return Err(format!("slot {index} caches {addr:#x}, which is not lent to it"));
                }
            }
        }
        if self.lending.claims != Amounts::default() || self.lending.armed != 0 {
            return Err(format!("claims {:?} with {} slots armed after disarming all", self.lending.claims, self.lending.armed));
        }
        Ok(())
    }

    /// Whether the lent block `id` is in its cache's entries (free), for
    /// `validate()`, which needs the slots disarmed and folded in.
    pub(super) fn lent_is_cached(&self, id: BlockId) -> Result<bool, String> {
        let index = self.blocks[id].lent_to;
        let Some(record) = self.lending.registered(index) else {
            return Err(format!("block {id} is lent to slot {index}, which is not registered"));
        };
        if record.slot.is_armed() {
            return Err("validate() with a thread's cache armed: validate_lending() first".into());
        }
        Ok(record.slot.holds(self.blocks[id].addr))
    }

    /// Whether block `id` is live: allocated, or lent and handed out again
    /// (not in its cache's entries).
    pub(super) fn is_live(&self, id: BlockId) -> bool {
        let b = &self.blocks[id];
        b.is_allocated() || (b.state == BlockState::Lent && self.lending.registered(b.lent_to).is_some_and(|r| !r.slot.holds(b.addr)))
    }

    /// How many blocks the slots' lists hold.
    pub(super) fn lent_listed(&self) -> usize {
        self.lending.slots.iter().flatten().map(|record| self.blocks.walk_list(record.head).count()).sum()
    }
}
