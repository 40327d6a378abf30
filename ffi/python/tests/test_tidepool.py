"""The Python package over the real library (ctypes), without torch but
for InstallIntoTorch (skipped where torch is not installed).

Run with TIDEPOOL_LIBRARY pointing at a built libtidepool.so and
TIDEPOOL_CONF selecting the host backend (tests/python.rs does both).
"""
import ctypes
import importlib.util
import io
import os
import pickle
import subprocess
import sys
import tempfile
import types
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import tidepool  # noqa: E402
from tidepool import _native  # noqa: E402

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
        tidepool._plug = None

    def tearDown(self):
        if self.saved is None:
            sys.modules.pop("torch", None)
        else:
            sys.modules["torch"] = self.saved
        tidepool._plug = None

    def test_install_hands_pytorch_the_library_and_every_hook(self):
        fake = FakeTorch()
        sys.modules["torch"] = fake.module
        tidepool.install(allow_host=True)
        self.assertEqual(fake.calls[0], ("CUDAPluggableAllocator", (tidepool.library_path(), "tidepool_malloc", "tidepool_free")))
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

    def test_install_refuses_to_give_pytorch_host_memory(self):
        fake = FakeTorch()
        sys.modules["torch"] = fake.module
        with self.assertRaisesRegex(tidepool.TidepoolError, "CUDA kernels cannot use"):
            tidepool.install(conf="backend:host")
        self.assertEqual(fake.calls, [], "nothing was handed to PyTorch")


@unittest.skipUnless(importlib.util.find_spec("torch"), "torch not installed")
class InstallIntoTorch(unittest.TestCase):
    """install() with the real torch: its CUDAPluggableAllocator loads the
    library, takes every hook under the name install() uses, becomes the
    allocator, and calls the graph-pool hooks as tidepool reads them (no GPU
    needed: CUDA is not initialised by any of it)."""

    def test_torch_takes_the_library_and_every_hook(self):
        # torch's own entry points to its graph-pool hooks (what CUDA graph
        # capture and use_mem_pool call) reach tidepool with the pool's id
        # intact: the C++ call and tidepool's C signature agree.
        script = (
            "import torch, tidepool\n"
            "from tidepool import _native\n"
            "tidepool.install(allow_host=True)\n"
            "assert torch._C._cuda_getAllocator() is tidepool._plug.allocator(), 'not the current allocator'\n"
            "torch._C._cuda_beginAllocateToPool(0, (9, 4))\n"
            "ptr = _native.lib().tidepool_malloc(1 << 20, 0, None)\n"
            "torch._C._cuda_endAllocateToPool(0, (9, 4))\n"
            "pools = {tuple(s['segment_pool_id']) for s in tidepool.snapshot()['segments'] if any(b['address'] == ptr for b in s['blocks'])}\n"
            "assert pools == {(9, 4)}, pools\n"
            "_native.lib().tidepool_free(ptr, 1 << 20, 0, None)\n"
            "torch._C._cuda_releasePool(0, (9, 4))\n"
            "assert not torch.cuda.is_initialized()\n"
            "print('installed')\n"
        )
        env = dict(os.environ, PYTHONPATH=os.path.join(os.path.dirname(__file__), ".."))
        done = subprocess.run([sys.executable, "-W", "ignore", "-c", script], env=env, capture_output=True, text=True, timeout=300)
        self.assertEqual(done.returncode, 0, done.stdout + done.stderr)
        self.assertIn("installed", done.stdout)


if __name__ == "__main__":
    unittest.main()
