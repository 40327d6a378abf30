"""PyTorch end to end on a GPU: a small GPT-2-style model (transformers,
random init: nothing downloaded), bf16 autocast, AdamW, a sequence length
that changes every step, with a side stream and record_stream; then a CUDA
graph of an MLP's forward pass, replayed after eager tensors were made: its
output must match eager execution and the eager tensors must survive the
replay (a graph replays into the blocks it freed during capture; an
allocator that hands them out again corrupts them). Run once per allocator,
each in a fresh process (PyTorch's allocator is chosen before CUDA starts):
`--allocator native` (PyTorch's), `native-expandable` (its
expandable_segments:True), `tidepool` (tidepool's default: expandable
segments where the backend maps pages) or `tidepool-whole` (tidepool with
expandable:false, whole segments); prints one JSON line. With `--history PATH` (PyTorch's own
allocator only) it records the training loop's allocations from an empty
allocator into a snapshot at PATH and stops there: `tidepool replay` of it
checks tidepool's models of PyTorch's allocator against what PyTorch did.

What a training step costs with each allocator, in the JSON line:
`steady_step_ms`, the median of steps 3..N (forward, backward and the
optimizer's step, synchronized); `warm_up_ms`, steps 1 and 2 together;
`warm_up_extra_ms`, what they took beyond steady steps of the same
sequence lengths (each against the median of the later steps of its length
where the lengths repeat, else against `steady_step_ms`): CUDA's and
cuBLAS's start-up and the optimizer's state are in it for every allocator
alike, so the allocator's part is its difference from PyTorch's; and the
allocator's driver calls, read from torch.cuda.memory_stats() after step 2
(`driver_calls_after_step_2`: what the later steps made) and after every
sequence length was seen once (`driver_calls_after_warm_up`, which a
caching allocator should bring to 0), counted as `driver_calls_counted`
says: tidepool's own count of its calls (`tidepool.num_driver_calls`) where
the library has it, else, for every allocator, its allocations and frees of
device memory (num_device_alloc + num_device_free: PyTorch's cudaMalloc and
cudaFree, or its expandable segments' mapped pieces; tidepool's segments,
or its physical allocations of pages, each of those costing more than one
call).

Then, for every allocator alike (tidepool must behave as PyTorch's own):
an allocation larger than the GPU raises "CUDA out of memory." where it is
made, an out-of-memory observer hears it, and training goes on; an
accelerate-style batch-size search finds a batch that fits;
max_memory_allocated and reset_peak_memory_stats behave; a snapshot
recorded with Python frames opens in memory_viz's segment and trace plots
and names this file in its frames.

`--device cpu` trains on the host (run.sh's rehearsal runs it so, with a
few short steps: nothing there is measured, but the script, the model and
the figures' code run; tidepool is installed into torch all the same and
its statistics are read from the library, over simgpu there).
"""
import argparse
import json
import os
import statistics
import sys
import time

ALLOCATORS = ["native", "native-expandable", "tidepool", "tidepool-whole"]
LENGTHS = [512, 128, 1024, 256, 768, 384, 896, 640]

parser = argparse.ArgumentParser()
parser.add_argument("--allocator", choices=ALLOCATORS, required=True)
parser.add_argument("--steps", type=int, default=30)
parser.add_argument("--snapshot", default=None)
parser.add_argument("--history", default=None, help="native allocators: record the training loop to this snapshot, then stop")
parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                    help="cpu: the training loop on the host, nothing measured (the rehearsal)")
parser.add_argument("--batch", type=int, default=8)
parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)),
                    help="the sequence lengths, one a step, in turn")
args = parser.parse_args()
if args.history and args.allocator.startswith("tidepool"):
    parser.error("--history records PyTorch's own allocator (native, native-expandable)")
if args.history and args.device != "cuda":
    parser.error("--history records PyTorch's CUDA allocator")
lengths = [int(n) for n in args.lengths.split(",")]
cuda = args.device == "cuda"

if args.allocator.startswith("tidepool"):
    # run.sh builds the package's C++ libraries into a copy of it (TIDEPOOL_CHECK_PACKAGE).
    sys.path.insert(0, os.environ.get("TIDEPOOL_CHECK_PACKAGE") or os.path.join(os.path.dirname(__file__), "..", "..", "ffi", "python"))
    import tidepool

    conf = os.environ.get("TIDEPOOL_CONF", "")
    if args.allocator == "tidepool-whole":
        conf = ",".join(c for c in [conf, "expandable:false"] if c)
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
# Its special tokens inside the vocabulary (GPT-2's are past it); nothing
# here generates text, so only transformers' warnings change.
config = GPT2Config(n_layer=6, n_head=8, n_embd=512, vocab_size=8192, n_positions=max(1024, max(lengths)),
                    bos_token_id=0, eos_token_id=0)
model = GPT2LMHeadModel(config).to(args.device)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)


def synchronize():
    if cuda:
        torch.cuda.synchronize()


def allocator_stats():
    """The allocator's statistics: torch.cuda.memory_stats() (tidepool's
    once installed); on the host, tidepool's from the library itself
    (torch reports nothing before CUDA starts), PyTorch's none."""
    if cuda:
        return torch.cuda.memory_stats()
    return tidepool.memory_stats() if args.allocator.startswith("tidepool") else {}


def calls(stats):
    """(driver calls so far, what was counted) from a memory_stats dict:
    tidepool's count of its calls where the library keeps one, else the
    allocations and frees of device memory; (None, None) with neither."""
    if "tidepool.num_driver_calls" in stats:
        return stats["tidepool.num_driver_calls"], "tidepool.num_driver_calls"
    if "num_device_alloc" in stats:
        return stats["num_device_alloc"] + stats.get("num_device_free", 0), "num_device_alloc+num_device_free"
    return None, None


def counters(stats):
    """The counters read at a step's end, for the differences below."""
    total, counted = calls(stats)
    return {"driver_calls": total, "counted": counted, "device_allocs": stats.get("num_device_alloc"),
            "device_frees": stats.get("num_device_free"), "pages_mapped": stats.get("tidepool.num_pages_mapped"),
            "pages_unmapped": stats.get("tidepool.num_pages_unmapped")}


def since(later, earlier):
    """Each counter's growth from `earlier` to `later` (None where unknown)."""
    return {k: (later[k] - earlier[k] if isinstance(later[k], int) and isinstance(earlier.get(k), int) else None)
            for k in later if k != "counted"}


side = torch.cuda.Stream() if cuda else None
losses, times = [], []
at_step_2 = at_warm_up = None
for step in range(args.steps):
    n = lengths[step % len(lengths)]
    ids = torch.randint(0, config.vocab_size, (args.batch, n), device=args.device, generator=None)
    shadow = None
    if cuda:
        # A side stream uses the batch too: record_stream keeps it from early reuse.
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            shadow = ids.float().mean()
        ids.record_stream(side)
    synchronize()
    start = time.perf_counter()
    with torch.autocast(args.device, dtype=torch.bfloat16):
        loss = model(ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    synchronize()
    times.append(time.perf_counter() - start)
    losses.append(round(loss.item(), 4))
    del shadow
    # Read after the step, outside its time: after step 2, and once every
    # sequence length has been seen (warm: a caching allocator calls the
    # driver no more).
    if step + 1 == 2:
        at_step_2 = counters(allocator_stats())
    if step + 1 == len(lengths):
        at_warm_up = counters(allocator_stats())
at_end = counters(allocator_stats())


def step_figures():
    """Steady step, warm-up and warm-up extra in ms, and the driver calls
    after step 2 and after the warm-up (module docstring)."""
    ms = [round(t * 1000, 3) for t in times]
    out = {"steps": len(ms), "step_ms": ms, "step_lengths": [lengths[i % len(lengths)] for i in range(len(ms))]}
    if len(ms) >= 3:
        steady = statistics.median(ms[2:])
        out["steady_step_ms"] = round(steady, 3)
        out["warm_up_ms"] = round(ms[0] + ms[1], 3)
        extra = 0.0
        for i in (0, 1):
            # Later steps of the same length, past the first round of lengths.
            same = [ms[j] for j in range(len(lengths), len(ms)) if j % len(lengths) == i % len(lengths)]
            extra += ms[i] - (statistics.median(same) if same else steady)
        out["warm_up_extra_ms"] = round(extra, 3)
    out["driver_calls_counted"] = at_end["counted"]
    out["driver_calls"] = at_end["driver_calls"]
    if at_step_2 is not None:
        after = since(at_end, at_step_2)
        out["driver_calls_after_step_2"] = after["driver_calls"]
        out["device_allocs_after_step_2"] = after["device_allocs"]
        out["device_frees_after_step_2"] = after["device_frees"]
        if args.allocator.startswith("tidepool"):
            out["pages_mapped_after_step_2"] = after["pages_mapped"]
            out["pages_unmapped_after_step_2"] = after["pages_unmapped"]
    if at_warm_up is not None:
        after = since(at_end, at_warm_up)
        out["driver_calls_after_warm_up"] = after["driver_calls"]
        if args.allocator.startswith("tidepool"):
            out["pages_mapped_after_warm_up"] = after["pages_mapped"]
            out["pages_unmapped_after_warm_up"] = after["pages_unmapped"]
    return out


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


result = {"allocator": args.allocator, "device": args.device, "batch": args.batch, "losses": losses}
result.update(step_figures())
if not cuda:
    # The host: the loop and its figures ran; the GPU's checks need a GPU.
    print(json.dumps(result))
    sys.exit(0)
# The training loop's own peak (the checks below allocate far more).
result["train_peak_reserved_bytes"] = torch.cuda.max_memory_reserved()
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
