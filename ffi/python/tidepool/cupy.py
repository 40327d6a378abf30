"""tidepool as CuPy's allocator.

    import tidepool.cupy
    tidepool.cupy.use()                       # or: cupy.cuda.set_allocator(tidepool.cupy.malloc)

Every CuPy array (and every buffer CuPy's kernels, cuBLAS workspaces and
reductions ask for) then comes from tidepool, on CuPy's current device and
for its current stream, and goes back to tidepool when CuPy drops it: the
same cache, statistics, out-of-memory report and release of idle memory
that PyTorch gets through tidepool.install(), shared with PyTorch when both
run in one process.

malloc(size) is what cupy.cuda.set_allocator takes: it returns a
cupy.cuda.MemoryPointer over a cupy.cuda.UnownedMemory whose owner frees the
block through tidepool (with its size, device and stream) when CuPy lets the
last reference go. An allocation tidepool cannot serve raises
tidepool.cupy.OutOfMemoryError, a cupy.cuda.memory.OutOfMemoryError whose
message carries tidepool's report (docs/oom.md).
"""
try:
    import cupy as _cupy
    from cupy.cuda import memory as _cupy_memory
except ImportError as err:  # pragma: no cover - depends on the environment
    raise ImportError(
        "tidepool.cupy needs CuPy: pip install cupy-cuda13x (or cupy-cuda12x, for the CUDA major your driver runs)"
    ) from err

from . import _runtimes

__all__ = ["malloc", "use", "OutOfMemoryError"]


class OutOfMemoryError(_cupy_memory.OutOfMemoryError):
    """cupy.cuda.memory.OutOfMemoryError with tidepool's report: `except
    cupy.cuda.memory.OutOfMemoryError` catches it. report: tidepool's
    out-of-memory report (what was asked, allocated, reserved, cached and
    free on the device, and what to do)."""

    def __init__(self, size, total, limit=0, report=""):
        super().__init__(size, total, limit)
        self.report = report
        if report:
            self.args = (f"{self.args[0]} {report}",)

    def __reduce__(self):
        return (type(self), (self._size, self._total, self._limit, self.report))


class _Block:
    """The owner of one tidepool block under a cupy.cuda.UnownedMemory:
    frees it through tidepool when CuPy drops the memory. It holds the CuPy
    stream the block was allocated for, so that the stream outlives the
    block (tidepool reuses a block on its stream, and may wait on it)."""

    __slots__ = ("ptr", "size", "device", "stream", "__weakref__")

    def __init__(self, ptr, size, device, stream):
        self.ptr = ptr
        self.size = size
        self.device = device
        self.stream = stream

    def __del__(self):
        # (At interpreter exit the module's globals may be gone already.)
        if self.ptr and _runtimes is not None:
            ptr, self.ptr = self.ptr, 0
            _runtimes.free(ptr, self.size, self.device, _stream_handle(self.stream))


def _stream_handle(stream):
    return stream if isinstance(stream, int) else stream.ptr


def malloc_on(size, device, stream):
    """malloc's work, with the device (an index) and stream (a
    cupy.cuda.Stream, or an int handle: 0 is the legacy default stream)
    given rather than read from CuPy: a cupy.cuda.MemoryPointer over
    `size` bytes of tidepool's memory. Reading CuPy's current device and
    stream is the only part of malloc that needs a GPU."""
    size = int(size)
    if size == 0:
        # tidepool_malloc answers NULL for 0 bytes; CuPy's own allocator
        # makes 0-byte memory at address 0 (its UnownedMemory needs the
        # device given for a null pointer).
        return _cupy_memory.MemoryPointer(_cupy_memory.UnownedMemory(0, 0, None, device), 0)
    try:
        ptr = _runtimes.allocate(size, device, _stream_handle(stream))
    except _runtimes.OutOfMemory as oom:
        allocated, limit = _runtimes.usage(device)
        raise OutOfMemoryError(size, allocated, limit, oom.report) from None
    owner = _Block(ptr, size, device, stream)
    return _cupy_memory.MemoryPointer(_cupy_memory.UnownedMemory(ptr, size, owner, device), 0)


def malloc(size):
    """CuPy's allocator interface (cupy.cuda.set_allocator(malloc)): `size`
    bytes from tidepool on CuPy's current device, for its current stream."""
    return malloc_on(size, _cupy.cuda.runtime.getDevice(), _cupy.cuda.get_current_stream())


def use(conf=None, allow_host=False):
    """Makes tidepool CuPy's allocator for every thread
    (cupy.cuda.set_allocator(malloc)); CuPy's own memory pool stops being
    used for new arrays (what it holds stays until
    cupy.get_default_memory_pool().free_all_blocks()).

    conf: a TIDEPOOL_CONF string, checked now and used when tidepool starts
    (ignored if tidepool already runs in this process, e.g. under PyTorch:
    one allocator serves both). allow_host: let the host backend (host
    memory, which CUDA kernels cannot use) serve CuPy: only for testing the
    wiring."""
    _runtimes.start(conf, allow_host, "tidepool.cupy.use")
    _cupy.cuda.set_allocator(malloc)
