//! `tidepool cards`: the GPU cards `tidepool plan` names, their memory
//! and what an allocator gets of it.

use tidepool_tools::trace::cards;

use super::out;

/// The GPU cards `tidepool plan` names, their memory and what an allocator gets of it
#[derive(clap::Args)]
#[command(override_usage = "tidepool cards [--json]")]
pub struct Args {
    /// One JSON object
    #[arg(long)]
    json: bool,
}

/// `tidepool cards`: the cards `plan` names, as a table or one JSON object.
pub fn run(args: Args) -> Result<(), String> {
    let json = args.json;
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
