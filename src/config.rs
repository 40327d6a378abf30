//! Configuration: one table of options, read once from `TIDEPOOL_CONF`.
//!
//! The syntax is PyTorch's `PYTORCH_CUDA_ALLOC_CONF`:
//! `TIDEPOOL_CONF="max_split_size_mb:256,roundup_power2_divisions:4"`.
//! An unknown key or a bad value is reported as a warning and the default
//! is kept: this library lives inside other people's processes and must
//! never abort them over a typo. The builder, for programs, is strict.
#![forbid(unsafe_code)]

use std::fmt;

use crate::size_class::SizeRules;

/// Which driver the allocator gets segments from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendKind {
    /// Host memory standing in for devices (tests, benchmarks, trace replay).
    Host,
    /// The CUDA driver: `cuMemAlloc` / `cuMemFree`.
    Cuda,
    /// The CUDA driver's stream-ordered allocator: `cuMemAllocFromPoolAsync`
    /// / `cuMemFreeAsync` + `cuMemPoolTrimTo`.
    CudaAsync,
}

/// Everything that can be configured.
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    pub backend: BackendKind,
    /// Number of simulated devices of the host backend.
    pub host_devices: usize,
    /// Capacity of each simulated device, in bytes.
    pub host_capacity: u64,
    /// Rounding, segment sizes and splitting.
    pub rules: SizeRules,
    /// Keep each pool's last freed block unmerged for an immediate request
    /// of its size (the cached pair's fast path).
    pub stash: bool,
    /// Blocks each thread keeps of its own frees, per device, to serve its
    /// next requests of their sizes without the device's lock (0: no
    /// thread caches; `thread_cache.rs`). Kept only with one stream shard.
    pub thread_cache_blocks: usize,
    /// The most bytes one thread's cache holds per device.
    pub thread_cache_bytes: u64,
    /// Record every allocation and free to this file (RMM CSV); from the
    /// TIDEPOOL_TRACE environment variable.
    pub trace_path: Option<std::path::PathBuf>,
    /// A whole free segment idle this long goes back to the driver (None: never).
    pub release_after_ms: Option<u64>,
    /// Release idle cache while the device has less free memory than this (0: off).
    pub headroom: u64,
    /// Reserve at most this much per device (None: no budget).
    pub max_reserved: Option<u64>,
    /// How often the reclaimer wakes.
    pub reclaim_interval_ms: u64,
    /// Processes sharing a device help each other (the registry).
    pub cooperative: bool,
    /// The longest a request waits for the other processes' answer before
    /// OOM (only when one shows cache to give back; less once all answered).
    pub oom_wait_ms: u64,
    /// Where the registries live (None: `registry::default_dir()`).
    pub registry_dir: Option<std::path::PathBuf>,
    /// Host backend: a file that makes every process naming it share the capacity.
    pub host_shared: Option<std::path::PathBuf>,
    /// Heaps per device, streams spread over them (1: one heap, exact peaks).
    pub stream_shards: usize,
    /// When the device is full, serve a stream from blocks cached for another.
    pub lend_across_streams: bool,
    /// Grow the large pool inside one reserved range of address space,
    /// holding memory page by page (see `heap/expandable.rs`).
    pub expandable: bool,
    /// With expandable segments, map physical memory this many bytes at a
    /// time (a multiple of the backend's page; None: the backend's page,
    /// 2 MiB on CUDA). Not an option of TIDEPOOL_CONF: the replay's model
    /// of PyTorch's expandable segments maps 20 MiB at a time.
    pub expandable_page: Option<u64>,
    /// With expandable segments, the most bytes of one physical allocation
    /// (`u64::MAX`: as many as one run of new pages needs;
    /// `heap/expandable.rs`). The replay's model of PyTorch's expandable
    /// segments makes one allocation per 20 MiB page.
    pub expandable_allocation: u64,
    /// With expandable segments and allocations larger than a page: a block
    /// carved from freed memory that ends inside a larger allocation no
    /// live block uses gives that allocation back and maps its own pages
    /// (`heap/expandable.rs`).
    pub expandable_split_allocations: bool,
    /// With expandable segments, move idle cached pages to where the heap
    /// grows before it grows past its high-water mark (`heap/recycle.rs`).
    /// Not an option of TIDEPOOL_CONF: off in the model of PyTorch.
    pub move_pages: bool,
    /// Keep this many of each device's last events for snapshots'
    /// `device_traces` from the start (0: off; see `heap/history.rs`).
    pub history_entries: usize,
    /// Write a snapshot here at the process's first out-of-memory of the
    /// C ABI's malloc (None: never).
    pub oom_snapshot: Option<std::path::PathBuf>,
}

impl Config {
    /// The release policy these options describe.
    pub fn policy(&self) -> crate::reclaim::policy::Policy {
        crate::reclaim::policy::Policy {
            release_after_ms: self.release_after_ms.unwrap_or(u64::MAX),
            headroom: self.headroom,
            // A segment a loop reuses every step stays: at least a second idle.
            headroom_min_idle_ms: 1_000,
            max_reserved: self.max_reserved.unwrap_or(u64::MAX),
        }
    }

    /// Whether a time-driven release policy is on (the reclaimer then runs;
    /// it also runs to cooperate with other processes on a shared device).
    pub fn reclaims(&self) -> bool {
        self.release_after_ms.is_some() || self.headroom > 0 || self.max_reserved.is_some()
    }
}

impl Default for Config {
    fn default() -> Self {
        Config {
            backend: BackendKind::Cuda,
            host_devices: 1,
            host_capacity: 16 << 30,
            rules: SizeRules::default(),
            stash: true,
            thread_cache_blocks: 16,
            thread_cache_bytes: 16 * MIB,
            trace_path: None,
            release_after_ms: Some(10_000),
            headroom: 256 << 20,
            max_reserved: None,
            reclaim_interval_ms: 100,
            cooperative: true,
            oom_wait_ms: 2000,
            registry_dir: None,
            host_shared: None,
            stream_shards: 1,
            lend_across_streams: true,
            expandable: true,
            expandable_page: None,
            expandable_allocation: DEFAULT_EXPANDABLE_ALLOCATION,
            expandable_split_allocations: false,
            move_pages: true,
            history_entries: 0,
            oom_snapshot: None,
        }
    }
}

/// One option: its key, its default as text, what it means, how it applies.
pub struct OptionSpec {
    pub key: &'static str,
    pub default: &'static str,
    pub help: &'static str,
    apply: fn(&mut Config, &str) -> Result<(), String>,
    /// The option's value in a configuration, written as TIDEPOOL_CONF takes it.
    pub show: fn(&Config) -> String,
}

const MIB: u64 = 1 << 20;

fn number(value: &str) -> Result<u64, String> {
    value.trim().parse::<u64>().map_err(|_| format!("expected a non-negative integer, got {value:?}"))
}

/// `true` or `on`, `false` or `off`, in any case (PyTorch's settings
/// write `True`): the one set of spellings every flag takes.
fn boolean(value: &str) -> Result<bool, String> {
    match value.trim() {
        v if v.eq_ignore_ascii_case("true") || v.eq_ignore_ascii_case("on") => Ok(true),
        v if v.eq_ignore_ascii_case("false") || v.eq_ignore_ascii_case("off") => Ok(false),
        other => Err(format!("expected true or false (on or off), got {other:?}")),
    }
}

/// Whether `value` is the word `word`, in any case. The words of "no
/// value" (`off`, `none`) mean the same wherever one is taken; `unlimited`
/// and `auto` are each their option's own.
fn is_word(value: &str, word: &str) -> bool {
    let value = value.trim();
    let no_value = |w: &str| w.eq_ignore_ascii_case("off") || w.eq_ignore_ascii_case("none");
    value.eq_ignore_ascii_case(word) || (no_value(word) && no_value(value))
}

fn scaled(value: &str, unit: u64) -> Result<u64, String> {
    number(value)?.checked_mul(unit).ok_or_else(|| format!("{value} is too large"))
}

// Row constructors: each option's row in one line, by the shape of its value.

/// `true` or `false`.
macro_rules! flag {
    ($key:literal, $default:literal, $help:literal, $($field:ident).+) => {
        OptionSpec {
            key: $key,
            default: $default,
            help: $help,
            apply: |c, v| Ok(c.$($field).+ = boolean(v)?),
            show: |c| c.$($field).+.to_string(),
        }
    };
}

/// An integer within a range, stored as `$ty`.
macro_rules! bounded {
    ($key:literal, $default:literal, $help:literal, $($field:ident).+: $ty:ty, $lo:literal..=$hi:literal) => {
        OptionSpec {
            key: $key,
            default: $default,
            help: $help,
            apply: |c, v| match number(v)? {
                n @ $lo..=$hi => Ok(c.$($field).+ = n as $ty),
                n => Err(format!("must be between {} and {}, got {n}", $lo, $hi)),
            },
            show: |c| c.$($field).+.to_string(),
        }
    };
}

/// A size written in units of `$unit` bytes (KiB, MiB) and stored in
/// bytes; with `at least $min`, smaller values are refused.
macro_rules! size {
    ($key:literal, $default:literal, $help:literal, $($field:ident).+, $unit:expr) => {
        size!($key, $default, $help, $($field).+, $unit, at least 0)
    };
    ($key:literal, $default:literal, $help:literal, $($field:ident).+, $unit:expr, at least $min:literal) => {
        OptionSpec {
            key: $key,
            default: $default,
            help: $help,
            apply: |c, v| Ok(c.$($field).+ = at_least(scaled(v, $unit)?, $min, $unit)?),
            show: |c| (c.$($field).+ / $unit).to_string(),
        }
    };
}

/// `bytes`, unless it is below `min` units of `unit` bytes.
fn at_least(bytes: u64, min: u64, unit: u64) -> Result<u64, String> {
    if bytes < min * unit {
        return Err(format!("must be at least {min}, got {}", bytes / unit));
    }
    Ok(bytes)
}

/// A value or the word `$none` for none: `$parse` reads the value, `$show`
/// writes it.
macro_rules! optional {
    ($key:literal, $default:literal, $help:literal, $($field:ident).+ or $none:literal, $parse:expr, $show:expr) => {
        OptionSpec {
            key: $key,
            default: $default,
            help: $help,
            apply: |c, v| Ok(c.$($field).+ = if is_word(v, $none) { None } else { Some($parse(v)?) }),
            show: |c| c.$($field).+.as_ref().map_or($none.into(), $show),
        }
    };
}

/// A path: not empty (an empty one would name nothing, and fail at the
/// first use instead of here).
fn path(value: &str) -> Result<std::path::PathBuf, String> {
    match value.trim() {
        "" => Err("expected a path, got nothing".into()),
        path => Ok(path.into()),
    }
}

fn show_path(path: &impl AsRef<std::path::Path>) -> String {
    path.as_ref().display().to_string()
}

/// With expandable segments, the most bytes one physical allocation holds
/// unless configured (`expandable_allocation_mb`): over the 32 traces of
/// docs/benchmarks.md, the warm-up makes 2.90 times the driver calls of
/// PyTorch's expandable segments (geometric mean; 7.35 times page by page,
/// 2.01 at 20 MiB) and the smallest device holds 1.0143x the peak of live
/// bytes (1.0107x page by page, 1.0189x at 20 MiB; PyTorch's expandable
/// segments 1.0306x): docs/expandable-segments.md.
pub const DEFAULT_EXPANDABLE_ALLOCATION: u64 = 8 * MIB;

/// The options table; `tidepool config --markdown` writes docs/configuration.md from it.
pub static OPTIONS: &[OptionSpec] = &[
    OptionSpec {
        key: "backend",
        default: "cuda",
        help: "where segments come from: cuda (cuMemAlloc), cuda_async (cuMemAllocAsync pools), host (host memory standing in for a GPU)",
        apply: |c, v| {
            c.backend = match v.trim() {
                "host" => BackendKind::Host,
                "cuda" => BackendKind::Cuda,
                "cuda_async" => BackendKind::CudaAsync,
                other => return Err(format!("unknown backend {other:?}; known: host, cuda, cuda_async")),
            };
            Ok(())
        },
        show: |c| match c.backend {
            BackendKind::Host => "host".into(),
            BackendKind::Cuda => "cuda".into(),
            BackendKind::CudaAsync => "cuda_async".into(),
        },
    },
    bounded!("host_devices", "1", "number of devices the host backend simulates", host_devices: usize, 1..=64),
    size!("host_capacity_mb", "16384", "memory of each simulated device, in MiB (address space only: untouched memory costs nothing)", host_capacity, MIB, at least 1),
    bounded!("stream_shards", "1", "heaps per device, streams spread over them: threads on different streams stop contending (1 to 64; above 1, peaks are summed over heaps)", stream_shards: usize, 1..=64),
    flag!("lend_across_streams", "true", "when the device is full, serve a stream from blocks cached for another (after a device-side wait on that stream)", lend_across_streams),
    flag!("expandable", "true", "grow the large pool inside one reserved range of address space, mapping pages as blocks need them and unmapping pages inside free blocks when memory is released or moving them where a growth needs them when the device or the cap is full (cuda and host backends; cuda_async keeps its driver pool's segments; false: whole segments, as PyTorch's default)", expandable),
    OptionSpec {
        key: "expandable_allocation_mb",
        default: "8",
        help: "with expandable: the most one physical allocation of new pages holds, in MiB (at least 1; unlimited: one per run of pages a block needs); the driver takes memory back, or moves it, only by whole allocations, so smaller ones hold less on a full device and larger ones make fewer driver calls while the heap grows (2, a page each: 3.2 times the calls of 8 while growing, the smallest device 0.4 % smaller over the traces of docs/benchmarks.md)",
        apply: |c, v| {
            c.expandable_allocation = if is_word(v, "unlimited") { u64::MAX } else { at_least(scaled(v, MIB)?, 1, MIB)? };
            Ok(())
        },
        show: |c| match c.expandable_allocation {
            u64::MAX => "unlimited".into(),
            bytes => (bytes / MIB).to_string(),
        },
    },
    flag!("expandable_split_allocations", "false", "with expandable and allocations larger than a page (expandable_allocation_mb): a block carved from freed memory that ends inside a larger physical allocation no live block uses gives that allocation back, once its stream's queued work has run, and maps its own pages; large allocations then hold no memory a smaller block does not use (unlimited allocations with it: the smallest device of page by page for a quarter of its driver calls while growing, but it splits again at every step: not for a repeated training step)", expandable_split_allocations),
    flag!("stash", "true", "keep each pool's last freed block unmerged until the next request, which takes it back if it is the same size; only a block where best fit would put that request, so it never changes placement", stash),
    bounded!("thread_cache_blocks", "16", "blocks each thread keeps of its own frees, per device, for its next requests of the same size and stream, served without the device's lock; every statistic stays exact (0: off; kept only with stream_shards:1; blocks of expandable segments, the large pool by default, are not kept)", thread_cache_blocks: usize, 0..=64),
    size!("thread_cache_mb", "16", "the most one thread's cache holds per device, in MiB", thread_cache_bytes, MIB),
    optional!("release_after_ms", "10000", "a whole free segment idle this long goes back to the driver; reuse restarts the wait (off: never)", release_after_ms or "off", number, |ms| ms.to_string()),
    size!("headroom_mb", "256", "while the device (every process counted) has less free memory than this, idle cache goes back, longest idle first (0: off)", headroom, MIB),
    optional!("max_reserved_mb", "unlimited", "reserve at most this much per device: cache goes first, and only live memory beyond it fails", max_reserved or "unlimited", |v| at_least(scaled(v, MIB)?, 1, MIB), |bytes| (bytes / MIB).to_string()),
    bounded!("reclaim_interval_ms", "100", "how often the background reclaimer wakes (10 to 60000)", reclaim_interval_ms: u64, 10..=60_000),
    flag!("cooperative", "true", "processes on one device help each other: one about to fail asks, the others give back idle cache", cooperative),
    bounded!("oom_wait_ms", "2000", "the longest a request waits for the other processes' answer before out of memory (only when one of them shows cache it could give back; it stops as soon as all have answered)", oom_wait_ms: u64, 0..=600_000),
    bounded!("history_entries", "0", "keep each device's last this many allocation and segment events, written into snapshots as device_traces (memory_viz's timeline) (0: off)", history_entries: usize, 0..=1_000_000_000),
    optional!("oom_snapshot", "none", "at the process's first out-of-memory (C ABI), write a PyTorch-schema snapshot (pickle, with device_traces when history is on) to this path (none: off)", oom_snapshot or "none", path, show_path),
    optional!("registry_dir", "auto", "directory of the registries of processes sharing a device (auto: $XDG_RUNTIME_DIR/tidepool or /tmp/tidepool-<uid>)", registry_dir or "auto", path, show_path),
    optional!("host_shared", "none", "host backend: a file whose name makes processes share one capacity, as on one GPU (what a process holds is given back when it ends, killed or not)", host_shared or "none", path, show_path),
    OptionSpec {
        key: "max_split_size_mb",
        default: "unlimited",
        help: "blocks at least this large are never split and only serve requests within 20 MiB of their size (above 20 and above large_segment_mb and small_segment_mb; whole segments only: expandable segments split any block)",
        apply: |c, v| {
            if is_word(v, "unlimited") {
                c.rules.max_split_size = u64::MAX;
                return Ok(());
            }
            let mb = number(v)?;
            if mb <= 20 {
                return Err(format!("must be above 20 (MiB), got {mb}"));
            }
            c.rules.max_split_size = scaled(v, MIB)?;
            Ok(())
        },
        show: |c| match c.rules.max_split_size {
            u64::MAX => "unlimited".into(),
            bytes => (bytes / MIB).to_string(),
        },
    },
    OptionSpec {
        key: "roundup_power2_divisions",
        default: "0",
        help: "round requests up to one of this many steps per power of two (a power of two; 0: off)",
        apply: |c, v| {
            let n = number(v)?;
            if n > 1 && !n.is_power_of_two() {
                return Err(format!("must be a power of two, got {n}"));
            }
            c.rules.roundup_power2_divisions = n;
            Ok(())
        },
        show: |c| c.rules.roundup_power2_divisions.to_string(),
    },
    size!("min_block_bytes", "512", "granularity of every block (a power of two, at least 256)", rules.min_block, 1),
    size!("small_size_kb", "1024", "requests up to this size (KiB) are served from the small pool", rules.small_size, 1024),
    size!("small_segment_mb", "2", "segment size (MiB) that grows the small pool", rules.small_segment, MIB),
    size!("min_large_alloc_mb", "10", "large requests below this size (MiB) share large_segment_mb segments; larger ones get their own", rules.min_large_alloc, MIB),
    size!("large_segment_mb", "20", "segment size (MiB) for large requests below min_large_alloc_mb", rules.large_segment, MIB),
    size!("large_round_mb", "2", "a request of min_large_alloc_mb or more gets a segment rounded up to this (MiB)", rules.large_round, MIB),
];

/// A rejected configuration entry (the strict builder's error; from
/// TIDEPOOL_CONF, a warning).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ConfigError {
    /// A key that is no option (nor PyTorch's name for one).
    UnknownOption { key: String },
    /// A value the option refuses, with the option's reason.
    BadValue { key: String, why: String },
    /// An entry with no `:` between key and value.
    NotKeyValue { entry: String },
    /// Size options that contradict each other (`SizeRules::check`).
    SizeRules(String),
    /// No device for the host backend to simulate.
    NoHostDevices,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ConfigError::UnknownOption { key } => write!(f, "unknown option {key:?}; run `tidepool config` for the list"),
            ConfigError::BadValue { key, why } => write!(f, "{key}: {why}"),
            ConfigError::NotKeyValue { entry } => write!(f, "{entry:?}: expected key:value"),
            ConfigError::SizeRules(why) => f.write_str(why),
            ConfigError::NoHostDevices => f.write_str("host_devices must be at least 1"),
        }
    }
}

impl std::error::Error for ConfigError {}

impl Config {
    /// Parses `key:value,key:value`. Returns the configuration and one
    /// warning per entry that was ignored; ignored entries keep defaults.
    pub fn parse(text: &str) -> (Config, Vec<String>) {
        Config::parse_bytes(text.as_bytes())
    }

    /// `parse` of bytes that may not be UTF-8 (an environment variable): an
    /// entry that is not is ignored with a warning naming it, as any bad
    /// entry is, and the others are kept.
    pub fn parse_bytes(text: &[u8]) -> (Config, Vec<String>) {
        let mut config = Config::default();
        let mut warnings = Vec::new();
        // Each option's entries, in order: one given twice is named once.
        let mut given: Vec<(&'static str, Vec<String>)> = Vec::new();
        for raw in text.split(|&byte| byte == b',') {
            let Ok(entry) = std::str::from_utf8(raw) else {
                warnings.push(format!("ignoring {:?}: not UTF-8", String::from_utf8_lossy(raw).trim()));
                continue;
            };
            let entry = entry.trim();
            if entry.is_empty() {
                continue;
            }
            let Some((key, value)) = entry.split_once(':') else {
                warnings.push(format!("ignoring {entry:?}: expected key:value"));
                continue;
            };
            let mut trial = config.clone();
            match apply(&mut trial, key.trim(), value) {
                Ok(spec) => {
                    config = trial;
                    match given.iter_mut().find(|(key, _)| *key == spec.key) {
                        Some((_, values)) => values.push(value.trim().into()),
                        None => given.push((spec.key, vec![value.trim().into()])),
                    }
                }
                Err(err) => warnings.push(format!("ignoring {entry:?}: {err}")),
            }
        }
        for (key, values) in given.iter().filter(|(_, values)| values.len() > 1) {
            let (last, earlier) = values.split_last().expect("two or more");
            warnings.push(format!("{key} is given {} times: the last, {last:?}, is used ({earlier:?} not)", values.len()));
        }
        if let Err(msg) = config.rules.check() {
            warnings.push(format!("ignoring the size options: {msg}; using the defaults"));
            // Splitting and rounding options are checked on their own and
            // kept, max_split_size_mb while the default segments allow it.
            let rounding = SizeRules { roundup_power2_divisions: config.rules.roundup_power2_divisions, ..SizeRules::default() };
            let splitting = SizeRules { max_split_size: config.rules.max_split_size, ..rounding };
            config.rules = if splitting.check().is_ok() { splitting } else { rounding };
        }
        (config, warnings)
    }

    /// The configuration from `TIDEPOOL_CONF` (defaults when unset) and
    /// `TIDEPOOL_TRACE`, with its warnings printed to stderr: each once in
    /// the process, however often the environment is read.
    pub fn from_env() -> Config {
        let (mut config, warnings) = Config::from_env_with_warnings();
        crate::log::warn_once("TIDEPOOL_CONF", &warnings);
        config.trace_path = std::env::var_os("TIDEPOOL_TRACE").filter(|p| !p.is_empty()).map(Into::into);
        config
    }

    /// The configuration `TIDEPOOL_CONF` gives, and what was wrong with it
    /// (not printed): for callers that refuse a bad configuration.
    pub fn from_env_with_warnings() -> (Config, Vec<String>) {
        let text = std::env::var_os("TIDEPOOL_CONF").unwrap_or_default();
        Config::parse_bytes(text.as_encoded_bytes())
    }

    /// A strict builder starting from the defaults.
    pub fn builder() -> ConfigBuilder {
        ConfigBuilder { config: Config::default() }
    }
}

/// PyTorch's names (PYTORCH_CUDA_ALLOC_CONF) for options tidepool calls
/// otherwise.
const PYTORCH_NAMES: &[(&str, &str)] = &[("expandable_segments", "expandable")];

/// Sets the option `key` (or PyTorch's name for it) to `value`; its row.
fn apply(config: &mut Config, key: &str, value: &str) -> Result<&'static OptionSpec, ConfigError> {
    let key = PYTORCH_NAMES.iter().find(|(pytorch, _)| *pytorch == key).map_or(key, |(_, ours)| ours);
    let spec = OPTIONS.iter().find(|o| o.key == key).ok_or_else(|| ConfigError::UnknownOption { key: key.into() })?;
    (spec.apply)(config, value).map_err(|why| ConfigError::BadValue { key: key.into(), why })?;
    Ok(spec)
}

/// Builds a configuration in code; every bad value is an error.
#[derive(Clone, Debug)]
pub struct ConfigBuilder {
    config: Config,
}

impl ConfigBuilder {
    /// Sets one option from the table, by key, as TIDEPOOL_CONF would.
    pub fn set(mut self, key: &str, value: &str) -> Result<Self, ConfigError> {
        apply(&mut self.config, key, value)?;
        Ok(self)
    }

    /// Applies a whole `key:value,...` string, failing on the first bad entry.
    pub fn conf(mut self, text: &str) -> Result<Self, ConfigError> {
        for entry in text.split(',').map(str::trim).filter(|e| !e.is_empty()) {
            let (key, value) = entry.split_once(':').ok_or_else(|| ConfigError::NotKeyValue { entry: entry.into() })?;
            self = self.set(key.trim(), value)?;
        }
        Ok(self)
    }

    /// Host backend: `devices` simulated devices of `capacity` bytes each.
    pub fn host(mut self, devices: usize, capacity: u64) -> Self {
        self.config.backend = BackendKind::Host;
        self.config.host_devices = devices;
        self.config.host_capacity = capacity;
        self
    }

    /// Records every allocation and free to `path` (RMM CSV).
    pub fn trace(mut self, path: impl Into<std::path::PathBuf>) -> Self {
        self.config.trace_path = Some(path.into());
        self
    }

    /// Replaces the size rules wholesale.
    pub fn rules(mut self, rules: SizeRules) -> Self {
        self.config.rules = rules;
        self
    }

    pub fn build(self) -> Result<Config, ConfigError> {
        self.config.rules.check().map_err(ConfigError::SizeRules)?;
        if self.config.host_devices == 0 {
            return Err(ConfigError::NoHostDevices);
        }
        Ok(self.config)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_entry_that_is_not_utf8_is_ignored_by_name_and_the_others_are_kept() {
        let (c, warnings) = Config::parse_bytes(b"backend:host,expandable:true,x:\xff,stash:false");
        assert_eq!((c.backend, c.expandable, c.stash), (BackendKind::Host, true, false));
        assert_eq!(warnings, vec!["ignoring \"x:\u{fffd}\": not UTF-8".to_string()]);
    }

    #[test]
    fn sizes_below_an_options_minimum_are_refused_with_the_minimum() {
        for (entry, said) in [
            ("host_capacity_mb:0", "host_capacity_mb: must be at least 1, got 0"),
            ("max_reserved_mb:0", "max_reserved_mb: must be at least 1, got 0"),
        ] {
            let (c, warnings) = Config::parse(entry);
            assert_eq!(c, Config::default(), "{entry}");
            assert!(warnings.len() == 1 && warnings[0].ends_with(said), "{warnings:?}");
            assert_eq!(Config::builder().conf(entry).unwrap_err().to_string(), said);
        }
        assert_eq!(Config::parse("host_capacity_mb:1").0.host_capacity, MIB);
    }

    #[test]
    fn pytorch_syntax_sets_the_named_options() {
        let (c, warnings) = Config::parse(" max_split_size_mb:256 , roundup_power2_divisions:4,host_devices:2");
        assert!(warnings.is_empty(), "{warnings:?}");
        assert_eq!(c.rules.max_split_size, 256 << 20);
        assert_eq!(c.rules.roundup_power2_divisions, 4);
        assert_eq!(c.host_devices, 2);
    }

    #[test]
    fn pytorchs_spelling_of_expandable_segments_works_as_is() {
        let (c, warnings) = Config::parse("expandable_segments:True");
        assert!(warnings.is_empty() && c.expandable, "{warnings:?}");
        let (c, warnings) = Config::parse("expandable:TRUE,stash:False");
        assert!(warnings.is_empty() && c.expandable && !c.stash, "{warnings:?}");
        let (_, warnings) = Config::parse("expandable:yes");
        assert!(warnings[0].contains("expected true or false"), "{warnings:?}");
    }

    #[test]
    fn on_off_none_and_unlimited_are_read_in_any_case_everywhere() {
        let (c, warnings) = Config::parse(
            "expandable:On,stash:OFF,cooperative:off,release_after_ms:NONE,max_reserved_mb:Unlimited,max_split_size_mb:UNLIMITED,\
             expandable_allocation_mb:Unlimited,oom_snapshot:Off,registry_dir:AUTO,host_shared:None",
        );
        assert!(warnings.is_empty(), "{warnings:?}");
        assert!(c.expandable && !c.stash && !c.cooperative);
        assert_eq!((c.release_after_ms, c.max_reserved, c.oom_snapshot, c.registry_dir, c.host_shared), (None, None, None, None, None));
        assert_eq!((c.rules.max_split_size, c.expandable_allocation), (u64::MAX, u64::MAX));
        // "off" and "none" say the same wherever one is taken; "unlimited" is not "off".
        assert_eq!(Config::parse("release_after_ms:none").0.release_after_ms, None);
        assert!(!Config::parse("max_reserved_mb:off").1.is_empty());
    }

    #[test]
    fn an_empty_path_is_an_error_at_the_check_not_at_the_first_use() {
        for key in ["host_shared", "registry_dir", "oom_snapshot"] {
            for value in ["", "  "] {
                let (c, warnings) = Config::parse(&format!("{key}:{value}"));
                assert_eq!(c, Config::default(), "{key}");
                assert!(warnings.len() == 1 && warnings[0].contains("expected a path, got nothing"), "{key}: {warnings:?}");
            }
            assert!(Config::builder().set(key, "").is_err());
        }
        for key in ["reclaim_interval_ms", "host_capacity_mb", "max_reserved_mb", "thread_cache_blocks"] {
            assert!(!Config::parse(&format!("{key}:")).1.is_empty(), "{key}: an empty number");
        }
    }

    #[test]
    fn a_key_given_twice_is_named_once_and_the_last_is_used() {
        let (c, warnings) = Config::parse("expandable:true,stash:false,expandable_segments:False,expandable:true,stash:false");
        assert!(c.expandable && !c.stash);
        assert_eq!(
            warnings,
            vec![
                "expandable is given 3 times: the last, \"true\", is used ([\"true\", \"False\"] not)".to_string(),
                "stash is given 2 times: the last, \"false\", is used ([\"false\"] not)".to_string(),
            ]
        );
        // In code, a later value overrides, as `set` does.
        assert!(Config::builder().conf("stash:false,stash:true").unwrap().build().unwrap().stash);
    }

    #[test]
    fn an_empty_string_gives_the_defaults() {
        assert_eq!(Config::parse(""), (Config::default(), vec![]));
    }

    #[test]
    fn unknown_keys_and_bad_values_warn_and_keep_defaults() {
        let (c, warnings) = Config::parse(
            "colour:blue,max_split_size_mb:lots,max_split_size_mb:10,host_devices:0,roundup_power2_divisions:3,novalue,host_capacity_mb:99999999999999999999",
        );
        assert_eq!(c, Config::default());
        assert_eq!(warnings.len(), 7, "{warnings:?}");
        assert!(warnings[0].contains("unknown option \"colour\""));
        assert!(warnings[1].contains("max_split_size_mb"));
        assert!(warnings[2].contains("above 20"));
        assert!(warnings[5].contains("expected key:value"));
    }

    #[test]
    fn inconsistent_size_options_fall_back_to_default_rules() {
        let (c, warnings) = Config::parse("small_segment_mb:0");
        assert_eq!(c.rules, SizeRules::default());
        assert_eq!(warnings.len(), 1);
        assert!(warnings[0].contains("small_segment"), "{warnings:?}");
    }

    #[test]
    fn the_builder_is_strict() {
        assert!(Config::builder().set("max_split_size_mb", "5").is_err());
        assert!(Config::builder().set("nope", "1").is_err());
        assert!(Config::builder().set("small_segment_mb", "0").unwrap().build().is_err());
        let c = Config::builder().conf("max_split_size_mb:64").unwrap().host(2, 1 << 30).build().unwrap();
        assert_eq!((c.rules.max_split_size, c.host_devices, c.host_capacity), (64 << 20, 2, 1 << 30));
    }

    #[test]
    fn every_option_has_a_default_that_parses_and_shows_as_itself() {
        for spec in OPTIONS {
            let mut c = Config::default();
            (spec.apply)(&mut c, spec.default).unwrap_or_else(|e| panic!("{}: {e}", spec.key));
            assert_eq!(c, Config::default(), "default of {} differs from Config::default()", spec.key);
            assert_eq!((spec.show)(&c), spec.default, "{} shows its default differently", spec.key);
        }
        let (c, _) = Config::parse("max_split_size_mb:64,host_capacity_mb:1024");
        let shown: Vec<_> = OPTIONS.iter().map(|o| (o.key, (o.show)(&c))).collect();
        assert!(shown.contains(&("max_split_size_mb", "64".to_string())));
        assert!(shown.contains(&("host_capacity_mb", "1024".to_string())));
    }

    #[test]
    fn oom_snapshot_names_a_path_or_none() {
        let (c, warnings) = Config::parse("oom_snapshot:/tmp/at-oom.pickle");
        assert!(warnings.is_empty(), "{warnings:?}");
        assert_eq!(c.oom_snapshot.as_deref(), Some(std::path::Path::new("/tmp/at-oom.pickle")));
        assert_eq!(Config::parse("oom_snapshot:none").0.oom_snapshot, None);
    }
}
