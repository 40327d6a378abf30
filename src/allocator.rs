//! `Allocator`: a caching allocator over all devices of one backend, the
//! Rust API's entry point. It makes the backend the configuration names,
//! one `Device` per GPU, the recorder of `TIDEPOOL_TRACE` and the
//! reclaimer thread, and answers for a fork child (which must not touch
//! heaps its parent's threads may have held locked).
#![forbid(unsafe_code)]

use std::sync::Arc;

use crate::sync::Mutex;

use crate::backend::host::HostBackend;
use crate::backend::{self, Backend};
use crate::config::{BackendKind, Config};
use crate::device::Device;
use crate::error::{AllocError, InvalidArgument, TagError, TagState};
use crate::frames::{self, Frame};
use crate::heap::history::HistoryEntry;
use crate::heap::private::PrivatePoolId;

use crate::heap::{DeviceHeap, SegmentSnapshot, TagStats};
use crate::reclaim;
use crate::recording;
use crate::stats::{Released, Stats};
use crate::tag::{self, TagId};
use crate::thread_cache::{self, Cached, Unnamed};
use crate::types::{DevicePtr, Stream};

/// A caching allocator over all devices of one backend. `Send + Sync`:
/// share it between threads by reference or in an `Arc`.
pub struct Allocator {
    config: Config,
    backend: Arc<dyn Backend>,
    devices: Arc<[Device]>,
    recorder: Option<Arc<recording::Recorder>>,
    /// The background thread that gives idle memory back (None: no policy on).
    reclaimer: Option<reclaim::Reclaimer>,
    /// The process that made it, and the fork count then: a forked child
    /// must not touch heaps its parent's threads may have held locked.
    pid: u32,
    fork_generation: u64,
    /// The frames of allocation contexts, for snapshots.
    contexts: frames::Contexts,
    /// Threads' caches of their own frees (None: off, or several stream shards).
    thread_caches: Option<thread_cache::ThreadCaches>,
}

impl Allocator {
    /// An allocator over the backend the configuration names.
    pub fn new(config: Config) -> Result<Allocator, AllocError> {
        let backend: Arc<dyn Backend> = match (config.backend, &config.host_shared) {
            (BackendKind::Host, None) => Arc::new(HostBackend::new(config.host_devices, config.host_capacity)),
            (BackendKind::Host, Some(path)) => Arc::new(
                HostBackend::shared(config.host_devices, config.host_capacity, path)
                    .map_err(|e| AllocError::InvalidArgument(InvalidArgument::HostShared { path: path.clone(), error: e.to_string() }))?,
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
        let recorder = config.trace_path.as_ref().and_then(|path| match recording::Recorder::create(path) {
            Ok(recorder) => Some(recorder),
            Err(err) => {
                crate::log::log_line(format_args!("tidepool: warning: TIDEPOOL_TRACE: cannot record to {}: {err}", path.display()));
                None
            }
        });
        let clock = reclaim::Clock::new();
        let devices: Arc<[Device]> =
            (0..backend.device_count()).map(|index| Device::new(index, &config, &backend, &clock, recorder.as_ref())).collect();
        let reclaimer = if config.reclaims() || devices.iter().any(Device::cooperates) {
            let interval = std::time::Duration::from_millis(config.reclaim_interval_ms);
            let weak = Arc::downgrade(&devices);
            let pass = move || match weak.upgrade() {
                Some(devices) => {
                    devices.iter().for_each(|device| {
                        device.reclaim();
                    });
                    true
                }
                None => false,
            };
            match reclaim::Reclaimer::start(pass, clock, interval) {
                Ok(reclaimer) => Some(reclaimer),
                Err(err) => {
                    crate::log::log_line(format_args!(
                        "tidepool: warning: cannot start the reclaimer thread ({err}); idle memory stays cached"
                    ));
                    None
                }
            }
        } else {
            None
        };
        let fork_generation = crate::fork::watch_forks();
        let pid = std::process::id();
        let contexts = frames::Contexts::default();
        // A heap recorded from the start (a trace, history) sees every
        // event under its lock: caches would only be looked at and passed by.
        let recorded = recorder.is_some() || config.history_entries > 0;
        let thread_caches = (config.thread_cache_blocks > 0 && config.stream_shards == 1 && !recorded)
            .then(|| thread_cache::ThreadCaches::new(config.thread_cache_blocks, config.thread_cache_bytes));
        Allocator { config, backend, devices, recorder, reclaimer, pid, fork_generation, contexts, thread_caches }
    }

    /// Why `device` cannot be used: a fork child's, or no such device.
    #[cold]
    fn unusable(&self, device: usize) -> AllocError {
        if self.forked() {
            AllocError::Forked { parent: self.pid }
        } else {
            AllocError::InvalidDevice { device: device as i64, device_count: self.devices.len() }
        }
    }

    /// Device `index`, unless there is none or this is a fork child.
    #[inline(always)]
    pub fn device(&self, index: usize) -> Result<&Device, AllocError> {
        match self.devices.get(index) {
            Some(device) if !self.forked() => Ok(device),
            _ => Err(self.unusable(index)),
        }
    }

    /// Every device, unless this is a fork child.
    fn devices(&self) -> Result<&[Device], AllocError> {
        if self.forked() {
            return Err(AllocError::Forked { parent: self.pid });
        }
        Ok(&self.devices)
    }

    /// Device `device`, or every device when None.
    fn devices_of(&self, device: Option<usize>) -> Result<&[Device], AllocError> {
        match device {
            Some(index) => self.device(index).map(std::slice::from_ref),
            None => self.devices(),
        }
    }

    /// Whether this process is a fork child of the one that made the allocator.
    #[inline]
    fn forked(&self) -> bool {
        crate::fork::fork_generation() != self.fork_generation
    }

    /// Whether a background reclaimer runs for this allocator.
    pub fn has_reclaimer(&self) -> bool {
        self.reclaimer.is_some()
    }

    /// Writes out every trace row recorded so far (TIDEPOOL_TRACE), without
    /// stopping the recording.
    pub fn flush_trace(&self) {
        self.devices().unwrap_or(&[]).iter().for_each(Device::flush_trace);
    }

    pub fn config(&self) -> &Config {
        &self.config
    }

    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.backend
    }

    pub fn device_count(&self) -> usize {
        self.devices.len()
    }

    /// `size` bytes on `device` for use on `stream`. A 0-byte request returns
    /// [`DevicePtr::NULL`] and no error.
    #[inline(always)]
    pub fn allocate(&self, device: usize, size: usize, stream: Stream) -> Result<DevicePtr, AllocError> {
        // One test for a bad device, a fork and a tagged thread: a thread
        // with a tag biases the device out of range (`tag::device_bias`).
        if device.wrapping_add(tag::device_bias()) >= self.devices.len() || self.forked() {
            return self.allocate_cold(device, size, stream, 0);
        }
        let dev = &self.devices[device];
        if let Some(caches) = &self.thread_caches {
            match caches.allocate(device, size as u64, stream) {
                Cached::Hit(addr) => return Ok(DevicePtr(addr)),
                Cached::Disarmed(index) => {
                    if let Some(addr) = Self::arm_and_take(caches, dev, index, device, size, stream) {
                        return Ok(addr);
                    }
                }
                Cached::Miss => {}
            }
        }
        let heap = dev.shard(stream);
        let result = heap.lock().allocate(size as u64, stream);
        match result {
            Ok(addr) => Ok(DevicePtr(addr)),
            Err(err) => Self::allocate_after(err, dev, heap, size, stream, 0),
        }
    }

    /// A cached block fits but the cache is disarmed: armed again, the
    /// cache serves it; else the block goes back for the heap to serve.
    #[cold]
    #[inline(never)]
    fn arm_and_take(
        caches: &thread_cache::ThreadCaches,
        dev: &Device,
        index: u32,
        device: usize,
        size: usize,
        stream: Stream,
    ) -> Option<DevicePtr> {
        if !dev.shard(stream).lock().arm_or_recall(index) {
            return None;
        }
        match caches.allocate(device, size as u64, stream) {
            Cached::Hit(addr) => Some(DevicePtr(addr)),
            _ => None,
        }
    }

    /// `allocate`, remembering `context` (0: none) for the block and for its
    /// `alloc` event in the history: snapshots show the frames registered
    /// for it (`register_context`). Plain `allocate` does not pay for this.
    pub fn allocate_with_context(&self, device: usize, size: usize, stream: Stream, context: u64) -> Result<DevicePtr, AllocError> {
        if tag::current() != TagId::DEFAULT {
            return self.allocate_cold(device, size, stream, context);
        }
        let dev = self.device(device)?;
        let heap = dev.shard(stream);
        let result = heap.lock().allocate_with_context(size as u64, stream, context);
        match result {
            Ok(addr) => Ok(DevicePtr(addr)),
            Err(err) => Self::allocate_after(err, dev, heap, size, stream, context),
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
        let dev = self.device(device)?;
        let heap = dev.shard(stream);
        let result = heap.lock().allocate_tagged(size as u64, stream, tag::current(), context);
        match result {
            Ok(addr) => Ok(DevicePtr(addr)),
            Err(err) => Self::allocate_after(err, dev, heap, size, stream, context),
        }
    }

    /// After a request to `heap`, a shard of `dev`, failed: an
    /// out-of-memory goes to the device's ladder (`Device::after_oom`: the
    /// cache released, the other shards', the other processes asked).
    #[cold]
    fn allocate_after(
        err: AllocError,
        dev: &Device,
        heap: &Mutex<DeviceHeap>,
        size: usize,
        stream: Stream,
        context: u64,
    ) -> Result<DevicePtr, AllocError> {
        if !matches!(err, AllocError::OutOfMemory(_)) {
            return Err(err);
        }
        let tag = tag::current();
        let attempt = |heap: &mut DeviceHeap| heap.allocate_tagged(size as u64, stream, tag, context).map(DevicePtr);
        dev.after_oom(heap, attempt, Some((size as u64, stream)))
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
        if let Some(caches) = &self.thread_caches {
            return self.free_cached(caches, device, ptr, None).map(|_| ());
        }
        self.device(device)?.with_owner(ptr, stream, |heap| heap.free(ptr.0)).map(|_| ())
    }

    /// Frees `ptr`, returned by `allocate` on any device, without saying
    /// which (nor its size, nor its stream: the block's own, recorded at
    /// its allocation, is used). Freeing NULL does nothing. The device is
    /// found by the thread's cache when it handed the block out (no lock:
    /// the cached path), else with one device, at once, else by asking
    /// each device's heaps in turn whether the address lies in one of their
    /// segments (one address-map lookup, else one segment lookup, under
    /// each heap's lock). A pointer no device holds is refused as
    /// `InvalidFree` and counted on device 0 (`num_invalid_frees`); a
    /// double free or an interior pointer, on the device that holds it.
    #[inline(always)]
    pub fn free_ptr(&self, ptr: DevicePtr) -> Result<(), AllocError> {
        if ptr.is_null() {
            return Ok(());
        }
        let caches = self.thread_caches.as_ref().filter(|_| !self.forked());
        if let Some(caches) = caches {
            match caches.free_unnamed(ptr.0) {
                Unnamed::Cached => return Ok(()),
                Unnamed::Heap(device) => return caches.free_slow(&self.devices, device, ptr.0, None).map(drop),
                Unnamed::Unknown => {}
            }
        }
        let device = self.owner_of(ptr)?;
        match caches {
            // No cache of this thread knows it (`free_unnamed` looked in each).
            Some(caches) => caches.free_slow(&self.devices, device, ptr.0, None).map(drop),
            None => self.device(device)?.with_owner(ptr, Stream::DEFAULT, |heap| heap.free(ptr.0)).map(drop),
        }
    }

    /// The device that must answer a free of `ptr` that names none: the
    /// one whose heaps hold it, device 0 when none does (or the only one).
    fn owner_of(&self, ptr: DevicePtr) -> Result<usize, AllocError> {
        let devices = self.devices()?;
        if devices.len() == 1 {
            return Ok(0);
        }
        Ok(devices.iter().position(|device| device.holds(ptr)).unwrap_or(0))
    }

    /// A free on a thread with caches: into the thread's cache, else
    /// through the heap, which may lend the block to that cache. Returns
    /// the size requested.
    #[inline(always)]
    fn free_cached(
        &self,
        caches: &thread_cache::ThreadCaches,
        device: usize,
        ptr: DevicePtr,
        size: Option<u64>,
    ) -> Result<u64, AllocError> {
        self.device(device)?;
        if caches.free(device, ptr.0, size) {
            return Ok(size.unwrap_or(0));
        }
        caches.free_slow(&self.devices, device, ptr.0, size)
    }

    /// Frees `ptr`, checking the size the caller believes it has: a
    /// different size is counted (`num_size_mismatches`) and the recorded
    /// one is used. Returns the recorded size.
    pub fn free_sized(&self, device: usize, ptr: DevicePtr, size: usize, stream: Stream) -> Result<u64, AllocError> {
        if ptr.is_null() {
            return Ok(0);
        }
        if let Some(caches) = &self.thread_caches {
            return self.free_cached(caches, device, ptr, Some(size as u64));
        }
        self.device(device)?.with_owner(ptr, stream, |heap| {
            let freed = heap.free(ptr.0)?;
            if freed.requested != size as u64 {
                heap.count_size_mismatch();
            }
            Ok(freed.requested)
        })
    }

    /// Releases every whole free segment of every device to the backend.
    pub fn empty_cache(&self) -> Released {
        let mut total = Released::default();
        for device in self.devices().unwrap_or(&[]) {
            total += device.release_free_segments(reclaim::policy::Reason::EmptyCache);
        }
        total
    }

    /// The statistics of `device`.
    /// With stream shards, each figure is the sum over the shards, so a peak
    /// is an upper bound of the device's (the shards may peak at different
    /// times), except the peak of all reserved bytes, which is the device's.
    pub fn stats(&self, device: usize) -> Result<Stats, AllocError> {
        Ok(self.device(device)?.stats())
    }

    /// Resets the peaks of `device` to the current values.
    pub fn reset_peak_stats(&self, device: usize) -> Result<(), AllocError> {
        self.device(device)?.reset_peak_stats();
        Ok(())
    }

    /// Zeroes what `device` accumulated (`torch.cuda.reset_accumulated_memory_stats`):
    /// every gauge's allocated and freed sums and the event counters;
    /// current values and peaks stay.
    pub fn reset_accumulated_stats(&self, device: usize) -> Result<(), AllocError> {
        self.device(device)?.reset_accumulated_stats();
        Ok(())
    }

    /// The base and size of the segment holding `ptr` (PyTorch's `getBaseAllocation`).
    pub fn segment_of(&self, device: usize, ptr: DevicePtr) -> Result<Option<(DevicePtr, u64)>, AllocError> {
        Ok(self.device(device)?.segment_of(ptr))
    }

    /// Limits what `device` may reserve to `fraction` of its total memory
    /// (PyTorch's `set_per_process_memory_fraction`): growth past it fails
    /// as out of memory after the cache is released. 1.0 lifts the limit.
    pub fn set_memory_fraction(&self, device: usize, fraction: f64) -> Result<(), AllocError> {
        if !(0.0..=1.0).contains(&fraction) {
            return Err(AllocError::InvalidArgument(InvalidArgument::MemoryFraction(fraction)));
        }
        let target = self.device(device)?;
        let total = self.backend.mem_info(device).map_err(AllocError::Backend)?.total;
        target.set_reserved_limit((fraction < 1.0).then_some((total as f64 * fraction) as u64));
        Ok(())
    }

    /// Routes every allocation on `device` to the private pool `id` until
    /// `end_private` (PyTorch's `beginAllocateToPool`: CUDA graph capture,
    /// `torch.cuda.use_mem_pool`). See `heap/private.rs` for what a
    /// private pool keeps.
    pub fn begin_private(&self, device: usize, id: PrivatePoolId) -> Result<(), AllocError> {
        self.device(device)?.begin_private(id)
    }

    /// Stops routing allocations on `device` to `id` (PyTorch's `endAllocateToPool`).
    pub fn end_private(&self, device: usize, id: PrivatePoolId) -> Result<(), AllocError> {
        self.device(device)?.on_shards(|heap| heap.end_private(id))
    }

    /// Drops a use of the private pool `id` on `device` (PyTorch's
    /// `releasePool`, when a graph or a `MemPool` goes).
    pub fn release_private(&self, device: usize, id: PrivatePoolId) -> Result<(), AllocError> {
        self.device(device)?.on_shards(|heap| heap.release_private(id))
    }

    /// Notes that the live block at `ptr` is used on `stream` too (PyTorch's
    /// `record_stream`); it is not reused until that stream's work is done.
    /// NULL (an empty tensor's storage) holds no block: nothing to note.
    pub fn record_stream(&self, ptr: DevicePtr, stream: Stream) -> Result<(), AllocError> {
        if ptr.0 == 0 {
            return Ok(());
        }
        self.devices()?
            .iter()
            .find_map(|device| device.record_stream(ptr, stream))
            .unwrap_or(Err(AllocError::UnknownPointer { ptr: ptr.0 }))
    }

    /// The device, base and size of the segment holding `ptr`, searching
    /// every device (PyTorch's `getBaseAllocation`).
    pub fn find_segment(&self, ptr: DevicePtr) -> Option<(usize, DevicePtr, u64)> {
        self.devices().ok()?.iter().enumerate().find_map(|(index, device)| device.segment_of(ptr).map(|(base, size)| (index, base, size)))
    }

    /// Keeps the last `max_entries` allocation and segment events of every
    /// device from now on, for snapshots' `device_traces` (PyTorch's
    /// `_record_memory_history`); None or 0 stops and forgets them.
    pub fn record_history(&self, max_entries: Option<usize>) -> Result<(), AllocError> {
        self.devices()?.iter().for_each(|device| device.record_history(max_entries));
        Ok(())
    }

    /// The events kept for `device`, oldest first (with stream shards, the
    /// shards' events merged by time).
    pub fn history(&self, device: usize) -> Result<Vec<HistoryEntry>, AllocError> {
        Ok(self.device(device)?.history())
    }

    /// Every segment of `device` with its blocks, in address order.
    pub fn snapshot(&self, device: usize) -> Result<Vec<SegmentSnapshot>, AllocError> {
        Ok(self.device(device)?.snapshot())
    }

    /// Checks every invariant of every device (`device.rs`, `heap/mod.rs`)
    /// and of the calling thread's caches (`cache_owner.rs`).
    pub fn validate(&self) -> Result<(), String> {
        self.devices().map_err(|e| e.to_string())?.iter().try_for_each(Device::validate)?;
        self.thread_caches.as_ref().map_or(Ok(()), |caches| caches.validate_this_thread())
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

    /// The id of a tag some thread of this process has used.
    fn known_tag(name: &str) -> Result<TagId, AllocError> {
        tag::check_name(name)?;
        tag::lookup(name).ok_or_else(|| AllocError::Tag(TagError { tag: name.into(), state: TagState::Unknown }))
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
        let devices = self.devices_of(device)?;
        devices.iter().try_for_each(|device| device.check_pausable(id))?;
        let mut given_back = 0;
        for (done, device) in devices.iter().enumerate() {
            match device.pause(id, offload) {
                Ok(bytes) => given_back += bytes,
                Err(err) => {
                    // All or nothing: the devices paused so far resume.
                    for earlier in &devices[..done] {
                        earlier.resume_where_possible(id);
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
        let devices = self.devices_of(device)?;
        if !devices.iter().any(|device| device.tag_paused(id)) {
            return Err(AllocError::Tag(TagError { tag: tag.into(), state: TagState::NotPaused }));
        }
        devices.iter().try_fold(0, |mapped, device| Ok(mapped + device.resume(id)?))
    }

    /// What `tag` holds on `device`: live blocks, reserved memory, and
    /// while paused, the memory given back and the host bytes holding its
    /// contents. All zeros for "default", which has no pools of its own
    /// (`stats` has what untagged allocations hold).
    pub fn tag_stats(&self, tag: &str, device: usize) -> Result<TagStats, AllocError> {
        let id = Self::known_tag(tag)?;
        Ok(self.device(device)?.tag_stats(id))
    }
}

impl Drop for Allocator {
    /// Writes the trace, if one is being recorded, and gives the cached
    /// memory back to the driver (not while a panic unwinds: a heap may be
    /// half changed). Blocks still live keep their memory, as do private
    /// pools still held and paused tags: whoever holds them may still use it.
    fn drop(&mut self) {
        if let Err(err) = self.finish_trace() {
            crate::log::log_line(format_args!("tidepool: warning: TIDEPOOL_TRACE: writing the trace failed: {err}"));
        }
        if !std::thread::panicking() {
            self.empty_cache();
        }
    }
}
