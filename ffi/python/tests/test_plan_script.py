"""python -m tidepool.plan run SCRIPT: scripts of ffi/python/tests/scripts
run unchanged without a GPU, each peak compared with the same workload
recorded through the Recorder on the meta device (the path of `module:`
factories), with the real tidepool command (TIDEPOOL_BIN).

Skipped without torch, transformers or the tidepool command, except when
TIDEPOOL_REQUIRE_TORCH=1 (CI), where their absence fails; skipped under
TIDEPOOL_SKIP_PLAN=1 (tools/tests/tools/python.rs runs the planner's tests
in a test of their own).
"""
import contextlib
import importlib.util
import io
import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPTS = os.path.join(HERE, "scripts")
NEEDED = [m for m in ("torch", "transformers") if importlib.util.find_spec(m) is None]
BINARY = os.environ.get("TIDEPOOL_BIN") or shutil.which("tidepool")
REQUIRED = os.environ.get("TIDEPOOL_REQUIRE_TORCH") == "1"
if os.environ.get("TIDEPOOL_SKIP_PLAN") == "1":
    NEEDED, REQUIRED = ["its own run (TIDEPOOL_SKIP_PLAN=1)"], False
if REQUIRED and (NEEDED or not BINARY):
    raise RuntimeError(f"TIDEPOOL_REQUIRE_TORCH=1 but missing: {NEEDED or 'the tidepool command (TIDEPOOL_BIN)'}")
SKIP = f"needs {', '.join(NEEDED)}" if NEEDED else ("needs the tidepool command (TIDEPOOL_BIN)" if not BINARY else "")


def run(*args):
    """`python -m tidepool.plan run ARGS` in this process: (status, stdout, stderr)."""
    from tidepool.plan import main

    os.environ["TIDEPOOL_BIN"] = BINARY or ""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(["run", *args])
            status = 0
        except SystemExit as exit:
            status = exit.code
    return status, out.getvalue(), err.getvalue()


def planned(*args):
    """The JSON report of a run that must succeed, and what the script printed."""
    status, out, err = run("--json", *args)
    assert status == 0, err
    lines = out.splitlines()
    return json.loads(lines[-1]), lines[:-1]


def h100_workspace():
    """cuBLAS's workspace a thread on the default card of `run` (an H100)."""
    from tidepool.plan.record import cublas_workspace_bytes

    return cublas_workspace_bytes((9, 0))


def script(name):
    return os.path.join(SCRIPTS, name)


def _load(name):
    spec = importlib.util.spec_from_file_location(f"scripts_{name}", script(name + ".py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def reference_train(zero_grad="before-forward", accumulation=1, amp=False, eval_every=0, steps=2, width=512,
                    depth=4, batch=64, classes=1000):
    """train_loop.py's loop written for the Recorder on the meta device (the
    model path's recording): its peak of live bytes."""
    import torch
    import torch.nn.functional as F

    from tidepool.plan.attention import cuda_attention
    from tidepool.plan.autocast import cuda_autocast
    from tidepool.record import Recorder

    net = _load("train_loop").Net
    with torch.device("meta"):
        model = net(width, depth, classes)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with Recorder(None, cublas_workspace=h100_workspace()) as rec, cuda_attention():
        rec.track(model)
        rec.track(optimizer)
        scale = torch.full((), 65536.0, device="meta") if amp else None
        for step in range(steps):
            if zero_grad == "before-forward":
                optimizer.zero_grad(set_to_none=True)
            for micro in range(accumulation):
                x = torch.randn(batch, width, device="meta")
                y = torch.randint(0, classes, (batch,), device="meta")
                with cuda_autocast(torch.float16, enabled=amp):
                    logits = model(x)
                    loss = F.cross_entropy(logits, y) / accumulation
                if zero_grad == "before-backward" and micro == 0:
                    optimizer.zero_grad(set_to_none=True)
                (loss * scale if amp else loss).backward()
            optimizer.step()
            if zero_grad == "after-step":
                optimizer.zero_grad(set_to_none=True)
            if eval_every and (step + 1) % eval_every == 0:
                with torch.no_grad():
                    (model(torch.randn(batch * 2, width, device="meta")).argmax(-1) == 0).float().mean()
    return rec.peak()[0]


def memtracker_train(zero_grad, accumulation, steps, width, depth, batch, classes):
    """train_loop.py's loop on the meta device under PyTorch's MemTracker:
    its peak."""
    import torch
    import torch.nn.functional as F
    from torch.distributed._tools.mem_tracker import MemTracker

    meta = torch.device("meta")
    with meta:
        model = _load("train_loop").Net(width, depth, classes)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    with tracker:
        for step in range(steps):
            if zero_grad == "before-forward":
                optimizer.zero_grad(set_to_none=True)
            for micro in range(accumulation):
                if step or micro:
                    tracker.reset_mod_stats()  # MemTracker's way to see a module called again
                x, y = torch.randn(batch, width, device=meta), torch.randint(0, classes, (batch,), device=meta)
                logits = model(x)  # held to the next forward, as the script holds it
                loss = F.cross_entropy(logits, y) / accumulation
                if zero_grad == "before-backward" and micro == 0:
                    optimizer.zero_grad(set_to_none=True)
                loss.backward()
            optimizer.step()
            if zero_grad == "after-step":
                optimizer.zero_grad(set_to_none=True)
    return tracker.get_tracker_snapshot("peak")[meta]["Total"]


@unittest.skipIf(SKIP, SKIP)
class TrainingLoops(unittest.TestCase):
    """train_loop.py, a hand-written loop, in the shapes real loops take."""

    def check(self, options, tolerance=0, **reference):
        row, printed = planned("--steps", "2", script("train_loop.py"), *options)
        ref = reference_train(**reference)
        self.assertLessEqual(abs(row["peak_live_bytes"] - ref), tolerance,
                             f"{options}: the script's peak {row['peak_live_bytes']} against the reference's {ref}")
        self.assertEqual(row["script"]["optimizer_steps"], 2)
        self.assertEqual(row["script"]["stopped_after"], "optimizer steps")
        b = row["breakdown"]
        self.assertEqual(sum(b.values()), row["peak_live_bytes"])
        self.assertGreater(b["weights_bytes"], 0)
        self.assertLessEqual(row["peak_live_bytes"], row["tidepool_min_capacity_bytes"])
        self.assertLessEqual(row["peak_live_bytes"], row["pytorch_min_capacity_bytes"])
        self.assertTrue(row["fits"])
        return row

    def test_zero_grad_before_the_forward_plans_as_the_reference(self):
        self.check(["--steps", "5"], zero_grad="before-forward")

    def test_zero_grad_between_forward_and_backward_keeps_the_gradients_through_the_forward(self):
        # The previous step's gradients are alive through the forward: the
        # peak (the forward's end, where the activations outweigh the
        # optimizer step's temporaries) is higher by the gradients' bytes,
        # less the gradients the other loop has made at its own peak, early
        # in the backward (measured: 3,947,516 of 4,220,968 bytes, 93.5 %).
        shape = dict(batch=512, width=256, depth=16, classes=10)
        options = ["--steps", "5"] + [f"--{k}={v}" for k, v in shape.items()]
        before = self.check(options, zero_grad="before-forward", **shape)
        between = self.check(options + ["--zero-grad", "before-backward"], zero_grad="before-backward", **shape)
        gradients = 4 * (16 * (256 * 256 + 256) + 256 * 10 + 10)
        self.assertEqual(between["breakdown"]["gradients_bytes"], gradients)
        higher = between["peak_live_bytes"] - before["peak_live_bytes"]
        self.assertLessEqual(higher, gradients)
        self.assertGreaterEqual(higher, 0.9 * gradients)

    def test_pytorchs_memtracker_sees_the_same_peak_for_each_placement_of_zero_grad(self):
        # MemTracker (torch.distributed._tools) over the same loop on the
        # meta device, AdamW foreach as on CUDA: the peak the script's run
        # records, less its two cuBLAS workspaces (the forward's thread and
        # the backward's), which MemTracker does not know.
        shape = dict(batch=512, width=256, depth=16, classes=10)
        options = ["--steps", "3"] + [f"--{k}={v}" for k, v in shape.items()]
        peaks = set()
        for zero_grad in ("before-forward", "before-backward", "after-step"):
            for accumulation in (1, 2):
                row, _ = planned("--steps", "3", script("train_loop.py"), *options, "--zero-grad", zero_grad,
                                 "--accumulation", str(accumulation))
                tracked = memtracker_train(zero_grad, accumulation, steps=3, **shape)
                self.assertEqual(row["peak_live_bytes"] - 2 * h100_workspace(), tracked,
                                 f"--zero-grad {zero_grad} --accumulation {accumulation}")
                peaks.add(tracked)
        self.assertGreaterEqual(len(peaks), 3)  # the placements differ

    def test_zero_grad_after_the_step(self):
        self.check(["--steps", "5", "--zero-grad", "after-step"], zero_grad="after-step")

    def test_gradient_accumulation(self):
        self.check(["--steps", "5", "--accumulation", "3"], accumulation=3)

    def test_amp_with_autocast_and_grad_scaler(self):
        # Within 16 bytes: GradScaler's growth tracker and found-inf flag
        # (4 bytes each), which the reference's multiplication by the scale
        # does not make.
        self.check(["--steps", "5", "--amp"], amp=True, tolerance=16)

    def test_evaluation_inside_training(self):
        self.check(["--steps", "5", "--eval-every", "1", "--batch", "256"], eval_every=1, batch=256)

    def test_compile_runs_eagerly_and_says_so(self):
        row, _ = planned("--steps", "2", script("train_loop.py"), "--compile")
        self.assertEqual(row["script"]["compiled"], 1)
        self.assertEqual(row["peak_live_bytes"], reference_train())
        status, out, _ = run("--steps", "2", script("train_loop.py"), "--compile")
        self.assertEqual(status, 0)
        self.assertIn("torch.compile: 1 calls, run eagerly", out)

    def test_a_value_read_back_drives_the_loop_to_the_step_limit(self):
        # `if loss.item() < target: break` never breaks on the placeholder
        # (1.0): --steps ends the run, and the report says where it read.
        row, printed = planned("--steps", "3", script("train_loop.py"), "--target-loss", "0.5")
        self.assertEqual(row["script"]["optimizer_steps"], 3)
        self.assertEqual(row["peak_live_bytes"], reference_train(steps=3))
        where = {(os.path.basename(r["file"]), r["line"], r["what"]): r["count"] for r in row["script"]["reads"]}
        # Steps 1 and 2 print the loss (line 73) and test it (line 74); step 3 ends in the optimizer's step.
        self.assertEqual(where, {("train_loop.py", 73, ".item()"): 2, ("train_loop.py", 74, ".item()"): 2})
        self.assertEqual(printed, ["step 1: loss 1.0000", "step 2: loss 1.0000"])
        status, out, _ = run("--steps", "3", script("train_loop.py"), "--target-loss", "0.5")
        self.assertIn("values read back from the card (4)", out)
        self.assertIn("train_loop.py:", out)


def plan_model(*args):
    """The model path (`python -m tidepool.plan MODEL ...`) in this process:
    its JSON rows."""
    from tidepool.plan import main

    if SCRIPTS not in sys.path:
        sys.path.insert(0, SCRIPTS)  # loop_factory.py and the train_loop.py it imports
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        try:
            main([*args, "--json"])
        except SystemExit as exit:
            assert exit.code == 0, exit.code
    return [json.loads(line) for line in out.getvalue().splitlines() if line.startswith("{")]


@unittest.skipIf(SKIP, SKIP)
class ZeroGradOption(unittest.TestCase):
    """--zero-grad on the model path: the script's loop, as options."""

    def test_each_place_plans_as_the_script_that_zeroes_there(self):
        shape = ["--batch=512", "--width=256", "--depth=16", "--classes=10"]
        places = ("after-step", "before-forward", "before-backward")
        rows = plan_model("module:loop_factory:workload", "--batch", "512", "--steps", "2",
                          "--sweep", "zero-grad=" + ",".join(places))
        self.assertEqual([r["variant"]["zero_grad"] for r in rows], list(places))
        for place, row in zip(places, rows):
            # An sm80 card: the model path records cuBLAS's workspace as PyTorch sizes it there.
            script_row, _ = planned("--card", "A100 80GB", "--steps", "2", script("train_loop.py"), *shape,
                                    "--zero-grad", place)
            # Within 16 bytes (measured: equal, equal, 4 bytes more for
            # before-backward): the script keeps its loss, a 4-byte scalar,
            # to the step's end, where the model path drops it after backward.
            self.assertLessEqual(abs(script_row["peak_live_bytes"] - row["peak_live_bytes"]), 16, place)
            self.assertEqual(script_row["breakdown"]["gradients_bytes"], row["breakdown"]["gradients_bytes"], place)
        self.assertGreater(rows[2]["peak_live_bytes"], rows[0]["peak_live_bytes"])

    def test_zeroing_in_place_keeps_the_gradients(self):
        rows = plan_model("module:loop_factory:workload", "--batch", "512", "--steps", "2",
                          "--sweep", "zero-grad-set-to-none=true,false")
        self.assertEqual([r["variant"]["zero_grad_set_to_none"] for r in rows], [True, False])
        gradients = 4 * (16 * (256 * 256 + 256) + 256 * 10 + 10)
        self.assertEqual(rows[1]["breakdown"]["gradients_bytes"], gradients)
        self.assertGreater(rows[1]["peak_live_bytes"], rows[0]["peak_live_bytes"])


@unittest.skipIf(SKIP, SKIP)
class ModelsMoved(unittest.TestCase):
    def test_an_optimizer_made_before_the_move_and_tied_weights_keep_their_parameters(self):
        # As on CUDA, `.cuda()` keeps each parameter object: the optimizer
        # made before it steps the card's parameters (its state on the card),
        # and the tied weight stays one.
        row, _ = planned(script("optimizer_first.py"))
        import torch
        import torch.nn.functional as F

        from tidepool.plan.attention import cuda_attention
        from tidepool.record import Recorder

        with torch.device("meta"):
            model = _load("optimizer_first").Tied()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        with Recorder(None, cublas_workspace=h100_workspace()) as rec, cuda_attention():
            rec.track(model)
            rec.track(optimizer)
            for _ in range(2):
                ids = torch.randint(0, 4096, (8, 128), device="meta")
                logits = model(ids)  # held through the backward and the step, as the script holds it
                loss = F.cross_entropy(logits.flatten(0, 1).float(), ids.flatten())
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            del loss, logits
        self.assertEqual(row["peak_live_bytes"], rec.peak()[0])
        weights = 4 * (4096 * 512 + 512 * 2048 + 2048 + 2048 * 512 + 512)
        self.assertEqual(row["breakdown"]["optimizer_bytes"], 2 * weights)


    def test_a_cast_on_the_card_keeps_the_parameters_and_frees_the_old_type(self):
        _, printed = planned(script("half_precision.py"))
        fp32 = 4 * (1024 * 1024 + 1024)
        self.assertEqual([int(line) for line in printed], [fp32, fp32 // 2, fp32 // 2])


@unittest.skipIf(SKIP, SKIP)
class TorchCuda(unittest.TestCase):
    def test_the_script_reads_the_card_and_the_planned_peak(self):
        with tempfile.TemporaryDirectory() as scratch:
            snapshot = os.path.join(scratch, "snapshot.pickle")
            row, printed = planned("--card", "A100 80GB", script("memory_report.py"), snapshot)
            self.assertEqual(printed[0], "device NVIDIA A100 80GB (81920 MiB, sm 8.0), 1 device(s), current 0")
            self.assertEqual(printed[1], "forward took nan ms")
            peak = int(printed[3].split()[1])
            self.assertEqual(peak, row["peak_live_bytes"])
            # The reference: the same forward recorded on meta.
            import torch

            from tidepool.record import Recorder

            with torch.device("meta"):
                model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 1024))
            with Recorder(None) as rec:
                rec.track(model)
                x = torch.randn(256, 1024, device="meta")
                with torch.no_grad():
                    y = model(x)
                del y
            self.assertEqual(peak, rec.peak()[0])
            weights = 4 * (1024 * 4096 * 2 + 4096 + 1024)
            live = weights + 4 * 256 * 1024 * 2 + rec.workspace_size  # weights, x, y and cuBLAS's workspace
            self.assertEqual(int(printed[2].split()[1]), live)
            self.assertEqual(int(printed[4].split()[3]), live)  # the peak since the reset
            # The snapshot replays to the same peak with `tidepool replay`.
            with open(snapshot, "rb") as f:
                self.assertIn("device_traces", pickle.load(f))
            done = subprocess.run([BINARY, "replay", snapshot, "--json", "--policy", "tidepool"],
                                  capture_output=True, text=True)
            self.assertEqual(done.returncode, 0, done.stderr)
            replayed = json.loads(done.stdout.strip().splitlines()[-1])
            self.assertEqual(replayed["peak_requested_bytes"], peak)
            # What PyTorch's allocator would reserve: the model of its policy
            # over the same events (its 2 MiB and 20 MiB segments); the card's
            # free memory is what is left of it.
            done = subprocess.run([BINARY, "replay", snapshot, "--json", "--policy", "pytorch"],
                                  capture_output=True, text=True)
            reserved = json.loads(done.stdout.strip().splitlines()[-1])["peak_reserved_bytes"]
            self.assertEqual(printed[5], f"reserved {reserved} bytes, {(81920 << 20) - (3 << 29) - reserved} free")
            self.assertGreater(reserved, peak)


    def test_a_snapshot_holds_the_events_of_the_memory_history_as_pytorchs_does(self):
        with tempfile.TemporaryDirectory() as scratch:
            snapshot = os.path.join(scratch, "window.pickle")
            row, _ = planned(script("history_window.py"), snapshot)
            self.assertEqual(row["peak_live_bytes"], 1 << 30)  # the run's peak: before the history
            for path, live in ((snapshot, 1), (snapshot + ".after", 2)):
                with open(path, "rb") as f:
                    dumped = pickle.load(f)
                self.assertEqual([(e["action"], e["size"]) for e in dumped["device_traces"][0]],
                                 [("alloc", 1 << 20)], path)
                self.assertEqual(len(dumped["segments"]), live, path)
            done = subprocess.run([BINARY, "replay", snapshot, "--json", "--policy", "pytorch"],
                                  capture_output=True, text=True)
            self.assertEqual(json.loads(done.stdout.splitlines()[0])["peak_requested_bytes"], 1 << 20)

    def test_cublas_takes_the_workspace_pytorch_gives_the_card(self):
        # 32 MiB a thread from Hopper on (torch 2.x), 8,519,680 bytes before.
        _, printed = planned(script("matmul_workspace.py"))
        self.assertEqual(printed, ["NVIDIA H100: workspace 33554432 bytes"])
        _, printed = planned("--card", "A100 80GB", script("matmul_workspace.py"))
        self.assertEqual(printed, ["NVIDIA A100 80GB: workspace 8519680 bytes"])


@unittest.skipIf(SKIP, SKIP)
class Generation(unittest.TestCase):
    def test_a_generation_loop_with_a_transformers_model_plans_as_the_reference(self):
        row, printed = planned(script("generate.py"))
        self.assertEqual(int(printed[-1].split()[1]), row["peak_live_bytes"])
        self.assertEqual(row["script"]["forwards"], 8)
        import torch

        from tidepool.plan.attention import cuda_attention
        from tidepool.record import Recorder

        generate = _load("generate")
        with torch.device("meta"):
            model = generate.LlamaForCausalLM(generate.tiny_config()).eval()
        with Recorder(None, cublas_workspace=h100_workspace()) as rec, cuda_attention(), torch.inference_mode():
            rec.track(model)
            ids = torch.randint(0, 1024, (4, 64), device="meta")
            out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
            cache = out.past_key_values
            for _ in range(7):
                token = out.logits[:, -1:].argmax(-1)
                del out
                out = model(input_ids=token, past_key_values=cache, use_cache=True)
            del out, cache
        self.assertEqual(row["peak_live_bytes"], rec.peak()[0])

    def test_transformers_generate_runs_to_its_token_limit(self):
        # Its stop test reads whether every sequence is done (the
        # placeholder: True): answered by the length, it generates all the
        # tokens asked for, and its peak is the hand-written loop's (the one
        # above, equal to the reference) within 0.5 % (measured: +0.42 % at
        # 8 tokens, +0.16 % at 256: generate's attention mask and its
        # float32 copy of the last logits).
        peaks = {}
        for tokens in (8, 256):
            row, printed = planned(script("generate.py"), "--generate", "--new-tokens", str(tokens))
            peaks[tokens] = row["peak_live_bytes"]
            self.assertEqual(printed[0], f"generated (4, {64 + tokens})")
            self.assertEqual(row["script"]["forwards"], tokens)
            loop, _ = planned(script("generate.py"), "--new-tokens", str(tokens))
            self.assertAlmostEqual(row["peak_live_bytes"] / loop["peak_live_bytes"], 1, delta=0.005)
        self.assertGreater(peaks[256], peaks[8])  # the KV cache of 248 more tokens
        stop = [r for r in row["script"]["reads"] if r["via"] and r["count"] == 256]
        self.assertEqual([(os.path.basename(r["file"]), r["what"]) for r in stop], [("generate.py", "bool()")])
        self.assertTrue(stop[0]["via"].startswith("transformers/generation/utils.py:"), stop[0]["via"])


def reference_checkpointed(bf16, steps=2):
    """checkpointed.py's non-reentrant loop written for the Recorder on the
    meta device, as the model path's --checkpointing records it (its
    recomputation entering CUDA's rules again through context_fn): its
    peak."""
    import torch

    from tidepool.plan.attention import cuda_attention
    from tidepool.plan.autocast import cuda_autocast
    from tidepool.record import Recorder

    @contextlib.contextmanager
    def rules():
        with cuda_attention(), cuda_autocast(torch.bfloat16, enabled=bf16):
            yield

    with torch.device("meta"):
        blocks = torch.nn.ModuleList(_load("checkpointed").Block(512, 8) for _ in range(6))
    optimizer = torch.optim.AdamW(blocks.parameters())
    with Recorder(None, cublas_workspace=h100_workspace()) as rec, cuda_attention():
        rec.track(blocks)
        rec.track(optimizer)
        for _ in range(steps):
            x = torch.randn(8, 256, 512, device="meta")
            with cuda_autocast(torch.bfloat16, enabled=bf16):  # the forward's autocast region, as the script's
                for block in blocks:
                    x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False,
                                                          context_fn=lambda: (contextlib.nullcontext(), rules()))
                loss = x.float().square().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    return rec.peak()[0]


@unittest.skipIf(SKIP, SKIP)
class Checkpointing(unittest.TestCase):
    """torch.utils.checkpoint in a script: its recomputation, in the
    backward, runs CUDA's attention kernels and autocast as its forward did
    (recompute.py; else checkpoint refuses the tensors it saves)."""

    def test_non_reentrant_checkpointing_plans_as_the_model_path(self):
        for bf16 in ([], ["--bf16"]):
            row, printed = planned(script("checkpointed.py"), "--checkpoint", "non-reentrant", *bf16)
            self.assertEqual(row["peak_live_bytes"], reference_checkpointed(bool(bf16)), bf16)
            self.assertEqual(int(printed[-1].split()[1]), row["peak_live_bytes"])

    def test_both_kinds_hold_less_than_no_checkpointing(self):
        held = {kind: planned(script("checkpointed.py"), "--checkpoint", kind)[0]["breakdown"]["activations_bytes"]
                for kind in ("none", "reentrant", "non-reentrant")}
        self.assertLess(held["reentrant"], held["none"] / 2)
        self.assertLess(held["non-reentrant"], held["none"] / 2)


@unittest.skipIf(SKIP, SKIP)
class HuggingFaceTrainer(unittest.TestCase):
    def test_a_trainer_script_plans_as_the_model_path(self):
        # The reference: the same Llama as an hf: model (whose training loop
        # is the Trainer's) with the Trainer's optimizer (adamw_torch_fused),
        # and with gradient checkpointing as the model path's
        # --checkpointing. Within 8 KiB (0.01 %; measured 4,116 bytes): the
        # Trainer's own small tensors, one of 4,096 bytes (a (4, 128) int64
        # one) and scalars (its loss accumulator, the gradient norm).
        from tidepool.plan import main

        peaks = {}
        for checkpointing in (False, True):
            # An sm80 card: the model path records cuBLAS's workspace as PyTorch sizes it there.
            row, printed = planned("--card", "A100 80GB", script("hf_trainer.py"),
                                   *(["--gradient-checkpointing"] if checkpointing else []))
            self.assertEqual(row["script"]["optimizer_steps"], 3)
            self.assertEqual(int(printed[-1].split()[1]), row["peak_live_bytes"])
            out = io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
                try:
                    main(["hf:llama", "--set", "hidden_size=256", "--set", "intermediate_size=1024", "--set",
                          "num_hidden_layers=2", "--set", "num_attention_heads=4", "--set", "num_key_value_heads=4",
                          "--set", "vocab_size=1024", "--set", "max_position_embeddings=512", "--batch", "4",
                          "--seq", "128", "--steps", "3", "--optimizer", "adamw-fused", "--json",
                          *(["--checkpointing"] if checkpointing else [])])
                except SystemExit as exit:
                    self.assertEqual(exit.code, 0)
            reference = json.loads(out.getvalue().splitlines()[-1])
            self.assertLessEqual(abs(row["peak_live_bytes"] - reference["peak_live_bytes"]), 8192, checkpointing)
            for key in ("weights_bytes", "gradients_bytes", "optimizer_bytes"):
                self.assertEqual(row["breakdown"][key], reference["breakdown"][key], key)
            peaks[checkpointing] = row["breakdown"]["activations_bytes"]
        self.assertLess(peaks[True], peaks[False])


@unittest.skipIf(SKIP, SKIP)
class LocalModel(unittest.TestCase):
    def test_a_model_from_a_local_directory_loads_and_plans_as_the_reference(self):
        import torch

        from tidepool.plan.attention import cuda_attention
        from tidepool.record import Recorder

        generate = _load("generate")
        with tempfile.TemporaryDirectory() as directory:
            with contextlib.redirect_stderr(io.StringIO()):
                generate.LlamaForCausalLM(generate.tiny_config()).save_pretrained(directory)
            row, printed = planned(script("local_model.py"), directory)
        self.assertEqual(printed[-2:], ["(2, 32, 1024) cuda:0", f"peak {row['peak_live_bytes']} bytes"])
        with torch.device("meta"):
            model = generate.LlamaForCausalLM(generate.tiny_config()).eval()
        with Recorder(None, cublas_workspace=h100_workspace()) as rec, cuda_attention(), torch.inference_mode():
            rec.track(model)
            logits = model(torch.zeros(2, 32, dtype=torch.long, device="meta")).logits
            del logits
        # Weights: the parameters and buffers (the rotary embedding's inverse frequencies).
        held = [*model.parameters(), *model.buffers()]
        self.assertEqual(row["breakdown"]["weights_bytes"], sum(t.numel() * t.element_size() for t in held))
        self.assertEqual(row["peak_live_bytes"], rec.peak()[0])

def sparse_checkpoint(path, state, location):
    """torch.save of `state` (CPU tensors whose pages were never touched)
    without its data: torch's skip_data leaves each data record a hole, so
    the file is its full size and holds nothing on disk; its storages say
    `location`, as when saved from there (torch.save asks
    torch.serialization.location_tag, here answered without a card)."""
    import torch
    import torch.serialization

    tag = torch.serialization.location_tag
    torch.serialization.location_tag = lambda storage: location
    try:
        with torch.serialization.skip_data():
            torch.save(state, path)
    finally:
        torch.serialization.location_tag = tag


def checkpoint_state(vocab, width):
    """load_checkpoint.py's Net's state dict, in CPU tensors that are
    never written (their memory is not touched), the tied weight one."""
    import torch

    embed = torch.empty(vocab, width)
    return {"embed.weight": embed, "proj.weight": torch.empty(width, width), "proj.bias": torch.empty(width),
            "head.weight": embed}


def sparse_model(directory, config, shards=2):
    """A model directory as save_pretrained writes a sharded one (config.json,
    model.safetensors.index.json, its shards) whose tensor data are holes:
    a safetensors file is a JSON header, then the tensors' bytes. The keys
    are those save_pretrained writes for the architecture (a tied weight
    once); their shapes and dtype those of `config`'s model."""
    import struct

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config.save_pretrained(directory)
    small = LlamaConfig(**dict(config.to_dict(), hidden_size=8, intermediate_size=8, num_attention_heads=1,
                               num_key_value_heads=1, vocab_size=8, head_dim=8))
    with tempfile.TemporaryDirectory() as scratch, contextlib.redirect_stderr(io.StringIO()):
        LlamaForCausalLM(small).save_pretrained(scratch)
        with open(os.path.join(scratch, "model.safetensors"), "rb") as f:
            keys = [k for k in json.loads(f.read(struct.unpack("<Q", f.read(8))[0])) if k != "__metadata__"]
    with torch.device("meta"):
        shapes = {k: tuple(t.shape) for k, t in LlamaForCausalLM(config).state_dict().items()}
    size = torch.tensor([], dtype=config.dtype).element_size()
    codes = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}
    index, total = {}, 0
    for shard in range(shards):
        name = f"model-{shard + 1:05d}-of-{shards:05d}.safetensors"
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for key in keys[shard::shards]:
            nbytes = size * int(torch.Size(shapes[key]).numel())
            header[key] = {"dtype": codes[config.dtype], "shape": list(shapes[key]), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
            index[key] = name
        text = json.dumps(header).encode()
        text += b" " * (-len(text) % 8)
        with open(os.path.join(directory, name), "wb") as f:
            f.write(struct.pack("<Q", len(text)) + text)
            f.truncate(8 + len(text) + offset)  # the data: a hole
        total += offset
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": index}, f)
    return total


def max_rss():
    """This process's peak resident memory so far, in bytes."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@unittest.skipIf(SKIP, SKIP)
class WeightsFromFiles(unittest.TestCase):
    """Weights a script loads from files are tracked on the card with
    their shapes, and their data is not read: the checkpoints here are
    holes (nothing on disk) of 5 GiB and 52 GiB, and this process's peak
    memory grows by less than 1 GiB."""

    VOCAB, WIDTH = 65536, 16384
    # load_checkpoint.py's storages: the tied embedding, the projection and its bias.
    WEIGHTS = 4 * (VOCAB * WIDTH + WIDTH * WIDTH + WIDTH)
    # The output layer's own weight, made with it and let go when tied.
    UNTIED = 4 * VOCAB * WIDTH

    def load(self, location, where):
        with tempfile.TemporaryDirectory() as directory:
            path = os.path.join(directory, "model.pt")
            sparse_checkpoint(path, checkpoint_state(self.VOCAB, self.WIDTH), location)
            before = max_rss()
            row, printed = planned(script("load_checkpoint.py"), path, where)
            self.assertLess(max_rss() - before, 1 << 30, "the checkpoint's data was read")
        return row, dict(line.rsplit(" ", 1) for line in printed if line.split()[0] not in
                         ("embed.weight", "proj.weight", "proj.bias", "head.weight")), printed

    def test_a_checkpoint_saved_from_the_card_is_restored_there(self):
        for where in ("none", "cuda", "cuda:0"):
            row, said, printed = self.load("cuda:0", where)
            self.assertIn(f"embed.weight cuda:0 ({self.VOCAB}, {self.WIDTH}) torch.float32", printed, where)
            self.assertIn(f"proj.bias cuda:0 ({self.WIDTH},) torch.float32", printed, where)
            # One allocation per storage, as the driver's copy of each: the
            # tied weight once; then the model made on the card, as much
            # again (and its output layer's weight until it is tied).
            peak = 2 * self.WEIGHTS + self.UNTIED
            self.assertEqual(said, {"tied": "True", "loaded": str(self.WEIGHTS), "model": str(2 * self.WEIGHTS),
                                    "state dropped": str(self.WEIGHTS), "peak": str(peak)}, where)
            self.assertEqual(row["peak_live_bytes"], peak)

    def test_a_checkpoint_mapped_to_the_cpu_is_copied_to_the_card_without_being_read(self):
        row, said, printed = self.load("cuda:0", "cpu")
        self.assertIn(f"embed.weight cpu ({self.VOCAB}, {self.WIDTH}) torch.float32", printed)
        peak = self.WEIGHTS + self.UNTIED
        self.assertEqual(said, {"tied": "True", "loaded": "0", "model": str(self.WEIGHTS),
                                "state dropped": str(self.WEIGHTS), "peak": str(peak)})
        self.assertEqual(row["peak_live_bytes"], peak)

    def test_a_device_the_run_does_not_have_is_refused_as_torch_refuses_it(self):
        with tempfile.TemporaryDirectory() as directory:
            path = os.path.join(directory, "model.pt")
            sparse_checkpoint(path, checkpoint_state(64, 32), "cuda:0")
            status, out, err = run(script("load_checkpoint.py"), path, "cuda:1")
        self.assertEqual(status, 1)
        self.assertIn("load_checkpoint.py\", line 23, in main", err)
        self.assertIn("RuntimeError: Attempting to deserialize object on CUDA device 1 but "
                      "torch.cuda.device_count() is 1", err)
        self.assertNotIn("weights.py", err)  # the planner's frames are not shown

    def test_a_sharded_model_far_larger_than_memory_loads_without_being_read(self):
        # A 27.7B-parameter Llama in bf16 (52 GiB in 16 shards, a tied
        # embedding): from_pretrained, then `.to("cuda")`, and with a
        # device_map, plan as the same model recorded on the meta device.
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        from tidepool.plan.attention import cuda_attention
        from tidepool.record import Recorder

        config = LlamaConfig(hidden_size=8192, intermediate_size=28672, num_hidden_layers=32, num_attention_heads=64,
                             num_key_value_heads=8, vocab_size=32000, max_position_embeddings=4096,
                             tie_word_embeddings=True, dtype="bfloat16")
        # Made in bf16 as from_pretrained makes it (its rotary frequencies stay fp32).
        default = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            with torch.device("meta"):
                model = LlamaForCausalLM(config).eval()
        finally:
            torch.set_default_dtype(default)
        with Recorder(None, cublas_workspace=h100_workspace()) as rec, cuda_attention(), torch.inference_mode():
            rec.track(model)
            logits = model(torch.zeros(2, 32, dtype=torch.long, device="meta")).logits
            del logits
        held = {id(t): t for t in [*model.parameters(), *model.buffers()]}.values()
        with tempfile.TemporaryDirectory() as directory:
            stored = sparse_model(directory, config, shards=16)
            self.assertGreater(stored, 50 << 30)
            for how in ([], ["cuda"], ["auto"]):
                before = max_rss()
                row, printed = planned(script("local_model.py"), directory, *how)
                self.assertLess(max_rss() - before, 1 << 30, f"{how}: the checkpoint's data was read")
                self.assertEqual(printed[-3:], ["cuda:0 True", "(2, 32, 32000) cuda:0",
                                                f"peak {row['peak_live_bytes']} bytes"], how)
                self.assertEqual(row["peak_live_bytes"], rec.peak()[0], how)
                self.assertEqual(row["breakdown"]["weights_bytes"], sum(t.numel() * t.element_size() for t in held),
                                 how)

    def test_a_checkpoint_that_is_not_there_fails_as_the_script_does(self):
        status, out, err = run(script("load_checkpoint.py"), "/nonexistent/model.pt", "cuda")
        self.assertEqual(status, 1)
        self.assertIn("load_checkpoint.py\", line 23, in main", err)
        self.assertIn("FileNotFoundError", err)
        self.assertIn("nothing planned", err)
        self.assertEqual(out, "")

    def test_a_truncated_checkpoint_fails_with_torchs_error(self):
        import torch

        with tempfile.TemporaryDirectory() as directory:
            path = os.path.join(directory, "model.pt")
            sparse_checkpoint(path, checkpoint_state(64, 32), "cuda:0")
            with open(path, "r+b") as f:
                f.truncate(os.path.getsize(path) // 2)  # the zip's directory, at its end, is gone
            status, out, err = run(script("load_checkpoint.py"), path, "cuda")
            with self.assertRaises(Exception) as plain:
                torch.load(path, map_location="cpu")
        self.assertEqual(status, 1)
        self.assertIn("load_checkpoint.py\", line 23, in main", err)
        # torch's own error, as torch.load gives it outside the run.
        self.assertIn(f"{type(plain.exception).__name__}: {plain.exception}", err)

    def test_a_safetensors_file_with_a_broken_header_fails_with_its_error(self):
        import torch
        from transformers import LlamaConfig

        config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                             num_key_value_heads=2, vocab_size=128, dtype="float32")
        with tempfile.TemporaryDirectory() as directory:
            sparse_model(directory, config, shards=1)
            shard = os.path.join(directory, "model-00001-of-00001.safetensors")
            with open(shard, "r+b") as f:
                length = int.from_bytes(f.read(8), "little")
                f.truncate(8 + length // 2)  # the JSON header ends halfway
            status, out, err = run(script("local_model.py"), directory)
        del torch
        self.assertEqual(status, 1)
        self.assertIn("local_model.py\", line 13, in <module>", err)
        self.assertIn("Error while deserializing header", err)
        self.assertIn("nothing planned", err)


def reference_data_parallel(sharded, world_size=2, width=1024, batch=32, steps=3):
    """ddp_train.py's and fsdp_train.py's loop written for the Recorder on
    the meta device, over the model path's DDP (ddp.wrap) or FSDP
    (fsdp.shard): one rank's peak of live bytes and breakdown there."""
    import torch
    import torch.distributed as dist

    from tidepool.plan import ddp, fsdp
    from tidepool.record import Recorder

    with torch.device("meta"):
        model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(4)])
    try:
        with Recorder(None, cublas_workspace=h100_workspace()) as rec, \
                (fsdp.sharding(world_size, rec) if sharded else contextlib.nullcontext()):
            rec.track(model)
            model = fsdp.shard(model, world_size, layers=list(model)) if sharded else ddp.wrap(model, world_size, rec)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
            rec.track(optimizer)
            for _ in range(steps):
                x = torch.randn(batch, width, device="meta")
                loss = model(x).square().mean()
                if not sharded:
                    optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                if sharded:
                    optimizer.zero_grad()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return rec.peak()[0], rec.breakdown_at_peak()


@unittest.skipIf(SKIP, SKIP)
class SeveralCards(unittest.TestCase):
    """A process that uses several cards (--devices N): each card planned
    alone, and torch.cuda's figures for the card asked about."""

    def test_model_parallelism_by_hand_plans_each_card(self):
        status, out, err = run("--json", "--devices", "2", script("two_cards.py"))
        self.assertEqual(status, 0, err)
        printed = [line for line in out.splitlines() if not line.startswith("{")]
        rows = {r["variant"]["device"]: r for r in map(json.loads, out.splitlines()[len(printed):])}
        self.assertEqual(sorted(rows), ["cuda:0", "cuda:1"])
        self.assertEqual(printed, [f"{card} {rows[card]['peak_live_bytes']}" for card in ("cuda:0", "cuda:1")])
        weights = {"cuda:0": 4 * 4 * (1024 * 1024 + 1024),
                   "cuda:1": 4 * (1024 * 2048 + 2048 + 4 * (2048 * 2048 + 2048))}
        for card, row in rows.items():
            self.assertEqual(row["breakdown"]["weights_bytes"], weights[card], card)
            self.assertEqual(row["breakdown"]["optimizer_bytes"], 2 * weights[card], card)  # AdamW's two moments
            self.assertLessEqual(row["peak_live_bytes"], row["tidepool_min_capacity_bytes"])
        with tempfile.TemporaryDirectory() as scratch:
            kept = os.path.join(scratch, "trace.csv")
            status, out, err = run("--devices", "2", "--keep-trace", kept, script("two_cards.py"))
            self.assertEqual(status, 0, err)
            self.assertEqual(sorted(os.listdir(scratch)), ["trace.cuda0.csv", "trace.cuda1.csv"])
            self.assertIn("device  peak live", out)

    def test_data_parallel_replicates_the_model_and_splits_the_batch(self):
        status, out, err = run("--json", "--devices", "2", script("data_parallel.py"))
        self.assertEqual(status, 0, err)
        lines = out.splitlines()
        zero, one = (json.loads(line) for line in lines[1:])
        self.assertEqual(lines[0], f"2 cards: cuda:0 {zero['peak_live_bytes']}, cuda:1 {one['peak_live_bytes']}")
        params = 4 * (2 * 1024 * 4096 + 4096 + 1024)
        # The model, its gradients and AdamW's state on the first card; a
        # replica of the weights on the second (weights: copies in their own
        # type; what of it is alive at that card's peak), with its half of
        # the batch's activations, no optimizer state.
        self.assertEqual(zero["breakdown"]["weights_bytes"], params)
        self.assertEqual(zero["breakdown"]["optimizer_bytes"], 2 * params)
        self.assertGreater(one["breakdown"]["weights_bytes"], 0)
        self.assertEqual((one["breakdown"]["optimizer_bytes"], one["breakdown"]["precision_copies_bytes"]), (0, 0))
        self.assertGreater(one["peak_live_bytes"], params + 256 * 4096 * 4)
        self.assertLess(one["peak_live_bytes"], zero["peak_live_bytes"])

    def test_transformers_device_map_spreads_the_weights_over_the_cards(self):
        status, out, err = run("--json", "--devices", "2", script("device_map.py"))
        self.assertEqual(status, 0, err)
        lines = out.splitlines()
        self.assertEqual(lines[0], "[0, 1]")
        rows = [json.loads(line) for line in lines[1:]]
        self.assertEqual([r["variant"]["device"] for r in rows], ["cuda:0", "cuda:1"])
        weights = [r["breakdown"]["weights_bytes"] + r["breakdown"]["precision_copies_bytes"] for r in rows]
        self.assertTrue(all(weights), weights)
        # Every parameter once (the embedding and the head untied), on one
        # card or the other, and the rotary embedding's buffer (256 bytes).
        params = 4 * (2 * 1024 * 256 + 4 * (4 * 256 * 256 + 3 * 256 * 1024 + 2 * 256) + 256)
        self.assertEqual(sum(weights), params + 256)
        self.assertLessEqual(weights[0], 8 << 20)

    def test_a_snapshot_has_a_trace_per_card_and_replays_to_each_cards_peak(self):
        with tempfile.TemporaryDirectory() as scratch:
            snapshot = os.path.join(scratch, "two.pickle")
            status, out, err = run("--json", "--devices", "2", script("two_cards.py"), snapshot)
            self.assertEqual(status, 0, err)
            peaks = [json.loads(line)["peak_live_bytes"] for line in out.splitlines() if line.startswith("{")]
            with open(snapshot, "rb") as f:
                self.assertEqual(len(pickle.load(f)["device_traces"]), 2)
            done = subprocess.run([BINARY, "replay", snapshot, "--json", "--policy", "pytorch"],
                                  capture_output=True, text=True)
            self.assertEqual(done.returncode, 0, done.stderr)
            replayed = json.loads(done.stdout.splitlines()[0])["devices"]
            self.assertEqual([d["peak_requested_bytes"] for d in replayed], peaks)


@unittest.skipIf(SKIP, SKIP)
class Torchrun(unittest.TestCase):
    """Scripts written for torchrun (a process per GPU) planned as one of
    their ranks: PyTorch's own DDP and FSDP2 over a fake process group."""

    def test_ddp_plans_a_rank_with_its_gradient_buckets(self):
        row, printed = planned("--nproc-per-node", "2", script("ddp_train.py"))
        peak, _ = reference_data_parallel(sharded=False)
        self.assertEqual(row["peak_live_bytes"], peak)
        # A replica, its gradients, and DDP's buckets: the gradients again.
        params = 4 * 4 * (1024 * 1024 + 1024)
        self.assertEqual(row["breakdown"]["weights_bytes"], params)
        self.assertEqual(row["breakdown"]["gradients_bytes"], 2 * params)
        self.assertEqual(printed, [f"step {i} loss 1.000 on 2 ranks" for i in range(3)])

    def test_fsdp_plans_a_rank_with_its_shard(self):
        row, _ = planned("--nproc-per-node", "4", script("fsdp_train.py"))
        four, breakdown = reference_data_parallel(sharded=True, world_size=4)
        self.assertEqual(row["peak_live_bytes"], four)
        two, _ = planned("--nproc-per-node", "2", script("fsdp_train.py"))
        self.assertLess(row["peak_live_bytes"], two["peak_live_bytes"])
        # AdamW's two moments of a quarter of the parameters (its step
        # counters live on the CPU).
        params = 4 * 4 * (1024 * 1024 + 1024)
        self.assertEqual(row["breakdown"]["optimizer_bytes"], 2 * params // 4)
        b = row["breakdown"]
        self.assertEqual(b["gradients_bytes"], breakdown["gradients"])
        # The script's run labels one more gathered block as weights (the
        # reference: as activations), the same bytes.
        self.assertEqual(b["weights_bytes"] + b["activations_bytes"], breakdown["weights"] + breakdown["activations"])

    def test_another_rank_and_torchruns_environment(self):
        # Rank 1 prints nothing (the script prints on rank 0) and plans the same.
        row, printed = planned("--nproc-per-node", "2", "--rank", "1", script("ddp_train.py"))
        self.assertEqual(printed, [])
        self.assertEqual(row["peak_live_bytes"], reference_data_parallel(sharded=False)[0])
        self.assertNotIn("RANK", os.environ)  # restored after the run
        status, _, err = run("--nproc-per-node", "2", "--rank", "2", script("ddp_train.py"))
        self.assertEqual(status, 2)
        self.assertIn("--rank 2: the ranks of --nproc-per-node 2 are 0 to 1", err)
        status, _, err = run("--rank", "1", script("ddp_train.py"))
        self.assertEqual(status, 2)
        self.assertIn("--rank is a rank of --nproc-per-node N", err)


def _snapshots():
    spec = importlib.util.spec_from_file_location("test_plan_snapshots", os.path.join(HERE, "test_plan.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SNAPSHOTS = _snapshots()


@unittest.skipIf(SKIP, SKIP)
@unittest.skipUnless(os.path.isdir(SNAPSHOTS.SNAPSHOTS), f"no real snapshots at {SNAPSHOTS.SNAPSHOTS}")
class RealSnapshotScripts(unittest.TestCase):
    """profile_memory.py, a profiling script as the course repositories of
    ../shared/traces write theirs, run with the configuration each real
    snapshot was recorded with: the peak it prints, and the peak of the
    snapshot it dumps replayed by `tidepool replay`, within 1 % of what
    PyTorch recorded on a GPU."""

    def check(self, real_name, *options):
        with tempfile.TemporaryDirectory() as tmp:
            dumped = os.path.join(tmp, "snapshot.pickle")
            # The snapshots' cuBLAS workspaces (8,519,680 bytes) say an sm80 card.
            row, printed = planned("--card", "A100 80GB", script("profile_memory.py"), "--d_model", "1024",
                                   "--d_ff", "4096", "--num_layers", "24", "--num_heads", "16", *options,
                                   "--snapshot", dumped)
            replayed = subprocess.run([BINARY, "replay", "--json", "--policy", "pytorch", dumped],
                                      capture_output=True, text=True, check=True)
        real = SNAPSHOTS.snapshot_peak(real_name)
        peak = int(printed[-1].split()[-2])
        self.assertAlmostEqual(peak / real, 1.0, delta=0.01, msg=f"printed {peak}, PyTorch recorded {real}")
        self.assertEqual(json.loads(replayed.stdout.splitlines()[0])["peak_requested_bytes"], peak)
        self.assertEqual(row["peak_live_bytes"], peak)  # the recorded step is the run's peak
        return row

    def test_inference_in_fp32(self):
        # Measured: +0.24 %.
        self.check("wed_medium_128_inference.pickle", "--context_length", "128")

    def test_a_full_step_under_bf16_autocast(self):
        # Measured: -0.33 %. (The repository's own script, run unchanged with
        # the flags it was recorded with, plans it to the byte: docs/planning.md.)
        row = self.check("wed_medium_512_training.pickle", "--context_length", "512", "--pattern",
                         "full-training-step", "--autocast")
        self.assertTrue(row["script"]["bf16"])


@unittest.skipIf(SKIP, SKIP)
class LoopsWaitingOnData(unittest.TestCase):
    def test_a_loop_that_waits_on_the_data_ends_and_the_report_says_where(self):
        row, printed = planned(script("rejection_loops.py"))
        self.assertEqual(printed, ["output (64, 2048)"])
        loops = {(os.path.basename(r["file"]), r["line"]): (r["count"], r["loop"]) for r in row["script"]["reads"]}
        # trunc_normal_'s loop (read at the script's call) spins 16 times and
        # ends on the 17th; the second call at another line does the same;
        # the script's own loop too.
        self.assertEqual(loops, {("rejection_loops.py", 7): (17, True), ("rejection_loops.py", 8): (17, True),
                                 ("rejection_loops.py", 10): (17, True)})
        # Weights, and the squashed input: each division's result replaces the last.
        weights = 4 * (2048 * 2048 + 2048)
        self.assertEqual(row["breakdown"]["weights_bytes"], weights)
        status, out, _ = run(script("rejection_loops.py"))
        self.assertIn("rejection_loops.py:10: bool() x17 (a loop waiting on the value: after 16 reads in a row", out)


@unittest.skipIf(SKIP, SKIP)
class SizedByData(unittest.TestCase):
    def test_a_result_sized_by_the_data_counts_every_element_and_says_where(self):
        row, printed = planned(script("sized_by_data.py"))
        self.assertEqual(printed, ["(64000, 2) (64000,) (64000,)", "(64000,) (1000, 64) (64000,) (64000,)"])
        said = {(r["line"], r["what"]) for r in row["script"]["reads"]}
        self.assertEqual(said, {(5, "nonzero() sized as if every element counted"),
                                (5, "masked_select() sized as if every element counted"),
                                (6, "_unique2() sized as if every element counted"),
                                (7, "unique_consecutive() sized as if every element counted")})


@unittest.skipIf(SKIP, SKIP)
class Failures(unittest.TestCase):
    def test_a_model_from_the_hub_is_refused_offline(self):
        status, out, err = run(script("hub_model.py"))
        self.assertNotEqual(status, 0)
        self.assertIn("hub_model.py\", line 5", err)
        self.assertIn("nothing is downloaded here (HF_HUB_OFFLINE=1): give it a local path", err)
        self.assertIn("nothing planned", err)
        self.assertEqual(out, "")

    def test_a_script_that_raises_shows_its_traceback_and_fails(self):
        status, out, err = run(script("fails.py"))
        self.assertEqual(status, 1)
        self.assertIn("Traceback (most recent call last)", err)
        self.assertIn("fails.py\", line 12, in <module>", err)
        self.assertIn("fails.py\", line 9, in step", err)
        self.assertIn("RuntimeError: a and b must have same reduction dim", err)
        self.assertIn("tidepool.plan run: " + script("fails.py") + " failed (exit status 1): nothing planned", err)

    def test_a_script_that_exits_with_a_status_keeps_it(self):
        with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
            f.write("import sys\nsys.exit(3)\n")
        try:
            status, _, err = run(f.name)
        finally:
            os.unlink(f.name)
        self.assertEqual(status, 3)
        self.assertIn("failed (exit status 3)", err)


if __name__ == "__main__":
    unittest.main()
