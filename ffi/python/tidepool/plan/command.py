"""Plan a model before renting a GPU: will it fit, on which card, at what batch?

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
"""
import argparse
import itertools
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time

from .cards import jobs_side_by_side, left_out, need_on, notes, resolve_cards, runnable, unsupported

GIB = 1 << 30
DEFAULT_CARDS = "T4,L4,RTX 4090,A100 40GB,L40S,H100,H200,B200"

# Sweepable options: name -> parser of one value.
_INT_OPTIONS = ("batch", "seq", "accumulation", "steps", "lora_rank", "new_tokens", "ddp", "fsdp", "zero1", "zero2")


def _bool(text):
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected true or false, got {text!r}")


def _positive(text):
    value = int(text)
    if value < 1:
        raise ValueError(f"expected a positive integer, got {text}")
    return value


def _non_negative(text):
    value = int(text)
    if value < 0:
        raise ValueError(f"expected 0 or more, got {text}")
    return value


def _choice(choices):
    def parse(text):
        if text not in choices:
            raise ValueError(f"expected one of {', '.join(choices)}, got {text!r}")
        return text
    return parse


def _task(text):
    """A task by name, or by the name it had ('forward': inference)."""
    from .step import TASK_ALIASES, TASKS

    task = TASK_ALIASES.get(text, text)
    if task not in TASKS:
        raise argparse.ArgumentTypeError(f"invalid choice: {text!r} (choose from {', '.join(TASKS)})")
    return task


def _parsers():
    from .step import LOOPS, OPTIMIZERS, PRECISIONS, ZERO_GRAD

    return {
        "task": _task, "loop": _choice(LOOPS), "batch": _positive, "seq": _positive, "precision": _choice(PRECISIONS),
        "checkpointing": _bool, "accumulation": _positive, "optimizer": _choice(OPTIMIZERS), "steps": _positive,
        "lora_rank": _non_negative, "new_tokens": _non_negative, "ddp": _non_negative,
        "fsdp": _non_negative, "zero1": _non_negative, "zero2": _non_negative,
        "zero_grad": _choice(ZERO_GRAD), "zero_grad_set_to_none": _bool,
    }


class Exit(Exception):
    """Ends the command with a message and an exit status."""

    def __init__(self, message, status=2):
        super().__init__(message)
        self.status = status


class _Help(argparse.RawDescriptionHelpFormatter):
    """The description as written, and every option's default said (an
    option whose default depends on the model says how in its help)."""

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        unsaid = default is None or default is False or default == [] or default == argparse.SUPPRESS or "%(default)" in text
        return text if unsaid or not action.option_strings else f"{text} (default: %(default)s)"


def parse_args(argv):
    from .step import LOOPS, OPTIMIZERS, PRECISIONS, TASKS, ZERO_GRAD

    parser = argparse.ArgumentParser(
        prog="python -m tidepool.plan", description=__doc__.split("\n\n")[0],
        formatter_class=_Help,
        epilog="MODEL: hf:TYPE (a transformers model_type, e.g. hf:gpt2, hf:llama, hf:bert, hf:vit), a config.json, "
               "or module:pkg.mod:factory (an nn.Module from token ids to logits, or a tidepool.workload.Workload).")
    parser.add_argument("model", metavar="MODEL")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a field of the transformers configuration (repeatable)")
    parser.add_argument("--task", default="train", type=_task, choices=TASKS,
                        help="train: forward, loss, backward and optimizer step; forward-grad: the forward with the "
                             "autograd graph kept and its output held, no backward (the loss only where the model or "
                             "a Workload computes one); inference: forward under "
                             "torch.inference_mode() (no graph; 'forward' is read as it); generate: a prompt of --seq "
                             "tokens then --new-tokens with the model's KV cache")
    parser.add_argument("--loop", default=None, choices=LOOPS,
                        help="the training loop's shape: plain (`logits = model(x); loss = loss_fn(logits, y); "
                             "loss.backward()`: the output held through backward and the optimizer step) or trainer "
                             "(Hugging Face Trainer's compute_loss: the output dropped before backward); default: "
                             "trainer for hf: models and config.json files, plain for module: factories")
    parser.add_argument("--batch", type=int, default=1, help="sequences (or images) per micro-batch")
    parser.add_argument("--seq", type=int, default=None, help="sequence length (image size for vision models); "
                        "default: the model's context length where its configuration or module states one "
                        "(max_position_embeddings, n_positions, block_size, ...), else 512; the configured image "
                        "size for vision")
    parser.add_argument("--precision", default="fp32", choices=PRECISIONS,
                        help="fp32; bf16-mixed / fp16-mixed: autocast as on CUDA (weights stay fp32); "
                             "bf16 / fp16: the whole model in that type")
    parser.add_argument("--checkpointing", action="store_true", help="activation (gradient) checkpointing per block")
    parser.add_argument("--accumulation", type=int, default=1, help="micro-batches of --batch per optimizer step")
    parser.add_argument("--zero-grad", default=None, choices=ZERO_GRAD,
                        help="where the training loop zeroes its gradients: after-step (after the optimizer step, the "
                             "default), before-forward, or before-backward (between forward and backward: the previous "
                             "step's gradients alive through the forward)")
    parser.add_argument("--zero-grad-set-to-none", default=None, type=_bool, metavar="true|false",
                        help="zero_grad(set_to_none=...): true (the default) frees the gradients; false zeroes them in "
                             "place, so that they stay for the whole run")
    parser.add_argument("--optimizer", default=None, choices=OPTIMIZERS, metavar="NAME",
                        help="for --task train (default: the factory's own optimizer if a module: factory returns "
                             "one, else adamw): " + "; ".join(f"{name}: {what}" for name, (what, _) in
                                                              OPTIMIZERS.items()))
    parser.add_argument("--lora-rank", type=int, default=0, help="train LoRA adapters of this rank (peft), base frozen; 0: none")
    parser.add_argument("--ddp", type=int, default=0, metavar="N",
                        help="DistributedDataParallel over N ranks (PyTorch's fake process group), one rank recorded; 0: none")
    parser.add_argument("--fsdp", type=int, default=0, metavar="N",
                        help="FSDP2 fully_shard over N ranks (PyTorch's fake process group), one rank recorded; 0: none")
    parser.add_argument("--zero2", type=int, default=0, metavar="N",
                        help="ZeRO-2 over N ranks: gradients and optimizer state sharded, each block's weights whole "
                             "from its forward to its backward (FSDP2 with reshard_after_forward=False); 0: none")
    parser.add_argument("--zero1", type=int, default=0, metavar="N",
                        help="ZeRO-1 over N ranks: the optimizer state alone sharded (DDP with PyTorch's "
                             "ZeroRedundancyOptimizer); 0: none")
    parser.add_argument("--new-tokens", type=int, default=0, help="tokens generated by --task generate; 0 means 32")
    parser.add_argument("--steps", type=int, default=2,
                        help="steps recorded (the optimizer state appears in the first)")
    parser.add_argument("--sweep", action="append", default=[], metavar="KEY=V1,V2,...",
                        help="record one variant per value (repeatable: the product of all); KEY is an option "
                             "(batch, seq, precision, checkpointing, accumulation, optimizer, steps, lora-rank, "
                             "new-tokens, ddp, fsdp, zero1, zero2, task, loop, zero-grad, zero-grad-set-to-none) or "
                             "set.FIELD for a configuration field")
    parser.add_argument("--cards", default=DEFAULT_CARDS,
                        help="cards, comma-separated: by name or alias (`tidepool cards` lists them, what an "
                             "allocator gets of each and their compute capability), or by their memory with its "
                             "unit, of which an allocator gets all but 1.5 GiB (24GB: 24*10^9 bytes, as vendors "
                             "state it; 24GiB: 24*2^30)")
    parser.add_argument("--json", action="store_true", help="one JSON object per variant, one per line")
    parser.add_argument("--keep-traces", metavar="DIR", help="keep each variant's trace (RMM CSV) in DIR")
    parser.add_argument("--plot", metavar="OUT.svg", help="memory by category over the step, and the smallest "
                        "device per variant")
    parser.add_argument("--tidepool", metavar="PATH", help="the tidepool command (default: $TIDEPOOL_BIN, then "
                        "tidepool on PATH, then this checkout's target/release or target/debug build)")
    args = parser.parse_args(argv)

    base = {"task": args.task, "loop": args.loop, "batch": args.batch, "seq": args.seq, "precision": args.precision,
            "checkpointing": args.checkpointing, "accumulation": args.accumulation, "optimizer": args.optimizer,
            "steps": args.steps, "lora_rank": args.lora_rank, "new_tokens": args.new_tokens, "ddp": args.ddp,
            "fsdp": args.fsdp, "zero1": args.zero1, "zero2": args.zero2, "zero_grad": args.zero_grad,
            "zero_grad_set_to_none": args.zero_grad_set_to_none}
    parsers = _parsers()
    for key in _INT_OPTIONS:
        value = base[key]
        if value is not None:
            try:
                (_non_negative if key in ("lora_rank", "new_tokens", "ddp", "fsdp", "zero1", "zero2") else _positive)(str(value))
            except ValueError as err:
                raise Exit(f"--{key.replace('_', '-')}: {err}") from None
    overrides = {}
    from .workload import _coerce

    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise Exit(f"--set {item!r}: expected KEY=VALUE")
        overrides[key.strip()] = _coerce(value.strip())
    sweeps = []
    for item in args.sweep:
        key, sep, values = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not values.strip():
            raise Exit(f"--sweep {item!r}: expected KEY=V1,V2,...")
        texts = [v.strip() for v in values.split(",") if v.strip()]
        if not texts:
            raise Exit(f"--sweep {item!r}: expected KEY=V1,V2,...")
        if key.startswith("set."):
            parsed = [_coerce(v) for v in texts]
        elif key in parsers:
            try:
                parsed = [parsers[key](v) for v in texts]
            except (ValueError, argparse.ArgumentTypeError) as err:
                raise Exit(f"--sweep {key}: {err}") from None
        else:
            raise Exit(f"--sweep {key}: not a sweepable option (one of {', '.join(sorted(parsers))}, or set.FIELD)")
        if any(key == k for k, _ in sweeps):
            raise Exit(f"--sweep {key} given twice")
        sweeps.append((key, parsed))
    return args, base, overrides, sweeps


def variants(base, overrides, sweeps):
    """The product of the sweeps: [(options, overrides, what differs)]."""
    out = []
    for values in itertools.product(*[v for _, v in sweeps]):
        options, sets, label = dict(base), dict(overrides), {}
        for (key, _), value in zip(sweeps, values):
            if key.startswith("set."):
                sets[key[4:]] = value
            else:
                options[key] = value
            label[key] = value
        out.append((options, sets, label))
    return out


def find_tidepool(explicit=None):
    """The tidepool command that replays and plans traces."""
    # The wheel installs it into the environment's bin directory, which is
    # on PATH only in an activated environment.
    installed = os.path.join(sysconfig.get_path("scripts"), "tidepool")

    def runnable(path):
        return path and os.path.isfile(path) and os.access(path, os.X_OK)

    # One named by --tidepool or TIDEPOOL_BIN is the one: a typo is an error,
    # not a silent fall back to another (perhaps older) build.
    for how, named in (("--tidepool ", explicit), ("TIDEPOOL_BIN=", os.environ.get("TIDEPOOL_BIN"))):
        if named:
            if runnable(named):
                return named
            raise Exit(f"{how}{named}: not an executable")
    # A source checkout: ffi/python/tidepool/plan/ is four levels below its root.
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.normpath(os.path.join(here, "..", "..", "..", ".."))
    candidates = [shutil.which("tidepool"), installed]
    candidates += [os.path.join(root, "target", kind, "tidepool") for kind in ("release", "debug")]
    for path in candidates:
        if runnable(path):
            return path
    raise Exit("the tidepool command is not found: build it (cargo build --release in a tidepool checkout, or "
               "cargo install --path .), put it on PATH or name it with --tidepool or TIDEPOOL_BIN")


def _plan_process(binary, trace):
    return subprocess.Popen([binary, "plan", trace, "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _plan_result(process):
    out, err = process.communicate()
    code = process.returncode
    if code != 0:
        how = f"exit status {code}" if code > 0 else f"killed by signal {-code}"
        raise RuntimeError(f"tidepool plan failed ({how}): {err.strip() or out.strip() or 'no output'}")
    lines = out.strip().splitlines()
    try:
        return json.loads(lines[-1])
    except (IndexError, ValueError):
        raise RuntimeError(f"tidepool plan printed no JSON: {(lines or [''])[-1][:200]!r}") from None


# The allocators a variant's needs are replayed with, by the suffix of
# their figures (fits, fits_pytorch, ...; jobs, jobs_pytorch, ...).
ALLOCATORS = (("tidepool", ""), ("pytorch", "_pytorch"), ("pytorch_expandable", "_pytorch_expandable"))


class _Progress:
    """A bar across variants on stderr."""

    def __init__(self, total, quiet):
        self.total, self.quiet, self.start = total, quiet, time.perf_counter()
        self.tty = sys.stderr.isatty()

    def show(self, done, text):
        if self.quiet:
            return
        filled = 24 * done // max(self.total, 1)
        line = f"[{'#' * filled}{' ' * (24 - filled)}] {done}/{self.total} {text}"
        if self.tty:
            sys.stderr.write(f"\r{line[:110]:110}")
            if done == self.total:
                sys.stderr.write("\n")
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()


def _human(n):
    return f"{n / GIB:.2f} GiB"


def run(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["run"]:  # `run SCRIPT [ARGS...]`: a script as it is written (script.py)
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
    import torch

    from . import step, workload

    if args.model.startswith("hf:") or not args.model.startswith("module:"):
        workload.hf_config(args.model, overrides)  # a bad architecture or file fails before any recording
    todo = variants(base, overrides, sweeps)
    keep = args.keep_traces
    if keep:
        os.makedirs(keep, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix="tidepool-plan-")
    progress = _Progress(len(todo), quiet=False)
    results = []
    pending = None  # (index, process) of the plan running while the next variant records
    timelines = []
    try:
        for index, (options, sets, label) in enumerate(todo):
            name = " ".join(f"{k}={v}" for k, v in label.items()) or "the model"
            progress.show(index, f"recording {name}")
            directory = keep or scratch
            trace = os.path.join(directory, f"variant-{index + 1}.csv")
            result = {"label": label, "options": options, "sets": sets, "trace": trace if keep else None}
            started = time.perf_counter()
            try:
                rec = step.record(args.model, sets, options, trace)
                seq, result["loop"] = rec.seq, rec.loop
                result["optimizer"] = getattr(rec, "optimizer", None)  # the one used, --optimizer or the factory's
                result["peak"], _ = rec.peak()
                result["breakdown"] = rec.breakdown_at_peak()
                result["record_seconds"] = time.perf_counter() - started
                result["allocs"] = rec.allocs
                result["workspaces"], result["workspace_bytes"] = len(rec.workspaces), rec.workspace_size
                if args.plot:
                    timelines.append((name, rec.timeline()))
                del rec
                result["process"] = _plan_process(binary, trace)
                result["seq"] = seq
            except workload.FactoryError:
                raise
            except workload.PlanError as err:
                # An option combination this variant cannot have: an error of
                # the run when it is the only variant, else of its row.
                if len(todo) == 1:
                    raise
                result["error"] = str(err)
            except step.MissingMetaKernel as err:
                result["error"] = f"no meta kernel for {err}"
            except Exception as err:  # noqa: BLE001 - a failing variant is reported, the others go on
                result["error"] = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
            if pending is not None:
                _finish(pending, cards)
            pending = result if "process" in result else None
            results.append(result)
        if pending is not None:
            _finish(pending, cards)
        progress.show(len(todo), "done")
    finally:
        if pending is not None and "process" in pending:
            # Left by an error: its trace is about to go.
            pending["process"].kill()
            pending["process"].wait()
        shutil.rmtree(scratch, ignore_errors=True)
    _report(args, results, cards, sweeps)
    if args.plot:
        from .plot import write_svg

        write_svg(args.plot, args.model, timelines, results)
        if not args.json:
            print(f"plot written to {args.plot}")
    return 1 if any("error" in r for r in results) else 0


def _finish(result, cards):
    result["cards_left_out"] = left_out(cards, result["options"])
    cards = runnable(cards, result["options"])
    try:
        plan = _plan_result(result.pop("process"))
        result["pytorch"] = plan["pytorch"]["min_capacity_bytes"]
        result["pytorch_expandable"] = plan["pytorch_expandable"]["min_capacity_bytes"]
        result["tidepool"] = plan["tidepool"]["min_capacity_bytes"]
        for allocator, suffix in ALLOCATORS:
            needs = {card: need_on(card, result[allocator], result) for card in cards}
            result["fits" + suffix] = [card.name for card, need in needs.items() if need <= card.usable]
            result["jobs" + suffix] = {card.name: jobs_side_by_side(card, need) for card, need in needs.items()}
    except (RuntimeError, ValueError, KeyError) as err:
        result["error"] = str(err)


def _variant_json(args, result):
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


def _report(args, results, cards, sweeps):
    if args.json:
        for r in results:
            if "error" in r:
                print(json.dumps({"variant": _variant_json(args, r), "error": r["error"]}))
                continue
            b = r["breakdown"]
            print(json.dumps({
                "variant": _variant_json(args, r),
                "peak_live_bytes": r["peak"],
                "breakdown": {"weights_bytes": b["weights"], "gradients_bytes": b["gradients"],
                              "optimizer_bytes": b["optimizer"], "precision_copies_bytes": b["copies"],
                              "activations_bytes": b["activations"]},
                "pytorch_min_capacity_bytes": r["pytorch"],
                "pytorch_expandable_min_capacity_bytes": r["pytorch_expandable"],
                "tidepool_min_capacity_bytes": r["tidepool"],
                "fits": r["fits"],
                "fits_pytorch": r["fits_pytorch"],
                "fits_pytorch_expandable": r["fits_pytorch_expandable"],
                "cards_left_out": r["cards_left_out"],
                "jobs": r["jobs"],
                "jobs_pytorch": r["jobs_pytorch"],
                "jobs_pytorch_expandable": r["jobs_pytorch_expandable"],
                "trace": r["trace"],
            }))
        return
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
        cells += [_human(r["peak"]), _human(b["weights"]), _human(b["gradients"]), _human(b["optimizer"]),
                  _human(b["copies"]), _human(b["activations"]), _human(r["pytorch"]), _human(r["pytorch_expandable"]),
                  _human(r["tidepool"]), fits]
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
                return max((r["options"]["batch"] for r in planned if need_on(card, r[allocator], r) <= usable),
                           default=None)

            best, best_pt, best_px = largest("tidepool"), largest("pytorch"), largest("pytorch_expandable")
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


def main(argv=None):
    try:
        status = run(argv)
    except Exit as err:
        print(f"tidepool.plan: error: {err}", file=sys.stderr)
        status = err.status
    except KeyboardInterrupt:
        status = 130
    except Exception as err:  # noqa: BLE001 - bad input raised inside: one clear line
        from .workload import FactoryError, PlanError

        if isinstance(err, FactoryError):
            print(f"tidepool.plan: the model factory raised:\n{err}", file=sys.stderr, end="")
            status = 2
        elif isinstance(err, PlanError):
            print(f"tidepool.plan: error: {err}", file=sys.stderr)
            status = 2
        else:
            raise
    sys.exit(status)
