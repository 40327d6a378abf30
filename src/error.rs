//! Errors the allocator returns, and the out-of-memory report.
#![forbid(unsafe_code)]

use std::fmt;

use crate::backend::BackendError;

/// Why a request or a free failed. Every error leaves the allocator as it was.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub enum AllocError {
    /// The device could not hold the request even after the cache was released.
    OutOfMemory(Box<OomReport>),
    /// The size cannot be represented once rounded (near `u64::MAX`).
    TooLarge { size: u64 },
    /// No such device.
    InvalidDevice { device: i64, device_count: usize },
    /// A free of a pointer that is not a live allocation.
    InvalidFree { ptr: u64, reason: InvalidFree },
    /// A pointer that is not a live allocation, given where one is needed.
    UnknownPointer { ptr: u64 },
    /// An argument out of its range, or a call out of order.
    InvalidArgument(InvalidArgument),
    /// The allocator belongs to the parent of this forked process.
    Forked { parent: u32 },
    /// The backend failed for a reason other than lack of memory.
    Backend(BackendError),
    /// A tag in the wrong state for the call (paused, not paused, unknown),
    /// or a pause refused now.
    Tag(TagError),
    /// Host memory for an offload could not be had; nothing was released.
    HostOutOfMemory { bytes: u64 },
}

/// What was wrong with an argument.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub enum InvalidArgument {
    /// The file `host_shared` names could not be opened.
    HostShared { path: std::path::PathBuf, error: String },
    /// A memory fraction outside [0, 1].
    MemoryFraction(f64),
    /// Context 0, which means none, given to be registered.
    ContextZero,
    /// An empty tag name.
    EmptyTag,
    /// A tag name longer than `max` bytes (`start`: its first characters).
    TagTooLong { start: String, len: usize, max: usize },
    /// A tag name holding a NUL byte.
    TagWithNul { tag: String },
    /// A new tag name when the process already has `max` ("default" included).
    TooManyTags { tag: String, max: usize },
    /// Tags map pages into reserved ranges; the backend cannot.
    TagsNeedVirtualMemory { backend: &'static str },
    /// A buffer of more bytes than the address space has.
    BufferTooLarge { len: usize, element: &'static str, element_size: usize },
    /// A copy of more elements than the buffer holds.
    CopyTooLarge { elements: usize, len: usize },
    /// A private pool (its id's two words) named out of order.
    PrivatePool { id: (u64, u64), misuse: PrivatePoolMisuse },
}

/// How a private pool was named out of order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum PrivatePoolMisuse {
    /// Ended while not open.
    NotOpen,
    /// Released more often than begun.
    NeverBegun,
    /// Released for the last time while still open.
    ReleasedWhileOpen,
}

impl fmt::Display for InvalidArgument {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            InvalidArgument::HostShared { path, error } => write!(f, "host_shared: cannot open {}: {error}", path.display()),
            InvalidArgument::MemoryFraction(fraction) => write!(f, "memory fraction must be between 0 and 1, got {fraction}"),
            InvalidArgument::ContextZero => f.write_str("context 0 means none and cannot be registered"),
            InvalidArgument::EmptyTag => f.write_str("a tag cannot be empty (use \"default\", or NULL in C)"),
            InvalidArgument::TagTooLong { start, len, max } => write!(f, "tag {start:?}... is {len} bytes long; a tag has at most {max}"),
            InvalidArgument::TagWithNul { tag } => write!(f, "tag {tag:?} contains a NUL byte"),
            InvalidArgument::TooManyTags { tag, max } => write!(
                f,
                "tag {tag:?} would be a new name past the {max} a process may use (\"default\" included): a tag names \
                 a kind of memory to pause and resume together (weights, KV cache), and each name keeps its pools \
                 for the life of the process"
            ),
            InvalidArgument::TagsNeedVirtualMemory { backend } => {
                write!(f, "tags need virtual memory (reserved ranges mapped page by page); the {backend} backend has none")
            }
            InvalidArgument::BufferTooLarge { len, element, element_size } => {
                write!(f, "a buffer of {len} elements of {element} ({element_size} bytes each) is larger than the address space")
            }
            InvalidArgument::CopyTooLarge { elements, len } => write!(f, "a copy of {elements} elements does not fit a buffer of {len}"),
            InvalidArgument::PrivatePool { id: (a, b), misuse } => {
                let what = match misuse {
                    PrivatePoolMisuse::NotOpen => "is not open",
                    PrivatePoolMisuse::NeverBegun => "was never begun, or was released as often",
                    PrivatePoolMisuse::ReleasedWhileOpen => "is released while still open",
                };
                write!(f, "private pool PrivatePoolId({a}, {b}) {what}")
            }
        }
    }
}

/// A tag in the wrong state for a call; nothing changed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TagError {
    pub tag: String,
    pub state: TagState,
}

/// Why a call refused a tag.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum TagState {
    /// No thread of this process ever set it.
    Unknown,
    /// Paused: nothing is allocated under it until it is resumed.
    Paused,
    /// Paused already.
    AlreadyPaused,
    /// Resumed, or never paused.
    NotPaused,
    /// "default", which cannot be paused.
    Default,
    /// A private pool is open (a CUDA graph capture may be underway).
    PrivatePoolOpen { resuming: bool },
    /// A stream that used it is being captured into a CUDA graph.
    StreamCapturing { stream: u64 },
    /// The work of another stream on a block freed from it could not be waited for.
    WorkNotWaited,
}

impl fmt::Display for TagError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "tag {:?} ", self.tag)?;
        match self.state {
            TagState::Unknown => f.write_str("is unknown: no thread of this process ever set it"),
            TagState::Paused => f.write_str("is paused: resume it before allocating under it"),
            TagState::AlreadyPaused => f.write_str("is already paused"),
            TagState::NotPaused => f.write_str("is not paused"),
            TagState::Default => f.write_str("cannot be paused: pause a tag of your own (tidepool.region)"),
            TagState::PrivatePoolOpen { resuming } => write!(
                f,
                "cannot be {} while a private pool is open (a CUDA graph capture may be underway)",
                if resuming { "resumed" } else { "paused" }
            ),
            TagState::StreamCapturing { stream } => {
                write!(f, "cannot be paused while stream {stream:#x}, which used it, is being captured into a CUDA graph")
            }
            TagState::WorkNotWaited => {
                f.write_str("cannot be paused: the work of another stream on a block freed from it could not be waited for")
            }
        }
    }
}

/// What was wrong with a freed pointer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum InvalidFree {
    /// Not inside any segment tidepool holds on that device.
    Foreign,
    /// At the start of a free block: freed twice, or never returned.
    NotLive,
    /// Inside a live block that starts at `block`, not at its start.
    Interior { block: u64 },
}

impl std::error::Error for TagError {}

/// Why expandable segments could not be switched on or off, or their page
/// set (`DeviceHeap::set_expandable`, `set_expandable_page`); nothing changed.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ExpandableError {
    /// Switched after the heap's first allocation.
    SwitchedAfterAllocation,
    /// The backend cannot map pages (an old driver, a backend without
    /// virtual memory): expandable segments stay off.
    NoVirtualMemory { backend: &'static str },
    /// A page set while expandable segments are off.
    Off,
    /// A page set after the heap's first allocation.
    PageAfterAllocation,
    /// A page that is not a multiple of the backend's (`backend_page`).
    PageNotMultiple { page: u64, backend_page: u64 },
    /// A page larger than a reserved range may be (`max` bytes).
    PageTooLarge { page: u64, max: u64 },
}

impl fmt::Display for ExpandableError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ExpandableError::SwitchedAfterAllocation => f.write_str("expandable segments can only be switched before the first allocation"),
            ExpandableError::NoVirtualMemory { backend } => {
                write!(f, "the {backend} backend cannot map pages; expandable segments stay off")
            }
            ExpandableError::Off => f.write_str("expandable segments are off"),
            ExpandableError::PageAfterAllocation => {
                f.write_str("the page of expandable segments can only be set before the first allocation")
            }
            ExpandableError::PageNotMultiple { page, backend_page } => {
                write!(f, "an expandable page of {page} bytes is not a multiple of the backend's {backend_page}")
            }
            ExpandableError::PageTooLarge { page, max } => {
                write!(f, "an expandable page of {page} bytes is larger than a range ({max} bytes at most)")
            }
        }
    }
}

impl std::error::Error for ExpandableError {}

impl fmt::Display for AllocError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AllocError::OutOfMemory(report) => report.fmt(f),
            AllocError::TooLarge { size } => write!(f, "tidepool: a request of {size} bytes is too large to represent"),
            AllocError::InvalidDevice { device, device_count } => match device_count {
                0 => write!(f, "tidepool: no device {device}; this process has none"),
                1 => write!(f, "tidepool: no device {device}; this process has one, device 0"),
                n => write!(f, "tidepool: no device {device}; this process has {n}, devices 0 to {}", n - 1),
            },
            AllocError::InvalidFree { ptr, reason } => match reason {
                InvalidFree::Foreign => write!(f, "tidepool: free of {ptr:#x}, which tidepool never allocated"),
                InvalidFree::NotLive => {
                    write!(f, "tidepool: free of {ptr:#x}, which is not allocated (double free?)")
                }
                InvalidFree::Interior { block } => {
                    write!(f, "tidepool: free of {ptr:#x}, which points inside the allocation at {block:#x}, not at its start")
                }
            },
            AllocError::UnknownPointer { ptr } => write!(f, "tidepool: {ptr:#x} is not a live allocation"),
            AllocError::InvalidArgument(why) => write!(f, "tidepool: {why}"),
            AllocError::Forked { parent } => write!(
                f,
                "tidepool: this allocator belongs to process {parent}, which forked this one; \
                 a forked child creates an allocator of its own (the C ABI does so by itself)"
            ),
            AllocError::Backend(err) => write!(f, "tidepool: {err}"),
            AllocError::Tag(err) => write!(f, "tidepool: {err}"),
            AllocError::HostOutOfMemory { bytes } => write!(
                f,
                "tidepool: cannot offload: {} of host memory could not be had; the tag was not paused and nothing was released",
                human_bytes(*bytes)
            ),
        }
    }
}

impl std::error::Error for AllocError {
    /// The error of the layer below, where one is wrapped: the backend's, or
    /// the tag's refusal.
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            AllocError::Backend(err) => Some(err),
            AllocError::Tag(err) => Some(err),
            AllocError::OutOfMemory(_)
            | AllocError::TooLarge { .. }
            | AllocError::InvalidDevice { .. }
            | AllocError::InvalidFree { .. }
            | AllocError::UnknownPointer { .. }
            | AllocError::InvalidArgument(_)
            | AllocError::Forked { .. }
            | AllocError::HostOutOfMemory { .. } => None,
        }
    }
}

/// What a person needs to act on an out-of-memory: what was asked, what is
/// held, and whether fragmentation is to blame.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct OomReport {
    pub device: usize,
    /// Bytes asked for.
    pub requested: u64,
    /// Bytes in live blocks.
    pub allocated: u64,
    /// Bytes held from the driver.
    pub reserved: u64,
    /// Reserved but free: cache that could not serve the request.
    pub cached_free: u64,
    pub largest_free_block: u64,
    /// Of `cached_free`, the bytes inside partly used segments: they can
    /// neither go back to the driver nor serve a request larger than their hole.
    pub inactive_split: u64,
    /// `inactive_split / reserved` ([`crate::stats::Stats::fragmentation`]).
    pub fragmentation: f64,
    /// The device's free and total bytes, when the backend could tell.
    pub device_free: Option<u64>,
    pub device_total: Option<u64>,
    /// The cap on reserved bytes (`set_memory_fraction`, or the budget
    /// `max_reserved_mb`, the lower), when there is one.
    pub reserved_limit: Option<u64>,
    /// Whether that cap is the budget (`max_reserved_mb`) rather than the
    /// memory fraction.
    pub limit_is_budget: bool,
    /// Whether the heap grows by expandable segments (then every free page
    /// was already given back before the request failed).
    pub expandable: bool,
    /// Whether a private pool was open (a CUDA graph capture may have been
    /// underway), so no cached memory could be given back.
    pub capturing: bool,
    /// The memory other processes on the device would have to give back
    /// for the request to succeed; 0 when that could not help (past the
    /// reserve cap). What cooperation asks them for.
    pub need_from_others: u64,
}

/// Bytes as a person reads them: "1.50 GiB", "512 B".
pub fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["KiB", "MiB", "GiB", "TiB", "PiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let mut value = bytes as f64 / 1024.0;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.2} {}", UNITS[unit])
}

impl fmt::Display for OomReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "tidepool: out of memory on device {}: tried to allocate {}; {} allocated, {} reserved, \
             of which {} cached free (largest free block {}; fragmentation {:.1} %: {} free inside \
             partly used segments)",
            self.device,
            human_bytes(self.requested),
            human_bytes(self.allocated),
            human_bytes(self.reserved),
            human_bytes(self.cached_free),
            human_bytes(self.largest_free_block),
            self.fragmentation * 100.0,
            human_bytes(self.inactive_split),
        )?;
        if let (Some(free), Some(total)) = (self.device_free, self.device_total) {
            write!(f, "; the device has {} free of {}", human_bytes(free), human_bytes(total))?;
        }
        let limit_name = if self.limit_is_budget { "max_reserved_mb" } else { "memory fraction" };
        if let Some(limit) = self.reserved_limit {
            write!(f, "; tidepool may reserve at most {} on it ({limit_name})", human_bytes(limit))?;
        }
        write!(f, ". ")?;
        if self.capturing && self.cached_free > 0 {
            write!(
                f,
                "A CUDA graph capture (or use_mem_pool) was underway, and during one no cached memory can go \
                 back to the device: call torch.cuda.empty_cache() before capturing, or capture a smaller batch."
            )
        } else if self.reserved_limit.is_some_and(|limit| self.allocated.saturating_add(self.requested) > limit) {
            if self.limit_is_budget {
                write!(f, "The budget is the limit: raise max_reserved_mb in TIDEPOOL_CONF or reduce the batch size.")
            } else {
                write!(
                    f,
                    "The memory fraction is the limit: raise it (torch.cuda.set_per_process_memory_fraction) \
                     or reduce the batch size."
                )
            }
        } else if self.cached_free >= self.requested && !self.expandable {
            write!(
                f,
                "The cache holds enough free memory but in pieces too small: leave expandable segments \
                 on (TIDEPOOL_CONF=expandable:true, the default: free pages of holes go back to the device) or \
                 set max_split_size_mb:<MB> so large blocks are not split, or reduce the batch size."
            )
        } else if self.expandable {
            // Every page inside a free block went back before this failed.
            write!(
                f,
                "Live memory (and the pages it shares with free pieces) needs more than the device has: \
                 reduce the batch size, use mixed precision or gradient checkpointing."
            )
        } else {
            write!(
                f,
                "Live memory needs more than the device has: reduce the batch size, use mixed precision \
                 or gradient checkpointing; if fragmentation is high, leave expandable segments on \
                 (TIDEPOOL_CONF=expandable:true, the default)."
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_device_is_named_with_the_devices_there_are() {
        let message = |device_count| AllocError::InvalidDevice { device: 5, device_count }.to_string();
        assert_eq!(message(0), "tidepool: no device 5; this process has none");
        assert_eq!(message(1), "tidepool: no device 5; this process has one, device 0");
        assert_eq!(message(4), "tidepool: no device 5; this process has 4, devices 0 to 3");
    }

    #[test]
    fn bytes_read_as_a_person_would() {
        assert_eq!(human_bytes(512), "512 B");
        assert_eq!(human_bytes(1536), "1.50 KiB");
        assert_eq!(human_bytes(3 << 30), "3.00 GiB");
        assert_eq!(human_bytes(u64::MAX), "16384.00 PiB");
    }

    #[test]
    fn the_report_names_the_figures_and_the_advice() {
        let report = OomReport {
            device: 1,
            requested: 2 << 30,
            allocated: 10 << 30,
            reserved: 13 << 30,
            cached_free: 3 << 30,
            largest_free_block: 1 << 30,
            inactive_split: 2 << 30,
            fragmentation: 2.0 / 13.0,
            device_free: Some(0),
            device_total: Some(16 << 30),
            reserved_limit: Some(14 << 30),
            limit_is_budget: false,
            expandable: false,
            capturing: false,
            need_from_others: 2 << 30,
        };
        let text = AllocError::OutOfMemory(Box::new(report.clone())).to_string();
        for needle in [
            "device 1",
            "2.00 GiB",
            "10.00 GiB allocated",
            "13.00 GiB reserved",
            "3.00 GiB cached free",
            "largest free block 1.00 GiB",
            "fragmentation 15.4 %: 2.00 GiB free inside partly used segments",
            "expandable:true",
            "max_split_size_mb",
            "batch size",
            "of 16.00 GiB",
            "at most 14.00 GiB",
        ] {
            assert!(text.contains(needle), "{needle:?} missing from {text}");
        }
        // With expandable segments on, it does not advise turning them on.
        let text = AllocError::OutOfMemory(Box::new(OomReport { expandable: true, ..report.clone() })).to_string();
        assert!(!text.contains("expandable:true") && text.contains("batch size"), "{text}");
        // During a capture, the cache could not be released: it says so, and what to do.
        let text = AllocError::OutOfMemory(Box::new(OomReport { capturing: true, ..report.clone() })).to_string();
        assert!(text.contains("CUDA graph capture") && text.contains("empty_cache() before capturing"), "{text}");
        // A cap that live memory alone overruns is named: the memory fraction, or the budget.
        let capped = OomReport { reserved_limit: Some(11 << 30), ..report };
        let text = AllocError::OutOfMemory(Box::new(capped.clone())).to_string();
        assert!(text.contains("(memory fraction)") && text.contains("set_per_process_memory_fraction"), "{text}");
        let text = AllocError::OutOfMemory(Box::new(OomReport { limit_is_budget: true, ..capped })).to_string();
        assert!(text.contains("(max_reserved_mb)") && text.contains("raise max_reserved_mb"), "{text}");
        assert!(!text.contains("memory fraction"), "{text}");
    }
}
