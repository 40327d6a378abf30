//! PyTorch memory snapshots (`torch.cuda.memory._dump_snapshot`) as traces.
//!
//! Recording starts mid-run, so the live set at the trace's start is
//! rebuilt first: walking each device's trace backwards from the final
//! segments, a block live at the end was live before unless an `alloc`
//! made it, and a `free_completed` means it was live before. Those blocks
//! become allocations at the start; then `alloc` and `free_completed` (the
//! moment PyTorch can reuse memory) replay in order. PyTorch's own reserved
//! bytes come from the segments and the segment events, walked the same way.
#![forbid(unsafe_code)]

use std::collections::{BTreeMap, HashMap};
use std::io::Read;

use super::{Format, RecordedOom, Trace, TraceError};
use crate::pickle::{NodeId, PickleDoc};

struct Reader<'a> {
    doc: &'a PickleDoc,
    file: &'a str,
}

impl Reader<'_> {
    fn fail<T>(&self, message: impl Into<String>) -> Result<T, TraceError> {
        Err(TraceError { file: self.file.to_string(), location: String::new(), message: message.into() })
    }

    fn field(&self, dict: NodeId, key: &str, what: &str) -> Result<NodeId, TraceError> {
        match self.doc.get(dict, key) {
            Some(id) => Ok(id),
            None => self.fail(format!("{what} has no {key:?}")),
        }
    }

    fn uint(&self, dict: NodeId, key: &str, what: &str) -> Result<u64, TraceError> {
        let id = self.field(dict, key, what)?;
        match self.doc.int(id).and_then(|v| u64::try_from(v).ok()) {
            Some(v) => Ok(v),
            None => self.fail(format!("{what}: {key:?} is not a non-negative integer that fits 64 bits")),
        }
    }

    /// An optional non-negative integer field (None when absent or not one).
    fn optional_uint(&self, dict: NodeId, key: &str) -> Option<u64> {
        self.doc.get(dict, key).and_then(|v| self.doc.int(v)).and_then(|v| u64::try_from(v).ok())
    }

    fn list(&self, id: NodeId, what: &str) -> Result<&[NodeId], TraceError> {
        match self.doc.items(id) {
            Some(items) => Ok(items),
            None => self.fail(format!("{what} is not a list")),
        }
    }
}

/// A live block: requested size and stream.
type Live = (u64, u64);

/// One entry of a device's trace: action, address (for an `oom`, the
/// device's free memory), size and stream.
type Entry<'a> = (&'a str, u64, u64, u64);

/// What the snapshot's segments say of each device when it was taken: the
/// blocks live then, and the bytes its segments held.
struct AtEnd {
    live: Vec<BTreeMap<u64, Live>>,
    reserved: Vec<u64>,
}

pub fn read(input: impl Read, file: &str) -> Result<Trace, TraceError> {
    let doc = PickleDoc::parse(input).map_err(|e| TraceError {
        file: file.to_string(),
        location: format!("byte {}", e.offset),
        message: e.message,
    })?;
    let r = Reader { doc: &doc, file };
    let root = doc.root();
    let segments = r.list(r.field(root, "segments", "the snapshot")?, "segments")?;
    let traces = r.list(r.field(root, "device_traces", "the snapshot")?, "device_traces")?;

    let mut trace = Trace::new(file, Format::TorchSnapshot);
    trace.pytorch_conf = pytorch_conf(&r, root, &mut trace);
    let devices = traces.len().max(1);
    let at_end = at_end(&r, segments, devices)?;

    let mut recorded_peaks = Vec::with_capacity(devices);
    let mut any_segment_info = !segments.is_empty();
    let mut history = false;
    // A snapshot taken without history may list no device at all.
    for device in 0..devices {
        let events = match traces.get(device) {
            Some(&events) => r.list(events, "a device trace")?,
            None => &[],
        };
        history |= !events.is_empty();
        let entries = events.iter().map(|&event| entry(&r, event)).collect::<Result<Vec<_>, _>>()?;
        let (live, reserved_at_start) = at_start(&at_end, device, &entries);
        let replayed = replay_device(&mut trace, device, &live, reserved_at_start, &entries);
        recorded_peaks.push(replayed.peak_reserved);
        any_segment_info |= replayed.segment_events;
    }
    if !history {
        trace.warnings.add("the snapshot has no allocation history (torch.cuda.memory._record_memory_history() before the run records it): only the blocks live when it was taken are replayed");
    }
    trace.devices = trace.devices.max(devices as u32);
    record_pytorch_peaks(&mut trace, recorded_peaks, any_segment_info);
    Ok(trace)
}

/// Per device: the blocks live when the snapshot was taken, and the bytes
/// in its segments then.
fn at_end(r: &Reader, segments: &[NodeId], devices: usize) -> Result<AtEnd, TraceError> {
    let mut at_end = AtEnd { live: vec![BTreeMap::new(); devices], reserved: vec![0u64; devices] };
    for &segment in segments {
        let device = r.uint(segment, "device", "a segment")? as usize;
        if device >= devices {
            return r.fail(format!("a segment is on device {device}, but the trace has {devices} devices"));
        }
        let stream = r.uint(segment, "stream", "a segment")?;
        at_end.reserved[device] = at_end.reserved[device].saturating_add(r.uint(segment, "total_size", "a segment")?);
        for &block in r.list(r.field(segment, "blocks", "a segment")?, "blocks")? {
            let state = r.field(block, "state", "a block")?;
            if r.doc.str(state) == Some("inactive") {
                continue;
            }
            let address = r.uint(block, "address", "a block")?;
            let requested = match r.doc.get(block, "requested_size") {
                Some(_) => r.uint(block, "requested_size", "a block")?,
                None => r.uint(block, "size", "a block")?,
            };
            at_end.live[device].insert(address, (requested, stream));
        }
    }
    Ok(at_end)
}

/// One entry of a device's trace.
fn entry<'a>(r: &Reader<'a>, event: NodeId) -> Result<Entry<'a>, TraceError> {
    let doc = r.doc;
    let action = doc.get(event, "action").and_then(|a| doc.str(a)).unwrap_or("");
    // For an `oom` entry, `addr` is the device's free memory (in
    // `device_free` from PyTorch 2.1 on).
    let addr = match action {
        "snapshot" | "" => 0,
        "oom" => r.optional_uint(event, "device_free").or_else(|| r.optional_uint(event, "addr")).unwrap_or(0),
        _ => r.uint(event, "addr", "a trace entry")?,
    };
    let size = match action {
        "snapshot" | "" => 0,
        "oom" => r.optional_uint(event, "size").unwrap_or(0),
        _ => r.uint(event, "size", "a trace entry")?,
    };
    let stream = r.optional_uint(event, "stream").unwrap_or(0);
    Ok((action, addr, size, stream))
}

/// Walking `device`'s trace backwards from the end: what was live, and
/// reserved, when the trace starts.
fn at_start(at_end: &AtEnd, device: usize, entries: &[Entry]) -> (BTreeMap<u64, Live>, i128) {
    let mut live = at_end.live[device].clone();
    let mut reserved_at_start = at_end.reserved[device] as i128;
    for &(action, addr, size, stream) in entries.iter().rev() {
        match action {
            "alloc" => {
                live.remove(&addr);
            }
            "free_completed" => {
                live.insert(addr, (size, stream));
            }
            "segment_alloc" | "segment_map" => reserved_at_start -= size as i128,
            "segment_free" | "segment_unmap" => reserved_at_start += size as i128,
            _ => {}
        }
    }
    (live, reserved_at_start)
}

/// What replaying one device's trace found of PyTorch's reserved bytes.
struct Replayed {
    /// The most its segments held.
    peak_reserved: u64,
    /// Whether the trace has segment events.
    segment_events: bool,
}

/// Forwards: the allocations live at the start, then `device`'s trace, as
/// events of `trace`. They are the device's first events: an `oom` entry
/// counts them.
fn replay_device(trace: &mut Trace, device: usize, live: &BTreeMap<u64, Live>, reserved_at_start: i128, entries: &[Entry]) -> Replayed {
    let first_event = trace.events.len();
    let mut ids: HashMap<u64, u32> = HashMap::new();
    for (&addr, &(size, stream)) in live {
        ids.insert(addr, trace.alloc(size, stream, device as u32));
    }
    let mut reserved = reserved_at_start.max(0) as u64;
    let mut replayed = Replayed { peak_reserved: reserved, segment_events: false };
    for &(action, addr, size, stream) in entries {
        match action {
            "alloc" => {
                if let Some(old) = ids.remove(&addr) {
                    trace.warnings.add(format!("device {device}: {addr:#x} allocated while live; the old one is freed"));
                    trace.free(old);
                }
                ids.insert(addr, trace.alloc(size, stream, device as u32));
            }
            "free_completed" => match ids.remove(&addr) {
                Some(id) => trace.free(id),
                None => trace.warnings.add(format!("device {device}: free of {addr:#x}, which is not live (skipped)")),
            },
            "segment_alloc" | "segment_map" => {
                replayed.segment_events = true;
                reserved += size;
                replayed.peak_reserved = replayed.peak_reserved.max(reserved);
            }
            "segment_free" | "segment_unmap" => reserved = reserved.saturating_sub(size),
            "oom" => trace.pytorch_ooms.push(RecordedOom {
                device: device as u32,
                event: trace.events.len() - first_event,
                requested: size,
                stream,
                reserved,
                device_free: addr,
            }),
            _ => {}
        }
    }
    replayed
}

/// PyTorch's peaks of reserved bytes, per device and in all, where the
/// snapshot's segments say them (`any_segment_info`). PyTorch held at least
/// what was live at every moment: segments that hold less at their peak (a
/// snapshot whose segments are not the allocator's, such as
/// `tidepool.record`'s) say nothing of PyTorch.
fn record_pytorch_peaks(trace: &mut Trace, recorded_peaks: Vec<u64>, mut any_segment_info: bool) {
    let recorded_peak = recorded_peaks.iter().copied().max().unwrap_or(0);
    let live = trace.peak_requested_per_device();
    if any_segment_info && recorded_peaks.iter().zip(&live).any(|(&held, &live)| held < live) {
        trace.warnings.add("the snapshot's segments hold less than its peak of live memory: no PyTorch figure recorded");
        any_segment_info = false;
    }
    if any_segment_info {
        trace.pytorch_peak_reserved_per_device = recorded_peaks;
    }
    trace.pytorch_peak_reserved = any_segment_info.then_some(recorded_peak);
}

/// PyTorch's recorded allocator settings as TIDEPOOL_CONF, for the model of
/// its policy; settings the model cannot follow become warnings.
fn pytorch_conf(r: &Reader, root: NodeId, trace: &mut Trace) -> String {
    let doc = r.doc;
    let Some(settings) = doc.get(root, "allocator_settings") else { return String::new() };
    let mut conf = Vec::new();
    if let Some(v) = doc.get(settings, "max_split_size").and_then(|v| doc.int(v)) {
        if v > 0 && v != i64::MAX as i128 && v != u64::MAX as i128 {
            conf.push(format!("max_split_size_mb:{}", v >> 20));
        }
    }
    if let Some(div) = doc.get(settings, "roundup_power2_divisions") {
        let values: Vec<i128> = match doc.node(div) {
            crate::pickle::Node::Dict(items) => items.iter().filter_map(|&(_, v)| doc.int(v)).collect(),
            _ => doc.int(div).into_iter().collect(),
        };
        let nonzero: Vec<i128> = values.into_iter().filter(|&v| v > 1).collect();
        if let Some(&first) = nonzero.first() {
            if nonzero.iter().any(|&v| v != first) {
                trace.warnings.add("roundup_power2_divisions differs by size; the model uses one value for all");
            }
            conf.push(format!("roundup_power2_divisions:{first}"));
        }
    }
    if doc.get(settings, "expandable_segments").and_then(|v| doc.int(v)) == Some(1) {
        trace.pytorch_expandable_segments = true;
    }
    conf.join(",")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::Event;
    use tidepool::pickle::{dumps, PyValue};

    fn event(action: &str, addr: u64, size: u64) -> PyValue {
        PyValue::dict([
            ("action", PyValue::str(action)),
            ("addr", PyValue::int(addr)),
            ("size", PyValue::int(size)),
            ("stream", PyValue::int(0)),
        ])
    }

    fn block(address: u64, size: u64, requested: u64, state: &str) -> PyValue {
        PyValue::dict([
            ("address", PyValue::int(address)),
            ("size", PyValue::int(size)),
            ("requested_size", PyValue::int(requested)),
            ("state", PyValue::str(state)),
        ])
    }

    fn snapshot(blocks: Vec<PyValue>, events: Vec<PyValue>) -> Vec<u8> {
        let segment = PyValue::dict([
            ("device", PyValue::int(0)),
            ("address", PyValue::int(0x1000u64)),
            ("total_size", PyValue::int(2u64 << 20)),
            ("stream", PyValue::int(0)),
            ("blocks", PyValue::List(blocks)),
        ]);
        dumps(&PyValue::dict([("segments", PyValue::List(vec![segment])), ("device_traces", PyValue::List(vec![PyValue::List(events)]))]))
    }

    #[test]
    fn the_live_set_at_the_start_is_rebuilt_backwards() {
        // At the end: A (0x1000) live; B (0x2000) was freed during the trace;
        // C (0x3000) was allocated and freed during the trace.
        let bytes = snapshot(
            vec![block(0x1000, 4096, 4000, "active_allocated"), block(0x2000, 2 * 1024 * 1024 - 4096, 0, "inactive")],
            vec![
                event("free_requested", 0x2000, 512),
                event("free_completed", 0x2000, 512),
                event("alloc", 0x3000, 100),
                event("free_completed", 0x3000, 100),
            ],
        );
        let trace = read(&bytes[..], "t.pickle").unwrap();
        // A and B were live before the trace began: allocated first, by address.
        assert_eq!(
            trace.events,
            vec![
                Event::Alloc { id: 0, size: 4000, stream: 0, device: 0 },
                Event::Alloc { id: 1, size: 512, stream: 0, device: 0 },
                Event::Free { id: 1 },
                Event::Alloc { id: 2, size: 100, stream: 0, device: 0 },
                Event::Free { id: 2 },
            ]
        );
        assert_eq!(trace.pytorch_peak_reserved, Some(2 << 20));
    }

    #[test]
    fn segments_that_hold_less_than_was_live_are_no_recorded_figure() {
        // 3 MiB came and went inside a snapshot whose one segment holds 2 MiB
        // and no segment event says more: not what PyTorch held.
        let bytes = snapshot(vec![], vec![event("alloc", 0x9000_0000, 3 << 20), event("free_completed", 0x9000_0000, 3 << 20)]);
        let trace = read(&bytes[..], "t.pickle").unwrap();
        assert_eq!((trace.pytorch_peak_reserved, trace.pytorch_peak_reserved_per_device.len()), (None, 0));
        assert!(trace.warnings.first.iter().any(|w| w.contains("hold less than its peak of live memory")), "{:?}", trace.warnings);
    }

    #[test]
    fn reserved_follows_the_segment_events() {
        let seg = 20u64 << 20;
        let bytes = snapshot(vec![], vec![event("segment_alloc", 0x9000_0000, seg), event("segment_free", 0x9000_0000, seg)]);
        let trace = read(&bytes[..], "t.pickle").unwrap();
        // 2 MiB at the end; a 20 MiB segment came and went: peak 22 MiB.
        assert_eq!(trace.pytorch_peak_reserved, Some((2 << 20) + seg));
    }

    #[test]
    fn an_oom_entry_is_kept_with_what_pytorch_held_and_the_device_had_free() {
        let seg = 20u64 << 20;
        let oom = PyValue::dict([
            ("action", PyValue::str("oom")),
            ("size", PyValue::int(64u64 << 20)),
            ("device_free", PyValue::int(5u64 << 20)),
            ("stream", PyValue::int(7)),
        ]);
        let events = vec![
            event("segment_alloc", 0x9000_0000, seg),
            event("alloc", 0x3000, 100),
            oom,
            event("free_completed", 0x3000, 100),
            event("segment_free", 0x9000_0000, seg),
        ];
        let trace = read(&snapshot(vec![], events)[..], "t.pickle").unwrap();
        let expected = RecordedOom { device: 0, event: 1, requested: 64 << 20, stream: 7, reserved: (2 << 20) + seg, device_free: 5 << 20 };
        assert_eq!(trace.pytorch_ooms, [expected]);
        assert_eq!(expected.usable(), (27 << 20));
        // Before PyTorch 2.1 the free memory was in `addr`.
        let old = PyValue::dict([("action", PyValue::str("oom")), ("size", PyValue::int(1u64 << 20)), ("addr", PyValue::int(3u64 << 20))]);
        let trace = read(&snapshot(vec![], vec![old])[..], "t.pickle").unwrap();
        assert_eq!((trace.pytorch_ooms[0].device_free, trace.pytorch_ooms[0].event), (3 << 20, 0));
    }

    #[test]
    fn a_snapshot_without_history_replays_the_blocks_live_in_it_and_says_so() {
        for traces in [vec![], vec![PyValue::List(vec![])]] {
            let segment = PyValue::dict([
                ("device", PyValue::int(0)),
                ("address", PyValue::int(0x1000u64)),
                ("total_size", PyValue::int(2u64 << 20)),
                ("stream", PyValue::int(0)),
                ("blocks", PyValue::List(vec![block(0x1000, 4096, 4000, "active_allocated")])),
            ]);
            let bytes = dumps(&PyValue::dict([("segments", PyValue::List(vec![segment])), ("device_traces", PyValue::List(traces))]));
            let trace = read(&bytes[..], "t.pickle").unwrap();
            assert_eq!(trace.events, vec![Event::Alloc { id: 0, size: 4000, stream: 0, device: 0 }]);
            assert_eq!(trace.pytorch_peak_reserved, Some(2 << 20));
            assert!(trace.warnings.first.iter().any(|w| w.contains("no allocation history")), "{:?}", trace.warnings);
        }
        // With history, no such warning.
        let trace = read(&snapshot(vec![], vec![event("alloc", 0x3000, 100)])[..], "t.pickle").unwrap();
        assert!(trace.warnings.first.is_empty(), "{:?}", trace.warnings);
    }

    #[test]
    fn an_oom_entry_counts_the_allocations_live_at_the_start() {
        // One 200 MiB segment holding A (live before the trace began) and C
        // (allocated in it); then 100 MiB more asked with 50 MiB free: 300
        // MiB needed, 250 usable.
        let mib = 1u64 << 20;
        let segment = PyValue::dict([
            ("device", PyValue::int(0)),
            ("address", PyValue::int(0x1000u64)),
            ("total_size", PyValue::int(200 * mib)),
            ("stream", PyValue::int(0)),
            (
                "blocks",
                PyValue::List(vec![
                    block(0x1000, 100 * mib, 100 * mib, "active_allocated"),
                    block(0x1000 + 100 * mib, 100 * mib, 100 * mib, "active_allocated"),
                ]),
            ),
        ]);
        let oom =
            PyValue::dict([("action", PyValue::str("oom")), ("size", PyValue::int(100 * mib)), ("device_free", PyValue::int(50 * mib))]);
        let events = PyValue::List(vec![event("alloc", 0x1000 + 100 * mib, 100 * mib), oom]);
        let bytes = dumps(&PyValue::dict([("segments", PyValue::List(vec![segment])), ("device_traces", PyValue::List(vec![events]))]));
        let trace = read(&bytes[..], "t.pickle").unwrap();
        // The device's events: A (live at the start), then C; the request came next.
        assert_eq!(trace.events.len(), 2);
        let oom = trace.pytorch_ooms[0];
        assert_eq!((oom.event, oom.usable()), (2, 250 * mib));
        // So no policy serves it: A and C stay live (counting only A, every one would).
        for model in crate::trace::replay::Model::ALL {
            assert!(!crate::trace::replay::serves_recorded_oom(&trace, &oom, model, "").unwrap(), "{model:?}");
        }
    }
}
