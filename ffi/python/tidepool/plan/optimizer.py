"""The optimizer a training variant steps: one of PyTorch's by `--optimizer
NAME`, each with the implementation its name says (what PyTorch chooses on
CUDA unless the name says otherwise), or the factory's own (a `module:`
factory returning `(model, optimizer)`), checked against the model it
trains.

What each implementation allocates on CUDA, and so in the recording, is
PyTorch's code as it runs there (the Recorder makes optimizers choose as
on CUDA): the state at the first step, and the temporaries of every step
(AdamW's foreach step: one tensor per parameter at once, as large as all of
them; its for-loop: one parameter's at a time; fused: none).
"""
import torch

from .errors import FactoryError, PlanError
from .workload import _traceback

# name -> (what it is, for --help; how it is made from the parameters to train)
OPTIMIZERS = {
    "adamw": ("AdamW as PyTorch picks it on CUDA (foreach: its step's temporaries are as large as all the "
              "parameters)", lambda params: torch.optim.AdamW(params, lr=1e-4)),
    "adamw-loop": ("AdamW with foreach=False (a loop over the parameters: temporaries of one parameter at a time)",
                   lambda params: torch.optim.AdamW(params, lr=1e-4, foreach=False)),
    "adamw-fused": ("AdamW with fused=True (one kernel, no temporaries; its step counters on the device)",
                    lambda params: torch.optim.AdamW(params, lr=1e-4, fused=True)),
    "sgd": ("SGD with momentum 0.9 as PyTorch picks it on CUDA (foreach): a momentum buffer per parameter",
            lambda params: torch.optim.SGD(params, lr=1e-3, momentum=0.9)),
    "sgd-plain": ("SGD without momentum: no state", lambda params: torch.optim.SGD(params, lr=1e-3)),
    "adafactor": ("Adafactor as PyTorch runs it by default (a loop over the parameters): factored second moments",
                  lambda params: torch.optim.Adafactor(params, lr=1e-2)),
}
DEFAULT = "adamw"


def build(options, work, model):
    """The optimizer of a training variant, and its name for the report.

    options["optimizer"]: a name of OPTIMIZERS, or None (not given: the
    factory's own if it has one, else DEFAULT). work.optimizer: the
    factory's, None, an Optimizer over the model's parameters as built, or
    a callable making one from the parameters to train."""
    own, name = work.optimizer, options.get("optimizer")
    if own is not None and name is not None:
        raise PlanError(f"--optimizer {name}: the factory returns its own optimizer; leave --optimizer out "
                        "(or return the model alone to plan PyTorch's)")
    trainable = [p for p in model.parameters() if p.requires_grad]
    if not trainable:
        raise PlanError(f"{type(model).__name__} has no parameters that require gradients: nothing to train "
                        "(plan --task inference or forward-grad)")
    if own is None:
        name = name or DEFAULT
        return OPTIMIZERS[name][1](trainable), name
    if isinstance(own, torch.optim.Optimizer):
        for option in ("lora_rank", "fsdp"):
            if options.get(option):
                what = "adds adapters" if option == "lora_rank" else "replaces the parameters with shards"
                raise PlanError(f"--{option.replace('_', '-')} {what} after the factory built its optimizer over the "
                                "model's parameters: return (model, a callable making the optimizer from the "
                                "parameters to train) instead")
        optimizer = own
    else:
        try:
            optimizer = own(trainable)
        except Exception:  # noqa: BLE001 - the user's callable raised: show its traceback
            raise FactoryError(_traceback()) from None
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise PlanError(f"the factory's optimizer callable returned {type(optimizer).__name__}; expected a "
                            "torch.optim.Optimizer")
    check(optimizer, model)
    cls = type(optimizer)
    return optimizer, f"{cls.__module__}.{cls.__qualname__}"  # the variant names the factory's by its class


def check(optimizer, model):
    """The optimizer holds parameters of the model, and only those."""
    mine = {id(p) for p in model.parameters()}
    held = [p for group in optimizer.param_groups for p in group["params"]]
    foreign = [p for p in held if id(p) not in mine]
    what = f"the factory's {type(optimizer).__name__}"
    if not held:
        raise PlanError(f"{what} holds no parameters; expected the model's")
    if foreign:
        shapes = ", ".join(str(tuple(p.shape)) for p in foreign[:3]) + (", ..." if len(foreign) > 3 else "")
        raise PlanError(f"{what} holds {len(foreign)} of {len(held)} tensors that are not parameters of the model "
                        f"{type(model).__name__} ({shapes}); expected an optimizer over the model's parameters, "
                        "built from the model the factory returns")
