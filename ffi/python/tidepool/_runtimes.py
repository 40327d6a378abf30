"""What tidepool.cupy and tidepool.numba share: starting the library with
its configuration checked (as install() does for PyTorch), one allocation
and one free through the C ABI, and telling an out of memory from a bad
argument when tidepool_malloc returns NULL."""
from . import _native
from ._install import check_and_set, refuse_host
from ._native import TidepoolError

# The first words of every out-of-memory report (docs/oom.md).
OOM_PREFIX = "tidepool: out of memory"


def start(conf, allow_host, who):
    """Starts the library for runtime `who` (its entry point, for the
    messages) as install() does for PyTorch: the host backend refused unless
    allow_host, the configuration (`conf`, else the environment's) checked
    and used when the library has not started yet. When tidepool already
    runs (under PyTorch, say) it is the one allocator both share."""
    refuse_host(conf, allow_host, "allow_host=True")
    check_and_set(conf, f"{who}({conf!r})")
    _native.lib()


class OutOfMemory(Exception):
    """tidepool_malloc found no memory; `report` is tidepool's report."""

    def __init__(self, size, device, report):
        super().__init__(report)
        self.size = size
        self.device = device
        self.report = report


def allocate(size, device, stream):
    """`size` (> 0) bytes on `device` for `stream` (an int handle, 0: the
    legacy default stream): the address. Raises OutOfMemory with tidepool's
    report, or TidepoolError with the library's message (a bad device)."""
    ptr = _native.lib().tidepool_malloc(size, device, stream or None)
    if ptr:
        return ptr
    message = _native.last_error()
    if message.startswith(OOM_PREFIX):
        raise OutOfMemory(size, device, message)
    raise TidepoolError(message or f"tidepool_malloc({size}, device {device}) failed")


def free(ptr, size, device, stream):
    """Gives back what allocate(size, device, stream) returned."""
    _native.lib().tidepool_free(ptr, size, device, stream or None)


def usage(device):
    """(allocated, limit) on `device` from tidepool's statistics: the bytes
    of live allocations and the cap on reserved memory (0: none)."""
    stats = _native.get_stats(device)
    return stats.allocated_bytes, (stats.reserved_limit_bytes if stats.has_reserved_limit else 0)


def memory_info(device, driver_free, driver_total):
    """(free, total) for a runtime that allocates through tidepool, from the
    driver's answer for the device (cuMemGetInfo) and tidepool's statistics:
    what tidepool holds but nothing uses (its cached free bytes) is free to
    the runtime too, and a cap on reserved memory (max_reserved_mb, a memory
    fraction) bounds both figures."""
    stats = _native.get_stats(device)
    free_bytes = driver_free + stats.cached_free_bytes
    total = driver_total
    if stats.has_reserved_limit:
        limit = stats.reserved_limit_bytes
        in_use = stats.reserved_bytes - stats.cached_free_bytes
        free_bytes = min(free_bytes, max(0, limit - in_use))
        total = min(total, limit)
    return min(free_bytes, total), total
