//! Replay speed: events per second of `tidepool replay` on the example
//! traces (and on ../shared/traces when present), parsing excluded. And
//! the rate at which a recording's writer formats rows, which bounds the
//! rate a recorded process can allocate at without waiting for it.

use std::path::Path;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use tidepool::recording::rows::{Action, Row, RowWriter};
use tidepool::{Allocator, Config, DevicePtr, Stream};
use tidepool_tools::trace::replay::{replay, Model, ReplayOptions};
use tidepool_tools::trace::Event;

fn traces() -> Vec<(String, tidepool_tools::trace::Trace)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let mut paths = vec![root.join("examples/traces/transformer-varlen-train.csv")];
    for shared in ["../shared/traces/rmm-csv", "../shared/traces/pytorch-snapshots"] {
        let mut found: Vec<_> = std::fs::read_dir(root.join(shared)).into_iter().flatten().flatten().map(|e| e.path()).collect();
        found.sort();
        paths.extend(found);
    }
    paths.into_iter().map(|p| (p.file_name().unwrap().to_string_lossy().into_owned(), tidepool_tools::trace::load(&p).unwrap())).collect()
}

/// Each trace with tidepool's default policy (expandable segments, what
/// `plan` bisects with) and with whole segments.
fn replay_speed(c: &mut Criterion) {
    let mut group = c.benchmark_group("replay");
    group.sample_size(10).warm_up_time(Duration::from_millis(500)).measurement_time(Duration::from_secs(2));
    for (name, trace) in traces() {
        group.throughput(Throughput::Elements(trace.events.len() as u64));
        for model in [Model::Tidepool, Model::WholeSegments] {
            let options = ReplayOptions { capacity: 1 << 50, model, conf: String::new(), samples: 0, record_to: None };
            let id = BenchmarkId::new(model.name(), &name);
            group.bench_function(id, |b| b.iter(|| replay(&trace, &options).unwrap()));
        }
    }
    group.finish();
}

/// The rows a recording of the trace's allocations and frees (served by
/// tidepool) buffers for its writer.
fn recorded_rows(trace: &tidepool_tools::trace::Trace) -> Vec<Row> {
    let alloc = Allocator::new(Config::builder().host(1, 1 << 50).build().unwrap()).unwrap();
    let mut live = vec![(0, 0, 0); trace.allocs as usize];
    let mut rows = Vec::with_capacity(trace.events.len());
    for (i, event) in trace.events.iter().enumerate() {
        let (action, (pointer, size, stream)) = match *event {
            Event::Alloc { id, size, stream, .. } => {
                let ptr = alloc.allocate(0, size as usize, Stream(stream)).unwrap();
                live[id as usize] = (ptr.0, size, stream);
                (Action::Allocate, live[id as usize])
            }
            Event::Free { id } => {
                alloc.free(0, DevicePtr(live[id as usize].0)).unwrap();
                (Action::Free, live[id as usize])
            }
        };
        // The clock is read once every 64 rows.
        rows.push(Row { thread: 1, micros: i as u64 / 64, action, pointer, size, stream });
    }
    rows
}

fn format_speed(c: &mut Criterion) {
    let mut group = c.benchmark_group("format_rows");
    for (name, trace) in traces() {
        let rows = recorded_rows(&trace);
        group.throughput(Throughput::Elements(rows.len() as u64));
        let mut buffer = Vec::new();
        group.bench_function(BenchmarkId::from_parameter(name), |b| {
            b.iter(|| {
                let mut writer = RowWriter::default();
                rows.chunks(4096).map(|chunk| writer.format(chunk, &mut buffer).len()).sum::<usize>()
            })
        });
    }
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(20).warm_up_time(Duration::from_millis(500)).measurement_time(Duration::from_secs(2));
    targets = replay_speed, format_speed
}
criterion_main!(benches);
