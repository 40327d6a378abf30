"""torchrun for `python -m tidepool.plan run --nproc-per-node N`: the script
runs as one rank of N processes on one machine (rank 0, or --rank R), as
torchrun starts each of them, and what that rank allocates on its card is
planned.

What changes for the script, as torchrun and N cards would make it:
- the environment torchrun gives each process (`RANK`, `LOCAL_RANK`,
  `WORLD_SIZE`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, ...), and N cards
  (`torch.cuda.device_count()`);
- `torch.distributed.init_process_group`, whatever backend it names, is
  PyTorch's fake process group of N ranks: collectives return at once and
  move no data, so a rank holds what it allocates itself (a collective's
  output is allocated as on NCCL, its contents are not);
- `DistributedDataParallel` is PyTorch's own: its gradient buckets (one
  more copy of the gradients, the flat tensors NCCL all-reduces) are made
  by C++ from the parameters it sees as meta tensors, so they are adopted
  as the rank's CUDA tensors while DDP is constructed
  (fake_cuda.adopting); its check that every rank holds parameters of the
  same shapes compares data across ranks, and is skipped (one process is
  every rank here). The fake group's work returns no tensor to DDP's own
  all-reduce, so where the script registers no comm hook of its own
  before its first forward, DDP's all-reduce is ddp.py's in-place one;
- FSDP (`fully_shard`) is PyTorch's own too, recorded as fsdp.py records
  it (what it all-gathers counts as weights, what it reduce-scatters from
  as gradients).
"""
import contextlib
import os

# The variables torchrun sets (torch.distributed.run, "Environment
# variables"), for one machine: node rank 0, one restart generation.
_SINGLE_NODE = {"GROUP_RANK": "0", "ROLE_RANK": None, "ROLE_NAME": "default", "LOCAL_WORLD_SIZE": None,
                "GROUP_WORLD_SIZE": "1", "ROLE_WORLD_SIZE": None, "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": "29500", "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
                "TORCHELASTIC_RUN_ID": "none"}


def torchrun_environment(nproc, rank):
    """torchrun's environment for `rank` of `nproc` processes on one node."""
    env = {name: value for name, value in _SINGLE_NODE.items() if value is not None}
    env.update(RANK=str(rank), LOCAL_RANK=str(rank), ROLE_RANK=str(rank), WORLD_SIZE=str(nproc),
               LOCAL_WORLD_SIZE=str(nproc), ROLE_WORLD_SIZE=str(nproc))
    return env


@contextlib.contextmanager
def as_rank(nproc, rank, recorder):
    """The script's process as `rank` of `nproc` (see the module): its
    environment and torch.distributed, restored after."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    import torch.nn.parallel.distributed as ddp_module
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    from .ddp import allreduce_in_place
    from .fake_cuda import adopting
    from .fsdp import recorded
    from .patching import environment, replaced

    if dist.is_initialized():
        dist.destroy_process_group()  # a group of this process's (a model's plan): the script's is its own
    init = c10d.init_process_group
    ddp_init = ddp_module.DistributedDataParallel.__init__

    def init_process_group(backend=None, init_method=None, timeout=None, world_size=-1, rank=-1, store=None,
                           group_name="", pg_options=None, device_id=None):
        # What the script asked for (its backend, its rendezvous) is
        # torchrun's rank in a fake group of nproc: nothing to meet.
        return init("fake", world_size=nproc, rank=int(os.environ["RANK"]), store=FakeStore(),
                    **({"timeout": timeout} if timeout is not None else {}))

    def ddp_constructed(self, module, *args, **kwargs):
        parameter = next((p for p in module.parameters()), None)
        device = getattr(parameter, "_cuda_device", None)
        with adopting(device) if device is not None else contextlib.nullcontext():
            ddp_init(self, module, *args, **kwargs)
        handle = None

        def first_forward(ddp, *_):
            handle.remove()
            if not ddp._comm_hooks:
                ddp.register_comm_hook(None, allreduce_in_place(nproc, recorder))

        handle = self.register_forward_pre_hook(first_forward)

    try:
        with environment(**torchrun_environment(nproc, rank)), \
                replaced((c10d, "init_process_group", init_process_group),
                         (dist, "init_process_group", init_process_group),
                         (ddp_module.DistributedDataParallel, "__init__", ddp_constructed),
                         (ddp_module, "_verify_param_shape_across_processes", lambda *args, **kwargs: None)), \
                recorded(recorder):
            yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
