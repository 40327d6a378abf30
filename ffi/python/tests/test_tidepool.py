"""The Python package over the real library (ctypes), without torch.

Run over the installed package (tools/tests/tools/python.rs installs the wheel pip
builds) with TIDEPOOL_CONF selecting the host backend with 1 GiB.
"""
import ctypes
import io
import os
import pickle
import subprocess
import sys
import tempfile
import types
import unittest

import tidepool
from tidepool import _install, _native

MIB = 1 << 20


def malloc(size, device=0, stream=0):
    return _native.lib().tidepool_malloc(size, device, stream)


def free(ptr, size, device=0, stream=0):
    _native.lib().tidepool_free(ptr, size, device, stream)


class MemoryStats(unittest.TestCase):
    def test_has_every_key_of_torch_cuda_memory_stats(self):
        stats = tidepool.memory_stats()
        for gauge in _native.GAUGES:
            for pool in _native.POOLS:
                for field in _native.FIELDS:
                    self.assertIn(f"{gauge}.{pool}.{field}", stats)
        for key in ("num_alloc_retries", "num_ooms", "num_device_alloc", "num_device_free", "num_sync_all_streams"):
            self.assertIn(key, stats)
        # Every event counter of the library's list (tests/cabi/header.rs
        # checks _native.COUNTERS against it), under its key.
        # (The reclaimer may count a pass between the two reads.)
        raw = _native.get_stats(0)
        self.assertEqual((raw.version, raw.size), (_native.STATS_VERSION, ctypes.sizeof(_native.Stats)))
        later = tidepool.memory_stats()
        for key, field in _native.COUNTERS:
            self.assertGreaterEqual(later[key], getattr(raw, field), key)
        for key in ("tidepool.num_stream_sync_errors", "tidepool.num_cross_stream_reuses", "tidepool.coop_last_wait_ms"):
            self.assertIn(key, stats)
        self.assertEqual(list(stats), sorted(stats), "keys sorted, as torch returns them")

    def test_follows_allocations_and_frees(self):
        before = tidepool.memory_stats()
        ptr = malloc(3 * MIB + 5)
        self.assertTrue(ptr)
        ctypes.memset(ptr, 7, 3 * MIB + 5)  # host backend: real memory
        during = tidepool.memory_stats()
        rounded = 3 * MIB + 512
        self.assertEqual(during["allocated_bytes.all.current"] - before["allocated_bytes.all.current"], rounded)
        self.assertEqual(during["allocated_bytes.large_pool.current"] - before["allocated_bytes.large_pool.current"], rounded)
        self.assertEqual(during["requested_bytes.all.current"] - before["requested_bytes.all.current"], 3 * MIB + 5)
        self.assertEqual(during["allocation.all.allocated"] - before["allocation.all.allocated"], 1)
        self.assertGreaterEqual(tidepool.max_memory_allocated(), rounded)
        self.assertEqual(tidepool.memory_allocated(), during["allocated_bytes.all.current"])
        self.assertEqual(tidepool.memory_reserved(), during["reserved_bytes.all.current"])
        free(ptr, 3 * MIB + 5)
        after = tidepool.memory_stats()
        self.assertEqual(after["allocated_bytes.all.current"], before["allocated_bytes.all.current"])
        self.assertEqual(after["allocation.all.freed"] - before["allocation.all.freed"], 1)

    def test_empty_cache_returns_whole_free_segments(self):
        ptr = malloc(30 * MIB)
        free(ptr, 30 * MIB)
        self.assertGreaterEqual(tidepool.memory_reserved(), 30 * MIB)
        before = tidepool.memory_stats()["tidepool.released_bytes.empty_cache"]
        tidepool.empty_cache()
        self.assertGreaterEqual(tidepool.memory_stats()["tidepool.released_bytes.empty_cache"] - before, 30 * MIB)
        self.assertEqual(tidepool.memory_reserved(), tidepool.memory_stats()["reserved_bytes.all.current"])
        self.assertLess(tidepool.memory_reserved(), 30 * MIB)

    def test_fragmentation_counts_holes_in_partly_used_segments_not_whole_free_segments(self):
        tidepool.empty_cache()
        base = tidepool.memory_stats()
        self.assertEqual(base["reserved_bytes.all.current"], 0, "nothing cached before")
        # Whole free segments (or, with expandable segments, a whole free
        # range): releasable at once, not fragmentation.
        for size in (12 * MIB, 22 * MIB):
            free(malloc(size), size)
        whole = tidepool.memory_stats()
        self.assertGreaterEqual(whole["tidepool.cached_free_bytes"], 22 * MIB)
        self.assertEqual(whole["tidepool.fragmentation"], 0.0)
        tidepool.empty_cache()
        # Every other 256 KiB block of a 2 MiB segment freed: half of it is holes.
        blocks = [malloc(256 << 10) for _ in range(8)]
        for ptr in blocks[::2]:
            free(ptr, 256 << 10)
        holes = tidepool.memory_stats()
        self.assertAlmostEqual(holes["tidepool.fragmentation"], 0.5)
        self.assertEqual(holes["tidepool.external_fragmentation"], holes["tidepool.fragmentation"], "the earlier name")
        self.assertIn("Fragmentation: 50 %", tidepool.memory_summary())
        for ptr in blocks[1::2]:
            free(ptr, 256 << 10)
        tidepool.empty_cache()

    def test_bad_input_is_counted_and_explained(self):
        before = tidepool.memory_stats()["tidepool.num_invalid_frees"]
        free(0x1000, 64)
        self.assertEqual(tidepool.memory_stats()["tidepool.num_invalid_frees"], before + 1)
        self.assertIn("never allocated", _native.last_error())
        self.assertIsNone(malloc(512, device=42))
        self.assertIn("no device 42", _native.last_error())
        with self.assertRaisesRegex(tidepool.TidepoolError, "no device 9"):
            tidepool.memory_stats(9)

    def test_summary_is_a_readable_table(self):
        ptr = malloc(4096)
        text = tidepool.memory_summary()
        free(ptr, 4096)
        for needle in ("Allocated memory", "Reserved memory", "from small pool", "Fragmentation", "OOMs"):
            self.assertIn(needle, text)


class Snapshots(unittest.TestCase):
    def test_snapshot_has_pytorchs_schema(self):
        ptr = malloc(12345, stream=5)
        snap = tidepool.snapshot()
        free(ptr, 12345, stream=5)
        self.assertEqual(set(snap), {"segments", "device_traces"})
        self.assertIsInstance(snap["device_traces"], list)
        mine = [s for s in snap["segments"] if any(b["address"] == ptr for b in s["blocks"])]
        self.assertEqual(len(mine), 1)
        segment = mine[0]
        for key in ("device", "address", "total_size", "allocated_size", "active_size", "requested_size",
                    "stream", "segment_type", "segment_pool_id", "is_expandable", "frames", "blocks"):
            self.assertIn(key, segment)
        self.assertEqual(segment["stream"], 5)
        self.assertEqual(segment["segment_type"], "small")
        self.assertEqual(sum(b["size"] for b in segment["blocks"]), segment["total_size"])
        block = next(b for b in segment["blocks"] if b["address"] == ptr)
        self.assertEqual((block["size"], block["requested_size"], block["state"]), (12800, 12345, "active_allocated"))
        self.assertTrue(all(b["state"] in ("active_allocated", "inactive") for b in segment["blocks"]))

    def test_history_puts_pytorchs_trace_entries_in_the_snapshot(self):
        self.assertEqual(tidepool.snapshot()["device_traces"], [[]], "no history unless asked")
        tidepool.record_memory_history(max_entries=1000)
        try:
            ptr = malloc(3 * MIB, stream=11)
            free(ptr, 3 * MIB, stream=11)
            trace = tidepool.snapshot()["device_traces"][0]
        finally:
            tidepool.record_memory_history(enabled=False)
        mine = [(e["action"], e["size"]) for e in trace if e["addr"] == ptr]
        self.assertEqual(mine[-3:], [("alloc", 3 * MIB), ("free_requested", 3 * MIB), ("free_completed", 3 * MIB)])
        self.assertTrue(all(action.startswith("segment_") for action, _ in mine[:-3]), mine)
        for entry in trace:
            self.assertEqual(set(entry), {"action", "addr", "size", "stream", "time_us", "frames"})
        self.assertEqual(tidepool.snapshot()["device_traces"], [[]], "off forgets")
        with self.assertRaises(tidepool.TidepoolError):
            tidepool.record_memory_history(max_entries=-1)

    def test_dump_snapshot_writes_a_file_a_plain_data_unpickler_loads(self):
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "snap.pickle")
            tidepool.dump_snapshot(path)
            with open(path, "rb") as f:
                data = f.read()
            # The standard library's own unpickler, with every global refused.
            class Refuse(pickle.Unpickler):
                def find_class(self, module, name):
                    raise AssertionError(f"snapshot references {module}.{name}")
            self.assertIn("segments", Refuse(io.BytesIO(data)).load())
            with self.assertRaisesRegex(tidepool.TidepoolError, "cannot write snapshot"):
                tidepool.dump_snapshot(os.path.join(tmp, "missing-dir", "x.pickle"))

    def test_load_snapshot_refuses_globals(self):
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "evil.pickle")
            with open(path, "wb") as f:
                pickle.dump({"segments": [os.system]}, f)
            with self.assertRaises(pickle.UnpicklingError):
                tidepool.load_snapshot(path)


class ResetStats(unittest.TestCase):
    def test_reset_peak_makes_every_peak_the_current_value(self):
        ptr = malloc(64 * MIB)
        free(ptr, 64 * MIB)
        self.assertGreater(tidepool.max_memory_allocated(), tidepool.memory_allocated())
        tidepool.reset_peak_memory_stats()
        stats = tidepool.memory_stats()
        self.assertEqual(tidepool.max_memory_allocated(), tidepool.memory_allocated())
        for gauge in _native.GAUGES:
            for pool in _native.POOLS:
                self.assertEqual(stats[f"{gauge}.{pool}.peak"], stats[f"{gauge}.{pool}.current"], (gauge, pool))

    def test_reset_accumulated_zeroes_totals_and_keeps_current_values(self):
        keep = malloc(2 * MIB)
        ptr = malloc(5 * MIB)
        free(ptr, 5 * MIB)
        self.assertIsNone(malloc(1 << 40), "an out of memory to count")
        before = tidepool.memory_stats()
        self.assertGreater(before["num_ooms"], 0)
        tidepool.reset_accumulated_memory_stats()
        after = tidepool.memory_stats()
        self.assertEqual(after["allocated_bytes.all.current"], before["allocated_bytes.all.current"])
        self.assertEqual(after["allocated_bytes.all.freed"], 0)
        self.assertEqual(after["allocated_bytes.all.allocated"], 0)
        self.assertEqual(after["num_ooms"], 0)
        free(keep, 2 * MIB)
        self.assertEqual(tidepool.memory_stats()["allocated_bytes.all.freed"], 2 * MIB)

    def test_driver_calls_are_counted_and_none_when_the_cache_serves(self):
        self.assertIn("tidepool.num_driver_calls", tidepool.memory_stats())
        self.assertEqual(tidepool.memory_stats_as_nested_dict()["tidepool"]["num_driver_calls"], _native.get_stats(0).num_driver_calls)
        # In a process of its own, whose cache goes back only on empty_cache
        # (release_after_ms:off): every call made is the script's. The
        # process's own configuration decides segments or pages.
        for conf in ("release_after_ms:off", "release_after_ms:off,expandable:false"):
            script = (
                "import tidepool\n"
                "from tidepool import _native\n"
                "lib = _native.lib()\n"
                "calls = lambda: tidepool.memory_stats()['tidepool.num_driver_calls']\n"
                "seen = [calls()]\n"
                "p = lib.tidepool_malloc(24 << 20, 0, None)\n"
                "seen.append(calls())\n"
                "lib.tidepool_free(p, 24 << 20, 0, None)\n"
                "p = lib.tidepool_malloc(24 << 20, 0, None)\n"
                "lib.tidepool_free(p, 24 << 20, 0, None)\n"
                "seen.append(calls())\n"
                "tidepool.empty_cache()\n"
                "seen.append(calls())\n"
                "tidepool.reset_accumulated_memory_stats()\n"
                "seen.append(calls())\n"
                "print(*seen)\n"
            )
            env = dict(os.environ, TIDEPOOL_CONF=f"backend:host,host_capacity_mb:64,{conf}")
            done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
            self.assertEqual(done.returncode, 0, done.stderr)
            start, grown, reused, emptied, reset = map(int, done.stdout.split())
            self.assertEqual(start, 0, conf)
            self.assertGreater(grown, 0, f"{conf}: growing takes driver calls")
            self.assertEqual(reused, grown, f"{conf}: the cache serves the second allocation, no driver call")
            self.assertGreater(emptied, reused, f"{conf}: empty_cache gives memory back with driver calls")
            self.assertEqual(reset, 0, f"{conf}: reset_accumulated_memory_stats zeroes it")

    def test_a_bad_device_is_an_error(self):
        with self.assertRaisesRegex(tidepool.TidepoolError, "device"):
            tidepool.reset_peak_memory_stats(7)
        with self.assertRaisesRegex(tidepool.TidepoolError, r"no device -5; this process has one, device 0"):
            tidepool.reset_accumulated_memory_stats(-5)


class Devices(unittest.TestCase):
    def test_a_device_is_taken_as_torch_cuda_takes_one(self):
        ptr = malloc(MIB)
        try:
            expected = tidepool.memory_allocated(0)
            self.assertGreaterEqual(expected, MIB)
            cuda_device = types.SimpleNamespace(type="cuda", index=0)  # a torch.device's fields
            for device in (None, "cuda", "cuda:0", cuda_device, types.SimpleNamespace(type="cuda", index=None)):
                self.assertEqual(tidepool.memory_allocated(device), expected, repr(device))
            self.assertEqual(tidepool.tag_stats("default", device="cuda:0")["allocated_bytes"], 0)
        finally:
            free(ptr, MIB)
        for bad in ("cpu", "cuda:x", types.SimpleNamespace(type="cpu", index=None), 1.5):
            with self.assertRaisesRegex(ValueError, "not a CUDA device", msg=repr(bad)):
                tidepool.memory_allocated(bad)


class OutOfMemoryObservers(unittest.TestCase):
    def test_an_observer_hears_each_out_of_memory_with_its_figures(self):
        heard = []
        tidepool.attach_oom_observer(lambda *args: heard.append(args))
        keep = malloc(8 * MIB)
        allocated = tidepool.memory_allocated()
        self.assertIsNone(malloc(4 << 30))
        self.assertEqual(len(heard), 1, heard)
        device, requested, device_allocated, device_free = heard[0]
        self.assertEqual((device, requested, device_allocated), (0, 4 << 30, allocated))
        self.assertGreater(device_free, 0)
        self.assertLessEqual(device_free, 1024 * MIB)
        self.assertTrue(malloc(MIB), "a smaller request is served after it")
        self.assertEqual(len(heard), 1, "no call without an out of memory")
        free(keep, 8 * MIB)

    def test_an_observer_that_raises_is_logged_and_the_error_still_comes(self):
        tidepool.attach_oom_observer(lambda *args: 1 / 0)
        with self.assertLogs("tidepool", level="ERROR") as logged:
            self.assertIsNone(malloc(8 << 30))
        self.assertIn("ZeroDivisionError", "\n".join(logged.output))
        self.assertIn("out of memory", _native.last_error())

    def test_a_non_callable_observer_is_refused_at_attach(self):
        with self.assertRaisesRegex(TypeError, "callable"):
            tidepool.attach_oom_observer("not a function")


class OutOfMemorySnapshot(unittest.TestCase):
    """TIDEPOOL_CONF=oom_snapshot:PATH, in a process of its own (the first
    out of memory of the process writes it)."""

    def run_script(self, conf, script):
        env = dict(os.environ, TIDEPOOL_CONF=f"backend:host,host_capacity_mb:64,{conf}")
        return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)

    def test_the_first_out_of_memory_writes_a_snapshot_with_the_timeline(self):
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "oom.pickle")
            done = self.run_script(f"oom_snapshot:{path}", (
                "import tidepool\n"
                "from tidepool import _native\n"
                "tidepool.record_memory_history()\n"
                "keep = _native.lib().tidepool_malloc(3 << 20, 0, None)\n"
                "assert not _native.lib().tidepool_malloc(1 << 30, 0, None)\n"
                "print('done')\n"
            ))
            self.assertEqual(done.returncode, 0, done.stderr)
            snap = tidepool.load_snapshot(path)
            sizes = [b["size"] for s in snap["segments"] for b in s["blocks"] if b["state"] == "active_allocated"]
            self.assertIn(3 << 20, sizes)
            actions = [e["action"] for e in snap["device_traces"][0]]
            self.assertIn("alloc", actions)
            self.assertEqual(actions[-1], "oom")
            # As PyTorch writes it (memory_viz reads the device's free bytes there).
            oom = snap["device_traces"][0][-1]
            self.assertEqual(set(oom) - {"frames"}, {"action", "device_free", "size", "stream", "time_us"})
            self.assertEqual(oom["size"], 1 << 30)
            self.assertGreater(oom["device_free"], 0)

    def test_an_unwritable_path_warns_and_loses_nothing_else(self):
        done = self.run_script("oom_snapshot:/nonexistent-dir/oom.pickle", (
            "from tidepool import _native\n"
            "lib = _native.lib()\n"
            "assert not lib.tidepool_malloc(1 << 30, 0, None)\n"
            "assert 'out of memory' in _native.last_error(), _native.last_error()\n"
            "ptr = lib.tidepool_malloc(1 << 20, 0, None)\n"
            "assert ptr\n"
            "lib.tidepool_free(ptr, 1 << 20, 0, None)\n"
            "print('kept working')\n"
        ))
        self.assertEqual(done.returncode, 0, done.stderr)
        self.assertIn("kept working", done.stdout)
        self.assertIn("/nonexistent-dir/oom.pickle", done.stderr)


class HistoryOptions(unittest.TestCase):
    def test_bad_options_get_pytorchs_errors(self):
        with self.assertRaisesRegex(RuntimeError, "expected state to be 'state', 'all', or None"):
            tidepool.record_memory_history("sometimes")
        with self.assertRaisesRegex(RuntimeError, "expected context to be"):
            tidepool.record_memory_history(context="everything")
        with self.assertRaisesRegex(RuntimeError, "expected stacks to be 'python', or 'all'"):
            tidepool.record_memory_history(stacks="cpp")
        with self.assertRaises(TypeError):
            tidepool.record_memory_history(enabled="all", colour="blue")


def torch_alloc(entry, size):
    """An allocation as PyTorch makes it (the entry point it calls)."""
    return entry.tidepool_torch_malloc(size, 0, None)


class PythonFrames(unittest.TestCase):
    """record_memory_history(stacks="python"): the Python frames of each
    allocation PyTorch makes, in the snapshot."""

    def entry(self, holding_gil):
        # PyDLL keeps the GIL during the call; CDLL lets it go first, as
        # PyTorch's operators do before they allocate.
        loader = ctypes.PyDLL if holding_gil else ctypes.CDLL
        entry = loader(_native.torch_library_path())
        entry.tidepool_torch_malloc.restype = ctypes.c_void_p
        entry.tidepool_torch_malloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        _native.torch_lib()  # bound to the loaded libtidepool.so
        return entry

    def frames_of(self, ptr):
        snap = tidepool.snapshot()
        block = next(b for s in snap["segments"] for b in s["blocks"] if b["address"] == ptr)
        alloc = [e for e in snap["device_traces"][0] if e["action"] == "alloc" and e["addr"] == ptr]
        return block["frames"], (alloc[-1]["frames"] if alloc else None)

    def test_each_allocation_carries_its_python_frames(self):
        entry = self.entry(holding_gil=True)
        tidepool.record_memory_history(stacks="python", max_entries=1000)
        try:
            ptr = torch_alloc(entry, 5 * MIB + 3)
            block_frames, alloc_frames = self.frames_of(ptr)
        finally:
            tidepool.record_memory_history(None)
        free(ptr, 5 * MIB + 3)
        self.assertEqual(block_frames, alloc_frames)
        names = [f["name"] for f in block_frames]
        self.assertEqual(names[:2], ["torch_alloc", "test_each_allocation_carries_its_python_frames"], names)
        self.assertTrue(block_frames[0]["filename"].endswith("test_tidepool.py"))
        self.assertIsInstance(block_frames[0]["line"], int)
        self.assertGreater(block_frames[0]["line"], 0)
        self.assertEqual(set(block_frames[0]), {"filename", "line", "name"})

    def test_a_thread_that_let_the_gil_go_still_gets_its_frames(self):
        tidepool.record_memory_history(stacks="python")
        try:
            ptr = torch_alloc(self.entry(holding_gil=False), 2 * MIB)
            names = [f["name"] for f in self.frames_of(ptr)[0]]
        finally:
            tidepool.record_memory_history(None)
        free(ptr, 2 * MIB)
        self.assertEqual(names[:2], ["torch_alloc", "test_a_thread_that_let_the_gil_go_still_gets_its_frames"])

    def test_no_frames_when_off(self):
        ptr = torch_alloc(self.entry(holding_gil=True), 2 * MIB)
        self.assertEqual(self.frames_of(ptr)[0], [], "recording is off")
        free(ptr, 2 * MIB)

    def test_a_reused_address_does_not_keep_old_frames(self):
        entry = self.entry(holding_gil=True)
        tidepool.record_memory_history(stacks="python")
        ptr = torch_alloc(entry, 3 * MIB)
        free(ptr, 3 * MIB)
        tidepool.record_memory_history(None)
        again = torch_alloc(entry, 3 * MIB)
        self.assertEqual(again, ptr, "the cached block is reused")
        self.assertEqual(self.frames_of(again)[0], [])
        free(again, 3 * MIB)


class LibraryChoice(unittest.TestCase):
    def run_script(self, library):
        script = "import tidepool; print(tidepool.library_path()); print(tidepool.memory_allocated())"
        env = dict(os.environ, TIDEPOOL_LIBRARY=library)
        return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)

    def test_tidepool_library_overrides_the_packaged_library(self):
        with tempfile.TemporaryDirectory() as tmp:
            copy = os.path.join(tmp, "libtidepool.so")
            with open(_native.library_path(), "rb") as src, open(copy, "wb") as dst:
                dst.write(src.read())
            done = self.run_script(copy)
            self.assertEqual(done.returncode, 0, done.stderr)
            self.assertEqual(done.stdout.split()[0], copy)

    def test_a_package_installed_near_the_root_is_no_source_checkout(self):
        saved_dir, saved_env = _native.PACKAGE_DIR, os.environ.pop("TIDEPOOL_LIBRARY", None)
        try:
            _native.PACKAGE_DIR = type(saved_dir)("/deps/tidepool")  # pip install --target /deps
            with self.assertRaisesRegex(tidepool.TidepoolError, "libtidepool.so not found"):
                _native.library_path()
        finally:
            _native.PACKAGE_DIR = saved_dir
            if saved_env is not None:
                os.environ["TIDEPOOL_LIBRARY"] = saved_env

    def test_a_missing_tidepool_library_is_a_clear_error(self):
        done = self.run_script("/nonexistent/libtidepool.so")
        self.assertNotEqual(done.returncode, 0)
        self.assertIn("TIDEPOOL_LIBRARY=/nonexistent/libtidepool.so does not exist", done.stderr)


class FakeTorch:
    """Stands in for torch's allocator-switching API (torch itself cannot
    run here): records what install() hands PyTorch."""

    def __init__(self, initialized=False):
        self.calls = []
        recorder = self

        class Raw:
            def __getattr__(self, name):
                return lambda address: recorder.calls.append((name, address))

        class Pluggable:
            def __init__(self, path, alloc_fn, free_fn):
                recorder.calls.append(("CUDAPluggableAllocator", (path, alloc_fn, free_fn)))
                self.raw = Raw()

            def allocator(self):
                return self.raw

        self.module = types.ModuleType("torch")
        self.module._C = types.SimpleNamespace(_cuda_getAllocator=lambda: "pytorch's own")
        self.module.cuda = types.SimpleNamespace(
            is_initialized=lambda: initialized,
            memory=types.SimpleNamespace(
                CUDAPluggableAllocator=Pluggable,
                change_current_allocator=lambda plug: recorder.calls.append(("change_current_allocator", plug)),
            ),
        )


class Install(unittest.TestCase):
    def setUp(self):
        self.saved = sys.modules.get("torch")
        _install._plug = None
        _install._installed = False

    def tearDown(self):
        if self.saved is None:
            sys.modules.pop("torch", None)
        else:
            sys.modules["torch"] = self.saved
        _install._plug = None
        _install._installed = False

    def test_a_second_install_only_points_torch_cuda_here_again(self):
        fake = FakeTorch()
        sys.modules["torch"] = fake.module
        tidepool.install(allow_host=True)
        calls = len(fake.calls)
        fake.module.cuda.is_initialized = lambda: True  # CUDA has started since
        tidepool.install(allow_host=True)
        self.assertEqual(len(fake.calls), calls, "PyTorch's allocator was not switched again")

    def test_a_conf_after_tidepool_started_is_refused_with_a_warning(self):
        sys.modules["torch"] = FakeTorch().module
        tidepool.memory_allocated()  # the library starts, reading TIDEPOOL_CONF
        before = os.environ.get("TIDEPOOL_CONF")
        with self.assertWarnsRegex(RuntimeWarning, "already started"):
            tidepool.install("expandable:true", allow_host=True)
        self.assertEqual(os.environ.get("TIDEPOOL_CONF"), before)

    def test_install_hands_pytorch_the_library_and_every_hook(self):
        fake = FakeTorch()
        sys.modules["torch"] = fake.module
        tidepool.install(allow_host=True)
        # PyTorch calls the C++ entry points that raise on out of memory.
        expected = (_native.torch_library_path(), "tidepool_torch_malloc", "tidepool_torch_free")
        self.assertEqual(fake.calls[0], ("CUDAPluggableAllocator", expected))
        hooks = dict(call for call in fake.calls[1:-1])
        self.assertEqual(hooks, {
            "set_init_fn": _native.function_address("tidepool_init"),
            "set_reset_fn": _native.function_address("tidepool_empty_cache"),
            "set_memory_fraction_fn": _native.function_address("tidepool_set_memory_fraction"),
            "set_record_stream_fn": _native.function_address("tidepool_record_stream"),
            "set_base_alloc_fn": _native.function_address("tidepool_base_alloc"),
            "set_begin_allocate_to_pool": _native.function_address("tidepool_begin_allocate_to_pool"),
            "set_end_allocate_to_pool_fn": _native.function_address("tidepool_end_allocate_to_pool"),
            "set_release_pool": _native.function_address("tidepool_release_pool"),
        })
        self.assertTrue(all(hooks.values()))
        self.assertEqual(fake.calls[-1][0], "change_current_allocator")

    def test_install_after_cuda_started_says_to_call_it_first(self):
        sys.modules["torch"] = FakeTorch(initialized=True).module
        with self.assertRaisesRegex(tidepool.TidepoolError, "first thing"):
            tidepool.install(allow_host=True)

    def test_install_refuses_a_bad_conf_at_once_and_takes_pytorchs_spelling(self):
        # In a process of its own: the library must not have started yet.
        script = (
            "import sys, types\n"
            "sys.modules['torch'] = types.SimpleNamespace(cuda=types.SimpleNamespace(is_initialized=lambda: False))\n"
            "import tidepool\n"
            "try:\n"
            "    tidepool.install('backend:host,expandable:maybe,colour:blue', allow_host=True)\n"
            "except tidepool.TidepoolError as err:\n"
            "    print('refused:', err)\n"
            "print(tidepool._native.conf_problems('expandable_segments:True,max_split_size_mb:256'))\n"
        )
        env = dict(os.environ, TIDEPOOL_CONF="")
        done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
        self.assertEqual(done.returncode, 0, done.stderr)
        refused, problems = done.stdout.splitlines()[:2]
        self.assertIn("expected true or false", refused)
        self.assertIn('unknown option \"colour\"', refused)
        self.assertEqual(problems, "[]", "PyTorch's name and its True are understood")
        self.assertEqual(done.stderr, "", "no warning later: the install refused first")

    def test_install_refuses_a_bad_environment_in_the_librarys_words(self):
        # In a process of its own: the library must not have started yet.
        script = (
            "import sys, types\n"
            "sys.modules['torch'] = types.SimpleNamespace(cuda=types.SimpleNamespace(is_initialized=lambda: False))\n"
            "import tidepool\n"
            "try:\n"
            "    tidepool.install(allow_host=True)\n"
            "except tidepool.TidepoolError as err:\n"
            "    print('refused:', err)\n"
        )
        env = {os.fsencode(k): os.fsencode(v) for k, v in os.environ.items()}
        env[b"TIDEPOOL_CONF"] = b"backend:host,colour:blue,x:\xff"  # a byte that is not UTF-8
        done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
        self.assertEqual(done.returncode, 0, done.stderr)
        self.assertIn('refused: TIDEPOOL_CONF: ignoring "colour:blue": unknown option "colour"', done.stdout)
        self.assertIn('ignoring "x:\ufffd": not UTF-8', done.stdout)
        self.assertEqual(done.stderr, "", "the library did not start: no warning")

    def test_install_refuses_to_give_pytorch_host_memory(self):
        fake = FakeTorch()
        sys.modules["torch"] = fake.module
        for conf in ("backend:host", "backend:cuda,backend:host"):  # the last entry wins, as in the library
            with self.assertRaisesRegex(tidepool.TidepoolError, "CUDA kernels cannot use"):
                tidepool.install(conf=conf)
        self.assertEqual(fake.calls, [], "nothing was handed to PyTorch")


if __name__ == "__main__":
    unittest.main()
