"""A model and a training script's own optimizer, as `python -m
tidepool.plan` factories (docs/planning.md, "Will my model fit?").

A `module:pkg.mod:factory` factory returns the model alone, or the model
and the optimizer the script trains it with: then the planner steps that
optimizer, its state made when it makes it (here at the first step) and
the temporaries of its step as its code allocates them. From the root of
a checkout:

    python -m tidepool.plan module:ffi.python.examples.own_optimizer:model --sweep optimizer=adamw,adamw-loop
    python -m tidepool.plan module:ffi.python.examples.own_optimizer:model_and_optimizer

The factories run under `torch.device("meta")`: nothing here holds data.
"""
import torch
from torch import nn


class LoopAdamW(torch.optim.Optimizer):
    """AdamW as training scripts often write it: a loop over the
    parameters, each one's moments made at the first step that sees its
    gradient. A step's temporary is one parameter's denominator at a time."""

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                p.mul_(1 - group["lr"] * group["weight_decay"])
                exp_avg.lerp_(p.grad, 1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                denom = (exp_avg_sq / (1 - beta2 ** state["step"])).sqrt_().add_(group["eps"])
                p.addcdiv_(exp_avg, denom, value=-group["lr"] / (1 - beta1 ** state["step"]))


class Block(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        b, s, w = x.shape
        q, k, v = (t.view(b, s, self.heads, w // self.heads).transpose(1, 2)
                   for t in self.qkv(self.norm1(x)).chunk(3, dim=-1))
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(a.transpose(1, 2).reshape(b, s, w))
        return x + self.down(nn.functional.gelu(self.up(self.norm2(x))))


class GPT(nn.Module):
    """A GPT-style language model: token ids (batch, seq) to logits (batch, seq, vocab)."""

    def __init__(self, width=1024, layers=12, heads=16, vocab=32000, context=1024):
        super().__init__()
        self.embed, self.position = nn.Embedding(vocab, width), nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, vocab, bias=False)

    def forward(self, ids):
        x = self.embed(ids) + self.position(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def model():
    """The model alone: the planner trains it with --optimizer (default adamw)."""
    return GPT()


def model_and_optimizer():
    """The model and the script's optimizer over its parameters."""
    gpt = GPT()
    return gpt, LoopAdamW(gpt.parameters(), lr=3e-4)


def model_and_optimizer_maker():
    """The model and how the script makes its optimizer from the parameters
    to train: the planner calls it after --lora-rank adds adapters or --fsdp
    shards the parameters, which an optimizer built here would not hold."""
    return GPT(), lambda params: LoopAdamW(params, lr=3e-4)
