"""A trace's warm-up through PyTorch, with PyTorch's own allocator or with
tidepool: every allocation of an RMM CSV trace (tidepool's recording
format) made as a tensor of its size times --scale, every free as the
tensor dropped, twice over: the first pass is the warm-up (the allocator
grows, every driver call it makes is in it), the second the steady state.
Run once per allocator in fresh processes (`--allocator native |
native-expandable | tidepool | tidepool-whole`: PyTorch's allocator, its
expandable segments, tidepool's default (expandable segments, in 8 MiB
allocations) and tidepool with expandable:false), `--conf` adding to tidepool's configuration, e.g.
`expandable_allocation_mb:2` (page by page); prints one JSON line:
the seconds of each pass, the peak of live bytes played, the peak
reserved, the allocator's allocations of device memory made and given back
(PyTorch's segments, or tidepool's physical allocations), and tidepool's
pages mapped and its driver calls (where the library counts them). --scale 0 picks the scale that makes the peak of live bytes about
--target-gib. `--device cpu` plays the trace on the host (the tests run it
so; nothing there is measured).
"""
import argparse
import csv
import json
import os
import sys
import time

parser = argparse.ArgumentParser()
parser.add_argument("--allocator", choices=["native", "native-expandable", "tidepool", "tidepool-whole"], required=True)
parser.add_argument("--conf", default="", help="more of tidepool's configuration")
parser.add_argument("--trace", required=True, help="an RMM CSV trace (Thread,Time,Action,Pointer,Size,Stream)")
parser.add_argument("--scale", type=int, default=0, help="sizes times this (0: to about --target-gib live)")
parser.add_argument("--target-gib", type=float, default=20.0)
parser.add_argument("--device", default="cuda")
args = parser.parse_args()

if args.allocator.startswith("tidepool") and args.device == "cuda":
    # run.sh builds the package's C++ libraries into a copy of it (TIDEPOOL_CHECK_PACKAGE).
    sys.path.insert(0, os.environ.get("TIDEPOOL_CHECK_PACKAGE") or os.path.join(os.path.dirname(__file__), "..", "..", "ffi", "python"))
    import tidepool

    whole = "expandable:false" if args.allocator == "tidepool-whole" else ""
    tidepool.install(",".join(c for c in [os.environ.get("TIDEPOOL_CONF", ""), whole, args.conf] if c))
elif args.allocator == "native-expandable":
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"

import torch  # noqa: E402

events = []
with open(args.trace, newline="") as f:
    for row in csv.DictReader(f):
        action = row["Action"].strip()
        if action in ("allocate", "free"):
            events.append((action == "allocate", row["Pointer"].strip(), int(row["Size"])))
live = peak = 0
sizes = {}
for allocate, pointer, size in events:
    if allocate:
        sizes[pointer] = size
        live += size
        peak = max(peak, live)
    elif pointer in sizes:
        live -= sizes.pop(pointer)
scale = args.scale or max(1, round(args.target_gib * 2**30 / max(peak, 1)))


def play():
    tensors = {}
    start = time.perf_counter()
    for allocate, pointer, size in events:
        if allocate:
            tensors[pointer] = torch.empty(size * scale, dtype=torch.uint8, device=args.device)
        else:
            tensors.pop(pointer, None)
    tensors.clear()
    if args.device == "cuda":
        torch.cuda.synchronize()
    return round(time.perf_counter() - start, 4)


warm_up, steady = play(), play()
result = {"allocator": args.allocator, "conf": args.conf, "trace": os.path.basename(args.trace), "scale": scale,
          "events": len(events), "peak_live_bytes": peak * scale, "warm_up_s": warm_up, "steady_s": steady}
if args.device == "cuda":
    result["peak_reserved_bytes"] = torch.cuda.max_memory_reserved()
    # PyTorch's, or tidepool's once installed; tidepool's count of its
    # driver calls where the library keeps one.
    stats = torch.cuda.memory_stats()
    result["device_allocs"] = stats.get("num_device_alloc")
    result["device_frees"] = stats.get("num_device_free")
    if args.allocator.startswith("tidepool"):
        result["pages_mapped"] = stats.get("tidepool.num_pages_mapped")
        result["driver_calls"] = stats.get("tidepool.num_driver_calls")
print(json.dumps(result))
