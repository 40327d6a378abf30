"""A sharded data-parallel training script (FSDP2's fully_shard) as torchrun
runs it: python -m torch.distributed.run --nproc-per-node N fsdp_train.py."""
import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()

    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    model = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width) for _ in range(4)]).cuda()
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for step in range(args.steps):
        x = torch.randn(args.batch, args.width, device="cuda")
        loss = model(x).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
