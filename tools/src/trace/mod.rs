//! Allocation traces: what a workload asked of its allocator, in order, so
//! that it can be replayed against tidepool or a model of PyTorch's policy
//! on a machine without a GPU.
//!
//! Readers turn files into a `Trace`: RMM's logging CSV (`rmm_csv`) and
//! PyTorch's memory snapshots (`torch_snapshot`). `replay` runs a trace,
//! `plan` finds the smallest device it fits, `cards` says which GPUs
//! that is, `plot` draws it. (A live
//! process's recording is written by `tidepool::recording`, below the heap.)
#![forbid(unsafe_code)]

pub mod cards;
pub mod plan;
pub mod plot;
pub mod replay;
pub mod rmm_csv;
pub mod torch_snapshot;

use std::fmt;
use std::io::Read;
use std::path::Path;

/// One step of a trace. Allocation ids are dense, in order of allocation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Event {
    Alloc { id: u32, size: u64, stream: u64, device: u32 },
    Free { id: u32 },
}

/// Where a trace came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    RmmCsv,
    TorchSnapshot,
}

impl Format {
    pub fn name(self) -> &'static str {
        match self {
            Format::RmmCsv => "RMM CSV",
            Format::TorchSnapshot => "PyTorch snapshot",
        }
    }
}

/// At most this many warnings keep their text; the rest are counted.
const KEPT_WARNINGS: usize = 10;

/// Problems a reader stepped over: counted, the first few kept.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Warnings {
    pub count: u64,
    pub first: Vec<String>,
}

impl Warnings {
    pub fn add(&mut self, message: impl Into<String>) {
        self.count += 1;
        if self.first.len() < KEPT_WARNINGS {
            self.first.push(message.into());
        }
    }
}

/// A trace ready to replay.
#[derive(Clone, Debug)]
pub struct Trace {
    pub source: String,
    pub format: Format,
    pub events: Vec<Event>,
    /// Number of allocations (ids are `0..allocs`).
    pub allocs: u32,
    /// Devices referenced (1 + the highest device index).
    pub devices: u32,
    /// PyTorch's own peak reserved bytes, when the file records segments:
    /// of its largest device.
    pub pytorch_peak_reserved: Option<u64>,
    /// The same per device (index = device), when the file records segments.
    pub pytorch_peak_reserved_per_device: Vec<u64>,
    /// PyTorch's allocator settings as recorded (snapshots only), in
    /// TIDEPOOL_CONF syntax: what the PyTorch model replays with.
    pub pytorch_conf: String,
    /// PyTorch ran with `expandable_segments:True` (snapshots only): its
    /// model is `Model::PytorchExpandable`.
    pub pytorch_expandable_segments: bool,
    /// The out-of-memory errors PyTorch recorded (snapshots' `oom` entries).
    pub pytorch_ooms: Vec<RecordedOom>,
    /// The points its recorder named, in order (`mark` rows of an RMM CSV:
    /// the planner marks the end of each step).
    pub marks: Vec<Mark>,
    pub warnings: Warnings,
}

/// A point of a trace its recorder named.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mark {
    pub label: String,
    /// The events before it.
    pub event: usize,
}

/// Where a trace's warm-up ends, and how that was told.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WarmUp {
    /// The events of the warm-up: the steady state is every event after them.
    pub events: usize,
    pub by: WarmUpEnd,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WarmUpEnd {
    /// The end of the trace's second step, as its marks say (`step N`).
    SecondStep,
    /// The first event at which the trace's live bytes reach their peak
    /// (a trace that marks no steps).
    PeakLive,
}

impl WarmUpEnd {
    pub fn name(self) -> &'static str {
        match self {
            WarmUpEnd::SecondStep => "after step 2",
            WarmUpEnd::PeakLive => "after the live peak",
        }
    }

    /// The name in JSON.
    pub fn key(self) -> &'static str {
        match self {
            WarmUpEnd::SecondStep => "step_2",
            WarmUpEnd::PeakLive => "live_peak",
        }
    }
}

/// An allocation PyTorch could not serve, as its snapshot recorded it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RecordedOom {
    pub device: u32,
    /// How many of the device's events came before it (the allocations
    /// live when recording began are its first): the request would have
    /// been the next one.
    pub event: usize,
    /// Bytes asked for, and on which stream.
    pub requested: u64,
    pub stream: u64,
    /// Bytes PyTorch held from the driver then (after it gave its cache back).
    pub reserved: u64,
    /// The device's free memory then (`cudaMemGetInfo`).
    pub device_free: u64,
}

impl RecordedOom {
    /// The memory the process could have had: what it held plus what was free.
    pub fn usable(&self) -> u64 {
        self.reserved.saturating_add(self.device_free)
    }
}

impl Trace {
    /// An empty trace to fill.
    pub fn new(source: impl Into<String>, format: Format) -> Trace {
        Trace {
            source: source.into(),
            format,
            events: Vec::new(),
            allocs: 0,
            devices: 1,
            pytorch_peak_reserved: None,
            pytorch_peak_reserved_per_device: Vec::new(),
            pytorch_conf: String::new(),
            pytorch_expandable_segments: false,
            pytorch_ooms: Vec::new(),
            marks: Vec::new(),
            warnings: Warnings::default(),
        }
    }

    /// Names the point after the events so far.
    pub fn mark(&mut self, label: impl Into<String>) {
        self.marks.push(Mark { label: label.into(), event: self.events.len() });
    }

    /// Where the warm-up ends: after the second step where the trace marks
    /// its steps (marks labelled `step N`, N a number: a step's end), else
    /// at the first event at which its live bytes (of its busiest device)
    /// reach their peak. The driver calls after it are the steady state's.
    pub fn warm_up(&self) -> WarmUp {
        let is_step_end = |m: &&Mark| m.label.strip_prefix("step ").is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()));
        if let Some(second) = self.marks.iter().filter(is_step_end).nth(1) {
            return WarmUp { events: second.event, by: WarmUpEnd::SecondStep };
        }
        let peak = self.peak_requested();
        let mut sizes = vec![(0u64, 0u32); self.allocs as usize];
        let mut live = vec![0u64; self.devices.max(1) as usize];
        for (index, event) in self.events.iter().enumerate() {
            match *event {
                Event::Alloc { id, size, device, .. } => {
                    sizes[id as usize] = (size, device);
                    live[device as usize] += size;
                    if live[device as usize] == peak {
                        return WarmUp { events: index + 1, by: WarmUpEnd::PeakLive };
                    }
                }
                Event::Free { id } => {
                    let (size, device) = std::mem::take(&mut sizes[id as usize]);
                    live[device as usize] -= size;
                }
            }
        }
        WarmUp { events: self.events.len(), by: WarmUpEnd::PeakLive }
    }

    /// Appends an allocation and returns its id.
    pub fn alloc(&mut self, size: u64, stream: u64, device: u32) -> u32 {
        let id = self.allocs;
        self.allocs += 1;
        self.devices = self.devices.max(device + 1);
        self.events.push(Event::Alloc { id, size, stream, device });
        id
    }

    pub fn free(&mut self, id: u32) {
        self.events.push(Event::Free { id });
    }

    /// The highest sum of live requested bytes on one device: of the
    /// device where it is highest (one card's figure, never a sum over cards).
    pub fn peak_requested(&self) -> u64 {
        self.peak_requested_per_device().into_iter().max().unwrap_or(0)
    }

    /// The highest sum of live requested bytes on each device (index = device).
    pub fn peak_requested_per_device(&self) -> Vec<u64> {
        let mut sizes = vec![(0u64, 0u32); self.allocs as usize];
        let devices = self.devices.max(1) as usize;
        let (mut live, mut peak) = (vec![0u64; devices], vec![0u64; devices]);
        for event in &self.events {
            match *event {
                Event::Alloc { id, size, device, .. } => {
                    sizes[id as usize] = (size, device);
                    let d = device as usize;
                    live[d] += size;
                    peak[d] = peak[d].max(live[d]);
                }
                Event::Free { id } => {
                    let (size, device) = std::mem::take(&mut sizes[id as usize]);
                    live[device as usize] -= size;
                }
            }
        }
        peak
    }

    /// The devices with at least one allocation, in order (device 0 for an
    /// empty trace): those that get figures of their own.
    pub fn used_devices(&self) -> Vec<u32> {
        let mut used = vec![false; self.devices.max(1) as usize];
        for event in &self.events {
            if let Event::Alloc { device, .. } = *event {
                used[device as usize] = true;
            }
        }
        let devices: Vec<u32> = (0..used.len() as u32).filter(|&d| used[d as usize]).collect();
        if devices.is_empty() {
            vec![0]
        } else {
            devices
        }
    }

    /// Each device's part of the trace with the device's number, the unit
    /// replay and plan give figures for: the trace itself when it has one
    /// device, else `on_device` of every device that allocates.
    pub fn per_device(&self) -> Vec<(u32, std::borrow::Cow<'_, Trace>)> {
        if self.devices <= 1 {
            return vec![(0, std::borrow::Cow::Borrowed(self))];
        }
        self.used_devices().into_iter().map(|d| (d, std::borrow::Cow::Owned(self.on_device(d)))).collect()
    }

    /// This one-device trace with each request PyTorch recorded as failing
    /// (`pytorch_ooms`) put back where it was asked, allocated and freed at
    /// once: what the workload asked for includes it, though the recorded
    /// run could not serve it. Returns also, for each event of the result,
    /// its index in this trace (a put-back request: the index it would have
    /// had, `RecordedOom::event`).
    pub fn with_failed_requests(&self) -> (Trace, Vec<u64>) {
        let mut whole = self.clone();
        whole.events.clear();
        whole.marks.clear();
        whole.allocs = 0;
        let mut marks = self.marks.iter().peekable();
        let mut ooms: Vec<&RecordedOom> = self.pytorch_ooms.iter().filter(|oom| oom.device == 0).collect();
        ooms.sort_by_key(|oom| oom.event);
        let (mut ids, mut origin) = (vec![u32::MAX; self.allocs as usize], Vec::with_capacity(self.events.len()));
        let mut next_oom = ooms.into_iter().peekable();
        for index in 0..=self.events.len() {
            while let Some(mark) = marks.next_if(|m| m.event <= index) {
                whole.mark(mark.label.clone());
            }
            while let Some(oom) = next_oom.next_if(|oom| oom.event <= index) {
                let id = whole.alloc(oom.requested.max(1), oom.stream, 0);
                whole.free(id);
                origin.extend([index as u64; 2]);
            }
            match self.events.get(index) {
                Some(&Event::Alloc { id, size, stream, .. }) => ids[id as usize] = whole.alloc(size, stream, 0),
                Some(&Event::Free { id }) if ids[id as usize] != u32::MAX => whole.free(ids[id as usize]),
                Some(Event::Free { .. }) | None => continue,
            }
            origin.push(index as u64);
        }
        (whole, origin)
    }

    /// The part of the trace on `device`, as a one-device trace (device 0),
    /// with PyTorch's recorded peak of that device. Devices share nothing in
    /// an allocator, so replaying each alone gives each card's figures.
    pub fn on_device(&self, device: u32) -> Trace {
        let mut part = Trace::new(self.source.clone(), self.format);
        part.pytorch_conf = self.pytorch_conf.clone();
        part.pytorch_expandable_segments = self.pytorch_expandable_segments;
        // Their event counts are the device's own already.
        part.pytorch_ooms =
            self.pytorch_ooms.iter().filter(|oom| oom.device == device).map(|&oom| RecordedOom { device: 0, ..oom }).collect();
        part.warnings = self.warnings.clone();
        part.pytorch_peak_reserved = self.pytorch_peak_reserved_per_device.get(device as usize).copied();
        if self.devices <= 1 {
            part.pytorch_peak_reserved = self.pytorch_peak_reserved;
        }
        part.pytorch_peak_reserved_per_device = part.pytorch_peak_reserved.into_iter().collect();
        let mut ids = vec![u32::MAX; self.allocs as usize];
        let mut marks = self.marks.iter().peekable();
        for (index, event) in self.events.iter().enumerate() {
            while let Some(mark) = marks.next_if(|m| m.event <= index) {
                part.mark(mark.label.clone());
            }
            match *event {
                Event::Alloc { id, size, stream, device: d } if d == device => ids[id as usize] = part.alloc(size, stream, 0),
                Event::Alloc { .. } => {}
                Event::Free { id } => {
                    if ids[id as usize] != u32::MAX {
                        part.free(ids[id as usize]);
                    }
                }
            }
        }
        marks.for_each(|mark| part.mark(mark.label.clone()));
        part
    }
}

/// Why a trace file could not be read: the file, where, and what.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TraceError {
    pub file: String,
    /// "line 12", "byte 345", or empty.
    pub location: String,
    pub message: String,
}

impl fmt::Display for TraceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.location.is_empty() {
            write!(f, "{}: {}", self.file, self.message)
        } else {
            write!(f, "{}: {}: {}", self.file, self.location, self.message)
        }
    }
}

impl std::error::Error for TraceError {}

/// Reads a trace file, telling the format by its first bytes (a pickle
/// starts with the PROTO opcode 0x80; anything else is read as CSV).
pub fn load(path: &Path) -> Result<Trace, TraceError> {
    let name = path.display().to_string();
    let error = |message: String| TraceError { file: name.clone(), location: String::new(), message };
    let mut file = std::fs::File::open(path).map_err(|e| error(format!("cannot open: {e}")))?;
    let mut first = [0u8; 4];
    let n = file.read(&mut first).map_err(|e| error(format!("cannot read: {e}")))?;
    if n == 0 {
        return Err(error("the file is empty".into()));
    }
    // Two files people take for traces: say what they are.
    const SNAPSHOT: &str = "a PyTorch memory snapshot is the pickle torch.cuda.memory._dump_snapshot(path) writes";
    if first.starts_with(&[0x1f, 0x8b]) {
        return Err(error(format!("a gzip file, not a trace: gunzip it first ({SNAPSHOT}, or an RMM log's CSV)")));
    }
    if first.starts_with(b"PK\x03\x04") {
        return Err(error(format!("a zip archive (torch.save writes those), not a trace: {SNAPSHOT}")));
    }
    let file = std::fs::File::open(path).map_err(|e| error(format!("cannot open: {e}")))?;
    if first[0] == 0x80 {
        torch_snapshot::read(file, &name)
    } else {
        rmm_csv::read(file, &name)
    }
}
