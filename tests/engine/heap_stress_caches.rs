//! The heap stress test's configurations (`heap_stress.rs`) through the
//! allocator, with threads' caches on, on two threads: each allocation and
//! free runs on one of them at random, so blocks go into and out of both
//! threads' caches, are freed by the thread that did not allocate them,
//! and are recalled by empty_cache, statistics reads, the reclaimer's
//! pass, tags' pauses, budgets, private pools and out-of-memory, with
//! failures injected into the backend. After one step in four (validation
//! disarms the caches, whose own paths need them armed): `validate()`
//! (the lending invariants among the heap's), no two live blocks overlap,
//! every live block is the heap's and keeps the bytes written at its ends,
//! the reserved bytes equal the backend's use; at every statistics read,
//! the allocation count and the requested bytes equal what is live.
//! `STRESS_SEEDS` and `STRESS_STEPS` run more, as for `heap_stress.rs`.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::AtomicU64;
use std::sync::mpsc;
use std::sync::Arc;

use std::sync::Mutex;
use tidepool::backend::host::HostBackend;
use tidepool::backend::Backend;
use tidepool::{AllocError, Allocator, Config, DevicePtr, PrivatePoolId, Stream};

use crate::common::Rng;
use crate::heap_stress::{
    check_live_blocks, check_pattern, configurations, inject_faults, sweep, write_pattern, Live, Opts, RandomBackend,
};

/// A second thread that runs what it is given, one call at a time.
struct Worker {
    calls: mpsc::Sender<Box<dyn FnOnce() + Send>>,
}

impl Worker {
    fn new() -> Worker {
        let (calls, receiver) = mpsc::channel::<Box<dyn FnOnce() + Send>>();
        std::thread::spawn(move || receiver.into_iter().for_each(|call| call()));
        Worker { calls }
    }

    /// Runs `f` here (`here`) or on the worker, and returns what it returns.
    fn run<R: Send + 'static>(&self, here: bool, f: impl FnOnce() -> R + Send + 'static) -> R {
        if here {
            return f();
        }
        let (done, result) = mpsc::sync_channel(1);
        self.calls.send(Box::new(move || done.send(f()).unwrap())).unwrap();
        result.recv().expect("the worker ran the call")
    }
}

const TAGS: [&str; 3] = ["default", "stress-caches-1", "stress-caches-2"];

fn conf(o: &Opts, seed: u64) -> String {
    let mut conf = vec![
        format!("expandable:{}", o.expandable),
        format!("stash:{}", o.stash),
        // Small bounds, so that the caches fill and evict.
        format!("thread_cache_blocks:{}", [2, 4, 16][seed as usize % 3]),
        format!("thread_cache_mb:{}", [1, 4, 64][seed as usize % 3]),
        format!("release_after_ms:{}", if seed.is_multiple_of(2) { "0" } else { "off" }),
        "cooperative:false".into(),
        "headroom_mb:0".into(),
        "reclaim_interval_ms:60000".into(),
    ];
    // `o.page`: the allocator maps the backend's page (no option sets another).
    if o.large_allocations {
        conf.push("expandable_allocation_mb:unlimited,expandable_split_allocations:true".into());
    }
    if o.split_rules {
        conf.push("max_split_size_mb:24".into());
        conf.push("roundup_power2_divisions:4".into());
    }
    conf.join(",")
}

fn run(seed: u64, steps: usize, o: Opts) -> Result<(), String> {
    let host = Arc::new(HostBackend::new(1, o.capacity));
    let backend = Arc::new(RandomBackend {
        host: host.clone(),
        next_event: AtomicU64::new(0),
        rng: Mutex::new(Rng(seed ^ 0x1234_5678_9abc)),
        events_on: o.events,
        outstanding: Mutex::new(HashSet::new()),
        chaos: o.chaos,
    });
    let config = Config::builder().conf(&conf(&o, seed)).map_err(|e| format!("{e:?}"))?.build().map_err(|e| format!("{e:?}"))?;
    assert!(config.thread_cache_blocks > 0, "caches are on");
    let alloc = Arc::new(Allocator::with_backend(config, backend as Arc<dyn Backend>));
    let worker = Worker::new();
    let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let mut live: HashMap<u64, Live> = HashMap::new();
    let mut order: Vec<u64> = Vec::new();
    let mut paused: HashMap<u32, bool> = HashMap::new(); // tag -> offload
    let mut open: Vec<PrivatePoolId> = Vec::new();
    let streams = [Stream(0), Stream(7), Stream(9)];
    let device = |alloc: &Allocator| alloc.device(0).map(|_| ()).map_err(|e| format!("{e}"));
    device(&alloc)?;
    for step in 0..steps {
        let here = rng.chance(50);
        let desc: String;
        match rng.below(100) {
            0..=44 => {
                let bits = 9 + rng.below(64 - (o.max_size.leading_zeros() as u64) - 9 + 1);
                let size = ((1u64 << bits).min(o.max_size) + rng.below(1 << bits.min(40)) / 2).clamp(1, o.max_size);
                // Sizes repeat often, so that caches serve them.
                let size = if rng.chance(50) { [512, 4096, 65536][rng.below(3) as usize] } else { size };
                let stream = streams[rng.below(3) as usize];
                let tag = if o.tags && rng.chance(30) { 1 + rng.below(2) as u32 } else { 0 };
                desc = format!("allocate({size}, {stream:?}, tag {tag}) on {}", if here { "main" } else { "worker" });
                let a = alloc.clone();
                let result = worker.run(here, move || {
                    let _tag = (tag != 0).then(|| tidepool::tag::region(TAGS[tag as usize]).unwrap());
                    a.allocate(0, size as usize, stream)
                });
                match result {
                    Ok(DevicePtr(addr)) => {
                        if addr == 0 || live.contains_key(&addr) {
                            return Err(format!("step {step}: {desc} = {addr:#x}: null or already live"));
                        }
                        // SAFETY: a block just allocated, of at least `size` bytes, on host memory.
                        unsafe { write_pattern(addr, size.max(8)) };
                        let tag = if open.is_empty() { tag } else { 0 };
                        live.insert(addr, Live { size, tag, intact: true, stream });
                        order.push(addr);
                    }
                    Err(AllocError::OutOfMemory(_)) => {}
                    Err(AllocError::Tag(_)) if tag != 0 && paused.contains_key(&tag) => {}
                    Err(AllocError::Backend(_)) if o.faults || o.chaos > 0 => {}
                    Err(e) => return Err(format!("step {step}: {desc}: unexpected {e:?}")),
                }
            }
            45..=79 => {
                if order.is_empty() {
                    continue;
                }
                let addr = order.swap_remove(rng.below(order.len() as u64) as usize);
                let l = live.remove(&addr).unwrap();
                let is_paused = l.tag != 0 && paused.contains_key(&l.tag);
                // SAFETY: still live (freed below), its pattern written at allocation.
                if l.intact && !is_paused && !unsafe { check_pattern(addr, l.size.max(8)) } {
                    return Err(format!("step {step}: contents of block {addr:#x} ({} bytes, tag {}) lost", l.size, l.tag));
                }
                if o.events && rng.chance(30) {
                    let other = streams.iter().copied().find(|&s| s != l.stream).unwrap();
                    alloc.record_stream(DevicePtr(addr), other).map_err(|e| format!("step {step}: record_stream {addr:#x}: {e:?}"))?;
                }
                desc = format!("free({addr:#x}) on {}", if here { "main" } else { "worker" });
                let a = alloc.clone();
                let sized = rng.chance(30);
                let (size, stream) = (l.size, l.stream);
                worker
                    .run(here, move || {
                        if sized {
                            a.free_sized(0, DevicePtr(addr), size as usize, stream).map(|_| ())
                        } else {
                            a.free_on_stream(0, DevicePtr(addr), stream)
                        }
                    })
                    .map_err(|e| format!("step {step}: {desc}: {e:?}"))?;
            }
            80..=83 => {
                desc = "empty_cache".into();
                alloc.empty_cache();
            }
            84..=86 => {
                desc = "reclaim".into();
                alloc.device(0).unwrap().reclaim();
            }
            87..=88 if o.budget => {
                let limit = if rng.chance(50) { Some(rng.below(o.capacity)) } else { None };
                desc = format!("set_reserved_limit({limit:?})");
                alloc.device(0).unwrap().set_reserved_limit(limit);
            }
            89..=91 if o.tags => {
                let tag = 1 + rng.below(2) as u32;
                if let Some(&offload) = paused.get(&tag) {
                    desc = format!("resume({tag})");
                    if alloc.resume(TAGS[tag as usize], Some(0)).is_ok() {
                        paused.remove(&tag);
                        for (&a, l) in live.iter_mut().filter(|(_, l)| l.tag == tag) {
                            if !offload {
                                // SAFETY: a live block, mapped again by the resume.
                                unsafe { write_pattern(a, l.size.max(8)) };
                            }
                            l.intact = true;
                        }
                    }
                } else {
                    let offload = rng.chance(50);
                    desc = format!("pause({tag}, offload {offload})");
                    if alloc.pause(TAGS[tag as usize], Some(0), offload).is_ok() {
                        paused.insert(tag, offload);
                    }
                }
            }
            92..=94 if o.private => {
                let id = PrivatePoolId(1 + rng.below(2), 0);
                match rng.below(3) {
                    0 => {
                        desc = format!("begin_private({id:?})");
                        alloc.begin_private(0, id).map_err(|e| format!("step {step}: {desc}: {e}"))?;
                        open.push(id);
                    }
                    1 => {
                        desc = format!("end_private({id:?})");
                        let r = alloc.end_private(0, id);
                        if let Some(at) = open.iter().rposition(|&x| x == id) {
                            open.remove(at);
                            r.map_err(|e| format!("step {step}: {desc}: {e}"))?;
                        } else if r.is_ok() {
                            return Err(format!("step {step}: {desc} succeeded when not open"));
                        }
                    }
                    _ => {
                        desc = format!("release_private({id:?})");
                        let _ = alloc.release_private(0, id);
                    }
                }
            }
            95..=97 if o.faults => desc = inject_faults(&mut rng, &host),
            _ => {
                desc = "stats".into();
                let s = alloc.stats(0).map_err(|e| format!("{e}"))?;
                let _ = alloc.snapshot(0);
                let requested: u64 = live.values().map(|l| l.size).sum();
                if paused.is_empty() && (s.allocation.all.current != live.len() as u64 || s.requested_bytes.all.current != requested) {
                    return Err(format!(
                        "step {step}: stats count {} allocations, {} bytes requested; {} live, {requested} bytes",
                        s.allocation.all.current,
                        s.requested_bytes.all.current,
                        live.len()
                    ));
                }
            }
        }
        // Validation disarms every cache: one step in four, so that the
        // caches' own paths (which need them armed) run between.
        if !rng.chance(25) {
            continue;
        }
        alloc.validate().map_err(|e| format!("step {step} after {desc}: validate: {e}"))?;
        let a = alloc.clone();
        worker.run(false, move || a.validate()).map_err(|e| format!("step {step} after {desc}: validate on the worker: {e}"))?;
        let dev = alloc.device(0).unwrap();
        check_live_blocks(&live, |a| dev.live_size(DevicePtr(a))).map_err(|e| format!("step {step} after {desc}: {e}"))?;
        let used = o.capacity - host.mem_info(0).unwrap().free;
        if used != dev.totals().reserved {
            return Err(format!("step {step} after {desc}: backend used {used}, reserved {}", dev.totals().reserved));
        }
    }
    Ok(())
}

/// Every configuration of the heap stress test, through the allocator with caches on.
#[test]
fn random_steps_on_two_threads_with_caches_keep_every_invariant() {
    for (name, opts) in configurations() {
        sweep(&format!("{name} with caches"), opts, run);
    }
}
