"""Activation checkpointing's recomputation under the function modes of
its forward, for `python -m tidepool.plan run`.

`torch.utils.checkpoint` runs a block again in the backward, inside
autograd's engine, which carries dispatch modes (the Recorder, FakeCuda)
into it but not TorchFunctionModes: there CUDA's attention kernels
(attention.py) and fake_cuda's device rules would be gone, and the
recomputation would take other paths than its forward (the math
attention path saves other tensors: checkpoint refuses the mismatch).
Its own `torch.autocast` it enters again itself (fake_cuda's regions
follow it).

`function_modes_in_recomputation()` keeps, for each checkpointed call, the
function modes its forward ran under, and enters those that are missing
around its recomputation: the non-reentrant kind's (`_CheckpointFrame`'s
`recompute_fn`) and the reentrant kind's (`CheckpointFunction.backward`).
It changes nothing where the modes are there already (a model path's
`context_fn` enters them itself).
"""
import contextlib

import torch.utils.checkpoint as checkpoint_module
from torch.overrides import _get_current_function_mode_stack

from .patching import replaced


@contextlib.contextmanager
def _entered(modes):
    """The modes of `modes` missing from the current stack, entered in order."""
    current = _get_current_function_mode_stack()
    with contextlib.ExitStack() as stack:
        for mode in modes:
            if not any(mode is m for m in current):
                stack.enter_context(mode)
        yield


@contextlib.contextmanager
def function_modes_in_recomputation():
    frame, function = checkpoint_module._CheckpointFrame, checkpoint_module.CheckpointFunction
    frame_init, forward, backward = frame.__init__, function.forward, function.backward

    def init(self, recompute_fn, *args, **kwargs):
        modes = _get_current_function_mode_stack()

        def recompute(*inputs):
            with _entered(modes):
                return recompute_fn(*inputs)

        frame_init(self, recompute, *args, **kwargs)

    def forward_keeping_modes(ctx, *args):
        ctx.tidepool_modes = _get_current_function_mode_stack()
        return forward(ctx, *args)

    def backward_under_modes(ctx, *args):
        with _entered(getattr(ctx, "tidepool_modes", [])):
            return backward(ctx, *args)

    with replaced((frame, "__init__", init), (function, "forward", staticmethod(forward_keeping_modes)),
                  (function, "backward", staticmethod(backward_under_modes))):
        yield
