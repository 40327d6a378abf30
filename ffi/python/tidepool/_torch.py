"""torch.cuda's memory functions, answered by tidepool.

With a pluggable allocator, PyTorch's C++ refuses statistics, peak resets,
snapshots, memory history and out-of-memory observers ("does not yet
support"). torch.cuda's Python functions (memory_stats, memory_allocated,
max_memory_allocated, memory_reserved, reset_peak_memory_stats,
memory_summary, memory_snapshot, _snapshot, _record_memory_history,
_dump_snapshot, ...) reach that C++ through a few functions of torch._C,
looked up at every call. redirect() replaces those few with tidepool's, so
PyTorch's own Python code — its keys, its summary table, its pickle — runs
unchanged over tidepool's figures, including in code that imported the
torch.cuda functions by name before install(). restore() puts PyTorch's back.
"""
import sys

from ._memory import memory_stats_as_nested_dict, reset_accumulated_memory_stats, reset_peak_memory_stats
from ._observers import attach_oom_observer
from ._snapshots import record_memory_history, snapshot


def _memory_snapshot(arg=None):
    """torch._C._cuda_memorySnapshot, redirected: arg is None, a pool id, or
    (id0, id1, include_traces); pool (0, 0) means every pool."""
    snap = snapshot()
    pool, include_traces = None, True
    if isinstance(arg, (tuple, list)):
        pool = tuple(arg[:2])
        if len(arg) > 2:
            include_traces = bool(arg[2])
    if pool and pool != (0, 0):
        snap["segments"] = [s for s in snap["segments"] if tuple(s["segment_pool_id"]) == pool]
    if not include_traces:
        snap["device_traces"] = [[] for _ in snap["device_traces"]]
    return snap


def _record_memory_history(enabled="all", context="all", stacks="all", max_entries=sys.maxsize, clear_history=False,
                           *_rest):
    """torch._C._cuda_record_memory_history, redirected (the options after
    clear_history concern PyTorch's own allocators)."""
    record_memory_history(enabled, context, stacks, max_entries, clear_history)


def _legacy_history_options(enabled, record_context=True, trace_alloc_max_entries=1, *_rest, **_ignored):
    """The (enabled, context, stacks, max_entries) the boolean form of
    _record_memory_history means."""
    if not enabled:
        return None, None, "python", 0
    return "all", ("all" if record_context else None), "python", max(int(trace_alloc_max_entries), 1)


def _record_memory_history_legacy(*args, **kwargs):
    """torch._C._cuda_record_memory_history_legacy (enabled as a bool), redirected."""
    enabled, context, stacks, max_entries = _legacy_history_options(*args, **kwargs)
    record_memory_history(enabled, context, stacks, max_entries)


# torch._C function -> the tidepool function that answers it.
REDIRECTS = {
    "_cuda_memoryStats": memory_stats_as_nested_dict,
    "_cuda_resetPeakMemoryStats": reset_peak_memory_stats,
    "_cuda_resetAccumulatedMemoryStats": reset_accumulated_memory_stats,
    "_cuda_memorySnapshot": _memory_snapshot,
    "_cuda_record_memory_history": _record_memory_history,
    "_cuda_record_memory_history_legacy": _record_memory_history_legacy,
    "_cuda_attach_out_of_memory_observer": attach_oom_observer,
}

# PyTorch's originals, while redirected.
_saved = {}


def redirect(torch):
    """Points the torch._C functions this torch has at tidepool's."""
    for name, target in REDIRECTS.items():
        if hasattr(torch._C, name) and name not in _saved:
            _saved[name] = getattr(torch._C, name)
            setattr(torch._C, name, target)


def restore(torch):
    """Puts PyTorch's own functions back."""
    for name, original in _saved.items():
        setattr(torch._C, name, original)
    _saved.clear()


def redirected():
    """The torch._C functions now answered by tidepool."""
    return sorted(_saved)
