"""The cards a plan is compared with (--cards), and which of them a
variant's recording stands for.

The tidepool command knows the cards: `tidepool cards --json ENTRY...`
resolves each entry of --cards (a name or alias, case and spaces aside;
or a card's memory with its unit, "24GB" being 24·10^9 bytes as vendors
state it, "24GiB" 24·2^30) and says what an allocator gets of it (its
memory less the driver's and the CUDA context's 1.5 GiB) and its compute
capability; an unknown or ambiguous name is its error, with the
candidates (tools/src/trace/cards.rs holds the table, its aliases and
units).

What this module adds is the architecture rule. The recording follows
what PyTorch runs on compute capability 8.0 (sm80) and later (attention.py,
autocast.py). On an sm75 card, the T4:
- bf16 (`bf16-mixed`, `bf16`) is not what PyTorch runs as recorded: the
  card has no bf16 tensor cores, and PyTorch's fused attention kernels
  take no bf16 there (flash attention needs sm80; memory-efficient
  attention takes fp16 and fp32 only below sm80), so attention falls back
  to the math path, which holds the whole score matrix. Such a card is
  left out of a bf16 variant's fits, and the report says why;
- fp16 and fp32 are: where sm80 runs flash attention PyTorch runs
  memory-efficient attention, which keeps the same output and a float32
  log-sum-exp per query row (rounded up to 32 rows), so the recording
  stands for the card to that rounding.
A card given by its memory has no known architecture: it is taken for
sm80 or later.
"""
import json
import subprocess
from collections import namedtuple

from .errors import Exit

# A card of --cards: its name, the bytes an allocator gets of it, its
# compute capability as (major, minor) (None for a card given by its
# memory) and its memory (what the driver, the processes' CUDA contexts
# and their allocators share).
Card = namedtuple("Card", "name usable compute_capability total", defaults=(None, None))


def resolve_cards(binary, text):
    """The cards of --cards, smallest first: [Card]. Each entry is a card
    `tidepool cards` knows, by name or alias, or a card's memory with its
    unit; a bad one ends the command (Exit, status 2) with the tidepool
    command's words."""
    entries = [entry.strip() for entry in text.split(",") if entry.strip()]
    if not entries:
        raise Exit(f"--cards {text!r}: expected cards, by name or by their memory with its unit (24GB, 24GiB)")
    try:
        done = subprocess.run([binary, "cards", "--json", "--", *entries], capture_output=True, text=True)
    except OSError as err:
        raise Exit(f"{binary} cards --json failed ({err})") from None
    if done.returncode != 0:
        said = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        said = said.removeprefix("tidepool: ").removeprefix("cards: ")
        if "unexpected argument" in said:
            raise Exit(f"{binary} cards --json takes no cards ({said}): is it an older tidepool command?")
        raise Exit(f"--cards {text!r}: {said}")
    try:
        listed = json.loads(done.stdout)["cards"]
        cards = {}
        for card in listed:
            capability = card["compute_capability"]
            capability = tuple(int(part) for part in capability.split(".")) if capability else None
            cards[card["name"]] = Card(card["name"], card["usable_bytes"], capability, card["total_bytes"])
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise Exit(f"{binary} cards --json printed no cards ({err!r}): is it an older tidepool command?") from None
    return sorted(cards.values(), key=lambda card: card.usable)


def unsupported(card, options):
    """Why a variant of `options` is not planned on `card` (what PyTorch
    runs there is not what was recorded), in a few words, or None. A card
    of the tests' (name, usable) pairs is taken for sm80 or later."""
    capability = getattr(card, "compute_capability", None)
    if capability is not None and capability < (8, 0) and str(options.get("precision", "")).startswith("bf16"):
        return "no bf16"
    return None


def runnable(cards, options):
    """The cards a variant of `options` is planned on."""
    return [card for card in cards if not unsupported(card, options)]


def left_out(cards, options):
    """{name: why} of the cards a variant of `options` is not planned on."""
    return {card[0]: unsupported(card, options) for card in cards if unsupported(card, options)}


def notes(cards, results):
    """A line for each card left out of some variant, saying why."""
    lines = []
    for card in cards:
        if any(unsupported(card, r["options"]) for r in results):
            major, minor = card.compute_capability
            lines.append(f"{card.name} (compute capability {major}.{minor}): not named for bf16 variants: it has no "
                         "bf16 tensor cores, and PyTorch's fused attention kernels take no bf16 below 8.0 (the "
                         "recording follows 8.0 and later)")
    return lines


def need_on(card, need, result):
    """The bytes a variant that needs `need` as recorded needs on `card`:
    where PyTorch gives the card another cuBLAS workspace than the
    recording's (32 MiB on Hopper and later, 8.125 MiB before, record.py),
    the difference for each thread that ran a matmul."""
    from .record import cublas_workspace_bytes

    recorded = result.get("workspace_bytes")
    if recorded is None:
        return need
    return need + result.get("workspaces", 0) * (cublas_workspace_bytes(card.compute_capability) - recorded)


def jobs_side_by_side(card, need):
    """How many jobs that each need `need` run on `card` side by side with
    room for one more kept free (the "N+1" rule): the largest N for which
    N+1 of them fit the card's memory, each with what its process's CUDA
    context takes (the card's memory less what an allocator gets of it)."""
    context = card.total - card.usable
    return max(0, card.total // (need + context) - 1)
