"""A data-parallel training script as torchrun runs it (one process per GPU):
python -m torch.distributed.run --nproc-per-node N ddp_train.py [--width W]."""
import argparse
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()

    dist.init_process_group("nccl")
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    model = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width) for _ in range(4)]).cuda()
    model = DistributedDataParallel(model, device_ids=[rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for step in range(args.steps):
        x = torch.randn(args.batch, args.width, device="cuda")
        loss = model(x).square().mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if rank == 0:
            print(f"step {step} loss {loss.item():.3f} on {dist.get_world_size()} ranks")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
