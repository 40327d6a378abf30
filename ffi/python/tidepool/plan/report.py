"""The planner's report of its results (running.py's): one JSON object a
variant (print_json, --json) or a table with what it means and the lines
of the cards left out, the largest batch each card holds (largest_batches)
and the jobs that share each card (jobs_lines) (print_text). Figures are
written in GiB (tidepool/_units.py).
"""
import json

from .._units import gib
from .cards import need_on, notes, unsupported


def variant_json(args, result):
    """The variant of `result` as --json names it: the model, every option
    (the model's defaults where none was given), --set and torch's version."""
    import torch

    options = dict(result["options"])
    if options.get("seq") is None and result.get("seq") is not None:
        options["seq"] = result["seq"]  # the model's default length, which was used
    if options.get("loop") is None:
        options["loop"] = result.get("loop")  # the model's default shape (None: not a training loop)
    if options.get("optimizer") is None:
        options["optimizer"] = result.get("optimizer")  # the default or the factory's, when one was used
    variant = {"model": args.model, **{k: v for k, v in options.items()}, "set": result["sets"],
               "torch": torch.__version__}
    return variant


def print_json(args, results):
    """One JSON object per variant, a line each (--json)."""
    for r in results:
        print(json.dumps(json_row(args, r)))


def json_row(args, r):
    """The JSON object of one variant's result: docs/planning.md names its
    fields."""
    if "error" in r:
        return {"variant": variant_json(args, r), "error": r["error"]}
    b = r["breakdown"]
    return {
        "variant": variant_json(args, r),
        "peak_live_bytes": r["peak"],
        "breakdown": {"weights_bytes": b["weights"], "gradients_bytes": b["gradients"],
                      "optimizer_bytes": b["optimizer"], "precision_copies_bytes": b["copies"],
                      "activations_bytes": b["activations"]},
        "pytorch_min_capacity_bytes": r["pytorch"],
        "pytorch_expandable_min_capacity_bytes": r["pytorch_expandable"],
        "tidepool_min_capacity_bytes": r["tidepool_expandable"],
        "fits": r["fits"],
        "fits_pytorch": r["fits_pytorch"],
        "fits_pytorch_expandable": r["fits_pytorch_expandable"],
        "cards_left_out": r["cards_left_out"],
        "jobs": r["jobs"],
        "jobs_pytorch": r["jobs_pytorch"],
        "jobs_pytorch_expandable": r["jobs_pytorch_expandable"],
        "trace": r["trace"],
    }


def print_text(args, results, cards, sweeps):
    """The table of the variants (a column per swept option, then the
    peak, its breakdown and each allocator's need), what it means, and the
    lines of the cards left out, the largest batches and the jobs side by
    side."""
    import torch

    first = results[0]["options"] if results else {}
    print(f"{args.model}, task {first.get('task')}, recorded on the meta device with torch {torch.__version__}")
    swept = [k for k, _ in sweeps]
    head = [k.replace("_", "-") for k in swept]
    head += ["peak live", "weights", "grads", "optim", "copies", "activ", "PyTorch needs", "PyTorch exp. needs",
             "tidepool needs", "smallest card"]
    rows = []
    for r in results:
        cells = [str(r["label"][k]) for k in swept]
        if "error" in r:
            rows.append(cells + [f"failed: {r['error']}"])
            continue
        b = r["breakdown"]
        fits = r["fits"][0] if r["fits"] else "none"
        cells += [gib(r["peak"]), gib(b["weights"]), gib(b["gradients"]), gib(b["optimizer"]),
                  gib(b["copies"]), gib(b["activations"]), gib(r["pytorch"]), gib(r["pytorch_expandable"]),
                  gib(r["tidepool_expandable"]), fits]
        rows.append(cells)
    widths = [max([len(head[i])] + [len(row[i]) for row in rows if len(row) == len(head)]) for i in range(len(head))]
    print("  ".join(h.rjust(w) for h, w in zip(head, widths)))
    for row in rows:
        if len(row) != len(head):  # a failed variant: its options, then what went wrong
            print("  ".join(c.rjust(w) for c, w in zip(row[:-1], widths)) + "  " + row[-1])
        else:
            print("  ".join(c.rjust(w) for c, w in zip(row, widths)))
    print("copies: weights cast to another type (autocast's); needs: the smallest device the step fits (PyTorch's "
          "caching allocator, without and with expandable_segments:True; tidepool with expandable segments); smallest "
          "card: the smallest of --cards that holds it with tidepool (what a card gives an allocator: `tidepool cards`)")
    for line in notes(cards, [r for r in results if "error" not in r]):
        print(line)
    for line in largest_batches(results, cards, swept):
        print(line)
    for line in jobs_lines(results, swept):
        print(line)
    for r in results:
        if r.get("trace"):
            print(f"trace: {r['trace']}")


def _need(result, allocator):
    """A result's need with `allocator` (a key of running.ALLOCATORS's).
    tidepool's is read under "tidepool" too, the key results had before
    they said which tidepool: largest_batches is tidepool.plan's, and a
    caller's results may be of that kind."""
    if allocator == "tidepool_expandable" and allocator not in result:
        return result["tidepool"]
    return result[allocator]


def largest_batches(results, cards, swept):
    """Per batch sweep (the other options fixed): the largest batch each card
    holds with tidepool, and in parentheses PyTorch's where either of its
    allocators (plain, expandable segments) holds another."""
    if "batch" not in swept:
        return []
    groups = {}
    for r in results:
        key = tuple((k, str(r["label"][k])) for k in swept if k != "batch")
        groups.setdefault(key, []).append(r)
    lines = []
    for key, members in groups.items():
        ok = [r for r in members if "error" not in r]
        where = " ".join(f"{k}={v}" for k, v in key)
        parts = []
        for card in cards:
            name, usable = card[:2]
            planned = [r for r in ok if not unsupported(card, r["options"])]

            def largest(allocator):
                return max((r["options"]["batch"] for r in planned if need_on(card, _need(r, allocator), r) <= usable),
                           default=None)

            best, best_pt, best_px = largest("tidepool_expandable"), largest("pytorch"), largest("pytorch_expandable")
            if ok and not planned:
                parts.append(f"{name}: {unsupported(card, ok[0]['options'])}")
            elif best is None:
                parts.append(f"{name}: none")
            elif best_pt == best and best_px == best:
                parts.append(f"{name}: {best}")
            else:
                parts.append(f"{name}: {best} (PyTorch {best_pt or 'none'}, "
                             f"with expandable segments {best_px or 'none'})")
        lines.append(f"largest batch{' with ' + where if where else ''}: " + "; ".join(parts))
    return lines


def jobs_lines(results, swept):
    """How many of each variant's jobs share each card by the N+1 rule,
    with PyTorch's count in parentheses where it differs (a card where
    neither runs one is left out), and what that assumes."""
    ok = [r for r in results if "error" not in r]
    if not ok:
        return []
    lines = ["jobs side by side per card by the N+1 rule (room for one more kept free), each a process with a 1.5 GiB "
             "CUDA context that needs its peak (tidepool gives what its cache holds beyond that back to the others; "
             "PyTorch's cache keeps it); PyTorch's count in parentheses where it differs:"]
    for r in ok:
        where = " ".join(f"{k}={r['label'][k]}" for k in swept)
        parts = []
        for name, count in r["jobs"].items():
            theirs = r["jobs_pytorch"][name]
            if count or theirs:
                parts.append(f"{name} {count}" + (f" (PyTorch {theirs})" if theirs != count else ""))
        lines.append(f"  {where + ': ' if where else ''}{', '.join(parts) or 'none on any card'}")
    return lines

