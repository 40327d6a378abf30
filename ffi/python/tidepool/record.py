"""Record the allocation trace of a PyTorch model without a GPU.

The model runs on the meta device (shapes and dtypes, no data) under a
TorchDispatchMode: every storage an operator creates is an allocation of
its size, and the death of its last reference, seen through a C++-level
weak reference to the storage, is its free. The trace is written as RMM's
logging CSV, which `tidepool replay` and `tidepool plan` read.

    python -m tidepool.record mlp --steps 3 --out mlp.csv
    python -m tidepool.record transformer-varlen --out varlen.csv

or, for a model of your own:

    from tidepool.record import Recorder
    with Recorder("trace.csv") as rec:
        rec.track_module(model)          # parameters and buffers already created
        for _ in range(steps):
            step()                       # forward, backward, optimizer step on "meta"

torch is needed for this module only.
"""
import argparse
import time

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

HEADER = "Thread,Time,Action,Pointer,Size,Stream\n"


class Recorder(TorchDispatchMode):
    """A dispatch mode that writes every storage's birth and death as RMM CSV rows."""

    def __init__(self, path):
        super().__init__()
        self.path = path
        self.out = None
        self.live = {}  # storage key -> (pointer, size, weak reference)
        self.next_pointer = 0x1000
        self.start = time.perf_counter()
        self.allocs = 0

    # -- output ------------------------------------------------------------
    def _row(self, action, pointer, size):
        micros = int((time.perf_counter() - self.start) * 1e6)
        secs = micros // 1_000_000
        self.out.write(
            f"1,{secs // 3600:02}:{secs // 60 % 60:02}:{secs % 60:02}.{micros % 1_000_000:06},"
            f"{action},{pointer:#x},{size},0\n"
        )

    # -- storages ----------------------------------------------------------
    def _track(self, tensor):
        if not isinstance(tensor, torch.Tensor):
            return
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key in self.live or storage.nbytes() == 0:
            return
        pointer = self.next_pointer
        self.next_pointer += 0x1000
        self.live[key] = (pointer, storage.nbytes(), StorageWeakRef(storage))
        self.allocs += 1
        self._row("allocate", pointer, storage.nbytes())

    def _collect(self):
        """Frees every storage whose last reference died since the last look."""
        dead = [key for key, (_, _, ref) in self.live.items() if ref.expired()]
        for key in dead:
            pointer, size, _ = self.live.pop(key)
            self._row("free", pointer, size)

    def track_module(self, module):
        """Counts the parameters and buffers a module already holds as allocations."""
        for tensor in list(module.parameters()) + list(module.buffers()):
            self._track(tensor)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self._collect()
        result = func(*args, **(kwargs or {}))
        for item in tree_flatten(result)[0]:
            self._track(item)
        return result

    def __enter__(self):
        self.out = open(self.path, "w")
        self.out.write(HEADER)
        return super().__enter__()

    def __exit__(self, *exc):
        result = super().__exit__(*exc)
        self._collect()
        # Whatever is still live (weights, optimizer state) stays live: the
        # trace ends with it allocated, as the process would.
        self.out.close()
        return result


# -- example workloads -----------------------------------------------------

def _mlp(batch):
    model = torch.nn.Sequential(
        torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 4096), torch.nn.GELU(),
        torch.nn.Linear(4096, 1024),
    )
    def step(i):
        x = torch.randn(batch, 1024, device="meta")
        return model(x).float().pow(2).mean()
    return model, step


def _cnn(batch):
    layers, channels = [], 3
    for width in (64, 128, 256, 512):
        layers += [torch.nn.Conv2d(channels, width, 3, padding=1), torch.nn.BatchNorm2d(width), torch.nn.ReLU(),
                   torch.nn.MaxPool2d(2)]
        channels = width
    model = torch.nn.Sequential(*layers, torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(512, 1000))
    def step(i):
        x = torch.randn(batch, 3, 128, 128, device="meta")
        return torch.nn.functional.cross_entropy(model(x), torch.zeros(batch, dtype=torch.long, device="meta"))
    return model, step


def _transformer_varlen(batch):
    model = torch.nn.TransformerEncoder(
        torch.nn.TransformerEncoderLayer(d_model=512, nhead=8, dim_feedforward=2048, batch_first=True), num_layers=6
    )
    lengths = [384, 128, 512, 256, 448, 192, 320, 64]
    def step(i):
        x = torch.randn(batch, lengths[i % len(lengths)], 512, device="meta")
        return model(x).float().pow(2).mean()
    return model, step


def _encoder_finetune_varlen(batch):
    # BERT-style fine-tuning: every batch padded to its own length.
    model = torch.nn.Sequential(
        torch.nn.TransformerEncoder(
            torch.nn.TransformerEncoderLayer(d_model=512, nhead=8, dim_feedforward=2048, batch_first=True), num_layers=6
        ),
    )
    head = torch.nn.Linear(512, 2)
    model.append(head)
    lengths = [200, 64, 448, 96, 320, 512, 160, 384, 128, 256, 480, 224]
    def step(i):
        x = torch.randn(batch, lengths[i % len(lengths)], 512, device="meta")
        logits = model(x)[:, 0]
        return torch.nn.functional.cross_entropy(logits, torch.zeros(batch, dtype=torch.long, device="meta"))
    return model, step


def _kv_generate(batch, layers=12, width=1024, prompt=128):
    # Autoregressive decoding: each step appends one token to every layer's
    # key and value caches (torch.cat, so each cache is a new, larger tensor).
    def block():
        return torch.nn.ModuleDict(dict(qkv=torch.nn.Linear(width, 3 * width), out=torch.nn.Linear(width, width),
                                        up=torch.nn.Linear(width, 4 * width), down=torch.nn.Linear(4 * width, width)))
    model = torch.nn.ModuleDict(dict(embed=torch.nn.Embedding(32000, width), blocks=torch.nn.ModuleList(block() for _ in range(layers)),
                                     head=torch.nn.Linear(width, 32000)))
    caches = [None] * layers
    state = {"ids": None}
    def step(i):
        ids = state["ids"] if i > 0 else torch.zeros(batch, prompt, dtype=torch.long, device="meta")
        h = model["embed"](ids)
        for n, b in enumerate(model["blocks"]):
            q, k, v = b["qkv"](h).chunk(3, dim=-1)
            caches[n] = (k.contiguous(), v.contiguous()) if caches[n] is None else (
                torch.cat([caches[n][0], k], 1), torch.cat([caches[n][1], v], 1))
            keys, values = caches[n]
            h = h + b["out"](torch.softmax(q @ keys.transpose(1, 2) / width ** 0.5, -1) @ values)
            h = h + b["down"](torch.nn.functional.gelu(b["up"](h)))
        state["ids"] = model["head"](h[:, -1:]).argmax(-1)
    return model, step


def _hf_generate(batch, layers=12, width=768, heads=12, vocab=50257, new_tokens=40, prompts=(96, 160, 64, 128)):
    # GPT-2 small decoding as Hugging Face's `generate` runs it (greedy, its
    # DynamicCache); a step is one call to `generate`. The prompts of a
    # batch have different lengths, left-padded to the longest (a step's
    # entry of `prompts`). The prompt runs whole, then each new token is
    # appended to every layer's key and value caches with torch.cat (each
    # cache a new, larger tensor, the old one freed), the ids and attention
    # mask grow the same way, logits are computed for the last position
    # only, and the caches are freed when the call returns.
    head_dim = width // heads
    def block():
        return torch.nn.ModuleDict(dict(ln_1=torch.nn.LayerNorm(width), c_attn=torch.nn.Linear(width, 3 * width),
                                        c_proj=torch.nn.Linear(width, width), ln_2=torch.nn.LayerNorm(width),
                                        c_fc=torch.nn.Linear(width, 4 * width), mlp_proj=torch.nn.Linear(4 * width, width)))
    model = torch.nn.ModuleDict(dict(wte=torch.nn.Embedding(vocab, width), wpe=torch.nn.Embedding(1024, width),
                                     h=torch.nn.ModuleList(block() for _ in range(layers)), ln_f=torch.nn.LayerNorm(width)))

    def heads_first(x):
        return x.view(batch, x.shape[1], heads, head_dim).transpose(1, 2)

    def forward(ids, positions, mask, cache):
        h = model["wte"](ids) + model["wpe"](positions)
        for n, b in enumerate(model["h"]):
            q, k, v = (heads_first(x) for x in b["c_attn"](b["ln_1"](h)).split(width, dim=-1))
            cache[n] = (k, v) if cache[n] is None else (torch.cat([cache[n][0], k], -2), torch.cat([cache[n][1], v], -2))
            a = torch.nn.functional.scaled_dot_product_attention(q, *cache[n], attn_mask=mask)
            h = h + b["c_proj"](a.transpose(1, 2).reshape(batch, ids.shape[1], width))
            h = h + b["mlp_proj"](torch.nn.functional.gelu(b["c_fc"](b["ln_2"](h)), approximate="tanh"))
        return model["ln_f"](h[:, -1:]) @ model["wte"].weight.T  # the tied head, last position only

    def step(i):
        prompt = prompts[i % len(prompts)]
        ids = torch.zeros(batch, prompt, dtype=torch.long, device="meta")
        attention = torch.ones(batch, prompt, dtype=torch.long, device="meta")
        cache = [None] * layers
        tokens, positions = ids, torch.arange(prompt, device="meta").expand(batch, prompt)
        for _ in range(new_tokens):
            # sdpa's 4-D mask: causal, and the padding the 2-D mask marks.
            mask = torch.zeros(batch, 1, tokens.shape[1], ids.shape[1], device="meta")
            logits = forward(tokens, positions, mask, cache)
            tokens = logits[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, tokens], -1)
            attention = torch.cat([attention, attention.new_ones(batch, 1)], -1)
            positions = torch.full((batch, 1), ids.shape[1] - 1, device="meta")
            del logits, mask
    return model, step


WORKLOADS = {
    "mlp": _mlp,
    "cnn": _cnn,
    "transformer-varlen": _transformer_varlen,
    "encoder-finetune-varlen": _encoder_finetune_varlen,
    "kv-generate": _kv_generate,
    "hf-generate": _hf_generate,
}
# Workloads that only run forward (kv-generate: a step is one generated
# token; hf-generate: one call to `generate`).
GENERATION = {"kv-generate", "hf-generate"}


def record_training(workload, path, steps=4, batch=16, inference=False):
    """Records `steps` training steps (AdamW) or forward passes of a workload."""
    inference = inference or workload in GENERATION
    with torch.device("meta"):
        model, step = WORKLOADS[workload](batch)
    optimizer = None if inference else torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    with Recorder(path) as rec:
        rec.track_module(model)
        for i in range(steps):
            if inference:
                with torch.no_grad():
                    step(i)
            else:
                loss = step(i)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                del loss
    return rec.allocs


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workload", choices=sorted(WORKLOADS))
    parser.add_argument("--out", required=True, help="the CSV to write")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--inference", action="store_true", help="forward passes only, no gradients (always for kv-generate)")
    args = parser.parse_args(argv)
    allocs = record_training(args.workload, args.out, args.steps, args.batch, args.inference)
    print(f"{args.out}: {allocs} allocations")


if __name__ == "__main__":
    main()
