"""A memory history recorded over part of a run: 1 GiB made and freed
before it, 1 MiB made while it records, 1 MiB more after it stops; a
snapshot dumped while it records (SNAPSHOT) and one after (SNAPSHOT.after)."""
import sys

import torch

big = torch.empty(1 << 28, device="cuda")
del big
torch.cuda.memory._record_memory_history(max_entries=100000)
small = torch.empty(1 << 18, device="cuda")
torch.cuda.memory._dump_snapshot(sys.argv[1])
torch.cuda.memory._record_memory_history(enabled=None)
later = torch.empty(1 << 18, device="cuda")
torch.cuda.memory._dump_snapshot(sys.argv[1] + ".after")
