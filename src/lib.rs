//! tidepool: a CUDA caching allocator that measures fragmentation and gives
//! idle memory back.
//!
//! [`Allocator`] is the entry point: one [`heap::DeviceHeap`]
//! per device behind its own lock, all growing through one
//! [`backend::Backend`].
//!
//! ```
//! use tidepool::{Allocator, Config, Stream};
//!
//! let config = Config::builder().host(1, 1 << 30).build().unwrap();
//! let alloc = Allocator::new(config).unwrap();
//! let ptr = alloc.allocate(0, 4096, Stream::DEFAULT).unwrap();
//! assert_eq!(alloc.stats(0).unwrap().allocated_bytes.all.current, 4096);
//! alloc.free(0, ptr).unwrap();
//! ```

pub mod backend;
pub mod buffer;
pub mod config;
mod cooperation;
pub mod error;
pub mod exporter;
#[allow(non_camel_case_types)]
pub mod ffi;
pub mod frames;
pub mod heap;
pub mod pickle;
pub mod reclaim;
pub mod size_class;
pub mod snapshot;
pub mod stats;
pub mod tag;
pub mod trace;
pub mod types;

/// cudarc interop: tidepool buffers as cudarc device memory (feature `cudarc`).
#[cfg(feature = "cudarc")]
pub mod cudarc_interop;

use std::sync::Arc;

use parking_lot::Mutex;

use backend::host::HostBackend;
use backend::Backend;
pub use buffer::{Buffer, Plain};
pub use config::{BackendKind, Config, ConfigError};
pub use error::{AllocError, InvalidFree, OomReport};
pub use ffi::global;
pub use frames::Frame;
use heap::DeviceHeap;
pub use heap::history::{HistoryAction, HistoryEntry};
pub use heap::private::PrivatePoolId;
pub use heap::tags::TagStats;
pub use heap::{BlockSnapshot, SegmentSnapshot};
pub use tag::TagId;
pub use stats::{Events, Released, Stat, StatByPool, Stats};

pub use types::{DevicePtr, Stream};

/// A caching allocator over all devices of one backend. `Send + Sync`:
/// share it between threads by reference or in an `Arc`.
pub struct Allocator {
    config: Config,
    backend: Arc<dyn Backend>,
    /// `shards` heaps per device, device by device: a stream's requests go
    /// to the heap `device * shards + shard_of(stream)`.
    heaps: Arc<[Mutex<DeviceHeap>]>,
    shards: usize,
    devices: usize,
    recorder: Option<Arc<trace::record::Recorder>>,
    /// The background thread that gives idle memory back (None: no policy on).
    reclaimer: Option<reclaim::Reclaimer>,
    /// The process that made it, and the fork count then: a forked child
    /// must not touch heaps its parent's threads may have held locked.
    pid: u32,
    fork_generation: u64,
    /// The frames of allocation contexts, for snapshots.
    contexts: frames::Contexts,
}

impl Allocator {
    /// An allocator over the backend the configuration names.
    pub fn new(config: Config) -> Result<Allocator, AllocError> {
        let backend: Arc<dyn Backend> = match (config.backend, &config.host_shared) {
            (BackendKind::Host, None) => Arc::new(HostBackend::new(config.host_devices, config.host_capacity)),
            (BackendKind::Host, Some(path)) => Arc::new(
                HostBackend::shared(config.host_devices, config.host_capacity, path)
                    .map_err(|e| AllocError::InvalidArgument(format!("host_shared: cannot open {}: {e}", path.display())))?,
            ),
            (BackendKind::Cuda, _) => Arc::new(backend::cuda::CudaBackend::new(false).map_err(AllocError::Backend)?),
            (BackendKind::CudaAsync, _) => Arc::new(backend::cuda::CudaBackend::new(true).map_err(AllocError::Backend)?),
        };
        Ok(Allocator::with_backend(config, backend))
    }

    /// An allocator configured from `TIDEPOOL_CONF`.
    pub fn from_env() -> Result<Allocator, AllocError> {
        Allocator::new(Config::from_env())
    }

    /// An allocator over a backend built by the caller (tests keep a handle
    /// to inject faults). A trace file that cannot be created is reported on
    /// stderr and the allocator runs without recording.
    pub fn with_backend(config: Config, backend: Arc<dyn Backend>) -> Allocator {
        let recorder = config.trace_path.as_ref().and_then(|path| match trace::record::Recorder::create(path) {
            Ok(recorder) => Some(recorder),
            Err(err) => {
                eprintln!("tidepool: warning: TIDEPOOL_TRACE: cannot record to {}: {err}", path.display());
                None
            }
        });
        let clock = reclaim::Clock::new();
        let mut cooperating = false;
        let shards = config.stream_shards.max(1);
        let mut heaps = Vec::with_capacity(backend.device_count() * shards);
        for device in 0..backend.device_count() {
            let device_reserved = Arc::new(std::sync::atomic::AtomicU64::new(0));
            for shard in 0..shards {
                let mut heap = DeviceHeap::new(device, config.rules.clone(), backend.clone());
                heap.share_device_reserved(device_reserved.clone());
                heap.set_stash(config.stash);
                heap.set_lend_across_streams(config.lend_across_streams);
                if let Err(err) = heap.set_expandable(config.expandable) {
                    if shard == 0 {
                        eprintln!("tidepool: warning: device {device}: {err}");
                    }
                }
                heap.set_policy(config.policy(), clock.clone());
                heap.record_history(Some(config.history_entries));
                // One registry slot per device: the first shard speaks for it.
                if shard == 0 {
                    if let Some(registry) = join_registry(&config, backend.as_ref(), device) {
                        heap.cooperate(registry, std::time::Duration::from_millis(config.oom_wait_ms));
                        cooperating = true;
                    }
                }
                if let Some(recorder) = &recorder {
                    heap.record_to(recorder.clone());
                }
                heaps.push(Mutex::new(heap));
            }
        }
        let heaps: Arc<[Mutex<DeviceHeap>]> = heaps.into();
        let reclaimer = if config.reclaims() || cooperating {
            let interval = std::time::Duration::from_millis(config.reclaim_interval_ms);
            // Each heap applies the policy in turn, locked one at a time.
            let weak = Arc::downgrade(&heaps);
            let pass = move || match weak.upgrade() {
                Some(heaps) => {
                    heaps.iter().for_each(|heap| {
                        heap.lock().reclaim();
                    });
                    true
                }
                None => false,
            };
            match reclaim::Reclaimer::start(pass, clock, interval) {
                Ok(reclaimer) => Some(reclaimer),
                Err(err) => {
                    eprintln!("tidepool: warning: cannot start the reclaimer thread ({err}); idle memory stays cached");
                    None
                }
            }
        } else {
            None
        };
        let fork_generation = ffi::watch_forks();
        let devices = backend.device_count();
        let pid = std::process::id();
        let contexts = frames::Contexts::default();
        Allocator { config, backend, heaps, shards, devices, recorder, reclaimer, pid, fork_generation, contexts }
    }

    /// Why `device` cannot be used: a fork child's, or no such device.
    #[cold]
    fn unusable(&self, device: usize) -> AllocError {
        if self.forked() {
            AllocError::Forked { parent: self.pid }
        } else {
            AllocError::InvalidDevice { device: device as i64, device_count: self.devices }
        }
    }

    /// The heaps of `device` (its stream shards).
    fn device_heaps(&self, device: usize) -> Result<&[Mutex<DeviceHeap>], AllocError> {
        if device >= self.devices || self.forked() {
            return Err(self.unusable(device));
        }
        Ok(&self.heaps[device * self.shards..(device + 1) * self.shards])
    }

    /// The heap serving `stream` on `device`.
    #[inline(always)]
    fn stream_heap(&self, device: usize, stream: Stream) -> Result<&Mutex<DeviceHeap>, AllocError> {
        if device >= self.devices || self.forked() {
            return Err(self.unusable(device));
        }
        Ok(self.shard_heap(device, stream))
    }

    /// The heap serving `stream` on `device`, a device known to exist.
    #[inline(always)]
    fn shard_heap(&self, device: usize, stream: Stream) -> &Mutex<DeviceHeap> {
        let shard = if self.shards == 1 {
            0
        } else {
            let mixed = stream.0 ^ (stream.0 >> 7) ^ (stream.0 >> 17);
            (mixed % self.shards as u64) as usize
        };
        &self.heaps[device * self.shards + shard]
    }

    /// Runs `f` on the heap of `device` holding the block `ptr`, locked
    /// once: `stream`'s heap first, then the others; if none holds it,
    /// `stream`'s heap (which then reports the bad pointer).
    #[inline(always)]
    fn with_owner<R>(&self, device: usize, ptr: DevicePtr, stream: Stream, f: impl FnOnce(&mut DeviceHeap) -> R) -> Result<R, AllocError> {
        let first = self.stream_heap(device, stream)?;
        {
            let mut heap = first.lock();
            if self.shards == 1 || heap.owns(ptr.0) {
                return Ok(f(&mut heap));
            }
        }
        for other in self.device_heaps(device)?.iter().filter(|h| !std::ptr::eq(*h, first)) {
            let mut heap = other.lock();
            if heap.owns(ptr.0) {
                return Ok(f(&mut heap));
            }
        }
        Ok(f(&mut first.lock()))
    }

    /// Whether this process is a fork child of the one that made the allocator.
    #[inline]
    fn forked(&self) -> bool {
        ffi::fork_generation() != self.fork_generation
    }

    /// Every heap, unless this is a fork child.
    fn heaps(&self) -> Result<&[Mutex<DeviceHeap>], AllocError> {
        if self.forked() {
            return Err(AllocError::Forked { parent: self.pid });
        }
        Ok(&self.heaps)
    }

    /// Whether a background reclaimer runs for this allocator.
    pub fn has_reclaimer(&self) -> bool {
        self.reclaimer.is_some()
    }

    /// Writes out every trace row recorded so far (TIDEPOOL_TRACE), without
    /// stopping the recording.
    pub fn flush_trace(&self) {
        for heap in self.heaps().unwrap_or(&[]) {
            heap.lock().flush_trace();
        }
    }

    pub fn config(&self) -> &Config {
        &self.config
    }

    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.backend
    }

    pub fn device_count(&self) -> usize {
        self.devices
    }

    /// The first heap of `device` (the only one without stream shards).
    #[inline]
    fn heap(&self, device: usize) -> Result<&Mutex<DeviceHeap>, AllocError> {
        Ok(&self.device_heaps(device)?[0])
    }

    /// `size` bytes on `device` for use on `stream`. A 0-byte request returns
    /// [`DevicePtr::NULL`] and no error.
    #[inline(always)]
    pub fn allocate(&self, device: usize, size: usize, stream: Stream) -> Result<DevicePtr, AllocError> {
        // One test for a bad device, a fork and a tagged thread: a thread
        // with a tag biases the device out of range (`tag::device_bias`).
        if device.wrapping_add(tag::device_bias()) >= self.devices || self.forked() {
            return self.allocate_cold(device, size, stream, 0);
        }
        let heap = self.shard_heap(device, stream);
        let result = heap.lock().allocate(size as u64, stream);
        match result {
            Ok(addr) => Ok(DevicePtr(addr)),
            Err(err) => self.allocate_after(err, heap, device, size, stream, 0),
        }
    }

    /// `allocate`, remembering `context` (0: none) for the block and for its
    /// `alloc` event in the history: snapshots show the frames registered
    /// for it (`register_context`). Plain `allocate` does not pay for this.
    pub fn allocate_with_context(&self, device: usize, size: usize, stream: Stream, context: u64) -> Result<DevicePtr, AllocError> {
        if tag::current() != TagId::DEFAULT {
            return self.allocate_cold(device, size, stream, context);
        }
        let heap = self.stream_heap(device, stream)?;
        let result = heap.lock().allocate_with_context(size as u64, stream, context);
        match result {
            Ok(addr) => Ok(DevicePtr(addr)),
            Err(err) => self.allocate_after(err, heap, device, size, stream, context),
        }
    }

    /// Registers the frames (innermost first) of `context`, non-zero,
    /// replacing any registered before; they live as long as the allocator.
    pub fn register_context(&self, context: u64, frames: Vec<Frame>) -> Result<(), AllocError> {
        self.contexts.register(context, frames)
    }

    /// The frames registered for `context` (none for 0 or an unknown one).
    pub fn context_frames(&self, context: u64) -> Arc<[Frame]> {
        self.contexts.frames(context)
    }

    /// A request made under the thread's tag (not "default"): from the
    /// tag's own pools (`heap/tags.rs`).
    #[cold]
    #[inline(never)]
    fn allocate_cold(&self, device: usize, size: usize, stream: Stream, context: u64) -> Result<DevicePtr, AllocError> {
        let heap = self.stream_heap(device, stream)?;
        let result = heap.lock().allocate_tagged(size as u64, stream, tag::current(), context);
        match result {
            Ok(addr) => Ok(DevicePtr(addr)),
            Err(err) => self.allocate_after(err, heap, device, size, stream, context),
        }
    }

    /// After a failed request: with stream shards, the other shards may
    /// cache what this one could not get; they release their whole free
    /// segments and the request is tried once more. Then, if other
    /// processes on the device hold memory they could give back, they are
    /// asked, with no heap locked while they answer (`cooperation.rs`).
    #[cold]
    fn allocate_after(
        &self,
        err: AllocError,
        heap: &Mutex<DeviceHeap>,
        device: usize,
        size: usize,
        stream: Stream,
        context: u64,
    ) -> Result<DevicePtr, AllocError> {
        if !matches!(err, AllocError::OutOfMemory(_)) {
            return Err(err);
        }
        let tag = tag::current();
        let retry = || heap.lock().retry_allocate(size as u64, stream, tag, context).map(DevicePtr);
        let mut err = err;
        if self.shards > 1 {
            for other in self.device_heaps(device)?.iter().filter(|h| !std::ptr::eq(*h, heap)) {
                other.lock().release_free_segments(reclaim::policy::Reason::OutOfMemory, |_, _| true);
            }
            match retry() {
                Err(again @ AllocError::OutOfMemory(_)) => err = again,
                other => return other,
            }
        }
        let Some(need) = heap.lock().take_oom_need() else {
            return Err(err);
        };
        cooperation::ask_and_retry(&self.device_heaps(device)?[0], need, retry).unwrap_or(Err(err))
    }

    /// Frees a pointer returned by `allocate` on `device`. Freeing NULL does nothing.
    #[inline(always)]
    pub fn free(&self, device: usize, ptr: DevicePtr) -> Result<(), AllocError> {
        self.free_on_stream(device, ptr, Stream::DEFAULT)
    }

    /// Frees `ptr`, allocated on `stream`: with stream shards, the stream
    /// names the heap at once (other heaps are searched if it is wrong).
    #[inline(always)]
    pub fn free_on_stream(&self, device: usize, ptr: DevicePtr, stream: Stream) -> Result<(), AllocError> {
        if ptr.is_null() {
            return Ok(());
        }
        self.with_owner(device, ptr, stream, |heap| heap.free(ptr.0))?.map(|_| ())
    }

    /// Frees `ptr`, checking the size the caller believes it has: a
    /// different size is counted (`num_size_mismatches`) and the recorded
    /// one is used. Returns the recorded size.
    pub fn free_sized(&self, device: usize, ptr: DevicePtr, size: usize, stream: Stream) -> Result<u64, AllocError> {
        if ptr.is_null() {
            return Ok(0);
        }
        self.with_owner(device, ptr, stream, |heap| {
            let freed = heap.free(ptr.0)?;
            if freed.requested != size as u64 {
                heap.count_size_mismatch();
            }
            Ok(freed.requested)
        })?
    }

    /// Releases every whole free segment of every device to the backend.
    pub fn empty_cache(&self) -> Released {
        let mut total = Released::default();
        for heap in self.heaps().unwrap_or(&[]) {
            total += heap.lock().release_free_segments(reclaim::policy::Reason::EmptyCache, |_, _| true);
        }
        total
    }

    /// The statistics of `device`.
    /// With stream shards, each figure is the sum over the shards, so a peak
    /// is an upper bound of the device's (the shards may peak at different times).
    pub fn stats(&self, device: usize) -> Result<Stats, AllocError> {
        let heaps = self.device_heaps(device)?;
        let each: Vec<Stats> = heaps.iter().map(|h| h.lock().stats()).collect();
        Ok(Stats::combine(&each))
    }

    /// Resets the peaks of `device` to the current values.
    pub fn reset_peak_stats(&self, device: usize) -> Result<(), AllocError> {
        for heap in self.device_heaps(device)? {
            heap.lock().reset_peak_stats();
        }
        Ok(())
    }

    /// Zeroes what `device` accumulated (`torch.cuda.reset_accumulated_memory_stats`):
    /// every gauge's allocated and freed sums and the event counters;
    /// current values and peaks stay.
    pub fn reset_accumulated_stats(&self, device: usize) -> Result<(), AllocError> {
        for heap in self.device_heaps(device)? {
            heap.lock().reset_accumulated_stats();
        }
        Ok(())
    }

    /// The base and size of the segment holding `ptr` (PyTorch's `getBaseAllocation`).
    pub fn segment_of(&self, device: usize, ptr: DevicePtr) -> Result<Option<(DevicePtr, u64)>, AllocError> {
        Ok(self.device_heaps(device)?.iter().find_map(|h| h.lock().segment_of(ptr.0)).map(|(base, size)| (DevicePtr(base), size)))
    }

    /// Limits what `device` may reserve to `fraction` of its total memory
    /// (PyTorch's `set_per_process_memory_fraction`): growth past it fails
    /// as out of memory after the cache is released. 1.0 lifts the limit.
    pub fn set_memory_fraction(&self, device: usize, fraction: f64) -> Result<(), AllocError> {
        if !(0.0..=1.0).contains(&fraction) {
            return Err(AllocError::InvalidArgument(format!("memory fraction must be between 0 and 1, got {fraction}")));
        }
        let heaps = self.device_heaps(device)?;
        let total = self.backend.mem_info(device).map_err(AllocError::Backend)?.total;
        let limit = (fraction < 1.0).then_some((total as f64 * fraction) as u64);
        for heap in heaps {
            heap.lock().set_reserved_limit(limit);
        }
        Ok(())
    }

    /// Routes every allocation on `device` to the private pool `id` until
    /// `end_private` (PyTorch's `beginAllocateToPool`: CUDA graph capture,
    /// `torch.cuda.use_mem_pool`). See `heap/private.rs` for what a
    /// private pool keeps.
    pub fn begin_private(&self, device: usize, id: PrivatePoolId) -> Result<(), AllocError> {
        self.on_device_heaps(device, |heap| {
            heap.begin_private(id);
            Ok(())
        })
    }

    /// Stops routing allocations on `device` to `id` (PyTorch's `endAllocateToPool`).
    pub fn end_private(&self, device: usize, id: PrivatePoolId) -> Result<(), AllocError> {
        self.on_device_heaps(device, |heap| heap.end_private(id))
    }

    /// Drops a use of the private pool `id` on `device` (PyTorch's
    /// `releasePool`, when a graph or a `MemPool` goes).
    pub fn release_private(&self, device: usize, id: PrivatePoolId) -> Result<(), AllocError> {
        self.on_device_heaps(device, |heap| heap.release_private(id))
    }

    /// Applies `change` to every heap of `device` (its stream shards keep
    /// the same private pools, so the first refusal stops them all).
    fn on_device_heaps(&self, device: usize, mut change: impl FnMut(&mut DeviceHeap) -> Result<(), String>) -> Result<(), AllocError> {
        for heap in self.device_heaps(device)? {
            change(&mut heap.lock()).map_err(|e| AllocError::InvalidArgument(format!("tidepool: {e}")))?;
        }
        Ok(())
    }

    /// Notes that the live block at `ptr` is used on `stream` too (PyTorch's
    /// `record_stream`); it is not reused until that stream's work is done.
    pub fn record_stream(&self, ptr: DevicePtr, stream: Stream) -> Result<(), AllocError> {
        for heap in self.heaps()? {
            let mut heap = heap.lock();
            if heap.live_size(ptr.0).is_some() {
                return heap.record_stream(ptr.0, stream);
            }
        }
        Err(AllocError::UnknownPointer { ptr: ptr.0 })
    }

    /// The device, base and size of the segment holding `ptr`, searching
    /// every device (PyTorch's `getBaseAllocation`).
    pub fn find_segment(&self, ptr: DevicePtr) -> Option<(usize, DevicePtr, u64)> {
        self.heaps()
            .ok()?
            .iter()
            .enumerate()
            .find_map(|(index, heap)| heap.lock().segment_of(ptr.0).map(|(base, size)| (index / self.shards, DevicePtr(base), size)))
    }

    /// Every segment of `device` with its blocks, in address order.
    /// Keeps the last `max_entries` allocation and segment events of every
    /// device from now on, for snapshots' `device_traces` (PyTorch's
    /// `_record_memory_history`); None or 0 stops and forgets them.
    pub fn record_history(&self, max_entries: Option<usize>) -> Result<(), AllocError> {
        for heap in self.heaps()? {
            heap.lock().record_history(max_entries);
        }
        Ok(())
    }

    /// The events kept for `device`, oldest first (with stream shards, the
    /// shards' events merged by time).
    pub fn history(&self, device: usize) -> Result<Vec<HistoryEntry>, AllocError> {
        let mut entries: Vec<HistoryEntry> = self.device_heaps(device)?.iter().flat_map(|h| h.lock().history()).collect();
        entries.sort_by_key(|e| e.time_us);
        Ok(entries)
    }

    pub fn snapshot(&self, device: usize) -> Result<Vec<SegmentSnapshot>, AllocError> {
        let mut segments: Vec<SegmentSnapshot> = self.device_heaps(device)?.iter().flat_map(|h| h.lock().snapshot()).collect();
        segments.sort_by_key(|s| s.address);
        Ok(segments)
    }

    /// Checks every invariant of every heap; see `heap/mod.rs`.
    pub fn validate(&self) -> Result<(), String> {
        for (index, heap) in self.heaps().map_err(|e| e.to_string())?.iter().enumerate() {
            let (device, shard) = (index / self.shards, index % self.shards);
            heap.lock().validate().map_err(|e| format!("device {device} (shard {shard}): {e}"))?;
        }
        Ok(())
    }

    /// Ends the recording: every row is written and the file closed. Later
    /// allocations are no longer recorded. Dropping the allocator does this too.
    pub fn finish_trace(&self) -> std::io::Result<()> {
        let Some(recorder) = &self.recorder else {
            return Ok(());
        };
        if self.forked() {
            return Ok(()); // the parent's recording is the parent's to finish
        }
        self.flush_trace();
        recorder.finish()
    }

    /// The heaps of `device`, or of every device when None.
    fn heaps_of(&self, device: Option<usize>) -> Result<&[Mutex<DeviceHeap>], AllocError> {
        match device {
            Some(device) => self.device_heaps(device),
            None => self.heaps(),
        }
    }

    /// The id of a tag some thread of this process has used.
    fn known_tag(name: &str) -> Result<TagId, AllocError> {
        tag::check_name(name)?;
        tag::lookup(name).ok_or_else(|| AllocError::Tag(format!("tag {name:?} is unknown: no thread of this process ever set it")))
    }

    /// Pauses `tag` on `device` (None: every device): waits for the work
    /// queued on the streams that used its blocks, then gives every page of
    /// its memory, live and cached, back to the device. Addresses stay
    /// reserved, so pointers keep their values. With `offload`, the
    /// contents of live blocks are first copied to host memory (pinned on
    /// CUDA) and come back at `resume`; without, they are lost. Returns the
    /// device bytes given back.
    ///
    /// Errors change nothing: an unknown tag, "default", a tag already
    /// paused on one of the devices, an open private pool (a CUDA graph
    /// capture may be underway) or a stream of the tag being captured,
    /// host memory that cannot be had for the offload. Allocating under a paused tag is an error until `resume`;
    /// freeing a paused block is allowed.
    pub fn pause(&self, tag: &str, device: Option<usize>, offload: bool) -> Result<u64, AllocError> {
        let id = Self::known_tag(tag)?;
        let heaps = self.heaps_of(device)?;
        for heap in heaps {
            heap.lock().check_pausable(id)?;
        }
        let mut given_back = 0;
        for (done, heap) in heaps.iter().enumerate() {
            match heap.lock().pause_tag(id, offload) {
                Ok(bytes) => given_back += bytes,
                Err(err) => {
                    // All or nothing: the heaps paused so far resume.
                    for earlier in &heaps[..done] {
                        let _ = earlier.lock().resume_tag(id);
                    }
                    return Err(err);
                }
            }
        }
        Ok(given_back)
    }

    /// Resumes `tag` on `device` (None: every device where it is paused):
    /// maps its pages again at the same addresses and copies the offloaded
    /// contents back; returns the device bytes mapped, once the memory is
    /// usable. When the device cannot give the memory back, the cache of
    /// the device is released and the other processes are asked; failing
    /// that, the error leaves the tag paused with nothing mapped and its
    /// saved contents intact (on that device: devices resumed before it
    /// stay resumed). Resuming a tag that is not paused is an error.
    pub fn resume(&self, tag: &str, device: Option<usize>) -> Result<u64, AllocError> {
        let id = Self::known_tag(tag)?;
        let heaps = self.heaps_of(device)?;
        if !heaps.iter().any(|h| h.lock().tag_paused(id)) {
            return Err(AllocError::Tag(format!("tag {tag:?} is not paused")));
        }
        let mut mapped = 0;
        for (index, heap) in heaps.iter().enumerate() {
            let (result, need) = {
                let mut heap = heap.lock();
                if !heap.tag_paused(id) {
                    continue;
                }
                let result = heap.resume_tag(id);
                (result, heap.take_oom_need())
            };
            mapped += match (result, need) {
                (Err(err @ AllocError::OutOfMemory(_)), Some(need)) => {
                    // The device's first heap holds its registry slot.
                    let device = device.unwrap_or(index / self.shards);
                    let registry_heap = &self.device_heaps(device)?[0];
                    cooperation::ask_and_retry(registry_heap, need, || heap.lock().retry_resume_tag(id)).unwrap_or(Err(err))?
                }
                (result, _) => result?,
            };
        }
        Ok(mapped)
    }

    /// What `tag` holds on `device`: live blocks, reserved memory, and
    /// while paused, the memory given back and the host bytes holding its
    /// contents.
    pub fn tag_stats(&self, tag: &str, device: usize) -> Result<TagStats, AllocError> {
        let id = Self::known_tag(tag)?;
        let mut total = TagStats::default();
        for heap in self.device_heaps(device)? {
            total += heap.lock().tag_stats(id);
        }
        Ok(total)
    }

    /// Runs `f` with the (first) heap of `device` locked (tests and tools).
    pub fn with_heap<R>(&self, device: usize, f: impl FnOnce(&mut DeviceHeap) -> R) -> Result<R, AllocError> {
        Ok(f(&mut self.heap(device)?.lock()))
    }
}

/// The registry of the processes sharing `device`, when cooperation is on
/// and the device can be shared; a registry that cannot be used is reported
/// and cooperation stays off for it.
fn join_registry(config: &Config, backend: &dyn Backend, device: usize) -> Option<reclaim::registry::Registry> {
    if !config.cooperative {
        return None;
    }
    let key = backend.shared_device_key(device)?;
    let dir = config.registry_dir.clone().unwrap_or_else(reclaim::registry::default_dir);
    match reclaim::registry::Registry::join(&dir, &key) {
        Ok(registry) => Some(registry),
        Err(err) => {
            eprintln!("tidepool: warning: cooperation off for device {device}: {err}");
            None
        }
    }
}

impl Drop for Allocator {
    fn drop(&mut self) {
        if let Err(err) = self.finish_trace() {
            eprintln!("tidepool: warning: TIDEPOOL_TRACE: writing the trace failed: {err}");
        }
    }
}
