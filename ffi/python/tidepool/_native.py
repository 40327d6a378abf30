"""ctypes bindings of libtidepool.so (ffi/tidepool.h), loaded once."""
import ctypes
import os
import pathlib

# Order of tidepool_stats.gauges, as torch.cuda.memory_stats names them.
GAUGES = (
    "allocation",
    "segment",
    "active",
    "inactive_split",
    "allocated_bytes",
    "reserved_bytes",
    "active_bytes",
    "inactive_split_bytes",
    "requested_bytes",
)
POOLS = ("all", "small_pool", "large_pool")
# Why memory went back to the driver, as tidepool_stats names it.
RELEASE_REASONS = ("idle_decay", "budget", "headroom", "out_of_memory", "empty_cache", "cooperation")
FIELDS = ("current", "peak", "allocated", "freed")
# The event counters, as src/stats.rs lists them (Events::COUNTERS): the key
# memory_stats gives each (PyTorch's name, or tidepool.*) and its field in
# tidepool_stats. tests/cabi/header.rs checks this list, Stats below and
# GAUGES above against the library's.
COUNTERS = (
    ("num_device_alloc", "num_device_allocs"),
    ("num_device_free", "num_device_frees"),
    ("num_alloc_retries", "num_alloc_retries"),
    ("num_ooms", "num_ooms"),
    ("tidepool.num_invalid_frees", "num_invalid_frees"),
    ("tidepool.num_size_mismatches", "num_size_mismatches"),
    ("tidepool.num_reclaims", "num_reclaims"),
    ("tidepool.num_coop_requests", "num_coop_requests"),
    ("tidepool.num_coop_satisfied", "num_coop_satisfied"),
    ("tidepool.num_coop_served", "num_coop_served"),
    ("tidepool.coop_last_wait_ms", "coop_last_wait_ms"),
    ("tidepool.num_stream_sync_errors", "num_stream_sync_errors"),
    ("tidepool.num_cross_stream_reuses", "num_cross_stream_reuses"),
    ("tidepool.num_pages_mapped", "num_pages_mapped"),
    ("tidepool.num_pages_unmapped", "num_pages_unmapped"),
    ("tidepool.num_driver_calls", "num_driver_calls"),
)

OK = 0
ERR_INVALID_ARGUMENT = 1
ERR_INVALID_DEVICE = 2
ERR_INTERNAL = 3
ERR_IO = 4
ERR_TAG_STATE = 5
ERR_OUT_OF_MEMORY = 6
PAUSE_OFFLOAD = 1
STATS_VERSION = 7
TAG_STATS_VERSION = 1


class Stat(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in FIELDS]


class StatByPool(ctypes.Structure):
    _fields_ = [(name, Stat) for name in POOLS]


class Stats(ctypes.Structure):
    _fields_ = [("size", ctypes.c_uint32), ("version", ctypes.c_uint32)] + [
        (name, ctypes.c_uint64)
        for name in (
            "allocated_bytes",
            "peak_allocated_bytes",
            "requested_bytes",
            "peak_requested_bytes",
            "reserved_bytes",
            "peak_reserved_bytes",
            "active_bytes",
            "peak_active_bytes",
            "inactive_split_bytes",
            "peak_inactive_split_bytes",
            "largest_free_block_bytes",
            "cached_free_bytes",
            "num_allocs",
            "num_frees",
            "num_device_allocs",
            "num_device_frees",
            "num_alloc_retries",
            "num_ooms",
            "num_invalid_frees",
            "num_size_mismatches",
            "reserved_limit_bytes",
        )
    ] + [("gauges", StatByPool * len(GAUGES))] + [
        (name, ctypes.c_uint64)
        for name in (
            "released_idle_decay_bytes",
            "released_budget_bytes",
            "released_headroom_bytes",
            "released_out_of_memory_bytes",
            "released_empty_cache_bytes",
            "num_reclaims",
            "released_cooperation_bytes",
            "num_coop_requests",
            "num_coop_satisfied",
            "num_coop_served",
            "num_pages_mapped",
            "num_pages_unmapped",
            "paused_bytes",
            "offloaded_bytes",
            # Version 5.
            "coop_last_wait_ms",
            "num_stream_sync_errors",
            "num_cross_stream_reuses",
            # Version 6.
            "has_reserved_limit",
            # Version 7.
            "num_driver_calls",
        )
    ]


class TagStats(ctypes.Structure):
    _fields_ = [("size", ctypes.c_uint32), ("version", ctypes.c_uint32)] + [
        (name, ctypes.c_uint64)
        for name in ("allocated_bytes", "reserved_bytes", "paused_bytes", "offloaded_bytes", "num_allocations", "paused")
    ]


# void (*)(int device, size_t requested, size_t device_allocated, size_t device_free, void* user)
OOM_OBSERVER = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_void_p)


class TidepoolError(RuntimeError):
    """A call into libtidepool failed; the message is the library's."""


PACKAGE_DIR = pathlib.Path(__file__).resolve().parent


def _packaged(stem):
    """The library `stem` the package was built with (setuptools may name it
    stem.so or stem.cpython-*.so), or None."""
    for candidate in sorted(PACKAGE_DIR.glob(f"{stem}.*so")):
        return candidate
    return None


def library_path():
    """Where libtidepool.so is: $TIDEPOOL_LIBRARY, the one built into this
    package, or the release build of a source checkout."""
    explicit = os.environ.get("TIDEPOOL_LIBRARY")
    if explicit:
        if not os.path.exists(explicit):
            raise TidepoolError(f"TIDEPOOL_LIBRARY={explicit} does not exist")
        return explicit
    # A source checkout: ffi/python/tidepool/ is three levels below its root.
    checkout = PACKAGE_DIR.parents[2] if len(PACKAGE_DIR.parents) > 2 else None
    built = checkout / "target" / "release" / "libtidepool.so" if checkout else None
    for candidate in (_packaged("libtidepool"), built):
        if candidate is not None and candidate.exists():
            return str(candidate)
    raise TidepoolError(
        "libtidepool.so not found: install the package with pip (pip install ./ffi/python builds it), "
        "or set TIDEPOOL_LIBRARY to a libtidepool.so built with cargo build --release"
    )


def torch_library_path():
    """Where libtidepool_torch.so (the entry points PyTorch calls) is: built
    into this package."""
    found = _packaged("libtidepool_torch")
    if found is None:
        raise TidepoolError(
            "libtidepool_torch.so not found: this tidepool package was not built by pip; "
            "install it with pip install ./ffi/python, which builds the entry points PyTorch calls"
        )
    return str(found)


_lib = None


def loaded():
    """Whether the library is loaded (then it may have started, reading TIDEPOOL_CONF)."""
    return _lib is not None


def lib():
    """The loaded library, with argument and result types declared."""
    global _lib
    if _lib is None:
        handle = ctypes.CDLL(library_path())
        signatures = {
            "tidepool_malloc": (ctypes.c_void_p, [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]),
            "tidepool_free": (None, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]),
            "tidepool_init": (None, [ctypes.c_int]),
            "tidepool_empty_cache": (None, []),
            "tidepool_set_memory_fraction": (None, [ctypes.c_double, ctypes.c_int]),
            "tidepool_record_stream": (None, [ctypes.c_void_p, ctypes.c_void_p]),
            "tidepool_base_alloc": (ctypes.c_void_p, [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t)]),
            "tidepool_get_stats": (ctypes.c_int, [ctypes.c_int, ctypes.POINTER(Stats)]),
            "tidepool_dump_snapshot": (ctypes.c_int, [ctypes.c_char_p]),
            "tidepool_record_history": (ctypes.c_int, [ctypes.c_size_t]),
            "tidepool_last_error": (ctypes.c_size_t, [ctypes.c_char_p, ctypes.c_size_t]),
            "tidepool_check_conf": (ctypes.c_int, [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]),
            "tidepool_reset_peak_stats": (ctypes.c_int, [ctypes.c_int]),
            "tidepool_reset_accumulated_stats": (ctypes.c_int, [ctypes.c_int]),
            "tidepool_attach_oom_observer": (ctypes.c_int, [OOM_OBSERVER, ctypes.c_void_p]),
            "tidepool_malloc_with_context": (
                ctypes.c_void_p,
                [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p, ctypes.c_uint64],
            ),
            "tidepool_register_context": (ctypes.c_int, [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t]),
            "tidepool_set_tag": (ctypes.c_int, [ctypes.c_char_p]),
            "tidepool_pause": (ctypes.c_int, [ctypes.c_char_p, ctypes.c_int, ctypes.c_int]),
            "tidepool_resume": (ctypes.c_int, [ctypes.c_char_p, ctypes.c_int]),
            "tidepool_get_tag_stats": (ctypes.c_int, [ctypes.c_char_p, ctypes.c_int, ctypes.POINTER(TagStats)]),
        }
        for name, (restype, argtypes) in signatures.items():
            fn = getattr(handle, name)
            fn.restype = restype
            fn.argtypes = argtypes
        _lib = handle
    return _lib


def last_error():
    """This thread's last error message from the library ('' if none)."""
    n = lib().tidepool_last_error(None, 0)
    buf = ctypes.create_string_buffer(n + 1)
    lib().tidepool_last_error(buf, n + 1)
    return buf.value.decode("utf-8", "replace")


def conf_problems(conf):
    """What is wrong with a TIDEPOOL_CONF string (str, or bytes as the
    environment holds it), one message each (none: []), checked by the
    library without starting it."""
    if isinstance(conf, str):
        conf = conf.encode("utf-8", "surrogateescape")  # bytes os.environ could not decode go back as they were
    buf = ctypes.create_string_buffer(4096)
    count = lib().tidepool_check_conf(conf, buf, len(buf))
    text = buf.value.decode("utf-8", "replace")
    return text.split("\n")[:count] if count > 0 else []


def get_stats(device):
    stats = Stats()
    stats.size = ctypes.sizeof(Stats)
    check(lib().tidepool_get_stats(device, ctypes.byref(stats)))
    return stats


def get_tag_stats(tag, device):
    stats = TagStats()
    stats.size = ctypes.sizeof(TagStats)
    check(lib().tidepool_get_tag_stats(tag, device, ctypes.byref(stats)))
    return stats


def check(rc):
    """Raises the library's last error unless rc is OK."""
    if rc != OK:
        raise TidepoolError(last_error())


_torch_lib = None


def torch_library_present():
    """Whether libtidepool_torch.so is loaded or can be."""
    return _torch_lib is not None or _packaged("libtidepool_torch") is not None


def torch_lib():
    """libtidepool_torch.so, bound to the loaded libtidepool.so (see
    csrc/torch_alloc.cpp): PyTorch's alloc and free go through it."""
    global _torch_lib
    if _torch_lib is None:
        handle = ctypes.CDLL(torch_library_path())
        handle.tidepool_torch_bind.restype = ctypes.c_int
        handle.tidepool_torch_bind.argtypes = [ctypes.c_void_p] * 4
        handle.tidepool_torch_set_context_source.restype = None
        handle.tidepool_torch_set_context_source.argtypes = [ctypes.c_void_p]
        names = ("tidepool_malloc", "tidepool_malloc_with_context", "tidepool_free", "tidepool_last_error")
        if handle.tidepool_torch_bind(*(function_address(name) for name in names)) != 0:
            raise TidepoolError("binding libtidepool_torch.so to libtidepool.so failed")
        _torch_lib = handle
    return _torch_lib


def function_address(name):
    """The address of an exported function, for PyTorch's hook setters."""
    return ctypes.cast(getattr(lib(), name), ctypes.c_void_p).value
