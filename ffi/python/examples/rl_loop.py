"""An RL post-training loop on one device with tidepool's sleep and wake.

A trainer (tag "train": weights, optimizer state, data) and a generator
(tag "rollout": its copy of the weights and a KV cache) take turns on one
device too small for both:

    train step  ->  pause("train", offload=True)  ->  generate under "rollout"
                ->  pause("rollout")  (discard)   ->  resume("train")  -> ...

Every stage prints the device memory tidepool holds. The losses are
compared with the same loop run on plain host arrays without pausing:
they must be identical, bit for bit, because resume puts every byte back
at the same address.

It runs on the host backend (host memory stands in for the GPU; the arrays
are numpy views of tidepool's memory), on a 32 MiB device unless
TIDEPOOL_CONF says otherwise: the trainer holds 10 MiB and the generator
26 MiB, so neither fits while the other holds its memory:

    python ffi/python/examples/rl_loop.py [--steps N]
"""
import argparse
import ctypes
import os
import sys

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # the same sums in both runs
os.environ.setdefault("TIDEPOOL_CONF", "backend:host,host_capacity_mb:32")

import numpy as np  # noqa: E402

import tidepool  # noqa: E402
from tidepool import _native  # noqa: E402

D = 512  # model width
N = 2048  # training samples
KV = 6 * 1024 * 1024  # KV cache entries (float32: 24 MiB)
MIB = 1 << 20


class DeviceArrays:
    """float32 arrays in tidepool memory, freed together."""

    def __init__(self):
        self.blocks = []

    def empty(self, *shape):
        nbytes = int(np.prod(shape)) * 4
        ptr = _native.lib().tidepool_malloc(nbytes, 0, None)
        if not ptr:
            raise MemoryError(_native.last_error())
        self.blocks.append((ptr, nbytes))
        buffer = (ctypes.c_char * nbytes).from_address(ptr)
        return np.frombuffer(buffer, dtype=np.float32).reshape(shape)

    def free(self):
        for ptr, nbytes in self.blocks:
            _native.lib().tidepool_free(ptr, nbytes, 0, None)
        self.blocks.clear()


class HostArrays:
    """The reference run's arrays: plain numpy memory."""

    def empty(self, *shape):
        return np.empty(shape, dtype=np.float32)

    def free(self):
        pass


def report(stage, verbose):
    if not verbose:
        return
    stats = tidepool.memory_stats()
    train, rollout = tidepool.tag_stats("train"), tidepool.tag_stats("rollout")
    print(
        f"{stage:<38} device memory held {stats['reserved_bytes.all.current'] / MIB:6.1f} MiB"
        f" | train {train['reserved_bytes'] / MIB:5.1f} MiB{' (paused)' if train['paused'] else ''}"
        f" | rollout {rollout['reserved_bytes'] / MIB:5.1f} MiB{' (paused)' if rollout['paused'] else ''}"
        f" | host {stats['tidepool.offloaded_bytes'] / MIB:5.1f} MiB"
    )


def run(steps, pausing, verbose):
    rng = np.random.default_rng(0)
    Arrays = DeviceArrays if pausing else HostArrays
    arrays = Arrays()
    with tidepool.region("train"):
        w = arrays.empty(D, D)
        momentum = arrays.empty(D, D)
        x = arrays.empty(N, D)
        y = arrays.empty(N, D)
        w[:] = rng.standard_normal((D, D), dtype=np.float32) * 0.01
        momentum[:] = 0
        x[:] = rng.standard_normal((N, D), dtype=np.float32)
        y[:] = x @ (rng.standard_normal((D, D), dtype=np.float32) * 0.01)
    rollout = None
    losses = []
    for step in range(steps):
        # Training step.
        error = x @ w - y
        losses.append(float(np.mean(error * error)))
        gradient = (x.T @ error) / np.float32(N)
        momentum *= np.float32(0.9)
        momentum += gradient
        w -= np.float32(0.1) * momentum
        weights = np.array(w)  # the weight sync to the generator
        report(f"step {step}: after the training step", verbose)
        if pausing:
            tidepool.pause("train", offload=True)
            report('after pause("train", offload=True)', verbose)
            if rollout is not None:
                tidepool.resume("rollout")
                report('after resume("rollout")', verbose)
        if rollout is None:
            rollout = Arrays()
            with tidepool.region("rollout"):
                rollout.w = rollout.empty(D, D)
                rollout.kv = rollout.empty(KV // D, D)
        # Generation: fills the KV cache from prompts; its result feeds the trainer.
        rollout.w[:] = weights
        prompts = rng.standard_normal((64, D), dtype=np.float32)
        for row in range(0, rollout.kv.shape[0], 64):
            rollout.kv[row : row + 64] = prompts @ rollout.w
            prompts = np.tanh(rollout.kv[row : row + 64])
        reward = float(np.mean(rollout.kv[-64:]))
        report("after generation", verbose)
        if pausing:
            tidepool.pause("rollout")
            report('after pause("rollout")', verbose)
            tidepool.resume("train")
            report('after resume("train")', verbose)
        losses[-1] += reward * 0.0  # the reward is used; the loss stays the model's
    arrays.free()
    if rollout is not None:
        if pausing:
            tidepool.resume("rollout")
        rollout.free()
    return losses


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    print(f"tidepool RL loop, TIDEPOOL_CONF={os.environ['TIDEPOOL_CONF']}")
    reference = run(args.steps, pausing=False, verbose=False)
    tidepool.empty_cache()
    losses = run(args.steps, pausing=True, verbose=True)
    for step, (a, b) in enumerate(zip(reference, losses)):
        print(f"step {step}: loss {b:.6f} (without pausing: {a:.6f})")
    if losses != reference:
        print("losses differ from the run without pausing", file=sys.stderr)
        return 1
    print("losses identical to the run without pausing")
    return 0


if __name__ == "__main__":
    sys.exit(main())
