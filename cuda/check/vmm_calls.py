"""What each driver call of expandable segments costs on this GPU.

Times, through the CUDA driver API itself (ctypes, no tidepool), the calls
tidepool's expandable segments make: cuMemCreate, cuMemMap, cuMemSetAccess,
cuMemUnmap and cuMemRelease, for one allocation of 2 MiB, 20 MiB and 1 GiB
(medians); then the warm-up of a heap growing to --warm-up GiB mapped four
ways: page by page (`expandable_allocation_mb:2`), in 8 MiB allocations
(tidepool's default), in 20 MiB ones (PyTorch's expandable segments) and
in 64 MiB ones, one grant of access per 1 GiB step, as a heap growing by
large blocks makes them; and what giving it all back costs.

Prints a line per figure and writes them as JSON to --json. Runs over
simgpu too (tools/tests/tools/vmm_calls.rs), with smaller sizes.
"""

import argparse
import ctypes
import json
import statistics
import time

MIB = 1 << 20

parser = argparse.ArgumentParser()
parser.add_argument("--sizes-mib", default="2,20,1024", help="allocation sizes timed call by call")
parser.add_argument("--repeats", type=int, default=20, help="cycles per size (a 1 GiB one: a fifth as many)")
parser.add_argument("--warm-up", type=float, default=20.0, help="GiB mapped by the warm-up of each setting")
parser.add_argument("--json", default=None, help="write the figures here")
args = parser.parse_args()


class Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class AllocFlags(ctypes.Structure):
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class AllocationProp(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", Location),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", AllocFlags),
    ]


class AccessDesc(ctypes.Structure):
    _fields_ = [("location", Location), ("flags", ctypes.c_int)]


PINNED, DEVICE, READ_WRITE = 1, 1, 3


def load_driver():
    for name in ("libcuda.so.1", "libcuda.so"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise SystemExit("vmm_calls: no libcuda.so.1 or libcuda.so")


cuda = load_driver()


def call(name, *argv):
    result = getattr(cuda, name)(*argv)
    if result != 0:
        raise SystemExit(f"vmm_calls: {name} failed with CUresult {result}")


call("cuInit", 0)
device, context = ctypes.c_int(), ctypes.c_void_p()
call("cuDeviceGet", ctypes.byref(device), 0)
call("cuDevicePrimaryCtxRetain", ctypes.byref(context), device)
call("cuCtxSetCurrent", context)
prop = AllocationProp(type=PINNED, location=Location(DEVICE, device.value))
access = AccessDesc(location=Location(DEVICE, device.value), flags=READ_WRITE)
granularity = ctypes.c_size_t()
call("cuMemGetAllocationGranularity", ctypes.byref(granularity), ctypes.byref(prop), 0)


def reserve(size):
    base = ctypes.c_uint64()
    call("cuMemAddressReserve", ctypes.byref(base), ctypes.c_size_t(size), ctypes.c_size_t(0), ctypes.c_uint64(0), ctypes.c_uint64(0))
    return base.value


def timed(name, *argv):
    """Microseconds one call took."""
    start = time.perf_counter_ns()
    call(name, *argv)
    return (time.perf_counter_ns() - start) / 1e3


def create(size):
    handle = ctypes.c_uint64()
    micros = timed("cuMemCreate", ctypes.byref(handle), ctypes.c_size_t(size), ctypes.byref(prop), ctypes.c_uint64(0))
    return handle, micros


figures = {"granularity_bytes": granularity.value, "calls": {}, "warm_up": {}}
print(f"granularity: {granularity.value >> 10} KiB")

# Each call alone: a cycle of create, map, access, unmap, release.
for mib in [int(s) for s in args.sizes_mib.split(",")]:
    size = mib * MIB
    base = reserve(size)
    times = {"create": [], "map": [], "set_access": [], "unmap": [], "release": []}
    for _ in range(max(1, args.repeats // 5 if mib >= 1024 else args.repeats)):
        handle, micros = create(size)
        times["create"].append(micros)
        times["map"].append(timed("cuMemMap", ctypes.c_uint64(base), ctypes.c_size_t(size), ctypes.c_size_t(0), handle, ctypes.c_uint64(0)))
        times["set_access"].append(timed("cuMemSetAccess", ctypes.c_uint64(base), ctypes.c_size_t(size), ctypes.byref(access), ctypes.c_size_t(1)))
        times["unmap"].append(timed("cuMemUnmap", ctypes.c_uint64(base), ctypes.c_size_t(size)))
        times["release"].append(timed("cuMemRelease", handle))
    call("cuMemAddressFree", ctypes.c_uint64(base), ctypes.c_size_t(size))
    medians = {k: round(statistics.median(v), 1) for k, v in times.items()}
    figures["calls"][f"{mib}MiB"] = medians
    print(f"calls at {mib} MiB (median us): " + ", ".join(f"{k} {v}" for k, v in medians.items()))

# The warm-up: the heap grows to `total` in 1 GiB steps, each step's pages
# in allocations of `each` bytes and one grant of access; then all goes back.
total = int(args.warm_up * 1024) * MIB
step = min(1024 * MIB, total)
settings = [("page by page", granularity.value), ("8 MiB (tidepool)", 8 * MIB), ("20 MiB (PyTorch)", 20 * MIB), ("64 MiB", 64 * MIB)]
for name, each in settings:
    per_step = step // each * each
    steps = max(1, total // step)
    base = reserve(per_step * steps)
    handles, calls = [], 0
    start = time.perf_counter()
    for s in range(steps):
        at = base + s * per_step
        for offset in range(0, per_step, each):
            handle, _ = create(each)
            call("cuMemMap", ctypes.c_uint64(at + offset), ctypes.c_size_t(each), ctypes.c_size_t(0), handle, ctypes.c_uint64(0))
            handles.append((at + offset, handle))
            calls += 2
        call("cuMemSetAccess", ctypes.c_uint64(at), ctypes.c_size_t(per_step), ctypes.byref(access), ctypes.c_size_t(1))
        calls += 1
    grow = time.perf_counter() - start
    start = time.perf_counter()
    for at, handle in handles:
        call("cuMemUnmap", ctypes.c_uint64(at), ctypes.c_size_t(each))
        call("cuMemRelease", handle)
        calls += 2
    shrink = time.perf_counter() - start
    call("cuMemAddressFree", ctypes.c_uint64(base), ctypes.c_size_t(per_step * steps))
    mapped = per_step * steps
    figures["warm_up"][name] = {"bytes": mapped, "calls": calls, "grow_ms": round(grow * 1e3, 2), "give_back_ms": round(shrink * 1e3, 2)}
    print(f"warm-up to {mapped / 2**30:.2f} GiB, {name}: {calls} calls, grow {grow * 1e3:.1f} ms, give back {shrink * 1e3:.1f} ms")

call("cuDevicePrimaryCtxRelease_v2", device)
if args.json:
    with open(args.json, "w") as f:
        json.dump(figures, f)
print("vmm calls: ok")
