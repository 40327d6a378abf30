"""tidepool: a CUDA caching allocator that gives memory back, for PyTorch.

install() makes PyTorch allocate through tidepool: an out-of-memory raises
at the call that allocated, and torch.cuda's memory functions
(memory_stats, max_memory_allocated, memory_summary, _snapshot,
_record_memory_history, ...) answer from tidepool. The functions of this
module answer the same without torch.

This module only gathers names; each module owns one part:
- _install.py: install, uninstall, mempool (tidepool as PyTorch's allocator);
- _torch.py: torch.cuda's memory functions pointed at tidepool's;
- _memory.py: memory_stats and the other statistics, their resets,
  memory_summary, empty_cache;
- _snapshots.py: snapshot, dump_snapshot, load_snapshot, record_memory_history;
- _observers.py: attach_oom_observer;
- tags.py: region, pause, resume, tag_stats (sleep and wake);
- _devices.py: what a `device` argument means;
- _native.py: the ctypes bindings of libtidepool.so, library_path, TidepoolError;
- _units.py: bytes written for people (memory_summary's, the planner's).
The planner, which never touches the library, is the subpackage
tidepool.plan (`python -m tidepool.plan`). The modules' layers, lowest
first, and the rule that none imports upward or in a circle:
ffi/python/tests/test_layers.py.
"""
from ._install import DEFAULT_BACKEND, install, mempool, uninstall
from ._memory import (
    empty_cache,
    max_memory_allocated,
    max_memory_reserved,
    memory_allocated,
    memory_reserved,
    memory_stats,
    memory_stats_as_nested_dict,
    memory_summary,
    reset_accumulated_memory_stats,
    reset_max_memory_allocated,
    reset_peak_memory_stats,
)
from ._native import FIELDS, GAUGES, POOLS, TidepoolError, library_path
from ._observers import attach_oom_observer
from ._snapshots import dump_snapshot, load_snapshot, record_memory_history, snapshot
from .tags import pause, region, resume, tag_stats

# What `from tidepool import *` takes; load_snapshot, DEFAULT_BACKEND,
# GAUGES, POOLS and FIELDS are importable from tidepool too, as before.
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
