"""A hand-written training loop as people write them: argparse, a model
moved with .to(device), AdamW, and where gradients are zeroed chosen by
--zero-grad (before the forward, between forward and backward, or after
the step), gradient accumulation, AMP (autocast and GradScaler) and an
evaluation pass inside training; it prints its loss and the peak memory
torch.cuda reports, as such scripts do."""
import argparse

import torch
import torch.nn.functional as F


class Net(torch.nn.Module):
    def __init__(self, width, depth, classes):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))
        self.head = torch.nn.Linear(width, classes)

    def forward(self, x):
        for block in self.blocks:
            x = x + F.gelu(block(x))
        return self.head(x)


def batches(count, batch, width, classes):
    # The data loader: CPU tensors, as a DataLoader gives them.
    generator = torch.Generator().manual_seed(0)
    for _ in range(count):
        yield torch.randn(batch, width, generator=generator), torch.randint(0, classes, (batch,), generator=generator)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--classes", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--accumulation", type=int, default=1)
    parser.add_argument("--zero-grad", choices=("before-forward", "before-backward", "after-step"),
                        default="before-forward")
    parser.add_argument("--amp", action="store_true")
    parser.add_argument("--eval-every", type=int, default=0)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--target-loss", type=float, default=None,
                        help="train until the loss is below this (however many steps that takes)")
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = Net(args.width, args.depth, args.classes).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    forward = torch.compile(model) if args.compile else model
    scaler = torch.amp.GradScaler("cuda", enabled=args.amp)
    steps = args.steps if args.target_loss is None else 10**9
    data = batches(steps * args.accumulation, args.batch, args.width, args.classes)
    for step in range(steps):
        model.train()
        if args.zero_grad == "before-forward":
            optimizer.zero_grad(set_to_none=True)
        for micro in range(args.accumulation):
            x, y = next(data)
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16, enabled=args.amp):
                logits = forward(x)
                loss = F.cross_entropy(logits, y) / args.accumulation
            if args.zero_grad == "before-backward" and micro == 0:
                optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        if args.zero_grad == "after-step":
            optimizer.zero_grad(set_to_none=True)
        print(f"step {step + 1}: loss {loss.item():.4f}")
        if args.target_loss is not None and loss.item() < args.target_loss:
            break
        if args.eval_every and (step + 1) % args.eval_every == 0:
            model.eval()
            with torch.no_grad():
                x, _ = next(batches(1, args.batch * 2, args.width, args.classes))
                accuracy = (model(x.to(device)).argmax(-1) == 0).float().mean().item()
            print(f"eval: {accuracy:.3f}")
    print(f"peak {torch.cuda.max_memory_allocated()} bytes")


if __name__ == "__main__":
    main()
