"""tidepool.region, pause, resume and tag_stats over the real library
(ctypes), without torch, on the host backend TIDEPOOL_CONF selects: memory
is host memory, so contents can be written and read back."""
import ctypes
import os
import subprocess
import sys
import threading
import unittest

import tidepool
from tidepool import _native

MIB = 1 << 20


def malloc(size):
    return _native.lib().tidepool_malloc(size, 0, None)


def free(ptr, size):
    _native.lib().tidepool_free(ptr, size, 0, None)


def fill(ptr, size, seed):
    data = bytes((seed * 7 + i) % 251 for i in range(4096))
    for offset in range(0, size - 4096 + 1, 64 * 1024):
        ctypes.memmove(ptr + offset, data, 4096)


def intact(ptr, size, seed):
    data = bytes((seed * 7 + i) % 251 for i in range(4096))
    return all(ctypes.string_at(ptr + offset, 4096) == data for offset in range(0, size - 4096 + 1, 64 * 1024))


class Tags(unittest.TestCase):
    def test_an_offloaded_pause_keeps_every_byte_and_address(self):
        with tidepool.region("py-weights"):
            blocks = [(malloc(size), size) for size in (8192, 300_000, 3 * MIB, 10 * MIB)]
        for seed, (ptr, size) in enumerate(blocks):
            self.assertTrue(ptr)
            fill(ptr, size, seed)
        before = tidepool.tag_stats("py-weights")
        self.assertEqual(before["num_allocations"], 4)
        self.assertFalse(before["paused"])
        reserved = tidepool.memory_reserved()
        tidepool.pause("py-weights", offload=True)
        paused = tidepool.tag_stats("py-weights")
        self.assertTrue(paused["paused"])
        self.assertEqual(paused["paused_bytes"], before["reserved_bytes"])
        self.assertGreaterEqual(paused["offloaded_bytes"], before["allocated_bytes"])
        self.assertEqual(tidepool.memory_reserved(), reserved - before["reserved_bytes"])
        stats = tidepool.memory_stats()
        self.assertEqual(stats["tidepool.paused_bytes"], paused["paused_bytes"])
        self.assertEqual(stats["tidepool.offloaded_bytes"], paused["offloaded_bytes"])
        tidepool.resume("py-weights")
        for seed, (ptr, size) in enumerate(blocks):
            self.assertTrue(intact(ptr, size, seed), f"block {seed} restored")
        self.assertEqual(tidepool.tag_stats("py-weights")["offloaded_bytes"], 0)
        for ptr, size in blocks:
            free(ptr, size)

    def test_regions_nest_and_restore_the_outer_tag(self):
        with tidepool.region("py-outer"):
            with tidepool.region("py-inner"):
                inner = malloc(4096)
            outer = malloc(4096)
        plain = malloc(4096)
        self.assertEqual(tidepool.tag_stats("py-inner")["num_allocations"], 1)
        self.assertEqual(tidepool.tag_stats("py-outer")["num_allocations"], 1)
        tidepool.pause("py-outer")  # plain memory is not the tag's
        ctypes.memset(plain, 1, 4096)
        tidepool.resume("py-outer")
        for ptr in (inner, outer, plain):
            free(ptr, 4096)

    def test_a_region_is_the_threads_own(self):
        seen = {}

        def other():
            seen["ptr"] = malloc(4096)

        with tidepool.region("py-thread"):
            thread = threading.Thread(target=other)
            thread.start()
            thread.join()
        self.assertEqual(tidepool.tag_stats("py-thread")["num_allocations"], 0, "another thread's allocation is untagged")
        free(seen["ptr"], 4096)

    def test_discard_gives_memory_back_and_keeps_nothing_on_the_host(self):
        with tidepool.region("py-kv"):
            ptr = malloc(6 * MIB)
        tidepool.pause("py-kv", offload=False)
        self.assertEqual(tidepool.tag_stats("py-kv")["offloaded_bytes"], 0)
        tidepool.resume("py-kv", device=0)
        ctypes.memset(ptr, 3, 6 * MIB)
        free(ptr, 6 * MIB)

    def test_bad_calls_raise_and_change_nothing(self):
        with tidepool.region("py-bad"):
            ptr = malloc(MIB)
        with self.assertRaisesRegex(tidepool.TidepoolError, "unknown"):
            tidepool.pause("py-never-set")
        with self.assertRaisesRegex(tidepool.TidepoolError, "not paused"):
            tidepool.resume("py-bad")
        with self.assertRaisesRegex(tidepool.TidepoolError, "at most 63"):
            with tidepool.region("x" * 64):
                pass
        with self.assertRaises(TypeError):
            tidepool.region(b"bytes")
        with self.assertRaisesRegex(tidepool.TidepoolError, "no device"):
            tidepool.pause("py-bad", device=7)
        with self.assertRaisesRegex(tidepool.TidepoolError, "cannot be paused"):
            tidepool.pause("default")
        tidepool.pause("py-bad", offload=True)
        with self.assertRaisesRegex(tidepool.TidepoolError, "already paused"):
            tidepool.pause("py-bad")
        with tidepool.region("py-bad"):
            self.assertFalse(malloc(4096), "allocating under a paused tag fails")
        self.assertIn('"py-bad" is paused', _native.last_error())
        self.assertTrue(tidepool.tag_stats("py-bad")["paused"])
        tidepool.resume("py-bad")
        free(ptr, MIB)

    def test_snapshots_mark_paused_segments_with_their_tag(self):
        with tidepool.region("py-snap"):
            ptr = malloc(4 * MIB)
        tidepool.pause("py-snap")
        segments = [s for s in tidepool.snapshot()["segments"] if s["tag"] == "py-snap"]
        self.assertTrue(segments and all(s["paused"] for s in segments))
        tidepool.resume("py-snap")
        segments = [s for s in tidepool.snapshot()["segments"] if s["tag"] == "py-snap"]
        self.assertTrue(segments and not any(s["paused"] for s in segments))
        free(ptr, 4 * MIB)


try:
    import numpy  # noqa: F401  (the RL example computes with it)
    HAVE_NUMPY = True
except ImportError:
    HAVE_NUMPY = False


@unittest.skipUnless(HAVE_NUMPY, "numpy not installed")
class Example(unittest.TestCase):
    def test_the_rl_loop_example_runs_and_its_losses_match_a_run_without_pausing(self):
        example = os.path.join(os.path.dirname(__file__), "..", "examples", "rl_loop.py")
        env = dict(os.environ)
        out = subprocess.run([sys.executable, example, "--steps", "3"], capture_output=True, text=True, env=env, timeout=300)
        self.assertEqual(out.returncode, 0, out.stdout + out.stderr)
        self.assertIn("losses identical to the run without pausing", out.stdout)
        self.assertIn("after pause(\"train\", offload=True)", out.stdout)


if __name__ == "__main__":
    unittest.main()
