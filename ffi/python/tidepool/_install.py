"""tidepool as PyTorch's CUDA allocator: install() hands PyTorch one
CUDAPluggableAllocator over the library with every hook set and points
torch.cuda's memory functions at tidepool's (_torch.py); uninstall() gives
those functions back; mempool() is a torch.cuda.MemPool served by tidepool."""
import os
import warnings

from . import _native, _torch
from ._native import TidepoolError

# The CUDAPluggableAllocator handed to PyTorch (made once, by _pluggable).
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


def refuse_host(conf, allow_host, how):
    """Raises TidepoolError when the configuration (`conf`, else the
    environment's) selects the host backend and allow_host is not set:
    CUDA kernels cannot use host memory. `how` says where allow_host=True
    is given, for the message."""
    effective = conf if conf is not None else os.environ.get("TIDEPOOL_CONF", "")
    if _backend(effective) == "host" and not allow_host:
        raise TidepoolError(
            "tidepool's backend is 'host' (host memory standing in for a GPU), which CUDA kernels cannot use: "
            f"use backend:cuda (the default) in TIDEPOOL_CONF, or {how} to test the wiring"
        )


def check_and_set(conf, where):
    """Before the library starts: checks the configuration (`conf`, else the
    environment's), raising TidepoolError worded as the library's warnings
    are (`where` names what was given it), and sets `conf` as TIDEPOOL_CONF,
    which the library reads when it starts. Nothing once it has started."""
    if _native.loaded():
        return
    checked = conf if conf is not None else os.environb.get(b"TIDEPOOL_CONF", b"")
    problems = _native.conf_problems(checked)
    if problems:
        raise TidepoolError(f"{where if conf is not None else 'TIDEPOOL_CONF'}: " + "; ".join(problems) + " (tidepool config lists the options)")
    if conf is not None:
        os.environ["TIDEPOOL_CONF"] = conf


def install(conf=None, allow_host=False):
    """Makes tidepool PyTorch's CUDA allocator. Call it first thing: PyTorch
    can only switch allocators before CUDA is initialised.

    Afterwards an allocation tidepool cannot serve raises RuntimeError("CUDA
    out of memory. ...") where it was made, and torch.cuda's memory
    functions answer from tidepool (see _torch.py for which, and how).

    conf: a TIDEPOOL_CONF string ("max_split_size_mb:256,..."); it sets the
    environment variable the library reads when it starts. The
    configuration (this one, else the environment's TIDEPOOL_CONF) is
    checked first: a problem raises TidepoolError, worded as the library's
    warnings are.
    allow_host: let the `host` backend (host memory standing in for a GPU)
    serve PyTorch. Its memory is not device memory, so CUDA kernels cannot
    use it: only for testing the wiring.
    """
    import torch

    global _installed
    refuse_host(conf, allow_host, "install(..., allow_host=True)")
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
        _torch.redirect(torch)
        return
    if torch.cuda.is_initialized():
        raise TidepoolError(
            "CUDA is already initialised, so PyTorch can no longer change its allocator: "
            "call tidepool.install() first thing, before any tensor or model touches the GPU"
        )
    # Checked here, where the mistake is made, not at the first allocation.
    check_and_set(conf, f"tidepool.install({conf!r})")
    torch.cuda.memory.change_current_allocator(_pluggable(torch))
    _installed = True
    _torch.redirect(torch)


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
