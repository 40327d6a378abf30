"""tidepool.plan: will a model fit, on which card, at what batch, answered
without a GPU. Gathers the names of `python -m tidepool.plan` (command.py
and the modules it ties together);
importing it needs none of torch, transformers and peft (the command
imports them when it runs).

The planner never touches libtidepool: it records a model's allocations on
the meta device and hands the trace to the `tidepool` command. Its modules:
- command.py: the command (main, run), which ties the next three together;
- arguments.py: its options (parse_args) and the variants of a sweep;
- running.py: the tidepool command it runs, found (find_tidepool), and
  each variant recorded and planned with it (`tidepool plan`);
- report.py: the results as JSON lines or as a table, with the largest
  batch each card holds and the jobs side by side;
- script.py: `run SCRIPT [ARGS...]`, a script planned as it is written
  (runpy under the recorder, --steps, the same report);
- fake_cuda.py: CUDA without a GPU for it: CUDA tensors as meta tensors
  that say "cuda:N", torch.cuda as a card of the cards table;
- cards.py: the cards of --cards (`tidepool cards` resolves them) and
  which of them a variant's recording stands for (no bf16 below sm80);
- record.py: the Recorder, a model's allocation trace on the meta device;
- demos.py: small workloads to record and their command line (`python -m
  tidepool.record`);
- step.py: one variant's recorded run (precision, adapters,
  checkpointing, sharding, then its task's steps);
- workload.py: the model a MODEL spec names and the batches it is fed;
- optimizer.py: the optimizer a training step runs (--optimizer, or the
  factory's own);
- autocast.py, attention.py: CUDA's autocast rules and attention kernels,
  emulated on the meta device;
- ddp.py, fsdp.py: data parallelism and sharding over a fake process group;
- plot.py: the --plot picture;
- errors.py: the errors all of them raise (Exit, PlanError, FactoryError,
  MissingMetaKernel), in a module of their own that imports none.
tidepool.record, tidepool.workload, tidepool.autocast and
tidepool.attention are these modules under the names documented first.
"""
from .._units import GIB
from .arguments import DEFAULT_CARDS, parse_args, variants
from .cards import resolve_cards
from .command import main, run
from .errors import Exit
from .report import largest_batches
from .running import find_tidepool

__all__ = [
    "main",
    "run",
    "parse_args",
    "variants",
    "find_tidepool",
    "resolve_cards",
    "largest_batches",
    "Exit",
    "DEFAULT_CARDS",
    "GIB",
]
