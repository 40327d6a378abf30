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
//! Invariant (tested): `CARDS` ascends by memory, so the first card that
//! holds a need is the smallest that does.
#![forbid(unsafe_code)]

/// Kept from each card's total for the driver and the CUDA context: 1.5 GiB.
pub const CONTEXT_BYTES: u64 = 3 << 29;

/// A card: its name and its memory as `nvidia-smi` shows the total.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Card {
    pub name: &'static str,
    pub total_mib: u64,
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
}

const fn card(name: &'static str, total_mib: u64) -> Card {
    Card { name, total_mib }
}

/// Data-centre and workstation cards PyTorch jobs run on, by memory
/// (`nvidia-smi`'s total with the card's ECC setting as shipped; the A10,
/// A40 and L40 have the memory of the card listed beside them).
pub const CARDS: [Card; 12] = [
    card("T4", 15_360),
    card("A10G", 23_028),
    card("L4", 23_034),
    card("RTX 4090", 24_564),
    card("A100 40GB", 40_960),
    card("L40S", 46_068),
    card("RTX A6000", 49_140),
    card("H100", 81_559),
    card("A100 80GB", 81_920),
    card("H100 NVL", 95_830),
    card("H200", 143_771),
    card("B200", 183_359),
];

/// The card named `name`, case, spaces and hyphens aside ("a100-80gb",
/// "A100 80GB" and "a10080gb" are one card).
pub fn find(name: &str) -> Option<Card> {
    let key = |text: &str| text.chars().filter(|c| c.is_ascii_alphanumeric()).map(|c| c.to_ascii_lowercase()).collect::<String>();
    let wanted = key(name);
    CARDS.iter().copied().find(|card| key(card.name) == wanted)
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
    let gib = |card: &Card| format!("{:.1} GiB", card.usable_gib());
    let fits = CARDS.iter().find(|card| card.usable() >= need);
    let not = CARDS.iter().rev().find(|card| card.usable() < need);
    match (fits, not) {
        (Some(f), Some(n)) => {
            format!("fits {} {} ({} for the allocator); not {} {} ({})", article(f.name), f.name, gib(f), article(n.name), n.name, gib(n))
        }
        (Some(f), None) => format!("fits {} {} ({} for the allocator)", article(f.name), f.name, gib(f)),
        (None, _) => {
            let largest = &CARDS[CARDS.len() - 1];
            format!("more than {} {} holds ({} for the allocator)", article(largest.name), largest.name, gib(largest))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    #[test]
    fn cards_ascend_by_memory_and_every_name_finds_its_card() {
        for pair in CARDS.windows(2) {
            assert!(pair[0].total_mib < pair[1].total_mib, "{:?} before {:?}", pair[0], pair[1]);
        }
        for card in CARDS {
            assert_eq!(find(card.name), Some(card));
        }
        assert_eq!(find("a100-80gb").map(|c| c.name), Some("A100 80GB"));
        assert_eq!(find("rtx4090").map(|c| c.name), Some("RTX 4090"));
        assert_eq!(find("A100"), None, "two cards are A100s: the name must say which");
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
}
