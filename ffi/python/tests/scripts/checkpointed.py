"""Activation checkpointing written by hand: transformer-like blocks (fused
attention, an MLP), each block run under torch.utils.checkpoint, of the
reentrant kind or not (--checkpoint none|reentrant|non-reentrant), with
or without bf16 autocast."""
import argparse

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


class Block(torch.nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.qkv, self.out = torch.nn.Linear(width, 3 * width), torch.nn.Linear(width, width)
        self.up, self.down = torch.nn.Linear(width, 4 * width), torch.nn.Linear(4 * width, width)

    def forward(self, x):
        q, k, v = self.qkv(x).unflatten(-1, (3, self.heads, -1)).permute(2, 0, 3, 1, 4).unbind(0)
        x = x + self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(-2))
        return x + self.down(F.gelu(self.up(x)))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint", choices=("none", "reentrant", "non-reentrant"), default="non-reentrant")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    blocks = torch.nn.ModuleList(Block(512, 8) for _ in range(6)).cuda()
    optimizer = torch.optim.AdamW(blocks.parameters())
    for _ in range(args.steps):
        x = torch.randn(8, 256, 512, device="cuda", requires_grad=args.checkpoint == "reentrant")
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=args.bf16):
            for block in blocks:
                if args.checkpoint == "none":
                    x = block(x)
                else:
                    x = checkpoint(block, x, use_reentrant=args.checkpoint == "reentrant")
            loss = x.float().square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    print(f"peak {torch.cuda.max_memory_allocated()} bytes")


if __name__ == "__main__":
    main()
