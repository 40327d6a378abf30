"""Running the planner: the tidepool command it needs, found
(find_tidepool), and each variant recorded (step.py) and planned by
`tidepool plan --json`, one variant's plan running while the next
records (record_and_plan), with its needs on each card worked out
(cards.py). What comes out is a result per variant, which report.py
prints.
"""
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time

from .cards import jobs_side_by_side, left_out, need_on, runnable
from .errors import Exit, FactoryError, MissingMetaKernel, PlanError


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


def pytorch_reserved(binary, recorder):
    """The bytes PyTorch's caching allocator would hold after the events
    recorded so far: the peak reserved of the model of its policy over
    them (`tidepool replay --policy pytorch`; it keeps what it reserves,
    so its reserve now is its peak)."""
    with tempfile.TemporaryDirectory(prefix="tidepool-reserved-") as scratch:
        trace = os.path.join(scratch, "so-far.csv")
        recorder.write(trace)
        done = subprocess.run([binary, "replay", "--json", "--policy", "pytorch", trace], capture_output=True,
                              text=True)
    if done.returncode != 0:
        raise RuntimeError(f"tidepool replay failed: {done.stderr.strip() or done.stdout.strip()}")
    return json.loads(done.stdout.splitlines()[0])["peak_reserved_bytes"]


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


# The allocators a variant's needs are replayed with: the key of the need
# in a result, the key of `tidepool plan --json` it is read from, and the
# suffix of its figures in a result and in --json (fits, fits_pytorch, ...;
# jobs, jobs_pytorch, ...). tidepool's need is tidepool as it runs by
# default, with its expandable segments ("tidepool" in `tidepool plan
# --json`, beside "whole_segments"; tidepool_min_capacity_bytes, fits and
# jobs in --json, as docs/planning.md names them).
ALLOCATORS = (
    ("tidepool_expandable", "tidepool", ""),
    ("pytorch", "pytorch", "_pytorch"),
    ("pytorch_expandable", "pytorch_expandable", "_pytorch_expandable"),
)


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


def record_and_plan(args, binary, cards, todo):
    """Records each variant of `todo` ((options, overrides, label), as
    variants() makes them) and plans it with `binary`: ([result], the
    timelines of --plot). A result holds the variant, its peak and
    breakdown, each allocator's need and the cards it fits, or its error;
    a PlanError of the only variant, or a FactoryError, ends the run."""
    from . import step

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
                result.update(recording_figures(rec))
                result["record_seconds"] = time.perf_counter() - started
                if args.plot:
                    timelines.append((name, rec.timeline()))
                del rec
                result["process"] = _plan_process(binary, trace)
                result["seq"] = seq
            except FactoryError:
                raise
            except PlanError as err:
                # An option combination this variant cannot have: an error of
                # the run when it is the only variant, else of its row.
                if len(todo) == 1:
                    raise
                result["error"] = str(err)
            except MissingMetaKernel as err:
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
    return results, timelines


def recording_figures(rec):
    """What a result holds of its recording: the peak of live bytes, its
    breakdown, the allocations, the cuBLAS workspaces and their bytes."""
    return {"peak": rec.peak()[0], "breakdown": rec.breakdown_at_peak(), "allocs": rec.allocs,
            "workspaces": len(rec.workspaces), "workspace_bytes": rec.workspace_size}


def _finish(result, cards):
    """Reads the plan of `result`'s variant: each allocator's need, and
    the cards it fits and the jobs each holds with it (or the error)."""
    result["cards_left_out"] = left_out(cards, result["options"])
    cards = runnable(cards, result["options"])
    try:
        plan = _plan_result(result.pop("process"))
        for allocator, planned, _ in ALLOCATORS:
            result[allocator] = plan[planned]["min_capacity_bytes"]
        for allocator, _, suffix in ALLOCATORS:
            needs = {card: need_on(card, result[allocator], result) for card in cards}
            result["fits" + suffix] = [card.name for card, need in needs.items() if need <= card.usable]
            result["jobs" + suffix] = {card.name: jobs_side_by_side(card, need) for card, need in needs.items()}
    except (RuntimeError, ValueError, KeyError) as err:
        result["error"] = str(err)

