"""tidepool as Numba's CUDA memory manager (an EMM plugin, numba-cuda's
External Memory Management interface, version 1).

    from numba import cuda
    import tidepool.numba
    cuda.set_memory_manager(tidepool.numba.TidepoolMemoryManager)   # before the first CUDA call

or, with no change to the program, NUMBA_CUDA_MEMORY_MANAGER=tidepool.numba
in the environment (Numba imports the module and takes its
_numba_memory_manager).

Every device array Numba allocates (cuda.device_array, to_device, the
arrays kernels are given from host data) then comes from tidepool, on the
context's device, for the default stream Numba's allocations belong to,
and goes back to tidepool when Numba lets it go. Pinned and mapped host
memory stay Numba's own (HostOnlyCUDAMemoryManager). An allocation tidepool
cannot serve raises numba's CudaAPIError with CUDA_ERROR_OUT_OF_MEMORY and
tidepool's report as its message (what Numba's own manager raises, after
tidepool released its cache and retried).
"""
import contextlib
import weakref

try:
    from numba import cuda as _cuda
    from numba.cuda.cudadrv import driver as _driver
except ImportError as err:  # pragma: no cover - depends on the environment
    raise ImportError("tidepool.numba needs numba-cuda: pip install numba-cuda[cu13] (or [cu12])") from err

from . import _native, _runtimes

__all__ = ["TidepoolMemoryManager", "IpcNotSupported"]

# CU_STREAM_PER_THREAD: the per-thread default stream's handle.
_PER_THREAD_STREAM = 2


class IpcNotSupported(RuntimeError):
    """get_ipc_handle on memory CUDA's legacy IPC cannot share."""


def _default_stream():
    """The handle of the default stream Numba's allocations belong to:
    per-thread when NUMBA_CUDA_PER_THREAD_DEFAULT_STREAM=1, else the legacy
    one (0)."""
    from numba.cuda.core import config

    return _PER_THREAD_STREAM if config.CUDA_PER_THREAD_DEFAULT_STREAM else 0


class _Deferred:
    """The device frees cuda.defer_cleanup() holds back: how many defers
    are active, and the blocks (ptr, size, device, stream) waiting. Shared
    by a manager and its pointers' finalizers (which must not keep the
    manager alive)."""

    __slots__ = ("depth", "pending")

    def __init__(self):
        self.depth = 0
        self.pending = []

    def free(self, ptr, size, device, stream):
        if self.depth:
            self.pending.append((ptr, size, device, stream))
        else:
            _runtimes.free(ptr, size, device, stream)

    def flush(self):
        while self.pending and not self.depth:
            _runtimes.free(*self.pending.pop())


def _finalizer(deferred, ptr, size, device, stream):
    """Frees the block through tidepool when Numba drops its pointer; inside
    cuda.defer_cleanup() the free waits until the outermost defer ends
    (what Numba promises for its own memory)."""

    def free():
        deferred.free(ptr, size, device, stream)

    return free


class TidepoolMemoryManager(_cuda.GetIpcHandleMixin, _cuda.HostOnlyCUDAMemoryManager):
    """Numba's EMM plugin over tidepool. Select it before Numba creates a
    context: numba.cuda.set_memory_manager(TidepoolMemoryManager), or
    NUMBA_CUDA_MEMORY_MANAGER=tidepool.numba.

    Numba makes one per context (the device's primary context, which
    tidepool allocates in as well); set_memory_manager makes one with
    context=None only to read interface_version."""

    # Whether the host backend (host memory standing in for a GPU, which
    # kernels cannot use) may serve Numba: only to test the wiring.
    allow_host = False

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._stream = _default_stream()
        self._deferred = _Deferred()

    @property
    def device(self):
        """The index of the context's device (0 without a context)."""
        return int(self.context.device.id) if self.context is not None else 0

    def initialize(self):
        """Starts tidepool (reading TIDEPOOL_CONF; the host backend is
        refused unless allow_host, its memory being no device memory) and sizes Numba's queue
        of deferred host frees from the device's memory, as Numba's own
        manager does."""
        _runtimes.start(None, self.allow_host, "tidepool.numba")
        if self.deallocations.memory_capacity == 0 and self.context is not None:
            self.deallocations.memory_capacity = self.get_memory_info().total

    def memalloc(self, size):
        """`size` bytes from tidepool on the context's device, as a
        numba.cuda.MemoryPointer whose finalizer frees them through
        tidepool."""
        size = int(size)
        device = self.device
        if size == 0:
            # tidepool answers NULL for 0 bytes: a null pointer of size 0,
            # which Numba's views and copies accept.
            return _cuda.MemoryPointer(self._weak_context(), 0, 0)
        stream = self._stream
        try:
            ptr = _runtimes.allocate(size, device, stream)
        except _runtimes.OutOfMemory as oom:
            # tidepool released its cache and retried before failing. Unlike
            # Numba's own manager, no flush of Numba's deferred frees and
            # retry: that queue holds none of tidepool's memory, and a free
            # held back by defer_cleanup must stay held.
            raise _driver.CudaAPIError(_driver.binding.CUresult.CUDA_ERROR_OUT_OF_MEMORY, oom.report) from None
        finalizer = _finalizer(self._deferred, ptr, size, device, stream)
        return _cuda.MemoryPointer(self._weak_context(), ptr, size, finalizer=finalizer)

    def _weak_context(self):
        return weakref.proxy(self.context) if self.context is not None else None

    def get_memory_info(self):
        """(free, total) of the device as Numba's allocations see it: the
        driver's free memory plus what tidepool caches unused (free to
        Numba through tidepool), both bounded by tidepool's cap on reserved
        memory when one is set."""
        driver_free, driver_total = _driver.driver.cuMemGetInfo()
        free, total = _runtimes.memory_info(self.device, int(driver_free), int(driver_total))
        return _cuda.MemoryInfo(free=free, total=total)

    def get_ipc_handle(self, memory):
        """An IPC handle for `memory`, by CUDA's legacy IPC (cuIpcGetMemHandle
        on the base of its segment), which only shares memory from
        cuMemAlloc: tidepool's whole segments (expandable:false). Memory of
        an expandable segment (tidepool's default: pages from cuMemCreate
        mapped into reserved addresses) raises IpcNotSupported."""
        ptr = int(memory.device_pointer_value or 0)
        segment = _segment_of(ptr)
        if segment is not None and segment.get("is_expandable"):
            raise IpcNotSupported(
                "tidepool.numba: this array lies in an expandable segment (tidepool's default: pages from "
                "cuMemCreate), which CUDA's legacy IPC (cuIpcGetMemHandle, what Numba's get_ipc_handle uses) "
                "cannot share; set TIDEPOOL_CONF=expandable:false for memory shared by IPC"
            )
        return super().get_ipc_handle(memory)

    def reset(self):
        """Numba's reset of the context (cuda.close(), a device reset):
        Numba's host allocations and pending frees are cleared, the
        device frees held back by a defer are done, then tidepool's cache is
        emptied (every whole free segment goes back to the driver)."""
        super().reset()
        self._deferred.depth = 0
        self._deferred.flush()
        _native.lib().tidepool_empty_cache()

    @contextlib.contextmanager
    def defer_cleanup(self):
        """While active, frees of device memory (and of Numba's host
        memory) wait; when the outermost one ends they are done."""
        self._deferred.depth += 1
        try:
            with super().defer_cleanup():
                yield
        finally:
            self._deferred.depth -= 1
            self._deferred.flush()  # does nothing while an outer defer is active

    @property
    def interface_version(self):
        return 1


def _segment_of(ptr):
    """The snapshot's segment that holds `ptr` (None: none does)."""
    from ._snapshots import snapshot

    for segment in snapshot()["segments"]:
        if segment["address"] <= ptr < segment["address"] + segment["total_size"]:
            return segment
    return None


# What NUMBA_CUDA_MEMORY_MANAGER=tidepool.numba makes Numba use.
_numba_memory_manager = TidepoolMemoryManager
