"""The planner's command line (`python -m tidepool.plan --help`): its
options and what each takes (parse_args), the value parsers a --sweep
shares with them (positive and non_negative: demos.py's command line too),
and the variants a sweep makes (variants). A bad value ends the command
(Exit, errors.py) with the option named.
"""
import argparse
import itertools

from .errors import Exit

# The first line of `--help`.
SUMMARY = "Plan a model before renting a GPU: will it fit, on which card, at what batch?"

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


def positive(text):
    """An integer of 1 or more; argparse.ArgumentTypeError (which argparse
    prints as it is) otherwise, ValueError for no integer."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def non_negative(text):
    """An integer of 0 or more (as positive)."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected 0 or more, got {text}")
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
        "task": _task, "loop": _choice(LOOPS), "batch": positive, "seq": positive, "precision": _choice(PRECISIONS),
        "checkpointing": _bool, "accumulation": positive, "optimizer": _choice(OPTIMIZERS), "steps": positive,
        "lora_rank": non_negative, "new_tokens": non_negative, "ddp": non_negative,
        "fsdp": non_negative, "zero1": non_negative, "zero2": non_negative,
        "zero_grad": _choice(ZERO_GRAD), "zero_grad_set_to_none": _bool,
    }


class _Help(argparse.RawDescriptionHelpFormatter):
    """The description as written, and every option's default said (an
    option whose default depends on the model says how in its help)."""

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        unsaid = default is None or default is False or default == [] or default == argparse.SUPPRESS or "%(default)" in text
        return text if unsaid or not action.option_strings else f"{text} (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """argparse's parser with tidepool's one-line refusal: a bad option
    raises Exit (status 2) with argparse's reason and where the options
    are listed, instead of printing the whole usage (as the tidepool
    command refuses one)."""

    def error(self, message):
        raise Exit(f"{message} (`{self.prog} --help` lists the options)", 2)


def parse_args(argv):
    from .step import LOOPS, OPTIMIZERS, PRECISIONS, TASKS, ZERO_GRAD

    parser = Parser(
        prog="python -m tidepool.plan", description=SUMMARY,
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
                (non_negative if key in ("lora_rank", "new_tokens", "ddp", "fsdp", "zero1", "zero2") else positive)(str(value))
            except (ValueError, argparse.ArgumentTypeError) as err:
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

