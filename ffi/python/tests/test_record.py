"""The meta-device recorder (needs torch; skipped without it)."""
import csv
import os
import tempfile
import unittest


try:
    import torch  # noqa: F401
    HAVE_TORCH = True
except ImportError:
    HAVE_TORCH = False


@unittest.skipUnless(HAVE_TORCH, "torch not installed")
class Record(unittest.TestCase):
    def rows(self, workload, **kwargs):
        from tidepool.record import record_training

        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "trace.csv")
            allocs = record_training(workload, path, **kwargs)
            with open(path) as f:
                rows = list(csv.DictReader(f))
        return allocs, rows

    def test_training_steps_become_a_consistent_rmm_log(self):
        allocs, rows = self.rows("mlp", steps=2, batch=8)
        self.assertEqual(sum(r["Action"] == "allocate" for r in rows), allocs)
        live = {}
        for r in rows:
            self.assertEqual(set(r), {"Thread", "Time", "Action", "Pointer", "Size", "Stream"})
            if r["Action"] == "allocate":
                self.assertNotIn(r["Pointer"], live, "a pointer reused while live")
                live[r["Pointer"]] = int(r["Size"])
            else:
                self.assertEqual(live.pop(r["Pointer"]), int(r["Size"]), "a free of an unknown pointer")
        # The weights are recorded first: the first Linear's 1024x4096 fp32 weight.
        self.assertEqual(int(rows[0]["Size"]), 1024 * 4096 * 4)
        # AdamW keeps two states per parameter, and the parameters stay: all live at the end.
        params = 1024 * 4096 + 4096 + 4096 * 4096 + 4096 + 4096 * 1024 + 1024
        self.assertGreaterEqual(sum(live.values()), 3 * params * 4)

    def test_generation_grows_every_key_and_value_cache_by_one_token_per_step(self):
        allocs, rows = self.rows("kv-generate", steps=3, batch=2)
        sizes = [int(r["Size"]) for r in rows if r["Action"] == "allocate"]
        for tokens in (128, 129, 130):  # the prompt, then one more token per step
            self.assertGreaterEqual(sizes.count(2 * tokens * 1024 * 4), 24, f"12 layers' caches of {tokens} tokens")

    def test_inference_frees_every_activation(self):
        allocs, rows = self.rows("mlp", steps=2, batch=8, inference=True)
        frees = sum(r["Action"] == "free" for r in rows)
        params = 6  # three weights and three biases stay live
        self.assertEqual(allocs - frees, params)


if __name__ == "__main__":
    unittest.main()


@unittest.skipUnless(HAVE_TORCH, "torch not installed")
class MemoryViz(unittest.TestCase):
    def test_pytorchs_memory_viz_draws_tidepools_snapshot(self):
        import tidepool
        import torch.cuda._memory_viz as viz

        lib = tidepool._native.lib()
        tidepool.record_memory_history(max_entries=1000)  # the timeline's events
        try:
            ptr = lib.tidepool_malloc(12345, 0, None)
            other = lib.tidepool_malloc(3 << 20, 0, None)
            lib.tidepool_free(other, 3 << 20, 0, None)
            snapshot = tidepool.snapshot()
            lib.tidepool_free(ptr, 12345, 0, None)
        finally:
            tidepool.record_memory_history(enabled=False)
        self.assertTrue(snapshot["device_traces"][0])
        for draw in (viz.segment_plot, viz.trace_plot):
            html = draw(snapshot)
            self.assertIn("<html", html.lower())
