"""Sharded data parallelism for `tidepool.plan --fsdp N` and `--zero2 N`:
FSDP2's `fully_shard` on every repeated block and on the root, over N
ranks of PyTorch's fake process group, recorded for rank 0 in this
process. A rank holds 1/N of the weights, gradients and optimizer state,
and a block's whole weights while it runs (the all-gathered copy, counted
as weights: with --fsdp, ZeRO-3, freed after the block's forward and
again after its backward; with --zero2, reshard_after_forward=False as
ZeRO-2 keeps parameters whole between forward and backward, held from
the block's forward to the end of its backward) and, in its backward, its
whole gradients until they are reduce-scattered (counted as gradients);
the fake group's collectives move no data.

FSDP wants a GPU where the meta device has none: its check that no
parameter is still on meta is lifted while recording, and its mesh on
"meta" gets a device handle whose streams and events do nothing (the
recording is in program order, as one stream would run it)."""
import contextlib
import types

import torch

from .ddp import fake_group


class _Stream:
    stream_id, device_index, device_type = 0, 0, 0

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        return _Event()

    def synchronize(self):
        pass


class _Event:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None):
        pass

    def wait(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True


_STREAM = _Stream()
_HANDLE = types.SimpleNamespace(
    current_device=lambda: 0, device_count=lambda: 1, set_device=lambda device: None, is_available=lambda: True,
    Stream=_Stream, Event=_Event, current_stream=lambda device=None: _STREAM,
    default_stream=lambda device=None: _STREAM, stream=lambda stream: contextlib.nullcontext(),
    synchronize=lambda device=None: None)


def blocks(model, layers=None):
    """The repeated blocks to shard: the given ones, else the largest nn.ModuleList."""
    if layers is not None:
        return list(layers)
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    if not lists:
        return []
    return list(max(lists, key=lambda m: sum(p.numel() for p in m.parameters())))


@contextlib.contextmanager
def sharding(world_size, rec):
    """While recording a model sharded over world_size fake ranks (the
    group made here): FSDP as recorded()."""
    fake_group(world_size)
    with recorded(rec):
        yield


@contextlib.contextmanager
def recorded(rec):
    """While recording FSDP over a fake group: what it all-gathers counts
    as weights, what it reduce-scatters from as gradients; its parameters
    may be meta tensors (C++ sees a CudaTensor's meta tensor too)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as group_module

    group = group_module.FSDPParamGroup
    check = group._validate_no_meta_params
    group._validate_no_meta_params = lambda self: None
    methods = {name: getattr(group, name) for name in ("unshard", "wait_for_unshard", "post_backward")}

    def labelled(method, category):
        def run(*args, **kwargs):
            with rec.labelling(category):
                return method(*args, **kwargs)
        return run

    group.unshard = labelled(methods["unshard"], "weights")
    group.wait_for_unshard = labelled(methods["wait_for_unshard"], "weights")
    group.post_backward = labelled(methods["post_backward"], "gradients")
    had = getattr(torch, "meta", None)
    torch.meta = _HANDLE  # FSDP looks the device handle up as torch.<device type>, at shard and first run
    try:
        yield
    finally:
        group._validate_no_meta_params = check
        for name, method in methods.items():
            setattr(group, name, method)
        if had is None:
            del torch.meta
        else:
            torch.meta = had


def shard(model, world_size, layers=None, reshard_after_forward=True):
    """fully_shard on each block, then on the root (inside sharding())."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("meta", (world_size,))
    for block in blocks(model, layers):
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
    return model
