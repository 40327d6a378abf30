"""python -m tidepool.plan over real transformers and peft models on tiny
configurations, with the real tidepool command (TIDEPOOL_BIN, which
tools/tests/tools/python.rs sets to the one cargo built).

Skipped without torch, transformers, peft or the tidepool command, except
when TIDEPOOL_REQUIRE_TORCH=1 (CI), where their absence fails.
"""
import contextlib
import importlib.util
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLES = os.path.join(os.path.dirname(HERE), "examples")  # own_optimizer.py: a factory with its optimizer
GIB = 1 << 30
NEEDED = [m for m in ("torch", "transformers", "peft") if importlib.util.find_spec(m) is None]
BINARY = os.environ.get("TIDEPOOL_BIN") or shutil.which("tidepool")
REQUIRED = os.environ.get("TIDEPOOL_REQUIRE_TORCH") == "1"
if os.environ.get("TIDEPOOL_SKIP_PLAN") == "1":
    # tools/tests/tools/python.rs runs this file in a test of its own, once.
    NEEDED, REQUIRED = ["its own run (TIDEPOOL_SKIP_PLAN=1)"], False
if REQUIRED and (NEEDED or not BINARY):
    raise RuntimeError(f"TIDEPOOL_REQUIRE_TORCH=1 but missing: {NEEDED or 'the tidepool command (TIDEPOOL_BIN)'}")
SKIP = f"needs {', '.join(NEEDED)}" if NEEDED else ("needs the tidepool command (TIDEPOOL_BIN)" if not BINARY else "")

# A llama small enough to record in a fraction of a second, large enough
# that its activations (not its vocabulary) make the peak.
LLAMA = ["hf:llama", "--set", "hidden_size=256", "--set", "intermediate_size=1024", "--set", "num_hidden_layers=2",
         "--set", "num_attention_heads=4", "--set", "num_key_value_heads=4", "--set", "vocab_size=512",
         "--seq", "256"]


def plan(*args, env=None, prelude=None):
    """Runs the planner; returns (status, stdout, stderr). In this process
    (torch imported once) unless env or prelude ask for a process of its own."""
    if env is None and prelude is None:
        from tidepool.plan import main

        os.environ["TIDEPOOL_BIN"] = BINARY or ""
        if HERE not in sys.path:
            sys.path.insert(0, HERE)
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                main(list(args))
                status = 0
            except SystemExit as exit:
                status = exit.code
        return status, out.getvalue(), err.getvalue()
    environment = dict(os.environ, TIDEPOOL_BIN=BINARY or "", **(env or {}))
    environment["PYTHONPATH"] = os.pathsep.join([HERE, environment.get("PYTHONPATH", "")])
    command = [sys.executable, "-m", "tidepool.plan", *args]
    if prelude:
        command = [sys.executable, "-c", prelude + "\nimport runpy, sys\nsys.argv = ['tidepool.plan'] + "
                   + repr(list(args)) + "\nrunpy.run_module('tidepool.plan', run_name='__main__')"]
    done = subprocess.run(command, capture_output=True, text=True, env=environment, timeout=600)
    return done.returncode, done.stdout, done.stderr


def rows(stdout):
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


@unittest.skipIf(SKIP, SKIP)
class Sweep(unittest.TestCase):
    """One sweep of 8 variants, shared by the tests that read it."""

    @classmethod
    def setUpClass(cls):
        status, out, err = plan(*LLAMA, "--json", "--sweep", "batch=1,2", "--sweep", "checkpointing=false,true",
                                "--sweep", "precision=fp32,bf16-mixed")
        assert status == 0, err
        cls.rows = rows(out)
        cls.stderr = err

    def find(self, **want):
        found = [r for r in self.rows if all(r["variant"][k] == v for k, v in want.items())]
        self.assertEqual(len(found), 1, want)
        return found[0]

    def test_every_variant_has_exactly_the_documented_fields(self):
        self.assertEqual(len(self.rows), 8)
        for r in self.rows:
            self.assertEqual(set(r), {"variant", "peak_live_bytes", "breakdown", "pytorch_min_capacity_bytes",
                                      "pytorch_expandable_min_capacity_bytes", "tidepool_min_capacity_bytes",
                                      "fits", "fits_pytorch", "fits_pytorch_expandable", "jobs", "jobs_pytorch",
                                      "jobs_pytorch_expandable", "cards_left_out",
                                      "trace"})
            self.assertEqual(set(r["breakdown"]), {"weights_bytes", "gradients_bytes", "optimizer_bytes",
                                                   "precision_copies_bytes", "activations_bytes"})
            self.assertIn("torch", r["variant"])
            self.assertIsNone(r["trace"], "traces are not kept without --keep-traces")

    def test_the_breakdown_sums_to_the_peak(self):
        for r in self.rows:
            self.assertEqual(sum(r["breakdown"].values()), r["peak_live_bytes"], r["variant"])

    def test_weights_and_optimizer_state_are_the_model_and_two_adamw_moments(self):
        r = self.find(batch=1, checkpointing=False, precision="fp32")
        params = 512 * 256 * 2 + 2 * (4 * 256 * 256 + 3 * 256 * 1024 + 2 * 256) + 256
        rotary = 2 * 32 * 4  # buffers are weights too: the rotary embedding's inverse frequencies
        self.assertEqual(r["breakdown"]["weights_bytes"], 4 * params + rotary)
        # The two moments, and the temporaries of AdamW's foreach step when the peak is in it.
        self.assertGreaterEqual(r["breakdown"]["optimizer_bytes"], 2 * 4 * params)

    def test_the_peak_grows_with_the_batch(self):
        for ckpt in (False, True):
            for precision in ("fp32", "bf16-mixed"):
                one = self.find(batch=1, checkpointing=ckpt, precision=precision)
                two = self.find(batch=2, checkpointing=ckpt, precision=precision)
                if ckpt:  # the peak may stay in the optimizer step, above the few activations kept
                    self.assertGreaterEqual(two["peak_live_bytes"], one["peak_live_bytes"])
                else:
                    self.assertGreater(two["peak_live_bytes"], one["peak_live_bytes"])
                    self.assertGreater(two["breakdown"]["activations_bytes"], one["breakdown"]["activations_bytes"])

    def test_checkpointing_lowers_activations(self):
        for precision in ("fp32", "bf16-mixed"):
            plain = self.find(batch=2, checkpointing=False, precision=precision)
            ckpt = self.find(batch=2, checkpointing=True, precision=precision)
            self.assertLess(ckpt["breakdown"]["activations_bytes"], plain["breakdown"]["activations_bytes"])

    def test_bf16_mixed_precision_lowers_activations(self):
        fp32 = self.find(batch=2, checkpointing=False, precision="fp32")
        mixed = self.find(batch=2, checkpointing=False, precision="bf16-mixed")
        self.assertLess(mixed["breakdown"]["activations_bytes"], fp32["breakdown"]["activations_bytes"])

    def test_autocasts_weight_copies_have_their_own_column(self):
        fp32 = self.find(batch=2, checkpointing=False, precision="fp32")
        mixed = self.find(batch=2, checkpointing=False, precision="bf16-mixed")
        self.assertEqual(fp32["breakdown"]["precision_copies_bytes"], 0)
        # The bf16 copies of the linear layers' weights (all but the embedding, the norms and the
        # rotary buffer), cached for the autocast region: half their fp32 bytes at most.
        linear = 4 * (512 * 256 + 2 * (4 * 256 * 256 + 3 * 256 * 1024))
        copies = mixed["breakdown"]["precision_copies_bytes"]
        self.assertGreater(copies, 0)
        self.assertLessEqual(copies, linear // 2)

    def test_the_smallest_devices_hold_the_peak_and_fits_follows_tidepools(self):
        for r in self.rows:
            self.assertGreaterEqual(r["pytorch_min_capacity_bytes"], r["peak_live_bytes"])
            self.assertGreaterEqual(r["pytorch_expandable_min_capacity_bytes"], r["peak_live_bytes"])
            self.assertGreaterEqual(r["tidepool_min_capacity_bytes"], r["peak_live_bytes"])
            # A T4 (compute capability 7.5) has no bf16: not named for a bf16 variant, and the row says why.
            bf16 = r["variant"]["precision"] == "bf16-mixed"
            self.assertEqual(r["fits"], ["L4", "RTX 4090", "A100 40GB", "L40S", "H100", "H200", "B200"] if bf16 else
                             ["T4", "L4", "RTX 4090", "A100 40GB", "L40S", "H100", "H200", "B200"])
            self.assertEqual(r["cards_left_out"], {"T4": "no bf16"} if bf16 else {})
            self.assertEqual(r["fits_pytorch"], r["fits"])
            self.assertEqual(r["fits_pytorch_expandable"], r["fits"])

    def test_a_progress_bar_runs_across_the_variants(self):
        self.assertIn("8/8", self.stderr)
        self.assertIn("1/8", self.stderr)


class LargestBatches(unittest.TestCase):
    """The largest-batch lines, from results as the sweep leaves them."""

    @staticmethod
    def result(batch, tidepool, pytorch, pytorch_expandable):
        return {"options": {"batch": batch}, "label": {"batch": batch}, "tidepool": tidepool * GIB,
                "pytorch": pytorch * GIB, "pytorch_expandable": pytorch_expandable * GIB}

    def test_pytorchs_allocators_are_named_where_either_holds_another_batch(self):
        from tidepool.plan import largest_batches

        from tidepool.plan.cards import Card

        results = [self.result(1, 10, 11, 10), self.result(2, 20, 26, 23), self.result(4, 40, 50, 44)]
        cards = [Card("8 GiB", 8 * GIB), Card("L4", 24 * GIB), Card("25 GiB", 25 * GIB), Card("H100", 48 * GIB)]
        line, = largest_batches(results, cards, ["batch"])
        self.assertEqual(line, "largest batch: 8 GiB: none; L4: 2 (PyTorch 1, with expandable segments 2); "
                               "25 GiB: 2 (PyTorch 1, with expandable segments 2); "
                               "H100: 4 (PyTorch 2, with expandable segments 4)")
        same = [self.result(1, 10, 10, 10), self.result(2, 20, 20, 20)]
        self.assertEqual(largest_batches(same, cards[1:2], ["batch"]), ["largest batch: L4: 2"])
        # Only its expandable segments hold less: PyTorch is named too.
        one_less = [self.result(1, 10, 10, 10), self.result(2, 20, 20, 30)]
        self.assertEqual(largest_batches(one_less, cards[1:2], ["batch"]),
                         ["largest batch: L4: 2 (PyTorch 2, with expandable segments 1)"])
        self.assertEqual(largest_batches(results, cards, ["precision"]), [], "no batch sweep, no line")


class CardsAndJobs(unittest.TestCase):
    """What a card's architecture adds to a need, and how many jobs share it."""

    def test_the_cublas_workspace_is_32_mib_where_the_torch_release_gives_it(self):
        from tidepool.plan.record import DEFAULT_CUBLAS_WORKSPACE as small, cublas_workspace_bytes as size

        large = 32 << 20
        self.assertEqual(size(None), small, "a card of unknown architecture: the default's")
        self.assertEqual(size((8, 9), (2, 15)), small)
        self.assertEqual([size((9, 0), v) for v in ((2, 0), (2, 10), (2, 15))], [large] * 3, "Hopper, since 2.0")
        self.assertEqual([size((10, 0), v) for v in ((2, 10), (2, 11))], [small, large], "Blackwell, since 2.11")
        self.assertEqual([size((11, 0), v) for v in ((2, 13), (2, 14))], [small, large], "Thor, since 2.14")
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:1"
        try:
            self.assertEqual(size((9, 0), (2, 15)), 4 << 20, "the variable, where set, on any card")
        finally:
            del os.environ["CUBLAS_WORKSPACE_CONFIG"]

    def test_a_need_on_a_hopper_card_counts_each_threads_larger_workspace(self):
        from tidepool.plan.cards import Card, need_on
        from tidepool.plan.record import DEFAULT_CUBLAS_WORKSPACE

        result = {"workspaces": 2, "workspace_bytes": DEFAULT_CUBLAS_WORKSPACE}
        h100, l40s = Card("H100", 78 * GIB, (9, 0), 80 * GIB), Card("L40S", 43 * GIB, (8, 9), 45 * GIB)
        self.assertEqual(need_on(l40s, GIB, result), GIB)
        self.assertEqual(need_on(h100, GIB, result), GIB + 2 * ((32 << 20) - DEFAULT_CUBLAS_WORKSPACE))
        self.assertEqual(need_on(h100, GIB, {}), GIB, "a result without its workspaces: as recorded")

    def test_jobs_side_by_side_keep_room_for_one_more_and_a_context_each(self):
        from tidepool.plan.cards import Card, jobs_side_by_side

        card = Card("80 GiB", 78 * GIB, None, 80 * GIB)  # a context of 2 GiB
        self.assertEqual(jobs_side_by_side(card, 18 * GIB), 3, "four of 20 GiB fill it: three run, one kept free")
        self.assertEqual(jobs_side_by_side(card, 17 * GIB), 4 - 1, "80 / 19: four fit")
        self.assertEqual(jobs_side_by_side(card, 14 * GIB), 4, "80 / 16: five fit, four run")
        self.assertEqual(jobs_side_by_side(card, 40 * GIB), 0, "not two: none beside its reserve")


@unittest.skipIf(SKIP, SKIP)
class Plan(unittest.TestCase):
    def test_the_table_names_the_largest_batch_per_card(self):
        # Cards given by their memory: the allocator gets 0.06, 0.1 and 24 GiB of them (1.5 GiB less).
        status, out, err = plan(*LLAMA, "--sweep", "batch=1,2,4", "--cards", "h200,1.56GiB,1.6GiB,25.5GiB")
        self.assertEqual(status, 0, err)
        self.assertIn("peak live", out)
        self.assertIn("PyTorch exp. needs", out)
        self.assertIn("torch 2.", out)
        line = [x for x in out.splitlines() if x.startswith("largest batch")]
        self.assertEqual(len(line), 1, out)
        self.assertIn("1.56 GiB: none; 1.6 GiB: ", line[0])
        self.assertTrue(line[0].endswith("; 25.5 GiB: 4; H200: 4"), line[0])
        # The smallest card is the table's last column: none of 1.56 GiB holds any batch, 25.5 GiB every one.
        self.assertIn("smallest card", out)

    def test_a_t4_is_not_named_for_bf16_and_the_report_says_why(self):
        status, out, err = plan(*LLAMA, "--sweep", "batch=1,2", "--sweep", "precision=fp16-mixed,bf16-mixed",
                                "--cards", "t4,l4")
        self.assertEqual(status, 0, err)
        rows = [x.split() for x in out.splitlines() if x.lstrip().startswith(("1 ", "2 "))]
        self.assertEqual([(row[0], row[1], row[-1]) for row in rows],
                         [("1", "fp16-mixed", "T4"), ("1", "bf16-mixed", "L4"), ("2", "fp16-mixed", "T4"),
                          ("2", "bf16-mixed", "L4")], out)
        self.assertIn("T4 (compute capability 7.5): not named for bf16 variants: it has no bf16 tensor cores", out)
        self.assertIn("largest batch with precision=fp16-mixed: T4: 2; L4: 2", out)
        self.assertIn("largest batch with precision=bf16-mixed: T4: no bf16; L4: 2", out)
        # Without a bf16 variant, no such line.
        status, out, err = plan(*LLAMA, "--precision", "fp16-mixed", "--cards", "t4,l4")
        self.assertEqual(status, 0, err)
        self.assertNotIn("not named for bf16", out)

    def test_generate_grows_with_new_tokens(self):
        status, out, err = plan(*LLAMA, "--task", "generate", "--json", "--steps", "1", "--seq", "8", "--sweep",
                                "new-tokens=2,64")
        self.assertEqual(status, 0, err)
        short, long = rows(out)
        self.assertGreater(long["peak_live_bytes"], short["peak_live_bytes"])
        # The KV cache: 2 layers x (keys, values) x 4 heads x 64 x fp32 per token: 62 more tokens, less
        # what the shorter run's peak (at the prompt) holds besides its cache.
        self.assertGreaterEqual(long["peak_live_bytes"] - short["peak_live_bytes"], 40 * 2 * 2 * 256 * 4)
        self.assertEqual(long["breakdown"]["gradients_bytes"], 0)

    def test_a_module_factory_works_and_keeps_its_traces(self):
        with tempfile.TemporaryDirectory() as tmp:
            status, out, err = plan("module:plan_models:tiny_lm", "--seq", "256", "--json", "--keep-traces", tmp,
                                    "--sweep", "batch=1,4")
            self.assertEqual(status, 0, err)
            for r in rows(out):
                self.assertTrue(os.path.exists(r["trace"]), r["trace"])
                with open(r["trace"]) as f:
                    self.assertTrue(f.readline().startswith("Thread,Time,Action,Pointer,Size,Stream,Operator"))
                    self.assertIn("aten.", f.read())
            one, two = rows(out)
            self.assertGreater(two["peak_live_bytes"], one["peak_live_bytes"])

    def test_a_snapshot_written_by_the_recorder_replays_to_the_same_peak(self):
        sys.path.insert(0, HERE)
        import plan_models
        import torch

        from tidepool.record import Recorder

        with torch.device("meta"):
            model = plan_models.tiny_lm()
        with Recorder(None) as rec:
            rec.track(model)
            ids = torch.zeros(2, 64, dtype=torch.long, device="meta")
            model(ids).float().logsumexp(-1).mean().backward()
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "snap.pickle")
            rec.write_snapshot(path)
            done = subprocess.run([BINARY, "replay", path, "--policy", "pytorch", "--json"], capture_output=True,
                                  text=True, timeout=120)
        self.assertEqual(done.returncode, 0, done.stderr)
        report = json.loads(done.stdout.splitlines()[0])
        self.assertEqual(report["peak_requested_bytes"], rec.peak()[0])
        # Its segments are the recording's, not an allocator's: no PyTorch figure beside it.
        self.assertIsNone(report["pytorch_recorded_peak_reserved_bytes"], report)

    def test_the_plot_draws_every_variant_by_category_and_its_smallest_devices(self):
        import xml.etree.ElementTree as ElementTree

        with tempfile.TemporaryDirectory() as tmp:
            svg = os.path.join(tmp, "plan.svg")
            status, out, err = plan(*LLAMA, "--sweep", "batch=1,2", "--steps", "1", "--plot", svg)
            self.assertEqual(status, 0, err)
            self.assertIn(f"plot written to {svg}", out)
            root = ElementTree.parse(svg).getroot()
        texts = " ".join(t.text or "" for t in root.iter("{http://www.w3.org/2000/svg}text"))
        for word in ("batch=1", "batch=2", "weights", "gradients", "optimizer", "copies", "activations", "tidepool needs"):
            self.assertIn(word, texts)
        polygons = list(root.iter("{http://www.w3.org/2000/svg}polygon"))
        self.assertEqual(len(polygons), 2 * 5, "five categories per variant")

    def test_masked_lm_seq2seq_and_vision_architectures_plan_too(self):
        tiny = {
            "hf:bert": ["hidden_size=64", "num_hidden_layers=2", "num_attention_heads=2", "intermediate_size=128"],
            "hf:t5": ["d_model=64", "num_layers=2", "num_heads=2", "d_ff=128", "d_kv=32"],
            "hf:bart": ["d_model=64", "encoder_layers=1", "decoder_layers=1", "encoder_attention_heads=2",
                        "decoder_attention_heads=2", "encoder_ffn_dim=128", "decoder_ffn_dim=128"],
            "hf:vit": ["hidden_size=64", "num_hidden_layers=2", "num_attention_heads=2", "intermediate_size=128",
                       "image_size=32", "patch_size=8"],
            # Two image classification classes in transformers' mapping (with and without a teacher).
            "hf:deit": ["hidden_size=64", "num_hidden_layers=2", "num_attention_heads=2", "intermediate_size=128",
                        "image_size=32", "patch_size=8"],
        }
        for model, sets in tiny.items():
            args = [model, "--json", "--steps", "1", "--seq", "32", "--sweep", "task=train,inference"]
            for item in sets:
                args += ["--set", item]
            status, out, err = plan(*args)
            self.assertEqual(status, 0, f"{model}: {out} {err}")
            train, forward = rows(out)
            self.assertGreater(train["breakdown"]["gradients_bytes"] + train["breakdown"]["optimizer_bytes"], 0)
            self.assertLess(forward["peak_live_bytes"], train["peak_live_bytes"], model)

    def test_a_vision_model_cast_to_bf16_takes_images_in_bf16(self):
        status, out, err = plan("hf:convnext", "--set", "hidden_sizes=[8,16,16,16]", "--set", "depths=[1,1,1,1]",
                                "--seq", "32", "--batch", "2", "--steps", "1", "--json", "--sweep", "task=train,inference",
                                "--sweep", "precision=fp32,bf16")
        self.assertEqual(status, 0, f"{out} {err}")
        train32, train16, forward32, forward16 = rows(out)
        self.assertEqual(train16["breakdown"]["weights_bytes"] * 2, train32["breakdown"]["weights_bytes"])
        self.assertLess(forward16["peak_live_bytes"], forward32["peak_live_bytes"])

    def test_ddp_keeps_a_whole_replica_per_rank_and_adds_gradient_buckets(self):
        status, out, err = plan(*LLAMA, "--json", "--batch", "2", "--sweep", "ddp=0,2")
        self.assertEqual(status, 0, err)
        alone, ddp = rows(out)
        self.assertEqual(ddp["variant"]["ddp"], 2)
        weights = alone["breakdown"]["weights_bytes"]
        self.assertEqual(ddp["breakdown"]["weights_bytes"], weights, "every rank holds every weight")
        self.assertGreaterEqual(ddp["breakdown"]["gradients_bytes"], weights - 256, "the buckets hold every gradient")
        self.assertGreater(ddp["peak_live_bytes"], alone["peak_live_bytes"])

    def test_fsdp_over_n_ranks_divides_weights_gradients_and_optimizer_state_by_about_n(self):
        from tidepool.plan import step

        sets = {k: int(v) for k, v in (item.split("=") for item in LLAMA[2:13:2])}
        base = dict(task="train", batch=2, seq=256, precision="fp32", checkpointing=False, accumulation=1,
                    optimizer="adamw", steps=2, lora_rank=0, new_tokens=0, ddp=0)
        held = {}
        for n in (0, 4):
            rec = step.record("hf:llama", sets, dict(base, fsdp=n), None)
            # What a rank holds as the second optimizer step begins: weights, gradients, the states.
            at = dict(rec.marks)["step 2: optimizer"]
            held[n] = rec.breakdown_at(at - 1)
        for category in ("weights", "gradients", "optimizer"):
            ratio = held[0][category] / held[4][category]
            self.assertAlmostEqual(ratio, 4, delta=0.4, msg=f"{category}: {held[0][category]} over {held[4][category]}")
        status, out, err = plan(*LLAMA, "--json", "--batch", "2", "--sweep", "fsdp=0,4")
        self.assertEqual(status, 0, err)
        alone, sharded = rows(out)
        self.assertEqual(sharded["variant"]["fsdp"], 4)
        self.assertLess(sharded["breakdown"]["optimizer_bytes"], alone["breakdown"]["optimizer_bytes"] / 3)
        self.assertLess(sharded["peak_live_bytes"], alone["peak_live_bytes"])

    def test_a_workload_object_works(self):
        status, out, err = plan("module:plan_models:image_workload", "--seq", "32", "--batch", "4", "--json")
        self.assertEqual(status, 0, err)
        (r,) = rows(out)
        self.assertGreater(r["breakdown"]["activations_bytes"], 4 * 16 * 32 * 32 * 4)

    def test_accumulation_keeps_the_memory_of_a_micro_batch_and_the_gradients(self):
        status, out, err = plan(*LLAMA, "--json", "--sweep", "batch=1,4", "--sweep", "accumulation=1,4")
        self.assertEqual(status, 0, err)
        one, one_acc, four, four_acc = rows(out)
        self.assertEqual((one_acc["variant"]["batch"], one_acc["variant"]["accumulation"]), (1, 4))
        # Four micro-batches of 1 cost far less than a batch of 4 ...
        self.assertLess(one_acc["peak_live_bytes"], 0.8 * four["peak_live_bytes"])
        # ... and no more than a batch of 1 with its gradients kept across micro-batches.
        weights = one["breakdown"]["weights_bytes"]
        self.assertLessEqual(one_acc["peak_live_bytes"], one["peak_live_bytes"] + weights)
        self.assertGreaterEqual(one_acc["peak_live_bytes"], one["peak_live_bytes"])

    def test_lora_trains_adapters_only(self):
        status, out, err = plan(*LLAMA, "--json", "--sweep", "lora-rank=0,8")
        self.assertEqual(status, 0, err)
        full, lora = rows(out)
        self.assertLess(lora["breakdown"]["optimizer_bytes"], full["breakdown"]["optimizer_bytes"] / 20)
        self.assertGreater(lora["breakdown"]["weights_bytes"], full["breakdown"]["weights_bytes"])

    def test_a_variant_without_a_meta_kernel_is_reported_and_the_others_go_on(self):
        status, out, err = plan("module:plan_models:bincount", "--seq", "8", "--json", "--sweep", "batch=1,2,3")
        self.assertEqual(status, 1, err)
        one, two, three = rows(out)
        self.assertIn("bincount", two["error"])
        self.assertIn("peak_live_bytes", one)
        self.assertIn("peak_live_bytes", three)

    def test_the_variant_names_the_length_used_when_seq_is_the_models_default(self):
        # LLAMA without its --seq: the model's default, min(512, max_position_embeddings) = 64 here.
        status, out, err = plan(*LLAMA[:-2], "--set", "max_position_embeddings=64", "--json", "--steps", "1")
        self.assertEqual(status, 0, err)
        self.assertEqual(rows(out)[0]["variant"]["seq"], 64)

    def test_nothing_touches_the_network(self):
        prelude = textwrap.dedent("""
            import sys
            def guard(event, args):
                if event.startswith("socket.") and event not in ("socket.__new__", "socket.bind"):
                    raise RuntimeError(f"network access attempted: {event} {args}")
            sys.addaudithook(guard)
        """)
        status, out, err = plan("hf:gpt2", "--set", "n_layer=1", "--set", "n_embd=64", "--set", "n_head=2",
                                "--seq", "32", "--json", "--steps", "1", prelude=prelude,
                                env={"HF_HUB_OFFLINE": "0", "TRANSFORMERS_OFFLINE": "0"})
        self.assertEqual(status, 0, err)
        self.assertNotIn("network access attempted", err)
        self.assertEqual(len(rows(out)), 1)


@unittest.skipIf(SKIP, SKIP)
class ScriptShapes(unittest.TestCase):
    """The tasks, loops, defaults and sharding of the scripts people write."""

    def test_forward_grad_keeps_the_graph_that_inference_does_not(self):
        status, out, err = plan(*LLAMA, "--json", "--batch", "2", "--steps", "1",
                                "--sweep", "task=forward-grad,inference,forward")
        self.assertEqual(status, 0, err)
        grad, inference, alias = rows(out)
        self.assertEqual(alias["variant"]["task"], "inference", "'forward' is read as inference")
        self.assertEqual(alias["peak_live_bytes"], inference["peak_live_bytes"])
        for r in (grad, inference):
            self.assertEqual(r["breakdown"]["gradients_bytes"] + r["breakdown"]["optimizer_bytes"], 0, r["variant"])
        # Every block's saved activations, where inference frees each block's as it goes.
        self.assertGreater(grad["breakdown"]["activations_bytes"], 1.5 * inference["breakdown"]["activations_bytes"])

    def test_the_plain_loop_holds_the_logits_through_backward_and_the_trainer_loop_does_not(self):
        status, out, err = plan("module:plan_models:tiny_lm", "--seq", "256", "--batch", "4", "--json",
                                "--sweep", "loop=plain,trainer")
        self.assertEqual(status, 0, err)
        plain, trainer = rows(out)
        self.assertEqual(plain["peak_live_bytes"] - trainer["peak_live_bytes"], 4 * 256 * 512 * 4, "the fp32 logits")
        # Each source's default, said in the variant.
        status, out, err = plan("module:plan_models:tiny_lm", "--seq", "64", "--json", "--steps", "1")
        self.assertEqual(rows(out)[0]["variant"]["loop"], "plain", err)
        status, out, err = plan(*LLAMA, "--json", "--steps", "1", "--sweep", "task=train,inference")
        train, inference = rows(out)
        self.assertEqual((train["variant"]["loop"], inference["variant"]["loop"]), ("trainer", None), err)

    def test_pytorchs_memtracker_sees_the_peak_of_each_task_and_loop_as_a_script_writes_it(self):
        import torch
        from torch.distributed._tools.mem_tracker import MemTracker

        if HERE not in sys.path:
            sys.path.insert(0, HERE)
        import plan_models
        from tidepool.plan import step

        meta = torch.device("meta")

        def script(task, loop, steps):
            """The steps as a script writes them, under MemTracker: its peak."""
            with meta:
                model = plan_models.tiny_lm()
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
            tracker = MemTracker()
            tracker.track_external(model, optimizer)
            with tracker:
                for k in range(steps):
                    if k:
                        tracker.reset_mod_stats()
                    ids, targets = (torch.randint(0, 512, (4, 64), device=meta) for _ in range(2))
                    if task == "inference":
                        with torch.inference_mode():
                            model(ids)
                    elif task == "forward-grad":
                        logits = model(ids)
                        del logits
                    elif loop == "plain":
                        logits = model(ids)
                        torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
                        optimizer.step()
                        optimizer.zero_grad()
                    else:  # the Trainer's compute_loss returns the loss alone
                        loss = torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), targets.flatten())
                        loss.backward()
                        del loss
                        optimizer.step()
                        optimizer.zero_grad()
            return tracker.get_tracker_snapshot("peak")[meta]["Total"]

        base = dict(batch=4, seq=64, precision="fp32", checkpointing=False, accumulation=1, optimizer="adamw-loop",
                    lora_rank=0, new_tokens=0)
        # Training over two steps (the state made in the first, the logits held into the second's
        # forward); the forward tasks over one (MemTracker holds a forward's activations past it).
        for task, loop, steps in (("train", "plain", 2), ("train", "trainer", 2), ("forward-grad", None, 1),
                                  ("inference", None, 1)):
            rec = step.record("module:plan_models:tiny_lm", {}, dict(base, task=task, loop=loop, steps=steps), None)
            ours = rec.peak()[0] - rec.workspace_size * len(rec.workspaces)  # MemTracker sees no cuBLAS
            self.assertEqual(ours, script(task, loop, steps), f"{task} {loop}")

    def test_a_bad_option_is_refused_in_one_line(self):
        for args, said in [(["hf:gpt2", "--bogus"], "unrecognized arguments: --bogus"),
                           (["hf:gpt2", "--precision", "fp8"], "argument --precision: invalid choice: 'fp8'"),
                           (["run"], "the following arguments are required: SCRIPT")]:
            status, out, err = plan(*args)
            self.assertEqual(status, 2, out + err)
            self.assertEqual(len(err.strip().splitlines()), 1, err)
            self.assertTrue(err.startswith("tidepool.plan: error: " + said), err)
            self.assertIn("--help` lists the options", err)
            self.assertNotIn("usage:", err)

    def test_a_model_without_a_named_loss_plans_without_transformers_warning(self):
        # GPT2LMHeadModel maps to no loss by its name: transformers warns
        # `loss_type=None` ... at every run unless the planner names it.
        status, out, err = plan("hf:gpt2", "--set", "n_layer=1", "--set", "n_embd=64", "--set", "n_head=2",
                                "--set", "vocab_size=128", "--seq", "16", "--steps", "1", "--json", env={})
        self.assertEqual(status, 0, err)
        self.assertNotIn("loss_type", err)

    def test_seq_defaults_to_the_context_length_a_module_says(self):
        status, out, err = plan("module:plan_models:basics_tiny", "--json", "--steps", "1")
        self.assertEqual(status, 0, err)
        self.assertEqual(rows(out)[0]["variant"]["seq"], 64)

    def test_a_shape_the_model_refuses_names_the_options(self):
        status, out, err = plan("module:plan_models:basics_tiny", "--seq", "128", "--batch", "3")
        self.assertEqual(status, 2, out + err)
        self.assertIn("the model refused inputs of --batch 3 and --seq 128: ", err)
        self.assertNotIn("Traceback", err)
        # A default the model cannot take says it was the default.
        status, out, err = plan("module:plan_models:learned_positions")
        self.assertEqual(status, 2, out + err)
        self.assertIn("--batch 1 and --seq 512 (the default): ", err)
        # An error of another kind is the variant's own, not blamed on the options.
        status, out, err = plan("module:plan_models:wrong_type", "--seq", "8", "--json")
        self.assertEqual(status, 1, out + err)
        self.assertEqual(rows(out)[0]["error"], "RuntimeError: expected scalar type Float but found BFloat16")

    def test_zero1_divides_the_optimizer_state_and_zero2_the_gradients_too(self):
        from tidepool.plan import step

        sets = {k: int(v) for k, v in (item.split("=") for item in LLAMA[2:13:2])}
        base = dict(task="train", batch=2, seq=256, precision="fp32", checkpointing=False, accumulation=1,
                    optimizer="adamw", steps=2, lora_rank=0, new_tokens=0)
        held, peaks = {}, {}
        for way in ("alone", "ddp", "zero1", "zero2", "fsdp"):
            rec = step.record("hf:llama", sets, dict(base, **({} if way == "alone" else {way: 4})), None)
            # What a rank holds as the second optimizer step begins, and at its peak.
            held[way] = rec.breakdown_at(dict(rec.marks)["step 2: optimizer"] - 1)
            peaks[way] = rec.breakdown_at_peak()
        whole = held["alone"]

        def ratio(way, category):
            return whole[category] / held[way][category]

        self.assertAlmostEqual(ratio("zero1", "optimizer"), 4, delta=0.4)
        self.assertAlmostEqual(ratio("zero1", "weights"), 1, delta=0.05)
        self.assertEqual(held["zero1"]["gradients"], held["ddp"]["gradients"], "every gradient, in DDP's buckets too")
        for category in ("optimizer", "gradients"):
            self.assertAlmostEqual(ratio("zero2", category), 4, delta=0.4, msg=category)
        # ZeRO-2 keeps every block's weights whole from its forward to its backward; FSDP (ZeRO-3)
        # gathers a block (and prefetches the next) at a time.
        self.assertGreaterEqual(peaks["zero2"]["weights"], whole["weights"])
        self.assertGreater(peaks["zero2"]["weights"], peaks["fsdp"]["weights"])

    def test_help_says_every_default(self):
        status, out, err = plan("--help")
        self.assertEqual(status, 0, err)
        text = " ".join(out.split())
        for said in ("micro-batch (default: 1)", "(default: train)", "(default: fp32)", "else adamw)",
                     "(default: 2)", "default: trainer for hf: models", "default: the model's context length"):
            self.assertIn(said, text)
        self.assertNotIn("default: None", text)

    def test_each_variant_says_how_many_of_its_jobs_share_each_card(self):
        status, out, err = plan(*LLAMA, "--steps", "1", "--json", "--cards", "T4,H100")
        self.assertEqual(status, 0, err)
        (r,) = rows(out)
        self.assertEqual(set(r["jobs"]), {"T4", "H100"})
        h100 = 81_559 << 20
        # The need on an H100 (its two threads' 32 MiB workspaces) and a 1.5 GiB context per job.
        need = r["tidepool_min_capacity_bytes"] + 2 * ((32 << 20) - 8_519_680)
        self.assertEqual(r["jobs"]["H100"], h100 // (need + (3 << 29)) - 1)
        self.assertLessEqual(r["jobs_pytorch"]["H100"], r["jobs"]["H100"])
        status, out, err = plan(*LLAMA, "--steps", "1", "--cards", "T4,H100", "--sweep", "batch=1,2")
        self.assertEqual(status, 0, err)
        self.assertIn("jobs side by side per card by the N+1 rule", out)
        self.assertRegex(out, r"\n  batch=1: T4 \d+(?: \(PyTorch \d+\))?, H100 \d+")
        # A card where no job runs beside its reserve is left out of the line.
        status, out, err = plan(*LLAMA, "--steps", "1", "--cards", "1.7GiB,H100")
        self.assertEqual(status, 0, err)
        self.assertRegex(out, r"\n  H100 \d+")

    def test_a_table_without_a_sweep_has_no_variant_column(self):
        status, out, err = plan(*LLAMA, "--steps", "1", "--cards", "24GB")
        self.assertEqual(status, 0, err)
        head = out.splitlines()[1].split()
        self.assertEqual(head[:2], ["peak", "live"], out)
        self.assertIn("copies", head)


@unittest.skipIf(SKIP, SKIP)
class Optimizers(unittest.TestCase):
    """Each --optimizer as PyTorch runs it on CUDA, and a factory's own: the
    state they keep and the temporaries of their steps, on plan_models'
    tiny_lm (21 parameters, 2,624,000 bytes in fp32)."""

    BASE = dict(task="train", batch=1, seq=64, precision="fp32", checkpointing=False, accumulation=1,
                optimizer=None, steps=2, lora_rank=0, new_tokens=0, ddp=0, fsdp=0)

    @classmethod
    def setUpClass(cls):
        import torch

        for path in (HERE, EXAMPLES):
            if path not in sys.path:
                sys.path.insert(0, path)
        import plan_models

        with torch.device("meta"):
            model = plan_models.tiny_lm()
        cls.sizes = [p.numel() * 4 for p in model.parameters()]
        # Adafactor's state: a row and a column of second moments per matrix, a whole one per vector.
        cls.factored = sum((p.shape[0] + p.shape[1] if p.dim() == 2 else p.numel()) * 4 for p in model.parameters())

    @staticmethod
    def step_figures(rec):
        """(state after step 2, temporaries of step 2's optimizer step: the
        most it added to what was live as it began)."""
        marks = dict(rec.marks)
        begin, end = marks["step 2: optimizer"], marks["step 2"]
        live = start = most = sum(e[3] if e[1] == "allocate" else -e[3] for e in rec.events[:begin])
        for _, action, _, size, _ in rec.events[begin:end]:
            live += size if action == "allocate" else -size
            most = max(most, live)
        return rec.breakdown_at(end - 1)["optimizer"], most - start

    def test_each_implementation_keeps_its_state_and_allocates_its_steps_temporaries(self):
        from tidepool.plan import step

        sizes, params = self.sizes, sum(self.sizes)
        self.assertEqual((len(sizes), params), (21, 2_624_000))
        # The for-loop's denominator of a parameter is made while the last
        # one's is still held: sqrt, then the division (sqrt freed after).
        loop = max(2 * size + (sizes[i - 1] if i else 0) for i, size in enumerate(sizes))
        self.assertEqual(loop, 786_432)  # w1's denominator, then w3's sqrt and quotient (512 x 128 each)
        expected = {
            "adamw": (2 * params, params),  # foreach: one sqrt per parameter, all at once
            "adamw-loop": (2 * params, loop),
            "adamw-fused": (2 * params + 4 * len(sizes), 0),  # its fp32 step counters are on the device
            "sgd": (params, 0),  # the momentum buffers, updated in place
            "sgd-plain": (0, 0),
        }
        for name in (*expected, "adafactor"):
            rec = step.record("module:plan_models:tiny_lm", {}, dict(self.BASE, optimizer=name), None)
            self.assertEqual(rec.optimizer, name)
            state, temporaries = self.step_figures(rec)
            if name == "adafactor":
                self.assertEqual(state, self.factored)
                self.assertGreater(temporaries, 0)
                self.assertLess(temporaries, params / 4, "a loop: one parameter's temporaries at a time")
            else:
                self.assertEqual((state, temporaries), expected[name], name)
            # At the peak the column holds the state, never a step's temporaries.
            self.assertEqual(rec.breakdown_at_peak()["optimizer"], state, name)

    def test_pytorchs_memtracker_sees_the_same_steps(self):
        import torch
        from torch.distributed._tools.mem_tracker import MemTracker

        import plan_models
        from tidepool.plan.optimizer import OPTIMIZERS
        from tidepool.record import Recorder

        meta = torch.device("meta")
        for name, (_, make) in OPTIMIZERS.items():
            with meta:
                model = plan_models.tiny_lm()
            optimizer = make(list(model.parameters()))
            tracker = MemTracker()
            tracker.track_external(model, optimizer)
            # One run seen by both (the recorder makes optimizers choose as on CUDA).
            with tracker, Recorder(None, cublas_workspace=0) as rec:
                rec.track(model, optimizer)
                for p in model.parameters():
                    p.grad = torch.ones_like(p)
                for _ in range(2):
                    optimizer.step()
            peak, now = tracker.get_tracker_snapshot("peak")[meta], tracker.get_tracker_snapshot()[meta]
            ours = rec.breakdown_at_peak()
            self.assertEqual(peak["Total"], rec.peak()[0], name)
            self.assertEqual(now["Optstate"], rec.breakdown_at(len(rec.events) - 1)["optimizer"], name)
            # MemTracker counts what the step allocates as optimizer memory; here
            # its temporaries are temporaries (activations) and the state alone optimizer.
            self.assertEqual(peak["Optstate"], ours["optimizer"] + ours["activations"], name)

    def test_a_factorys_own_optimizer_makes_its_state_at_the_first_step(self):
        import torch

        import own_optimizer
        from tidepool.plan import step

        with torch.device("meta"):
            sizes = [p.numel() * 4 for p in own_optimizer.model().parameters()]
        params = sum(sizes)
        rec = step.record("module:own_optimizer:model_and_optimizer", {}, self.BASE, None)
        self.assertEqual(rec.optimizer, "own_optimizer.LoopAdamW")
        marks = dict(rec.marks)
        self.assertEqual(rec.breakdown_at(marks["step 1: optimizer"] - 1)["optimizer"], 0, "no state before its step")
        first = [e for e in rec.events[marks["step 1: optimizer"]:marks["step 1"]] if e[1] == "allocate"]
        self.assertEqual(sum(e[3] for e in first if e[4] == "aten.zeros_like.default"), 2 * params)
        state, temporaries = self.step_figures(rec)
        self.assertEqual(state, 2 * params)
        # Its loop holds one parameter's denominator while it makes the next.
        self.assertEqual(temporaries, max(size + (sizes[i - 1] if i else 0) for i, size in enumerate(sizes)))
        status, out, err = plan("module:own_optimizer:model_and_optimizer", "--seq", "64", "--json")
        self.assertEqual(status, 0, err)
        (r,) = rows(out)
        self.assertEqual(r["variant"]["optimizer"], "own_optimizer.LoopAdamW")
        self.assertEqual(r["breakdown"]["optimizer_bytes"], 2 * params)

    def test_a_sweep_of_optimizers_and_the_default_named_in_the_variant(self):
        status, out, err = plan("module:plan_models:tiny_lm", "--seq", "64", "--json",
                                "--sweep", "optimizer=adamw,adamw-loop,adamw-fused")
        self.assertEqual(status, 0, err)
        foreach, loop, fused = rows(out)
        self.assertEqual([r["variant"]["optimizer"] for r in (foreach, loop, fused)],
                         ["adamw", "adamw-loop", "adamw-fused"])
        # The step's temporaries make the difference (the backward's peak may be the fused step's).
        self.assertEqual(foreach["peak_live_bytes"] - loop["peak_live_bytes"], 2_624_000 - 786_432)
        self.assertGreater(loop["peak_live_bytes"], fused["peak_live_bytes"])
        self.assertEqual({r["breakdown"]["optimizer_bytes"] for r in (foreach, loop)}, {2 * 2_624_000})
        status, out, err = plan("module:plan_models:tiny_lm", "--seq", "64", "--json")
        self.assertEqual(rows(out)[0]["variant"]["optimizer"], "adamw")

    def test_a_factorys_optimizer_maker_trains_lora_adapters(self):
        status, out, err = plan("module:own_optimizer:model_and_optimizer_maker", "--seq", "64", "--json",
                                "--sweep", "lora-rank=0,8")
        self.assertEqual(status, 0, err)
        full, lora = rows(out)
        self.assertEqual(lora["variant"]["optimizer"], "own_optimizer.LoopAdamW")
        self.assertLess(lora["breakdown"]["optimizer_bytes"], full["breakdown"]["optimizer_bytes"] / 20)


SHARED = os.path.normpath(os.path.join(HERE, "..", "..", "..", "..", "shared"))
SNAPSHOTS = os.path.join(SHARED, "traces", "pytorch-snapshots")
# Under CI, a ../shared without its snapshots is an incomplete copy: a failure.
if os.environ.get("CI") == "true" and os.path.isdir(SHARED) and not os.path.isdir(SNAPSHOTS):
    raise RuntimeError(f"CI=true: {SNAPSHOTS} is missing: an incomplete copy of ../shared/traces")


def snapshot_peak(name):
    """Peak of live requested bytes of a real snapshot's device 0: the live
    set at its start rebuilt backwards from its final segments, then its
    events."""
    import pickle

    class PlainData(pickle.Unpickler):
        def find_class(self, module, name):
            raise pickle.UnpicklingError(f"{module}.{name} refused: plain data only")

    with open(os.path.join(SNAPSHOTS, name), "rb") as f:
        snap = PlainData(f).load()
    events = snap["device_traces"][0]
    live = {b["address"]: b["requested_size"] for seg in snap["segments"] if seg.get("device", 0) == 0
            for b in seg["blocks"] if b["state"] != "inactive"}
    for e in reversed(events):
        if e["action"] == "alloc":
            live.pop(e["addr"], None)
        elif e["action"] == "free_completed":
            live[e["addr"]] = e["size"]
    current = peak = sum(live.values())
    for e in events:
        if e["action"] == "alloc":
            live[e["addr"]] = e["size"]
            current += e["size"]
            peak = max(peak, current)
        elif e["action"] == "free_completed" and e["addr"] in live:
            current -= live.pop(e["addr"])
    return peak


@unittest.skipIf(SKIP, SKIP)
@unittest.skipUnless(os.path.isdir(SNAPSHOTS), f"no real snapshots at {SNAPSHOTS}")
class RealSnapshots(unittest.TestCase):
    """The recorded peak against what PyTorch allocated on a GPU for the same
    model and step (the configurations of ../shared/traces/pytorch-snapshots/
    README.md, as module: factories in plan_models.py)."""

    def recorded_peak(self, factory, **options):
        from tidepool.plan import step

        if HERE not in sys.path:
            sys.path.insert(0, HERE)
        base = dict(task="train", batch=1, seq=None, precision="fp32", checkpointing=False, accumulation=1,
                    optimizer="adamw", steps=1, lora_rank=0, new_tokens=0)
        return step.record(f"module:plan_models:{factory}", {}, dict(base, **options), None).peak()[0]

    def test_medium_inference_in_fp32(self):
        real = snapshot_peak("wed_medium_128_inference.pickle")
        ours = self.recorded_peak("wed_medium", task="inference", batch=4, seq=128)
        self.assertAlmostEqual(ours / real, 1.0, delta=0.01, msg=f"recorded {ours}, PyTorch {real}")

    def test_xl_forward_with_gradients_under_bf16_autocast(self):
        # The course code's model (einsum linears), its logits kept, no loss, no backward.
        real = snapshot_peak("kk_memory_ctx256_forward_mixed.pickle")
        ours = self.recorded_peak("basics_xl", task="forward-grad", batch=4, seq=256, precision="bf16-mixed")
        self.assertAlmostEqual(ours / real, 1.0, delta=0.01, msg=f"recorded {ours}, PyTorch {real}")

    def test_xl_first_full_step_with_a_for_loop_adamw_and_the_logits_held(self):
        # The course code's model and its own AdamW (a loop over the parameters, state made in the
        # step) in a plain loop: logits = model(x); loss_fn(logits, y).backward(); optimizer.step().
        real = snapshot_peak("kk_memory_ctx512_fullstep.pickle")
        ours = self.recorded_peak("basics_xl", batch=4, seq=512, optimizer="adamw-loop", loop="plain")
        self.assertAlmostEqual(ours / real, 1.0, delta=0.01, msg=f"recorded {ours}, PyTorch {real}")

    def test_xl_full_step_with_bf16_autocast_and_foreach_adamw(self):
        real = snapshot_peak("lin_xl_ctx512_fullstep_bf16.pickle")
        ours = self.recorded_peak("kk_xl", batch=4, seq=512, precision="bf16-mixed", steps=2)
        self.assertAlmostEqual(ours / real, 1.0, delta=0.01, msg=f"recorded {ours}, PyTorch {real}")


@unittest.skipIf(SKIP, SKIP)
class BadInput(unittest.TestCase):
    def fails(self, *args, status=2):
        code, out, err = plan(*args)
        self.assertEqual(code, status, out + err)
        self.assertNotIn("Traceback", err) if status == 2 and "raises" not in str(args) else None
        return err

    def test_an_unknown_architecture_is_named(self):
        err = self.fails("hf:gpt3000")
        self.assertIn("unknown architecture 'gpt3000'", err)

    def test_a_malformed_config_names_the_file_or_the_field(self):
        with tempfile.TemporaryDirectory() as tmp:
            broken = os.path.join(tmp, "config.json")
            with open(broken, "w") as f:
                f.write("{not json")
            self.assertIn(f"{broken}: not valid JSON", self.fails(broken))
            with open(broken, "w") as f:
                json.dump({"hidden_size": 8}, f)
            self.assertIn('no "model_type" field', self.fails(broken))
            with open(broken, "w") as f:
                json.dump({"model_type": "llama-9"}, f)
            self.assertIn('field "model_type"', self.fails(broken))
        self.assertIn("no such file", self.fails("/nonexistent/config.json"))

    def test_an_unknown_config_field_is_named(self):
        self.assertIn("has no field 'hiden_size'", self.fails("hf:llama", "--set", "hiden_size=8"))

    def test_a_factory_that_raises_shows_its_traceback(self):
        code, out, err = plan("module:plan_models:raises")
        self.assertEqual(code, 2)
        self.assertIn("Traceback", err)
        self.assertIn("this factory fails on purpose", err)

    def test_a_missing_module_or_factory_is_named(self):
        self.assertIn("no module named 'no_such_models'", self.fails("module:no_such_models:f"))
        self.assertIn("has no callable 'nope'", self.fails("module:plan_models:nope"))
        self.assertIn("expected module:pkg.mod:factory", self.fails("module:plan_models"))

    def test_options_the_task_does_not_support_are_refused(self):
        self.assertIn("--lora-rank trains adapters", self.fails(*LLAMA, "--task", "forward", "--lora-rank", "4"))
        self.assertIn("needs a causal language model", self.fails("hf:vit", "--task", "generate"))
        self.assertIn("--new-tokens is for --task generate", self.fails(*LLAMA, "--new-tokens", "4"))
        self.assertIn("--ddp replicates a training step", self.fails(*LLAMA, "--task", "forward", "--ddp", "2"))
        self.assertIn("--ddp and --fsdp: choose one", self.fails(*LLAMA, "--ddp", "2", "--fsdp", "2"))
        self.assertIn("--zero1 and --zero2: choose one", self.fails(*LLAMA, "--zero1", "2", "--zero2", "2"))
        self.assertIn("--zero2 shards what training keeps", self.fails(*LLAMA, "--task", "inference", "--zero2", "2"))
        self.assertIn("--loop plain: the loop's shape is a training loop's",
                      self.fails(*LLAMA, "--task", "forward-grad", "--loop", "plain"))
        self.assertIn("--checkpointing saves activations for backward: --task inference has none",
                      self.fails(*LLAMA, "--task", "inference", "--checkpointing"))
        self.assertIn("invalid choice: 'backward'", self.fails(*LLAMA, "--task", "backward"))
        self.assertIn("a Workload's inputs are its own", self.fails("module:plan_models:image_workload", "--task", "generate"))
        self.assertIn("no linear layers peft can wrap",
                      self.fails("module:plan_models:embedding_only", "--lora-rank", "4"))

    def test_a_factory_the_planner_cannot_train_is_named(self):
        self.assertIn("NoParameters has no parameters that require gradients",
                      self.fails("module:plan_models:no_parameters"))
        self.assertIn("the factory's AdamW holds 21 of 21 tensors that are not parameters of the model LM",
                      self.fails("module:plan_models:foreign_optimizer"))
        self.assertIn("returned (model, str); expected the optimizer as a torch.optim.Optimizer or a callable",
                      self.fails("module:plan_models:not_an_optimizer"))
        self.assertIn("returned a tuple of 3; expected (model, optimizer)", self.fails("module:plan_models:three_things"))
        self.assertIn("TwoInputs is called with token ids alone (a (batch, seq) tensor), but its signature is "
                      "(ids, mask); return a tidepool.workload.Workload", self.fails("module:plan_models:two_inputs"))
        self.assertIn("Pooled returned a tensor of shape (1, 16) for token ids of shape (1, 8); expected logits",
                      self.fails("module:plan_models:pooled", "--seq", "8"))
        if EXAMPLES not in sys.path:
            sys.path.insert(0, EXAMPLES)
        self.assertIn("--optimizer sgd: the factory returns its own optimizer",
                      self.fails("module:own_optimizer:model_and_optimizer", "--optimizer", "sgd"))
        for option in ("--lora-rank", "--fsdp"):
            self.assertIn(f"{option} ", self.fails("module:own_optimizer:model_and_optimizer", "--seq", "64", option, "2"))
            self.assertIn("return (model, a callable making the optimizer from the parameters to train)",
                          self.fails("module:own_optimizer:model_and_optimizer", "--seq", "64", option, "2"))
        self.assertIn("invalid choice: 'adam'", self.fails(*LLAMA, "--optimizer", "adam"))
        self.assertIn("--sweep optimizer: expected one of adamw, adamw-loop, adamw-fused, sgd, sgd-plain, adafactor",
                      self.fails(*LLAMA, "--sweep", "optimizer=adamw,lion"))

    def test_bad_sweeps_and_numbers_are_named(self):
        self.assertIn("--sweep colour: not a sweepable option", self.fails(*LLAMA, "--sweep", "colour=red"))
        self.assertIn("--sweep batch", self.fails(*LLAMA, "--sweep", "batch=1,two"))
        self.assertIn("--sweep precision", self.fails(*LLAMA, "--sweep", "precision=fp8"))
        self.assertIn("--sweep task: invalid choice: 'backward'", self.fails(*LLAMA, "--sweep", "task=train,backward"))
        self.assertIn("--batch", self.fails(*LLAMA, "--batch", "0"))
        self.assertIn("--cards 'big,h100': 'big' is neither a card (T4, A10G,", self.fails(*LLAMA, "--cards", "big,h100"))
        # A size is a card's memory with its unit: a bare number could be GB or GiB.
        for cards, said in (("nan,24GB", "'nan' is neither a card"), ("24,h100", "'24': a card's memory needs its "
                            "unit: write 24GB (10^9 bytes, as vendors state a card's memory) or 24GiB (2^30 bytes)"),
                            ("0GB", "'0GB': a card of 0 GB leaves an allocator nothing"), (",", "expected cards")):
            self.assertIn(f"--cards {cards!r}: {said}", self.fails(*LLAMA, "--cards", cards))
        self.assertIn("--cards 'l4,a100': 'a100' names more than one card: A100 40GB, A100 80GB",
                      self.fails(*LLAMA, "--cards", "l4,a100"))
        # A sweep of no values would plan nothing and say nothing.
        self.assertIn("expected KEY=V1,V2", self.fails(*LLAMA, "--sweep", "batch=,"))

    def test_cards_by_the_end_of_their_name_and_sizes_with_their_unit(self):
        from tidepool.plan import Exit, find_tidepool, resolve_cards

        cards = resolve_cards(BINARY, "4090,22.5GiB,a6000,30 GB,H100 80GB,nvidia a100-sxm4-40gb")
        self.assertEqual([card.name for card in cards],
                         ["22.5 GiB", "RTX 4090", "30 GB", "A100 40GB", "RTX A6000", "H100"], cards)
        usable = {card.name: card.usable for card in cards}
        # A size is the card's memory, as its vendor states it (GB: 10^9 bytes); the allocator gets 1.5 GiB less.
        self.assertEqual(usable["22.5 GiB"], 21 * 2**30)
        self.assertEqual(usable["30 GB"], 30 * 10**9 - 3 * 2**29)
        self.assertEqual({card.name: card.compute_capability for card in cards}["RTX 4090"], (8, 9))
        self.assertIsNone(cards[0].compute_capability, "a card given by its memory")
        # A 24 GB card does not give 24 GiB: a need of 22 GiB fits an RTX 4090 (22.5 GiB), not a "24GB" card.
        self.assertLess(resolve_cards(BINARY, "24GB")[0].usable, 21 * 2**30)
        # "a100" is two cards (A100 40GB, A100 80GB): refused, with both.
        with self.assertRaisesRegex(Exit, "--cards 'a100': 'a100' names more than one card: A100 40GB, A100 80GB$"):
            resolve_cards(BINARY, "a100")
        # A binary named but missing is an error, not a fall back to another build.
        with self.assertRaisesRegex(Exit, "--tidepool /nonexistent/tidepool: not an executable"):
            find_tidepool("/nonexistent/tidepool")

    def test_a_combination_one_variant_cannot_have_fails_that_row_only(self):
        # Checkpointing is for backward: the inference variant's row says so, the others are planned.
        status, out, err = plan(*LLAMA, "--json", "--sweep", "task=train,inference", "--sweep", "checkpointing=false,true")
        self.assertEqual(status, 1, err)
        results = rows(out)
        self.assertEqual(len(results), 4, out)
        failed = [r for r in results if "error" in r]
        self.assertEqual(len(failed), 1, out)
        self.assertIn("--checkpointing", failed[0]["error"])
        self.assertTrue(all("peak_live_bytes" in r for r in results if "error" not in r))

    def test_a_plan_binary_that_answers_nothing_useful_is_named(self):
        from tidepool.plan.running import _plan_result

        class Done:
            def __init__(self, code, out, err=""):
                self.returncode, self.out, self.err = code, out, err

            def communicate(self):
                return self.out, self.err

        for process, said in [(Done(0, ""), "printed no JSON"), (Done(0, "not json\n"), "printed no JSON: 'not json'"),
                              (Done(1, ""), "exit status 1): no output"), (Done(-9, ""), "killed by signal 9")]:
            with self.assertRaisesRegex(RuntimeError, said.replace("(", "\\(").replace(")", "\\)")):
                _plan_result(process)

    def test_the_recorder_refuses_sizes_and_paths_before_recording(self):
        from tidepool.record import main

        for argv in (["mlp", "--out", "t.csv", "--batch", "0"], ["mlp", "--out", "t.csv", "--steps", "-1"],
                     ["mlp", "--out", "/nonexistent-dir/t.csv"]):
            with contextlib.redirect_stderr(io.StringIO()) as said, self.assertRaises(SystemExit) as ended:
                main(argv)
            self.assertEqual(ended.exception.code, 2, argv)
            self.assertTrue("positive integer" in said.getvalue() or "no directory" in said.getvalue(), said.getvalue())


if __name__ == "__main__":
    unittest.main()
