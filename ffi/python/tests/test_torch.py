"""tidepool inside the real torch: install() hands PyTorch the C++ entry
points and every hook, and torch.cuda's memory functions, called as any
training loop calls them, answer from tidepool.

Each test runs a script in a process of its own (install() must come before
CUDA starts, once per process). There is no GPU here, so CUDA never starts:
the scripts tell torch.cuda it has (memory.is_initialized, current_device),
which is all that stands between its memory functions and the allocator;
everything after that is PyTorch's own code over tidepool's answers.

Skipped without torch, except when TIDEPOOL_REQUIRE_TORCH=1 (CI), where a
missing torch fails.
"""
import importlib.util
import os
import subprocess
import sys
import tempfile
import textwrap
import unittest

HAVE_TORCH = importlib.util.find_spec("torch") is not None
if not HAVE_TORCH and os.environ.get("TIDEPOOL_REQUIRE_TORCH") == "1":
    raise RuntimeError("torch is required here (TIDEPOOL_REQUIRE_TORCH=1) but not installed")

PRELUDE = """
import os, sys, ctypes
import torch, tidepool
from tidepool import _native
tidepool.install(allow_host=True)
# No GPU here: say CUDA has started, as it would have after the first tensor.
torch.cuda.memory.is_initialized = lambda: True
torch.cuda.current_device = lambda: 0
lib = _native.lib()
MIB = 1 << 20
"""


@unittest.skipUnless(HAVE_TORCH, "torch not installed")
class InTorch(unittest.TestCase):
    def run_script(self, body, env=None):
        script = PRELUDE + textwrap.dedent(body) + "\nprint('script ok')\n"
        done = subprocess.run(
            [sys.executable, "-W", "ignore", "-c", script],
            env=dict(os.environ, **(env or {})),
            capture_output=True,
            text=True,
            timeout=300,
        )
        self.assertEqual(done.returncode, 0, done.stdout + done.stderr)
        self.assertIn("script ok", done.stdout)
        return done.stdout

    def test_torch_takes_the_entry_points_and_every_hook(self):
        # torch's own entry points to its graph-pool hooks (what CUDA graph
        # capture and use_mem_pool call) reach tidepool with the pool's id
        # intact: the C++ call and tidepool's C signature agree.
        self.run_script("""
            assert torch._C._cuda_getAllocator() is tidepool._install._plug.allocator(), 'not the current allocator'
            torch._C._cuda_beginAllocateToPool(0, (9, 4))
            ptr = lib.tidepool_malloc(1 << 20, 0, None)
            torch._C._cuda_endAllocateToPool(0, (9, 4))
            pools = {tuple(s['segment_pool_id']) for s in tidepool.snapshot()['segments']
                     if any(b['address'] == ptr for b in s['blocks'])}
            assert pools == {(9, 4)}, pools
            lib.tidepool_free(ptr, 1 << 20, 0, None)
            torch._C._cuda_releasePool(0, (9, 4))
        """)

    def test_torch_cuda_memory_functions_answer_from_tidepool(self):
        self.run_script("""
            before = torch.cuda.memory_allocated()
            ptr = lib.tidepool_malloc(7 * MIB + 100, 0, None)
            assert torch.cuda.memory_allocated() == tidepool.memory_allocated() == before + 7 * MIB + 512
            assert torch.cuda.memory_allocated(0) == torch.cuda.memory_allocated(torch.device("cuda:0"))
            assert torch.cuda.memory_reserved() == tidepool.memory_reserved() >= 7 * MIB
            stats = torch.cuda.memory_stats()
            mine = tidepool.memory_stats()
            assert stats == mine, set(stats.items()) ^ set(mine.items())
            assert stats["requested_bytes.all.current"] == 7 * MIB + 100
            nested = torch.cuda.memory_stats_as_nested_dict()
            assert nested["allocated_bytes"]["large_pool"]["current"] == 7 * MIB + 512
            lib.tidepool_free(ptr, 7 * MIB + 100, 0, None)

            # Peaks, as training loops read and reset them.
            assert torch.cuda.max_memory_allocated() >= before + 7 * MIB
            assert torch.cuda.max_memory_reserved() >= 7 * MIB
            torch.cuda.reset_peak_memory_stats()
            assert torch.cuda.max_memory_allocated() == torch.cuda.memory_allocated()
            assert torch.cuda.max_memory_reserved() == torch.cuda.memory_reserved()
            p = lib.tidepool_malloc(3 * MIB, 0, None); lib.tidepool_free(p, 3 * MIB, 0, None)
            torch.cuda.reset_max_memory_allocated()
            assert torch.cuda.max_memory_allocated() == torch.cuda.memory_allocated()
            assert torch.cuda.memory_stats()["allocation.all.allocated"] > 0
            torch.cuda.reset_accumulated_memory_stats()
            stats = torch.cuda.memory_stats()
            assert stats["allocation.all.allocated"] == 0 and stats["allocated_bytes.all.freed"] == 0, stats

            # PyTorch's own summary table, over tidepool's figures.
            keep = lib.tidepool_malloc(5 * MIB, 0, None)
            summary = torch.cuda.memory_summary(0)  # (no GPU: torch cannot name the current device)
            assert "PyTorch CUDA memory summary, device ID 0" in summary, summary
            assert "Allocated memory" in summary and "5120 KiB" in summary, summary
            assert torch.cuda.memory_summary(0, abbreviated=True).count("from large pool") == 0

            # Snapshots: the segments and, with history, the timeline.
            segments = torch.cuda.memory_snapshot()
            assert any(b["address"] == keep for s in segments for b in s["blocks"]), segments
            torch.cuda.memory._record_memory_history(max_entries=100)
            p = lib.tidepool_malloc(MIB, 0, None); lib.tidepool_free(p, MIB, 0, None)
            snap = torch.cuda.memory._snapshot()
            actions = [(e["action"], e["addr"]) for e in snap["device_traces"][0]]
            assert ("alloc", p) in actions and ("free_requested", p) in actions, actions
            assert torch.cuda.memory_snapshot(include_traces=False) == snap["segments"]
            path = os.path.join(os.environ["OUT"], "torch.pickle")
            torch.cuda.memory._dump_snapshot(path)
            dumped = tidepool.load_snapshot(path)
            assert dumped["segments"] == tidepool.snapshot()["segments"]
            torch.cuda.memory._record_memory_history(enabled=None)
            assert torch.cuda.memory._snapshot()["device_traces"] == [[]]
            lib.tidepool_free(keep, 5 * MIB, 0, None)
            print("redirected:", ",".join(tidepool._torch.redirected()))
        """, env={"OUT": tempfile.mkdtemp()})

    def test_pytorchs_argument_errors_stay_pytorchs(self):
        self.run_script("""
            for kwargs, message in [
                (dict(enabled="sometimes"), "expected state to be"),
                (dict(context="everything"), "expected context to be"),
                (dict(stacks="cpp"), "expected stacks to be 'python', or 'all'"),
            ]:
                try:
                    torch.cuda.memory._record_memory_history(**kwargs)
                except RuntimeError as err:
                    assert message in str(err), err
                else:
                    raise AssertionError(f"{kwargs} accepted")
            try:
                torch.cuda.memory._record_memory_history(colour="blue")
            except TypeError:
                pass
            else:
                raise AssertionError("an unknown argument accepted")
        """)

    def test_python_frames_through_torchs_record_memory_history(self):
        out = tempfile.mkdtemp()
        self.run_script("""
            torch.cuda.memory._record_memory_history(stacks="python", max_entries=1000)
            entry = ctypes.PyDLL(_native.torch_library_path())  # as PyTorch calls it, GIL held
            entry.tidepool_torch_malloc.restype = ctypes.c_void_p
            entry.tidepool_torch_malloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]

            def make_activation():
                return entry.tidepool_torch_malloc(9 * MIB, 0, None)

            ptr = make_activation()
            path = os.path.join(os.environ["OUT"], "frames.pickle")
            torch.cuda.memory._dump_snapshot(path)
            snap = tidepool.load_snapshot(path)
            block = next(b for s in snap["segments"] for b in s["blocks"] if b["address"] == ptr)
            assert block["frames"][0]["name"] == "make_activation", block["frames"]
            # memory_viz's plots, as PyTorch draws them, take it.
            from torch.cuda import _memory_viz
            assert "<!DOCTYPE html>" in _memory_viz.trace_plot(snap)
            assert "<!DOCTYPE html>" in _memory_viz.segment_plot(snap)
            lib.tidepool_free(ptr, 9 * MIB, 0, None)
        """, env={"OUT": out})

    def test_out_of_memory_observers_through_torch(self):
        self.run_script("""
            heard = []
            torch._C._cuda_attach_out_of_memory_observer(lambda *args: heard.append(args))
            assert not lib.tidepool_malloc(1 << 40, 0, None)
            assert len(heard) == 1 and heard[0][:2] == (0, 1 << 40), heard
        """)

    def test_uninstall_gives_pytorch_its_functions_back(self):
        self.run_script("""
            assert "_cuda_memoryStats" in tidepool._torch.redirected()
            tidepool.uninstall()
            assert not tidepool._torch.redirected()
            try:
                torch._C._cuda_memoryStats(0)
            except RuntimeError as err:
                pass  # PyTorch's own again, which needs a GPU here
            else:
                raise AssertionError("still tidepool's")
        """)


if __name__ == "__main__":
    unittest.main()
