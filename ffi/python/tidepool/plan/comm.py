"""Copies between the cards of one process, for `python -m tidepool.plan run
--devices N`: what `torch.nn.DataParallel` (and `torch.nn.parallel`'s
replicate, scatter and gather) does, on CudaTensors (fake_cuda.py).

PyTorch does these in C++ (`torch._C._broadcast_coalesced`, `_scatter`,
`_gather`, NCCL's reduce), which sees the meta tensors under the CUDA ones
and refuses them as being on no card. Here each is the copies it makes,
allocated on the cards they go to:
- broadcast: the tensor itself on its own card, a copy on each other one
  (C++ copies coalesced tensors through flat buffers of at most
  `buffer_size` bytes, whose views it returns: the same bytes);
- scatter: each chunk on its card (a view where it is already there);
- gather: one tensor on the destination, each part copied into its place;
- reduce_add: the Python path PyTorch takes without NCCL (a sum on the
  destination card).
DataParallel runs its replicas in threads of their own (`parallel_apply`),
where the recorder and fake_cuda's modes (per thread) are not: here they
run one after another in the calling thread, each under its card as
current, as each thread does; what each card holds is the same.
"""
import contextlib
import importlib

import torch

from .patching import replaced


def _device(index):
    return torch.device("cpu") if index == -1 else torch.device("cuda", torch.cuda.current_device()
                                                                if index is None else index)


def _on_card(tensor, index):
    """`tensor` on card `index`: itself where it is there, else a copy."""
    return tensor if tensor.get_device() == index else tensor.to(_device(index))


def _broadcast(tensor, devices):
    return [_on_card(tensor, index) for index in devices]


def _broadcast_coalesced(tensors, devices, buffer_size=10485760):
    return [[_on_card(tensor, index) for tensor in tensors] for index in devices]


def _scatter(tensor, devices, chunk_sizes=None, dim=0, streams=None):
    chunks = tensor.split(list(chunk_sizes), dim) if chunk_sizes else tensor.chunk(len(devices), dim)
    return [chunk.to(_device(index)) for chunk, index in zip(chunks, devices)]


def _gather(tensors, dim=0, destination=None):
    shape = list(tensors[0].shape)
    shape[dim] = sum(t.size(dim) for t in tensors)
    result = torch.empty(shape, dtype=tensors[0].dtype, device=_device(destination))
    at = 0
    for tensor in tensors:
        result.narrow(dim, at, tensor.size(dim)).copy_(tensor)
        at += tensor.size(dim)
    return result


def _parallel_apply(modules, inputs, kwargs_tup=None, devices=None):
    kwargs_tup = kwargs_tup or ({},) * len(modules)
    devices = devices or [None] * len(modules)
    outputs = []
    for module, args, kwargs, device in zip(modules, inputs, kwargs_tup, devices):
        if not isinstance(args, (list, tuple)):
            args = (args,)
        with torch.cuda.device(device) if device is not None else contextlib.nullcontext():
            outputs.append(module(*args, **kwargs))
    return outputs


@contextlib.contextmanager
def between_cards():
    """While inside: torch.nn.parallel's copies as above."""
    import torch.cuda.nccl as nccl

    # The modules by their names: torch.nn.parallel's own names are functions of theirs.
    data_parallel = importlib.import_module("torch.nn.parallel.data_parallel")
    parallel_apply = importlib.import_module("torch.nn.parallel.parallel_apply")

    with replaced((torch._C, "_broadcast", _broadcast), (torch._C, "_broadcast_coalesced", _broadcast_coalesced),
                  (torch._C, "_scatter", _scatter), (torch._C, "_gather", _gather),
                  (nccl, "is_available", lambda tensors: False),
                  (parallel_apply, "parallel_apply", _parallel_apply),
                  (data_parallel, "parallel_apply", _parallel_apply)):
        yield
