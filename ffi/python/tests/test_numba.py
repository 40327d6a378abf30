"""tidepool.numba inside the real numba-cuda, on the host backend (no GPU here).

What runs here: the plugin against numba-cuda's EMM interface (no abstract
method left, the interface version Numba requires, set_memory_manager and
NUMBA_CUDA_MEMORY_MANAGER=tidepool.numba take it), and the plugin's own
calls made as Numba makes them, with the context=None Numba itself gives a
manager in set_memory_manager: memalloc returns numba's MemoryPointer over a
tidepool block whose finalizer frees it, views, defer_cleanup holding frees
back, out of memory as CudaAPIError(CUDA_ERROR_OUT_OF_MEMORY) with
tidepool's report, get_ipc_handle refusing expandable segments, reset
emptying tidepool's cache, and get_memory_info's arithmetic over tidepool's
statistics. What only a GPU runs: Numba creating a context with the plugin,
the driver's half of get_memory_info and of get_ipc_handle, and kernels on
the memory: cuda/check/runtimes_check.py.

Skipped without numba-cuda, except when TIDEPOOL_REQUIRE_TORCH=1 (CI, whose
venv ./test.sh makes with numba-cuda), where a missing numba-cuda fails.
"""
import gc
import importlib.util
import os
import subprocess
import sys
import unittest

HAVE_NUMBA_CUDA = importlib.util.find_spec("numba_cuda") is not None
if not HAVE_NUMBA_CUDA and os.environ.get("TIDEPOOL_REQUIRE_TORCH") == "1":
    raise RuntimeError("numba-cuda is required here (TIDEPOOL_REQUIRE_TORCH=1: ./test.sh installs it) but not installed")

import tidepool

MIB = 1 << 20


def on_host_backend():
    return "backend:host" in os.environ.get("TIDEPOOL_CONF", "").replace(" ", "")


@unittest.skipUnless(HAVE_NUMBA_CUDA, "numba-cuda not installed")
class TheInterface(unittest.TestCase):
    def test_the_plugin_implements_every_method_of_the_interface(self):
        from numba import cuda
        from numba.cuda.cudadrv import driver

        import tidepool.numba

        manager = tidepool.numba.TidepoolMemoryManager
        self.assertTrue(issubclass(manager, cuda.BaseCUDAMemoryManager))
        self.assertTrue(issubclass(manager, cuda.HostOnlyCUDAMemoryManager))
        self.assertEqual(manager.__abstractmethods__, frozenset())
        instance = manager(context=None)  # as set_memory_manager makes one
        self.assertEqual(instance.interface_version, driver._SUPPORTED_EMM_INTERFACE_VERSION)
        for method in ("memalloc", "initialize", "get_ipc_handle", "get_memory_info", "reset", "defer_cleanup"):
            self.assertEqual(getattr(manager, method).__module__, "tidepool.numba", method)

    def test_set_memory_manager_takes_it(self):
        from numba import cuda
        from numba.cuda.cudadrv import driver

        import tidepool.numba

        before = driver._memory_manager
        try:
            cuda.set_memory_manager(tidepool.numba.TidepoolMemoryManager)
            self.assertIs(driver._memory_manager, tidepool.numba.TidepoolMemoryManager)
        finally:
            driver._memory_manager = before

    def test_the_environment_variable_selects_it(self):
        # What Numba does when it makes its first context
        # (_ensure_memory_manager), in a process of its own.
        script = (
            "from numba.cuda.cudadrv import driver\n"
            "driver._ensure_memory_manager()\n"
            "print(driver._memory_manager.__module__, driver._memory_manager.__name__)\n"
        )
        done = subprocess.run(
            [sys.executable, "-c", script],
            env=dict(os.environ, NUMBA_CUDA_MEMORY_MANAGER="tidepool.numba"),
            capture_output=True,
            text=True,
            timeout=120,
        )
        self.assertEqual(done.returncode, 0, done.stdout + done.stderr)
        self.assertIn("tidepool.numba TidepoolMemoryManager", done.stdout)


@unittest.skipUnless(HAVE_NUMBA_CUDA, "numba-cuda not installed")
@unittest.skipUnless(on_host_backend(), "these tests run on TIDEPOOL_CONF=backend:host")
class OverTheHostBackend(unittest.TestCase):
    def setUp(self):
        from numba import cuda
        from numba.cuda.cudadrv import driver

        import tidepool.numba

        class HostManager(tidepool.numba.TidepoolMemoryManager):
            allow_host = True

        self.cuda = cuda
        self.driver = driver
        self.tn = tidepool.numba
        self.manager = HostManager(context=None)
        self.manager.initialize()
        gc.collect()
        self.allocated = tidepool.memory_allocated()

    def tearDown(self):
        gc.collect()
        self.assertEqual(tidepool.memory_allocated(), self.allocated, "a block was not freed")

    def test_initialize_refuses_the_host_backend_unless_allowed(self):
        with self.assertRaisesRegex(tidepool.TidepoolError, "backend is 'host'"):
            self.tn.TidepoolMemoryManager(context=None).initialize()

    def test_memalloc_gives_a_pointer_whose_finalizer_frees_through_tidepool(self):
        frees = tidepool.memory_stats()["tidepool.num_frees"]
        pointer = self.manager.memalloc(3000)
        self.assertIsInstance(pointer, self.cuda.MemoryPointer)
        self.assertEqual(pointer.size, 3000)
        self.assertGreaterEqual(tidepool.memory_allocated() - self.allocated, 3000)
        blocks = [b for s in tidepool.snapshot()["segments"] for b in s["blocks"] if b["address"] == pointer.device_pointer_value]
        self.assertEqual([(b["state"], b["requested_size"]) for b in blocks], [("active_allocated", 3000)])
        view = pointer.view(100, 200)
        self.assertEqual(view.device_pointer_value - pointer.device_pointer_value, 100)
        self.assertEqual(view.size, 100)
        del view
        del pointer
        self.assertEqual(tidepool.memory_allocated(), self.allocated)
        self.assertEqual(tidepool.memory_stats()["tidepool.num_frees"], frees + 1)
        self.assertEqual(tidepool.memory_stats()["tidepool.num_size_mismatches"], 0)
        # free() as Numba's arrays call it frees at once too.
        pointer = self.manager.memalloc(MIB)
        pointer.free()
        self.assertEqual(tidepool.memory_allocated(), self.allocated)

    def test_zero_bytes(self):
        pointer = self.manager.memalloc(0)
        self.assertEqual((pointer.device_pointer_value, pointer.size), (None, 0))

    def test_defer_cleanup_holds_frees_back_until_the_outermost_ends(self):
        with self.manager.defer_cleanup():
            with self.manager.defer_cleanup():
                pointer = self.manager.memalloc(5000)
                del pointer
                self.assertGreaterEqual(tidepool.memory_allocated() - self.allocated, 5000)
            self.assertGreaterEqual(tidepool.memory_allocated() - self.allocated, 5000)
        self.assertEqual(tidepool.memory_allocated(), self.allocated)

    def test_out_of_memory_is_numbas_error_with_tidepools_report(self):
        with self.assertRaises(self.driver.CudaAPIError) as caught:
            self.manager.memalloc(1 << 44)
        error = caught.exception
        self.assertEqual(error.code, self.driver.binding.CUresult.CUDA_ERROR_OUT_OF_MEMORY)
        self.assertIn("tidepool: out of memory on device 0: tried to allocate 16.00 TiB", str(error))

    def test_get_ipc_handle_refuses_expandable_segments(self):
        pointer = self.manager.memalloc(3 * MIB)
        segment = [s for s in tidepool.snapshot()["segments"] if s["address"] <= pointer.device_pointer_value < s["address"] + s["total_size"]]
        if not segment[0]["is_expandable"]:
            self.skipTest("a whole segment: cuIpcGetMemHandle's half needs a GPU")
        with self.assertRaisesRegex(self.tn.IpcNotSupported, "expandable:false"):
            self.manager.get_ipc_handle(pointer)

    def test_reset_empties_tidepools_cache(self):
        pointer = self.manager.memalloc(8 * MIB)
        del pointer
        released = tidepool.memory_stats()["tidepool.released_bytes.empty_cache"]
        self.manager.reset()
        self.assertGreater(tidepool.memory_stats()["tidepool.released_bytes.empty_cache"], released)

    def test_memory_info_adds_tidepools_cache_to_the_drivers_free_memory(self):
        from tidepool import _runtimes

        pointer = self.manager.memalloc(8 * MIB)
        del pointer
        cached = tidepool.memory_stats()["tidepool.cached_free_bytes"]
        self.assertGreater(cached, 0)
        self.assertEqual(_runtimes.memory_info(0, 100 * MIB, 1 << 40), (100 * MIB + cached, 1 << 40))
        self.assertEqual(_runtimes.memory_info(0, 1 << 40, 1 << 40), (1 << 40, 1 << 40))

    def test_memory_info_within_a_cap_on_reserved_memory(self):
        script = (
            "from tidepool import _native, _runtimes\n"
            "assert _native.lib().tidepool_malloc(3 << 20, 0, None)\n"
            "stats = _native.get_stats(0)\n"
            "print(_runtimes.memory_info(0, 1 << 30, 2 << 30), stats.reserved_bytes - stats.cached_free_bytes)\n"
        )
        done = subprocess.run(
            [sys.executable, "-c", script],
            env=dict(os.environ, TIDEPOOL_CONF=os.environ["TIDEPOOL_CONF"] + ",max_reserved_mb:64"),
            capture_output=True,
            text=True,
            timeout=120,
        )
        self.assertEqual(done.returncode, 0, done.stdout + done.stderr)
        (free, total), in_use = eval(done.stdout.strip().replace(") ", "), "))
        self.assertEqual(total, 64 * MIB)
        self.assertGreaterEqual(in_use, 3 * MIB)
        self.assertEqual(free, 64 * MIB - in_use)


if __name__ == "__main__":
    unittest.main()
