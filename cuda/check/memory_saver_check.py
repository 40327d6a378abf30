"""torch_memory_saver's calls through tidepool.memory_saver on a GPU: a
torch model's weights paused and resumed, a forward pass before and after
giving the same output.

Cases, each reported on its own (one JSON line at the end, and --json):
- `cpu_backup`: weights made in region(tag="ms-weights",
  enable_cpu_backup=True); pause gives their memory back (the device's free
  memory grows by at least the weights' bytes; tag_stats says paused and
  offloaded); resume; same data_ptr for every parameter; the forward pass
  gives a bit-identical output.
- `no_backup`: weights made in region(tag="ms-discard"); pause, a tensor
  allocated meanwhile in the freed memory, resume; same addresses; the
  weights are loaded again from a CPU copy (load_state_dict into the same
  tensors, as an RL trainer's weight sync does) and the output is
  bit-identical.
- `cuda_graph`: the forward pass captured in a CUDA graph over the
  backed-up weights; pause, resume, replay: the same output (the graph
  replays the addresses a pause keeps).
- `vllm`: tidepool.vllm.CuMemAllocator, weights under "weights", a KV-cache
  tensor under "kv_cache"; sleep(offload_tags=("weights",)), wake_up():
  the same output, get_current_usage() as before.

    PYTHONPATH=<the tidepool package> python cuda/check/memory_saver_check.py [--json PATH]

`--rehearse` runs without a GPU (run.sh's rehearsal; over simgpu there, or
the host backend when TIDEPOOL_CONF is not set): the model runs on the CPU,
its weights' bytes are copied into tidepool memory allocated under the
same regions and tags, paused and resumed the same way (with and without
backup) and copied back; the forward pass must agree as on a GPU. The CUDA
graph case is skipped there.
"""
import argparse
import ctypes
import json
import os
import sys
import time

MIB = 1 << 20

parser = argparse.ArgumentParser()
parser.add_argument("--rehearse", action="store_true", help="no GPU: the model on the CPU, its bytes through tidepool memory")
parser.add_argument("--hidden", type=int, default=1024, help="width of the model's layers")
parser.add_argument("--layers", type=int, default=8)
parser.add_argument("--json", default=None, help="write the results here too")
args = parser.parse_args()

if args.rehearse:
    os.environ.setdefault("TIDEPOOL_CONF", "backend:host,host_capacity_mb:512")

import torch  # noqa: E402

import tidepool  # noqa: E402
from tidepool import _native  # noqa: E402
from tidepool.memory_saver import tidepool_tag, torch_memory_saver  # noqa: E402
from tidepool.vllm import CuMemAllocator  # noqa: E402

host_backend = "backend:host" in os.environ.get("TIDEPOOL_CONF", "")
tidepool.install(allow_host=args.rehearse and host_backend)
DEVICE = "cpu" if args.rehearse else "cuda"
results = {"rehearse": args.rehearse, "cases": {}}


def model():
    torch.manual_seed(0)
    layers = []
    for _ in range(args.layers):
        layers += [torch.nn.Linear(args.hidden, args.hidden), torch.nn.GELU()]
    return torch.nn.Sequential(*layers).to(DEVICE)


def weight_bytes(m):
    return sum(p.numel() * p.element_size() for p in m.parameters())


def device_free():
    if args.rehearse:
        return None
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


class Mirror:
    """Rehearsal only: the model's parameters' bytes in tidepool memory
    allocated in the current region, standing in for the GPU tensors."""

    def __init__(self, m):
        lib = _native.lib()
        self.blocks = []
        for p in m.parameters():
            size = p.numel() * p.element_size()
            ptr = lib.tidepool_malloc(size, 0, None)
            assert ptr, _native.last_error()
            ctypes.memmove(ptr, p.data_ptr(), size)
            self.blocks.append((p, ptr, size))

    def addresses(self):
        return [ptr for _, ptr, _ in self.blocks]

    def scribble(self):
        for _, ptr, size in self.blocks:
            ctypes.memset(ptr, 0xA5, size)

    def load_into(self, m):
        # The GPU tensors' contents are what the tidepool memory holds now.
        with torch.no_grad():
            for p, ptr, size in self.blocks:
                ctypes.memmove(p.data_ptr(), ptr, size)

    def store(self):
        for p, ptr, size in self.blocks:
            ctypes.memmove(ptr, p.data_ptr(), size)

    def free(self):
        for _, ptr, size in self.blocks:
            _native.lib().tidepool_free(ptr, size, 0, None)


def addresses(m, mirror):
    return mirror.addresses() if mirror else [p.data_ptr() for p in m.parameters()]


def case(name, fn):
    started = time.perf_counter()
    try:
        out = fn() or {}
        out["ok"] = True
    except Exception as err:  # reported per case; the exit status says it failed
        out = {"ok": False, "error": f"{type(err).__name__}: {err}"}
    out["seconds"] = round(time.perf_counter() - started, 3)
    results["cases"][name] = out
    print(f"{name}: {'ok' if out['ok'] else 'FAILED ' + out['error']}", flush=True)


def check_paused(tag, nbytes, free_before, offload):
    stats = tidepool.tag_stats(tidepool_tag(tag, offload))
    assert stats["paused"], stats
    assert stats["paused_bytes"] >= nbytes, (stats, nbytes)
    if offload:
        assert stats["offloaded_bytes"] >= nbytes, (stats, nbytes)
    else:
        assert stats["offloaded_bytes"] == 0, stats
    freed = None
    if free_before is not None:
        freed = device_free() - free_before
        assert freed >= nbytes, f"the device's free memory grew by {freed} bytes, less than the weights' {nbytes}"
    return stats, freed


def cpu_backup():
    x = torch.randn(64, args.hidden, device=DEVICE)
    with torch_memory_saver.region(tag="ms-weights", enable_cpu_backup=True):
        m = model()
        mirror = Mirror(m) if args.rehearse else None
    with torch.no_grad():
        before = m(x)
    where = addresses(m, mirror)
    nbytes = weight_bytes(m)
    free_before = device_free()
    torch_memory_saver.pause("ms-weights")
    stats, freed = check_paused("ms-weights", nbytes, free_before, True)
    if mirror:
        with torch.no_grad():
            for p in m.parameters():
                p.zero_()  # only the tidepool copy holds the weights now
    torch_memory_saver.resume("ms-weights")
    assert addresses(m, mirror) == where, "addresses changed"
    if mirror:
        mirror.load_into(m)
    with torch.no_grad():
        after = m(x)
    assert torch.equal(before, after), f"outputs differ by {(before - after).abs().max().item()}"
    if mirror:
        mirror.free()
    del m
    return {"weight_bytes": nbytes, "paused_bytes": stats["paused_bytes"], "offloaded_bytes": stats["offloaded_bytes"], "device_freed": freed}


def no_backup():
    x = torch.randn(64, args.hidden, device=DEVICE)
    with torch_memory_saver.region(tag="ms-discard"):
        m = model()
        mirror = Mirror(m) if args.rehearse else None
    saved = {k: v.detach().cpu().clone() for k, v in m.state_dict().items()}
    with torch.no_grad():
        before = m(x)
    where = addresses(m, mirror)
    nbytes = weight_bytes(m)
    free_before = device_free()
    torch_memory_saver.pause("ms-discard")
    stats, freed = check_paused("ms-discard", nbytes, free_before, False)
    # Another user of the memory meanwhile.
    other = torch.full((nbytes // 4,), 7.0, device=DEVICE)
    del other
    torch_memory_saver.resume("ms-discard")
    assert addresses(m, mirror) == where, "addresses changed"
    if mirror:
        mirror.scribble()  # contents undefined after a pause without backup
    m.load_state_dict(saved)  # the weight sync, into the same tensors
    if mirror:
        mirror.store()
        mirror.load_into(m)
    assert addresses(m, mirror) == where, "load_state_dict moved the weights"
    with torch.no_grad():
        after = m(x)
    assert torch.equal(before, after), f"outputs differ by {(before - after).abs().max().item()}"
    if mirror:
        mirror.free()
    del m
    return {"weight_bytes": nbytes, "paused_bytes": stats["paused_bytes"], "device_freed": freed}


def cuda_graph():
    x = torch.randn(64, args.hidden, device=DEVICE)
    with torch_memory_saver.region(tag="ms-graph", enable_cpu_backup=True):
        m = model()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.no_grad():
        for _ in range(3):
            m(x)  # warm up before capturing
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        out = m(x)
    graph.replay()
    torch.cuda.synchronize()
    before = out.clone()
    free_before = device_free()
    torch_memory_saver.pause("ms-graph")
    check_paused("ms-graph", weight_bytes(m), free_before, True)
    torch_memory_saver.resume("ms-graph")
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(before, out), f"replay after resume differs by {(before - out).abs().max().item()}"
    del graph, m
    return {}


def vllm():
    allocator = CuMemAllocator.get_instance()
    x = torch.randn(64, args.hidden, device=DEVICE)
    with allocator.use_memory_pool(tag="weights"):
        m = model()
        mirror = Mirror(m) if args.rehearse else None
    with allocator.use_memory_pool(tag="kv_cache"):
        if args.rehearse:
            kv_size = 4 * MIB
            kv = _native.lib().tidepool_malloc(kv_size, 0, None)
            assert kv, _native.last_error()
        else:
            kv = torch.zeros(4 * MIB // 4, device=DEVICE)
    with torch.no_grad():
        before = m(x)
    usage = allocator.get_current_usage()
    where = addresses(m, mirror)
    free_before = device_free()
    allocator.sleep(offload_tags=("weights",))
    kv_stats = tidepool.tag_stats("vllm:kv_cache")
    assert kv_stats["paused"] and kv_stats["offloaded_bytes"] == 0, kv_stats
    assert tidepool.tag_stats("vllm:weights")["offloaded_bytes"] >= weight_bytes(m)
    freed = None if free_before is None else device_free() - free_before
    if freed is not None:
        assert freed >= weight_bytes(m) + 4 * MIB, f"sleep freed {freed} bytes"
    assert allocator.get_current_usage() == usage, "usage while asleep"
    if mirror:
        with torch.no_grad():
            for p in m.parameters():
                p.zero_()
    allocator.wake_up()
    assert addresses(m, mirror) == where, "addresses changed"
    if mirror:
        mirror.load_into(m)
    with torch.no_grad():
        after = m(x)
    assert torch.equal(before, after), f"outputs differ by {(before - after).abs().max().item()}"
    if mirror:
        mirror.free()
        _native.lib().tidepool_free(kv, kv_size, 0, None)
    return {"current_usage": usage, "device_freed": freed}


case("cpu_backup", cpu_backup)
case("no_backup", no_backup)
if args.rehearse:
    results["cases"]["cuda_graph"] = {"ok": None, "skipped": "needs a GPU"}
    print("cuda_graph: skipped (needs a GPU)")
else:
    case("cuda_graph", cuda_graph)
case("vllm", vllm)

results["ok"] = all(c["ok"] is not False for c in results["cases"].values())
line = json.dumps(results, sort_keys=True)
if args.json:
    with open(args.json, "w") as f:
        f.write(line + "\n")
print(line)
sys.exit(0 if results["ok"] else 1)
