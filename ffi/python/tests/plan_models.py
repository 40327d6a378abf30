"""Models for the planner's tests, as `module:plan_models:FACTORY` factories.

`lm(...)` is the GPT-style language model of the real snapshots in
../shared/traces/pytorch-snapshots (their README: pre-norm RMSNorm, rotary
position embeddings, SwiGLU feed-forward, untied output layer, vocabulary
10,000), written from that description: attention by hand (scores, a
causal mask, softmax, weighted sum), RMSNorm computed in float32.
`BasicsLM` is the same architecture with the operators of the course code
most of those snapshots ran (einsum linear layers, a softmax written out).
"""
import math

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x * self.weight).to(dtype)


class Rope(nn.Module):
    def __init__(self, d_head, context, theta=10000.0):
        super().__init__()
        freqs = 1.0 / theta ** (torch.arange(0, d_head, 2).float() / d_head)
        angles = torch.outer(torch.arange(context).float(), freqs)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x):
        seq = x.size(-2)
        cos, sin = self.cos[:seq], self.sin[:seq]
        even, odd = x[..., 0::2], x[..., 1::2]
        return torch.stack([even * cos - odd * sin, even * sin + odd * cos], -1).flatten(-2)


class Block(nn.Module):
    def __init__(self, d_model, d_ff, heads, rope):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = RMSNorm(d_model), RMSNorm(d_model)
        self.q, self.k, self.v, self.o = (nn.Linear(d_model, d_model, bias=False) for _ in range(4))
        self.w1, self.w3 = nn.Linear(d_model, d_ff, bias=False), nn.Linear(d_model, d_ff, bias=False)
        self.w2 = nn.Linear(d_ff, d_model, bias=False)
        self.rope = rope

    def attention(self, x):
        b, s, d = x.shape
        split = lambda t: t.view(b, s, self.heads, d // self.heads).transpose(1, 2)  # noqa: E731
        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        q, k = self.rope(q), self.rope(k)
        scores = q @ k.transpose(-2, -1) / math.sqrt(d // self.heads)
        mask = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
        out = torch.softmax(scores, -1) @ v
        return self.o(out.transpose(1, 2).reshape(b, s, d))

    def forward(self, x):
        x = x + self.attention(self.norm1(x))
        h = self.norm2(x)
        return x + self.w2(nn.functional.silu(self.w1(h)) * self.w3(h))


class LM(nn.Module):
    def __init__(self, d_model, d_ff, layers, heads, vocab=10_000, context=512):
        super().__init__()
        rope = Rope(d_model // heads, context)
        self.embed = nn.Embedding(vocab, d_model)
        self.layers = nn.ModuleList(Block(d_model, d_ff, heads, rope) for _ in range(layers))
        self.norm = RMSNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def tiny_lm():
    return LM(d_model=128, d_ff=512, layers=2, heads=4, vocab=512, context=512)


# The real snapshots' configurations (README of pytorch-snapshots).
def kk_xl():
    return LM(2560, 10240, 32, 32, context=512)


def wed_medium():
    return LM(1024, 4096, 24, 16, context=512)


def niu_small():
    return LM(512, 1344, 4, 16, context=256)


# The same architecture as the course code most of the real snapshots ran
# it: every linear layer an einsum over a [out, in] weight, the
# embedding an index into its weight, RMSNorm upcast to float32, rotary
# embedding on the halves of each pair then concatenated, attention scores
# masked with torch.where and a softmax written out (max, exp, sum), SiLU
# as x * sigmoid(x).
class EinsumLinear(nn.Module):
    def __init__(self, d_in, d_out):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(d_out, d_in))

    def forward(self, x):
        return torch.einsum("...i,oi->...o", x, self.weight)


class IndexEmbedding(nn.Module):
    def __init__(self, vocab, d):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab, d))

    def forward(self, ids):
        return self.weight[ids, :]


class PairRope(nn.Module):
    def __init__(self, d_head, context, theta=10000.0):
        super().__init__()
        angles = torch.outer(torch.arange(context).float(), theta ** -(torch.arange(0, d_head, 2) / d_head))
        self.register_buffer("cos_sin", torch.stack((angles.cos(), angles.sin())), persistent=False)

    def forward(self, x):
        first, second = x.unflatten(-1, (-1, 2)).movedim(-1, 0).unbind(0)
        cos, sin = self.cos_sin[:, : x.size(-2)].unbind(0)
        return torch.concat((cos * first - sin * second, sin * first + cos * second), dim=-1)


def written_softmax(x, dim):
    shifted = x - x.max(dim=dim, keepdim=True)[0]
    exps = shifted.exp()
    return exps / exps.sum(dim=dim, keepdim=True)


class BasicsBlock(nn.Module):
    def __init__(self, d_model, d_ff, heads, rope):
        super().__init__()
        self.heads, self.rope = heads, rope
        self.ln1, self.ln2 = RMSNorm(d_model), RMSNorm(d_model)
        self.q_proj, self.k_proj, self.v_proj, self.output_proj = (EinsumLinear(d_model, d_model) for _ in range(4))
        self.w1, self.w3, self.w2 = EinsumLinear(d_model, d_ff), EinsumLinear(d_model, d_ff), EinsumLinear(d_ff, d_model)

    def attention(self, x):
        b, s, d = x.shape
        q, k, v = (p(x).unflatten(-1, (self.heads, -1)).transpose(-3, -2) for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k = self.rope(q), self.rope(k)
        positions = torch.arange(s, device=x.device)
        causal = (positions[:, None] >= positions[None, :])[None, None]
        scores = torch.einsum("...qd,...kd->...qk", q, k) / math.sqrt(d // self.heads)
        weights = written_softmax(torch.where(causal, scores, float("-inf")), dim=-1)
        out = torch.einsum("...qk,...kd->...qd", weights, v)
        return self.output_proj(out.transpose(-3, -2).flatten(-2).contiguous())

    def forward(self, x):
        x = x + self.attention(self.ln1(x))
        h = self.ln2(x)
        gate = self.w1(h)
        return x + self.w2(gate * torch.sigmoid(gate) * self.w3(h))


class BasicsLM(nn.Module):
    def __init__(self, d_model, d_ff, layers, heads, vocab=10_000, context_length=512):
        super().__init__()
        self.context_length = context_length
        rope = PairRope(d_model // heads, context_length)
        self.token_embeddings = IndexEmbedding(vocab, d_model)
        self.layers = nn.ModuleList(BasicsBlock(d_model, d_ff, heads, rope) for _ in range(layers))
        self.ln_final = RMSNorm(d_model)
        self.lm_head = EinsumLinear(d_model, vocab)

    def forward(self, ids):
        x = self.token_embeddings(ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.ln_final(x))


def basics_xl():
    return BasicsLM(2560, 10240, 32, 32)


def basics_tiny():
    """Says its context length (64), as the course code's model does."""
    return BasicsLM(64, 256, 2, 4, vocab=256, context_length=64)


class LearnedPositions(nn.Module):
    """64 learned positions, and no attribute that says so."""

    def __init__(self):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(256, 32), nn.Embedding(64, 32)
        self.head = nn.Linear(32, 256)

    def forward(self, ids):
        return self.head(self.tokens(ids) + self.positions.weight[: ids.size(1)])


def learned_positions():
    return LearnedPositions()


class WrongType(nn.Module):
    """Fails as a model whose types disagree does: not the inputs' shape."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(8, 8)

    def forward(self, ids):
        raise RuntimeError("expected scalar type Float but found BFloat16")


def wrong_type():
    return WrongType()


class Bincount(nn.Module):
    """Runs an operator with no meta kernel (bincount) when the batch is 2."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(64, 16)
        self.head = nn.Linear(16, 64)

    def forward(self, ids):
        if ids.size(0) == 2:
            torch.bincount(ids.flatten())
        return self.head(self.embed(ids))


def bincount():
    return Bincount()


def raises():
    raise ValueError("this factory fails on purpose")


def image_workload():
    """A Workload that is not token ids to logits: a small CNN on images."""
    from tidepool.workload import Workload

    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(16, 10))
    return Workload(model, lambda batch, seq: (torch.randn(batch, 3, seq, seq, device="meta"),),
                    loss=lambda out, inputs: out.float().pow(2).mean())


class EmbeddingOnly(nn.Module):
    """No linear layer: nothing for LoRA to wrap."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(64, 64)

    def forward(self, ids):
        return self.embed(ids)


def embedding_only():
    return EmbeddingOnly()


# Factories the planner cannot use (test_plan.BadInput).
class NoParameters(nn.Module):
    def forward(self, ids):
        return nn.functional.one_hot(ids, 8).float()


def no_parameters():
    return NoParameters()


def foreign_optimizer():
    """An optimizer over another model's parameters."""
    model, other = tiny_lm(), tiny_lm()
    return model, torch.optim.AdamW(other.parameters())


def not_an_optimizer():
    return tiny_lm(), "adamw"


def three_things():
    model = tiny_lm()
    return model, torch.optim.AdamW(model.parameters()), "extra"


class TwoInputs(nn.Module):
    """Needs a mask besides the token ids: a Workload's to feed."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(64, 16)

    def forward(self, ids, mask):
        return self.embed(ids) * mask


def two_inputs():
    return TwoInputs()


class Pooled(nn.Module):
    """Returns one vector per sequence, not logits per token."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(64, 16)

    def forward(self, ids):
        return self.embed(ids).mean(1)


def pooled():
    return Pooled()
