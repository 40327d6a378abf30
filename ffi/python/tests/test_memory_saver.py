"""tidepool.memory_saver (torch_memory_saver's API) and tidepool.vllm
(vLLM's CuMemAllocator's shape) over the real library, on the host backend
TIDEPOOL_CONF selects: memory is host memory, so contents can be written
and read back. Allocations are made with tidepool_malloc, the call torch's
allocator makes for a tensor; the sequences of calls are those of
torch_memory_saver's own examples (test/examples/simple.py, cpu_backup.py,
rl_example.py, nested_region.py, training_engine.py) and of vLLM's GPU
worker (load_model, initialize_from_config, sleep, wake_up). The last class
runs them under the real torch with tidepool installed as its allocator.

Tag names are unique per test: tags live as long as the process.
"""
import ctypes
import importlib.util
import os
import subprocess
import sys
import textwrap
import threading
import types
import unittest

import tidepool
from tidepool import _native
from tidepool import memory_saver
from tidepool import vllm as tidepool_vllm
from tidepool.memory_saver import TorchMemorySaver, tidepool_tag
from tidepool.vllm import CuMemAllocator

MIB = 1 << 20

HAVE_TORCH = importlib.util.find_spec("torch") is not None
if not HAVE_TORCH and os.environ.get("TIDEPOOL_REQUIRE_TORCH") == "1":
    raise RuntimeError("torch is required here (TIDEPOOL_REQUIRE_TORCH=1) but not installed")


def malloc(size):
    ptr = _native.lib().tidepool_malloc(size, 0, None)
    return ptr


def free(ptr, size):
    _native.lib().tidepool_free(ptr, size, 0, None)


def fill(ptr, size, value):
    ctypes.memset(ptr, value, size)


def holds(ptr, size, value):
    """Whether every byte of the block is `value` (sampled every 64 KiB)."""
    want = bytes([value]) * 4096
    return all(ctypes.string_at(ptr + offset, min(4096, size - offset)) == want[: min(4096, size - offset)] for offset in range(0, size, 64 * 1024))


def segment_addresses(tag):
    """The addresses of the segments of tidepool tag `tag` (a snapshot's view)."""
    return sorted(s["address"] for s in tidepool.snapshot()["segments"] if s.get("tag") == tag)


class MemorySaver(unittest.TestCase):
    def setUp(self):
        self.saver = TorchMemorySaver()  # one per test: the singleton would see every test's tags

    def test_simple_pause_gives_memory_back_and_resume_keeps_the_address(self):
        # simple.py: a tensor outside any region, a large one in region().
        normal = malloc(MIB)
        fill(normal, MIB, 100)
        with self.saver.region():
            pauseable = malloc(24 * MIB)
        fill(pauseable, 24 * MIB, 100)
        name = tidepool_tag("default", False)
        self.assertEqual(name, "tms:default")
        self.assertEqual(tidepool.tag_stats(name)["allocated_bytes"], 24 * MIB)
        addresses = segment_addresses(name)
        reserved = tidepool.memory_reserved()
        paused_before = tidepool.memory_stats()["tidepool.paused_bytes"]
        self.saver.pause()
        self.assertGreaterEqual(reserved - tidepool.memory_reserved(), 24 * MIB)
        stats = tidepool.tag_stats(name)
        self.assertTrue(stats["paused"])
        self.assertGreaterEqual(stats["paused_bytes"], 24 * MIB)
        self.assertEqual(stats["offloaded_bytes"], 0, "no CPU backup: nothing kept")
        self.assertEqual(tidepool.memory_stats()["tidepool.paused_bytes"] - paused_before, stats["paused_bytes"])
        self.assertTrue(holds(normal, MIB, 100), "memory outside regions is not paused")
        self.saver.resume()
        self.assertEqual(tidepool.memory_reserved(), reserved)
        self.assertEqual(segment_addresses(name), addresses)
        fill(pauseable, 24 * MIB, 7)  # mapped again, writable
        self.assertTrue(holds(pauseable, 24 * MIB, 7))
        free(pauseable, 24 * MIB)
        free(normal, MIB)

    def test_cpu_backup_keeps_contents_and_no_backup_discards_them(self):
        # cpu_backup.py: with and without backup, one pause of everything,
        # an unrelated tensor allocated while paused, then resume.
        with self.saver.region(tag="cb", enable_cpu_backup=True):
            with_backup = malloc(20 * MIB)
            typed = malloc(10 * 20 * 30 * 4)
        with self.saver.region(tag="cb", enable_cpu_backup=False):
            without_backup = malloc(20 * MIB)
        fill(with_backup, 20 * MIB, 10)
        fill(typed, 24000, 42)
        fill(without_backup, 20 * MIB, 20)
        self.saver.pause()
        self.assertGreaterEqual(tidepool.tag_stats("tms:cb+cpu")["offloaded_bytes"], 20 * MIB + 24000)
        self.assertEqual(tidepool.tag_stats("tms:cb")["offloaded_bytes"], 0)
        unrelated = malloc(20 * MIB)
        fill(unrelated, 20 * MIB, 30)
        self.saver.resume()
        self.assertTrue(holds(with_backup, 20 * MIB, 10))
        self.assertTrue(holds(typed, 24000, 42))
        self.assertFalse(holds(without_backup, 20 * MIB, 20), "contents without backup are not restored")
        self.assertEqual(tidepool.tag_stats("tms:cb+cpu")["offloaded_bytes"], 0, "resume frees the host copy")
        for ptr, size in ((with_backup, 20 * MIB), (typed, 24000), (without_backup, 20 * MIB), (unrelated, 20 * MIB)):
            free(ptr, size)

    def test_rl_example_two_tags_paused_and_resumed_one_at_a_time(self):
        # rl_example.py: weights and KV cache under two tags; pause one, then
        # the other, with the memory given back at each step; resume in the
        # other order; addresses unchanged; then a selective pause.
        with self.saver.region(tag="rl_kv_cache"):
            kv = malloc(16 * MIB)
        with self.saver.region(tag="rl_model_weights"):
            weights = malloc(12 * MIB)
        fill(kv, 16 * MIB, 1)
        fill(weights, 12 * MIB, 1)
        kv_segments, weight_segments = segment_addresses("tms:rl_kv_cache"), segment_addresses("tms:rl_model_weights")
        start = tidepool.memory_reserved()
        self.saver.pause("rl_kv_cache")
        after_kv = tidepool.memory_reserved()
        self.assertGreaterEqual(start - after_kv, 16 * MIB)
        self.saver.pause("rl_model_weights")
        after_both = tidepool.memory_reserved()
        self.assertGreaterEqual(after_kv - after_both, 12 * MIB)
        self.saver.resume("rl_model_weights")
        self.assertEqual(tidepool.memory_reserved(), after_kv)
        self.saver.resume("rl_kv_cache")
        self.assertEqual(tidepool.memory_reserved(), start)
        self.assertEqual(segment_addresses("tms:rl_kv_cache"), kv_segments)
        self.assertEqual(segment_addresses("tms:rl_model_weights"), weight_segments)
        fill(kv, 16 * MIB, 2)
        fill(weights, 12 * MIB, 2)
        self.saver.pause("rl_kv_cache")
        self.assertTrue(holds(weights, 12 * MIB, 2), "the other tag stays usable")
        self.assertFalse(tidepool.tag_stats("tms:rl_model_weights")["paused"])
        self.saver.resume("rl_kv_cache")
        free(kv, 16 * MIB)
        free(weights, 12 * MIB)

    def test_nested_regions_restore_the_outer_tag_and_backup(self):
        # nested_region.py: a backed-up outer region holding a grad buffer
        # region without backup; what comes after the inner region goes to
        # the outer tag again.
        with self.saver.region(tag="nr_model", enable_cpu_backup=True):
            weight = malloc(8 * MIB)
            with self.saver.region(tag="nr_grad", enable_cpu_backup=False):
                grad = malloc(8 * MIB)
            extra = malloc(4 * MIB)
        fill(weight, 8 * MIB, 42)
        fill(grad, 8 * MIB, 99)
        fill(extra, 4 * MIB, 7)
        self.assertEqual(tidepool.tag_stats("tms:nr_model+cpu")["num_allocations"], 2)
        self.assertEqual(tidepool.tag_stats("tms:nr_grad")["num_allocations"], 1)
        before = tidepool.memory_reserved()
        self.saver.pause()
        self.assertGreaterEqual(before - tidepool.memory_reserved(), 20 * MIB)
        self.saver.resume()
        self.assertTrue(holds(weight, 8 * MIB, 42))
        self.assertTrue(holds(extra, 4 * MIB, 7))
        fill(grad, 8 * MIB, 0)  # accessible and writable, contents undefined
        self.saver.pause()
        self.saver.resume()
        self.assertTrue(holds(extra, 4 * MIB, 7))
        for ptr, size in ((weight, 8 * MIB), (grad, 8 * MIB), (extra, 4 * MIB)):
            free(ptr, size)

    def test_disable_allocates_untagged_memory_while_paused(self):
        # training_engine.py: pause, then allocate and compute under
        # disable(), whose memory goes back on leaving it.
        with self.saver.region(tag="te_weights", enable_cpu_backup=True):
            weights = [(malloc(size), size) for size in (8 * MIB, MIB, 1024, 42)]
        for ptr, size in weights:
            fill(ptr, size, 42)
        self.saver.pause()
        paused = tidepool.memory_reserved()
        with self.saver.region(tag="te_weights", enable_cpu_backup=True):
            self.assertFalse(malloc(4096), "the paused tag refuses new memory")
            with self.saver.disable():
                inside = malloc(16 * MIB)
                self.assertTrue(inside, "disable() allocates outside the paused tag")
                fill(inside, 16 * MIB, 53)
                self.assertTrue(holds(inside, 16 * MIB, 53))
                free(inside, 16 * MIB)
        self.assertLessEqual(tidepool.memory_reserved(), paused, "leaving disable() gives its memory back")
        self.saver.resume()
        for ptr, size in weights:
            self.assertTrue(holds(ptr, size, 42))
            free(ptr, size)

    def test_a_region_tags_the_calling_thread_only(self):
        seen = {}

        def other():
            seen["ptr"] = malloc(4096)

        with self.saver.region(tag="th"):
            thread = threading.Thread(target=other)
            thread.start()
            thread.join()
            mine = malloc(4096)
        self.assertEqual(tidepool.tag_stats("tms:th")["num_allocations"], 1)
        free(seen["ptr"], 4096)
        free(mine, 4096)

    def test_bad_calls_raise_and_change_nothing(self):
        with self.saver.region(tag="bad", enable_cpu_backup=True):
            ptr = malloc(MIB)
        fill(ptr, MIB, 5)
        with self.assertRaisesRegex(tidepool.TidepoolError, r"unknown tag.*region\(tag='never'\)"):
            self.saver.pause("never")
        with self.assertRaisesRegex(tidepool.TidepoolError, "unknown tag"):
            self.saver.resume("never")
        with self.assertRaisesRegex(tidepool.TidepoolError, r"resume\('bad'\): tag 'bad' is not paused"):
            self.saver.resume("bad")
        with self.assertRaisesRegex(tidepool.TidepoolError, "no tag is paused"):
            self.saver.resume()
        self.saver.pause("bad")
        with self.assertRaisesRegex(tidepool.TidepoolError, r"already paused: tms:bad\+cpu"):
            self.saver.pause("bad")
        with self.assertRaisesRegex(tidepool.TidepoolError, "already paused"):
            self.saver.pause()
        self.assertTrue(tidepool.tag_stats("tms:bad+cpu")["paused"])
        self.saver.resume("bad")
        self.assertTrue(holds(ptr, MIB, 5), "the failed calls changed nothing")
        with self.assertRaises(TypeError):
            self.saver.pause(b"bad")
        with self.assertRaisesRegex(ValueError, "1 to 55 bytes"):
            with self.saver.region(tag="x" * 56):
                pass
        with self.assertRaisesRegex(ValueError, "requires enable_cpu_backup"):
            with self.saver.region(tag="bad", cpu_backup_backend="pinned"):
                pass
        with self.assertRaisesRegex(ValueError, "mutually exclusive"):
            with self.saver.region(tag="bad", enable_cpu_backup=True, enable_disk_backup=True):
                pass
        with self.assertRaisesRegex(NotImplementedError, "enable_disk_backup is not supported"):
            with self.saver.region(tag="bad", enable_disk_backup=True):
                pass
        with self.assertRaisesRegex(NotImplementedError, "get_cpu_backup"):
            self.saver.get_cpu_backup(None)
        with self.assertRaisesRegex(NotImplementedError, "retain_cpu_backup"):
            self.saver.retain_cpu_backup = True
        with self.assertRaisesRegex(ValueError, "hook_mode"):
            self.saver.hook_mode = "other"
        free(ptr, MIB)

    def test_a_pause_of_every_tag_that_fails_midway_resumes_what_it_paused(self):
        with self.saver.region(tag="rb_first", enable_cpu_backup=True):
            first = malloc(2 * MIB)
        with self.saver.region(tag="rb_second"):
            second = malloc(2 * MIB)
        fill(first, 2 * MIB, 11)
        tidepool.pause("tms:rb_second")  # behind the saver's back: its pause of this tag fails
        with self.assertRaisesRegex(tidepool.TidepoolError, "already paused"):
            self.saver.pause()
        self.assertFalse(tidepool.tag_stats("tms:rb_first+cpu")["paused"], "rolled back")
        self.assertTrue(holds(first, 2 * MIB, 11))
        tidepool.resume("tms:rb_second")
        free(first, 2 * MIB)
        free(second, 2 * MIB)

    def test_a_resume_of_every_tag_that_fails_midway_pauses_again_what_it_resumed(self):
        with self.saver.region(tag="rr_first", enable_cpu_backup=True):
            first = malloc(2 * MIB)
        with self.saver.region(tag="rr_second"):
            second = malloc(2 * MIB)
        fill(first, 2 * MIB, 12)
        self.saver.pause()
        tidepool.resume("tms:rr_second")  # behind the saver's back: its resume of this tag fails
        with self.assertRaisesRegex(tidepool.TidepoolError, "not paused"):
            self.saver.resume()
        stats = tidepool.tag_stats("tms:rr_first+cpu")
        self.assertTrue(stats["paused"], "paused again")
        self.assertGreaterEqual(stats["offloaded_bytes"], 2 * MIB, "with its backup")
        tidepool.pause("tms:rr_second")
        self.saver.resume()
        self.assertTrue(holds(first, 2 * MIB, 12))
        free(first, 2 * MIB)
        free(second, 2 * MIB)

    def test_what_frameworks_set_is_accepted(self):
        saver = memory_saver.torch_memory_saver
        self.assertIsInstance(saver, TorchMemorySaver)
        self.assertTrue(saver.enabled)
        saver.hook_mode = "torch"
        saver.hook_mode = "preload"
        saver.memory_margin_bytes = 1 << 30
        self.assertEqual(saver.memory_margin_bytes, 1 << 30)
        self.assertFalse(saver.retain_cpu_backup)
        saver.retain_cpu_backup = False
        with memory_saver.configure_subprocess():
            pass


class VllmSleepMode(unittest.TestCase):
    def setUp(self):
        self.allocator = CuMemAllocator()  # fresh: the singleton would see every test's tags

    def test_get_instance_is_a_singleton(self):
        self.assertIs(CuMemAllocator.get_instance(), CuMemAllocator.get_instance())
        self.assertEqual(tidepool_vllm.tidepool_tag("weights"), "vllm:weights")

    def test_sleep_offloads_weights_discards_the_kv_cache_and_wake_up_restores(self):
        # vLLM's worker: load_model under "weights" (usage 0 first),
        # initialize_from_config under "kv_cache", sleep(level=1), wake_up.
        a = self.allocator
        self.assertEqual(a.get_current_usage(), 0)
        with a.use_memory_pool(tag="v1_weights"):
            self.assertEqual(a.current_tag, "v1_weights")
            weights = malloc(10 * MIB)
        self.assertEqual(a.current_tag, "default")
        with a.use_memory_pool(tag="v1_kv"):
            kv = malloc(16 * MIB)
        fill(weights, 10 * MIB, 3)
        fill(kv, 16 * MIB, 4)
        self.assertEqual(a.get_current_usage(), 26 * MIB)
        segments = segment_addresses("vllm:v1_weights")
        reserved = tidepool.memory_reserved()
        a.sleep(offload_tags=("v1_weights",))
        self.assertGreaterEqual(reserved - tidepool.memory_reserved(), 26 * MIB)
        self.assertGreaterEqual(tidepool.tag_stats("vllm:v1_weights")["offloaded_bytes"], 10 * MIB)
        self.assertEqual(tidepool.tag_stats("vllm:v1_kv")["offloaded_bytes"], 0)
        self.assertTrue(tidepool.tag_stats("vllm:v1_kv")["paused"])
        self.assertEqual(a.get_current_usage(), 26 * MIB, "the tensors live on while asleep")
        a.sleep(offload_tags=("v1_weights",))  # asleep already: nothing to do (as vLLM's)
        a.wake_up(["v1_weights"])
        self.assertTrue(holds(weights, 10 * MIB, 3))
        self.assertEqual(segment_addresses("vllm:v1_weights"), segments)
        self.assertTrue(tidepool.tag_stats("vllm:v1_kv")["paused"], "only the tags named")
        a.wake_up()
        self.assertFalse(tidepool.tag_stats("vllm:v1_kv")["paused"])
        fill(kv, 16 * MIB, 5)
        self.assertTrue(holds(kv, 16 * MIB, 5))
        # Level 2: nothing offloaded.
        a.sleep(offload_tags=tuple())
        self.assertEqual(tidepool.tag_stats("vllm:v1_weights")["offloaded_bytes"], 0)
        a.wake_up()
        free(weights, 10 * MIB)
        free(kv, 16 * MIB)
        self.assertEqual(a.get_current_usage(), 0)

    def test_sleep_offloads_the_default_tag_when_given_none(self):
        a = self.allocator
        with a.use_memory_pool():
            ptr = malloc(2 * MIB)
        fill(ptr, 2 * MIB, 9)
        self.assertEqual(tidepool.tag_stats("vllm:default")["allocated_bytes"], 2 * MIB)
        a.sleep()
        self.assertGreaterEqual(tidepool.tag_stats("vllm:default")["offloaded_bytes"], 2 * MIB)
        a.wake_up("default")
        self.assertTrue(holds(ptr, 2 * MIB, 9))
        free(ptr, 2 * MIB)

    def test_discard_gives_one_tag_back(self):
        a = self.allocator
        with a.use_memory_pool(tag="v3_kv"):
            kv = malloc(4 * MIB)
        with a.use_memory_pool(tag="v3_weights"):
            weights = malloc(4 * MIB)
        fill(weights, 4 * MIB, 8)
        a.discard("v3_kv")
        self.assertTrue(tidepool.tag_stats("vllm:v3_kv")["paused"])
        self.assertFalse(tidepool.tag_stats("vllm:v3_weights")["paused"])
        self.assertTrue(holds(weights, 4 * MIB, 8))
        a.wake_up(["v3_kv"])
        fill(kv, 4 * MIB, 1)
        free(kv, 4 * MIB)
        free(weights, 4 * MIB)

    def test_bad_calls_raise(self):
        a = self.allocator
        with a.use_memory_pool(tag="v4"):
            ptr = malloc(MIB)
        with self.assertRaisesRegex(tidepool.TidepoolError, "unknown tag: 'nope'"):
            a.wake_up(["nope"])
        with self.assertRaisesRegex(tidepool.TidepoolError, "unknown tag: 'nope'"):
            a.discard(("nope",))
        with self.assertRaisesRegex(tidepool.TidepoolError, "not asleep: 'v4'"):
            a.wake_up(["v4"])
        with self.assertRaises(TypeError):
            with a.use_memory_pool(tag=3):
                pass
        a.sleep(offload_tags=())
        with a.use_memory_pool(tag="v4"):
            self.assertFalse(malloc(4096), "an asleep tag refuses new memory")
        self.assertIn('"vllm:v4" is paused', _native.last_error())
        a.wake_up()
        free(ptr, MIB)

    def test_patch_vllm_replaces_what_the_worker_looks_up(self):
        saved = {name: sys.modules.get(name) for name in ("vllm", "vllm.device_allocator", "vllm.device_allocator.cumem", "vllm.v1", "vllm.v1.worker", "vllm.v1.worker.gpu_worker")}
        try:
            fake = {name: types.ModuleType(name) for name in saved}
            fake["vllm.device_allocator.cumem"].CuMemAllocator = object
            fake["vllm.device_allocator.cumem"].cumem_available = False
            fake["vllm.device_allocator"].get_mem_allocator_instance = lambda: None
            fake["vllm.v1.worker.gpu_worker"].CuMemAllocator = object
            sys.modules.update(fake)
            replaced = tidepool_vllm.patch_vllm()
            self.assertEqual(
                replaced,
                [
                    "vllm.device_allocator.cumem.CuMemAllocator",
                    "vllm.device_allocator.cumem.cumem_available",
                    "vllm.device_allocator.get_mem_allocator_instance",
                    "vllm.v1.worker.gpu_worker.CuMemAllocator",
                ],
            )
            self.assertIs(fake["vllm.v1.worker.gpu_worker"].CuMemAllocator, CuMemAllocator)
            self.assertIs(fake["vllm.device_allocator"].get_mem_allocator_instance(), CuMemAllocator.get_instance())
            for name in saved:
                del sys.modules[name]
            sys.modules["vllm"] = None  # not importable
            with self.assertRaisesRegex(tidepool.TidepoolError, "patch_vllm: found no vLLM module"):
                tidepool_vllm.patch_vllm()
        finally:
            for name, module in saved.items():
                if module is None:
                    sys.modules.pop(name, None)
                else:
                    sys.modules[name] = module

    def test_patch_vllm_replaces_the_names_of_newer_vllm_under_vllm_backends_platform(self):
        # Newer vLLM: the allocator under vllm.backends.platform.device_allocator,
        # vllm.device_allocator a shim forwarding there for the names it lacks,
        # the worker importing get_mem_allocator_instance at its top, and the
        # default sleep-mode backend ("cumem") calling it at each sleep.
        canonical = "vllm.backends.platform.device_allocator"
        names = ("vllm", "vllm.device_allocator", "vllm.backends", "vllm.backends.platform", canonical, canonical + ".cumem", "vllm.v1", "vllm.v1.worker", "vllm.v1.worker.gpu_worker")
        saved = {name: sys.modules.get(name) for name in names}
        try:
            fake = {name: types.ModuleType(name) for name in names}
            fake[canonical + ".cumem"].CuMemAllocator = object
            fake[canonical].get_mem_allocator_instance = lambda: None
            fake["vllm.device_allocator"].__getattr__ = lambda name: getattr(fake[canonical], name)
            fake["vllm.v1.worker.gpu_worker"].get_mem_allocator_instance = fake[canonical].get_mem_allocator_instance
            sys.modules.update(fake)
            replaced = tidepool_vllm.patch_vllm()
            self.assertEqual(
                replaced,
                [
                    "vllm.device_allocator.get_mem_allocator_instance",  # set on the shim, found through its forward
                    canonical + ".cumem.CuMemAllocator",
                    canonical + ".get_mem_allocator_instance",
                    "vllm.v1.worker.gpu_worker.get_mem_allocator_instance",
                ],
            )
            # What the sleep-mode backend and the worker then get, by either path.
            from vllm.device_allocator import get_mem_allocator_instance  # the shim's forward

            self.assertIs(get_mem_allocator_instance(), CuMemAllocator.get_instance())
            self.assertIs(fake["vllm.v1.worker.gpu_worker"].get_mem_allocator_instance(), CuMemAllocator.get_instance())
        finally:
            for name, module in saved.items():
                if module is None:
                    sys.modules.pop(name, None)
                else:
                    sys.modules[name] = module


PRELUDE = """
import ctypes, sys
import torch, tidepool
tidepool.install(allow_host=True)
# No GPU here: say CUDA has started, as it would have after the first tensor.
torch.cuda.memory.is_initialized = lambda: True
torch.cuda.current_device = lambda: 0
from tidepool import _native
from tidepool.memory_saver import torch_memory_saver
from tidepool.vllm import CuMemAllocator
# The entry point PyTorch's CUDAPluggableAllocator calls for every tensor.
torch_malloc = _native.torch_lib().tidepool_torch_malloc
torch_malloc.restype = ctypes.c_void_p
torch_malloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
torch_free = _native.torch_lib().tidepool_torch_free
torch_free.restype = None
torch_free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
MIB = 1 << 20
"""


@unittest.skipUnless(HAVE_TORCH, "torch not installed")
class UnderTorch(unittest.TestCase):
    def run_script(self, body):
        script = PRELUDE + textwrap.dedent(body) + "\nprint('script ok')\n"
        done = subprocess.run([sys.executable, "-W", "ignore", "-c", script], capture_output=True, text=True, timeout=300)
        self.assertEqual(done.returncode, 0, done.stdout + done.stderr)
        self.assertIn("script ok", done.stdout)

    def test_the_one_import_switch_pauses_what_torch_allocates_in_a_region(self):
        # What sglang does with torch_memory_saver, with the import changed:
        # torch's allocator (tidepool) serves the region's tensors under
        # its tag; torch.cuda's figures show the pause.
        self.run_script("""
            torch_memory_saver.hook_mode = "torch"
            with torch_memory_saver.region(tag="weights", enable_cpu_backup=True):
                ptr = torch_malloc(8 * MIB, 0, None)
            ctypes.memset(ptr, 77, 8 * MIB)
            reserved = torch.cuda.memory_reserved()
            torch_memory_saver.pause("weights")
            assert torch.cuda.memory_reserved() <= reserved - 8 * MIB, (torch.cuda.memory_reserved(), reserved)
            stats = torch.cuda.memory_stats()
            assert stats["tidepool.paused_bytes"] >= 8 * MIB and stats["tidepool.offloaded_bytes"] >= 8 * MIB, stats
            torch_memory_saver.resume("weights")
            assert ctypes.string_at(ptr, 16) == bytes([77]) * 16
            assert torch.cuda.memory_reserved() == reserved
            torch_free(ptr, 8 * MIB, 0, None)
        """)

    def test_the_vllm_allocator_under_torch(self):
        self.run_script("""
            allocator = CuMemAllocator.get_instance()
            with allocator.use_memory_pool(tag="weights"):
                weights = torch_malloc(4 * MIB, 0, None)
            with allocator.use_memory_pool(tag="kv_cache"):
                kv = torch_malloc(6 * MIB, 0, None)
            ctypes.memset(weights, 5, 4 * MIB)
            assert allocator.get_current_usage() == 10 * MIB
            free_before = torch.cuda.memory_reserved()
            allocator.sleep(offload_tags=("weights",))
            assert torch.cuda.memory_reserved() <= free_before - 10 * MIB
            allocator.wake_up(tags=["weights"])
            allocator.wake_up(tags=["kv_cache"])
            assert ctypes.string_at(weights, 16) == bytes([5]) * 16
            torch_free(weights, 4 * MIB, 0, None)
            torch_free(kv, 6 * MIB, 0, None)
        """)


if __name__ == "__main__":
    unittest.main()
