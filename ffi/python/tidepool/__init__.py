"""tidepool: a CUDA caching allocator that gives memory back, for PyTorch.

install() makes PyTorch allocate through tidepool: an out-of-memory raises
at the call that allocated, and torch.cuda's memory functions
(memory_stats, max_memory_allocated, memory_summary, _snapshot,
_record_memory_history, ...) answer from tidepool. The functions of this
module answer the same without torch.
"""
import logging
import os
import pickle
import sys
import tempfile
import threading
import warnings

from . import _native, _torch
from ._native import GAUGES, POOLS, FIELDS, TidepoolError, library_path
from .tags import region, pause, resume, tag_stats

_log = logging.getLogger("tidepool")

__all__ = [
    "install",
    "uninstall",
    "mempool",
    "memory_stats",
    "memory_stats_as_nested_dict",
    "memory_allocated",
    "max_memory_allocated",
    "memory_reserved",
    "max_memory_reserved",
    "reset_peak_memory_stats",
    "reset_max_memory_allocated",
    "reset_accumulated_memory_stats",
    "attach_oom_observer",
    "memory_summary",
    "empty_cache",
    "snapshot",
    "dump_snapshot",
    "record_memory_history",
    "library_path",
    "region",
    "pause",
    "resume",
    "tag_stats",
    "TidepoolError",
]

_plug = None
# PyTorch allocates through tidepool (set by install(); PyTorch cannot switch back).
_installed = False


def _pluggable(torch):
    """One CUDAPluggableAllocator over the library with every hook set."""
    global _plug
    if _plug is None:
        # PyTorch calls the C++ entry points, which raise on out of memory
        # (tidepool_malloc's NULL would become a tensor at address 0).
        _native.torch_lib()
        plug = torch.cuda.memory.CUDAPluggableAllocator(
            _native.torch_library_path(), "tidepool_torch_malloc", "tidepool_torch_free"
        )
        raw = plug.allocator()
        raw.set_init_fn(_native.function_address("tidepool_init"))
        raw.set_reset_fn(_native.function_address("tidepool_empty_cache"))
        raw.set_memory_fraction_fn(_native.function_address("tidepool_set_memory_fraction"))
        raw.set_record_stream_fn(_native.function_address("tidepool_record_stream"))
        raw.set_base_alloc_fn(_native.function_address("tidepool_base_alloc"))
        # CUDA graphs and MemPools: what a capture allocates stays its own.
        raw.set_begin_allocate_to_pool(_native.function_address("tidepool_begin_allocate_to_pool"))
        raw.set_end_allocate_to_pool_fn(_native.function_address("tidepool_end_allocate_to_pool"))
        raw.set_release_pool(_native.function_address("tidepool_release_pool"))
        _plug = plug
    return _plug


# The backend the library uses when TIDEPOOL_CONF names none.
DEFAULT_BACKEND = "cuda"


def _backend(conf):
    # The last entry wins, as the library reads them.
    backend = DEFAULT_BACKEND
    for entry in (conf or "").split(","):
        key, _, value = entry.partition(":")
        if key.strip() == "backend":
            backend = value.strip()
    return backend


def install(conf=None, allow_host=False):
    """Makes tidepool PyTorch's CUDA allocator. Call it first thing: PyTorch
    can only switch allocators before CUDA is initialised.

    Afterwards an allocation tidepool cannot serve raises RuntimeError("CUDA
    out of memory. ...") where it was made, and torch.cuda's memory
    functions answer from tidepool (see _torch.py for which, and how).

    conf: a TIDEPOOL_CONF string ("max_split_size_mb:256,..."); it sets the
    environment variable the library reads when it starts.
    allow_host: let the `host` backend (host memory standing in for a GPU)
    serve PyTorch. Its memory is not device memory, so CUDA kernels cannot
    use it: only for testing the wiring.
    """
    import torch

    global _installed
    effective = conf if conf is not None else os.environ.get("TIDEPOOL_CONF", "")
    if _backend(effective) == "host" and not allow_host:
        raise TidepoolError(
            "tidepool's backend is 'host' (host memory standing in for a GPU), which CUDA kernels cannot use: "
            "use backend:cuda (the default) in TIDEPOOL_CONF, or install(..., allow_host=True) to test the wiring"
        )
    # The library reads TIDEPOOL_CONF once, when it starts (at its first call).
    started = _installed or _native.loaded()
    if conf is not None and started and conf != os.environ.get("TIDEPOOL_CONF"):
        warnings.warn(
            f"tidepool.install({conf!r}): tidepool has already started with TIDEPOOL_CONF="
            f"{os.environ.get('TIDEPOOL_CONF', '')!r}, so this configuration is ignored: "
            "pass it to the first install(), or set TIDEPOOL_CONF before the process starts",
            RuntimeWarning,
            stacklevel=2,
        )
    if _installed:
        # PyTorch allocates through tidepool already: a second install()
        # (or one after uninstall()) only points torch.cuda's functions here.
        _torch.redirect(torch, sys.modules[__name__])
        return
    if torch.cuda.is_initialized():
        raise TidepoolError(
            "CUDA is already initialised, so PyTorch can no longer change its allocator: "
            "call tidepool.install() first thing, before any tensor or model touches the GPU"
        )
    if conf is not None and not started:
        # Checked here, where the mistake is made, not at the first allocation.
        problems = _native.conf_problems(conf)
        if problems:
            raise TidepoolError(f"tidepool.install({conf!r}): " + "; ".join(problems) + " (tidepool config lists the options)")
        os.environ["TIDEPOOL_CONF"] = conf
    torch.cuda.memory.change_current_allocator(_pluggable(torch))
    _installed = True
    _torch.redirect(torch, sys.modules[__name__])


def uninstall():
    """Gives torch.cuda's memory functions back to PyTorch. tidepool stays
    PyTorch's allocator: PyTorch offers no handle on its own allocator to
    switch back to (torch._C._cuda_getAllocator() is None for it), and no
    switch at all once CUDA has started."""
    import torch

    _torch.restore(torch)


def mempool():
    """A torch.cuda.MemPool served by tidepool, leaving PyTorch's allocator in
    place for everything else:

        with torch.cuda.use_mem_pool(tidepool.mempool()):
            ...

    PyTorch still carves the pool's segments into blocks itself and asks
    tidepool only for whole segments (2 MiB, 20 MiB or rounded sizes), so
    tidepool's statistics see segments, not tensors, and its fragmentation
    figures do not apply inside the pool; tidepool's release of idle memory
    works at segment granularity there.
    """
    import torch

    return torch.cuda.MemPool(allocator=_pluggable(torch).allocator())


def _device(device):
    return _native.device_index(device)


def memory_stats_as_nested_dict(device=None):
    """torch.cuda.memory_stats_as_nested_dict's answer from tidepool: each
    gauge as {"all"|"small_pool"|"large_pool": {"current", "peak",
    "allocated", "freed"}}, PyTorch's event counters, and tidepool's own
    figures under "tidepool"."""
    s = _native.get_stats(_device(device))
    out = {}
    for gauge_name, gauge in zip(GAUGES, s.gauges):
        out[gauge_name] = {pool: {field: getattr(getattr(gauge, pool), field) for field in FIELDS} for pool in POOLS}
    # tidepool never splits "oversize" blocks apart from others, nor rejects
    # requests ahead of the driver, nor synchronizes every stream.
    out["oversize_allocations"] = dict.fromkeys(FIELDS, 0)
    out["oversize_segments"] = dict.fromkeys(FIELDS, 0)
    out["num_oom_rejections"] = 0
    out["num_sync_all_streams"] = 0
    # Fragmentation: free bytes stuck inside partly used segments (neither
    # releasable nor usable by a larger request) over reserved bytes, as
    # tidepool's statistics, OOM report, top and exporter define it.
    # "external_fragmentation" is the earlier name of the same figure.
    reserved = out["reserved_bytes"]["all"]["current"]
    fragmentation = min(1.0, out["inactive_split_bytes"]["all"]["current"] / reserved) if reserved else 0.0
    own = {
        "cached_free_bytes": s.cached_free_bytes,
        "largest_free_block_bytes": s.largest_free_block_bytes,
        "fragmentation": fragmentation,
        "external_fragmentation": fragmentation,
        "num_allocs": s.num_allocs,
        "num_frees": s.num_frees,
        "reserved_limit_bytes": s.reserved_limit_bytes,
        "released_bytes": {reason: getattr(s, f"released_{reason}_bytes") for reason in _native.RELEASE_REASONS},
    }
    # Every event counter, PyTorch's at the top, tidepool's under "tidepool".
    for key, field in _native.COUNTERS:
        if key.startswith("tidepool."):
            own[key[len("tidepool."):]] = getattr(s, field)
        else:
            out[key] = getattr(s, field)
    # Paused tags (tidepool.pause): GPU memory given back, host memory holding their contents.
    own["paused_bytes"] = s.paused_bytes
    own["offloaded_bytes"] = s.offloaded_bytes
    out["tidepool"] = own
    return out


def _flatten(prefix, value, into):
    if isinstance(value, dict):
        for key, inner in value.items():
            _flatten(f"{prefix}.{key}" if prefix else key, inner, into)
    else:
        into[prefix] = value


def memory_stats(device=None):
    """A dict with torch.cuda.memory_stats' keys and meanings
    ("allocated_bytes.all.current", "num_ooms", ...), sorted as PyTorch
    sorts them, plus tidepool's own under "tidepool.*"."""
    flat = {}
    _flatten("", memory_stats_as_nested_dict(device), flat)
    return dict(sorted(flat.items()))


def reset_peak_memory_stats(device=None):
    """Sets every peak of `device` to its current value (torch.cuda.reset_peak_memory_stats)."""
    _native.check(_native.lib().tidepool_reset_peak_stats(_device(device)))


def reset_max_memory_allocated(device=None):
    """torch.cuda.reset_max_memory_allocated: resets every peak, as PyTorch does."""
    reset_peak_memory_stats(device)


def reset_accumulated_memory_stats(device=None):
    """Zeroes the accumulated figures of `device` ("allocated", "freed",
    num_ooms, ...) (torch.cuda.reset_accumulated_memory_stats)."""
    _native.check(_native.lib().tidepool_reset_accumulated_stats(_device(device)))


def memory_allocated(device=None):
    return _native.get_stats(_device(device)).allocated_bytes


def max_memory_allocated(device=None):
    return _native.get_stats(_device(device)).peak_allocated_bytes


def memory_reserved(device=None):
    return _native.get_stats(_device(device)).reserved_bytes


def max_memory_reserved(device=None):
    return _native.get_stats(_device(device)).peak_reserved_bytes


def empty_cache():
    """Returns every whole free segment to the driver."""
    _native.lib().tidepool_empty_cache()


def _human(n):
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024


def memory_summary(device=None):
    """A readable table of the statistics, in the spirit of torch.cuda.memory_summary."""
    stats = memory_stats(device)
    rows = [
        ("Allocated memory", "allocated_bytes", True),
        ("Active memory", "active_bytes", True),
        ("Requested memory", "requested_bytes", True),
        ("Reserved memory", "reserved_bytes", True),
        ("Non-releasable memory", "inactive_split_bytes", True),
        ("Allocations", "allocation", False),
        ("Active allocs", "active", False),
        ("Segments", "segment", False),
        ("Non-releasable allocs", "inactive_split", False),
    ]
    width = 78
    lines = [
        "=" * width,
        f" tidepool memory summary, device {_device(device)}".ljust(width),
        "-" * width,
        f"{'Metric':<26}|{'Cur Usage':>12} |{'Peak Usage':>12} |{'Tot Alloc':>11} |{'Tot Freed':>10}",
        "-" * width,
    ]
    for title, key, is_bytes in rows:
        fmt = _human if is_bytes else str
        for pool, label in (("all", title), ("large_pool", "      from large pool"), ("small_pool", "      from small pool")):
            values = [fmt(stats[f"{key}.{pool}.{field}"]) for field in FIELDS]
            lines.append(f"{label:<26}|{values[0]:>12} |{values[1]:>12} |{values[2]:>11} |{values[3]:>10}")
        lines.append("-" * width)
    lines.append(
        f"Largest free block: {_human(stats['tidepool.largest_free_block_bytes'])}   "
        f"Cached free: {_human(stats['tidepool.cached_free_bytes'])}   "
        f"Fragmentation: {100 * stats['tidepool.fragmentation']:.0f} %"
    )
    lines.append(
        f"Device allocs: {stats['num_device_alloc']}   Device frees: {stats['num_device_free']}   "
        f"Alloc retries: {stats['num_alloc_retries']}   OOMs: {stats['num_ooms']}"
    )
    lines.append("=" * width)
    return "\n".join(lines)


def record_memory_history(enabled="all", context="all", stacks="all", max_entries=100_000, clear_history=False):
    """Records allocation history and the Python frames of allocations, as
    torch.cuda.memory._record_memory_history does (same arguments, same
    errors): snapshot() and dump_snapshot() then carry the events as
    device_traces (pytorch.org/memory_viz's timeline) and each allocation's
    frames (memory_viz shows who allocated what).

    enabled: "all" keeps the last max_entries events and frames; "state"
    frames of live allocations only; None stops and forgets the events
    (True and False stand for "all" and None). context: None records no
    frames. stacks: "python" or "all" (tidepool records Python frames in
    both: file, line and function of each frame, for allocations PyTorch
    makes through install() on a Python thread; autograd's backward threads
    have none).
    """
    if isinstance(enabled, bool):
        enabled = "all" if enabled else None
    _torch.check_history_options(enabled, context, stacks)
    if max_entries is None or max_entries < 0:
        raise TidepoolError(f"max_entries must be a non-negative number, not {max_entries!r}")
    lib = _native.lib()
    if clear_history:
        _native.check(lib.tidepool_record_history(0))
    _native.check(lib.tidepool_record_history(min(max_entries, sys.maxsize) if enabled == "all" else 0))
    _record_frames(enabled is not None and context is not None)


def _record_frames(on):
    """Starts or stops capturing Python frames at each PyTorch allocation."""
    if not on:
        if _native.torch_library_present():
            _native.torch_lib().tidepool_torch_set_context_source(None)
        return
    try:
        from . import _stacks
    except ImportError as err:
        raise TidepoolError(
            f"recording Python frames needs the tidepool package built by pip (pip install ./ffi/python): {err}"
        ) from None
    _stacks.bind(_native.function_address("tidepool_register_context"))
    _native.torch_lib().tidepool_torch_set_context_source(_stacks.source_address())


def _torch_record_memory_history(enabled="all", context="all", stacks="all", max_entries=sys.maxsize,
                                 clear_history=False, *_rest):
    """torch._C._cuda_record_memory_history, redirected (the options after
    clear_history concern PyTorch's own allocators)."""
    record_memory_history(enabled, context, stacks, max_entries, clear_history)


def _torch_record_memory_history_legacy(*args, **kwargs):
    """torch._C._cuda_record_memory_history_legacy (enabled as a bool), redirected."""
    enabled, context, stacks, max_entries = _torch.legacy_history_options(*args, **kwargs)
    record_memory_history(enabled, context, stacks, max_entries)


def _torch_memory_snapshot(arg=None):
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


_observers = []
_observers_lock = threading.Lock()
_c_observer = None


def attach_oom_observer(observer):
    """Calls observer(device, bytes requested, device bytes allocated,
    device bytes free) at each out-of-memory, before the error is raised
    (torch._C._cuda_attach_out_of_memory_observer's signature). An observer
    that raises is logged; the out-of-memory error is raised all the same."""
    if not callable(observer):
        raise TypeError(f"an out-of-memory observer must be callable, not {type(observer).__name__}")
    global _c_observer
    with _observers_lock:
        if _c_observer is None:
            callback = _native.OOM_OBSERVER(_notify_observers)
            _native.check(_native.lib().tidepool_attach_oom_observer(callback, None))
            _c_observer = callback  # kept alive: the library calls it
        _observers.append(observer)


def _notify_observers(device, requested, allocated, free, _user):
    for observer in list(_observers):
        try:
            observer(device, requested, allocated, free)
        except Exception:
            _log.exception("an out-of-memory observer raised; the out-of-memory error is raised all the same")


def dump_snapshot(path):
    """Writes a snapshot pickle in PyTorch's schema to path (pytorch.org/memory_viz opens it)."""
    _native.check(_native.lib().tidepool_dump_snapshot(os.fsencode(path)))


class _PlainData(pickle.Unpickler):
    """Loads only plain data: any class or function reference is refused."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}: a snapshot holds plain data only")


def load_snapshot(path):
    """Reads a snapshot pickle (tidepool's or PyTorch's) refusing any global."""
    with open(path, "rb") as f:
        return _PlainData(f).load()


def snapshot():
    """The snapshot as a dict (torch.cuda.memory._snapshot()'s schema)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "snapshot.pickle")
        dump_snapshot(path)
        return load_snapshot(path)
