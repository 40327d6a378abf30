//! Random steps through one device's heap on the host backend: allocations
//! and frees of 512 B to 64 MiB on three streams, frees recorded on other
//! streams (events that finish at random), tags paused and resumed, private
//! pools, release policies and budgets, and failures injected into the
//! backend's calls. After every step: `validate()`, no two live blocks
//! overlap, every live block is the heap's and keeps the bytes written at
//! its ends, and the reserved count, the statistics and the backend's use
//! agree. Each configuration runs a few seeds in CI; `STRESS_SEEDS` and
//! `STRESS_STEPS` run more (`STRESS_BASE`: the first seed).

use crate::common;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use std::sync::Mutex;
use tidepool::backend::host::{FaultKind, HostBackend};
use tidepool::backend::{Backend, BackendError, HostMemory, MemInfo};
use tidepool::heap::reserve::Reserve;
use tidepool::heap::DeviceHeap;
use tidepool::reclaim::policy::{Policy, Reason};
use tidepool::reclaim::Clock;
use tidepool::PrivatePoolId;
use tidepool::{AllocError, Stream, TagId};

use common::{Rng, MIB};

/// The host backend, with events of other streams' work that finish at
/// random, and (`chaos`) calls that fail at random where the host backend
/// has no fault of its own to inject.
pub(crate) struct RandomBackend {
    pub host: Arc<HostBackend>,
    pub next_event: AtomicU64,
    pub rng: Mutex<Rng>,
    pub events_on: bool,
    pub outstanding: Mutex<HashSet<u64>>,
    /// Percent chance that a call the host backend cannot fail fails.
    pub chaos: u64,
}

impl RandomBackend {
    fn fail(&self, call: &'static str) -> Result<(), BackendError> {
        if self.chaos > 0 && self.rng.lock().unwrap().chance(self.chaos) {
            return Err(BackendError::Driver { call, code: -7, message: "chaos".into() });
        }
        Ok(())
    }
}

impl Backend for RandomBackend {
    fn name(&self) -> &'static str {
        "host with random events and failures"
    }
    fn device_count(&self) -> usize {
        1
    }
    fn driver_calls_on(&self, d: usize) -> u64 {
        self.host.driver_calls_on(d)
    }
    fn allocate(&self, d: usize, s: u64, st: Stream) -> Result<u64, BackendError> {
        self.host.allocate(d, s, st)
    }
    fn release(&self, d: usize, b: u64, s: u64, st: Stream) -> Result<(), BackendError> {
        self.host.release(d, b, s, st)
    }
    fn mem_info(&self, d: usize) -> Result<MemInfo, BackendError> {
        self.host.mem_info(d)
    }
    fn shared_device_key(&self, _d: usize) -> Option<String> {
        None
    }
    fn record_event(&self, _d: usize, _s: Stream) -> Result<Option<u64>, BackendError> {
        if !self.events_on {
            return Ok(None);
        }
        self.fail("record_event")?;
        let e = self.next_event.fetch_add(1, Ordering::SeqCst) + 1;
        self.outstanding.lock().unwrap().insert(e);
        Ok(Some(e))
    }
    fn event_done(&self, _d: usize, e: u64) -> Result<bool, BackendError> {
        assert!(self.outstanding.lock().unwrap().contains(&e), "query of recycled event {e}");
        self.fail("event_done")?;
        Ok(self.rng.lock().unwrap().chance(40))
    }
    fn wait_event(&self, _d: usize, e: u64) -> Result<(), BackendError> {
        assert!(self.outstanding.lock().unwrap().contains(&e), "wait of recycled event {e}");
        self.fail("wait_event")
    }
    fn recycle_event(&self, _d: usize, e: u64) {
        assert!(self.outstanding.lock().unwrap().remove(&e), "double recycle of event {e}");
    }
    fn vm_page_size(&self, d: usize) -> Option<u64> {
        self.host.vm_page_size(d)
    }
    fn synchronize_stream(&self, _d: usize, _s: Stream) -> Result<(), BackendError> {
        self.fail("sync")
    }
    fn stream_wait_event(&self, _d: usize, _s: Stream, _e: u64) -> Result<(), BackendError> {
        self.fail("stream_wait_event")
    }
    fn vm_reserve(&self, d: usize, s: u64) -> Result<u64, BackendError> {
        self.fail("vm_reserve")?;
        self.host.vm_reserve(d, s)
    }
    fn vm_free(&self, d: usize, b: u64, s: u64) -> Result<(), BackendError> {
        self.fail("vm_free")?;
        self.host.vm_free(d, b, s)
    }
    fn vm_map(&self, d: usize, a: u64, sizes: &[u64]) -> Result<(), BackendError> {
        self.host.vm_map(d, a, sizes)
    }
    fn vm_unmap(&self, d: usize, a: u64, l: u64) -> Result<(), BackendError> {
        self.host.vm_unmap(d, a, l)
    }
    fn vm_move(&self, d: usize, f: u64, t: u64, l: u64) -> Result<(), BackendError> {
        self.fail("vm_move")?;
        self.host.vm_move(d, f, t, l)
    }
    fn copy_to_device(&self, d: usize, dst: u64, src: &[u8], s: Stream) -> Result<(), BackendError> {
        self.fail("copy_to_device")?;
        self.host.copy_to_device(d, dst, src, s)
    }
    fn copy_to_host(&self, d: usize, src: u64, dst: &mut [u8], s: Stream) -> Result<(), BackendError> {
        self.fail("copy_to_host")?;
        self.host.copy_to_host(d, src, dst, s)
    }
    fn host_memory(&self, len: u64) -> Result<Box<dyn HostMemory>, BackendError> {
        if self.chaos > 0 && self.rng.lock().unwrap().chance(self.chaos) {
            return Err(BackendError::OutOfMemory);
        }
        self.host.host_memory(len)
    }
}

#[derive(Clone, Copy, Debug)]
/// One configuration of the random steps.
pub(crate) struct Opts {
    /// Expandable segments (else whole segments).
    pub expandable: bool,
    /// The device's memory.
    pub capacity: u64,
    /// Steps that make the backend fail its next allocations or releases.
    pub faults: bool,
    /// Allocations under tags 1 and 2, and steps that pause and resume them.
    pub tags: bool,
    /// Steps that begin, end and release private pools.
    pub private: bool,
    /// Frees recorded on another stream (events that finish at random).
    pub events: bool,
    /// Budgets (`max_reserved`, the shared reserve's limit) as well as idle decay.
    pub budget: bool,
    /// The largest request.
    pub max_size: u64,
    /// Each pool's stash of its last freed block.
    pub stash: bool,
    /// Expandable segments' page (0: the backend's).
    pub page: u64,
    /// Percent of the calls the host backend cannot fail that fail.
    pub chaos: u64,
    /// max_split_size and roundup_power2_divisions as PyTorch's settings write them.
    pub split_rules: bool,
    /// Expandable segments' physical allocations as large as each run, split
    /// when a smaller block reuses them (`expandable_split_allocations`).
    pub large_allocations: bool,
}

impl Default for Opts {
    fn default() -> Opts {
        Opts {
            expandable: true,
            capacity: 512 * MIB,
            faults: false,
            tags: false,
            private: false,
            events: false,
            budget: false,
            max_size: 64 * MIB,
            stash: true,
            page: 0,
            chaos: 0,
            split_rules: false,
            large_allocations: false,
        }
    }
}

pub(crate) struct Live {
    pub size: u64,
    pub tag: u32,
    /// Pattern written and expected intact.
    pub intact: bool,
    pub stream: Stream,
}

fn pattern(addr: u64) -> u64 {
    addr.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xA5A5
}

/// Writes a word derived from the address at each end of a live block.
///
/// # Safety
/// `addr` is a live block of at least `size` bytes of host memory (the host
/// backend's), at least 8 of them.
pub(crate) unsafe fn write_pattern(addr: u64, size: u64) {
    let p = pattern(addr);
    // SAFETY: per the contract, both words lie inside the live block.
    unsafe {
        (addr as *mut u64).write_volatile(p);
        if size >= 16 {
            ((addr + (size & !7) - 8) as *mut u64).write_volatile(!p);
        }
    }
}

/// Whether the words `write_pattern` wrote are still there.
///
/// # Safety
/// As `write_pattern`.
pub(crate) unsafe fn check_pattern(addr: u64, size: u64) -> bool {
    let p = pattern(addr);
    // SAFETY: per the contract, both words lie inside the live block.
    unsafe {
        let a = (addr as *const u64).read_volatile() == p;
        let b = size < 16 || ((addr + (size & !7) - 8) as *const u64).read_volatile() == !p;
        a && b
    }
}

fn run(seed: u64, steps: usize, o: Opts, log: bool) -> Result<(), String> {
    let host = Arc::new(HostBackend::new(1, o.capacity));
    let backend = Arc::new(RandomBackend {
        host: host.clone(),
        next_event: AtomicU64::new(0),
        rng: Mutex::new(Rng(seed ^ 0x1234_5678_9abc)),
        events_on: o.events,
        outstanding: Mutex::new(HashSet::new()),
        chaos: o.chaos,
    });
    let mut rules = tidepool::size_class::SizeRules::default();
    if o.split_rules {
        rules.max_split_size = 8 * MIB;
        rules.roundup_power2_divisions = 4;
    }
    let mut heap = DeviceHeap::new(0, rules, backend.clone());
    let reserve = Arc::new(Reserve::default());
    heap.share_reserve(reserve.clone());
    if o.large_allocations {
        heap.set_max_allocation(u64::MAX);
        heap.set_split_allocations(true);
    }
    if o.expandable {
        heap.set_expandable(true).unwrap();
        if o.page != 0 {
            heap.set_expandable_page(o.page).unwrap();
        }
    }
    heap.set_stash(o.stash);
    let clock = Clock::new();
    let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let mut live: HashMap<u64, Live> = HashMap::new();
    let mut order: Vec<u64> = Vec::new();
    let mut paused: HashMap<u32, bool> = HashMap::new(); // tag -> offload
    let mut open: Vec<PrivatePoolId> = Vec::new();
    let mut uses: HashMap<PrivatePoolId, u64> = HashMap::new();
    let streams = [Stream(0), Stream(7), Stream(9)];
    let mut now = 0u64;
    for step in 0..steps {
        let op = rng.below(100);
        let mut desc: String;
        match op {
            0..=44 => {
                // allocate
                let bits = 9 + rng.below(64 - (o.max_size.leading_zeros() as u64) - 9 + 1);
                let size = (1u64 << bits).min(o.max_size) + rng.below(1 << bits.min(40)) / 2;
                let size = size.clamp(1, o.max_size);
                let stream = streams[rng.below(3) as usize];
                let tag = if o.tags && rng.chance(30) { 1 + rng.below(2) as u32 } else { 0 };
                desc = format!("allocate({size}, {stream:?}, tag {tag})");
                let attempt = |heap: &mut DeviceHeap| {
                    if tag == 0 {
                        heap.allocate(size, stream)
                    } else {
                        heap.allocate_tagged(size, stream, TagId(tag), 0)
                    }
                };
                // An exhausted heap: the first rung of the device's ladder
                // (its cache released, the request tried again).
                let r = match attempt(&mut heap) {
                    Err(AllocError::OutOfMemory(_)) => {
                        heap.release_free_segments(Reason::OutOfMemory, |_, _| true);
                        attempt(&mut heap)
                    }
                    r => r,
                };
                match r {
                    Ok(addr) => {
                        desc += &format!(" = {addr:#x}");
                        if addr == 0 {
                            return Err(format!("step {step}: {desc}: null"));
                        }
                        if live.contains_key(&addr) {
                            return Err(format!("step {step}: {desc}: address already live"));
                        }
                        let actual_tag = if open.is_empty() { tag } else { 0 };
                        // SAFETY: a block just allocated, of at least `size` bytes, on host memory.
                        unsafe { write_pattern(addr, size.max(8)) };
                        live.insert(addr, Live { size, tag: actual_tag, intact: true, stream });
                        order.push(addr);
                    }
                    Err(AllocError::OutOfMemory(_)) => desc += " = OOM",
                    Err(AllocError::Tag(m)) if tag != 0 && paused.contains_key(&tag) => desc += &format!(" = tag err {m}"),
                    Err(AllocError::Backend(e)) if o.faults => desc += &format!(" = backend err {e}"),
                    Err(e) => return Err(format!("step {step}: {desc}: unexpected {e:?}")),
                }
            }
            45..=79 => {
                if order.is_empty() {
                    continue;
                }
                let idx = rng.below(order.len() as u64) as usize;
                let addr = order.swap_remove(idx);
                let l = live.remove(&addr).unwrap();
                let is_paused = l.tag != 0 && paused.contains_key(&l.tag);
                // SAFETY: still live (freed below), its pattern written at allocation.
                if l.intact && !is_paused && !unsafe { check_pattern(addr, l.size.max(8)) } {
                    return Err(format!("step {step}: contents of block {addr:#x} ({} bytes, tag {}) lost", l.size, l.tag));
                }
                if o.events && rng.chance(40) {
                    let other = streams.iter().copied().find(|&s| s != l.stream).unwrap();
                    heap.record_stream(addr, other).map_err(|e| format!("step {step}: record_stream {addr:#x}: {e:?}"))?;
                }
                desc = format!("free({addr:#x})");
                heap.free(addr).map_err(|e| format!("step {step}: {desc}: {e:?}"))?;
            }
            80..=83 => {
                desc = "empty_cache".into();
                heap.release_free_segments(Reason::EmptyCache, |_, _| true);
            }
            84..=86 => {
                now += rng.below(5000);
                clock.set(now);
                let max_reserved = if o.budget && rng.chance(50) { rng.below(o.capacity) } else { u64::MAX };
                let release_after_ms = if rng.chance(50) { rng.below(3000) } else { u64::MAX };
                let p = Policy {
                    release_after_ms,
                    headroom: if rng.chance(20) { rng.below(o.capacity) } else { 0 },
                    headroom_min_idle_ms: 0,
                    max_reserved,
                };
                desc = format!("set_policy({p:?}) + reclaim at {now}");
                heap.set_policy(p, clock.clone());
                heap.reclaim();
            }
            87..=88 if o.budget => {
                let limit = if rng.chance(50) { Some(rng.below(o.capacity)) } else { None };
                desc = format!("reserve.set_limit({limit:?}) + release_over_budget");
                reserve.set_limit(limit);
                heap.release_over_budget();
            }
            89..=91 if o.tags => {
                let tag = 1 + rng.below(2) as u32;
                if let Some(&offload) = paused.get(&tag) {
                    desc = format!("resume_tag({tag})");
                    match heap.resume_tag(TagId(tag)) {
                        Ok(_) => {
                            paused.remove(&tag);
                            if !offload {
                                for l in live.values_mut().filter(|l| l.tag == tag) {
                                    l.intact = false;
                                }
                            }
                            // rewrite patterns so later checks are meaningful
                            for (&a, l) in live.iter_mut().filter(|(_, l)| l.tag == tag && !l.intact) {
                                // SAFETY: a live block, mapped again by the resume.
                                unsafe { write_pattern(a, l.size.max(8)) };
                                l.intact = true;
                            }
                        }
                        Err(e) => desc += &format!(" = {e}"),
                    }
                } else {
                    let offload = rng.chance(50);
                    desc = format!("pause_tag({tag}, offload {offload})");
                    match heap.pause_tag(TagId(tag), offload) {
                        Ok(_) => {
                            paused.insert(tag, offload);
                        }
                        Err(e) => desc += &format!(" = {e}"),
                    }
                }
            }
            92..=94 if o.private => {
                let id = PrivatePoolId(1 + rng.below(2), 0);
                match rng.below(3) {
                    0 => {
                        desc = format!("begin_private({id:?})");
                        heap.begin_private(id);
                        open.push(id);
                        *uses.entry(id).or_default() += 1;
                    }
                    1 => {
                        desc = format!("end_private({id:?})");
                        let r = heap.end_private(id);
                        if let Some(at) = open.iter().rposition(|&x| x == id) {
                            open.remove(at);
                            r.map_err(|e| format!("step {step}: {desc}: {e}"))?;
                        } else if r.is_ok() {
                            return Err(format!("step {step}: {desc} succeeded when not open"));
                        }
                    }
                    _ => {
                        desc = format!("release_private({id:?})");
                        let r = heap.release_private(id);
                        let _ = r;
                    }
                }
            }
            95..=97 if o.faults => desc = inject_faults(&mut rng, &host),
            _ => {
                desc = "stats".into();
                let s = heap.stats();
                let _ = heap.snapshot();
                if paused.is_empty() && s.reserved_bytes.all.current < s.allocated_bytes.all.current {
                    return Err(format!("step {step}: reserved < allocated"));
                }
            }
        }
        if log {
            eprintln!("{step}: {desc}");
        }
        heap.validate().map_err(|e| format!("step {step} after {desc}: validate: {e}"))?;
        check_live_blocks(&live, |a| heap.live_size(a)).map_err(|e| format!("step {step} after {desc}: {e}"))?;
        let totals = heap.totals();
        let used = o.capacity - host.mem_info(0).unwrap().free;
        if reserve.bytes() != totals.reserved || used != totals.reserved {
            return Err(format!(
                "step {step} after {desc}: reserve count {} / backend used {used} / stats reserved {}",
                reserve.bytes(),
                totals.reserved
            ));
        }
    }
    Ok(())
}

/// Arms the backend to fail its next few allocations or releases (as out
/// of memory or a driver error), or turns the faults off; says which.
pub(crate) fn inject_faults(rng: &mut Rng, host: &HostBackend) -> String {
    let n = 1 + rng.below(4);
    let kind = if rng.chance(50) { FaultKind::OutOfMemory } else { FaultKind::DriverError };
    let desc = match rng.below(3) {
        0 => {
            host.faults().fail_nth_allocate(n);
            format!("fail_nth_allocate({n}) {kind:?}")
        }
        1 => {
            host.faults().fail_nth_release(n);
            format!("fail_nth_release({n}) {kind:?}")
        }
        _ => {
            host.faults().fail_nth_allocate(0);
            host.faults().fail_nth_release(0);
            "faults off".into()
        }
    };
    host.faults().set_kind(kind);
    desc
}

pub(crate) fn seeds() -> u64 {
    std::env::var("STRESS_SEEDS").ok().and_then(|s| s.parse().ok()).unwrap_or(2)
}
pub(crate) fn steps() -> usize {
    std::env::var("STRESS_STEPS").ok().and_then(|s| s.parse().ok()).unwrap_or(1200)
}

/// Live blocks are all the heap's (`live_size`), hold at least what was
/// requested, and never overlap.
pub(crate) fn check_live_blocks(live: &HashMap<u64, Live>, live_size: impl Fn(u64) -> Option<u64>) -> Result<(), String> {
    let mut ranges: BTreeMap<u64, u64> = BTreeMap::new();
    for (&a, l) in live {
        let sz = live_size(a).ok_or_else(|| format!("live block {a:#x} unknown to the heap"))?;
        if sz < l.size {
            return Err(format!("block {a:#x} has {sz} < requested {}", l.size));
        }
        ranges.insert(a, sz);
    }
    let mut end = 0;
    for (&a, &s) in &ranges {
        if a < end {
            return Err(format!("block {a:#x} overlaps the previous one"));
        }
        end = a + s;
    }
    Ok(())
}

/// Runs `run` (seed, steps, configuration) on each seed; fails with the first failure.
pub(crate) fn sweep(name: &str, o: Opts, run: impl Fn(u64, usize, Opts) -> Result<(), String>) {
    let base: u64 = std::env::var("STRESS_BASE").ok().and_then(|s| s.parse().ok()).unwrap_or(1);
    let mut failures = Vec::new();
    for seed in base..base + seeds() {
        if let Err(e) = run(seed, steps(), o) {
            eprintln!("{name} seed {seed}: {e}");
            failures.push((seed, e));
        }
    }
    assert!(failures.is_empty(), "{name}: {} failures, first: {:?}", failures.len(), failures[0]);
}

/// Every configuration, by name.
pub(crate) fn configurations() -> Vec<(&'static str, Opts)> {
    vec![
        ("plain", Opts { expandable: false, ..Opts::default() }),
        ("expandable_budget", Opts { budget: true, capacity: 256 * MIB, ..Opts::default() }),
        ("plain_budget", Opts { expandable: false, budget: true, capacity: 256 * MIB, ..Opts::default() }),
        ("faults_plain", Opts { expandable: false, faults: true, ..Opts::default() }),
        ("faults_expandable", Opts { faults: true, ..Opts::default() }),
        ("tags", Opts { tags: true, ..Opts::default() }),
        ("tags_faults", Opts { tags: true, faults: true, budget: true, ..Opts::default() }),
        ("private", Opts { private: true, tags: true, ..Opts::default() }),
        ("events", Opts { events: true, ..Opts::default() }),
        ("events_plain", Opts { events: true, expandable: false, ..Opts::default() }),
        ("all", Opts { events: true, tags: true, private: true, faults: true, budget: true, capacity: 384 * MIB, ..Opts::default() }),
        (
            "all_plain",
            Opts {
                expandable: false,
                events: true,
                tags: true,
                private: true,
                faults: true,
                budget: true,
                capacity: 384 * MIB,
                ..Opts::default()
            },
        ),
        ("big_page", Opts { page: 8 * MIB, budget: true, tags: true, ..Opts::default() }),
        ("nostash", Opts { stash: false, events: true, tags: true, budget: true, ..Opts::default() }),
        ("expandable", Opts::default()),
        ("tight", Opts { capacity: 96 * MIB, budget: true, tags: true, events: true, ..Opts::default() }),
        (
            "tight_faults",
            Opts { capacity: 96 * MIB, budget: true, tags: true, events: true, faults: true, private: true, ..Opts::default() },
        ),
        (
            "tight_plain",
            Opts {
                expandable: false,
                capacity: 96 * MIB,
                budget: true,
                tags: true,
                events: true,
                faults: true,
                private: true,
                ..Opts::default()
            },
        ),
        (
            "chaos",
            Opts { chaos: 5, faults: true, tags: true, events: true, private: true, budget: true, capacity: 256 * MIB, ..Opts::default() },
        ),
        (
            "chaos_plain",
            Opts {
                expandable: false,
                chaos: 5,
                faults: true,
                tags: true,
                events: true,
                private: true,
                budget: true,
                capacity: 256 * MIB,
                ..Opts::default()
            },
        ),
        ("split", Opts { split_rules: true, tags: true, events: true, budget: true, ..Opts::default() }),
        (
            "split_plain",
            Opts { expandable: false, split_rules: true, tags: true, events: true, budget: true, faults: true, ..Opts::default() },
        ),
        ("split_nostash", Opts { stash: false, split_rules: true, events: true, ..Opts::default() }),
        (
            "large_allocations",
            Opts { large_allocations: true, tags: true, events: true, private: true, faults: true, budget: true, ..Opts::default() },
        ),
    ]
}

fn opts_by_name(name: &str) -> Opts {
    configurations().into_iter().find(|(n, _)| *n == name).unwrap_or_else(|| panic!("no configuration {name}")).1
}

/// Every configuration with expandable segments, each on its seeds.
#[test]
fn random_steps_keep_every_invariant_with_expandable_segments() {
    for (name, opts) in configurations().into_iter().filter(|(_, opts)| opts.expandable) {
        sweep(name, opts, |seed, steps, o| run(seed, steps, o, false));
    }
}

/// Every configuration without, each on its seeds (a test of its own: the two run side by side).
#[test]
fn random_steps_keep_every_invariant_with_whole_segments() {
    for (name, opts) in configurations().into_iter().filter(|(_, opts)| !opts.expandable) {
        sweep(name, opts, |seed, steps, o| run(seed, steps, o, false));
    }
}

/// `STRESS_ONE=name:seed` replays one run, printing every step (to read a failure).
#[test]
#[ignore = "run by hand: STRESS_ONE=name:seed cargo test --release -p tidepool --test engine -- --ignored heap_stress::"]
fn one_run_step_by_step() {
    let spec = std::env::var("STRESS_ONE").expect("STRESS_ONE=name:seed");
    let (name, seed) = spec.split_once(':').expect("STRESS_ONE=name:seed");
    let r = run(seed.parse().unwrap(), steps(), opts_by_name(name), true);
    assert!(r.is_ok(), "{r:?}");
}
