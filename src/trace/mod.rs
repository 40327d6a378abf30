//! Allocation traces: what a workload asked of its allocator, in order, so
//! that it can be replayed against tidepool or a model of PyTorch's policy
//! on a machine without a GPU.
//!
//! Readers turn files into a `Trace`: RMM's logging CSV (`rmm_csv`) and
//! PyTorch's memory snapshots (`torch_snapshot`). `replay` runs a trace,
//! `plan` finds the smallest device it fits, `plot` draws it, `record`
//! writes the trace of a live process.
#![forbid(unsafe_code)]

pub mod plan;
pub mod plot;
pub mod record;
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
    /// PyTorch's own peak reserved bytes, when the file records segments.
    pub pytorch_peak_reserved: Option<u64>,
    /// PyTorch's allocator settings as recorded (snapshots only), in
    /// TIDEPOOL_CONF syntax: what the PyTorch model replays with.
    pub pytorch_conf: String,
    pub warnings: Warnings,
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
            pytorch_conf: String::new(),
            warnings: Warnings::default(),
        }
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

    /// The highest sum of live requested bytes over the trace.
    pub fn peak_requested(&self) -> u64 {
        let mut sizes = vec![0u64; self.allocs as usize];
        let (mut live, mut peak) = (0u64, 0u64);
        for event in &self.events {
            match *event {
                Event::Alloc { id, size, .. } => {
                    sizes[id as usize] = size;
                    live += size;
                    peak = peak.max(live);
                }
                Event::Free { id } => live -= std::mem::take(&mut sizes[id as usize]),
            }
        }
        peak
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
    let mut first = [0u8; 1];
    let n = file.read(&mut first).map_err(|e| error(format!("cannot read: {e}")))?;
    if n == 0 {
        return Err(error("the file is empty".into()));
    }
    let file = std::fs::File::open(path).map_err(|e| error(format!("cannot open: {e}")))?;
    if first[0] == 0x80 {
        torch_snapshot::read(file, &name)
    } else {
        rmm_csv::read(file, &name)
    }
}
