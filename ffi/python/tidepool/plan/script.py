"""`python -m tidepool.plan run SCRIPT [ARGS...]`: a training or inference
script planned as it is written, on a machine without a GPU.

The script runs as `__main__` with its own arguments (runpy), its CPU work
as written, its CUDA work on tensors without storage (fake_cuda.py) under
the Recorder; torch.cuda answers as the card of --card would, its memory
figures from the recording. Then the recording is planned and reported as
a model's is (report.py), card by card where the process used several
(`--devices N`). `--nproc-per-node N` runs it as one rank of a torchrun
job (launch.py). Weights it loads from files are not read (weights.py),
transformers' generate runs to its token limit (generation.py).

What the run does to the script, and says in the report:
- `--steps K` ends it after K optimizer steps (the step's return: a
  private exception, raised by a global step hook and caught here), or,
  where the script makes no optimizer, after K calls of its outermost
  module;
- `torch.compile` returns what it is given (the script runs eagerly);
- values read back from the card are placeholders (reads.py), and the
  places that read them are listed;
- nothing is downloaded (HF_HUB_OFFLINE=1): a model the script would fetch
  from the hub fails as transformers fails offline, with a line that says
  so; a local path works.
"""
import argparse
import contextlib
import functools
import json
import os
import runpy
import shutil
import sys
import tempfile
import traceback

from .cards import resolve_cards
from .errors import Exit
from .report import json_row, print_text
from .running import _finish, _plan_process, find_tidepool, pytorch_reserved, recording_figures

DEFAULT_CARD = "H100"


class StepsDone(BaseException):
    """Ends the script after --steps (a BaseException: `except Exception`
    in the script does not catch it)."""


class ScriptFailed(Exception):
    """The script raised or exited with a non-zero status."""

    def __init__(self, status):
        super().__init__(status)
        self.status = status


def parse_args(argv):
    from .arguments import DEFAULT_CARDS, Parser, positive

    parser = Parser(
        prog="python -m tidepool.plan run",
        description="Run a PyTorch script unchanged, without a GPU, and plan what it needs on one.",
        epilog="Everything after SCRIPT is the script's own arguments.")
    parser.add_argument("script", metavar="SCRIPT")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS")
    parser.add_argument("--steps", type=positive, default=None, metavar="K",
                        help="stop after K optimizer steps (K forwards of the outermost module where the script "
                             "makes no optimizer); default: run to the end")
    parser.add_argument("--card", default=DEFAULT_CARD, metavar="NAME",
                        help=f"the card torch.cuda describes to the script (default: {DEFAULT_CARD})")
    parser.add_argument("--devices", type=positive, default=None, metavar="N",
                        help="torch.cuda.device_count(): the cards of the process, each planned alone where it "
                             "uses several (default: 1, or --nproc-per-node)")
    parser.add_argument("--nproc-per-node", "--nproc_per_node", type=positive, default=None, metavar="N",
                        help="run the script as torchrun would start it on N cards of one machine, as one of its "
                             "ranks (torch.distributed over a fake process group), and plan that rank")
    parser.add_argument("--rank", type=int, default=0, metavar="R", help="the rank planned (default: 0)")
    parser.add_argument("--cards", default=DEFAULT_CARDS, help="the cards to compare the needs with, as for a model")
    parser.add_argument("--json", action="store_true", help="one JSON object (a line per card used), as for a model")
    parser.add_argument("--keep-trace", metavar="PATH",
                        help="keep the recording's trace (RMM CSV) at PATH (PATH.cudaN.csv per card where it "
                             "uses several)")
    parser.add_argument("--tidepool", metavar="PATH", help="the tidepool command (as for a model)")
    args = parser.parse_args(argv)
    if not os.path.isfile(args.script):
        raise Exit(f"{args.script}: no such file")
    if args.nproc_per_node is None and args.rank != 0:
        parser.error("--rank is a rank of --nproc-per-node N")
    if args.nproc_per_node is not None and not 0 <= args.rank < args.nproc_per_node:
        parser.error(f"--rank {args.rank}: the ranks of --nproc-per-node {args.nproc_per_node} are 0 to "
                     f"{args.nproc_per_node - 1}")
    if args.devices is None:
        args.devices = args.nproc_per_node or 1
    return args


class _Bounds:
    """Counts optimizer steps and outermost forwards; ends the run at --steps.
    Labels what the recorder sees for the breakdown: a module's parameters
    and buffers as weights at its first call, an optimizer's parameters as
    weights, and its gradients and state at each step (Recorder.track)."""

    def __init__(self, steps, recorder, reads):
        self.reads = reads  # told of each step and module call (reads.Reads.progress)
        self.steps, self.optimizers, self.optimizer_steps, self.forwards, self.depth = steps, 0, 0, 0, 0
        self.stopped = None  # "optimizer steps" or "forwards" when --steps ended the run
        self.recorder, self.seen = recorder, set()

    def optimizer_made(self, optimizer):
        self.optimizers += 1
        from .record import WEIGHTS

        for group in optimizer.param_groups:
            self.recorder.track(list(group["params"]), category=WEIGHTS)
        self.recorder.track(optimizer)

    def stepped(self, *_):
        self.optimizer_steps += 1
        self.reads.progress()
        if self.steps is not None and self.optimizer_steps >= self.steps:
            self.stopped = "optimizer steps"
            raise StepsDone()

    def forward_begins(self, module, *_):
        self.reads.progress()
        if self.depth == 0 and id(module) not in self.seen:
            self.seen.add(id(module))
            self.recorder.track(module)
        self.depth += 1

    def forward_ends(self, *_):
        self.depth -= 1
        if self.depth == 0:
            self.forwards += 1
            if self.steps is not None and not self.optimizers and self.forwards >= self.steps:
                self.stopped = "forwards"
                raise StepsDone()


@contextlib.contextmanager
def _patched(bounds, compiled):
    import torch
    import torch.nn.modules.module as module_hooks
    import torch.optim.optimizer as optimizer_hooks

    handles = [optimizer_hooks.register_optimizer_step_post_hook(bounds.stepped),
               module_hooks.register_module_forward_pre_hook(bounds.forward_begins),
               module_hooks.register_module_forward_hook(bounds.forward_ends, always_call=True)]
    init = torch.optim.Optimizer.__init__

    def made(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if not getattr(self, "_tidepool_counted", False):
            self._tidepool_counted = True
            bounds.optimizer_made(self)

    from torch.amp import grad_scaler

    maybe_step = grad_scaler.GradScaler._maybe_opt_step

    def opt_step(self, optimizer, optimizer_state, *args, **kwargs):
        # GradScaler steps where no gradient is inf or NaN, which it reads
        # back from the card: the placeholder is "none", the ordinary step.
        return optimizer.step(*args, **kwargs)

    compile_ = torch.compile

    def eager(model=None, **kwargs):
        compiled.append(kwargs)
        return model if model is not None else (lambda fn: fn)

    torch.optim.Optimizer.__init__ = made
    torch.compile = eager
    grad_scaler.GradScaler._maybe_opt_step = opt_step
    try:
        yield
    finally:
        grad_scaler.GradScaler._maybe_opt_step = maybe_step
        torch.optim.Optimizer.__init__ = init
        torch.compile = compile_
        for handle in handles:
            handle.remove()


def record(args):
    """Runs the script under the recording; returns (recorder, facts)."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    import torch

    from .cards import Card
    from .fake_cuda import dtypes_made, fake_cuda
    from .generation import generating_to_the_limit
    from .launch import as_rank
    from .reads import reads
    from .record import Recorder, cublas_workspace_bytes
    from .weights import weights_from_files

    card = Card(*args.card_resolved)
    # cuBLAS's workspace as PyTorch sizes it on the card torch.cuda describes
    # (32 MiB a thread on Hopper and later; need_on() scales it per card).
    recorder = Recorder(None, devices=("cuda",), cublas_workspace=cublas_workspace_bytes(card.compute_capability))
    bounds, compiled = _Bounds(args.steps, recorder, reads), []
    path = os.path.abspath(args.script)
    argv = sys.argv[:]
    sys.argv = [args.script, *args.script_args]
    sys.path.insert(0, os.path.dirname(path))
    reads.clear()
    status = 0
    launched = as_rank(args.nproc_per_node, args.rank, recorder) if args.nproc_per_node else contextlib.nullcontext()
    try:
        reserved = functools.partial(pytorch_reserved, args.binary)
        with _patched(bounds, compiled), fake_cuda(card, recorder, args.devices, reserved), launched, \
                weights_from_files(), generating_to_the_limit():
            try:
                runpy.run_path(path, run_name="__main__")
            except StepsDone:
                pass
            except SystemExit as exit:
                status = exit.code if isinstance(exit.code, int) else (0 if exit.code is None else 1)
                if exit.code not in (None, 0) and not isinstance(exit.code, int):
                    print(exit.code, file=sys.stderr)
            except BaseException as err:  # noqa: BLE001 - the script's error, shown as its traceback
                if isinstance(err, KeyboardInterrupt):
                    raise
                _show(err, path)
                status = 1
    finally:
        sys.argv = argv
        if sys.path and sys.path[0] == os.path.dirname(path):
            del sys.path[0]
    if status:
        raise ScriptFailed(status)
    bf16 = torch.bfloat16 in dtypes_made()

    def read(place, count):
        file, line, what, via = place
        return {"file": file, "line": line, "what": what, "via": via, "count": count, "loop": place in reads.loops}

    places = sorted(reads.places.items(), key=lambda item: (*item[0][:3], item[0][3] or ""))
    facts = {"optimizer_steps": bounds.optimizer_steps, "forwards": bounds.forwards, "stopped_after": bounds.stopped,
             "compiled": len(compiled), "card": card.name, "bf16": bf16, "spin": reads.SPIN,
             "reads": [read(place, count) for place, count in places]}
    return recorder, facts


def _show(err, path):
    """The script's traceback, from its own first frame, without the
    planner's frames (its modes and the recorder), and a line about a
    download refused offline."""
    here = os.path.dirname(os.path.abspath(__file__))
    shown = traceback.TracebackException.from_exception(err)
    frames = list(shown.stack)
    first = next((i for i, frame in enumerate(frames) if os.path.abspath(frame.filename) == path), 0)
    shown.stack = traceback.StackSummary.from_list(
        [frame for frame in frames[first:] if not os.path.abspath(frame.filename).startswith(here + os.sep)])
    sys.stderr.write("".join(shown.format()))
    text = str(err)
    if os.environ.get("HF_HUB_OFFLINE") == "1" and ("offline" in text.lower() or "huggingface.co" in text
                                                      or type(err).__name__ in ("LocalEntryNotFoundError",
                                                                                "OfflineModeIsEnabled")):
        sys.stderr.write("tidepool.plan run: the script downloads from the Hugging Face hub, and nothing is "
                         "downloaded here (HF_HUB_OFFLINE=1): give it a local path (a directory with the model's "
                         "config.json, and its weights where it loads them)\n")


def run(argv):
    """The `run` subcommand: returns the exit status."""
    args = parse_args(argv)
    binary = args.binary = find_tidepool(args.tidepool)
    cards = resolve_cards(binary, args.cards)
    args.card_resolved = tuple(resolve_cards(binary, args.card)[0])
    try:
        recorder, facts = record(args)
    except ScriptFailed as failed:
        print(f"tidepool.plan run: {args.script} failed (exit status {failed.status}): nothing planned",
              file=sys.stderr)
        return failed.status
    devices = recorder.devices_used()
    several = len(devices) > 1
    options = {"task": "script", "precision": "bf16" if facts["bf16"] else None, "steps": args.steps}
    scratch = tempfile.mkdtemp(prefix="tidepool-plan-run-")
    results = []
    try:
        for index in devices:
            # A process on several cards: each card's recording planned alone.
            on_device = recorder.on_device(index)
            trace = _trace_path(args.keep_trace, index, several) or os.path.join(scratch, f"cuda{index}.csv")
            on_device.write(trace)
            label = {"device": f"cuda:{index}"} if several else {}
            results.append({"label": label, "options": {**options, **label}, "sets": {},
                            "trace": trace if args.keep_trace else None, **recording_figures(on_device),
                            "process": _plan_process(binary, trace)})
        for result in results:
            _finish(result, cards)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    failed = next((r for r in results if "error" in r), None)
    if failed is not None:
        raise Exit(f"planning the recording failed: {failed['error']}", 1)
    model = " ".join(["run", args.script, *args.script_args])
    shown = argparse.Namespace(json=args.json, model=model)
    if args.json:
        for result in results:
            print(json.dumps({**json_row(shown, result), "script": facts}))
        return 0
    print_text(shown, results, cards, [("device", [r["label"]["device"] for r in results])] if several else [])
    for line in _lines(facts):
        print(line)
    return 0


def _trace_path(keep, index, several):
    """Where --keep-trace keeps device `index`'s trace: PATH itself for a
    process on one card, PATH with `.cudaN` before its extension for each
    of several."""
    if keep is None or not several:
        return keep
    root, extension = os.path.splitext(keep)
    return f"{root}.cuda{index}{extension}"


def _lines(facts):
    lines = [f"torch.cuda described {facts['card']} to the script; it ran {facts['optimizer_steps']} optimizer "
             f"steps and {facts['forwards']} outermost module calls" +
             (f", stopped by --steps after {facts['stopped_after']}" if facts["stopped_after"] else ", to its end")]
    if facts["compiled"]:
        lines.append(f"torch.compile: {facts['compiled']} calls, run eagerly (a compiled step's memory may differ)")
    if facts["reads"]:
        total = sum(r["count"] for r in facts["reads"])
        lines.append(f"values read back from the card ({total}): placeholders (True, 1 or 1.0; copies to the CPU "
                     "filled with them), read at:")
        for r in facts["reads"]:
            loop = (f" (a loop waiting on the value: after {facts['spin']} reads in a row with no other read, "
                    "module call or step between, answered False, 0 or 0.0)") if r["loop"] else ""
            via = f" in {r['via']}" if r["via"] else ""
            lines.append(f"  {_shown(r['file'])}:{r['line']}: {r['what']}{via} x{r['count']}{loop}")
    return lines


def _shown(path):
    """`path` as the user would type it: relative to the working directory
    when it lies below it, else as it is."""
    if not os.path.isabs(path):
        return path
    relative = os.path.relpath(path)
    return path if relative.startswith("..") else relative
