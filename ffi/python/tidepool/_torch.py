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
# torch._C function -> the tidepool function (in tidepool/__init__.py) that answers it.
REDIRECTS = {
    "_cuda_memoryStats": "memory_stats_as_nested_dict",
    "_cuda_resetPeakMemoryStats": "reset_peak_memory_stats",
    "_cuda_resetAccumulatedMemoryStats": "reset_accumulated_memory_stats",
    "_cuda_memorySnapshot": "_torch_memory_snapshot",
    "_cuda_record_memory_history": "_torch_record_memory_history",
    "_cuda_record_memory_history_legacy": "_torch_record_memory_history_legacy",
    "_cuda_attach_out_of_memory_observer": "attach_oom_observer",
}

# PyTorch's originals, while redirected.
_saved = {}


def redirect(torch, tidepool):
    """Points the torch._C functions this torch has at tidepool's."""
    for name, target in REDIRECTS.items():
        if hasattr(torch._C, name) and name not in _saved:
            _saved[name] = getattr(torch._C, name)
            setattr(torch._C, name, getattr(tidepool, target))


def restore(torch):
    """Puts PyTorch's own functions back."""
    for name, original in _saved.items():
        setattr(torch._C, name, original)
    _saved.clear()


def redirected():
    """The torch._C functions now answered by tidepool."""
    return sorted(_saved)


def check_history_options(enabled, context, stacks):
    """PyTorch's checks of _record_memory_history's options, with its messages."""
    if enabled not in (None, "state", "all"):
        raise RuntimeError("expected state to be 'state', 'all', or None")
    if context not in (None, "state", "alloc", "all"):
        raise RuntimeError("expected context to be 'state', 'alloc', 'all', or None")
    if stacks not in ("python", "all"):
        raise RuntimeError("expected stacks to be 'python', or 'all'")


def legacy_history_options(enabled, record_context=True, trace_alloc_max_entries=1, *_rest, **_ignored):
    """The (enabled, context, stacks, max_entries) the boolean form of
    _record_memory_history means."""
    if not enabled:
        return None, None, "python", 0
    return "all", ("all" if record_context else None), "python", max(int(trace_alloc_max_entries), 1)

