"""Snapshots of the allocator in PyTorch's schema (pytorch.org/memory_viz
opens them) and the history they carry: snapshot, dump_snapshot,
load_snapshot, and record_memory_history, which records allocation events
(device_traces) and the Python frames of each allocation."""
import os
import pickle
import sys
import tempfile

from . import _native
from ._native import TidepoolError


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
    _check_history_options(enabled, context, stacks)
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


def _check_history_options(enabled, context, stacks):
    """PyTorch's checks of _record_memory_history's options, with its messages."""
    if enabled not in (None, "state", "all"):
        raise RuntimeError("expected state to be 'state', 'all', or None")
    if context not in (None, "state", "alloc", "all"):
        raise RuntimeError("expected context to be 'state', 'alloc', 'all', or None")
    if stacks not in ("python", "all"):
        raise RuntimeError("expected stacks to be 'python', or 'all'")
