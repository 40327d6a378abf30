//! Replay and plan on real traces (../shared/traces, skipped when absent)
//! and on small files made here: the PyTorch model against PyTorch's own
//! figures, determinism, recordings that replay to the same peaks, bad
//! files, pictures and the command line.

use crate::common;
use crate::common::MIB;

use std::path::{Path, PathBuf};
use std::process::Command;

use tidepool_tools::trace::plan::{smallest_capacity, smallest_capacity_per_device};
use tidepool_tools::trace::replay::{self, replay, replay_per_device, Model, ReplayOptions};
use tidepool_tools::trace::{self, Trace};

const GIB: f64 = (1u64 << 30) as f64;

fn shared(relative: &str) -> Option<PathBuf> {
    common::shared_traces(relative)
}

fn options(model: Model) -> ReplayOptions {
    ReplayOptions { capacity: 1 << 50, model, conf: String::new(), samples: 0, record_to: None }
}

fn tmp(name: &str) -> PathBuf {
    Path::new(env!("CARGO_TARGET_TMPDIR")).join(name)
}

#[test]
fn the_pytorch_model_lands_within_2_percent_of_pytorchs_recorded_peak_reserved() {
    for name in [
        "kk_memory_ctx128_fullstep.pickle",
        "kk_memory_ctx256_forward_mixed.pickle",
        "wed_medium_128_inference.pickle",
        "wed_medium_512_training.pickle",
    ] {
        let Some(path) = shared(&format!("pytorch-snapshots/{name}")) else {
            continue;
        };
        let trace = trace::load(&path).unwrap();
        let recorded = trace.pytorch_peak_reserved.expect("snapshots record segments") as f64;
        let report = replay(&trace, &options(Model::Pytorch)).unwrap();
        let error = report.peak_reserved_bytes as f64 / recorded - 1.0;
        assert!(error.abs() <= 0.02, "{name}: model {} vs recorded {recorded}: {:.2} %", report.peak_reserved_bytes, 100.0 * error);
        assert_eq!(report.ooms, 0);
    }
}

#[test]
fn the_rmm_logs_replay_to_the_published_pytorch_policy_figures() {
    // ../shared/traces/README.md: PyTorch-policy peak reserved per log.
    for (name, gib) in [("resnet50-b64.csv", 6.438), ("gpt2-b8-s1024.csv", 29.143), ("gpt2-b8-varlen.csv", 30.383)] {
        let Some(path) = shared(&format!("rmm-csv/{name}")) else {
            continue;
        };
        let trace = trace::load(&path).unwrap();
        let report = replay(&trace, &options(Model::Pytorch)).unwrap();
        let ours = report.peak_reserved_bytes as f64 / GIB;
        assert!((ours / gib - 1.0).abs() <= 0.02, "{name}: {ours:.3} GiB vs {gib} GiB");
    }
}

#[test]
fn plan_finds_the_published_smallest_device() {
    let Some(path) = shared("rmm-csv/gpt2-b8-varlen.csv") else {
        return;
    };
    let trace = trace::load(&path).unwrap();
    let plan = smallest_capacity(&trace, Model::Pytorch, "").unwrap();
    let gib = plan.min_capacity as f64 / GIB;
    assert!((gib / 30.383 - 1.0).abs() <= 0.01, "{gib:.3} GiB");
    assert!(plan.min_capacity >= trace.peak_requested());
    // One step less does not fit; the step is a quarter percent of the peak.
    assert_eq!(plan.step, (trace.peak_requested() / 400).next_multiple_of(1 << 20));
    let smaller = ReplayOptions { capacity: plan.min_capacity - plan.step, ..options(Model::Pytorch) };
    let short = replay(&trace, &smaller).unwrap();
    assert!(short.ooms > 0);
    let first = short.first_oom.expect("the first OOM is reported");
    assert!(first.event < short.events && first.message.contains("out of memory"), "{first:?}");
    let fits = ReplayOptions { capacity: plan.min_capacity, ..options(Model::Pytorch) };
    assert_eq!(replay(&trace, &fits).unwrap().first_oom, None);
}

#[test]
fn a_trace_of_several_gpus_gets_each_cards_figures_not_their_sum() {
    let Some(path) = shared("pytorch-snapshots/constructorsun_two_gpus.pickle") else {
        return;
    };
    let trace = trace::load(&path).unwrap();
    let peaks = trace.peak_requested_per_device();
    assert_eq!(trace.peak_requested(), *peaks.iter().max().unwrap(), "one card's peak, never a sum");
    let reports = replay_per_device(&trace, &options(Model::Tidepool)).unwrap();
    assert!(reports.len() >= 2);
    for report in &reports {
        let device = report.device as usize;
        assert_eq!(report.peak_requested_bytes, peaks[device]);
        // PyTorch recorded each card: the replay of that card lands near it.
        let recorded = trace.pytorch_peak_reserved_per_device[device] as f64;
        let ratio = report.peak_reserved_bytes as f64 / recorded;
        assert!((0.95..=1.06).contains(&ratio), "device {device}: {} against recorded {recorded}", report.peak_reserved_bytes);
    }
    let largest = reports.iter().map(|r| r.peak_requested_bytes).max().unwrap() as f64;
    assert!((largest / GIB - 78.29).abs() < 0.01, "{}", largest / GIB);
}

#[test]
fn a_plan_serves_the_request_the_recorded_run_could_not_and_names_each_device_in_its_messages() {
    // Device 1 holds 2 MiB (a 20 MiB segment), then PyTorch recorded a
    // failed request of 300 MiB there (its part's event 1), then the 2 MiB went.
    let mut trace = trace::Trace::new("two cards", trace::Format::TorchSnapshot);
    let a = trace.alloc(40 << 20, 0, 0);
    let b = trace.alloc(2 << 20, 0, 1);
    trace.free(b);
    trace.free(a);
    let oom = trace::RecordedOom { device: 1, event: 1, requested: 300 << 20, stream: 0, reserved: 20 << 20, device_free: 0 };
    trace.pytorch_ooms.push(oom);
    let (whole, origin) = trace.on_device(1).with_failed_requests();
    assert_eq!((whole.events.len(), whole.peak_requested()), (4, 302 << 20));
    assert_eq!(origin, [0, 1, 1, 1], "each event's index in the recorded part");
    let plans = smallest_capacity_per_device(&trace, Model::WholeSegments, "", Some(2 << 20)).unwrap();
    assert_eq!((plans[1].device, plans[1].min_capacity), (1, 320 << 20), "the 2 MiB block's segment and the request");
    let less = plans[1].one_step_less.as_ref().unwrap();
    assert_eq!(less.event, 1, "the failed request, numbered as the trace numbers it");
    assert!(less.message.contains("on device 1:") && less.message.contains("300.00 MiB"), "{}", less.message);
    assert_eq!(plans[0].min_capacity, 40 << 20, "device 0 recorded no failure");
    // The replay of what ran names the device too.
    let small = ReplayOptions { capacity: 1 << 20, ..options(Model::Tidepool) };
    let reports = replay_per_device(&trace, &small).unwrap();
    let first = reports[1].first_oom.as_ref().unwrap();
    assert!(first.message.contains("on device 1:"), "{}", first.message);
}

#[test]
fn the_model_of_pytorchs_expandable_segments_lands_on_the_peaks_pytorch_recorded_with_them() {
    // This snapshot's run set expandable_segments:True.
    let Some(path) = shared("pytorch-snapshots/constructorsun_two_gpus.pickle") else {
        return;
    };
    let trace = trace::load(&path).unwrap();
    assert!(trace.pytorch_expandable_segments, "the snapshot's settings say so");
    assert!(trace.per_device().iter().all(|(_, part)| part.pytorch_expandable_segments), "and each card's part");
    for report in replay_per_device(&trace, &options(Model::PytorchExpandable)).unwrap() {
        let device = report.device as usize;
        let recorded = trace.pytorch_peak_reserved_per_device[device] as f64;
        let error = report.peak_reserved_bytes as f64 / recorded - 1.0;
        // Device 1 ran out of memory in the recorded run (its `oom` event):
        // PyTorch gave cached pages back and stayed under the card's size,
        // which the unlimited replay does not know. The others: exact.
        if device == 1 {
            assert!(error > 0.0 && error < 0.06, "device 1: {:.2} %", 100.0 * error);
        } else {
            assert!(
                error.abs() <= 0.005,
                "device {device}: model {} vs recorded {recorded}: {:.2} %",
                report.peak_reserved_bytes,
                100.0 * error
            );
        }
        // Plain segments, PyTorch's default, miss by more on every card.
        let plain = replay_per_device(&trace, &options(Model::Pytorch)).unwrap()[device].peak_reserved_bytes as f64;
        assert!((plain / recorded - 1.0).abs() > error.abs(), "device {device}");
    }
    // So it is the model `tidepool replay` puts beside the recorded figure.
    let (ok, stdout, stderr) = tidepool_cli(&["replay", path.to_str().unwrap()]);
    assert!(ok, "{stderr}");
    let header = stdout.lines().nth(1).unwrap();
    assert!(header.contains("pytorch expandable model") && !header.contains("pytorch model"), "{stdout}");
    assert!(!stderr.contains("expandable_segments"), "no warning left: {stderr}");
    let (ok, stdout, stderr) = tidepool_cli(&["plan", path.to_str().unwrap()]);
    assert!(ok, "{stderr}");
    // The need serves device 1's failed request too: 78.29 GiB live and the 4.94 GiB more it asked.
    assert!(
        stdout.contains("PyTorch's allocator with expandable segments (as recorded): each of the 3 devices fits an H100 NVL"),
        "{stdout}"
    );
    // Device 1's run asked 4.94 GiB more than its 78.42 GiB held and 91 MiB free:
    // live memory, which no policy serves (the models run out where PyTorch did).
    let parts = trace.per_device();
    let (_, card) = parts.iter().find(|(d, _)| *d == 1).unwrap();
    let oom = card.pytorch_ooms[0];
    assert_eq!((oom.requested, oom.device_free), (5_308_694_528, 95_682_560));
    assert!(Model::ALL.iter().all(|&p| !replay::serves_recorded_oom(card, &oom, p, "").unwrap()));
    // On the memory that run had (held + free at its OOM), the model lands
    // on the recorded peak there too, giving memory back as often (six
    // segment_unmap events in the snapshot).
    let on_the_card = ReplayOptions { capacity: oom.usable(), ..options(Model::PytorchExpandable) };
    let report = replay(card, &on_the_card).unwrap();
    let recorded = trace.pytorch_peak_reserved_per_device[1] as f64;
    let error = report.peak_reserved_bytes as f64 / recorded - 1.0;
    assert!(error.abs() <= 0.001, "device 1 on {} bytes: {:.3} %", oom.usable(), 100.0 * error);
    assert_eq!((report.ooms, report.device_frees), (0, 6));
    let err = replay::serves_recorded_oom(&trace, &oom, Model::Tidepool, "").unwrap_err();
    assert!(err.contains("one device's part"), "{err}");
    assert!(stdout.contains("The recorded run ran out of memory at event 287 asking 4.94 GiB (the needs above serve it too)"), "{stdout}");
    assert!(stdout.contains("tidepool runs out too, tidepool expandable:false runs out too"), "{stdout}");
}

#[test]
fn a_recorded_out_of_memory_is_tried_again_with_each_policy_on_the_memory_pytorch_had() {
    // Ten 4 MiB blocks in two 20 MiB segments, every other one freed: 20 MiB
    // live, and PyTorch cannot give either segment back. Then 30 MiB asked
    // with 60 MiB to use: PyTorch ran out (40 held + 30 > 60), and so would
    // its expandable segments (no 20 MiB piece is wholly free); tidepool's
    // give the holes' 2 MiB pages back.
    let mut trace = Trace::new("fragmented", trace::Format::RmmCsv);
    let ids: Vec<u32> = (0..10).map(|_| trace.alloc(4 << 20, 0, 0)).collect();
    for id in ids.iter().skip(1).step_by(2) {
        trace.free(*id);
    }
    let oom = trace::RecordedOom { device: 0, event: 15, requested: 30 << 20, stream: 0, reserved: 40 << 20, device_free: 20 << 20 };
    let served = |model| replay::serves_recorded_oom(&trace, &oom, model, "").unwrap();
    assert!(!served(Model::Pytorch) && !served(Model::WholeSegments), "the model runs out where PyTorch did");
    assert!(!served(Model::PytorchExpandable));
    assert!(served(Model::Tidepool));
    // With less memory than live + asked, nobody serves it.
    let tight = trace::RecordedOom { device_free: 8 << 20, ..oom };
    assert!(Model::ALL.iter().all(|&p| !replay::serves_recorded_oom(&trace, &tight, p, "").unwrap()));
}

#[test]
fn replay_json_puts_the_largest_card_on_top_and_every_card_in_devices() {
    let Some(path) = shared("pytorch-snapshots/constructorsun_two_gpus.pickle") else {
        return;
    };
    let (ok, stdout, stderr) = tidepool_cli(&["replay", path.to_str().unwrap(), "--json", "--policy", "pytorch,expandable"]);
    assert!(ok, "{stderr}");
    let objects: Vec<serde_json::Value> = stdout.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(objects.len(), 2, "one object per policy: {stdout}");
    for object in &objects {
        let devices = object["devices"].as_array().unwrap();
        assert_eq!(devices.iter().map(|d| d["device"].as_u64().unwrap()).collect::<Vec<_>>(), [0, 1, 2]);
        let largest = devices.iter().max_by_key(|d| d["peak_reserved_bytes"].as_u64().unwrap()).unwrap();
        for key in ["device", "peak_requested_bytes", "peak_reserved_bytes", "driver_calls", "pytorch_recorded_peak_reserved_bytes"] {
            assert_eq!(object[key], largest[key], "{key}: the top level is the largest card's");
        }
        // Each card against what PyTorch recorded for it, not a sum.
        assert!(devices.iter().all(|d| d["pytorch_recorded_peak_reserved_bytes"].as_u64().unwrap() < 90 << 30));
    }
}

#[test]
fn driver_calls_count_each_call_the_cuda_backend_makes() {
    // One 64 MiB block on a fresh heap: one segment, or a range of address
    // space and 32 pages in one run.
    let mut trace = Trace::new("one", trace::Format::RmmCsv);
    let id = trace.alloc(64 << 20, 0, 0);
    trace.free(id);
    let plain = replay(&trace, &options(Model::WholeSegments)).unwrap();
    assert_eq!(plain.driver_calls, 1);
    // cuMemAddressReserve, cuMemCreate and cuMemMap per allocation (8 MiB
    // by default), cuMemSetAccess per run.
    let expandable = replay(&trace, &options(Model::Tidepool)).unwrap();
    assert_eq!(expandable.driver_calls, 1 + 2 * 8 + 1);
    let by_2_mib = ReplayOptions { conf: "expandable_allocation_mb:2".into(), ..options(Model::Tidepool) };
    assert_eq!(replay(&trace, &by_2_mib).unwrap().driver_calls, 1 + 2 * 32 + 1);
    // PyTorch's expandable segments map 20 MiB at a time: 4 pieces for 64 MiB.
    let pytorch = replay(&trace, &options(Model::PytorchExpandable)).unwrap();
    assert_eq!((pytorch.driver_calls, pytorch.peak_reserved_bytes), (1 + 2 * 4 + 1, 80 << 20));
    // A small block: a 2 MiB piece there too, three calls.
    let small = trace.alloc(4096, 0, 0);
    trace.free(small);
    let pytorch = replay(&trace, &options(Model::PytorchExpandable)).unwrap();
    assert_eq!((pytorch.driver_calls, pytorch.peak_reserved_bytes), (1 + 2 * 4 + 1 + 3, 82 << 20));
    // A call that fails is one call: on a 1 MiB device the small piece
    // fails, then again after the cache is released.
    let mut tiny = Trace::new("tiny", trace::Format::RmmCsv);
    let id = tiny.alloc(4096, 0, 0);
    tiny.free(id);
    let failed = replay(&tiny, &ReplayOptions { capacity: 1 << 20, ..options(Model::PytorchExpandable) }).unwrap();
    assert_eq!((failed.ooms, failed.driver_calls), (1, 2));
}

/// Every trace: examples/traces, tools/tests/traces (a bf16 autocast
/// training step, and the planner's repeated steps in steps/, for the
/// expandable targets), and ../shared/traces when present.
pub(crate) fn all_traces() -> Vec<PathBuf> {
    let root = common::repo_root();
    let dirs = [
        Some(root.join("examples/traces")),
        Some(root.join("tools/tests/traces")),
        Some(root.join("tools/tests/traces/steps")),
        shared("pytorch-snapshots"),
        shared("rmm-csv"),
    ];
    let mut files: Vec<PathBuf> = dirs
        .iter()
        .flatten()
        .filter_map(|dir| std::fs::read_dir(dir).ok())
        .flatten()
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "csv" || e == "pickle"))
        .collect();
    files.sort();
    files
}

#[test]
fn whole_segments_never_reserve_more_than_pytorchs_model_and_the_default_never_needs_a_larger_device_on_any_trace() {
    for file in all_traces() {
        let trace = trace::load(&file).unwrap();
        let ours = replay_per_device(&trace, &options(Model::WholeSegments)).unwrap();
        let model = replay_per_device(&trace, &options(Model::Pytorch)).unwrap();
        for (ours, model) in ours.iter().zip(&model) {
            assert!(
                ours.peak_reserved_bytes <= model.peak_reserved_bytes,
                "{} device {}: tidepool {} above the model's {}",
                file.display(),
                ours.device,
                ours.peak_reserved_bytes,
                model.peak_reserved_bytes
            );
        }
        let ours = smallest_capacity_per_device(&trace, Model::Tidepool, "", None).unwrap();
        let model = smallest_capacity_per_device(&trace, Model::Pytorch, "", None).unwrap();
        for (ours, model) in ours.iter().zip(&model) {
            assert!(
                ours.min_capacity <= model.min_capacity,
                "{} device {}: smallest device {ours:?} above {model:?}",
                file.display(),
                ours.device
            );
        }
    }
}

fn small_trace() -> Trace {
    // Two "steps" of a loop whose activation sizes vary.
    let mut trace = Trace::new("small", trace::Format::RmmCsv);
    let weights = trace.alloc(300 << 20, 0, 0);
    for step in 0..3u64 {
        let mut acts = Vec::new();
        for layer in 0..20u64 {
            acts.push(trace.alloc((1 + (layer * 7 + step * 3) % 11) << 20, 0, 0));
            acts.push(trace.alloc(1000 + layer * 512, 0, 0));
        }
        for id in acts.into_iter().rev() {
            trace.free(id);
        }
    }
    trace.free(weights);
    trace
}

/// The child side: replays of a trace that ends with blocks live, under
/// every policy, leave no mapping behind.
#[test]
#[ignore = "child process: run by replays_give_back_every_mapping_they_made"]
fn child_replays_leave_no_mapping() {
    common::child_only();
    let mappings = || std::fs::read_to_string("/proc/self/maps").unwrap().lines().count();
    let mut trace = small_trace();
    for size in [512, 3 << 20, 40 << 20] {
        trace.alloc(size, 0, 0);
    }
    let before = mappings();
    for _ in 0..50 {
        for model in Model::ALL {
            replay(&trace, &options(model)).unwrap();
        }
    }
    let after = mappings();
    assert!(after <= before + 8, "150 replays left {} mappings behind", after - before);
    println!("replays leave no mapping: ok");
}

#[test]
fn replays_give_back_every_mapping_they_made() {
    let (ok, text) = common::child_output(&mut common::child_command("child_replays_leave_no_mapping"));
    assert!(ok && text.contains("replays leave no mapping: ok"), "{text}");
}

#[test]
fn replay_is_deterministic() {
    let trace = small_trace();
    let a = replay(&trace, &options(Model::Tidepool)).unwrap();
    let b = replay(&trace, &options(Model::Tidepool)).unwrap();
    let key = |r: &tidepool_tools::trace::replay::ReplayReport| {
        (
            r.peak_requested_bytes,
            r.peak_allocated_bytes,
            r.peak_reserved_bytes,
            r.device_allocs,
            r.device_frees,
            r.ooms,
            r.peak_inactive_split_bytes,
        )
    };
    assert_eq!(key(&a), key(&b));
}

#[test]
fn a_recorded_replay_replays_to_the_same_peaks() {
    let original = match shared("rmm-csv/resnet50-b64.csv") {
        Some(path) => trace::load(&path).unwrap(),
        None => small_trace(),
    };
    let recording = tmp("recorded_replay.csv");
    let first = replay(&original, &ReplayOptions { record_to: Some(recording.clone()), ..options(Model::Tidepool) }).unwrap();
    let recorded = trace::load(&recording).unwrap();
    assert_eq!(recorded.allocs, original.allocs);
    assert_eq!(recorded.warnings.count, 0);
    let second = replay(&recorded, &options(Model::Tidepool)).unwrap();
    assert_eq!(
        (second.peak_requested_bytes, second.peak_allocated_bytes, second.peak_reserved_bytes),
        (first.peak_requested_bytes, first.peak_allocated_bytes, first.peak_reserved_bytes)
    );
}

#[test]
fn a_trace_the_disk_cannot_hold_ends_at_its_last_whole_row_and_says_so() {
    let path = tmp("file-size-limit.csv");
    let (ok, text) = common::child_output(common::child_command("child_records_past_a_file_size_limit").env("TIDEPOOL_TEST_TRACE", &path));
    assert!(ok && text.contains("child: ok"), "{text}");
    // Cut back to the last whole row: it still reads, and replays.
    let recorded = trace::load(&path).expect("every row whole");
    assert!(recorded.events.len() > 1000 && recorded.events.len() < 40_000, "{} events", recorded.events.len());
    replay(&recorded, &options(Model::Tidepool)).unwrap();
}

#[test]
#[ignore = "child process: run by a_trace_the_disk_cannot_hold_ends_at_its_last_whole_row_and_says_so"]
fn child_records_past_a_file_size_limit() {
    common::child_only();
    // SAFETY: settings of this child process alone: a write past 256 KiB
    // fails (EFBIG) rather than the signal ending the process.
    unsafe {
        libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
        let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        assert_eq!(libc::getrlimit(libc::RLIMIT_FSIZE, &mut limit), 0);
        limit.rlim_cur = 256 << 10;
        assert_eq!(libc::setrlimit(libc::RLIMIT_FSIZE, &limit), 0);
    }
    let path = std::env::var("TIDEPOOL_TEST_TRACE").unwrap();
    let config = tidepool::Config::builder().conf("release_after_ms:off").unwrap().trace(&path).host(1, 1 << 30).build().unwrap();
    let alloc = tidepool::Allocator::new(config).unwrap();
    for i in 0..20_000usize {
        let p = alloc.allocate(0, 4096 + i % 7 * 512, tidepool::Stream::DEFAULT).unwrap();
        alloc.free(0, p).unwrap();
    }
    let err = alloc.finish_trace().unwrap_err().to_string();
    assert!(err.contains("the trace ends at the last whole row") && err.contains("rows after it were not written"), "{err}");
    println!("child: ok");
}

#[test]
fn bad_files_are_clear_errors_that_name_the_file_and_place() {
    let write = |name: &str, bytes: &[u8]| {
        let path = tmp(name);
        std::fs::write(&path, bytes).unwrap();
        path
    };
    let err = trace::load(&write("bad_header.csv", b"a,b,c\n1,2,3\n")).unwrap_err().to_string();
    assert!(err.contains("bad_header.csv") && err.contains("line 1") && err.contains("header"), "{err}");
    let err =
        trace::load(&write("bad_size.csv", b"Thread,Time,Action,Pointer,Size,Stream\n1,0,allocate,0x10,-5,0\n")).unwrap_err().to_string();
    assert!(err.contains("line 2") && err.contains("bad size"), "{err}");
    let err = trace::load(&write("evil.pickle", b"\x80\x04cos\nsystem\n.")).unwrap_err().to_string();
    assert!(err.contains("evil.pickle") && err.contains("byte 2") && err.contains("refused"), "{err}");
    let err = trace::load(&write("truncated.pickle", b"\x80\x04}\x94(\x8c\x08segments")).unwrap_err().to_string();
    assert!(err.contains("truncated"), "{err}");
    let err = trace::load(&write("empty.csv", b"")).unwrap_err().to_string();
    assert!(err.contains("empty"), "{err}");
    let err = trace::load(Path::new("/nonexistent/trace.csv")).unwrap_err().to_string();
    assert!(err.contains("/nonexistent/trace.csv") && err.contains("cannot open"), "{err}");
    // 32 MiB of garbage, as text and as a pickle: refused at once.
    let mut rng = common::Rng(0x9E37_79B9_7F4A_7C15);
    let garbage: Vec<u8> = (0..32 << 20).map(|_| rng.next() as u8).collect();
    let mut as_pickle = garbage.clone();
    as_pickle[0] = 0x80;
    as_pickle[1] = 4;
    assert!(trace::load(&write("garbage.pickle", &as_pickle)).is_err());
    let mut as_text = garbage;
    as_text[0] = b'x';
    assert!(trace::load(&write("garbage.csv", &as_text)).is_err());
}

#[test]
fn cards_lists_each_cards_memory_and_what_an_allocator_gets() {
    use tidepool_tools::trace::cards::{CARDS, CONTEXT_BYTES};
    let (ok, stdout, stderr) = tidepool_cli(&["cards"]);
    assert!(ok, "{stderr}");
    assert!(stdout.contains("L40S         46068 MiB           43.5 GiB"), "{stdout}");
    assert_eq!(stdout.lines().count(), 2 + CARDS.len(), "{stdout}");
    let (ok, stdout, _) = tidepool_cli(&["cards", "--json"]);
    assert!(ok);
    let listed: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(listed["context_bytes"], CONTEXT_BYTES);
    let cards = listed["cards"].as_array().unwrap();
    assert_eq!(cards.len(), CARDS.len());
    for (json, card) in cards.iter().zip(CARDS) {
        assert_eq!(json["name"], card.name);
        assert_eq!(json["usable_bytes"].as_u64().unwrap(), (card.total_mib << 20) - CONTEXT_BYTES);
        assert_eq!(json["compute_capability"], card.compute_capability_text());
        assert_eq!(json["aliases"].as_array().unwrap().len(), card.aliases.len());
    }
    let (ok, _, stderr) = tidepool_cli(&["cards", "--all"]);
    assert!(!ok && stderr.contains("cards: unknown option --all"), "{stderr}");
}

#[test]
fn cards_given_by_name_or_by_memory_are_those_listed() {
    use tidepool_tools::trace::cards::CONTEXT_BYTES;
    let (ok, stdout, stderr) = tidepool_cli(&["cards", "--json", "h100 80gb", "4090,24GB"]);
    assert!(ok, "{stderr}");
    let listed: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    let names: Vec<&str> = listed["cards"].as_array().unwrap().iter().map(|c| c["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["H100", "RTX 4090", "24 GB"]);
    let memory = &listed["cards"][2];
    assert_eq!(memory["usable_bytes"].as_u64().unwrap(), 24_000_000_000 - CONTEXT_BYTES);
    assert!(memory["compute_capability"].is_null(), "{memory}");
    let (ok, stdout, _) = tidepool_cli(&["cards", "T4", "22.5GiB"]);
    assert!(ok);
    assert!(stdout.starts_with("The cards given:"), "{stdout}");
    assert!(stdout.contains("T4           15360 MiB           13.5 GiB  7.5      Tesla T4"), "{stdout}");
    assert!(stdout.contains("22.5 GiB     23040 MiB           21.0 GiB  -"), "{stdout}");
    for (args, said) in [
        (&["cards", "a100"][..], "tidepool: cards: 'a100' names more than one card: A100 40GB, A100 80GB\n"),
        (&["cards", "24"][..], "tidepool: cards: '24': a card's memory needs its unit: write 24GB"),
        (&["cards", "T4", "V100"][..], "tidepool: cards: 'V100' is neither a card (T4, A10G,"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_tidepool")).args(args).output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        assert!(out.stdout.is_empty() && stderr.starts_with(said), "{args:?}: {stderr}");
    }
}

fn tidepool_cli(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_tidepool")).args(args).output().unwrap();
    (out.status.success(), String::from_utf8_lossy(&out.stdout).into(), String::from_utf8_lossy(&out.stderr).into())
}

fn write_small_csv() -> PathBuf {
    // A file per call: the tests that use it run at once.
    static CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let path = tmp(&format!("small_cli_{}.csv", CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed)));
    let mut text = String::from("Thread,Time,Action,Pointer,Size,Stream\n");
    for i in 1..=50u64 {
        text += &format!("1,00:00:00.{i:06},allocate,{:#x},{},0\n", i << 20, i * 100_000);
    }
    for i in (1..=50u64).step_by(2) {
        text += &format!("1,00:00:01.{i:06},free,{:#x},{},0\n", i << 20, i * 100_000);
    }
    std::fs::write(&path, text).unwrap();
    path
}

#[test]
fn replay_json_has_one_object_per_policy_with_the_documented_keys() {
    let path = write_small_csv();
    let (ok, stdout, stderr) = tidepool_cli(&["replay", path.to_str().unwrap(), "--json"]);
    assert!(ok, "{stderr}");
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), 3, "{stdout}");
    for key in [
        "\"file\"",
        "\"policy\"",
        "\"events\":75",
        "\"allocs\":50",
        "\"peak_requested_bytes\"",
        "\"peak_allocated_bytes\"",
        "\"peak_reserved_bytes\"",
        "\"reserved_over_requested\"",
        "\"device_allocs\"",
        "\"device_frees\"",
        "\"device\":0",
        "\"driver_calls\"",
        "\"ooms\":0",
        "\"first_oom\":null",
        "\"events_per_second\"",
        "\"pytorch_recorded_peak_reserved_bytes\":null",
    ] {
        assert!(lines[0].contains(key), "{key} missing from {}", lines[0]);
    }
    let policies: Vec<&str> = lines.iter().map(|l| l.split("\"policy\":\"").nth(1).unwrap().split('"').next().unwrap()).collect();
    assert_eq!(policies, ["pytorch", "tidepool", "whole-segments"]);
    let (ok, stdout, _) = tidepool_cli(&["replay", path.to_str().unwrap(), "--json", "--policy", "whole-segments,pytorch"]);
    assert!(ok && stdout.lines().count() == 2 && stdout.starts_with("{") && stdout.contains("\"policy\":\"whole-segments\""), "{stdout}");
    // Earlier releases' name for tidepool with expandable segments, now its default.
    let (ok, stdout, _) = tidepool_cli(&["replay", path.to_str().unwrap(), "--json", "--policy", "expandable"]);
    assert!(ok && stdout.lines().count() == 1 && stdout.contains("\"policy\":\"tidepool\""), "{stdout}");
}

#[test]
fn a_replay_that_runs_out_says_where_and_why() {
    let path = write_small_csv();
    // 50 allocations of 0.1 to 5 MB, 122 MiB in all, on a 64 MiB device.
    let args = ["replay", path.to_str().unwrap(), "--policy", "tidepool", "--capacity", "64M"];
    let (ok, stdout, stderr) = tidepool_cli(&args);
    assert!(ok, "{stderr}");
    let line = stdout.lines().find(|l| l.contains("first OOM")).unwrap_or_else(|| panic!("no first OOM line:\n{stdout}"));
    assert!(line.contains("first OOM, tidepool: event ") && line.contains("tried to allocate"), "{line}");
    // It served less than the trace asks: no ratio of reserved to requested.
    let ratio = stdout.lines().find(|l| l.contains("reserved / requested")).unwrap();
    assert!(ratio.trim_end().ends_with("ran out"), "{ratio}");
    let (ok, stdout, _) = tidepool_cli(&[&args[..], &["--json"]].concat());
    assert!(ok);
    let report: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    let event = report["first_oom"]["event"].as_u64().expect("first_oom.event");
    assert!(event < 50, "an allocation fails before the frees: {event}");
    assert!(report["first_oom"]["message"].as_str().unwrap().contains("out of memory on device 0"), "{report}");
    assert!(report["ooms"].as_u64().unwrap() > 0);
    assert!(report["reserved_over_requested"].is_null(), "{report}");
}

#[test]
fn plan_answers_in_plain_words_and_in_json() {
    let path = write_small_csv();
    let (ok, stdout, stderr) = tidepool_cli(&["plan", path.to_str().unwrap()]);
    assert!(ok, "{stderr}");
    assert!(stdout.contains("with PyTorch's allocator") && stdout.contains("with tidepool"), "{stdout}");
    // A small trace: the smallest card named, with what it gives an allocator.
    assert!(stdout.contains("tidepool and PyTorch's allocator: fits a T4 (13.5 GiB for the allocator; "), "{stdout}");
    // Sizes as precise as the 2 MiB step: in whole MiB, not hundredths of a GiB.
    let needs = stdout.lines().find(|l| l.starts_with("needs ")).unwrap();
    assert!(needs.contains(" MiB with PyTorch's allocator") && needs.ends_with("(in steps of 2 MiB)"), "{needs}");
    assert!(needs.contains(" MiB with PyTorch's expandable_segments:True"), "{needs}");
    assert!(stdout.contains("(one step less), tidepool runs out at event "), "{stdout}");
    let (ok, stdout, _) = tidepool_cli(&["plan", path.to_str().unwrap(), "--json"]);
    assert!(ok);
    for key in [
        "\"file\"",
        "\"peak_requested_bytes\"",
        "\"tidepool\":{\"min_capacity_bytes\"",
        "\"pytorch\":{\"min_capacity_bytes\"",
        "\"whole_segments\":{\"min_capacity_bytes\"",
        "\"pytorch_expandable\":{\"min_capacity_bytes\"",
        "\"pytorch_recorded_oom\":null",
        "\"step_bytes\":2097152",
        "\"devices\":[{\"device\":0",
    ] {
        assert!(stdout.contains(key), "{key} missing from {stdout}");
    }
    // Why one step less does not do: where the replay runs out, per policy and device.
    let plan: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    let less = &plan["devices"][0]["tidepool"]["one_step_less"];
    let (need, step) = (plan["devices"][0]["tidepool"]["min_capacity_bytes"].as_u64().unwrap(), plan["step_bytes"].as_u64().unwrap());
    assert_eq!(less["capacity_bytes"].as_u64(), Some(need - step), "{plan}");
    assert!(less["event"].as_u64().unwrap() < 75 && less["message"].as_str().unwrap().contains("out of memory"), "{plan}");
    let (ok, stdout, _) = tidepool_cli(&["plan", path.to_str().unwrap(), "--step", "4MiB"]);
    assert!(ok && stdout.contains("(in steps of 4 MiB)"), "{stdout}");
    // A step of no whole MiB: sizes to the KiB.
    let (ok, stdout, _) = tidepool_cli(&["plan", path.to_str().unwrap(), "--step", "1536KiB"]);
    let needs = stdout.lines().find(|l| l.starts_with("needs ")).unwrap();
    assert!(ok && needs.ends_with("(in steps of 1.50 MiB)") && needs.contains(".500 MiB with PyTorch's allocator"), "{needs}");
}

#[test]
fn plan_with_bf16_names_no_card_below_compute_capability_8_0() {
    let path = write_small_csv();
    let path = path.to_str().unwrap();
    // A trace carries no dtype: the T4 that fits is named, with what leaves it out.
    let (ok, stdout, stderr) = tidepool_cli(&["plan", path]);
    assert!(ok, "{stderr}");
    let advice = "tidepool and PyTorch's allocator: fits a T4 (13.5 GiB for the allocator; not for bf16: --bf16 leaves it out).";
    assert_eq!(stdout.lines().last(), Some(advice), "{stdout}");
    // In bf16 the smallest card is the A10G (8.6), and the T4 (7.5) is not named as too small either.
    let (ok, bf16_stdout, stderr) = tidepool_cli(&["plan", path, "--bf16"]);
    assert!(ok, "{stderr}");
    assert_eq!(bf16_stdout.lines().last(), Some("tidepool and PyTorch's allocator: fits an A10G (21.0 GiB for the allocator)."));
    assert!(!bf16_stdout.contains("T4"), "{bf16_stdout}");
    // The needs do not depend on it: only the card.
    let all_but_last = |text: &str| text.lines().take(text.lines().count() - 1).collect::<Vec<_>>().join("\n");
    assert_eq!(all_but_last(&stdout), all_but_last(&bf16_stdout));
    // JSON says whether it was given.
    for (args, bf16) in [(vec!["plan", path, "--json"], false), (vec!["plan", path, "--json", "--bf16"], true)] {
        let (ok, stdout, stderr) = tidepool_cli(&args);
        assert!(ok, "{stderr}");
        let plan: serde_json::Value = serde_json::from_str(&stdout).unwrap();
        assert_eq!(plan["bf16"].as_bool(), Some(bf16), "{args:?}: {plan}");
    }
    // A flag, not an option with a value.
    let (ok, stdout, stderr) = tidepool_cli(&["plan", path, "--bf16=true"]);
    assert!(!ok && stdout.is_empty() && stderr.contains("unexpected value 'true' for '--bf16'"), "{stderr}");
    // A trace that allocates nothing needs no card, in bf16 or not.
    let empty = tmp("header_only_bf16.csv");
    std::fs::write(&empty, "Thread,Time,Action,Pointer,Size,Stream\n").unwrap();
    let (ok, stdout, stderr) = tidepool_cli(&["plan", empty.to_str().unwrap(), "--bf16"]);
    assert!(ok && stdout.contains("allocates nothing: no device needed") && !stdout.contains("fits"), "{stdout} {stderr}");
}

#[test]
fn a_replay_of_every_policy_keeps_its_columns_apart() {
    let path = write_small_csv();
    // The column titles of `replay --policy POLICIES`, split where two spaces part them.
    let titles = |policies: &str| {
        let (ok, stdout, stderr) = tidepool_cli(&["replay", path.to_str().unwrap(), "--policy", policies]);
        assert!(ok, "{stderr}");
        let header = stdout.lines().nth(1).unwrap().to_string();
        header.split("  ").map(str::trim).filter(|t| !t.is_empty()).map(String::from).collect::<Vec<_>>()
    };
    assert_eq!(titles("all"), ["pytorch model", "tidepool", "tidepool whole segments", "pytorch expandable model"]);
    // A policy named twice is replayed once, where first named.
    assert_eq!(titles("whole-segments,all"), ["tidepool whole segments", "pytorch model", "tidepool", "pytorch expandable model"]);
    // Given twice, --policy and --conf add up rather than the last replacing the first.
    let (ok, stdout, stderr) =
        tidepool_cli(&["replay", path.to_str().unwrap(), "--policy", "whole-segments", "--policy", "pytorch,whole-segments"]);
    assert!(ok && stdout.lines().nth(1).unwrap().contains("pytorch model"), "{stdout}{stderr}");
    for confs in [["bogus:1", "stash:false"], ["stash:false", "bogus:1"]] {
        let (ok, _, stderr) = tidepool_cli(&["replay", path.to_str().unwrap(), "--conf", confs[0], "--conf", confs[1]]);
        assert!(!ok && stderr.contains("bogus"), "{confs:?}: {stderr}");
    }
}

#[test]
fn the_plot_is_an_svg_with_every_series() {
    let path = write_small_csv();
    let svg = tmp("small.svg");
    let (ok, _, stderr) = tidepool_cli(&["replay", path.to_str().unwrap(), "--plot", svg.to_str().unwrap()]);
    assert!(ok, "{stderr}");
    let text = std::fs::read_to_string(&svg).unwrap();
    assert!(text.starts_with("<svg") && text.trim_end().ends_with("</svg>"), "not an SVG document");
    for label in [
        "requested",
        "allocated (tidepool)",
        "reserved (tidepool)",
        "allocated (pytorch model)",
        "reserved (tidepool whole segments)",
        "memory (GiB)",
        "driver calls so far",
        "warm-up ends (after the live peak)",
        "event",
    ] {
        assert!(text.contains(label), "{label} missing");
    }
    // Requested, then per policy allocated and reserved above and calls below.
    assert!(text.matches("<polyline").count() > 3 * 3, "expected ten line series");
    // Each policy in a colour of its own (series and legend), the same in both panels.
    for colour in ["#D62728", "#1F77B4", "#2CA02C"] {
        assert!(text.matches(&format!("stroke=\"{colour}\"")).count() >= 4, "{colour}");
    }
    // Well formed: every element that opens closes.
    let opens = text.matches("<text").count();
    assert_eq!(opens, text.matches("</text>").count());
}

#[test]
fn output_that_cannot_be_written_ends_the_command_quietly() {
    // stdout on a full device: every write fails (ENOSPC), and no command panics.
    let path = write_small_csv();
    let empty_registry = tmp("no-registry-here");
    for args in [
        vec!["help"],
        vec!["top", "--once"],
        vec!["top", "--once", "--json"],
        vec!["replay", path.to_str().unwrap()],
        vec!["plan", path.to_str().unwrap()],
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_tidepool"))
            .args(&args)
            .env("TIDEPOOL_CONF", format!("registry_dir:{}", empty_registry.display()))
            .stdout(std::fs::File::create("/dev/full").unwrap())
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success() && !stderr.contains("panicked"), "{args:?}: {:?} {stderr}", out.status);
    }
}

#[test]
fn the_command_line_refuses_bad_arguments_clearly() {
    let (ok, _, stderr) = tidepool_cli(&["replay", "/nonexistent.csv"]);
    assert!(!ok && stderr.contains("/nonexistent.csv"), "{stderr}");
    let (ok, _, stderr) = tidepool_cli(&["replay", "x.csv", "--capacity", "lots"]);
    assert!(!ok && stderr.contains("bad size"), "{stderr}");
    let (ok, _, stderr) = tidepool_cli(&["replay", "x.csv", "--policy", "jemalloc"]);
    assert!(!ok && stderr.contains("--policy"), "{stderr}");
    let (ok, _, stderr) = tidepool_cli(&["replay", "x.csv", "--conf", "colour:blue"]);
    assert!(!ok && stderr.contains("colour"), "{stderr}");
    let (ok, _, stderr) = tidepool_cli(&["frobnicate"]);
    assert!(!ok && stderr.contains("unknown command"), "{stderr}");
    // One line that says what is wrong, not the whole usage.
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    // `--capacity 8 GiB`, unquoted: 8 alone would be bytes.
    let trace = write_small_csv();
    let trace = trace.to_str().unwrap();
    let (ok, stdout, stderr) = tidepool_cli(&["replay", trace, "--capacity", "8", "GiB"]);
    assert!(!ok && stdout.is_empty() && stderr.contains("write its unit"), "{stderr}");
    assert!(tidepool_cli(&["replay", trace, "--capacity", "2097152"]).0, "bytes from 1 MiB");
    // Every file is opened before the first is replayed.
    let (ok, stdout, stderr) = tidepool_cli(&["replay", trace, "/nonexistent.csv"]);
    assert!(!ok && stdout.is_empty() && stderr.contains("/nonexistent.csv: cannot open"), "{stdout} {stderr}");
    let (ok, stdout, stderr) = tidepool_cli(&["replay", trace, "--plot", "/nonexistent/p.svg"]);
    assert!(!ok && stdout.is_empty() && stderr.contains("no folder /nonexistent"), "{stderr}");
    let (ok, _, stderr) = tidepool_cli(&["cards", "--bogus"]);
    assert!(!ok && stderr.contains("unknown option --bogus") && !stderr.contains('['), "{stderr}");
}

#[test]
fn files_taken_for_traces_are_named_for_what_they_are() {
    for (name, bytes, said) in [
        ("trace.csv.gz", &[0x1f, 0x8b, 8, 0, 0][..], "a gzip file, not a trace: gunzip it first"),
        ("model.pt", &b"PK\x03\x04rest"[..], "a zip archive (torch.save writes those)"),
    ] {
        let path = tmp(name);
        std::fs::write(&path, bytes).unwrap();
        let err = trace::load(&path).unwrap_err().to_string();
        assert!(err.contains(said) && err.contains("_dump_snapshot"), "{err}");
    }
}

#[test]
fn a_trace_that_allocates_nothing_needs_no_device() {
    let path = tmp("header_only.csv");
    std::fs::write(&path, "Thread,Time,Action,Pointer,Size,Stream\n").unwrap();
    let (ok, stdout, stderr) = tidepool_cli(&["replay", path.to_str().unwrap()]);
    assert!(ok && !stdout.contains("ran out"), "{stdout} {stderr}");
    let (ok, stdout, stderr) = tidepool_cli(&["plan", path.to_str().unwrap()]);
    assert!(ok && stdout.contains("allocates nothing: no device needed") && !stdout.contains("fits"), "{stdout} {stderr}");
}

#[test]
fn help_after_a_command_prints_the_usage_and_succeeds() {
    for args in [vec!["--help"], vec!["-h"], vec!["plan", "--help"], vec!["replay", "trace.csv", "-h"], vec!["exporter", "--help"]] {
        let (ok, stdout, stderr) = tidepool_cli(&args);
        assert!(ok && stdout.contains("usage:") && stderr.is_empty(), "{args:?}: {stdout} {stderr}");
    }
    // A command's help is that command's usage (and what a SIZE is, where it takes one).
    let (_, plan, _) = tidepool_cli(&["plan", "--help"]);
    assert!(plan.contains("tidepool plan FILE") && plan.contains("SIZE:") && !plan.contains("tidepool replay"), "{plan}");
    let (_, replay, _) = tidepool_cli(&["replay", "-h"]);
    assert!(replay.contains("[--plot OUT.svg]") && !replay.contains("tidepool top"), "{replay}");
}

#[test]
fn a_closed_stdout_ends_the_command_quietly() {
    // `tidepool replay ... | head -1`: the reader goes away after one line.
    let path = write_small_csv();
    let mut child = Command::new(env!("CARGO_BIN_EXE_tidepool"))
        .args(["replay", path.to_str().unwrap()])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && !stderr.contains("panicked"), "{:?}: {stderr}", out.status);
}

#[test]
fn a_replay_with_stream_shards_counts_every_shard() {
    use tidepool_tools::trace::replay::{replay, Model, ReplayOptions};
    use tidepool_tools::trace::{Format, Trace};
    // Two streams, routed to different shards, each holding 30 MiB at the peak.
    let mut trace = Trace::new("shards", Format::RmmCsv);
    let ids: Vec<u32> = (0..6).map(|i| trace.alloc(10 * MIB, 1 + (i % 2), 0)).collect();
    ids.into_iter().for_each(|id| trace.free(id));
    let run = |conf: &str| {
        let options = ReplayOptions { capacity: 1 << 30, model: Model::Tidepool, conf: conf.into(), samples: 12, record_to: None };
        replay(&trace, &options).unwrap()
    };
    let (one, four) = (run(""), run("stream_shards:4"));
    assert_eq!(four.peak_allocated_bytes, 60 * MIB, "both shards' blocks");
    assert_eq!(four.peak_allocated_bytes, one.peak_allocated_bytes);
    assert_eq!(four.peak_reserved_bytes, 60 * MIB, "a 10 MiB segment per block, on both shards");
    // The samples a plot draws follow every shard too.
    let most = |r: &tidepool_tools::trace::replay::ReplayReport| {
        (r.series.iter().map(|s| s.allocated).max().unwrap(), r.series.iter().map(|s| s.reserved).max().unwrap())
    };
    assert_eq!(most(&four), (60 * MIB, 60 * MIB));
    assert_eq!(most(&four), most(&one));
}

#[test]
fn options_take_their_value_after_an_equals_sign_and_shells_get_completions() {
    let trace = write_small_csv();
    let (ok, stdout, stderr) = tidepool_cli(&["replay", trace.to_str().unwrap(), "--capacity=1GiB", "--policy=tidepool", "--json"]);
    assert!(ok && stdout.contains("\"capacity_bytes\":1073741824"), "{stdout} {stderr}");
    let (ok, _, stderr) = tidepool_cli(&["replay", trace.to_str().unwrap(), "--capacity=8"]);
    assert!(!ok && stderr.contains("write its unit") && stderr.lines().count() == 1, "{stderr}");
    for shell in ["bash", "zsh", "fish"] {
        let (ok, stdout, stderr) = tidepool_cli(&["completions", shell]);
        assert!(ok && stdout.contains("replay") && stdout.contains("capacity"), "{shell}: {stderr}");
    }
    let (ok, _, stderr) = tidepool_cli(&["completions", "tcsh"]);
    assert!(!ok && stderr.contains("tcsh") && stderr.lines().count() == 1, "{stderr}");
}
