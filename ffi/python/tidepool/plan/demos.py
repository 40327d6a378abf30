"""The recorder's demo workloads and its command line, `python -m
tidepool.record WORKLOAD --out trace.csv` (tidepool/record.py runs main):
small models on the meta device (an MLP, a CNN, transformers fed batches of
varying length, KV-cache decoding, Hugging Face's generate) whose training
steps or forward passes record_training records with the Recorder
(record.py). The planner (command.py) uses none of them; the tests and
docs/planning.md do.
"""
import argparse
import os

import torch

from . import record
from .arguments import positive
from .record import Recorder


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
    optimizer = None if inference else torch.optim.AdamW(model.parameters(), lr=1e-4)
    with Recorder(path) as rec:
        rec.track(model)
        if optimizer is not None:
            rec.track(optimizer)
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
            rec.mark(f"step {i + 1}")
    return rec.allocs


def main(argv=None):
    parser = argparse.ArgumentParser(description=record.__doc__.split("\n\n")[0])
    parser.add_argument("workload", choices=sorted(WORKLOADS))
    parser.add_argument("--out", required=True, help="the CSV to write")
    parser.add_argument("--steps", type=positive, default=4)
    parser.add_argument("--batch", type=positive, default=16)
    parser.add_argument("--inference", action="store_true", help="forward passes only, no gradients (always for kv-generate)")
    args = parser.parse_args(argv)
    # Before the recording, not after it: a directory that is not there.
    directory = os.path.dirname(os.path.abspath(args.out))
    if not os.path.isdir(directory):
        parser.error(f"--out {args.out}: no directory {directory}")
    allocs = record_training(args.workload, args.out, args.steps, args.batch, args.inference)
    print(f"{args.out}: {allocs} allocations (torch {torch.__version__})")


if __name__ == "__main__":
    main()
