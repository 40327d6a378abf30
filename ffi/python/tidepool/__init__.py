"""tidepool: a CUDA caching allocator that gives memory back, for PyTorch.

install() makes PyTorch allocate through tidepool; memory_stats() and the
functions beside it answer what torch.cuda's memory functions answer, which
PyTorch cannot with a pluggable allocator.
"""
import os
import pickle
import tempfile

from . import _native
from ._native import GAUGES, POOLS, FIELDS, TidepoolError, library_path

__all__ = [
    "install",
    "mempool",
    "memory_stats",
    "memory_allocated",
    "max_memory_allocated",
    "memory_reserved",
    "max_memory_reserved",
    "memory_summary",
    "empty_cache",
    "snapshot",
    "dump_snapshot",
    "record_memory_history",
    "library_path",
    "TidepoolError",
]

_plug = None


def _pluggable(torch):
    """One CUDAPluggableAllocator over the library with every hook set."""
    global _plug
    if _plug is None:
        plug = torch.cuda.memory.CUDAPluggableAllocator(library_path(), "tidepool_malloc", "tidepool_free")
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
    for entry in (conf or "").split(","):
        key, _, value = entry.partition(":")
        if key.strip() == "backend":
            return value.strip()
    return DEFAULT_BACKEND


def install(conf=None, allow_host=False):
    """Makes tidepool PyTorch's CUDA allocator. Call it first thing: PyTorch
    can only switch allocators before CUDA is initialised.

    conf: a TIDEPOOL_CONF string ("max_split_size_mb:256,..."); it sets the
    environment variable the library reads when it starts.
    allow_host: let the `host` backend (host memory standing in for a GPU)
    serve PyTorch. Its memory is not device memory, so CUDA kernels cannot
    use it: only for testing the wiring.
    """
    import torch

    effective = conf if conf is not None else os.environ.get("TIDEPOOL_CONF", "")
    if _backend(effective) == "host" and not allow_host:
        raise TidepoolError(
            "tidepool's backend is 'host' (host memory standing in for a GPU), which CUDA kernels cannot use: "
            "use backend:cuda (the default) in TIDEPOOL_CONF"
        )
    if torch.cuda.is_initialized():
        raise TidepoolError(
            "CUDA is already initialised, so PyTorch can no longer change its allocator: "
            "call tidepool.install() first thing, before any tensor or model touches the GPU"
        )
    if conf is not None:
        os.environ["TIDEPOOL_CONF"] = conf
    torch.cuda.memory.change_current_allocator(_pluggable(torch))


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
    if device is None:
        try:
            import torch

            return torch.cuda.current_device() if torch.cuda.is_initialized() else 0
        except ImportError:
            return 0
    if hasattr(device, "index"):  # a torch.device
        return device.index or 0
    return int(device)


def memory_stats(device=None):
    """A dict with torch.cuda.memory_stats' keys and meanings
    ("allocated_bytes.all.current", "num_ooms", ...) plus tidepool's own
    under "tidepool.*"."""
    s = _native.get_stats(_device(device))
    out = {}
    for gauge_name, gauge in zip(GAUGES, s.gauges):
        for pool in POOLS:
            stat = getattr(gauge, pool)
            for field in FIELDS:
                out[f"{gauge_name}.{pool}.{field}"] = getattr(stat, field)
    out["num_alloc_retries"] = s.num_alloc_retries
    out["num_ooms"] = s.num_ooms
    out["num_device_alloc"] = s.num_device_allocs
    out["num_device_free"] = s.num_device_frees
    out["num_sync_all_streams"] = 0  # tidepool never synchronizes every stream
    cached = s.cached_free_bytes
    out["tidepool.cached_free_bytes"] = cached
    out["tidepool.largest_free_block_bytes"] = s.largest_free_block_bytes
    out["tidepool.external_fragmentation"] = (1.0 - s.largest_free_block_bytes / cached) if cached else 0.0
    out["tidepool.num_allocs"] = s.num_allocs
    out["tidepool.num_frees"] = s.num_frees
    out["tidepool.num_invalid_frees"] = s.num_invalid_frees
    out["tidepool.num_size_mismatches"] = s.num_size_mismatches
    out["tidepool.reserved_limit_bytes"] = s.reserved_limit_bytes
    for reason in _native.RELEASE_REASONS:
        out[f"tidepool.released_bytes.{reason}"] = getattr(s, f"released_{reason}_bytes")
    out["tidepool.num_reclaims"] = s.num_reclaims
    for key in ("num_coop_requests", "num_coop_satisfied", "num_coop_served", "num_pages_mapped", "num_pages_unmapped"):
        out[f"tidepool.{key}"] = getattr(s, key)
    return dict(sorted(out.items()))


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
        f"Fragmentation: {100 * stats['tidepool.external_fragmentation']:.0f} %"
    )
    lines.append(
        f"Device allocs: {stats['num_device_alloc']}   Device frees: {stats['num_device_free']}   "
        f"Alloc retries: {stats['num_alloc_retries']}   OOMs: {stats['num_ooms']}"
    )
    lines.append("=" * width)
    return "\n".join(lines)


def record_memory_history(enabled=True, max_entries=100_000):
    """Keeps the last max_entries allocation and segment events of every
    device (torch.cuda.memory._record_memory_history's counterpart): then
    snapshot() and dump_snapshot() carry them as device_traces, and
    pytorch.org/memory_viz draws the memory timeline. enabled=False (or
    None) stops and forgets them."""
    entries = max_entries if enabled else 0
    if entries is None or entries < 0:
        raise TidepoolError(f"max_entries must be a non-negative number, not {max_entries!r}")
    if _native.lib().tidepool_record_history(entries) != _native.OK:
        raise TidepoolError(_native.last_error())


def dump_snapshot(path):
    """Writes a snapshot pickle in PyTorch's schema to path (pytorch.org/memory_viz opens it)."""
    rc = _native.lib().tidepool_dump_snapshot(os.fsencode(path))
    if rc != _native.OK:
        raise TidepoolError(_native.last_error())


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
