"""PyTorch end to end on a GPU: a small GPT-2-style model (transformers,
random init), bf16 autocast, AdamW, a sequence length that changes every
step, with a side stream and record_stream; then a CUDA graph of an MLP's
forward pass, replayed after eager tensors were made: its output must
match eager execution and the eager tensors must survive the replay (a graph
replays into the blocks it freed during capture; an allocator that hands
them out again corrupts them). Run once per allocator in fresh processes
(`--allocator native|native-expandable|tidepool|tidepool-expandable`);
prints one JSON line. With `--history PATH` (PyTorch's own allocator
only) it records the training loop's allocations from an empty allocator
into a snapshot at PATH and stops there: `tidepool replay` of it checks
tidepool's models of PyTorch's allocator against what PyTorch did.

Then, for every allocator alike (tidepool must behave as PyTorch's own):
an allocation larger than the GPU raises "CUDA out of memory." where it is
made, an out-of-memory observer hears it, and training goes on; an
accelerate-style batch-size search finds a batch that fits;
max_memory_allocated and reset_peak_memory_stats behave; a snapshot
recorded with Python frames opens in memory_viz's segment and trace plots
and names this file in its frames.
"""
import argparse
import json
import os
import sys
import time

parser = argparse.ArgumentParser()
parser.add_argument("--allocator", choices=["native", "native-expandable", "tidepool", "tidepool-expandable"], required=True)
parser.add_argument("--steps", type=int, default=30)
parser.add_argument("--snapshot", default=None)
parser.add_argument("--history", default=None, help="native allocators: record the training loop to this snapshot, then stop")
args = parser.parse_args()
if args.history and args.allocator.startswith("tidepool"):
    parser.error("--history records PyTorch's own allocator (native, native-expandable)")

if args.allocator.startswith("tidepool"):
    # run.sh builds the package's C++ libraries into a copy of it (TIDEPOOL_CHECK_PACKAGE).
    sys.path.insert(0, os.environ.get("TIDEPOOL_CHECK_PACKAGE") or os.path.join(os.path.dirname(__file__), "..", "..", "ffi", "python"))
    import tidepool

    conf = os.environ.get("TIDEPOOL_CONF", "")
    if args.allocator == "tidepool-expandable":
        conf += ",expandable:true"
    tidepool.install(conf)  # first thing: before CUDA starts
elif args.allocator == "native-expandable":
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"

import torch  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402

if args.history:
    # From an empty allocator: the replay starts where PyTorch did.
    torch.cuda.memory._record_memory_history(max_entries=1_000_000)

torch.manual_seed(0)
torch.backends.cudnn.deterministic = True
torch.use_deterministic_algorithms(True, warn_only=True)
config = GPT2Config(n_layer=6, n_head=8, n_embd=512, vocab_size=8192, n_positions=1024)
model = GPT2LMHeadModel(config).cuda()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
lengths = [512, 128, 1024, 256, 768, 384, 896, 640]
side = torch.cuda.Stream()
losses, times = [], []
pages_at_warm_up = None
for step in range(args.steps):
    if step == len(lengths) and args.allocator.startswith("tidepool"):
        # Every sequence length has been seen once: warm.
        s = tidepool.memory_stats()
        pages_at_warm_up = (s["tidepool.num_pages_mapped"], s["tidepool.num_pages_unmapped"])
    n = lengths[step % len(lengths)]
    ids = torch.randint(0, config.vocab_size, (8, n), device="cuda", generator=None)
    # A side stream uses the batch too: record_stream keeps it from early reuse.
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        shadow = ids.float().mean()
    ids.record_stream(side)
    torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    times.append(time.perf_counter() - start)
    losses.append(round(loss.item(), 4))
    del shadow

if args.history:
    torch.cuda.memory._dump_snapshot(args.history)
    torch.cuda.memory._record_memory_history(enabled=None)
    print(json.dumps({"allocator": args.allocator, "history": args.history, "steps": args.steps,
                      "peak_reserved_bytes": torch.cuda.max_memory_reserved()}))
    sys.exit(0)



def graph_check():
    """Captures a forward pass (an MLP stack: surely capturable, with
    megabytes of temporaries freed during the capture), makes eager tensors,
    replays: True when the replay matches eager execution and left the eager
    tensors intact."""
    layers = []
    for _ in range(4):
        layers += [torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024), torch.nn.LayerNorm(1024)]
    net = torch.nn.Sequential(*layers).cuda().eval()
    static_in = torch.randn(256, 1024, device="cuda")
    warm = torch.cuda.Stream()
    warm.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warm), torch.no_grad():
        for _ in range(2):
            net(static_in)
    torch.cuda.current_stream().wait_stream(warm)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        static_out = net(static_in)
    with torch.no_grad():
        expected = net(static_in).clone()
    eager = [torch.full((1 << 18,), float(i), device="cuda") for i in range(64)]
    graph.replay()
    torch.cuda.synchronize()
    ok = torch.allclose(static_out, expected, atol=1e-3) and all(bool((t == i).all()) for i, t in enumerate(eager))
    del graph, static_out, eager
    return ok


def is_oom(error):
    """accelerate's test (find_executable_batch_size): the message PyTorch's
    allocator raises, or its OutOfMemoryError."""
    return isinstance(error, torch.cuda.OutOfMemoryError) or (
        isinstance(error, RuntimeError) and "CUDA out of memory." in str(error)
    )


def train_step(batch, n=256):
    ids = torch.randint(0, config.vocab_size, (batch, n), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def api_check():
    """What training loops rely on, the same for every allocator."""
    out = {}
    heard = []
    torch._C._cuda_attach_out_of_memory_observer(lambda *a: heard.append(a))
    total = torch.cuda.get_device_properties(0).total_memory
    try:
        torch.empty(2 * total, dtype=torch.uint8, device="cuda")
        out["oom_raises"] = "no exception"
    except Exception as e:  # noqa: BLE001
        out["oom_raises"] = is_oom(e)
        out["oom_exception"] = f"{type(e).__name__}: {str(e)[:160]}"
    out["oom_observer_calls"] = len(heard)
    out["continues_after_oom"] = bool(torch.isfinite(torch.tensor(train_step(8))))

    # accelerate's find_executable_batch_size, as it searches: halve on OOM.
    batch, found = 1 << 14, None
    while batch >= 1 and found is None:
        try:
            train_step(batch, n=1024)
            found = batch
        except Exception as e:  # noqa: BLE001
            if not is_oom(e):
                raise
            batch //= 2
            torch.cuda.empty_cache()
    out["batch_search_found"] = found

    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    peak_reset = torch.cuda.max_memory_allocated() == base
    x = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    grew = torch.cuda.max_memory_allocated() >= base + (256 << 20)
    del x
    out["peak_api_ok"] = peak_reset and grew and torch.cuda.memory_allocated() == base
    out["memory_stats_keys"] = len(torch.cuda.memory_stats())

    torch.cuda.memory._record_memory_history(stacks="python", max_entries=100_000)
    train_step(8)
    path = (args.snapshot or "/tmp/e2e.pickle") + ".frames"
    torch.cuda.memory._dump_snapshot(path)
    torch.cuda.memory._record_memory_history(enabled=None)
    import pickle
    import torch.cuda._memory_viz as viz

    with open(path, "rb") as f:
        snap = pickle.load(f)
    viz.segment_plot(snap)
    viz.trace_plot(snap)
    frames = [f for s in snap["segments"] for b in s["blocks"] for f in b.get("frames", [])]
    out["frames_name_this_file"] = any(f["filename"].endswith("torch_e2e.py") for f in frames)
    return out


result = {"allocator": args.allocator, "losses": losses, "median_step_s": sorted(times[5:])[len(times[5:]) // 2]}
try:
    result["graph_ok"] = graph_check()
except Exception as e:  # reported, not fatal: the rest of the run still counts
    result["graph_ok"] = f"error: {type(e).__name__}: {e}"[:300]
try:
    result.update(api_check())
except Exception as e:  # noqa: BLE001
    result["api_error"] = f"{type(e).__name__}: {e}"[:300]
if args.allocator.startswith("tidepool"):
    stats = tidepool.memory_stats()
    if pages_at_warm_up is not None:
        result["pages_mapped_after_warm_up"] = stats["tidepool.num_pages_mapped"] - pages_at_warm_up[0]
        result["pages_unmapped_after_warm_up"] = stats["tidepool.num_pages_unmapped"] - pages_at_warm_up[1]
    result["peak_reserved_bytes"] = stats["reserved_bytes.all.peak"]
    result["peak_allocated_bytes"] = stats["allocated_bytes.all.peak"]
    result["stats_sane"] = stats["allocated_bytes.all.peak"] <= stats["reserved_bytes.all.peak"] and stats["num_ooms"] >= 1
    if args.snapshot:
        tidepool.dump_snapshot(args.snapshot)
        import torch.cuda._memory_viz as viz

        viz.segment_plot(tidepool.load_snapshot(args.snapshot))
        result["snapshot_loads_in_memory_viz"] = True
else:
    result["peak_reserved_bytes"] = torch.cuda.max_memory_reserved()
    result["peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
print(json.dumps(result))
