//! The `tidepool` command line: replay and plan allocation traces, watch
//! the processes of this machine (`top`) or serve their figures to
//! Prometheus (`exporter`), and show the configuration.

mod serve;

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use tidepool::config::OPTIONS;
use tidepool::error::human_bytes;
use tidepool::reclaim::policy::Reason;
use tidepool::registry;
use tidepool::Config;
use tidepool_tools::trace::cards::{self, card_advice};
use tidepool_tools::trace::plan::{smallest_capacity_per_device, Plan};
use tidepool_tools::trace::replay::{replay_device, serves_recorded_oom, Policy, ReplayOptions, ReplayReport};
use tidepool_tools::trace::{self, RecordedOom, Trace};

/// `println!` that ends the process quietly when stdout is closed
/// (`tidepool replay ... | head`) instead of panicking.
macro_rules! out {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        if writeln!(std::io::stdout(), $($arg)*).is_err() {
            std::process::exit(0);
        }
    }};
}

const USAGE: &str = "\
tidepool: a CUDA caching allocator that gives memory back

usage:
  tidepool replay FILE... [--capacity SIZE] [--conf KEY:VAL,...] [--policy LIST] [--json]
                          [--plot OUT.svg]
      replay allocation traces (RMM logging CSV, PyTorch memory snapshot pickles) and report
      peak requested, allocated and reserved memory, driver calls, OOMs and fragmentation;
      --capacity limits each device (default: unlimited); --policy picks from pytorch (the
      model of PyTorch's allocator), tidepool, expandable (tidepool with expandable:true) and
      pytorch-expandable (the model of PyTorch with expandable_segments:True), comma-separated;
      by default PyTorch's model as the trace says it ran, tidepool and expandable; all four
      with all; a trace of several GPUs gets figures per device
  tidepool plan FILE [--conf KEY:VAL,...] [--step SIZE] [--json]
      the smallest device the trace fits, with PyTorch's allocator (with and without its
      expandable segments) and with tidepool (with and without its own), found to --step
      (default: the larger of 2 MiB and 0.25 % of the peak of live memory, in whole MiB); a
      trace of several GPUs gets one answer per device
  tidepool top [--once] [--json] [--registry-dir DIR]
      the tidepool processes sharing devices on this machine, refreshed every second
      (--once: one table; --json: one JSON object; --registry-dir: the registries' folder, by
      default TIDEPOOL_CONF's registry_dir)
  tidepool exporter [--listen ADDR:PORT] [--registry-dir DIR]... [--textfile PATH [--interval SECS] [--once]]
                    [--timeout SECS] [--max-connections N]
      serves the figures of every tidepool process on this machine at http://ADDR:PORT/metrics
      (Prometheus text, or OpenMetrics when the scraper asks for it), read afresh at each
      scrape; default 127.0.0.1:9464. --textfile writes the same text to PATH every --interval
      seconds (default 15) for node_exporter's textfile collector, atomically (with --once:
      once, then exits); with --textfile and no --listen there is no server. --timeout
      (default 10) bounds the wait for a request; --max-connections (default 64) the
      connections served at once
  tidepool cards [--json]    the GPU cards `tidepool plan` names, their memory and what an allocator gets of it
  tidepool config            the options of TIDEPOOL_CONF, their defaults and current values
  tidepool --version         the version
  tidepool help              this text

SIZE: a number with its unit, KiB, MiB, GiB or TiB (K, M, G, T and KB, MB, GB, TB: the same,
powers of 1024), or bytes (from 1 MiB).
";

/// The usage of `command` alone (its lines of USAGE, and the note on sizes
/// where it takes one); the whole usage for anything else.
fn usage_of(command: &str) -> String {
    let head = format!("  tidepool {command} ");
    let mut lines = USAGE.lines().skip_while(|line| !line.starts_with(&head));
    let Some(first) = lines.next() else { return USAGE.trim_end_matches('\n').to_string() };
    let mut text = format!("usage:\n{first}");
    for line in lines.take_while(|line| line.starts_with("      ") || line.starts_with("                ")) {
        text += &format!("\n{line}");
    }
    if first.contains("SIZE") {
        let sizes: Vec<&str> = USAGE.lines().skip_while(|line| !line.starts_with("SIZE:")).collect();
        text += &format!("\n\n{}", sizes.join("\n"));
    }
    text
}

/// Appended to a refused command line: one line, not the whole usage.
const SEE_HELP: &str = " (`tidepool help` lists the commands and their options)";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    // `tidepool plan --help` is a question, not a mistake.
    let asks_help = args.iter().any(|arg| arg == "--help" || arg == "-h");
    let result = match args.first().map(String::as_str) {
        _ if asks_help => {
            out!("{}", usage_of(args.first().map(String::as_str).unwrap_or("")));
            Ok(())
        }
        Some("replay") => run_replay(&args[1..]),
        Some("plan") => run_plan(&args[1..]),
        Some("top") => run_top(&args[1..]),
        Some("exporter") => run_exporter(&args[1..]),
        Some("cards") => run_cards(&args[1..]),
        Some("config") => {
            print_config();
            Ok(())
        }
        Some("--version") | Some("-V") => {
            out!("tidepool {}", env!("CARGO_PKG_VERSION"));
            Ok(())
        }
        Some("help") | None => {
            out!("{}", USAGE.trim_end_matches('\n'));
            Ok(())
        }
        Some(other) => Err(format!("unknown command {other:?}{SEE_HELP}")),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("tidepool: {message}");
            ExitCode::from(2)
        }
    }
}

/// The capacity of a replay given none: more than any device.
const UNLIMITED: u64 = 1 << 50;

/// Parsed options of replay and plan.
struct Options {
    files: Vec<PathBuf>,
    capacity: u64,
    conf: String,
    /// None: the default for each trace (`default_policies`).
    policies: Option<Vec<Policy>>,
    json: bool,
    plot: Option<PathBuf>,
    /// plan's bisection step (None: its default for the trace).
    step: Option<u64>,
}

fn parse_options(args: &[String], allow: &[&str]) -> Result<Options, String> {
    let mut options =
        Options { files: Vec::new(), capacity: UNLIMITED, conf: String::new(), policies: None, json: false, plot: None, step: None };
    let mut policies: Option<String> = None;
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        let mut value = |name: &str| it.next().cloned().ok_or_else(|| format!("{name} needs a value"));
        if arg.starts_with("--") && !allow.contains(&arg.as_str()) {
            return Err(format!("unknown option {arg}{SEE_HELP}"));
        }
        match arg.as_str() {
            "--capacity" => options.capacity = parse_size(&value("--capacity")?)?,
            // Given twice, they add up (later keys win, as in TIDEPOOL_CONF).
            "--conf" => {
                let more = value("--conf")?;
                options.conf = if options.conf.is_empty() { more } else { format!("{},{more}", options.conf) };
            }
            "--policy" => {
                let more = value("--policy")?;
                policies = Some(policies.map_or(more.clone(), |earlier| format!("{earlier},{more}")));
            }
            "--json" => options.json = true,
            "--plot" => options.plot = Some(PathBuf::from(value("--plot")?)),
            "--step" => options.step = Some(parse_size(&value("--step")?)?),
            file => options.files.push(PathBuf::from(file)),
        }
    }
    if options.files.is_empty() {
        return Err(format!("no trace file given{SEE_HELP}"));
    }
    options.policies = policies.as_deref().map(parse_policies).transpose()?;
    Config::builder().conf(&options.conf).map_err(|e| format!("--conf: {e}"))?;
    // Every file, and where the plot goes, before any replay takes time.
    for file in &options.files {
        std::fs::File::open(file).map_err(|err| format!("{}: cannot open: {err}", file.display()))?;
    }
    if let Some(parent) = options.plot.as_ref().and_then(|p| p.parent()).filter(|p| !p.as_os_str().is_empty()) {
        if !parent.is_dir() {
            return Err(format!("--plot: no folder {}", parent.display()));
        }
    }
    Ok(options)
}

/// What replay compares when --policy is not given: PyTorch's model as the
/// trace says PyTorch ran, and tidepool without and with expandable segments.
fn default_policies(trace: &Trace) -> Vec<Policy> {
    vec![Policy::pytorch_as_recorded(trace), Policy::Tidepool, Policy::Expandable]
}

/// "pytorch,expandable" -> the policies, in the order given.
fn parse_policies(text: &str) -> Result<Vec<Policy>, String> {
    let mut policies = Vec::new();
    for name in text.split(',') {
        let policy = match name.trim() {
            "all" => {
                policies.extend(Policy::ALL);
                continue;
            }
            // Earlier releases' name for tidepool and pytorch.
            "both" => {
                policies.extend([Policy::Tidepool, Policy::Pytorch]);
                continue;
            }
            other => Policy::ALL.into_iter().find(|p| p.name() == other),
        };
        let expected = "pytorch, tidepool, expandable, pytorch-expandable or all";
        policies.push(policy.ok_or_else(|| format!("--policy: expected {expected}, got {name:?}"))?);
    }
    // Each once, where first named.
    let mut unique = Vec::new();
    for policy in policies {
        if !unique.contains(&policy) {
            unique.push(policy);
        }
    }
    Ok(unique)
}

/// "24GiB", "512M", "1073741824" -> bytes.
fn parse_size(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let split = text.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let number: f64 = number.parse().map_err(|_| format!("bad size {text:?}"))?;
    let scale: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" | "kb" => 1 << 10,
        "m" | "mib" | "mb" => 1 << 20,
        "g" | "gib" | "gb" => 1 << 30,
        "t" | "tib" | "tb" => 1 << 40,
        _ => return Err(format!("bad size {text:?}: unknown unit {unit:?}")),
    };
    let bytes = number * scale as f64;
    if !(bytes.is_finite() && bytes >= 1.0 && bytes < 2f64.powi(62)) {
        return Err(format!("bad size {text:?}"));
    }
    // "--capacity 8 GiB" reads 8 bytes and a file named GiB: no one means
    // a device or a step of a few bytes.
    if unit.trim().is_empty() && bytes < (1u64 << 20) as f64 {
        return Err(format!("bad size {text:?}: a number alone is bytes; write its unit, in one word (\"{text}GiB\", \"{text}MiB\")"));
    }
    Ok(bytes as u64)
}

fn load(path: &Path) -> Result<Trace, String> {
    let trace = trace::load(path).map_err(|e| e.to_string())?;
    if trace.warnings.count > 0 {
        let count = trace.warnings.count;
        let noun = if count == 1 { "warning" } else { "warnings" };
        eprintln!("tidepool: {}: {count} {noun}, first: {}", path.display(), trace.warnings.first[0]);
    }
    Ok(trace)
}

fn run_replay(args: &[String]) -> Result<(), String> {
    let options = parse_options(args, &["--capacity", "--conf", "--policy", "--json", "--plot"])?;
    if options.plot.is_some() && options.files.len() > 1 {
        return Err("--plot draws one trace: give one file".into());
    }
    let progress = !options.json && std::io::stderr().is_terminal();
    for file in &options.files {
        if progress {
            eprint!("tidepool: reading {} ...\r", file.display());
        }
        let trace = load(file)?;
        let policies = options.policies.clone().unwrap_or_else(|| default_policies(&trace));
        // Each device on its own: a card's figures, never sums over cards.
        let (devices, parts): (Vec<u32>, Vec<_>) = trace.per_device().into_iter().unzip();
        let mut by_device: Vec<Vec<ReplayReport>> = Vec::new();
        for (&device, part) in devices.iter().zip(&parts) {
            let mut reports = Vec::new();
            for &policy in &policies {
                let samples = if options.plot.is_some() { 2000 } else { 0 };
                let replay_options =
                    ReplayOptions { capacity: options.capacity, policy, conf: options.conf.clone(), samples, record_to: None };
                let name = file.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
                let bar = |done: usize, total: usize| {
                    if progress {
                        let filled = 30 * done / total.max(1);
                        eprint!(
                            "{name} ({}) [{}{}] {:3}%\r",
                            policy.name(),
                            "#".repeat(filled),
                            " ".repeat(30 - filled),
                            100 * done / total.max(1)
                        );
                    }
                };
                reports.push(replay_device(device, part, &replay_options, bar)?);
            }
            by_device.push(reports);
        }
        if progress {
            eprint!("{:80}\r", "");
        }
        if options.json {
            for policy in 0..policies.len() {
                let reports: Vec<&ReplayReport> = by_device.iter().map(|reports| &reports[policy]).collect();
                out!("{}", policy_json(&reports));
            }
        } else {
            for (part, reports) in parts.iter().zip(&by_device) {
                let device = (trace.devices > 1).then_some(reports[0].device);
                print_report(part, reports, device);
            }
        }
        if let Some(path) = &options.plot {
            // The device with the most live memory: the card that decides.
            let largest = (0..parts.len()).max_by_key(|&i| parts[i].peak_requested()).unwrap_or(0);
            let mut title = format!("{} ({})", file.file_name().map(|n| n.to_string_lossy()).unwrap_or_default(), trace.format.name());
            if trace.devices > 1 {
                title += &format!(", device {}", devices[largest]);
            }
            tidepool_tools::trace::plot::write_svg(path, &title, &by_device[largest].iter().collect::<Vec<_>>())?;
            if !options.json {
                out!("plot written to {}", path.display());
            }
        }
    }
    Ok(())
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
    let width = reports.iter().map(|r| r.policy.title().len() + 2).max().unwrap_or(0).max(21);
    let mut header = format!("  {:<24}", "");
    for r in reports {
        header += &format!("{:>width$}", r.policy.title());
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
    row("OOMs", &|r| r.ooms.to_string(), None);
    row("fragmentation (peak)", &|r| format!("{:.1} %", 100.0 * r.fragmentation()), None);
    row("replay speed", &|r| format!("{:.1} M ev/s", r.events_per_second() / 1e6), None);
    for r in reports {
        if let Some(oom) = &r.first_oom {
            out!("  first OOM, {}: event {} of {}: {}", r.policy.title(), oom.event, r.events, oom.message);
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
    object["policy"] = largest.policy.name().into();
    object["devices"] = reports.iter().map(|r| report_json(r)).collect();
    object.to_string()
}

fn run_plan(args: &[String]) -> Result<(), String> {
    let options = parse_options(args, &["--conf", "--json", "--step"])?;
    if options.files.len() != 1 {
        return Err("plan takes one trace file".into());
    }
    let file = &options.files[0];
    let trace = load(file)?;
    let [pytorch, tidepool, expandable, pytorch_expandable] =
        Policy::ALL.map(|policy| smallest_capacity_per_device(&trace, policy, &options.conf, options.step));
    let (pytorch, tidepool, expandable, pytorch_expandable) = (pytorch?, tidepool?, expandable?, pytorch_expandable?);
    let peaks: Vec<u64> = {
        let all = trace.peak_requested_per_device();
        pytorch.iter().map(|p| all.get(p.device as usize).copied().unwrap_or(0)).collect()
    };
    // The card: the largest device's need.
    let need = |plans: &[Plan]| plans.iter().map(|p| p.min_capacity).max().unwrap_or(0);
    let step = pytorch.iter().map(|p| p.step).max().unwrap_or(0);
    // Per device, the first out-of-memory PyTorch recorded, and whether
    // each policy would have served that request on the memory PyTorch had.
    // (`served` in the order of Policy::ALL.)
    let parts = trace.per_device();
    let recorded_ooms: Vec<Option<(RecordedOom, Vec<bool>)>> = pytorch
        .iter()
        .map(|plan| {
            let Some((_, part)) = parts.iter().find(|(d, _)| *d == plan.device) else { return Ok(None) };
            let Some(&oom) = part.pytorch_ooms.first() else { return Ok(None) };
            let served = Policy::ALL.iter().map(|&policy| serves_recorded_oom(part, &oom, policy, &options.conf));
            Ok(Some((oom, served.collect::<Result<Vec<bool>, String>>()?)))
        })
        .collect::<Result<_, String>>()?;
    if options.json {
        let policy = |plan: &Plan| {
            serde_json::json!({
                "min_capacity_bytes": plan.min_capacity,
                "one_step_less": plan.one_step_less.as_ref().map(|oom| serde_json::json!({
                    "capacity_bytes": plan.min_capacity - plan.step,
                    "event": oom.event,
                    "message": oom.message,
                })),
            })
        };
        let devices: Vec<serde_json::Value> = (0..pytorch.len())
            .map(|d| {
                serde_json::json!({
                    "device": pytorch[d].device,
                    "peak_requested_bytes": peaks[d],
                    "step_bytes": pytorch[d].step,
                    "pytorch": policy(&pytorch[d]),
                    "tidepool": policy(&tidepool[d]),
                    "expandable": policy(&expandable[d]),
                    "pytorch_expandable": policy(&pytorch_expandable[d]),
                    "pytorch_recorded_oom": recorded_ooms[d].as_ref().map(|(oom, served)| serde_json::json!({
                        "event": oom.event,
                        "requested_bytes": oom.requested,
                        "reserved_bytes": oom.reserved,
                        "device_free_bytes": oom.device_free,
                        "usable_bytes": oom.usable(),
                        "served": Policy::ALL.iter().zip(served).map(|(p, &s)| (p.name().replace('-', "_"), s.into())).collect::<serde_json::Map<String, serde_json::Value>>(),
                    })),
                })
            })
            .collect();
        let card = |plans: &[Plan]| serde_json::json!({ "min_capacity_bytes": need(plans) });
        let object = serde_json::json!({
            "file": trace.source,
            "peak_requested_bytes": trace.peak_requested(),
            "step_bytes": step,
            "pytorch": card(&pytorch),
            "tidepool": card(&tidepool),
            "expandable": card(&expandable),
            "pytorch_expandable": card(&pytorch_expandable),
            "devices": devices,
        });
        out!("{object}");
    } else {
        out!("{} ({}): peak of live memory {}", trace.source, trace.format.name(), human_bytes(trace.peak_requested()));
        for d in 0..pytorch.len() {
            let prefix = if trace.devices > 1 {
                format!("device {}: peak of live memory {}; ", pytorch[d].device, human_bytes(peaks[d]))
            } else {
                String::new()
            };
            let step = pytorch[d].step;
            out!(
                "{prefix}needs {} with PyTorch's allocator, {} with PyTorch's expandable_segments:True, \
                 {} with tidepool, {} with tidepool expandable:true (in steps of {})",
                capacity_text(pytorch[d].min_capacity, step),
                capacity_text(pytorch_expandable[d].min_capacity, step),
                capacity_text(tidepool[d].min_capacity, step),
                capacity_text(expandable[d].min_capacity, step),
                step_text(step),
            );
            if let Some((oom, served)) = &recorded_ooms[d] {
                let verdict = |policy: Policy| {
                    let i = Policy::ALL.iter().position(|&p| p == policy).unwrap_or(0);
                    if served[i] {
                        "serves it"
                    } else {
                        "runs out too"
                    }
                };
                out!(
                    "  The recorded run ran out of memory at event {} asking {} (the needs above serve it too), with {} to use \
                     ({} held, {} free): there, PyTorch's allocator {}, with expandable_segments:True {}, tidepool {}, \
                     tidepool expandable:true {}",
                    oom.event,
                    human_bytes(oom.requested),
                    human_bytes(oom.usable()),
                    human_bytes(oom.reserved),
                    human_bytes(oom.device_free),
                    verdict(Policy::Pytorch),
                    verdict(Policy::PytorchExpandable),
                    verdict(Policy::Tidepool),
                    verdict(Policy::Expandable)
                );
            }
            if let Some(oom) = &expandable[d].one_step_less {
                let less = expandable[d].min_capacity - expandable[d].step;
                out!(
                    "  on {} (one step less), tidepool expandable:true runs out at event {}: {}",
                    capacity_text(less, step),
                    oom.event,
                    oom.message
                );
            }
        }
        if trace.allocs == 0 {
            out!("The trace allocates nothing: no device needed.");
            return Ok(());
        }
        let best = need(&tidepool).min(need(&expandable));
        let ours_name = if need(&expandable) < need(&tidepool) { "tidepool expandable:true" } else { "tidepool" };
        let each = if pytorch.len() > 1 { format!("each of the {} devices ", pytorch.len()) } else { String::new() };
        let (theirs, how) = match Policy::pytorch_as_recorded(&trace) {
            Policy::PytorchExpandable => (&pytorch_expandable, " with expandable segments (as recorded)"),
            _ => (&pytorch, ""),
        };
        let (ours, theirs) = (card_advice(best), card_advice(need(theirs)));
        if ours == theirs {
            out!("{ours_name} and PyTorch's allocator{how}: {each}{ours}.");
        } else {
            out!("{ours_name}: {each}{ours}. PyTorch's allocator{how}: {each}{theirs}.");
        }
    }
    Ok(())
}

/// A device size `plan` found to `step` bytes, as precisely as the step
/// makes it: GiB for steps of 16 MiB and more, MiB (and GiB beside them
/// from 1 GiB on) for finer ones, whole for a step of whole MiB, else to
/// the KiB (JSON has the bytes).
fn capacity_text(bytes: u64, step: u64) -> String {
    const MIB: f64 = (1u64 << 20) as f64;
    let gib = format!("{:.2} GiB", bytes as f64 / (1u64 << 30) as f64);
    if step >= 16 << 20 {
        return gib;
    }
    let decimals = if step.is_multiple_of(1 << 20) { 0 } else { 3 };
    let mib = format!("{:.*} MiB", decimals, bytes as f64 / MIB);
    if bytes >= 1 << 30 {
        format!("{gib} ({mib})")
    } else {
        mib
    }
}

/// `plan`'s step: "4 MiB", "512 KiB", "6.40 MiB".
fn step_text(step: u64) -> String {
    match step {
        s if s.is_multiple_of(1 << 20) => format!("{} MiB", s >> 20),
        s if s.is_multiple_of(1 << 10) && s < 1 << 20 => format!("{} KiB", s >> 10),
        s => human_bytes(s),
    }
}

fn run_top(args: &[String]) -> Result<(), String> {
    let (mut once, mut json, mut named_dir) = (false, false, None);
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--once" => once = true,
            "--json" => json = true,
            "--registry-dir" => named_dir = Some(PathBuf::from(it.next().ok_or("top: --registry-dir needs a value")?)),
            other => return Err(format!("top: unknown option {other}{SEE_HELP}")),
        }
    }
    let config = Config::from_env();
    let dir = named_dir.or_else(|| config.registry_dir.clone()).unwrap_or_else(registry::default_dir);
    if json {
        out!("{}", top_json(&dir));
        return Ok(());
    }
    loop {
        let table = top_table(&dir);
        if once {
            out!("{}", table.trim_end_matches('\n'));
            return Ok(());
        }
        let mut stdout = std::io::stdout();
        if write!(stdout, "\x1b[2J\x1b[H{table}").and_then(|()| stdout.flush()).is_err() {
            return Ok(()); // stdout closed: nothing left to show it to
        }
        std::thread::sleep(std::time::Duration::from_secs(1));
    }
}

/// `tidepool cards`: the cards `plan` names, as a table or one JSON object.
fn run_cards(args: &[String]) -> Result<(), String> {
    let json = match args {
        [] => false,
        [flag] if flag == "--json" => true,
        _ => return Err(format!("cards: unknown option {}{SEE_HELP}", args.join(" "))),
    };
    if json {
        let list: Vec<serde_json::Value> = cards::CARDS
            .iter()
            .map(|card| serde_json::json!({ "name": card.name, "total_mib": card.total_mib, "usable_bytes": card.usable() }))
            .collect();
        out!("{}", serde_json::json!({ "context_bytes": cards::CONTEXT_BYTES, "cards": list }));
        return Ok(());
    }
    out!(
        "The cards `tidepool plan` names: their memory as nvidia-smi shows its total, and what an allocator gets of it \
         ({:.1} GiB less, for the driver and the CUDA context).",
        cards::CONTEXT_BYTES as f64 / (1u64 << 30) as f64
    );
    out!("{:<10} {:>11} {:>18}", "card", "memory", "for the allocator");
    for card in cards::CARDS {
        out!("{:<10} {:>7} MiB {:>14.1} GiB", card.name, card.total_mib, card.usable_gib());
    }
    Ok(())
}

fn top_table(dir: &Path) -> String {
    let found = registry::scan(dir);
    // The device column as wide as its longest key (a GPU's is 40 characters).
    let width = found.registries.iter().map(|r| r.key.len()).max().unwrap_or(0).max("device".len());
    let mut out = format!("tidepool processes ({})\n", dir.display());
    out += &format!(
        "{:<width$} {:>8} {:<15} {:>4} {:>11} {:>11} {:>11} {:>6} {:>11} {:>11} {:>11} {:>11} {:>11} {:>11}\n",
        "device",
        "pid",
        "comm",
        "dev",
        "allocated",
        "reserved",
        "cached free",
        "frag",
        "idle decay",
        "headroom",
        "oom",
        "for others",
        "requesting",
        "paused"
    );
    if found.registries.iter().all(|r| r.entries.is_empty()) {
        out += "(none)\n";
    }
    for r in &found.registries {
        for e in &r.entries {
            let released = |reason: Reason| human_bytes(e.released[reason as usize]);
            out += &format!(
                "{:<width$} {:>8} {:<15} {:>4} {:>11} {:>11} {:>11} {:>5.1}% {:>11} {:>11} {:>11} {:>11} {:>11} {:>11}\n",
                r.key,
                e.pid,
                e.comm(),
                e.device,
                human_bytes(e.allocated),
                human_bytes(e.reserved),
                human_bytes(e.cached_free),
                100.0 * e.fragmentation(),
                released(Reason::IdleDecay),
                released(Reason::Headroom),
                released(Reason::OutOfMemory),
                released(Reason::Cooperation),
                if e.request_bytes > 0 { human_bytes(e.request_bytes) } else { "-".into() },
                if e.paused > 0 { human_bytes(e.paused) } else { "-".into() },
            );
        }
    }
    for (path, error) in &found.errors {
        out += &format!("skipped {}: {}\n", path.display(), error.name());
    }
    out
}

fn top_json(dir: &Path) -> String {
    let found = registry::scan(dir);
    let mut processes = Vec::new();
    for r in &found.registries {
        for e in &r.entries {
            let released: serde_json::Map<String, serde_json::Value> =
                Reason::ALL.iter().map(|&reason| (reason.name().to_string(), e.released[reason as usize].into())).collect();
            processes.push(serde_json::json!({
                "device_key": r.key,
                "pid": e.pid,
                "comm": e.comm(),
                "device": e.device,
                "heartbeat_ms": e.heartbeat_ms,
                "allocated_bytes": e.allocated,
                "reserved_bytes": e.reserved,
                "cached_free_bytes": e.cached_free,
                "inactive_split_bytes": e.inactive_split,
                "largest_free_block_bytes": e.largest_free_block,
                "fragmentation": (e.fragmentation() * 1000.0).round() / 1000.0,
                "released_bytes": released,
                "requests_served": e.requests_served,
                "requests_posted": e.requests_posted,
                "ooms": e.ooms,
                "request_bytes": e.request_bytes,
                "device_total_bytes": e.device_total,
                "device_free_bytes": e.device_free,
                "paused_bytes": e.paused,
            }));
        }
    }
    let skipped: Vec<serde_json::Value> = found
        .errors
        .iter()
        .map(|(path, error)| serde_json::json!({ "file": path.display().to_string(), "reason": error.name() }))
        .collect();
    serde_json::json!({ "registry_dir": dir.display().to_string(), "processes": processes, "skipped": skipped }).to_string()
}

fn run_exporter(args: &[String]) -> Result<(), String> {
    let mut listen: Option<String> = None;
    let mut dirs = Vec::new();
    let mut textfile: Option<PathBuf> = None;
    let (mut interval, mut timeout, mut max_connections, mut once) = (15.0f64, 10.0f64, 64usize, false);
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        let mut value = |name: &str| it.next().cloned().ok_or_else(|| format!("exporter: {name} needs a value"));
        let seconds = |name: &str, text: String| {
            text.parse::<f64>()
                .ok()
                .filter(|s| s.is_finite() && *s > 0.0 && *s <= 86_400.0)
                .ok_or_else(|| format!("exporter: {name}: expected seconds, got {text:?}"))
        };
        match arg.as_str() {
            "--listen" => listen = Some(value("--listen")?),
            "--registry-dir" => dirs.push(PathBuf::from(value("--registry-dir")?)),
            "--textfile" => textfile = Some(PathBuf::from(value("--textfile")?)),
            "--interval" => interval = seconds("--interval", value("--interval")?)?,
            "--timeout" => timeout = seconds("--timeout", value("--timeout")?)?,
            "--max-connections" => {
                let text = value("--max-connections")?;
                max_connections = text
                    .parse()
                    .ok()
                    .filter(|n| (1..=4096).contains(n))
                    .ok_or_else(|| format!("exporter: --max-connections: expected 1 to 4096, got {text:?}"))?;
            }
            "--once" => once = true,
            other => return Err(format!("exporter: unknown option {other}{SEE_HELP}")),
        }
    }
    if once && textfile.is_none() {
        return Err("exporter: --once writes the textfile once: give --textfile".into());
    }
    if once && listen.is_some() {
        return Err("exporter: --once writes the textfile once and exits: it serves nothing, so give no --listen".into());
    }
    if dirs.is_empty() {
        dirs.push(Config::from_env().registry_dir.unwrap_or_else(registry::default_dir));
    }
    let exporter = std::sync::Arc::new(tidepool_tools::exporter::Exporter::new(dirs, tidepool_tools::exporter::hostname()));
    let serving = listen.is_some() || textfile.is_none();
    let listener = if serving {
        let listen = listen.unwrap_or_else(|| "127.0.0.1:9464".into());
        // An address or a host name ("localhost:9464"): its first address.
        let addr = std::net::ToSocketAddrs::to_socket_addrs(listen.as_str())
            .ok()
            .and_then(|mut addrs| addrs.next())
            .ok_or_else(|| format!("exporter: --listen: expected ADDR:PORT or HOST:PORT, got {listen:?}"))?;
        let listener = std::net::TcpListener::bind(addr).map_err(|e| format!("exporter: cannot listen on {addr}: {e}"))?;
        let bound = listener.local_addr().map_err(|e| e.to_string())?;
        if !bound.ip().is_loopback() {
            eprintln!("tidepool exporter: warning: serving on {bound}, beyond this machine: whoever reaches it sees process names and memory figures");
        }
        // The bound address (a port 0 becomes the one the kernel chose), for scripts and tests.
        out!("tidepool exporter: listening on {bound}, metrics at http://{bound}/metrics");
        Some(listener)
    } else {
        None
    };
    let dirs: Vec<String> = exporter.dirs().iter().map(|d| d.display().to_string()).collect();
    eprintln!("tidepool exporter: reading the registries in {}", dirs.join(", "));
    if let Some(path) = textfile {
        if once {
            return write_textfile(&exporter, &path).map_err(|e| format!("exporter: --textfile {}: {e}", path.display()));
        }
        let interval = std::time::Duration::from_secs_f64(interval);
        let exporter = exporter.clone();
        let writer = move || loop {
            if let Err(err) = write_textfile(&exporter, &path) {
                eprintln!("tidepool exporter: --textfile {}: {err}", path.display());
            }
            std::thread::sleep(interval);
        };
        match listener {
            None => writer(),
            Some(_) => {
                std::thread::Builder::new().name("tidepool-textfile".into()).spawn(writer).map_err(|e| format!("exporter: {e}"))?;
            }
        }
    }
    let options = serve::ServeOptions { timeout: std::time::Duration::from_secs_f64(timeout), max_connections };
    serve::serve(exporter, listener.expect("serving"), options)
}

/// Writes a scrape in the text format to `path`: to a hidden temporary file
/// in the same directory first, then renamed over `path`, so a reader
/// (node_exporter's textfile collector reads `*.prom`) never sees half a file.
fn write_textfile(exporter: &tidepool_tools::exporter::Exporter, path: &Path) -> std::io::Result<()> {
    use std::io::Write as _;
    let text = exporter.scrape(tidepool_tools::exporter::exposition::Format::Text);
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let name = path.file_name().ok_or_else(|| std::io::Error::other("no file name"))?.to_string_lossy();
    let temporary = dir.join(format!(".{name}.{}.tmp", std::process::id()));
    let result = (|| {
        let mut file = std::fs::File::create(&temporary)?;
        file.write_all(text.as_bytes())?;
        file.sync_all()?;
        std::fs::rename(&temporary, path)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&temporary);
    }
    result
}

fn print_config() {
    let text = std::env::var("TIDEPOOL_CONF").unwrap_or_default();
    let (config, warnings) = Config::parse(&text);
    for warning in &warnings {
        eprintln!("tidepool: warning: TIDEPOOL_CONF: {warning}");
    }
    out!("TIDEPOOL_CONF={text:?}\n");
    out!("{:<26} {:<10} {:<10} meaning", "key", "default", "current");
    for spec in OPTIONS {
        out!("{:<26} {:<10} {:<10} {}", spec.key, spec.default, (spec.show)(&config), spec.help);
    }
}
