"""Data parallelism for `tidepool.plan --ddp N` and `--zero1 N`: the model
wrapped in PyTorch's DistributedDataParallel over N ranks of PyTorch's
fake process group, recorded for one rank in this process. What a rank
holds is a whole replica (weights, gradients, optimizer state) plus DDP's
gradient buckets, the flat tensors gradients are copied into and
all-reduced in; the fake group's collectives move no data, so the
all-reduce is done in place on the bucket (as NCCL's is), divided by N as
DDP's default hook does. With --zero1 (ZeRO-1) the optimizer is PyTorch's
ZeroRedundancyOptimizer around the same one: each rank keeps the state of
its 1/N of the parameters (by size, as it partitions them)."""
import torch
import torch.distributed as dist


def fake_group(world_size):
    """Rank 0 of a fake process group of world_size ranks (made anew when the size changes)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    if dist.is_initialized():
        if dist.get_world_size() == world_size and dist.get_backend() == "fake":
            return
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())


def wrap(model, world_size, rec):
    """The model as DistributedDataParallel sees it on rank 0; its buckets
    are labelled as gradients in the recording."""
    import torch.nn.parallel.distributed as ddp_module

    fake_group(world_size)
    # The check that every rank has the same parameters compares data the
    # meta device does not have; one process is every rank here.
    check = ddp_module._verify_param_shape_across_processes
    ddp_module._verify_param_shape_across_processes = lambda *args, **kwargs: None
    try:
        wrapped = torch.nn.parallel.DistributedDataParallel(model)
    finally:
        ddp_module._verify_param_shape_across_processes = check

    wrapped.register_comm_hook(None, allreduce_in_place(world_size, rec))
    return wrapped


def allreduce_in_place(world_size, rec):
    """DDP's all-reduce as a comm hook over the fake group (its own would
    get no tensor back from the fake group's work): in place on the bucket,
    divided by the world size as DDP's default is; the bucket labelled as
    gradients."""

    def hook(_state, bucket):
        buffer = bucket.buffer()
        rec.label(buffer, "gradients")
        buffer.div_(world_size)
        done = torch.futures.Future()
        done.set_result(buffer)
        return done

    return hook


def zero_redundancy(optimizer):
    """`optimizer` as ZeRO-1 runs it: the same class and settings, its state
    kept for this rank's share of the parameters only."""
    import inspect

    from torch.distributed.optim import ZeroRedundancyOptimizer

    params = [p for group in optimizer.param_groups for p in group["params"]]
    # The settings its constructor takes (`defaults` may hold more: torch's
    # AdamW keeps `decoupled_weight_decay` there, which AdamW() refuses).
    accepted = inspect.signature(type(optimizer)).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
    settings = {k: v for k, v in optimizer.defaults.items() if takes_any or k in accepted}
    return ZeroRedundancyOptimizer(params, optimizer_class=type(optimizer), **settings)
