#!/usr/bin/env python3
"""What recording Python frames costs per allocation, against PyTorch's own.

Allocates and frees through the entry point PyTorch calls
(tidepool_torch_malloc) at a given Python stack depth, the GIL held or let
go first (as PyTorch's operators do before they allocate), with record_memory_history(stacks="python") off
and on; the anchor is PyTorch's own python-only capture at the same depth
(torch._C._profiler.gather_traceback(python=True, script=False, cpp=False),
what its allocator runs at every allocation with stacks="python").
Medians of 7 rounds, all figures from one run.

Usage (the package installed, e.g. PYTHONPATH=<pip install --target DIR>):
    TIDEPOOL_CONF=backend:host,host_capacity_mb:1024 python3 benches/python_stacks.py
"""
import ctypes
import statistics
import sys
import time

import tidepool
from tidepool import _native

try:
    import torch
except ImportError:
    torch = None

PAIRS = 20_000
ROUNDS = 7
SIZE = 1 << 20


def at_depth(depth, fn):
    """Runs fn() under `depth` more Python frames."""
    if depth == 0:
        return fn()
    return at_depth(depth - 1, fn)


def entry(holding_gil):
    loader = ctypes.PyDLL if holding_gil else ctypes.CDLL  # CDLL lets the GIL go during the call
    lib = loader(_native.torch_library_path())
    lib.tidepool_torch_malloc.restype = ctypes.c_void_p
    lib.tidepool_torch_malloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    lib.tidepool_torch_free.restype = None
    lib.tidepool_torch_free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    _native.torch_lib()
    return lib


def pairs(lib):
    malloc, free = lib.tidepool_torch_malloc, lib.tidepool_torch_free
    start = time.perf_counter_ns()
    for _ in range(PAIRS):
        free(malloc(SIZE, 0, None), SIZE, 0, None)
    return (time.perf_counter_ns() - start) / PAIRS


def anchor():
    gather = torch._C._profiler.gather_traceback
    start = time.perf_counter_ns()
    for _ in range(PAIRS):
        gather(True, False, False)
    return (time.perf_counter_ns() - start) / PAIRS


def median(fn):
    return statistics.median(fn() for _ in range(ROUNDS))


def main():
    print(f"{'GIL':>8} {'depth':>5} {'off ns':>8} {'on ns':>8} {'frames ns':>10} {'pytorch ns':>11} {'ratio':>6}")
    for holding_gil, depth in ((True, 10), (True, 40), (False, 10), (False, 40)):
        lib = entry(holding_gil)
        tidepool.record_memory_history(None)
        off = at_depth(depth, lambda: median(lambda: pairs(lib)))
        tidepool.record_memory_history("state", stacks="python")
        on = at_depth(depth, lambda: median(lambda: pairs(lib)))
        tidepool.record_memory_history(None)
        ours = on - off
        theirs = at_depth(depth, lambda: median(anchor)) if torch is not None else float("nan")
        gil = "held" if holding_gil else "let go"
        print(f"{gil:>8} {depth:>5} {off:>8.0f} {on:>8.0f} {ours:>10.0f} {theirs:>11.0f} {ours / theirs:>6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
