"""tidepool.cupy inside the real CuPy, on the host backend (no GPU here).

What runs here: the module imports, use() makes tidepool.cupy.malloc CuPy's
allocator (and refuses the host backend unless allow_host), and
malloc_on(size, device, stream), the layer under malloc, gives real
cupy.cuda.MemoryPointer / UnownedMemory objects over tidepool's blocks:
cupy.ndarray is built over them, tidepool's statistics see each block,
CuPy dropping the array frees it (with its size and stream), out of memory
raises cupy.cuda.memory.OutOfMemoryError with tidepool's report. What only
a GPU runs: malloc itself (it reads CuPy's current device and stream, which
needs a driver) and kernels on the memory: cuda/check/runtimes_check.py.

Skipped without CuPy, except when TIDEPOOL_REQUIRE_TORCH=1 (CI, whose venv
./test.sh makes with CuPy), where a missing CuPy fails.
"""
import gc
import importlib.util
import os
import pickle
import unittest

HAVE_CUPY = importlib.util.find_spec("cupy") is not None
if not HAVE_CUPY and os.environ.get("TIDEPOOL_REQUIRE_TORCH") == "1":
    raise RuntimeError("cupy is required here (TIDEPOOL_REQUIRE_TORCH=1: ./test.sh installs it) but not installed")

import tidepool

MIB = 1 << 20


def on_host_backend():
    return os.environ.get("TIDEPOOL_CONF", "").replace(" ", "").find("backend:host") >= 0


@unittest.skipUnless(HAVE_CUPY, "cupy not installed")
@unittest.skipUnless(on_host_backend(), "these tests run on TIDEPOOL_CONF=backend:host")
class InCuPy(unittest.TestCase):
    def setUp(self):
        import cupy

        import tidepool.cupy

        self.cupy = cupy
        self.tc = tidepool.cupy
        gc.collect()
        self.allocated = tidepool.memory_allocated()

    def tearDown(self):
        gc.collect()
        self.assertEqual(tidepool.memory_allocated(), self.allocated, "a block was not freed")

    def block_segment(self, ptr):
        for segment in tidepool.snapshot()["segments"]:
            for block in segment["blocks"]:
                if block["address"] == ptr:
                    return segment, block
        self.fail(f"no block at {ptr:#x} in tidepool's snapshot")

    def test_use_makes_malloc_cupys_allocator(self):
        before = self.cupy.cuda.get_allocator()
        try:
            with self.assertRaisesRegex(tidepool.TidepoolError, "backend is 'host'"):
                self.tc.use()
            self.tc.use(allow_host=True)
            self.assertIs(self.cupy.cuda.get_allocator(), self.tc.malloc)
        finally:
            self.cupy.cuda.set_allocator(before)

    def test_an_array_over_tidepool_memory_is_freed_when_cupy_drops_it(self):
        frees = tidepool.memory_stats()["tidepool.num_frees"]
        memptr = self.tc.malloc_on(4000, 0, self.cupy.cuda.Stream.null)
        self.assertIsInstance(memptr, self.cupy.cuda.MemoryPointer)
        self.assertIsInstance(memptr.mem, self.cupy.cuda.UnownedMemory)
        self.assertEqual((memptr.device_id, memptr.mem.size), (0, 4000))
        array = self.cupy.ndarray((1000,), dtype="float32", memptr=memptr)
        self.assertEqual(array.data.ptr, memptr.ptr)
        self.assertEqual(array.nbytes, 4000)
        self.assertGreaterEqual(tidepool.memory_allocated() - self.allocated, 4000)
        segment, block = self.block_segment(memptr.ptr)
        self.assertEqual((block["state"], block["requested_size"], segment["stream"]), ("active_allocated", 4000, 0))
        del memptr
        self.assertGreater(tidepool.memory_allocated(), self.allocated, "the array still holds its memory")
        view = array[10:20]
        del array
        self.assertGreater(tidepool.memory_allocated(), self.allocated, "a view still holds the memory")
        del view
        self.assertEqual(tidepool.memory_allocated(), self.allocated)
        self.assertEqual(tidepool.memory_stats()["tidepool.num_frees"], frees + 1)
        self.assertEqual(tidepool.memory_stats()["tidepool.num_size_mismatches"], 0)

    def test_the_block_belongs_to_the_stream_it_was_allocated_for(self):
        class Foreign:  # another library's stream, by the CUDA stream protocol
            def __cuda_stream__(self):
                return (0, 0x5A00)

        stream = self.cupy.cuda.Stream.from_external(Foreign())
        memptr = self.tc.malloc_on(3 * MIB, 0, stream)
        segment, _ = self.block_segment(memptr.ptr)
        self.assertEqual(segment["stream"], 0x5A00)
        # The owner keeps the stream alive as long as the block lives.
        self.assertIs(memptr.mem._owner.stream, stream)
        invalid = tidepool.memory_stats()["tidepool.num_invalid_frees"]
        del memptr
        self.assertEqual(tidepool.memory_stats()["tidepool.num_invalid_frees"], invalid)

    def test_out_of_memory_raises_cupys_error_with_tidepools_report(self):
        ooms = tidepool.memory_stats()["num_ooms"]
        with self.assertRaises(self.cupy.cuda.memory.OutOfMemoryError) as caught:
            self.tc.malloc_on(1 << 44, 0, 0)
        error = caught.exception
        self.assertIsInstance(error, self.tc.OutOfMemoryError)
        message = str(error)
        self.assertIn("Out of memory allocating 17,592,186,044,416 bytes", message)
        self.assertIn("tidepool: out of memory on device 0: tried to allocate 16.00 TiB", message)
        self.assertTrue(error.report.startswith("tidepool: out of memory"), error.report)
        self.assertEqual(str(pickle.loads(pickle.dumps(error))), message)
        self.assertEqual(tidepool.memory_stats()["num_ooms"], ooms + 1)

    def test_zero_bytes_and_a_bad_device(self):
        memptr = self.tc.malloc_on(0, 0, 0)
        self.assertEqual((memptr.ptr, memptr.mem.size, memptr.device_id), (0, 0, 0))
        with self.assertRaisesRegex(tidepool.TidepoolError, "no device 7"):
            self.tc.malloc_on(16, 7, 0)

    def test_many_sizes_round_trip(self):
        requested = tidepool.memory_stats()["requested_bytes.all.current"]
        sizes = (1, 511, 512, 4096, MIB + 1, 5 * MIB)
        blocks = [self.tc.malloc_on(size, 0, 0) for size in sizes]
        self.assertEqual(len({b.ptr for b in blocks}), len(blocks))
        self.assertEqual(tidepool.memory_stats()["requested_bytes.all.current"] - requested, sum(sizes))
        del blocks
        self.assertEqual(tidepool.memory_stats()["requested_bytes.all.current"], requested)


if __name__ == "__main__":
    unittest.main()
