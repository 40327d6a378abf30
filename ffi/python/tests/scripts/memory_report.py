"""A script that reports its own memory as people do: the peak
torch.cuda.max_memory_allocated() gives, and a snapshot for memory_viz."""
import sys

import torch

snapshot = sys.argv[1] if len(sys.argv) > 1 else None
props = torch.cuda.get_device_properties(0)
print(f"device {torch.cuda.get_device_name()} ({props.total_memory >> 20} MiB, sm {props.major}.{props.minor}), "
      f"{torch.cuda.device_count()} device(s), current {torch.cuda.current_device()}")
if snapshot:
    torch.cuda.memory._record_memory_history(max_entries=100000)
model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 1024)).cuda()
x = torch.randn(256, 1024, device="cuda")
start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
start.record()
with torch.no_grad():
    y = model(x)
end.record()
torch.cuda.synchronize()
print(f"forward took {start.elapsed_time(end)} ms")
print(f"allocated {torch.cuda.memory_allocated()} bytes")
print(f"peak {torch.cuda.max_memory_allocated()} bytes")
torch.cuda.reset_peak_memory_stats()
del y
print(f"peak after reset {torch.cuda.max_memory_allocated()} bytes")
print(f"reserved {torch.cuda.memory_reserved()} bytes, {torch.cuda.mem_get_info()[0]} free")
if snapshot:
    torch.cuda.memory._dump_snapshot(snapshot)
