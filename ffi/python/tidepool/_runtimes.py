"""What tidepool.cupy and tidepool.numba share: checking the configuration
before the library starts (as install() does for PyTorch), one allocation
and one free through the C ABI, and telling an out of memory from a bad
argument when tidepool_malloc returns NULL."""
import os

from . import _native
from ._native import TidepoolError

# The first words of every out-of-memory report (docs/oom.md).
OOM_PREFIX = "tidepool: out of memory"


def backend_of(conf):
    """The backend a TIDEPOOL_CONF string selects (the last entry wins, as
    the library reads them; none: the default, cuda)."""
    from ._install import _backend

    return _backend(conf)


def configure(conf, allow_host, who):
    """Checks the configuration `who` (the runtime's entry point, for the
    messages) was given, else the environment's, and sets TIDEPOOL_CONF
    when the library has not started yet; refuses the host backend unless
    allow_host. Warns nothing when tidepool already runs: the runtimes share
    one allocator with PyTorch, whichever started it."""
    effective = conf if conf is not None else os.environ.get("TIDEPOOL_CONF", "")
    if backend_of(effective) == "host" and not allow_host:
        raise TidepoolError(
            f"{who}: tidepool's backend is 'host' (host memory standing in for a GPU), which CUDA kernels "
            "cannot use: use backend:cuda (the default) in TIDEPOOL_CONF, or allow_host=True to test the wiring"
        )
    if _native.loaded():
        return
    checked = conf if conf is not None else os.environb.get(b"TIDEPOOL_CONF", b"")
    problems = _native.conf_problems(checked)
    if problems:
        where = f"{who}({conf!r})" if conf is not None else "TIDEPOOL_CONF"
        raise TidepoolError(f"{where}: " + "; ".join(problems) + " (tidepool config lists the options)")
    if conf is not None:
        os.environ["TIDEPOOL_CONF"] = conf


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
