"""The planner's command, `python -m tidepool.plan` (main, and run, which
returns its exit status): plan a model before renting a GPU, will it fit,
on which card, at what batch?

    python -m tidepool.plan hf:llama --set num_hidden_layers=16 --batch 4 --seq 2048 \\
        --precision bf16-mixed --sweep batch=1,2,4,8 --sweep checkpointing=false,true

Each variant (the product of the --sweep options) is recorded on the meta
device without a GPU (tidepool.record), then its allocation trace is
replayed through PyTorch's allocator and tidepool's (`tidepool plan`) to
find the smallest device it fits. The answer: peak live memory, what was
live at the peak (weights, gradients, optimizer state, activations and
temporaries), the smallest device with each allocator, the cards it fits,
and per batch sweep the largest batch each card holds.

Nothing is downloaded: transformers models come from their configuration
(HF_HUB_OFFLINE=1), and no weights are loaded.

This module ties the parts together: the options (arguments.py), the
recording and planning of each variant (running.py), the report
(report.py) and the picture (plot.py).
"""
import os
import sys

from .arguments import parse_args, variants
from .cards import resolve_cards
from .errors import Exit, FactoryError, PlanError
from .report import print_json, print_text
from .running import find_tidepool, record_and_plan


def run(argv=None):
    """Plans the variants argv asks for and prints the report: the exit
    status (1 when a variant failed). A bad option raises Exit.
    `run SCRIPT [ARGS...]` plans a script as it is written (script.py)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["run"]:
        from .script import run as run_script

        return run_script(argv[1:])
    # Nothing is downloaded. Set when the command runs, before transformers
    # is first imported (it reads them then), not when tidepool.plan is
    # imported: a program that only records keeps its own settings.
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    args, base, overrides, sweeps = parse_args(argv)
    binary = find_tidepool(args.tidepool)
    cards = resolve_cards(binary, args.cards)
    # torch, then what records (step.py, which running.py runs), before
    # any work: one that cannot be imported fails the command first.
    import torch  # noqa: F401

    from . import step, workload  # noqa: F401

    if args.model.startswith("hf:") or not args.model.startswith("module:"):
        workload.hf_config(args.model, overrides)  # a bad architecture or file fails before any recording
    results, timelines = record_and_plan(args, binary, cards, variants(base, overrides, sweeps))
    if args.json:
        print_json(args, results)
    else:
        print_text(args, results, cards, sweeps)
    if args.plot:
        from .plot import write_svg

        write_svg(args.plot, args.model, timelines, results)
        if not args.json:
            print(f"plot written to {args.plot}")
    return 1 if any("error" in r for r in results) else 0


def main(argv=None):
    try:
        status = run(argv)
    except Exit as err:
        print(f"tidepool.plan: error: {err}", file=sys.stderr)
        status = err.status
    except KeyboardInterrupt:
        status = 130
    except Exception as err:  # noqa: BLE001 - bad input raised inside: one clear line
        if isinstance(err, FactoryError):
            print(f"tidepool.plan: the model factory raised:\n{err}", file=sys.stderr, end="")
            status = 2
        elif isinstance(err, PlanError):
            print(f"tidepool.plan: error: {err}", file=sys.stderr)
            status = 2
        else:
            raise
    sys.exit(status)
