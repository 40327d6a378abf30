"""CuPy and Numba on tidepool's memory, on a GPU (docs/runtimes.md).

Each runtime runs in a process of its own (a runtime that crashes leaves
the other's figures), through the package's one-line switch:

- cupy: tidepool.cupy.use(); arrays made, an elementwise expression, a
  reduction and a RawKernel (NVRTC) run on them, on the legacy default
  stream and on a stream of its own; results checked against numpy; every
  array's address held by tidepool (tidepool_base_alloc) and its block on
  the stream it was made for (the snapshot); an allocation larger than the
  GPU raises cupy.cuda.memory.OutOfMemoryError with tidepool's report and
  the next one is served; dropped arrays go back (allocated bytes return
  to where they were).
- numba: numba.cuda.set_memory_manager(tidepool.numba.TidepoolMemoryManager);
  the context's manager is tidepool's, to_device and a @cuda.jit kernel on
  the arrays, results checked; get_memory_info against the device's size;
  defer_cleanup holds a free back; out of memory raises CudaAPIError
  (CUDA_ERROR_OUT_OF_MEMORY) with tidepool's report; get_ipc_handle refuses
  an expandable segment (tidepool's default).

Both read tidepool's statistics back (allocations, frees, peaks, device
allocations) and print one JSON line each; the parent prints a line per
runtime (ok, FAILED, skipped: not installed) and writes the figures to
--json. Exit status 1 when a runtime failed (a runtime not installed is
skipped, not failed, unless --require).

    python cuda/check/runtimes_check.py [--json OUT.json] [--only cupy|numba] [--require]
    python cuda/check/runtimes_check.py --rehearse

--rehearse runs, without a GPU, what can run there: both packages import,
use() and set_memory_manager take tidepool, and the allocators' layer under
the runtime (tidepool.cupy.malloc_on with a cupy.ndarray over the block;
the plugin's memalloc, defer_cleanup and out of memory) over tidepool's
backend as TIDEPOOL_CONF names it (run.sh's rehearsal: the cuda backend over
simgpu; unset: the host backend); no kernel runs.

Reads TIDEPOOL_LIBRARY (run.sh's staged libtidepool.so) and
TIDEPOOL_CHECK_PACKAGE (run.sh's copy of the package; else ffi/python).
"""
import argparse
import json
import os
import subprocess
import sys
import time
import traceback

MIB = 1 << 20
RUNTIMES = ("cupy", "numba")


def package_path():
    here = os.path.dirname(os.path.abspath(__file__))
    return os.environ.get("TIDEPOOL_CHECK_PACKAGE") or os.path.join(here, "..", "..", "ffi", "python")


def tidepool_figures(tidepool, device=0):
    stats = tidepool.memory_stats(device)
    keys = (
        "allocated_bytes.all.current",
        "allocated_bytes.all.peak",
        "reserved_bytes.all.current",
        "reserved_bytes.all.peak",
        "tidepool.num_allocs",
        "tidepool.num_frees",
        "num_device_alloc",
        "num_ooms",
        "tidepool.num_driver_calls",
        "tidepool.num_size_mismatches",
        "tidepool.num_invalid_frees",
    )
    return {key: stats[key] for key in keys}


def expect(condition, what):
    if not condition:
        raise AssertionError(what)


def held_by_tidepool(ptr):
    import ctypes

    from tidepool import _native

    size = ctypes.c_size_t(0)
    return bool(_native.lib().tidepool_base_alloc(ptr, ctypes.byref(size)))


def segment_of(tidepool, ptr):
    for segment in tidepool.snapshot()["segments"]:
        if segment["address"] <= ptr < segment["address"] + segment["total_size"]:
            return segment
    return None


def check_cupy(rehearse, out):
    import numpy as np

    import cupy
    import tidepool
    import tidepool.cupy

    out["versions"] = {"cupy": cupy.__version__}
    on_host = "backend:host" in os.environ.get("TIDEPOOL_CONF", "")
    tidepool.cupy.use(allow_host=rehearse and on_host)
    expect(cupy.cuda.get_allocator() is tidepool.cupy.malloc, "use() did not make tidepool CuPy's allocator")
    base = tidepool.memory_allocated()
    if rehearse:
        # No driver for CuPy here: the layer under malloc, over tidepool's backend.
        memptr = tidepool.cupy.malloc_on(4 * MIB, 0, cupy.cuda.Stream.null)
        array = cupy.ndarray((MIB,), dtype="float32", memptr=memptr)
        expect(array.data.ptr == memptr.ptr and held_by_tidepool(memptr.ptr), "the array is not on tidepool's block")
        expect(tidepool.memory_allocated() - base >= 4 * MIB, "tidepool does not count the block")
        try:
            tidepool.cupy.malloc_on(1 << 44, 0, 0)
            raise AssertionError("16 TiB was served")
        except cupy.cuda.memory.OutOfMemoryError as error:
            expect("tidepool: out of memory" in str(error), f"no tidepool report in {error}")
        del memptr, array
        expect(tidepool.memory_allocated() == base, "the block was not freed")
        out["figures"] = tidepool_figures(tidepool)
        return
    device = cupy.cuda.runtime.getDevice()
    total = cupy.cuda.runtime.memGetInfo()[1]
    out["device"] = {"index": device, "total_bytes": total}
    n = 1 << 24  # 64 MiB of float32
    began = time.perf_counter()
    x = cupy.arange(n, dtype=cupy.float32)
    y = x * 2 + 1
    expect(held_by_tidepool(x.data.ptr) and held_by_tidepool(y.data.ptr), "CuPy's arrays are not tidepool's")
    expect(tidepool.memory_allocated() - base >= 2 * n * 4, "tidepool does not count CuPy's arrays")
    host = np.arange(n, dtype=np.float32)
    expect(np.array_equal(cupy.asnumpy(y), host * 2 + 1), "x * 2 + 1 is wrong")
    total_sum = float(x.astype(cupy.float64).sum())
    expect(total_sum == float(host.astype(np.float64).sum()), f"sum {total_sum} is wrong")
    saxpy = cupy.RawKernel(
        r"""
        extern "C" __global__ void saxpy(float a, const float* x, const float* y, float* out, unsigned n) {
            unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
            if (i < n) out[i] = a * x[i] + y[i];
        }""",
        "saxpy",
    )
    result = cupy.empty_like(x)
    saxpy(((n + 255) // 256,), (256,), (cupy.float32(3), x, y, result, cupy.uint32(n)))
    expect(np.array_equal(cupy.asnumpy(result), 3 * host + (host * 2 + 1)), "the RawKernel's saxpy is wrong")
    # A stream of its own: the block is that stream's.
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        z = cupy.full(n, 7, dtype=cupy.float32)
        z += x
    stream.synchronize()
    expect(segment_of(tidepool, z.data.ptr)["stream"] == stream.ptr, "the array's block is not on its stream")
    expect(np.array_equal(cupy.asnumpy(z), host + 7), "z = 7 + x on a stream is wrong")
    peak = tidepool.max_memory_allocated()
    out["kernels_s"] = round(time.perf_counter() - began, 3)
    # More than the GPU: CuPy's error with tidepool's report, then the next is served.
    try:
        cupy.empty(2 * total, dtype=cupy.uint8)
        raise AssertionError("twice the GPU was served")
    except cupy.cuda.memory.OutOfMemoryError as error:
        expect(isinstance(error, tidepool.cupy.OutOfMemoryError), f"{type(error)} is not tidepool's")
        expect("tidepool: out of memory on device" in str(error), f"no tidepool report in {error}")
        out["oom_message"] = str(error)[:300]
    after = cupy.ones(n, dtype=cupy.float32)
    expect(float(after.sum()) == n, "the allocation after the OOM is wrong")
    del x, y, z, result, after
    cupy.cuda.Device().synchronize()
    expect(tidepool.memory_allocated() == base, f"{tidepool.memory_allocated() - base} B still allocated after del")
    out["peak_allocated_bytes"] = peak
    out["figures"] = tidepool_figures(tidepool, device)
    expect(out["figures"]["tidepool.num_size_mismatches"] == 0, "a free with the wrong size")
    expect(out["figures"]["tidepool.num_invalid_frees"] == 0, "a free of memory tidepool does not hold")


def check_numba(rehearse, out):
    import numpy as np
    from numba import cuda
    from numba.cuda.cudadrv import driver

    import numba
    import numba_cuda
    import tidepool
    import tidepool.numba

    out["versions"] = {"numba": numba.__version__, "numba-cuda": numba_cuda.__version__}
    cuda.set_memory_manager(tidepool.numba.TidepoolMemoryManager)
    expect(driver._memory_manager is tidepool.numba.TidepoolMemoryManager, "set_memory_manager did not take it")
    base = tidepool.memory_allocated()
    if rehearse:
        # No context without a driver: the plugin as set_memory_manager makes it.
        class Manager(tidepool.numba.TidepoolMemoryManager):
            allow_host = True

        manager = Manager(context=None)
        manager.initialize()
        pointer = manager.memalloc(4 * MIB)
        expect(held_by_tidepool(pointer.device_pointer_value), "memalloc's memory is not tidepool's")
        with manager.defer_cleanup():
            del pointer
            expect(tidepool.memory_allocated() - base >= 4 * MIB, "defer_cleanup did not hold the free")
        expect(tidepool.memory_allocated() == base, "the block was not freed after the defer")
        try:
            manager.memalloc(1 << 44)
            raise AssertionError("16 TiB was served")
        except driver.CudaAPIError as error:
            expect("tidepool: out of memory" in str(error), f"no tidepool report in {error}")
        out["figures"] = tidepool_figures(tidepool)
        return

    context = cuda.current_context()
    expect(isinstance(context.memory_manager, tidepool.numba.TidepoolMemoryManager), "the context's manager is not tidepool's")
    device = context.device.id
    free, total = context.get_memory_info()
    driver_free, driver_total = driver.driver.cuMemGetInfo()
    expect(total == driver_total and driver_free <= free <= total, f"get_memory_info ({free}, {total}) against the driver's ({driver_free}, {driver_total})")
    out["memory_info"] = {"free": free, "total": total}

    @cuda.jit
    def axpy(out_array, a, x, y):
        i = cuda.grid(1)
        if i < out_array.size:
            out_array[i] = a * x[i] + y[i]

    n = 1 << 24
    host = np.arange(n, dtype=np.float32)
    began = time.perf_counter()
    x = cuda.to_device(host)
    y = cuda.to_device(host * 2)
    result = cuda.device_array_like(x)
    expect(held_by_tidepool(x.device_ctypes_pointer.value), "Numba's arrays are not tidepool's")
    expect(tidepool.memory_allocated(device) - base >= 3 * n * 4, "tidepool does not count Numba's arrays")
    axpy[(n + 255) // 256, 256](result, np.float32(3), x, y)
    expect(np.array_equal(result.copy_to_host(), 3 * host + host * 2), "the @cuda.jit axpy is wrong")
    stream = cuda.stream()
    z = cuda.to_device(host, stream=stream)
    axpy[(n + 255) // 256, 256, stream](z, np.float32(2), x, z)
    stream.synchronize()
    expect(np.array_equal(z.copy_to_host(), 3 * host), "axpy on a stream is wrong")
    out["kernels_s"] = round(time.perf_counter() - began, 3)
    peak = tidepool.max_memory_allocated(device)
    with cuda.defer_cleanup():
        held = tidepool.memory_allocated(device)
        del z
        expect(tidepool.memory_allocated(device) == held, "defer_cleanup did not hold the free")
    expect(tidepool.memory_allocated(device) < held, "the free was not done after the defer")
    try:
        cuda.device_array(2 * total, dtype=np.uint8)
        raise AssertionError("twice the GPU was served")
    except driver.CudaAPIError as error:
        expect(error.code == driver.binding.CUresult.CUDA_ERROR_OUT_OF_MEMORY, f"code {error.code}")
        expect("tidepool: out of memory on device" in str(error), f"no tidepool report in {error}")
        out["oom_message"] = str(error)[:300]
    big = cuda.device_array(8 * MIB, dtype=np.uint8)
    if segment_of(tidepool, big.device_ctypes_pointer.value)["is_expandable"]:
        try:
            big.get_ipc_handle()
            raise AssertionError("an IPC handle for an expandable segment")
        except tidepool.numba.IpcNotSupported as error:
            out["ipc"] = str(error)[:200]
    del x, y, result, big
    cuda.synchronize()
    expect(tidepool.memory_allocated(device) == base, f"{tidepool.memory_allocated(device) - base} B still allocated after del")
    out["peak_allocated_bytes"] = peak
    out["figures"] = tidepool_figures(tidepool, device)
    expect(out["figures"]["tidepool.num_size_mismatches"] == 0, "a free with the wrong size")
    expect(out["figures"]["tidepool.num_invalid_frees"] == 0, "a free of memory tidepool does not hold")


def run_one(name, rehearse):
    """In the child: one runtime's check; its JSON line last."""
    sys.path.insert(0, package_path())
    if rehearse and not os.environ.get("TIDEPOOL_CONF"):
        os.environ["TIDEPOOL_CONF"] = "backend:host,host_capacity_mb:1024"
    out = {"runtime": name, "status": "ok", "tidepool_conf": os.environ.get("TIDEPOOL_CONF", "")}
    module = {"cupy": "cupy", "numba": "numba_cuda"}[name]
    try:
        __import__(module)
    except ImportError as error:
        out["status"] = f"skipped: {module} not installed ({error})"
        print(json.dumps(out))
        return 0
    began = time.perf_counter()
    try:
        (check_cupy if name == "cupy" else check_numba)(rehearse, out)
    except Exception as error:  # noqa: BLE001 - reported, the status says FAILED
        traceback.print_exc()
        out["status"] = f"FAILED: {type(error).__name__}: {error}"[:500]
    out["seconds"] = round(time.perf_counter() - began, 3)
    print(json.dumps(out))
    return 0 if out["status"] == "ok" else 1


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rehearse", action="store_true", help="no GPU: only what runs without one")
    parser.add_argument("--only", choices=RUNTIMES, help="one runtime")
    parser.add_argument("--require", action="store_true", help="a runtime not installed fails")
    parser.add_argument("--json", help="write every runtime's figures here")
    parser.add_argument("--child", choices=RUNTIMES, help=argparse.SUPPRESS)
    parser.add_argument("--timeout", type=float, default=120, help="seconds each runtime may take")
    args = parser.parse_args()
    if args.child:
        return run_one(args.child, args.rehearse)
    results, failed = [], False
    for name in [args.only] if args.only else RUNTIMES:
        command = [sys.executable, os.path.abspath(__file__), "--child", name] + (["--rehearse"] if args.rehearse else [])
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
            lines = done.stdout.strip().splitlines()
            try:
                result = json.loads(lines[-1]) if lines else None
            except json.JSONDecodeError:
                result = None
            if result is None:
                result = {"runtime": name, "status": f"FAILED: exit {done.returncode}, no result"}
            sys.stderr.write(done.stderr[-4000:])
        except subprocess.TimeoutExpired:
            result = {"runtime": name, "status": f"FAILED: timed out after {args.timeout:.0f} s"}
        if result["status"].startswith("skipped") and args.require:
            result["status"] = "FAILED: " + result["status"]
        failed |= result["status"].startswith("FAILED")
        results.append(result)
        figures = result.get("figures", {})
        print(
            f"runtimes_check {name}: {result['status']}"
            + (f"; peak allocated {result.get('peak_allocated_bytes', figures.get('allocated_bytes.all.peak', 0)) / MIB:.1f} MiB, "
               f"{figures.get('tidepool.num_allocs', 0)} allocations, {figures.get('tidepool.num_frees', 0)} frees, "
               f"{figures.get('num_device_alloc', 0)} device allocations, {figures.get('num_ooms', 0)} OOMs" if figures else "")
        )
        if args.json:  # after each runtime: a section cut short keeps the figures of those done
            with open(args.json, "w") as file:
                json.dump({"rehearsal": args.rehearse, "runtimes": results}, file, indent=1)
    print(json.dumps({"runtimes_check": {r["runtime"]: r["status"] for r in results}}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
