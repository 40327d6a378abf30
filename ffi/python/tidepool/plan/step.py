"""One variant's recorded run for `tidepool.plan`: the model set up as the
options say (precision, adapters, checkpointing, sharding), then the steps
of its task under the Recorder:
- train: forward, loss, backward and the optimizer step, in the loop's
  shape (`LOOPS`);
- forward-grad: the forward with the autograd graph kept, its output
  referenced, and no backward (the forward half of training as benchmarks
  time it, evaluation with gradients for a later backward, activation-
  memory studies); the loss only where the model computes it (transformers
  models given labels) or a Workload names one;
- inference: forward under `torch.inference_mode()` (no graph);
- generate: a prompt, then new tokens with the model's KV cache."""
import contextlib

import torch

from . import workload as wl
from .errors import MissingMetaKernel
from .attention import cuda_attention
from .autocast import cuda_autocast
from .optimizer import OPTIMIZERS  # noqa: F401 - the choices of --optimizer, named here with the others
from .optimizer import build as _optimizer
from .record import Recorder

PRECISIONS = ("fp32", "bf16-mixed", "fp16-mixed", "bf16", "fp16")
TASKS = ("train", "forward-grad", "inference", "generate")
# "forward" meant inference before forward-grad existed: still read so.
TASK_ALIASES = {"forward": "inference"}
# How a training loop holds the model's output:
# - plain: `logits = model(x); loss = loss_fn(logits, y); loss.backward()`,
#   the output referenced through backward and the optimizer step, until
#   the next forward's output takes its name (the default for module:);
# - trainer: Hugging Face Trainer's `compute_loss`, which returns the loss
#   only, so the output goes before backward (the default for hf: models
#   and config.json files, which are trained that way most often).
LOOPS = ("plain", "trainer")
# Where a training loop zeroes its gradients (--zero-grad):
# - after-step: after the optimizer step (the default; Trainer's place);
# - before-forward: at the start of each step, before its forward (the
#   same memory as after-step where the step is last: the gradients go
#   before the forward either way);
# - before-backward: between the forward and the backward, so that the
#   previous step's gradients are alive through the forward.
# --zero-grad-set-to-none false zeroes them in place (`zero_grad(set_to_none=False)`):
# once made, the gradients stay for the rest of the run.
ZERO_GRAD = ("after-step", "before-forward", "before-backward")


def _low_dtype(precision):
    return torch.bfloat16 if precision.startswith("bf16") else torch.float16


def _checkpoint_layers(work, modes):
    """Checkpoints each repeated block (the model's own switch for transformers).

    The recomputation runs in backward, where autograd's engine does not
    carry TorchFunctionModes: `modes` (CUDA's attention and autocast rules)
    are entered again around it, as checkpoint enters torch.autocast again.
    """
    model = work.model

    def context_fn():
        return contextlib.nullcontext(), modes()

    if work.hf:
        kwargs = {"use_reentrant": False, "context_fn": context_fn}
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        return
    layers = work.layers
    if layers is None:
        lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
        if not lists:
            raise wl.PlanError("--checkpointing: the model has no nn.ModuleList of blocks; give Workload(layers=...)")
        layers = max(lists, key=lambda m: sum(p.numel() for p in m.parameters()))
    from torch.utils.checkpoint import checkpoint

    for block in layers:
        forward = block.forward

        def checkpointed(*args, _forward=forward, **kwargs):
            return checkpoint(_forward, *args, use_reentrant=False, context_fn=context_fn, **kwargs)

        block.forward = checkpointed


def _lora(work, rank):
    try:
        import peft
    except ImportError as err:
        raise wl.PlanError(f"--lora-rank needs peft ({err}); pip install peft") from None
    targets = [name for name, m in work.model.named_modules() if isinstance(m, (torch.nn.Linear, torch.nn.Conv1d))
               or type(m).__name__ == "Conv1D"]
    if not targets:
        raise wl.PlanError(f"--lora-rank: {type(work.model).__name__} has no linear layers peft can wrap")
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear" if work.hf else
                             sorted({n.split(".")[-1] for n in targets}))
    try:
        with torch.device("meta"):
            work.model = peft.get_peft_model(work.model, config)
    except (ValueError, TypeError) as err:
        raise wl.PlanError(f"--lora-rank: peft cannot wrap {type(work.model).__name__}: {err}") from None


def _call(work, inputs, **extra):
    try:
        return work.call(inputs, **extra)
    except NotImplementedError as err:
        raise MissingMetaKernel(_op_of(err)) from None


def _op_of(err):
    text = str(err)
    for word in text.replace("'", " ").replace('"', " ").split():
        if word.startswith("aten::") or word.startswith("aten."):
            return word.rstrip(".,:")
    return text.splitlines()[0] if text else type(err).__name__


class _NoMetaKernel(Recorder):
    """The Recorder that names the operator a meta kernel is missing for."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        try:
            return super().__torch_dispatch__(func, types, args, kwargs)
        except NotImplementedError as err:
            raise MissingMetaKernel(str(func)) from None


def record(spec, overrides, options, path):
    """Builds and records one variant; returns the Recorder (events in memory)."""
    task = options["task"]
    work = wl.build(spec, overrides, task)
    if task == "generate" and work.kind == "custom":
        # Its inputs are its own (make_batch): there are no token ids to extend.
        raise wl.PlanError("--task generate needs a model that takes token ids; a Workload's inputs are its own")
    if options["lora_rank"]:
        if task != "train":
            raise wl.PlanError("--lora-rank trains adapters: use it with --task train")
        _lora(work, options["lora_rank"])
    loop = options.get("loop") or ("trainer" if work.hf else "plain")
    for name in ("zero_grad", "zero_grad_set_to_none"):
        if options.get(name) is not None and task != "train":
            raise wl.PlanError(f"--{name.replace('_', '-')}: gradients are zeroed by a training loop: use it with "
                               "--task train")
    if options.get("loop") and task != "train":
        raise wl.PlanError(f"--loop {options['loop']}: the loop's shape is a training loop's: use it with --task train")
    precision = options["precision"]
    mixed = precision.endswith("-mixed")

    @contextlib.contextmanager
    def cuda_rules():
        """CUDA's attention kernels, and autocast's rules for mixed precision."""
        with cuda_attention(), cuda_autocast(_low_dtype(precision), enabled=mixed):
            yield

    if options["checkpointing"]:
        if task not in ("train", "forward-grad"):
            raise wl.PlanError(f"--checkpointing saves activations for backward: --task {task} has none")
        _checkpoint_layers(work, cuda_rules)
    if options["new_tokens"] and task != "generate":
        raise wl.PlanError("--new-tokens is for --task generate")
    if precision in ("bf16", "fp16"):
        work.model.to(_low_dtype(precision))
    model = work.model
    model.train(task in ("train", "forward-grad"))
    seq = options["seq"] or work.default_seq
    batch = options["batch"]
    if options.get("ddp") and task != "train":
        raise wl.PlanError("--ddp replicates a training step over ranks: use it with --task train")
    for zero in ("zero1", "zero2"):
        if options.get(zero) and task != "train":
            raise wl.PlanError(f"--{zero} shards what training keeps (optimizer state, gradients): use it with --task train")
    parallel = [f"--{name}" for name in ("ddp", "fsdp", "zero1", "zero2") if options.get(name)]
    if len(parallel) > 1:
        raise wl.PlanError(f"{' and '.join(parallel)}: choose one way to spread the model over ranks")
    rec = _NoMetaKernel(path)
    rec.seq = seq  # the length used, --seq or the model's default
    rec.loop = loop if task == "train" else None
    with _shapes_named(options, batch, seq, work), contextlib.ExitStack() as stack:
        stack.enter_context(rec)
        # ZeRO-3 (--fsdp) and ZeRO-2 (--zero2): FSDP2, the weights resharded
        # after each block's forward or kept whole until its backward.
        sharded = options.get("fsdp") or options.get("zero2")
        if sharded:
            from . import fsdp

            stack.enter_context(fsdp.sharding(sharded, rec))
            fsdp.shard(model, sharded, work.layers, reshard_after_forward=bool(options.get("fsdp")))
        rec.track(model)
        # DDP's whole replica, and for ZeRO-1 (--zero1) a sharded optimizer.
        replicated = options.get("ddp") or options.get("zero1")
        if replicated:
            from . import ddp

            work.model = ddp.wrap(model, replicated, rec)
        if task == "train":
            _train(rec, work, model, options, batch, seq, cuda_rules, keep_output=loop == "plain")
        elif task == "forward-grad":
            for k in range(options["steps"]):
                inputs = work.inputs(batch, seq)
                with cuda_rules():
                    output = _call(work, inputs)
                    # A loss outside the model only where the Workload gives
                    # one (a transformers model computes its own from labels).
                    loss = work.loss_fn(output, inputs) if work.loss_fn is not None else None
                # The graph is kept (output and loss referenced) to the step's end.
                rec.mark(f"step {k + 1}")
                del output, loss, inputs
        elif task == "inference":
            for k in range(options["steps"]):
                with torch.inference_mode(), cuda_rules():
                    _call(work, work.inputs(batch, seq))
                rec.mark(f"step {k + 1}")
        else:
            _generate(rec, work, options, batch, seq, cuda_rules)
    return rec


def _train(rec, work, model, options, batch, seq, autocast, keep_output):
    """The training steps; `keep_output`: the plain loop's shape (`LOOPS`)."""
    optimizer, rec.optimizer = _optimizer(options, work, model)
    if options.get("zero1"):
        from .ddp import zero_redundancy

        optimizer = zero_redundancy(optimizer)
    rec.track(optimizer)
    accumulation = options["accumulation"]
    scaler = options["precision"] == "fp16-mixed"
    held = None  # the plain loop's output, until the next forward's takes its name
    place = options.get("zero_grad") or "after-step"
    to_none = options.get("zero_grad_set_to_none")
    to_none = True if to_none is None else to_none
    for k in range(options["steps"]):
        if place == "before-forward":
            optimizer.zero_grad(set_to_none=to_none)
        for micro in range(accumulation):
            inputs = work.inputs(batch, seq)
            # Forward and loss under autocast, backward outside it (PyTorch's
            # AMP recipe): autocast's weight casts go when the region exits.
            with autocast():
                output = _call(work, inputs)
                held = output if keep_output else None
                loss = work.loss(output, inputs)
                del output
                if accumulation > 1:
                    loss = loss / accumulation
                if scaler:  # GradScaler's scaled loss
                    loss = loss * 65536.0
            if place == "before-backward" and micro == 0:
                optimizer.zero_grad(set_to_none=to_none)
            loss.backward()
            del loss, inputs
        rec.mark(f"step {k + 1}: optimizer")
        optimizer.step()
        if place == "after-step":
            optimizer.zero_grad(set_to_none=to_none)
        rec.mark(f"step {k + 1}")


# Words of the errors a model raises when its inputs have a shape it does
# not take (a --seq past its positions, a batch its code cannot split).
# ("expected" alone is not one: "expected scalar type ..." is a dtype's.)
_SHAPE_WORDS = ("size", "shape", "dimension", "broadcast", "out of range", "out of bounds")


@contextlib.contextmanager
def _shapes_named(options, batch, seq, work):
    """A model that refuses the inputs' shape fails naming the options that
    made it (and whether --seq was the model's default)."""
    try:
        yield
    except (RuntimeError, ValueError, IndexError) as err:
        text = str(err).splitlines()[0] if str(err) else type(err).__name__
        if not any(word in text.lower() for word in _SHAPE_WORDS):
            raise
        said = "the default: the model's context length" if work.context else "the default"
        seq_text = f"--seq {seq}" if options["seq"] else f"--seq {seq} ({said})"
        raise wl.PlanError(f"the model refused inputs of --batch {batch} and {seq_text}: {text}") from None


def _generate(rec, work, options, batch, seq, autocast):
    new_tokens = options["new_tokens"] or 32
    model = work.model
    for k in range(options["steps"]):
        with torch.inference_mode(), autocast():
            ids = torch.randint(0, work.vocab or 2, (batch, seq), device="meta")
            if work.hf:
                import inspect

                params = inspect.signature(model.forward).parameters
                extra = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
                cache_name = "cache" if "cache" in params else "past_key_values"
                out = _call(work, dict(input_ids=ids, use_cache=True, **extra))
                cache = getattr(out, "past_key_values", None) or getattr(out, "cache", None)
                for _ in range(new_tokens - 1):
                    nxt = out.logits[:, -1:].argmax(-1)
                    del out
                    out = _call(work, dict(input_ids=nxt, use_cache=True, **{cache_name: cache}))
                del out, cache
            else:
                # A plain module has no cache: each token runs the whole sequence again.
                for _ in range(new_tokens):
                    logits = _call(work, (ids, ids))
                    logits = logits if isinstance(logits, torch.Tensor) else logits[0]
                    ids = torch.cat([ids, logits[:, -1:].argmax(-1)], 1)
                    del logits
        rec.mark(f"step {k + 1}")
