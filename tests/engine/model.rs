//! A state machine test against a reference model: random sequences of
//! allocations, frees, cache releases, injected growth and release failures
//! (the first or the second driver call of a request), bad frees (each
//! free, good or bad, named with its device or by the pointer alone:
//! `free_ptr`, a path of its own through the thread's cache), and
//! private pools begun, ended and released (in order or not) over several
//! streams, with whole segments and with expandable segments. After every
//! step the heap validates, live ranges never overlap, patterns written into
//! blocks are intact, the statistics equal the model's, no memory goes back
//! while a private pool is open, and no block a private pool ever held goes
//! to anyone else while private pools are held; at the end everything goes
//! back to the driver. And a second model: the same heap without its stash,
//! which must place every block and call the driver exactly alike.

use crate::common;

use std::collections::BTreeMap;

use common::{check, fill, host_allocator, MIB};
use proptest::prelude::*;
use tidepool::{AllocError, DevicePtr, PrivatePoolId, Stream};

#[derive(Clone, Debug)]
enum Op {
    Alloc {
        stream: u64,
        size: u64,
    },
    /// `by_ptr`: with `free_ptr`, which names no device.
    Free {
        pick: usize,
        by_ptr: bool,
    },
    EmptyCache,
    FailNextGrowth,
    FailSecondGrowth,
    FailNextRelease,
    FreeForeign {
        by_ptr: bool,
    },
    DoubleFree {
        pick: usize,
        by_ptr: bool,
    },
    Begin {
        pool: u64,
    },
    End {
        pool: u64,
    },
    Release {
        pool: u64,
    },
}

fn size() -> impl Strategy<Value = u64> {
    prop_oneof![
        6 => 1u64..=8192,
        3 => 8193u64..=(1 << 20),
        2 => (1u64 << 20) + 1..=12 << 20,
        1 => (12u64 << 20)..=48 << 20,
    ]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        10 => (0u64..3, size()).prop_map(|(stream, size)| Op::Alloc { stream, size }),
        7 => (any::<usize>(), any::<bool>()).prop_map(|(pick, by_ptr)| Op::Free { pick, by_ptr }),
        1 => Just(Op::EmptyCache),
        1 => Just(Op::FailNextGrowth),
        1 => Just(Op::FailSecondGrowth),
        1 => Just(Op::FailNextRelease),
        1 => any::<bool>().prop_map(|by_ptr| Op::FreeForeign { by_ptr }),
        1 => (any::<usize>(), any::<bool>()).prop_map(|(pick, by_ptr)| Op::DoubleFree { pick, by_ptr }),
        1 => (1u64..3).prop_map(|pool| Op::Begin { pool }),
        1 => (1u64..3).prop_map(|pool| Op::End { pool }),
        1 => (1u64..3).prop_map(|pool| Op::Release { pool }),
    ]
}

struct Live {
    block: u64,
    requested: u64,
    tag: u64,
}

const CAPACITY: u64 = 160 * MIB;

fn run(ops: Vec<Op>, conf: &str) -> Result<(), TestCaseError> {
    let (alloc, backend) = host_allocator(1, CAPACITY, conf);
    prop_assert_eq!(alloc.device(0).unwrap().is_expandable(), !conf.contains("expandable:false"));
    let mut live: BTreeMap<u64, Live> = BTreeMap::new();
    let mut freed: Vec<u64> = Vec::new();
    let mut invalid_frees = 0;
    // Private pools: those open (innermost last), uses not yet released,
    // and every range handed out from each while any is held.
    let (mut open, mut uses) = (Vec::<u64>::new(), BTreeMap::<u64, u64>::new());
    let mut private_ranges: Vec<(u64, u64, u64)> = Vec::new();
    let free = |ptr: DevicePtr, by_ptr: bool| if by_ptr { alloc.free_ptr(ptr) } else { alloc.free(0, ptr) };
    for (step, op) in ops.into_iter().enumerate() {
        let reserved_before = alloc.stats(0).unwrap().reserved_bytes.all.current;
        match op {
            Op::Alloc { stream, size } => match alloc.allocate(0, size as usize, Stream(stream)) {
                Ok(ptr) => {
                    prop_assert!(!ptr.is_null() && ptr.0 % 512 == 0);
                    let block = alloc.device(0).unwrap().live_size(ptr).expect("returned block is live");
                    prop_assert!(block >= size);
                    let routed = open.last().copied().unwrap_or(0);
                    for &(pool, addr, len) in &private_ranges {
                        prop_assert!(
                            pool == routed || ptr.0 + block <= addr || addr + len <= ptr.0,
                            "a block of private pool {pool} at {addr:#x} went to pool {routed} while private pools are held"
                        );
                    }
                    if routed != 0 {
                        private_ranges.push((routed, ptr.0, block));
                    }
                    if let Some((&addr, prev)) = live.range(..ptr.0).next_back() {
                        prop_assert!(addr + prev.block <= ptr.0, "overlaps the block at {addr:#x}");
                    }
                    if let Some((&addr, _)) = live.range(ptr.0..).next() {
                        prop_assert!(ptr.0 + block <= addr, "overlaps the block at {addr:#x}");
                    }
                    fill(ptr, size, step as u64);
                    live.insert(ptr.0, Live { block, requested: size, tag: step as u64 });
                }
                Err(AllocError::OutOfMemory(report)) => prop_assert_eq!(report.requested, size),
                Err(other) => prop_assert!(false, "unexpected error {other:?}"),
            },
            Op::Free { pick, by_ptr } if !live.is_empty() => {
                let addr = *live.keys().nth(pick % live.len()).unwrap();
                let entry = live.remove(&addr).unwrap();
                prop_assert_eq!(check(DevicePtr(addr), entry.requested, entry.tag), Ok(()), "pattern of {:#x} damaged", addr);
                free(DevicePtr(addr), by_ptr).unwrap();
                freed.push(addr);
            }
            Op::Free { .. } => {}
            Op::EmptyCache => {
                alloc.empty_cache();
            }
            Op::FailNextGrowth => backend.faults().fail_nth_allocate(1),
            Op::FailSecondGrowth => backend.faults().fail_nth_allocate(2),
            Op::FailNextRelease => backend.faults().fail_nth_release(1),
            Op::FreeForeign { by_ptr } => {
                prop_assert!(free(DevicePtr(0x1000), by_ptr).is_err());
                invalid_frees += 1;
            }
            Op::DoubleFree { pick, by_ptr } => {
                if let Some(&addr) = freed.get(pick % freed.len().max(1)) {
                    if !live.contains_key(&addr) {
                        prop_assert!(free(DevicePtr(addr), by_ptr).is_err());
                        invalid_frees += 1;
                    }
                }
            }
            Op::Begin { pool } => {
                alloc.begin_private(0, PrivatePoolId(pool, 0)).unwrap();
                open.push(pool);
                *uses.entry(pool).or_default() += 1;
            }
            Op::End { pool } => {
                let result = alloc.end_private(0, PrivatePoolId(pool, 0));
                match open.iter().rposition(|&p| p == pool) {
                    Some(at) => {
                        prop_assert!(result.is_ok());
                        open.remove(at);
                    }
                    None => prop_assert!(result.is_err()),
                }
            }
            Op::Release { pool } => {
                let result = alloc.release_private(0, PrivatePoolId(pool, 0));
                match uses.get(&pool).copied() {
                    Some(1) if open.contains(&pool) => prop_assert!(result.is_err(), "released while open"),
                    Some(n) => {
                        prop_assert!(result.is_ok());
                        if n == 1 {
                            uses.remove(&pool);
                        } else {
                            uses.insert(pool, n - 1);
                        }
                    }
                    None => prop_assert!(result.is_err()),
                }
                if uses.is_empty() {
                    private_ranges.clear();
                }
            }
        }
        if !open.is_empty() {
            prop_assert!(alloc.stats(0).unwrap().reserved_bytes.all.current >= reserved_before, "memory went back during a capture");
        }
        alloc.validate().map_err(TestCaseError::fail)?;
        let stats = alloc.stats(0).unwrap();
        prop_assert_eq!(stats.allocated_bytes.all.current, live.values().map(|l| l.block).sum::<u64>());
        prop_assert_eq!(stats.requested_bytes.all.current, live.values().map(|l| l.requested).sum::<u64>());
        prop_assert_eq!(stats.allocation.all.current, live.len() as u64);
        prop_assert_eq!(stats.events.num_invalid_frees, invalid_frees);
        prop_assert!(stats.reserved_bytes.all.current <= CAPACITY);
    }
    backend.faults().fail_nth_allocate(0);
    backend.faults().fail_nth_release(0);
    for pool in open.iter().rev() {
        alloc.end_private(0, PrivatePoolId(*pool, 0)).unwrap();
    }
    for (pool, n) in uses {
        for _ in 0..n {
            alloc.release_private(0, PrivatePoolId(pool, 0)).unwrap();
        }
    }
    for (addr, entry) in std::mem::take(&mut live) {
        prop_assert_eq!(check(DevicePtr(addr), entry.requested, entry.tag), Ok(()));
        alloc.free(0, DevicePtr(addr)).unwrap();
    }
    alloc.empty_cache();
    alloc.validate().map_err(TestCaseError::fail)?;
    let stats = alloc.stats(0).unwrap();
    prop_assert_eq!(stats.reserved_bytes.all.current, 0);
    prop_assert_eq!(stats.segment.all.current, 0, "address space reserved for nothing");
    prop_assert_eq!(tidepool::backend::Backend::mem_info(&*backend, 0).unwrap().free, CAPACITY);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    #[test]
    fn the_heap_agrees_with_a_model_of_live_ranges(ops in prop::collection::vec(op(), 1..80)) {
        run(ops, "")?;
    }

    #[test]
    fn whole_segments_agree_with_the_model(ops in prop::collection::vec(op(), 1..80)) {
        run(ops, "expandable:false")?;
    }
}

/// One step of the stash's equivalence test: sizes drawn from a few
/// classes so that equal sizes (the tie-breaks of best fit) are common.
#[derive(Clone, Debug)]
enum PairOp {
    Alloc { stream: u64, size: u64, tagged: bool },
    Free { pick: usize },
    EmptyCache,
    // A live block used on another stream too (`record_stream`): freed at
    // once on the host backend, held pending while a private pool is open.
    RecordStream { pick: usize },
    BeginPrivate { pool: u64 },
    EndPrivate { pool: u64 },
    ReleasePrivate { pool: u64 },
}

fn pair_size() -> impl Strategy<Value = u64> {
    prop_oneof![
        4 => prop::sample::select(vec![512u64, 1024, 1536, 4096, 65536, 1 << 19, 1 << 20]),
        4 => prop::sample::select(vec![(1u64 << 20) + 512, 3 << 19, 2 << 20, 3 << 20, 4 << 20, 6 << 20, 8 << 20, 12 << 20, 24 << 20, 32 << 20, 40 << 20]),
        1 => 1u64..=(1 << 20),
        1 => (1u64 << 20) + 1..=40 << 20,
    ]
}

fn pair_op() -> impl Strategy<Value = PairOp> {
    prop_oneof![
        10 => (0u64..2, pair_size(), prop::bool::weighted(0.2)).prop_map(|(stream, size, tagged)| PairOp::Alloc { stream, size, tagged }),
        10 => any::<usize>().prop_map(|pick| PairOp::Free { pick }),
        1 => Just(PairOp::EmptyCache),
        2 => any::<usize>().prop_map(|pick| PairOp::RecordStream { pick }),
        1 => (1u64..3).prop_map(|pool| PairOp::BeginPrivate { pool }),
        1 => (1u64..3).prop_map(|pool| PairOp::EndPrivate { pool }),
        1 => (1u64..3).prop_map(|pool| PairOp::ReleasePrivate { pool }),
    ]
}

/// Where each allocation landed, as (segment in order of creation, offset
/// in it), then the driver calls and the bytes reserved at the end: what
/// two allocators can be compared by.
type Placements = (Vec<(usize, u64)>, [u64; 7], u64);

fn placements(ops: &[PairOp], conf: &str) -> Result<Placements, TestCaseError> {
    // The heap's placement: threads' caches, which move it, off.
    let (alloc, backend) = host_allocator(1, 4 << 30, &format!("thread_cache_blocks:0,{conf}"));
    let (mut live, mut segments, mut out) = (Vec::new(), BTreeMap::new(), Vec::new());
    let mut created = 0;
    for op in ops {
        match *op {
            PairOp::Alloc { stream, size, tagged } => {
                let calls = backend.allocate_calls() + backend.vm_reserve_calls();
                let region = tagged.then(|| tidepool::tag::region("stash-equivalence").unwrap());
                let ptr = alloc.allocate(0, size as usize, Stream(stream)).map_err(|e| TestCaseError::fail(e.to_string()))?;
                drop(region);
                let (base, _) = alloc.segment_of(0, ptr).unwrap().unwrap();
                // A new segment or range may lie where a released one did.
                if backend.allocate_calls() + backend.vm_reserve_calls() > calls {
                    segments.remove(&base.0);
                }
                let segment = *segments.entry(base.0).or_insert_with(|| {
                    created += 1;
                    created
                });
                out.push((segment, ptr.0 - base.0));
                live.push(ptr);
            }
            PairOp::Free { pick } if !live.is_empty() => {
                let ptr = live.swap_remove(pick % live.len());
                alloc.free(0, ptr).unwrap();
            }
            PairOp::Free { .. } => {}
            PairOp::EmptyCache => {
                alloc.empty_cache();
            }
            PairOp::RecordStream { pick } if !live.is_empty() => {
                let ptr = live[pick % live.len()];
                alloc.record_stream(ptr, Stream(7)).unwrap();
            }
            PairOp::RecordStream { .. } => {}
            // Ending or releasing a pool that is not open fails the same
            // way with the stash and without it: the outcome is compared.
            PairOp::BeginPrivate { pool } => out.push((0, alloc.begin_private(0, PrivatePoolId(pool, 0)).is_ok() as u64)),
            PairOp::EndPrivate { pool } => out.push((0, alloc.end_private(0, PrivatePoolId(pool, 0)).is_ok() as u64)),
            PairOp::ReleasePrivate { pool } => out.push((0, alloc.release_private(0, PrivatePoolId(pool, 0)).is_ok() as u64)),
        }
    }
    alloc.validate().map_err(|e| TestCaseError::fail(e.to_string()))?;
    let ((maps, unmaps), (moves, moved)) = (backend.vm_calls(), backend.vm_moves());
    let calls = [backend.allocate_calls(), backend.release_calls(), backend.vm_reserve_calls(), maps, unmaps, moves, moved];
    let reserved = alloc.stats(0).unwrap().reserved_bytes.all.current;
    for ptr in live {
        alloc.free(0, ptr).unwrap();
    }
    Ok((out, calls, reserved))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1000, ..ProptestConfig::default() })]

    /// The stash only saves work: with it or without it, every block lands
    /// in the same place and the driver sees the same calls (the replay's
    /// model of PyTorch has no stash), over two streams, a tag's pools,
    /// cache releases, private pools and blocks recorded on a third
    /// stream (held pending while a private pool is open).
    #[test]
    fn the_stash_never_moves_a_block(ops in prop::collection::vec(pair_op(), 1..120)) {
        for conf in ["expandable:false", "expandable:false,max_split_size_mb:24", "expandable:true"] {
            let with = placements(&ops, conf)?;
            let without = placements(&ops, &[conf, "stash:false"].join(","))?;
            prop_assert_eq!(with, without, "{}", conf);
        }
    }
}
