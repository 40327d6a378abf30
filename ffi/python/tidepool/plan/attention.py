"""The attention kernel CUDA would run, chosen on the meta device.

On meta, `scaled_dot_product_attention` always takes the math path, which
holds the whole (batch, heads, query, key) score matrix and its softmax;
on a CUDA GPU PyTorch picks a fused kernel that holds only the output and
a log-sum-exp per row. `cuda_attention()` is a TorchFunctionMode that makes
the choice PyTorch makes on a current GPU (sm80 and later):
- flash attention for float16 and bfloat16 without an attention mask, head
  size a multiple of 8 and at most 256;
- memory-efficient attention otherwise when the head size is a multiple
  of 8 (it takes float32 and masks);
- the math path in all other cases,
and calls that kernel's operator, whose meta kernel and backward exist.
An sm75 card (the T4) chooses otherwise (no flash attention, no bf16 in
the fused kernels): cards.py says which precisions a recording stands for
there.
"""
import torch
from torch.overrides import TorchFunctionMode


def _backend(q, k, v, mask, dropout):
    head = q.size(-1)
    if q.device.type not in ("meta", "cuda") or q.dim() != 4 or head % 8 or not (q.dtype == k.dtype == v.dtype):
        return "math"
    if k.size(-1) != head or v.size(-1) != head:
        return "math"
    if q.dtype in (torch.float16, torch.bfloat16) and mask is None and head <= 256:
        return "flash"
    if q.dtype in (torch.float16, torch.bfloat16, torch.float32):
        return "efficient"
    return "math"


class cuda_attention(TorchFunctionMode):  # noqa: N801 - a context manager
    """`with cuda_attention(): ...` runs attention with CUDA's fused kernels."""

    def __init__(self):
        super().__init__()
        self.choices = {"flash": 0, "efficient": 0, "math": 0}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") != "scaled_dot_product_attention":
            return func(*args, **kwargs)
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
        given = dict(zip(names, args), **kwargs)
        q, k, v = given["query"], given["key"], given["value"]
        mask, dropout = given.get("attn_mask"), given.get("dropout_p", 0.0)
        causal, scale = given.get("is_causal", False), given.get("scale")
        backend = _backend(q, k, v, mask, dropout)
        self.choices[backend] += 1
        if backend == "math":
            return func(*args, **kwargs)
        if given.get("enable_gqa") and k.size(-3) != q.size(-3):
            repeat = q.size(-3) // k.size(-3)
            k, v = k.repeat_interleave(repeat, -3), v.repeat_interleave(repeat, -3)
        if backend == "flash":
            return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, dropout, causal, False, scale=scale)[0]
        if mask is not None and mask.dtype == torch.bool:
            mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, float("-inf"))
        if mask is not None:
            mask = mask.expand(q.size(0), q.size(1), q.size(2), k.size(2))
        grad = any(t.requires_grad for t in (q, k, v)) and torch.is_grad_enabled()
        return torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, mask, grad, dropout, causal, scale=scale)[0]
