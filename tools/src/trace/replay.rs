//! Replays a trace against an allocator on the host backend (address space
//! only: a 60 GiB trace replays on a laptop) and reports what a person
//! sizing a GPU needs: peaks, the driver calls, OOMs, fragmentation.
//!
//! Models (`Model`, the command's `--policy`): `tidepool` (tidepool's configuration, TIDEPOOL_CONF
//! syntax via `conf`: expandable segments, as tidepool runs by default),
//! `whole-segments` (the same with `expandable:false`) and
//! `pytorch`, the model of PyTorch's native caching
//! allocator: the rules it shares with tidepool's engine (512-byte
//! rounding, 2 MiB segments for requests up to 1 MiB, 20 MiB below 10 MiB,
//! 2 MiB rounding above, best fit per stream, small blocks split when 512
//! bytes remain and large ones when more than 1 MiB does, release of every
//! cached whole segment and one retry before an OOM), with the settings the
//! snapshot recorded (`max_split_size`, `roundup_power2_divisions`), and
//! without tidepool's stash of the last freed block or its lending of
//! blocks across streams. A fourth, `pytorch-expandable`, models PyTorch
//! with `expandable_segments:True`: the large pool grows in one range per
//! stream, 20 MiB of physical memory at a time (`cuMemCreate` and
//! `cuMemMap` each, `cuMemSetAccess` per run), whole 20 MiB pieces of free
//! blocks are unmapped only when memory runs out or the cache is emptied,
//! nothing moves, and the small pool keeps 2 MiB pieces (modelled as
//! segments, counted as the three calls each takes there).
#![forbid(unsafe_code)]

use std::time::Instant;

use super::{Event, RecordedOom, Trace, WarmUp};
use tidepool::backend::host::HostBackend;
use tidepool::{AllocError, Allocator, Config, ConfigError, DevicePtr, Stream};

/// The allocator a replay runs: tidepool as configured or with whole
/// segments, or a model of PyTorch's (the command's `--policy`; not a
/// release policy, which is `tidepool::reclaim::policy::Policy`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Model {
    /// tidepool as configured: by default, expandable segments.
    Tidepool,
    /// tidepool with whole segments (`expandable:false`).
    WholeSegments,
    Pytorch,
    /// The model of PyTorch with `expandable_segments:True`.
    PytorchExpandable,
}

/// What PyTorch's expandable segments map at a time in the large pool
/// (its `kLargeBuffer`).
const PYTORCH_EXPANDABLE_PAGE: u64 = 20 << 20;

impl Model {
    /// Every model (`--policy all`).
    pub const ALL: [Model; 4] = [Model::Pytorch, Model::Tidepool, Model::WholeSegments, Model::PytorchExpandable];

    /// The model of PyTorch as `trace` says it ran: with expandable
    /// segments or without.
    pub fn pytorch_as_recorded(trace: &Trace) -> Model {
        if trace.pytorch_expandable_segments {
            Model::PytorchExpandable
        } else {
            Model::Pytorch
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Model::Tidepool => "tidepool",
            Model::WholeSegments => "whole-segments",
            Model::Pytorch => "pytorch",
            Model::PytorchExpandable => "pytorch-expandable",
        }
    }

    /// The name as a table heading.
    pub fn title(self) -> &'static str {
        match self {
            Model::Tidepool => "tidepool",
            Model::WholeSegments => "tidepool whole segments",
            Model::Pytorch => "pytorch model",
            Model::PytorchExpandable => "pytorch expandable model",
        }
    }
}

#[derive(Clone, Debug)]
pub struct ReplayOptions {
    /// Bytes each device has.
    pub capacity: u64,
    pub model: Model,
    /// Extra TIDEPOOL_CONF for the replayed allocator.
    pub conf: String,
    /// Keep about this many samples of the totals for a plot (0: none).
    pub samples: usize,
    /// Record what the replayed allocator serves to this file (RMM CSV).
    pub record_to: Option<std::path::PathBuf>,
}

/// The totals at one point of the trace.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sample {
    pub event: u64,
    pub requested: u64,
    pub allocated: u64,
    pub reserved: u64,
    /// The driver calls made so far (`ReplayReport::driver_calls`).
    pub driver_calls: u64,
}

/// The first allocation of a replay that failed for lack of memory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FirstOom {
    /// Its index among the trace's events.
    pub event: u64,
    /// The allocator's error, as a live process would have raised it.
    pub message: String,
}

#[derive(Clone, Debug)]
pub struct ReplayReport {
    pub file: String,
    pub model: Model,
    /// The device these figures are of (0 for a one-device trace).
    pub device: u32,
    pub capacity: u64,
    pub events: u64,
    pub allocs: u64,
    pub peak_requested_bytes: u64,
    pub peak_allocated_bytes: u64,
    pub peak_reserved_bytes: u64,
    pub device_allocs: u64,
    pub device_frees: u64,
    /// The driver calls that change what memory is held, as the `cuda`
    /// backend makes them: one per segment allocated or freed
    /// (`cuMemAlloc`, `cuMemFree`), and with expandable segments two per
    /// page mapped (`cuMemCreate`, `cuMemMap`) plus one per run
    /// (`cuMemSetAccess`) and two per page unmapped (`cuMemUnmap`,
    /// `cuMemRelease`); a page whose memory moves to another page costs
    /// two (`cuMemMap`, `cuMemUnmap`), plus one per run moved
    /// (`cuMemSetAccess`). Failed attempts count.
    pub driver_calls: u64,
    /// Where the trace's warm-up ends (`Trace::warm_up`), and the driver
    /// calls made after it: the steady state's, which a repeated step
    /// should not make.
    pub warm_up: WarmUp,
    pub steady_driver_calls: u64,
    /// Allocations that failed for lack of memory (0: the trace fits).
    pub ooms: u64,
    /// The first of them: where in the trace, and the allocator's report
    /// (what was asked, held, cached and free on the device).
    pub first_oom: Option<FirstOom>,
    /// The most bytes ever free inside partly used segments (PyTorch's
    /// `inactive_split_bytes` peak): memory that only a fitting request can use.
    pub peak_inactive_split_bytes: u64,
    pub seconds: f64,
    pub pytorch_recorded_peak_reserved_bytes: Option<u64>,
    pub series: Vec<Sample>,
}

impl ReplayReport {
    /// Peak reserved over peak requested; None when the replay ran out of
    /// memory (it served less than the trace asks) or requested nothing.
    pub fn reserved_over_requested(&self) -> Option<f64> {
        (self.ooms == 0 && self.peak_requested_bytes > 0).then(|| self.peak_reserved_bytes as f64 / self.peak_requested_bytes as f64)
    }

    /// Fragmentation at the peaks: peak inactive split bytes over peak
    /// reserved ([`tidepool::Stats::fragmentation`]'s definition, on peaks).
    pub fn fragmentation(&self) -> f64 {
        tidepool::stats::fragmentation(self.peak_inactive_split_bytes, self.peak_reserved_bytes)
    }

    pub fn events_per_second(&self) -> f64 {
        if self.seconds > 0.0 {
            self.events as f64 / self.seconds
        } else {
            0.0
        }
    }
}

/// The configuration a model replays with.
pub fn model_config(trace: &Trace, options: &ReplayOptions) -> Result<Config, ConfigError> {
    // A replay has no wall clock: the time-driven release policies stay off.
    // It plays the heap's placement: threads' caches, a live process's
    // shortcut that moves it (docs/allocation.md), stay off too.
    let mut builder = Config::builder().conf("release_after_ms:off,headroom_mb:0,thread_cache_blocks:0")?;
    let pytorch = matches!(options.model, Model::Pytorch | Model::PytorchExpandable);
    match options.model {
        Model::Pytorch | Model::PytorchExpandable => builder = builder.conf(&trace.pytorch_conf)?,
        Model::WholeSegments => builder = builder.set("expandable", "false")?,
        Model::Tidepool => {}
    }
    if let Some(path) = &options.record_to {
        builder = builder.trace(path);
    }
    builder = builder.conf(&options.conf)?;
    if pytorch {
        // PyTorch merges every free at once, never lends across streams and
        // grows as its setting says, whatever `conf` says.
        let expandable = options.model == Model::PytorchExpandable;
        builder = builder.set("stash", "false")?.set("lend_across_streams", "false")?.set("expandable", &expandable.to_string())?;
    }
    let mut config = builder.host(trace.devices as usize, options.capacity).build()?;
    if options.model == Model::PytorchExpandable {
        config.expandable_page = Some(PYTORCH_EXPANDABLE_PAGE);
        config.expandable_allocation = PYTORCH_EXPANDABLE_PAGE;
        config.move_pages = false;
    }
    Ok(config)
}

/// The driver calls so far: every call the `cuda` backend makes for what
/// the heaps asked (segments, ranges of address space, physical
/// allocations, maps, unmaps and access), and, for the model of PyTorch's
/// expandable segments, what its small pool's mapped pieces cost there.
fn driver_calls(alloc: &Allocator, backend: &HostBackend, model: Model, devices: usize) -> u64 {
    let mut calls = backend.driver_calls().total();
    if model == Model::PytorchExpandable {
        for device in 0..devices {
            let s = alloc.stats(device).expect("device exists");
            // Its small pool's 2 MiB pieces are mapped pages there too:
            // cuMemCreate, cuMemMap and cuMemSetAccess each, cuMemUnmap and
            // cuMemRelease to go back, where a segment here is one call
            // each way (counted with the backend's calls).
            calls += 2 * s.segment.small_pool.allocated + s.segment.small_pool.freed;
        }
    }
    calls
}

/// Replays each device of `trace` on its own: one report per device, in
/// device order (one for a one-device trace; devices that allocate
/// nothing are left out). A device's figures are one
/// card's, never sums over cards.
pub fn replay_per_device(trace: &Trace, options: &ReplayOptions) -> Result<Vec<ReplayReport>, String> {
    trace.per_device().into_iter().map(|(device, part)| replay_device(device, &part, options, |_, _| {})).collect()
}

/// `replay_with_progress` of `part`, the part of a trace on `device`
/// (`Trace::per_device`): its report is that device's, and names it.
pub fn replay_device(
    device: u32,
    part: &Trace,
    options: &ReplayOptions,
    progress: impl FnMut(usize, usize),
) -> Result<ReplayReport, String> {
    let mut report = replay_with_progress(part, options, progress)?;
    report.device = device;
    if let Some(oom) = &mut report.first_oom {
        oom.message = name_device(&oom.message, device);
    }
    Ok(report)
}

/// An allocator's message from the replay of one device's part (replayed
/// as device 0), naming the trace's device `device` instead.
pub fn name_device(message: &str, device: u32) -> String {
    message.replacen("on device 0:", &format!("on device {device}:"), 1)
}

/// Whether `model` would have served the request PyTorch could not
/// (`oom`, of this one-device trace) on the memory PyTorch had then: the
/// trace up to that point replayed on `oom.usable()` bytes, then the
/// request. False also when an earlier allocation runs out.
pub fn serves_recorded_oom(trace: &Trace, oom: &RecordedOom, model: Model, conf: &str) -> Result<bool, String> {
    if trace.devices > 1 {
        return Err(format!("{}: a recorded out-of-memory is tried on one device's part (Trace::per_device)", trace.source));
    }
    let mut until = Trace::new(trace.source.clone(), trace.format);
    until.pytorch_conf = trace.pytorch_conf.clone();
    let mut ids = vec![u32::MAX; trace.allocs as usize];
    for event in trace.events.iter().take(oom.event) {
        match *event {
            Event::Alloc { id, size, stream, .. } => ids[id as usize] = until.alloc(size, stream, 0),
            Event::Free { id } if ids[id as usize] != u32::MAX => until.free(ids[id as usize]),
            Event::Free { .. } => {}
        }
    }
    until.alloc(oom.requested.max(1), oom.stream, 0);
    let options = ReplayOptions { capacity: oom.usable(), model, conf: conf.to_string(), samples: 0, record_to: None };
    Ok(replay(&until, &options)?.ooms == 0)
}

/// Replays `trace` once, all devices together (figures summed over
/// devices: see `replay_per_device` for each card's). Fails only on a bad `conf`, or if the allocator
/// reports something other than lack of memory.
pub fn replay(trace: &Trace, options: &ReplayOptions) -> Result<ReplayReport, String> {
    replay_with_progress(trace, options, |_, _| {})
}

/// `replay`, calling `progress(done, total)` about a hundred times.
pub fn replay_with_progress(trace: &Trace, options: &ReplayOptions, progress: impl FnMut(usize, usize)) -> Result<ReplayReport, String> {
    let config = model_config(trace, options).map_err(|e| format!("--conf: {e}"))?;
    let devices = trace.devices as usize;
    let backend = std::sync::Arc::new(HostBackend::unbacked(devices, options.capacity));
    let alloc = Allocator::with_backend(config, backend.clone());
    let replayer = Replayer { alloc, backend, model: options.model, devices };
    let mut played = replayer.play(trace, options, progress)?;
    let ptrs = std::mem::take(&mut played.ptrs);
    let report = replayer.report(trace, options, played);
    replayer.alloc.finish_trace().map_err(|e| format!("recording the replay: {e}"))?;
    // The blocks the trace leaves live go back too, so that the replay
    // holds no memory or address space once dropped (`plan` runs dozens).
    for (ptr, device) in ptrs.into_iter().filter(|&(ptr, _)| ptr != 0) {
        let _ = replayer.alloc.free(device as usize, DevicePtr(ptr));
    }
    Ok(report)
}

/// The allocator a replay drives, on its unbacked host backend.
struct Replayer {
    alloc: Allocator,
    backend: std::sync::Arc<HostBackend>,
    model: Model,
    devices: usize,
}

/// What playing a trace's events left and found.
struct Played {
    /// Each allocation's address (0: not live) and device, by id.
    ptrs: Vec<(u64, u32)>,
    ooms: u64,
    first_oom: Option<FirstOom>,
    series: Vec<Sample>,
    warm_up: WarmUp,
    /// The driver calls made by the end of the warm-up.
    warm_up_calls: Option<u64>,
    seconds: f64,
}

impl Replayer {
    fn driver_calls(&self) -> u64 {
        driver_calls(&self.alloc, &self.backend, self.model, self.devices)
    }

    /// Plays `trace`'s events in order, sampling the figures `options.samples` times.
    fn play(&self, trace: &Trace, options: &ReplayOptions, mut progress: impl FnMut(usize, usize)) -> Result<Played, String> {
        let mut played = Played {
            ptrs: vec![(0u64, 0u32); trace.allocs as usize],
            ooms: 0,
            first_oom: None,
            series: Vec::new(),
            warm_up: trace.warm_up(),
            warm_up_calls: None,
            seconds: 0.0,
        };
        let every = if options.samples == 0 { u64::MAX } else { (trace.events.len() as u64 / options.samples as u64).max(1) };
        let tick = (trace.events.len() / 100).max(1);
        let start = Instant::now();
        for (index, event) in trace.events.iter().enumerate() {
            if index % tick == 0 {
                progress(index, trace.events.len());
            }
            if index == played.warm_up.events {
                played.warm_up_calls = Some(self.driver_calls());
            }
            self.step(trace, index, event, &mut played)?;
            if (index as u64).is_multiple_of(every) || index + 1 == trace.events.len() {
                played.series.push(self.sample(index));
            }
        }
        played.seconds = start.elapsed().as_secs_f64();
        Ok(played)
    }

    /// One event: an allocation (an out-of-memory counted) or a free.
    fn step(&self, trace: &Trace, index: usize, event: &Event, played: &mut Played) -> Result<(), String> {
        match *event {
            Event::Alloc { id, size, stream, device } => match self.alloc.allocate(device as usize, size as usize, Stream(stream)) {
                Ok(ptr) => played.ptrs[id as usize] = (ptr.0, device),
                Err(err @ (AllocError::OutOfMemory(_) | AllocError::TooLarge { .. })) => {
                    played.ooms += 1;
                    played.first_oom.get_or_insert_with(|| FirstOom { event: index as u64, message: err.to_string() });
                }
                Err(other) => return Err(format!("{}: event {index}: {other}", trace.source)),
            },
            Event::Free { id } => {
                let (ptr, device) = std::mem::take(&mut played.ptrs[id as usize]);
                if ptr != 0 {
                    let _ = self.alloc.free(device as usize, DevicePtr(ptr));
                }
            }
        }
        Ok(())
    }

    /// The figures after event `index`, summed over devices.
    fn sample(&self, index: usize) -> Sample {
        let mut sample = Sample { event: index as u64, requested: 0, allocated: 0, reserved: 0, driver_calls: self.driver_calls() };
        for device in 0..self.devices {
            let t = self.alloc.device(device).map(|d| d.totals()).unwrap_or_default();
            sample.requested += t.requested;
            sample.allocated += t.allocated;
            sample.reserved += t.reserved;
        }
        sample
    }

    /// The report of a replay played to its end: the allocator's peaks and
    /// counts summed over devices, and what playing found.
    fn report(&self, trace: &Trace, options: &ReplayOptions, played: Played) -> ReplayReport {
        let mut report = ReplayReport {
            file: trace.source.clone(),
            model: options.model,
            device: 0,
            capacity: options.capacity,
            events: trace.events.len() as u64,
            allocs: trace.allocs as u64,
            peak_requested_bytes: 0,
            peak_allocated_bytes: 0,
            peak_reserved_bytes: 0,
            device_allocs: 0,
            device_frees: 0,
            driver_calls: 0,
            warm_up: played.warm_up,
            steady_driver_calls: 0,
            ooms: played.ooms,
            first_oom: played.first_oom,
            peak_inactive_split_bytes: 0,
            seconds: played.seconds,
            pytorch_recorded_peak_reserved_bytes: trace.pytorch_peak_reserved,
            series: played.series,
        };
        for device in 0..self.devices {
            let s = self.alloc.stats(device).expect("device exists");
            report.peak_requested_bytes += s.requested_bytes.all.peak;
            report.peak_allocated_bytes += s.allocated_bytes.all.peak;
            report.peak_reserved_bytes += s.reserved_bytes.all.peak;
            report.device_allocs += s.events.num_device_alloc;
            report.device_frees += s.events.num_device_free;
            report.peak_inactive_split_bytes += s.inactive_split_bytes.all.peak;
        }
        report.driver_calls = self.driver_calls();
        report.steady_driver_calls = report.driver_calls - played.warm_up_calls.unwrap_or(report.driver_calls);
        report
    }
}
