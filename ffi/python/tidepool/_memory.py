"""torch.cuda's memory functions, answered from tidepool's statistics:
memory_stats and its nested form (PyTorch's keys, tidepool's own under
"tidepool"), memory_allocated, max_memory_allocated, memory_reserved,
max_memory_reserved, the resets of peaks and accumulated figures,
memory_summary and empty_cache. `device` is as torch.cuda takes it
(_devices.py)."""
from . import _native
from ._devices import device_index
from ._native import FIELDS, GAUGES, POOLS
from ._units import human_bytes


def memory_stats_as_nested_dict(device=None):
    """torch.cuda.memory_stats_as_nested_dict's answer from tidepool: each
    gauge as {"all"|"small_pool"|"large_pool": {"current", "peak",
    "allocated", "freed"}}, PyTorch's event counters, and tidepool's own
    figures under "tidepool"."""
    s = _native.get_stats(device_index(device))
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
        # A limit only when has_reserved_limit is 1 (a limit of 0 B included).
        "reserved_limit_bytes": s.reserved_limit_bytes,
        "has_reserved_limit": s.has_reserved_limit,
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
    _native.check(_native.lib().tidepool_reset_peak_stats(device_index(device)))


def reset_max_memory_allocated(device=None):
    """torch.cuda.reset_max_memory_allocated: resets every peak, as PyTorch does."""
    reset_peak_memory_stats(device)


def reset_accumulated_memory_stats(device=None):
    """Zeroes the accumulated figures of `device` ("allocated", "freed",
    num_ooms, ...) (torch.cuda.reset_accumulated_memory_stats)."""
    _native.check(_native.lib().tidepool_reset_accumulated_stats(device_index(device)))


def memory_allocated(device=None):
    return _native.get_stats(device_index(device)).allocated_bytes


def max_memory_allocated(device=None):
    return _native.get_stats(device_index(device)).peak_allocated_bytes


def memory_reserved(device=None):
    return _native.get_stats(device_index(device)).reserved_bytes


def max_memory_reserved(device=None):
    return _native.get_stats(device_index(device)).peak_reserved_bytes


def empty_cache():
    """Returns every whole free segment to the driver."""
    _native.lib().tidepool_empty_cache()


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
        f" tidepool memory summary, device {device_index(device)}".ljust(width),
        "-" * width,
        f"{'Metric':<26}|{'Cur Usage':>12} |{'Peak Usage':>12} |{'Tot Alloc':>11} |{'Tot Freed':>10}",
        "-" * width,
    ]
    for title, key, is_bytes in rows:
        fmt = human_bytes if is_bytes else str
        for pool, label in (("all", title), ("large_pool", "      from large pool"), ("small_pool", "      from small pool")):
            values = [fmt(stats[f"{key}.{pool}.{field}"]) for field in FIELDS]
            lines.append(f"{label:<26}|{values[0]:>12} |{values[1]:>12} |{values[2]:>11} |{values[3]:>10}")
        lines.append("-" * width)
    lines.append(
        f"Largest free block: {human_bytes(stats['tidepool.largest_free_block_bytes'])}   "
        f"Cached free: {human_bytes(stats['tidepool.cached_free_bytes'])}   "
        f"Fragmentation: {100 * stats['tidepool.fragmentation']:.0f} %"
    )
    lines.append(
        f"Device allocs: {stats['num_device_alloc']}   Device frees: {stats['num_device_free']}   "
        f"Alloc retries: {stats['num_alloc_retries']}   OOMs: {stats['num_ooms']}"
    )
    lines.append("=" * width)
    return "\n".join(lines)
