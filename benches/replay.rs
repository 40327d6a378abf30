//! Replay speed: events per second of `tidepool replay` on the example
//! traces (and on ../shared/traces when present), parsing excluded.

use std::path::Path;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use tidepool::trace::replay::{replay, Policy, ReplayOptions};

fn traces() -> Vec<(String, tidepool::trace::Trace)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut paths = vec![root.join("examples/traces/transformer-varlen-train.csv")];
    for shared in ["../shared/traces/rmm-csv/gpt2-b8-varlen.csv", "../shared/traces/pytorch-snapshots/kk_memory_ctx128_fullstep.pickle"] {
        let path = root.join(shared);
        if path.exists() {
            paths.push(path);
        }
    }
    paths
        .into_iter()
        .map(|p| (p.file_name().unwrap().to_string_lossy().into_owned(), tidepool::trace::load(&p).unwrap()))
        .collect()
}

fn replay_speed(c: &mut Criterion) {
    let mut group = c.benchmark_group("replay");
    for (name, trace) in traces() {
        group.throughput(Throughput::Elements(trace.events.len() as u64));
        let options = ReplayOptions { capacity: 1 << 50, policy: Policy::Tidepool, conf: String::new(), samples: 0, record_to: None };
        group.bench_function(BenchmarkId::from_parameter(name), |b| b.iter(|| replay(&trace, &options).unwrap()));
    }
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(20).warm_up_time(Duration::from_millis(500)).measurement_time(Duration::from_secs(2));
    targets = replay_speed
}
criterion_main!(benches);
