//! `tidepool replay`: each trace replayed under each policy, device by
//! device, as a table or one JSON line per policy, and a plot.

use std::io::IsTerminal;
use std::path::PathBuf;

use indicatif::{ProgressBar, ProgressStyle};
use tidepool::error::human_bytes;
use tidepool_tools::trace::plot;
use tidepool_tools::trace::replay::{replay_device, Model, ReplayOptions, ReplayReport};
use tidepool_tools::trace::Trace;

use super::{args, out, SIZES};

/// The capacity of a replay given none: more than any device.
pub const UNLIMITED: u64 = 1 << 50;

/// Replays allocation traces (RMM logging CSV, PyTorch memory snapshot
/// pickles) and reports peak requested, allocated and reserved memory,
/// driver calls, OOMs and fragmentation; a trace of several GPUs gets
/// figures per device
#[derive(clap::Args)]
#[command(
    override_usage = "tidepool replay FILE... [--capacity SIZE] [--conf KEY:VAL,...] [--policy LIST] [--json] [--plot OUT.svg]",
    after_help = SIZES
)]
pub struct Args {
    /// The traces
    #[arg(value_name = "FILE")]
    files: Vec<PathBuf>,
    /// Limits each device (default: unlimited)
    #[arg(long, value_name = "SIZE", value_parser = args::size)]
    capacity: Option<u64>,
    /// tidepool's configuration, as TIDEPOOL_CONF takes it (given twice, both apply; later keys win)
    #[arg(long, value_name = "KEY:VAL,...")]
    conf: Vec<String>,
    /// Which to compare, comma-separated: pytorch (the model of PyTorch's allocator), tidepool (as configured: expandable
    /// segments by default), whole-segments (tidepool with expandable:false), pytorch-expandable (the model of PyTorch with
    /// expandable_segments:True), or all. Default: PyTorch's model as the trace says it ran, tidepool and whole-segments
    #[arg(long, value_name = "LIST")]
    policy: Vec<String>,
    /// One JSON object per policy, a line each
    #[arg(long)]
    json: bool,
    /// Draws live and reserved memory over the trace into an SVG file
    #[arg(long, value_name = "OUT.svg")]
    plot: Option<PathBuf>,
}

pub fn run(args: Args) -> Result<(), String> {
    // None: the default for each trace.
    let models = if args.policy.is_empty() { None } else { Some(args::models(&args.policy)?) };
    let conf = args::conf(&args.conf)?;
    args::check_files(&args.files, args.plot.as_deref())?;
    if args.plot.is_some() && args.files.len() > 1 {
        return Err("--plot draws one trace: give one file".into());
    }
    let capacity = args.capacity.unwrap_or(UNLIMITED);
    let progress = !args.json && std::io::stderr().is_terminal();
    for file in &args.files {
        let reading = progress.then(|| spinner(format!("reading {}", file.display())));
        let trace = args::load(file)?;
        drop(reading);
        let models = models.clone().unwrap_or_else(|| default_models(&trace));
        // Each device on its own: a card's figures, never sums over cards.
        let (devices, parts): (Vec<u32>, Vec<_>) = trace.per_device().into_iter().unzip();
        let mut by_device: Vec<Vec<ReplayReport>> = Vec::new();
        for (&device, part) in devices.iter().zip(&parts) {
            let mut reports = Vec::new();
            for &model in &models {
                let samples = if args.plot.is_some() { 2000 } else { 0 };
                let replay_options = ReplayOptions { capacity, model, conf: conf.clone(), samples, record_to: None };
                let name = file.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
                let bar = progress.then(|| bar(format!("{name} ({})", model.name())));
                let report = replay_device(device, part, &replay_options, |done, total| {
                    if let Some(bar) = &bar {
                        bar.set_length(total as u64);
                        bar.set_position(done as u64);
                    }
                });
                if let Some(bar) = bar {
                    bar.finish_and_clear();
                }
                reports.push(report?);
            }
            by_device.push(reports);
        }
        if args.json {
            for model in 0..models.len() {
                let reports: Vec<&ReplayReport> = by_device.iter().map(|reports| &reports[model]).collect();
                out!("{}", policy_json(&reports));
            }
        } else {
            for (part, reports) in parts.iter().zip(&by_device) {
                let device = (trace.devices > 1).then_some(reports[0].device);
                print_report(part, reports, device);
            }
        }
        if let Some(path) = &args.plot {
            // The device with the most live memory: the card that decides.
            let largest = (0..parts.len()).max_by_key(|&i| parts[i].peak_requested()).unwrap_or(0);
            let mut title = format!("{} ({})", file.file_name().map(|n| n.to_string_lossy()).unwrap_or_default(), trace.format.name());
            if trace.devices > 1 {
                title += &format!(", device {}", devices[largest]);
            }
            plot::write_svg(path, &title, &by_device[largest].iter().collect::<Vec<_>>())?;
            if !args.json {
                out!("plot written to {}", path.display());
            }
        }
    }
    Ok(())
}

/// A progress bar on stderr for one replay (a terminal only).
fn bar(message: String) -> ProgressBar {
    let bar = ProgressBar::new(1).with_message(message);
    bar.set_style(ProgressStyle::with_template("{msg} [{bar:30}] {percent:>3}%").expect("a valid template").progress_chars("#>-"));
    bar
}

/// A spinner on stderr while a trace is read (a terminal only).
fn spinner(message: String) -> ProgressBar {
    let spinner = ProgressBar::new_spinner().with_message(message);
    spinner.enable_steady_tick(std::time::Duration::from_millis(100));
    spinner
}

/// What replay compares when --policy is not given: PyTorch's model as the
/// trace says PyTorch ran, and tidepool with and without expandable segments.
fn default_models(trace: &Trace) -> Vec<Model> {
    vec![Model::pytorch_as_recorded(trace), Model::Tidepool, Model::WholeSegments]
}

fn print_report(trace: &Trace, reports: &[ReplayReport], device: Option<u32>) {
    out!(
        "{}{} ({}): {} events, {} allocations, peak requested {}",
        trace.source,
        device.map_or(String::new(), |d| format!(", device {d}")),
        trace.format.name(),
        trace.events.len(),
        trace.allocs,
        human_bytes(trace.peak_requested())
    );
    // Columns as wide as the longest title, and at least 21.
    let width = reports.iter().map(|r| r.model.title().len() + 2).max().unwrap_or(0).max(21);
    let mut header = format!("  {:<24}", "");
    for r in reports {
        header += &format!("{:>width$}", r.model.title());
    }
    if trace.pytorch_peak_reserved.is_some() {
        header += &format!("{:>18}", "pytorch recorded");
    }
    out!("{header}");
    let row = |label: &str, cell: &dyn Fn(&ReplayReport) -> String, recorded: Option<String>| {
        let mut line = format!("  {label:<24}");
        for r in reports {
            line += &format!("{:>width$}", cell(r));
        }
        if let Some(recorded) = recorded {
            line += &format!("{recorded:>18}");
        }
        out!("{line}");
    };
    let recorded = trace.pytorch_peak_reserved;
    row("peak allocated", &|r| human_bytes(r.peak_allocated_bytes), None);
    row("peak reserved", &|r| human_bytes(r.peak_reserved_bytes), recorded.map(human_bytes));
    row(
        "reserved / requested",
        &|r| match r.reserved_over_requested() {
            Some(ratio) => format!("{ratio:.3}"),
            None if r.ooms > 0 => "ran out".to_string(),
            None => "-".to_string(), // nothing requested
        },
        recorded.map(|p| format!("{:.3}", p as f64 / trace.peak_requested().max(1) as f64)),
    );
    row("device allocs", &|r| r.device_allocs.to_string(), None);
    row("device frees", &|r| r.device_frees.to_string(), None);
    row("driver calls", &|r| r.driver_calls.to_string(), None);
    // The warm-up is the trace's, the same for every policy.
    let steady = reports.first().map_or("", |r| r.warm_up.by.name());
    row(&format!("  {steady}"), &|r| r.steady_driver_calls.to_string(), None);
    row("OOMs", &|r| r.ooms.to_string(), None);
    row("fragmentation (peak)", &|r| format!("{:.1} %", 100.0 * r.fragmentation()), None);
    row("replay speed", &|r| format!("{:.1} M ev/s", r.events_per_second() / 1e6), None);
    for r in reports {
        if let Some(oom) = &r.first_oom {
            out!("  first OOM, {}: event {} of {}: {}", r.model.title(), oom.event, r.events, oom.message);
        }
    }
}

/// One device's figures under one policy, as JSON.
fn report_json(r: &ReplayReport) -> serde_json::Value {
    serde_json::json!({
        "device": r.device,
        "capacity_bytes": (r.capacity < UNLIMITED).then_some(r.capacity),
        "events": r.events,
        "allocs": r.allocs,
        "peak_requested_bytes": r.peak_requested_bytes,
        "peak_allocated_bytes": r.peak_allocated_bytes,
        "peak_reserved_bytes": r.peak_reserved_bytes,
        "reserved_over_requested": r.reserved_over_requested().map(|ratio| (ratio * 1e6).round() / 1e6),
        "device_allocs": r.device_allocs,
        "device_frees": r.device_frees,
        "driver_calls": r.driver_calls,
        "steady_driver_calls": r.steady_driver_calls,
        "warm_up_events": r.warm_up.events,
        "warm_up_ends": r.warm_up.by.key(),
        "ooms": r.ooms,
        "first_oom": r.first_oom.as_ref().map(|oom| serde_json::json!({ "event": oom.event, "message": oom.message })),
        "peak_inactive_split_bytes": r.peak_inactive_split_bytes,
        "fragmentation": (r.fragmentation() * 1e6).round() / 1e6,
        "events_per_second": r.events_per_second().round() as u64,
        "pytorch_recorded_peak_reserved_bytes": r.pytorch_recorded_peak_reserved_bytes,
    })
}

/// One trace under one policy, as one JSON line: the figures of the
/// device with the largest peak reserved (what a card must hold) at the
/// top, and every device's in `devices`.
fn policy_json(reports: &[&ReplayReport]) -> String {
    let largest = reports.iter().max_by_key(|r| (r.peak_reserved_bytes, std::cmp::Reverse(r.device))).expect("a device");
    let mut object = report_json(largest);
    object["file"] = largest.file.as_str().into();
    object["policy"] = largest.model.name().into();
    object["devices"] = reports.iter().map(|r| report_json(r)).collect();
    object.to_string()
}
