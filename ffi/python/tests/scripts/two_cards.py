"""Model parallelism by hand in one process: the first half of the layers
on cuda:0, the second (twice as wide) on cuda:1, the activations moved
between them; each card's memory printed as torch.cuda reports it, and a
snapshot dumped where a path is given."""
import sys

import torch


def half(width, depth, device):
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(depth)]).to(device)


if len(sys.argv) > 1:
    torch.cuda.memory._record_memory_history()
first, second = half(1024, 4, "cuda:0"), torch.nn.Sequential(torch.nn.Linear(1024, 2048), half(2048, 4, "cuda:1"))
second.to("cuda:1")
optimizer = torch.optim.AdamW([*first.parameters(), *second.parameters()])
for _ in range(2):
    x = torch.randn(256, 1024, device="cuda:0")
    loss = second(first(x).to("cuda:1")).square().mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
for card in range(torch.cuda.device_count()):
    print(f"cuda:{card} {torch.cuda.max_memory_allocated(card)}")
if len(sys.argv) > 1:
    torch.cuda.memory._dump_snapshot(sys.argv[1])
