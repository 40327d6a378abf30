//! The GPU cards a plan is compared with, and how much of each an
//! allocator gets.
//!
//! A card sold as "N GB" holds less than N GiB for the allocator: its
//! memory is what `nvidia-smi` shows as its total (an L40S "48GB": 46,068
//! MiB, 45.0 GiB, with ECC on as shipped; an H100 "80GB": 81,559 MiB), and
//! of that the driver keeps some and the CUDA context of the process, with
//! the kernels PyTorch and its libraries load, takes more before the
//! first tensor. `CONTEXT_BYTES` is that allowance; what a card gives an
//! allocator is its total less it (`Card::usable`). It is set from a real
//! run: a PyTorch snapshot of a process on an 80 GB card
//! (../shared/traces, constructorsun_two_gpus, device 1) held 78.42 GiB
//! and had 91 MiB free at its OOM, 78.51 GiB for the allocator: 1.1 GiB
//! below an H100's total, 1.5 GiB below an A100 80GB's. A card of one's
//! own is measured best in an idle process: `torch.cuda.mem_get_info()[0]`
//! after one matmul (cuda/check/run.sh does).
//!
//! A card is named as people name and buy it (`choose`): its name or one
//! of its aliases (the names `nvidia-smi` and clouds give it), or the
//! last words of one ("4090"); a name two cards share ("A100") is refused
//! with both. A card not listed is given by its memory with the unit its
//! vendor states: "24GB" is 24·10^9 bytes, "24GiB" 24·2^30, and the
//! allocator gets that less `CONTEXT_BYTES`, as of a listed card.
//!
//! Invariant (tested): `CARDS` ascends by memory, so the first card that
//! holds a need is the smallest that does.
#![forbid(unsafe_code)]

/// Kept from each card's total for the driver and the CUDA context: 1.5 GiB.
pub const CONTEXT_BYTES: u64 = 3 << 29;

/// A card: its name, the other names it goes by, its memory as
/// `nvidia-smi` shows the total and its compute capability.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Card {
    pub name: &'static str,
    /// Other names of this card (or of one with its memory and compute
    /// capability), matched as the name is.
    pub aliases: &'static [&'static str],
    pub total_mib: u64,
    /// CUDA compute capability, (major, minor): (7, 5) is sm75. What
    /// PyTorch runs on a card follows it (bf16 and flash attention need
    /// 8.0).
    pub compute_capability: (u8, u8),
}

impl Card {
    /// The bytes an allocator can take on the card.
    pub fn usable(&self) -> u64 {
        (self.total_mib << 20).saturating_sub(CONTEXT_BYTES)
    }

    /// `usable` in GiB, for people.
    pub fn usable_gib(&self) -> f64 {
        self.usable() as f64 / (1u64 << 30) as f64
    }

    /// "7.5".
    pub fn compute_capability_text(&self) -> String {
        format!("{}.{}", self.compute_capability.0, self.compute_capability.1)
    }

    /// Whether a bf16 workload runs on the card as recorded: bf16 tensor
    /// cores, and PyTorch's fused attention taking bf16, come with
    /// `BF16_COMPUTE_CAPABILITY`.
    pub fn runs_bf16(&self) -> bool {
        self.compute_capability >= BF16_COMPUTE_CAPABILITY
    }
}

/// The compute capability bf16 work needs: below 8.0 (the T4's 7.5) a card
/// has no bf16 tensor cores, and PyTorch's flash attention takes no bf16.
pub const BF16_COMPUTE_CAPABILITY: (u8, u8) = (8, 0);

const fn card(name: &'static str, aliases: &'static [&'static str], total_mib: u64, compute_capability: (u8, u8)) -> Card {
    Card { name, aliases, total_mib, compute_capability }
}

/// Data-centre and workstation cards PyTorch jobs run on, by memory
/// (`nvidia-smi`'s total with the card's ECC setting as shipped). The
/// aliases are the names `nvidia-smi` (less its "NVIDIA") and clouds give
/// them: the H100 is the SXM and the PCIe card (both 81,559 MiB), each
/// A100 its SXM4 and PCIe card; the A10 and L40 have the memory and the
/// compute capability of the A10G and L40S and are planned as them.
/// Compute capabilities as NVIDIA lists them (developer.nvidia.com/cuda-gpus:
/// T4 7.5; A100 8.0; A10 (the A10G's chip) and RTX A6000 8.6; L4, L40S and
/// GeForce RTX 4090 8.9; H100 and H200 9.0; B200 10.0).
pub const CARDS: [Card; 12] = [
    card("T4", &["Tesla T4"], 15_360, (7, 5)),
    card("A10G", &["A10"], 23_028, (8, 6)),
    card("L4", &[], 23_034, (8, 9)),
    card("RTX 4090", &["GeForce RTX 4090"], 24_564, (8, 9)),
    card("A100 40GB", &["A100", "A100 SXM4 40GB", "A100 PCIe 40GB", "A100 SXM", "A100 PCIe"], 40_960, (8, 0)),
    card("L40S", &["L40"], 46_068, (8, 9)),
    card("RTX A6000", &[], 49_140, (8, 6)),
    card("H100", &["H100 80GB", "H100 SXM", "H100 SXM5", "H100 PCIe", "H100 80GB HBM3"], 81_559, (9, 0)),
    card("A100 80GB", &["A100", "A100 SXM4 80GB", "A100 80GB PCIe", "A100 SXM", "A100 PCIe"], 81_920, (8, 0)),
    card("H100 NVL", &[], 95_830, (9, 0)),
    card("H200", &["H200 141GB", "H200 SXM"], 143_771, (9, 0)),
    card("B200", &[], 183_359, (10, 0)),
];

/// Letters and digits, lower case: "A100-80GB" and "a100 80gb" are one name.
fn key(text: &str) -> String {
    text.chars().filter(|c| c.is_ascii_alphanumeric()).map(|c| c.to_ascii_lowercase()).collect()
}

/// The words of a name, a leading "NVIDIA" aside (`nvidia-smi` and
/// `torch.cuda.get_device_name()` start with it).
fn words(text: &str) -> Vec<&str> {
    let words: Vec<&str> = text.split(|c: char| c.is_whitespace() || c == '-' || c == '_').filter(|w| !w.is_empty()).collect();
    match words.split_first() {
        Some((first, rest)) if first.eq_ignore_ascii_case("nvidia") && !rest.is_empty() => rest.to_vec(),
        _ => words,
    }
}

/// Why a name finds no one card.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NotFound {
    /// No card has the name, or ends with it.
    Unknown,
    /// Several cards do: their names.
    Ambiguous(Vec<&'static str>),
}

/// The card a name names, case, spaces, hyphens and a leading "NVIDIA"
/// aside ("a100-80gb", "A100 80GB" and "NVIDIA A100 80GB PCIe" are one
/// card): a name or alias in full, else the last words of one ("4090",
/// "80GB PCIe"). A name of several cards ("A100") is `Ambiguous`.
pub fn find(name: &str) -> Result<Card, NotFound> {
    let wanted = key(&words(name).concat());
    if wanted.is_empty() {
        return Err(NotFound::Unknown);
    }
    let names = |card: &Card| std::iter::once(card.name).chain(card.aliases.iter().copied()).collect::<Vec<_>>();
    let matching = |matches: &dyn Fn(&str) -> bool| -> Vec<Card> {
        CARDS.iter().copied().filter(|card| names(card).iter().any(|name| matches(name))).collect()
    };
    let mut found = matching(&|name| key(name) == wanted);
    if found.is_empty() {
        found = matching(&|name| {
            let words = words(name);
            (1..words.len()).any(|first| key(&words[first..].concat()) == wanted)
        });
    }
    match found.as_slice() {
        [] => Err(NotFound::Unknown),
        [card] => Ok(*card),
        several => Err(NotFound::Ambiguous(several.iter().map(|card| card.name).collect())),
    }
}

/// A card a plan is compared with: one of `CARDS`, or one given by its
/// memory ("24GB").
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Choice {
    Listed(Card),
    /// Its name ("24 GB", "22.5 GiB") and its memory in bytes.
    Memory {
        name: String,
        total_bytes: u64,
    },
}

impl Choice {
    pub fn name(&self) -> &str {
        match self {
            Choice::Listed(card) => card.name,
            Choice::Memory { name, .. } => name,
        }
    }

    /// The card's memory, all of it.
    pub fn total_bytes(&self) -> u64 {
        match self {
            Choice::Listed(card) => card.total_mib << 20,
            Choice::Memory { total_bytes, .. } => *total_bytes,
        }
    }

    /// What an allocator gets: the memory less `CONTEXT_BYTES`.
    pub fn usable(&self) -> u64 {
        self.total_bytes().saturating_sub(CONTEXT_BYTES)
    }

    /// The listed card, whose compute capability is known.
    pub fn card(&self) -> Option<Card> {
        match self {
            Choice::Listed(card) => Some(*card),
            Choice::Memory { .. } => None,
        }
    }
}

/// The units a card's memory is given in, as vendors and `nvidia-smi` write
/// them: decimal GB as cards are sold, binary MiB and GiB as `nvidia-smi`
/// and PyTorch count.
const UNITS: [(&str, u64); 8] = [
    ("KB", 1_000),
    ("MB", 1_000_000),
    ("GB", 1_000_000_000),
    ("TB", 1_000_000_000_000),
    ("KiB", 1 << 10),
    ("MiB", 1 << 20),
    ("GiB", 1 << 30),
    ("TiB", 1 << 40),
];

/// "24GB", "24 GB", "22.5GiB": a number, then its unit. None where `entry`
/// is not a number with a unit or none (a name); an error where the unit
/// is missing or a bare "G" (which of the two?), or the card too small.
fn memory(entry: &str) -> Option<Result<Choice, String>> {
    let split = entry.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(entry.len());
    let (number, unit) = (&entry[..split], entry[split..].trim());
    let value: f64 = number.parse().ok()?;
    let write = |n: &str| format!("write {n}GB (10^9 bytes, as vendors state a card's memory) or {n}GiB (2^30 bytes)");
    let Some(&(unit, scale)) = UNITS.iter().find(|(name, _)| name.eq_ignore_ascii_case(unit)) else {
        return match unit.to_ascii_uppercase().as_str() {
            "" => Some(Err(format!("'{entry}': a card's memory needs its unit: {}", write(number)))),
            "K" | "M" | "G" | "T" => Some(Err(format!("'{entry}': {unit} could be either unit: {}", write(number)))),
            _ => None,
        };
    };
    let bytes = value * scale as f64;
    let name = format!("{value} {unit}");
    if !(bytes.is_finite() && bytes < 2f64.powi(62)) {
        return Some(Err(format!("'{entry}': more memory than any card has")));
    }
    if bytes as u64 <= CONTEXT_BYTES {
        return Some(Err(format!(
            "'{entry}': a card of {name} leaves an allocator nothing: the driver and the CUDA context keep {:.1} GiB of a card's memory",
            CONTEXT_BYTES as f64 / (1u64 << 30) as f64
        )));
    }
    Some(Ok(Choice::Memory { name, total_bytes: bytes as u64 }))
}

/// The card an entry of `--cards` names: a card's memory with its unit
/// ("24GB": 24·10^9 bytes, "24GiB": 24·2^30, of which an allocator gets
/// all but `CONTEXT_BYTES`), else a card of `CARDS` by its name (`find`).
/// A number without its unit is the last word of a name ("4090") or
/// refused: it could be either unit. The error says what is wrong, and
/// names the candidates.
pub fn choose(entry: &str) -> Result<Choice, String> {
    let entry = entry.trim();
    let memory = memory(entry);
    if let Some(Ok(choice)) = memory {
        return Ok(choice);
    }
    match (find(entry), memory) {
        (Ok(card), _) => Ok(Choice::Listed(card)),
        (Err(NotFound::Ambiguous(names)), _) => Err(format!("'{entry}' names more than one card: {}", names.join(", "))),
        (Err(NotFound::Unknown), Some(Err(why))) => Err(why),
        (Err(NotFound::Unknown), _) => {
            let names = CARDS.iter().map(|card| card.name).collect::<Vec<_>>().join(", ");
            Err(format!("'{entry}' is neither a card ({names}) nor a card's memory with its unit (24GB, 24GiB)"))
        }
    }
}

/// "a" or "an" before a card's name, as its first letter is read aloud
/// ("an H100", "an L40S", "a T4").
fn article(name: &str) -> &'static str {
    match name.chars().next() {
        Some(c) if "AEFHILMNORSX".contains(c.to_ascii_uppercase()) => "an",
        _ => "a",
    }
}

/// "fits an L40S (43.5 GiB for the allocator); not an RTX 4090 (22.5 GiB)":
/// the smallest card of `CARDS` that holds `need` bytes and the largest that
/// does not.
pub fn card_advice(need: u64) -> String {
    advice_among(need, &CARDS, |_| "")
}

/// Where the card a trace fits runs no bf16, `card_advice_for_trace` says
/// so after its GiB.
const NOT_FOR_BF16: &str = "; not for bf16: --bf16 leaves it out";

/// `card_advice` for the need of a trace (`tidepool plan`), which carries
/// no dtype: with `bf16` (the workload runs in bf16) among the cards that
/// run it (`Card::runs_bf16`) only, for what fits and what does not;
/// without, among every card, and a card that fits but runs no bf16 says
/// so ("fits a T4 (13.5 GiB for the allocator; not for bf16: --bf16 leaves
/// it out)").
pub fn card_advice_for_trace(need: u64, bf16: bool) -> String {
    if bf16 {
        let bf16_cards: Vec<Card> = CARDS.iter().copied().filter(Card::runs_bf16).collect();
        advice_among(need, &bf16_cards, |_| "")
    } else {
        advice_among(need, &CARDS, |card| if card.runs_bf16() { "" } else { NOT_FOR_BF16 })
    }
}

/// `card_advice` among `cards` (ascending by memory, not empty), with
/// `note(card)` after the GiB of the card that fits.
fn advice_among(need: u64, cards: &[Card], note: impl Fn(&Card) -> &'static str) -> String {
    let gib = |card: &Card| format!("{:.1} GiB", card.usable_gib());
    let fits = cards.iter().find(|card| card.usable() >= need);
    let not = cards.iter().rev().find(|card| card.usable() < need);
    match (fits, not) {
        (Some(f), Some(n)) => format!(
            "fits {} {} ({} for the allocator{}); not {} {} ({})",
            article(f.name),
            f.name,
            gib(f),
            note(f),
            article(n.name),
            n.name,
            gib(n)
        ),
        (Some(f), None) => format!("fits {} {} ({} for the allocator{})", article(f.name), f.name, gib(f), note(f)),
        (None, _) => {
            let largest = &cards[cards.len() - 1];
            format!("more than {} {} holds ({} for the allocator)", article(largest.name), largest.name, gib(largest))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    #[test]
    fn cards_ascend_by_memory_and_every_name_and_alias_finds_its_card() {
        for pair in CARDS.windows(2) {
            assert!(pair[0].total_mib < pair[1].total_mib, "{:?} before {:?}", pair[0], pair[1]);
        }
        for card in CARDS {
            assert_eq!(find(card.name), Ok(card));
            for alias in card.aliases {
                // An alias two cards share names both.
                match find(alias) {
                    Ok(found) => assert_eq!(found, card, "{alias}"),
                    Err(NotFound::Ambiguous(names)) => assert!(names.contains(&card.name), "{alias}: {names:?}"),
                    Err(NotFound::Unknown) => panic!("{alias}: not found"),
                }
            }
        }
        let name = |text| find(text).map(|c| c.name);
        assert_eq!(name("a100-80gb"), Ok("A100 80GB"));
        assert_eq!(name("rtx4090"), Ok("RTX 4090"));
        // As people name and buy them, and as nvidia-smi and torch.cuda.get_device_name() do.
        for (text, card) in [
            ("H100 80GB", "H100"),
            ("h100 sxm", "H100"),
            ("H100 PCIe", "H100"),
            ("NVIDIA H100 80GB HBM3", "H100"),
            ("A100 40GB", "A100 40GB"),
            ("NVIDIA A100-SXM4-80GB", "A100 80GB"),
            ("NVIDIA A100 80GB PCIe", "A100 80GB"),
            ("RTX 4090", "RTX 4090"),
            ("NVIDIA GeForce RTX 4090", "RTX 4090"),
            ("4090", "RTX 4090"),
            ("a6000", "RTX A6000"),
            ("Tesla T4", "T4"),
            ("A10", "A10G"),
            ("L40", "L40S"),
            ("nvl", "H100 NVL"),
        ] {
            assert_eq!(name(text), Ok(card), "{text}");
        }
        assert_eq!(find("A100"), Err(NotFound::Ambiguous(vec!["A100 40GB", "A100 80GB"])), "the name must say which");
        assert_eq!(find("a100 pcie"), Err(NotFound::Ambiguous(vec!["A100 40GB", "A100 80GB"])));
        assert_eq!(find("80GB"), Err(NotFound::Ambiguous(vec!["H100", "A100 80GB"])), "the last word of two names");
        for unknown in ["A40", "V100", "100", "NVIDIA", "", "-"] {
            assert_eq!(find(unknown), Err(NotFound::Unknown), "{unknown}");
        }
    }

    #[test]
    fn every_card_has_a_compute_capability() {
        for card in CARDS {
            let (major, minor) = card.compute_capability;
            assert!((7..=10).contains(&major) && minor <= 9, "{card:?}");
        }
        let sm = |name| find(name).unwrap().compute_capability_text();
        assert_eq!(sm("T4"), "7.5");
        assert_eq!(sm("A100 80GB"), "8.0");
        assert_eq!(sm("A10G"), "8.6");
        assert_eq!(sm("L4"), "8.9");
        assert_eq!(sm("H200"), "9.0");
        assert_eq!(sm("B200"), "10.0");
    }

    #[test]
    fn a_card_is_chosen_by_name_or_by_its_memory_with_the_unit_its_vendor_states() {
        let chosen = |text| choose(text).unwrap();
        assert_eq!(chosen(" rtx 4090 "), Choice::Listed(find("RTX 4090").unwrap()));
        // "24GB" as a card is sold: 24·10^9 bytes of memory, 1.5 GiB less for the allocator.
        let gb = chosen("24GB");
        assert_eq!((gb.name(), gb.total_bytes(), gb.usable()), ("24 GB", 24_000_000_000, 24_000_000_000 - CONTEXT_BYTES));
        assert!(gb.usable() < 21 * GIB, "a 24 GB card gives an allocator 20.9 GiB");
        assert_eq!(gb.card(), None);
        let gib = chosen("22.5 gib");
        assert_eq!((gib.name(), gib.total_bytes(), gib.usable()), ("22.5 GiB", 45 * GIB / 2, 21 * GIB));
        assert_eq!(chosen("24564MiB").usable(), find("RTX 4090").unwrap().usable(), "nvidia-smi's total is the card");
        // A size, not the card whose name ends with it.
        assert_eq!(chosen("80GB").name(), "80 GB");
        assert_eq!(chosen("40 GB").total_bytes(), 40_000_000_000);
        let refused = |text| choose(text).unwrap_err();
        assert!(refused("24").contains("'24': a card's memory needs its unit: write 24GB (10^9 bytes"), "{}", refused("24"));
        assert!(refused("24G").contains("G could be either unit"), "{}", refused("24G"));
        assert!(refused("1GB").contains("leaves an allocator nothing"), "{}", refused("1GB"));
        assert!(refused("0GiB").contains("leaves an allocator nothing"));
        assert!(refused("9e99GB").contains("is neither a card"));
        assert_eq!(refused("A100"), "'A100' names more than one card: A100 40GB, A100 80GB");
        for text in ["big", "nan", "inf", "24XB"] {
            assert!(
                refused(text).starts_with(&format!("'{text}' is neither a card (T4, A10G, L4, RTX 4090, A100 40GB,")),
                "{}",
                refused(text)
            );
        }
    }

    #[test]
    fn a_card_gives_its_total_less_the_context_to_the_allocator() {
        let l40s = find("l40s").unwrap();
        assert_eq!(l40s.usable(), 46_068 * (1 << 20) - 3 * GIB / 2);
        // An "80GB" H100 does not hold 80 GiB, nor a "48GB" L40S 48 GiB (nor 45).
        assert!(find("h100").unwrap().usable() < 79 * GIB);
        assert!(l40s.usable() < 45 * GIB);
    }

    #[test]
    fn card_advice_names_the_smallest_card_that_holds_the_need_and_the_largest_that_does_not() {
        assert_eq!(card_advice(3 * GIB), "fits a T4 (13.5 GiB for the allocator)");
        assert_eq!(card_advice(30 * GIB), "fits an A100 40GB (38.5 GiB for the allocator); not an RTX 4090 (22.5 GiB)");
        // 47.7 GiB: more than any "48GB" card gives.
        assert_eq!(card_advice(47 * GIB + 700 * (1 << 20)), "fits an H100 (78.1 GiB for the allocator); not an RTX A6000 (46.5 GiB)");
        assert_eq!(card_advice(15 * GIB), "fits an A10G (21.0 GiB for the allocator); not a T4 (13.5 GiB)");
        assert_eq!(card_advice(500 * GIB), "more than a B200 holds (177.6 GiB for the allocator)");
    }

    #[test]
    fn only_cards_of_compute_capability_8_0_and_later_run_bf16() {
        let runs_no_bf16: Vec<&str> = CARDS.iter().filter(|card| !card.runs_bf16()).map(|card| card.name).collect();
        assert_eq!(runs_no_bf16, ["T4"]);
        assert!(find("A100 40GB").unwrap().runs_bf16(), "8.0 itself runs it");
    }

    #[test]
    fn the_advice_for_a_bf16_trace_leaves_out_the_cards_that_run_no_bf16() {
        // The T4 would hold 3 GiB; in bf16 the smallest card is the A10G, and nothing below it is named.
        assert_eq!(card_advice_for_trace(3 * GIB, true), "fits an A10G (21.0 GiB for the allocator)");
        assert_eq!(card_advice_for_trace(15 * GIB, true), "fits an A10G (21.0 GiB for the allocator)");
        // A need above the T4, whose "not" card runs bf16, is advised as ever.
        for need in [30 * GIB, 47 * GIB + 700 * (1 << 20), 500 * GIB] {
            assert_eq!(card_advice_for_trace(need, true), card_advice(need), "{need}");
        }
    }

    #[test]
    fn the_advice_for_a_trace_of_unknown_dtype_says_where_the_card_that_fits_runs_no_bf16() {
        assert_eq!(card_advice_for_trace(3 * GIB, false), "fits a T4 (13.5 GiB for the allocator; not for bf16: --bf16 leaves it out)");
        // A T4 that does not fit needs no word.
        for need in [15 * GIB, 30 * GIB, 500 * GIB] {
            assert_eq!(card_advice_for_trace(need, false), card_advice(need), "{need}");
        }
    }
}
