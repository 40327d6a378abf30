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
            self.assertEqual(set(r), {"Thread", "Time", "Action", "Pointer", "Size", "Stream", "Operator"})
            if r["Action"] == "allocate":
                self.assertNotIn(r["Pointer"], live, "a pointer reused while live")
                live[r["Pointer"]] = int(r["Size"])
            elif r["Action"] == "free":
                self.assertEqual(live.pop(r["Pointer"]), int(r["Size"]), "a free of an unknown pointer")
        # Each step's end is marked: replay counts the driver calls after step 2.
        marks = [r["Operator"] for r in rows if r["Action"] == "mark"]
        self.assertEqual(marks, ["step 1", "step 2"])
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

    def test_hf_generate_grows_caches_one_token_at_a_time_and_frees_them_after_each_call(self):
        allocs, rows = self.rows("hf-generate", steps=1, batch=2)
        sizes = [int(r["Size"]) for r in rows if r["Action"] == "allocate"]
        per_token = 2 * 12 * 64 * 4  # batch x heads x head size x fp32: one token of one layer's keys
        for tokens in (97, 98, 135):  # the 96-token prompt, then one more token per step
            self.assertGreaterEqual(sizes.count(tokens * per_token), 24, f"12 layers' keys and values of {tokens} tokens")
        live = {}
        for r in rows:
            if r["Action"] == "allocate":
                live[r["Pointer"]] = r["Operator"]
            elif r["Action"] == "free":
                live.pop(r["Pointer"])
        # After the call only what existed before it is live (the weights) and
        # the cuBLAS workspace: the caches, ids and masks are all freed.
        self.assertEqual(sum(op != "pre-existing" for op in live.values()), 1, live)

    def test_inference_frees_every_activation(self):
        allocs, rows = self.rows("mlp", steps=2, batch=8, inference=True)
        frees = sum(r["Action"] == "free" for r in rows)
        params = 6  # three weights and three biases stay live, and the matmuls' cuBLAS workspace
        self.assertEqual(allocs - frees, params + 1)



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


@unittest.skipUnless(HAVE_TORCH, "torch not installed")
class RecorderMechanisms(unittest.TestCase):
    """What the Recorder does so that a meta-device trace is what CUDA allocates."""

    def record(self, body, **kwargs):
        from tidepool.record import Recorder

        with Recorder(None, cublas_workspace=0, **kwargs) as rec:
            body(rec)
        return rec

    def test_a_storage_is_freed_when_its_last_tensor_dies_before_the_next_allocation(self):
        def body(rec):
            a = torch.empty(100, device="meta")
            view = a[10:]
            del a
            torch.empty(7, device="meta")  # the view still holds the storage
            del view
            torch.empty(300, device="meta")
        rec = self.record(body)
        actions = [(e[1], e[3]) for e in rec.events]
        # The view kept the 400 bytes past the 28-byte temporary; both die before the next allocation.
        self.assertEqual(actions, [("allocate", 400), ("allocate", 28), ("free", 400), ("free", 28),
                                   ("allocate", 1200), ("free", 1200)])

    def test_tensors_autograd_saves_are_freed_when_the_graph_goes(self):
        def body(rec):
            w = torch.randn(64, 64, device="meta", requires_grad=True)
            rec.track(w)
            y = (torch.randn(8, 64, device="meta") @ w).relu()  # relu saves its output in C++
            loss = y.sum()
            del y
            rec.mark("forward")
            loss.backward()
            del loss
            rec.mark("backward")
        rec = self.record(body)
        (_, forward), (_, backward) = rec.marks
        live = lambda upto: sum(e[3] if e[1] == "allocate" else -e[3] for e in rec.events[:upto])  # noqa: E731
        self.assertGreaterEqual(live(forward), 64 * 64 * 4 + 8 * 64 * 4)  # the relu output, held by autograd
        self.assertEqual(live(backward), 2 * 64 * 64 * 4)  # the weight and its gradient, nothing else

    def test_cpu_tensors_are_not_device_memory(self):
        rec = self.record(lambda rec: (torch.ones(1000), torch.ones(10, device="meta")))
        self.assertEqual([e[3] for e in rec.events if e[1] == "allocate"], [40])

    def test_a_sparse_embedding_records_without_failing(self):
        def body(rec):
            embed = torch.nn.Embedding(1000, 16, sparse=True, device="meta")
            opt = torch.optim.SGD(embed.parameters(), lr=0.1)
            rec.track(embed, opt)
            embed(torch.zeros(4, 8, dtype=torch.long, device="meta")).sum().backward()
            self.assertTrue(embed.weight.grad.is_sparse)
            rec.label(embed.weight.grad, "gradients")  # its indices and values (none on meta: nnz is data)
            opt.step()
        rec = self.record(body)
        self.assertEqual(rec.events[0][3], 1000 * 16 * 4)

    def test_each_allocation_names_its_operator(self):
        rec = self.record(lambda rec: torch.randn(8, 8, device="meta") @ torch.randn(8, 8, device="meta"))
        self.assertEqual([e[4] for e in rec.events if e[1] == "allocate"],
                         ["aten.randn.default", "aten.randn.default", "aten.mm.default"])

    def test_the_recording_as_a_memory_snapshot_names_each_operator_for_memory_viz(self):
        import torch.cuda._memory_viz as viz

        kept = []

        def body(rec):
            w = torch.randn(64, 64, device="meta", requires_grad=True)
            rec.track(w)
            (torch.randn(8, 64, device="meta") @ w).relu().sum().backward()
            kept.append(w)
        rec = self.record(body)
        snap = rec.snapshot()
        allocs = [e for e in snap["device_traces"][0] if e["action"] == "alloc"]
        self.assertIn("aten.mm.default", [e["frames"][0]["name"] for e in allocs])
        self.assertEqual(len(allocs), rec.allocs)
        live_at_end = sum(b["requested_size"] for seg in snap["segments"] for b in seg["blocks"])
        self.assertEqual(live_at_end, 2 * 64 * 64 * 4, "the weight and its gradient")
        html = viz.trace_plot(snap)  # the page embeds the snapshot, base64-encoded
        import base64
        import re

        embedded = base64.b64decode(re.search(r'"base64": "([^"]+)"', html).group(1))
        self.assertIn(b"aten.mm.default", embedded)

    def test_a_recording_started_mid_run_begins_with_what_is_live(self):
        def body(rec):
            keep = torch.empty(50, device="meta")
            gone = torch.empty(70, device="meta")
            del gone
            rec.start()
            torch.empty(5, device="meta")
            del keep
        rec = self.record(body, start=False)
        self.assertEqual([(e[1], e[3], e[4]) for e in rec.events],
                         [("allocate", 200, "pre-existing"), ("allocate", 20, "aten.empty.memory_format"),
                          ("free", 200, ""), ("free", 20, "")])  # freed together: in allocation order

    def test_one_cublas_workspace_per_thread_that_runs_a_matmul(self):
        from tidepool.record import Recorder

        w = torch.randn(32, 32, device="meta", requires_grad=True)
        with Recorder(None) as rec:
            for _ in range(3):
                (torch.randn(4, 32, device="meta") @ w).sum().backward()
        spaces = [e[3] for e in rec.events if e[4] == "cublas_workspace"]
        self.assertEqual(spaces, [8_519_680, 8_519_680], "the calling thread's and autograd's backward thread's")
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
        try:
            with Recorder(None) as rec:
                torch.randn(4, 4, device="meta") @ torch.randn(4, 4, device="meta")
        finally:
            del os.environ["CUBLAS_WORKSPACE_CONFIG"]
        self.assertEqual([e[3] for e in rec.events if e[4] == "cublas_workspace"], [32 << 20])

    def test_composite_matmuls_take_a_workspace_under_inference_mode_too(self):
        from tidepool.record import Recorder

        a, b = torch.randn(4, 8, 16, device="meta"), torch.randn(16, 8, device="meta")
        products = {
            "einsum": lambda: torch.einsum("bsi,io->bso", a, b),
            "tensordot": lambda: torch.tensordot(a, b, dims=1),
            "chain_matmul": lambda: torch.linalg.multi_dot([a[0], b, b.T]),
            "bilinear": lambda: torch.nn.functional.bilinear(a, a, torch.randn(3, 16, 16, device="meta")),
        }
        for name, product in products.items():
            # Composite operators reach the recorder whole under inference_mode (and decomposed
            # into mm/bmm under autograd): either way the thread's workspace is allocated.
            for inference in (True, False):
                with Recorder(None) as rec, torch.inference_mode(inference):
                    product()
                spaces = [e[3] for e in rec.events if e[4] == "cublas_workspace"]
                self.assertEqual(spaces, [8_519_680], f"{name}, inference_mode={inference}")

    def test_gather_and_index_backward_allocate_as_without_a_dispatch_mode(self):
        def body(rec):
            x = torch.randn(64, 1024, device="meta", requires_grad=True)
            rec.track(x)
            index = torch.zeros(64, 1024, dtype=torch.long, device="meta")
            y = x.gather(1, index).sum() + x[torch.zeros(16, dtype=torch.long, device="meta")].sum()
            rec.mark("forward")
            y.backward()
        rec = self.record(body)
        _, forward = rec.marks[0]
        size = 64 * 1024 * 4
        backward = [e[4] for e in rec.events[forward:] if e[1] == "allocate" and e[3] == size]
        # As without a mode: zeros, then scatter_add_ (gather) and index_put_ (index) into them in place.
        self.assertEqual(backward.count("aten.new_zeros.default"), 2, backward)
        self.assertNotIn("aten.scatter_add.default", backward)
        self.assertNotIn("aten.index_put.default", backward)

    def test_optimizers_take_the_foreach_path_as_on_cuda(self):
        def body(rec):
            model = torch.nn.Linear(64, 64, device="meta")
            opt = torch.optim.AdamW(model.parameters())
            rec.track(model, opt)
            model(torch.randn(4, 64, device="meta")).sum().backward()
            opt.step()
            rec.mark("stepped")
        rec = self.record(body)
        self.assertTrue(any("_foreach_" in e[4] for e in rec.events), "no foreach operator recorded")
        # What stays: exp_avg and exp_avg_sq of the weight and the bias (the steps are on the CPU).
        self.assertEqual(rec.breakdown_at(rec.marks[-1][1] - 1)["optimizer"], 2 * (64 * 64 + 64) * 4)

    def test_a_value_read_from_a_meta_tensor_takes_the_ordinary_branch(self):
        seen = []
        rec = self.record(lambda rec: seen.append((bool(torch.ones(3, device="meta").all()),
                                                   torch.ones(3, device="meta").sum().item())))
        self.assertEqual(seen, [(True, 1.0)])
        self.assertTrue(rec.events)

    def test_a_storage_resized_in_place_is_a_free_and_an_allocation(self):
        kept = []

        def body(rec):
            t = torch.empty(100, device="meta")
            t.untyped_storage().resize_(0)  # as FSDP frees an all-gathered weight, the tensor kept
            rec.mark("freed")
            t.untyped_storage().resize_(400)
            kept.append(t)
        rec = self.record(body)
        self.assertEqual([(e[1], e[3]) for e in rec.events], [("allocate", 400), ("free", 400), ("allocate", 400)])
        self.assertEqual(rec.marks[0][1], 2)

    def test_a_tensor_given_another_storage_frees_its_old_one(self):
        kept = []

        def body(rec):
            layer = torch.nn.Linear(256, 256, bias=False, device="meta")
            rec.track(layer)
            rec.mark("fp32")
            layer.to(torch.bfloat16)  # Module._apply: `param.data = converted`
            rec.mark("bf16")
            with torch.no_grad():
                layer.weight.set_(torch.empty(64, device="meta").untyped_storage())  # aten::set_, a dispatched operator
            rec.mark("set")
            kept.append(layer)
        rec = self.record(body)
        live = lambda upto: sum(e[3] if e[1] == "allocate" else -e[3] for e in rec.events[:upto])  # noqa: E731
        (_, fp32), (_, bf16), (_, after_set) = rec.marks
        self.assertEqual(live(fp32), 256 * 256 * 4)
        self.assertEqual(live(bf16), 256 * 256 * 2, "the fp32 weight is freed once the parameter holds its bf16 copy")
        self.assertEqual(live(after_set), 64 * 4)
        self.assertEqual(live(len(rec.events)), 64 * 4)

    def test_a_copy_to_the_cpu_is_an_uninitialised_cpu_tensor(self):
        seen = []
        self.record(lambda rec: seen.append(torch.ones(3, 4, device="meta", dtype=torch.float16).cpu()))
        self.assertEqual((seen[0].device.type, tuple(seen[0].shape), seen[0].dtype), ("cpu", (3, 4), torch.float16))

    def test_the_breakdown_at_the_peak_sums_to_the_peak(self):
        def body(rec):
            model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256))
            model.to("meta")
            opt = torch.optim.AdamW(model.parameters())
            rec.track(model, opt)
            for _ in range(2):
                model(torch.randn(32, 256, device="meta")).sum().backward()
                opt.step()
                opt.zero_grad()
            rec.mark("end")
        rec = self.record(body)
        peak, _ = rec.peak()
        parts = rec.breakdown_at_peak()
        self.assertEqual(sum(parts.values()), peak)
        weights = (256 * 1024 * 2 + 1024 + 256) * 4
        self.assertEqual(parts["weights"], weights)
        self.assertEqual(parts["optimizer"], 2 * weights, "the states; the step's temporaries are not state")
        self.assertGreaterEqual(parts["activations"], weights, "AdamW's foreach temporary, as large as the weights")
        self.assertEqual(rec.breakdown_at(rec.marks[-1][1] - 1)["optimizer"], 2 * weights)

    def test_pytorchs_memtracker_agrees_except_where_its_mode_changes_backward(self):
        from torch.distributed._tools.mem_tracker import MemTracker

        from tidepool.record import Recorder

        def peaks(model, step):
            tracker = MemTracker()
            tracker.track_external(model)
            with tracker:
                step()
            model.zero_grad(set_to_none=True)
            with Recorder(None, cublas_workspace=0) as rec:
                rec.track(model)
                step()
            model.zero_grad(set_to_none=True)
            return tracker.get_tracker_snapshot("peak")[torch.device("meta")]["Total"], rec.peak()[0]

        mlp = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 512)).to("meta")
        mlp_step = lambda: mlp(torch.randn(64, 512, device="meta")).sum().backward()  # noqa: E731
        theirs, ours = peaks(mlp, mlp_step)
        self.assertEqual(theirs, ours)

        table = torch.nn.Linear(1, 1024 * 1024, bias=False).to("meta")  # a 4 MiB weight to gather from
        index = torch.zeros(16, 1024, dtype=torch.long, device="meta")
        gather_step = lambda: table.weight.view(1024, 1024).gather(1, index).sum().backward()  # noqa: E731
        theirs, ours = peaks(table, gather_step)
        # MemTracker's mode sends gather's backward down its out-of-place path: one more weight-sized tensor.
        self.assertEqual(theirs - ours, 4 << 20)


if __name__ == "__main__":
    unittest.main()
