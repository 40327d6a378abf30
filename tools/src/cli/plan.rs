//! `tidepool plan`: the smallest device a trace fits, with each allocator,
//! device by device, and the card that holds it.

use std::path::PathBuf;

use tidepool::error::human_bytes;
use tidepool_tools::trace::cards::card_advice_for_trace;
use tidepool_tools::trace::plan::{smallest_capacity_per_device, Plan};
use tidepool_tools::trace::replay::{serves_recorded_oom, Model};
use tidepool_tools::trace::{RecordedOom, Trace};

use super::{args, out, SIZES};

/// The smallest device the trace fits, with PyTorch's allocator (with and
/// without its expandable segments) and with tidepool (with its expandable
/// segments, as it runs by default, and with whole segments); a trace of
/// several GPUs gets one answer per device
#[derive(clap::Args)]
#[command(override_usage = "tidepool plan FILE [--conf KEY:VAL,...] [--step SIZE] [--bf16] [--json]", after_help = SIZES)]
pub struct Args {
    /// The trace
    #[arg(value_name = "FILE")]
    files: Vec<PathBuf>,
    /// tidepool's configuration, as TIDEPOOL_CONF takes it (given twice, both apply; later keys win)
    #[arg(long, value_name = "KEY:VAL,...")]
    conf: Vec<String>,
    /// The precision of the search (default: the larger of 2 MiB and 0.25 % of the peak of live memory, in whole MiB)
    #[arg(long, value_name = "SIZE", value_parser = args::size)]
    step: Option<u64>,
    /// The workload runs in bf16: cards below compute capability 8.0 are left out
    #[arg(long)]
    bf16: bool,
    /// One JSON object
    #[arg(long)]
    json: bool,
}

/// Per device, the first out-of-memory PyTorch recorded, and whether each
/// model would have served that request on the memory PyTorch had (in the
/// order of `Model::ALL`).
type RecordedOomVerdicts = Option<(RecordedOom, Vec<bool>)>;

/// What `plan` found: each model's plans, device by device (in the same
/// order), each device's peak of live memory, and its recorded OOM.
struct Plans {
    pytorch: Vec<Plan>,
    tidepool: Vec<Plan>,
    whole: Vec<Plan>,
    pytorch_expandable: Vec<Plan>,
    peaks: Vec<u64>,
    recorded_ooms: Vec<RecordedOomVerdicts>,
}

pub fn run(args: Args) -> Result<(), String> {
    let conf = args::conf(&args.conf)?;
    args::check_files(&args.files, None)?;
    if args.files.len() != 1 {
        return Err("plan takes one trace file".into());
    }
    let trace = args::load(&args.files[0])?;
    let plans = plan(&trace, &conf, args.step)?;
    if args.json {
        print_json(&trace, &plans, args.bf16);
    } else {
        print_text(&trace, &plans, args.bf16);
    }
    Ok(())
}

/// The smallest device with each model, device by device, and what each
/// would have done with the out-of-memory PyTorch recorded.
fn plan(trace: &Trace, conf: &str, step: Option<u64>) -> Result<Plans, String> {
    let [pytorch, tidepool, whole, pytorch_expandable] = Model::ALL.map(|model| smallest_capacity_per_device(trace, model, conf, step));
    let (pytorch, tidepool, whole, pytorch_expandable) = (pytorch?, tidepool?, whole?, pytorch_expandable?);
    let peaks: Vec<u64> = {
        let all = trace.peak_requested_per_device();
        pytorch.iter().map(|p| all.get(p.device as usize).copied().unwrap_or(0)).collect()
    };
    let parts = trace.per_device();
    let recorded_ooms: Vec<RecordedOomVerdicts> = pytorch
        .iter()
        .map(|plan| {
            let Some((_, part)) = parts.iter().find(|(d, _)| *d == plan.device) else { return Ok(None) };
            let Some(&oom) = part.pytorch_ooms.first() else { return Ok(None) };
            let served = Model::ALL.iter().map(|&model| serves_recorded_oom(part, &oom, model, conf));
            Ok(Some((oom, served.collect::<Result<Vec<bool>, String>>()?)))
        })
        .collect::<Result<_, String>>()?;
    Ok(Plans { pytorch, tidepool, whole, pytorch_expandable, peaks, recorded_ooms })
}

/// The card: the largest device's need.
fn need(plans: &[Plan]) -> u64 {
    plans.iter().map(|p| p.min_capacity).max().unwrap_or(0)
}

/// `--json`: one object, with whether `--bf16` was given.
fn print_json(trace: &Trace, plans: &Plans, bf16: bool) {
    let Plans { pytorch, tidepool, whole, pytorch_expandable, peaks, recorded_ooms } = plans;
    let step = pytorch.iter().map(|p| p.step).max().unwrap_or(0);
    let model = |plan: &Plan| {
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
                "pytorch": model(&pytorch[d]),
                "tidepool": model(&tidepool[d]),
                "whole_segments": model(&whole[d]),
                "pytorch_expandable": model(&pytorch_expandable[d]),
                "pytorch_recorded_oom": recorded_ooms[d].as_ref().map(|(oom, served)| serde_json::json!({
                    "event": oom.event,
                    "requested_bytes": oom.requested,
                    "reserved_bytes": oom.reserved,
                    "device_free_bytes": oom.device_free,
                    "usable_bytes": oom.usable(),
                    "served": Model::ALL.iter().zip(served).map(|(p, &s)| (p.name().replace('-', "_"), s.into())).collect::<serde_json::Map<String, serde_json::Value>>(),
                })),
            })
        })
        .collect();
    let card = |plans: &[Plan]| serde_json::json!({ "min_capacity_bytes": need(plans) });
    let object = serde_json::json!({
        "file": trace.source,
        "peak_requested_bytes": trace.peak_requested(),
        "step_bytes": step,
        "bf16": bf16,
        "pytorch": card(pytorch),
        "tidepool": card(tidepool),
        "whole_segments": card(whole),
        "pytorch_expandable": card(pytorch_expandable),
        "devices": devices,
    });
    out!("{object}");
}

/// The text: a line per device (and its recorded OOM, and where tidepool
/// runs out one step below), then the card (one that runs bf16, with
/// `bf16`).
fn print_text(trace: &Trace, plans: &Plans, bf16: bool) {
    out!("{} ({}): peak of live memory {}", trace.source, trace.format.name(), human_bytes(trace.peak_requested()));
    for d in 0..plans.pytorch.len() {
        print_device(trace, plans, d);
    }
    if trace.allocs == 0 {
        out!("The trace allocates nothing: no device needed.");
        return;
    }
    let Plans { pytorch, tidepool, whole, pytorch_expandable, .. } = plans;
    let best = need(tidepool).min(need(whole));
    let ours_name = if need(whole) < need(tidepool) { "tidepool expandable:false" } else { "tidepool" };
    let each = if pytorch.len() > 1 { format!("each of the {} devices ", pytorch.len()) } else { String::new() };
    let (theirs, how) = match Model::pytorch_as_recorded(trace) {
        Model::PytorchExpandable => (pytorch_expandable, " with expandable segments (as recorded)"),
        _ => (pytorch, ""),
    };
    let (ours, theirs) = (card_advice_for_trace(best, bf16), card_advice_for_trace(need(theirs), bf16));
    if ours == theirs {
        out!("{ours_name} and PyTorch's allocator{how}: {each}{ours}.");
    } else {
        out!("{ours_name}: {each}{ours}. PyTorch's allocator{how}: {each}{theirs}.");
    }
}

/// The text's lines for the `d`th device.
fn print_device(trace: &Trace, plans: &Plans, d: usize) {
    let Plans { pytorch, tidepool, whole, pytorch_expandable, peaks, recorded_ooms } = plans;
    let prefix = if trace.devices > 1 {
        format!("device {}: peak of live memory {}; ", pytorch[d].device, human_bytes(peaks[d]))
    } else {
        String::new()
    };
    let step = pytorch[d].step;
    out!(
        "{prefix}needs {} with PyTorch's allocator, {} with PyTorch's expandable_segments:True, \
         {} with tidepool, {} with tidepool expandable:false (in steps of {})",
        capacity_text(pytorch[d].min_capacity, step),
        capacity_text(pytorch_expandable[d].min_capacity, step),
        capacity_text(tidepool[d].min_capacity, step),
        capacity_text(whole[d].min_capacity, step),
        step_text(step),
    );
    if let Some((oom, served)) = &recorded_ooms[d] {
        let verdict = |model: Model| {
            let i = Model::ALL.iter().position(|&p| p == model).unwrap_or(0);
            if served[i] {
                "serves it"
            } else {
                "runs out too"
            }
        };
        out!(
            "  The recorded run ran out of memory at event {} asking {} (the needs above serve it too), with {} to use \
             ({} held, {} free): there, PyTorch's allocator {}, with expandable_segments:True {}, tidepool {}, \
             tidepool expandable:false {}",
            oom.event,
            human_bytes(oom.requested),
            human_bytes(oom.usable()),
            human_bytes(oom.reserved),
            human_bytes(oom.device_free),
            verdict(Model::Pytorch),
            verdict(Model::PytorchExpandable),
            verdict(Model::Tidepool),
            verdict(Model::WholeSegments)
        );
    }
    if let Some(oom) = &tidepool[d].one_step_less {
        let less = tidepool[d].min_capacity - tidepool[d].step;
        out!("  on {} (one step less), tidepool runs out at event {}: {}", capacity_text(less, step), oom.event, oom.message);
    }
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
