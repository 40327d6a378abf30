//! Pausing and resuming a tag (giving its memory back to the device with
//! every address kept, and taking it again), and what a paused tag keeps
//! (`Tags`). Which pools serve a tag is `routing.rs`'s; its figures are
//! `report.rs`'s; the check of the invariants below, `validate.rs`'s.
//!
//! An allocation made under a tag other than "default" (`crate::tag`) comes
//! from the pools of (stream, tag, kind). They grow in reserved virtual
//! ranges, page by page, as expandable segments do, whatever the
//! `expandable` option says: only a reserved range keeps its addresses while
//! its memory is gone. They neither give blocks to other streams nor
//! borrow, so a page never holds blocks of two tags. Untagged allocations
//! never come here: the allocator tests the thread's tag once and goes on.
//!
//! Pausing a tag (`pause_tag`) waits for the work queued on the streams
//! that used its blocks, then unmaps every mapped page of its ranges, live
//! or cached, so the device's free memory grows by the tag's reserved
//! bytes. With offload it first copies the pages under live blocks to host
//! memory from the backend, one copy per run of such pages; without, their
//! contents are lost. Resuming (`resume_tag`) maps those pages again at the
//! same addresses (all or nothing: when the device cannot give them, the
//! heap releases its other cache, then asks the other processes, then
//! fails with nothing mapped and the tag still paused) and copies the saved
//! bytes back.
//!
//! Defined behaviours: allocating under a paused tag is an error naming the
//! tag; freeing a paused block is allowed (nothing is mapped, and the
//! saved pages no live block touches any more are dropped as the free
//! completes, so that reading figures never copies memory); pausing a
//! paused tag, an unknown one, while a private pool is open (a CUDA graph
//! capture may be underway), while a stream that used the tag is being
//! captured or when the work other streams queued on a block freed from it
//! cannot be waited for (a driver error), and resuming one that is not paused or while a private pool is
//! open, are errors that change nothing; an offload that cannot get host
//! memory fails whole, with nothing released. A paused tag's ranges stay
//! reserved: the release policies leave them alone (`keeps_memory`).
//!
//! A tag's pools are the pools whose `tag` is it (the heap files every
//! pool under its key, tag included); only paused tags keep state here.
//!
//! Invariants (checked by `validate()`: `check_tags`, `check_saved_runs`):
//! - "default" is never paused, and a paused tag's pools stash nothing;
//! - in a paused tag, every page touched by an active block is mapped or
//!   lies in a saved run of its range; saved runs lie in ranges of the
//!   tag, on unmapped pages (but those a failed resume mapped and could not
//!   unmap again: the next resume writes them as the others), each touched
//!   by an active block (a free drops what no block needs), and hold host
//!   memory of their size exactly when the pause offloaded;
//! - `paused_bytes` and `offloaded_bytes` of a tag are what its pause gave
//!   back (less what a failed resume left mapped) and the host bytes its
//!   saved runs hold.
#![forbid(unsafe_code)]

use std::collections::{BTreeMap, HashMap};

use super::block::{BlockId, BlockState};
use super::expandable::Vm;
use super::ids::{PoolId, SegmentId};
use super::DeviceHeap;
use crate::backend::{BackendError, HostMemory};
use crate::error::{AllocError, TagError, TagState};
use crate::tag::{name_of, TagId};
use crate::types::Stream;

/// Pages of one range under live blocks at the pause, and their contents
/// when offloaded: what resume maps and fills again.
pub(super) struct SavedRun {
    /// The range's base address.
    pub base: u64,
    pub first_page: u64,
    pub pages: u64,
    pub data: Option<Box<dyn HostMemory>>,
}

/// A paused tag.
pub(super) struct Paused {
    /// Whether the pause saved the contents of live blocks' pages.
    pub offload: bool,
    /// Device bytes the pause unmapped (less what a failed resume left mapped).
    pub given_back: u64,
    /// The pages resume maps again, with their contents when offloaded.
    pub runs: Vec<SavedRun>,
}

impl Paused {
    /// Host bytes holding the tag's contents.
    pub fn offloaded_bytes(&self) -> u64 {
        self.runs.iter().filter_map(|r| r.data.as_ref()).map(|d| d.bytes().len() as u64).sum()
    }
}

/// What one heap keeps of its tags beyond their pools.
#[derive(Default)]
pub(super) struct Tags {
    /// The paused tags, never "default".
    pub paused: HashMap<TagId, Paused>,
    /// The backend's page size and a large range's size, once a tag needed
    /// them (`routing.rs`).
    pub vm: Option<Vm>,
}

impl Tags {
    pub fn is_paused(&self, tag: TagId) -> bool {
        self.paused.contains_key(&tag)
    }

    /// The page of tags' ranges (1 before any tag has one).
    pub fn page(&self) -> u64 {
        self.vm.map_or(1, |vm| vm.page)
    }

    fn paused_mut(&mut self, tag: TagId) -> &mut Paused {
        self.paused.get_mut(&tag).expect("paused")
    }
}

pub(super) fn tag_error(tag: TagId, state: TagState) -> AllocError {
    AllocError::Tag(TagError { tag: name_of(tag).to_string(), state })
}

impl DeviceHeap {
    /// Whether the pool belongs to a paused tag.
    pub(super) fn pool_paused(&self, pool: PoolId) -> bool {
        let tag = self.pools[pool].tag;
        tag != TagId::DEFAULT && self.tags.is_paused(tag)
    }

    /// Whether `tag` could be paused now: it is not paused, no private pool
    /// is open (a capture may be underway: unmapping is forbidden), and no
    /// stream that used it is being captured. Checked on every shard and
    /// device before any pauses, so that a pause refused for these reasons
    /// changes nothing even without offload (whose contents would be gone).
    pub fn check_pausable(&self, tag: TagId) -> Result<(), AllocError> {
        if tag == TagId::DEFAULT {
            return Err(tag_error(TagId::DEFAULT, TagState::Default));
        }
        if !self.may_release() {
            return Err(tag_error(tag, TagState::PrivatePoolOpen { resuming: false }));
        }
        if self.tags.is_paused(tag) {
            return Err(tag_error(tag, TagState::AlreadyPaused));
        }
        if let Some(s) = self.tag_streams(tag).into_iter().find(|&s| self.backend.stream_capturing(self.device, s)) {
            return Err(tag_error(tag, TagState::StreamCapturing { stream: s.0 }));
        }
        Ok(())
    }

    /// Whether `tag` is paused here.
    pub fn tag_paused(&self, tag: TagId) -> bool {
        self.tags.is_paused(tag)
    }

    /// The ranges of `tag`'s pools, in address order.
    pub(super) fn tag_segments(&self, tag: TagId) -> Vec<SegmentId> {
        self.segments.by_address().filter(|(_, s)| self.pools[s.pool].tag == tag).map(|(id, _)| id).collect()
    }

    /// The pages the active blocks of range `segment_id` touch, mapped or
    /// not: its base and sorted, merged (first page, end page) intervals.
    pub(super) fn touched_pages(&self, segment_id: SegmentId) -> (u64, Vec<(u64, u64)>) {
        let Some(segment) = self.segments.get(segment_id) else { return (0, Vec::new()) };
        let Some(pages) = segment.pages.as_ref() else { return (segment.base, Vec::new()) };
        let mut touched: Vec<(u64, u64)> = Vec::new();
        for (_, b) in self.blocks.walk_segment(segment.first_block).filter(|(_, b)| b.is_active()) {
            let (first, count) = pages.touched(b.addr - segment.base, b.addr - segment.base + b.size);
            match touched.last_mut() {
                Some((_, end)) if *end >= first => *end = (*end).max(first + count),
                _ => touched.push((first, first + count)),
            }
        }
        (segment.base, touched)
    }

    /// The runs of mapped pages touched by the active blocks of range
    /// `segment_id`, as saved runs without data.
    fn live_runs(&self, segment_id: SegmentId) -> Vec<SavedRun> {
        let (base, touched) = self.touched_pages(segment_id);
        let Some(pages) = self.segments.pages(segment_id) else { return Vec::new() };
        touched
            .into_iter()
            .flat_map(|(first, end)| pages.runs(first, end - first, true))
            .map(|(p, n)| SavedRun { base, first_page: p, pages: n, data: None })
            .collect()
    }

    /// Takes the free blocks of the ranges out of their bins (uncounted)
    /// before their pages change, so `rebin` counts them as the pages are.
    fn unbin(&mut self, segments: &[SegmentId]) -> Vec<BlockId> {
        let free: Vec<BlockId> =
            segments.iter().flat_map(|&id| self.blocks_of(id)).filter(|(_, b)| b.state == BlockState::Binned).map(|(id, _)| id).collect();
        for &id in &free {
            self.remove_free(id);
        }
        free
    }

    fn rebin(&mut self, free: Vec<BlockId>) {
        for id in free {
            self.insert_free(id);
        }
    }

    /// Every stream that used `tag`'s blocks: its pools' and the streams
    /// recorded for its live blocks (`record_stream`).
    fn tag_streams(&self, tag: TagId) -> Vec<Stream> {
        let mut streams: Vec<Stream> = self.pools.of_tag(tag).iter().map(|&p| self.pools[p].stream).collect();
        for id in self.tag_segments(tag) {
            for (_, b) in self.blocks_of(id) {
                if let Some(recorded) = self.streams.recorded.get(&b.addr) {
                    streams.extend_from_slice(recorded);
                }
            }
        }
        streams.sort();
        streams.dedup();
        streams
    }

    /// Gives back every page of `tag`'s ranges, saving the contents of those
    /// under live blocks to host memory first when `offload`. Returns the
    /// device bytes given back. See the top of this file for the rules.
    pub fn pause_tag(&mut self, tag: TagId, offload: bool) -> Result<u64, AllocError> {
        self.recall_all();
        self.check_pausable(tag)?;
        let pools = self.pools.of_tag(tag);
        let segments = self.tag_segments(tag);
        // The work queued on every stream that used the tag's blocks.
        for stream in self.tag_streams(tag) {
            self.backend.synchronize_stream(self.device, stream).map_err(AllocError::Backend)?;
        }
        self.process_pending(true);
        // A freed block whose other streams' work could not be waited for
        // (the driver failed the wait) may still be written: its pages stay.
        if segments.iter().any(|&id| self.holds_pending_block(id)) {
            return Err(tag_error(tag, TagState::WorkNotWaited));
        }
        // After the pending frees: one of them may have gone to a stash.
        for &pool in &pools {
            self.flush_stash(pool);
        }

        let mut runs: Vec<SavedRun> = segments.iter().flat_map(|&id| self.live_runs(id)).collect();
        let page = self.tags.page();
        if offload {
            let total: u64 = runs.iter().map(|r| r.pages * page).sum();
            for run in &mut runs {
                let bytes = run.pages * page;
                let mut memory = self.backend.host_memory(bytes).map_err(|err| match err {
                    BackendError::OutOfMemory => AllocError::HostOutOfMemory { bytes: total },
                    other => AllocError::Backend(other),
                })?;
                let addr = run.base + run.first_page * page;
                self.backend.copy_to_host(self.device, addr, memory.bytes_mut(), Stream::DEFAULT).map_err(AllocError::Backend)?;
                run.data = Some(memory);
            }
        }

        // Nothing has changed yet; from here the pages go.
        let free = self.unbin(&segments);
        let mut given_back = 0;
        for &id in &segments {
            let pages = self.segments.pages(id).expect("tagged pools grow in ranges");
            for (p, n) in pages.runs(0, pages.end_bytes() / page, true) {
                // A run the backend refuses stays mapped and counted, contents
                // in place: whole, so that each saved run (inside one mapped
                // run) is unmapped whole or kept whole.
                given_back += self.unmap_whole_run(id, p, n);
            }
        }
        self.rebin(free);
        // A run the backend would not unmap keeps its contents on the device.
        runs.retain(|r| self.segment_pages(r.base).is_some_and(|pages| !pages.is_mapped(r.first_page)));
        self.tags.paused.insert(tag, Paused { offload, given_back, runs });
        Ok(given_back)
    }

    /// Whether a block of segment `id` waits for other streams' work.
    fn holds_pending_block(&self, id: SegmentId) -> bool {
        self.blocks_of(id).any(|(_, b)| b.state == BlockState::Pending)
    }

    pub(super) fn segment_pages(&self, base: u64) -> Option<&crate::page_map::PageMap> {
        self.segments.pages(self.segments.at_base(base)?)
    }

    /// Drops the saved pages of the paused `tag` in range `segment_id` that
    /// no active block touches any more (a block there was freed while
    /// paused): a run no live block touches goes, and one partly touched is
    /// cut to the touched pages (their bytes copied to smaller host memory;
    /// kept whole when none can be had). Runs of other ranges stay as they are.
    fn drop_unneeded_runs(&mut self, tag: TagId, segment_id: SegmentId) {
        let page = self.tags.page();
        // Pages live blocks touch in the range: sorted, merged page intervals.
        let (base, needed) = self.touched_pages(segment_id);
        let old = std::mem::take(&mut self.tags.paused_mut(tag).runs);
        let mut kept = Vec::with_capacity(old.len());
        for run in old {
            if run.base != base {
                kept.push(run);
                continue;
            }
            let (first, end) = (run.first_page, run.first_page + run.pages);
            let parts: Vec<(u64, u64)> = needed.iter().map(|&(s, e)| (s.max(first), e.min(end))).filter(|&(s, e)| s < e).collect();
            if parts.is_empty() {
                continue;
            }
            if parts == [(first, end)] {
                kept.push(run);
                continue;
            }
            let Some(data) = &run.data else {
                kept.extend(parts.iter().map(|&(s, e)| SavedRun { base: run.base, first_page: s, pages: e - s, data: None }));
                continue;
            };
            let mut pieces = Vec::new();
            for &(s, e) in &parts {
                let Ok(mut memory) = self.backend.host_memory((e - s) * page) else { break };
                let from = ((s - first) * page) as usize;
                memory.bytes_mut().copy_from_slice(&data.bytes()[from..from + ((e - s) * page) as usize]);
                pieces.push(SavedRun { base: run.base, first_page: s, pages: e - s, data: Some(memory) });
            }
            if pieces.len() == parts.len() {
                kept.extend(pieces);
            } else {
                kept.push(run);
            }
        }
        self.tags.paused_mut(tag).runs = kept;
    }

    /// Makes the freed block `id` of a tagged pool reusable. In a paused
    /// tag it is merged at once (a paused tag stashes nothing) and the
    /// saved pages only it touched are dropped.
    #[cold]
    pub(super) fn deactivate_tagged(&mut self, id: BlockId) {
        let (tag, segment) = (self.pools[self.blocks[id].pool].tag, self.blocks[id].segment);
        if !self.tags.is_paused(tag) {
            return self.stash_or_bin(id);
        }
        self.bin_freed(id);
        self.drop_unneeded_runs(tag, segment);
    }

    /// Maps the saved runs' pages again, all or nothing; commits them to the
    /// page maps and the counts only when every run is mapped. Pages still
    /// mapped (an earlier undo whose unmap failed) are left as they are.
    fn map_saved(&mut self, runs: &[(u64, u64, u64)], page: u64) -> Result<(), BackendError> {
        // Each unmapped run in physical allocations as a growth makes them,
        // one `vm_map` per run.
        let mut todo: Vec<(u64, u64, Vec<u64>)> = Vec::new();
        for &(base, first, count) in runs {
            let id = self.segments.at_base(base).expect("a range of the tag");
            let pages = self.segments.pages(id).expect("a range of the tag");
            for (p, n) in pages.runs(first, count, false) {
                todo.push((base, p, self.allocations_for(n, page).collect::<Vec<_>>()));
            }
        }
        // The allocations mapped (first page, pages), by range.
        let mut done: BTreeMap<u64, Vec<(u64, u64)>> = BTreeMap::new();
        let mut failed = None;
        for (base, first, allocations) in todo {
            let sizes: Vec<u64> = allocations.iter().map(|&n| n * page).collect();
            let bytes = sizes.iter().sum();
            let mapped = self.claim_reserved(bytes).and_then(|()| {
                let result = self.backend.vm_map(self.device, base + first * page, &sizes);
                if result.is_err() {
                    self.limits.reserve.give_back(bytes);
                }
                result
            });
            if let Err(err) = mapped {
                failed = Some(err);
                break;
            }
            let mut at = first;
            for n in allocations {
                done.entry(base).or_default().push((at, n));
                at += n;
            }
        }
        for (base, allocations) in done {
            let id = self.segments.at_base(base).expect("a range of the tag");
            let kind = self.pools[self.segments[id].pool].kind;
            // Undone when a run failed: what the backend cannot unmap stays mapped, and counted.
            if failed.is_some() {
                self.undo_mapped(id, kind, allocations);
            } else {
                self.commit_mapped(id, kind, &allocations);
            }
        }
        failed.map_or(Ok(()), Err)
    }

    /// Unmaps runs `map_saved` mapped (a resume that could not finish);
    /// a run the backend refuses stays mapped and counted.
    fn unmap_saved(&mut self, runs: &[(u64, u64, u64)]) {
        for &(base, first, count) in runs {
            self.unmap_run(self.segments.at_base(base).expect("a range of the tag"), first, count);
        }
    }

    /// Maps `tag`'s saved pages again at their addresses and copies their
    /// contents back (offload). When the device has no room, nothing stays
    /// mapped and the tag stays paused, its saved bytes intact: an
    /// out-of-memory for the device's ladder (which releases the cache,
    /// asks the other processes and calls this again). Returns the device
    /// bytes mapped.
    pub fn resume_tag(&mut self, tag: TagId) -> Result<u64, AllocError> {
        if !self.tags.is_paused(tag) {
            return Err(tag_error(tag, TagState::NotPaused));
        }
        if !self.may_release() {
            // Its copies and, should it fail, its unmaps are what a capture forbids.
            return Err(tag_error(tag, TagState::PrivatePoolOpen { resuming: true }));
        }
        let page = self.tags.page();
        let segments = self.tag_segments(tag);
        let saved_runs =
            |heap: &Self| -> Vec<(u64, u64, u64)> { heap.tags.paused[&tag].runs.iter().map(|r| (r.base, r.first_page, r.pages)).collect() };
        // Taken afresh at each attempt: a release between two (the device's
        // out-of-memory ladder) completes frees that waited on events, the
        // tag's too, so its free blocks may have merged and its saved pages
        // shrunk (`drop_unneeded_runs`).
        let runs = saved_runs(self);
        // Pages a failed attempt leaves mapped are no longer given back.
        let mapped_before = self.tag_mapped_bytes(&segments);
        let free = self.unbin(&segments);
        let mapped = self.map_saved(&runs, page);
        let need: u64 = runs.iter().map(|r| r.2 * page).sum();
        if let Err(err) = mapped {
            self.rebin(free);
            self.recount_given_back(tag, &segments, mapped_before);
            return Err(match err {
                // The device releases, asks the other processes and retries.
                BackendError::OutOfMemory => {
                    let from_others = self.need_within_cap(need);
                    AllocError::OutOfMemory(Box::new(self.oom_report(need, from_others)))
                }
                other => AllocError::Backend(other),
            });
        }
        // Every page is back; now the contents.
        let state = &self.tags.paused[&tag];
        let mut copied = Ok(());
        for run in &state.runs {
            if let Some(data) = &run.data {
                copied = self.backend.copy_to_device(self.device, run.base + run.first_page * page, data.bytes(), Stream::DEFAULT);
                if copied.is_err() {
                    break;
                }
            }
        }
        if let Err(err) = copied {
            self.unmap_saved(&runs);
            self.rebin(free);
            self.recount_given_back(tag, &segments, mapped_before);
            return Err(AllocError::Backend(err));
        }
        self.rebin(free);
        self.tags.paused.remove(&tag);
        Ok(self.tag_mapped_bytes(&segments) - mapped_before)
    }

    /// Bytes mapped in the ranges `segments` (a tag's).
    fn tag_mapped_bytes(&self, segments: &[SegmentId]) -> u64 {
        segments.iter().filter_map(|&id| self.segments.get(id)?.pages.as_ref()).map(|p| p.mapped_bytes()).sum()
    }

    /// After a resume of `tag` that failed: the pages it left mapped (an
    /// undo the backend refused) are no longer what the pause gave back,
    /// and those it unmapped that an earlier failure had left are again.
    fn recount_given_back(&mut self, tag: TagId, segments: &[SegmentId], mapped_before: u64) {
        let mapped_after = self.tag_mapped_bytes(segments);
        let paused = self.tags.paused_mut(tag);
        paused.given_back = (paused.given_back + mapped_before).saturating_sub(mapped_after);
    }
}
