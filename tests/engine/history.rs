//! Memory history (`record_history`): the events a snapshot carries in
//! `device_traces`, named and ordered as PyTorch's, bounded, and complete
//! enough that a snapshot tidepool wrote replays to the run it recorded.

use crate::common;

use common::{host_allocator, MIB};
use tidepool::{Allocator, HistoryAction, Stream};

const S: Stream = Stream(7);

fn actions(alloc: &Allocator) -> Vec<(HistoryAction, u64, u64)> {
    alloc.history(0).unwrap().iter().map(|e| (e.action, e.addr, e.size)).collect()
}

#[test]
fn each_allocation_free_and_segment_is_an_event_in_pytorchs_words() {
    let (alloc, _) = host_allocator(1, 1 << 30, "expandable:false");
    alloc.allocate(0, 100, S).unwrap(); // before history: not kept
    alloc.record_history(Some(1000)).unwrap();
    let ptr = alloc.allocate(0, 3 * MIB as usize, S).unwrap();
    alloc.free(0, ptr).unwrap();
    alloc.empty_cache();
    let base = ptr.0;
    use HistoryAction::*;
    assert_eq!(
        actions(&alloc),
        [
            (SegmentAlloc, base, 20 * MIB),
            (Alloc, base, 3 * MIB),
            (FreeRequested, base, 3 * MIB),
            (FreeCompleted, base, 3 * MIB),
            (SegmentFree, base, 20 * MIB)
        ]
    );
    let history = alloc.history(0).unwrap();
    assert!(history.iter().all(|e| e.stream == S));
    assert!(history.windows(2).all(|w| w[0].time_us <= w[1].time_us));
    assert_eq!(tidepool::HistoryAction::SegmentUnmap.name(), "segment_unmap");
}

#[test]
fn history_entries_in_tidepool_conf_keeps_them_from_the_start() {
    let (alloc, _) = host_allocator(1, 1 << 30, "history_entries:3");
    let p = alloc.allocate(0, 4096, S).unwrap();
    alloc.free(0, p).unwrap();
    let kept: Vec<_> = alloc.history(0).unwrap().iter().map(|e| e.action).collect();
    assert_eq!(kept, [HistoryAction::Alloc, HistoryAction::FreeRequested, HistoryAction::FreeCompleted]);
    let (quiet, _) = host_allocator(1, 1 << 30, "");
    quiet.allocate(0, 4096, S).unwrap();
    assert!(quiet.history(0).unwrap().is_empty(), "history is off by default");
    assert!(tidepool::Config::builder().conf("history_entries:many").is_err());
}

#[test]
fn only_the_last_entries_are_kept_and_off_forgets_them() {
    let (alloc, _) = host_allocator(1, 1 << 30, "");
    alloc.record_history(Some(10)).unwrap();
    for _ in 0..100 {
        let p = alloc.allocate(0, 4096, S).unwrap();
        alloc.free(0, p).unwrap();
    }
    let kept = alloc.history(0).unwrap();
    assert_eq!(kept.len(), 10);
    assert_eq!(kept.last().unwrap().action, HistoryAction::FreeCompleted);
    alloc.record_history(None).unwrap();
    assert!(alloc.history(0).unwrap().is_empty());
}

#[test]
fn an_oom_is_an_event_with_the_devices_free_bytes() {
    let (alloc, _) = host_allocator(1, 64 * MIB, "");
    alloc.record_history(Some(100)).unwrap();
    assert!(alloc.allocate(0, 100 * MIB as usize, S).is_err());
    let oom = alloc.history(0).unwrap().into_iter().find(|e| e.action == HistoryAction::Oom).expect("an oom entry");
    assert_eq!((oom.addr, oom.size), (64 * MIB, 100 * MIB));
}
