#!/usr/bin/env python3
"""What recording a step costs against the same step on the plain meta
device: `python -m tidepool.plan`'s recorder (and its CUDA rules: autocast,
attention kernels, foreach optimizers) against the model alone.

For each task (train with the plain loop, forward-grad, inference) the
same transformers model is built on meta and its step run, once plainly
and once as the planner records it (tidepool.plan.step.record); medians of
ROUNDS rounds, both figures from one run, the ratio printed. In fp32:
CUDA's autocast does nothing on the plain meta device.

Usage (from a checkout, torch and transformers installed):
    PYTHONPATH=ffi/python python3 benches/plan_recording.py
"""
import statistics
import time

import torch

from tidepool.plan import step, workload

ROUNDS = 5
# A 0.95B-parameter Llama on 2,048-token sequences (README's example).
MODEL = "hf:llama"
SETS = {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 16, "num_attention_heads": 16,
        "num_key_value_heads": 16, "vocab_size": 32000}
OPTIONS = dict(loop="plain", batch=1, seq=2048, precision="fp32", checkpointing=False, accumulation=1,
               optimizer="adamw", steps=1, lora_rank=0, new_tokens=0)


def plain(task):
    """The step without the recorder: build, then run it on meta."""
    work = workload.build(MODEL, SETS, task)
    model = work.model
    inputs = work.inputs(OPTIONS["batch"], OPTIONS["seq"])
    if task == "inference":
        with torch.inference_mode():
            work.call(inputs)
        return
    model.train()
    output = work.call(inputs)
    if task == "forward-grad":
        return
    loss = work.loss(output, inputs)
    loss.backward()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    optimizer.step()


def recorded(task):
    step.record(MODEL, SETS, dict(OPTIONS, task=task, loop="plain" if task == "train" else None), None)


def median_seconds(run, task):
    times = []
    for _ in range(ROUNDS):
        started = time.perf_counter()
        run(task)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main():
    print(f"{MODEL} ({SETS['num_hidden_layers']} layers, width {SETS['hidden_size']}), batch {OPTIONS['batch']}, "
          f"{OPTIONS['seq']} tokens, {OPTIONS['precision']}, torch {torch.__version__}; medians of {ROUNDS}")
    print(f"{'task':<13} {'plain meta':>11} {'recorded':>10} {'ratio':>6}")
    for task in ("train", "forward-grad", "inference"):
        bare, ours = median_seconds(plain, task), median_seconds(recorded, task)
        print(f"{task:<13} {bare:>9.2f} s {ours:>8.2f} s {ours / bare:>6.2f}")


if __name__ == "__main__":
    main()
