//! `tidepool cards`: the GPU cards `tidepool plan` names, their memory,
//! what an allocator gets of it and their compute capability; given cards
//! by name or memory, those (the planner's `--cards` asks it).

use tidepool_tools::trace::cards::{self, Choice};

use super::out;

/// The GPU cards `tidepool plan` names, their memory, what an allocator gets of it and their compute capability
#[derive(clap::Args)]
#[command(override_usage = "tidepool cards [CARD|MEMORY]... [--json]")]
pub struct Args {
    /// Only these: a card by name or alias ("H100 80GB", "4090"; case and spaces aside), or a card's memory with its unit
    /// ("24GB" is 24·10^9 bytes, as vendors state it; "24GiB" 24·2^30), of which an allocator gets all but 1.5 GiB
    #[arg(value_name = "CARD|MEMORY")]
    cards: Vec<String>,
    /// One JSON object
    #[arg(long)]
    json: bool,
}

/// `tidepool cards`: the cards `plan` names, or those asked for, as a
/// table or one JSON object.
pub fn run(args: Args) -> Result<(), String> {
    let chosen: Vec<Choice> = if args.cards.is_empty() {
        cards::CARDS.iter().map(|card| Choice::Listed(*card)).collect()
    } else {
        let entries = args.cards.iter().flat_map(|text| text.split(',')).filter(|entry| !entry.trim().is_empty());
        entries.map(cards::choose).collect::<Result<_, _>>().map_err(|why| format!("cards: {why}"))?
    };
    if chosen.is_empty() {
        return Err("cards: no card given".into());
    }
    if args.json {
        let list: Vec<serde_json::Value> = chosen
            .iter()
            .map(|choice| {
                let card = choice.card();
                serde_json::json!({
                    "name": choice.name(),
                    "aliases": card.map_or(&[][..], |card| card.aliases),
                    "total_bytes": choice.total_bytes(),
                    "usable_bytes": choice.usable(),
                    "compute_capability": card.map(|card| card.compute_capability_text()),
                })
            })
            .collect();
        out!("{}", serde_json::json!({ "context_bytes": cards::CONTEXT_BYTES, "cards": list }));
        return Ok(());
    }
    out!(
        "{}: their memory as nvidia-smi shows its total, what an allocator gets of it ({:.1} GiB less, for the driver \
         and the CUDA context), their compute capability and other names.",
        if args.cards.is_empty() { "The cards `tidepool plan` names" } else { "The cards given" },
        cards::CONTEXT_BYTES as f64 / (1u64 << 30) as f64
    );
    out!("{:<10} {:>11} {:>18}  {:<7}  {}", "card", "memory", "for the allocator", "compute", "also");
    for choice in chosen {
        let card = choice.card();
        let gib = choice.usable() as f64 / (1u64 << 30) as f64;
        let compute = card.map_or("-".to_string(), |card| card.compute_capability_text());
        let also = card.map_or(String::new(), |card| card.aliases.join(", "));
        let line = format!("{:<10} {:>7} MiB {:>14.1} GiB  {:<7}  {}", choice.name(), choice.total_bytes() >> 20, gib, compute, also);
        out!("{}", line.trim_end());
    }
    Ok(())
}
