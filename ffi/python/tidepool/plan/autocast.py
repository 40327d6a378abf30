"""CUDA autocast's rules, applied on the meta device.

`torch.autocast("cuda")` does nothing to meta tensors (they never reach the
AutocastCUDA dispatch key, and without a GPU it disables itself), so a
mixed-precision step recorded on meta would keep every activation in
float32. `cuda_autocast(dtype)` is a TorchFunctionMode that applies, above
autograd as autocast does, the rules PyTorch documents for CUDA:
- the lower-precision operators (matmuls, linear layers, convolutions,
  attention) cast their floating-point inputs to `dtype`;
- the float32 operators (reductions, norms, losses, exp/log/pow and
  the like) cast theirs to float32;
- softmax, log_softmax, sum, prod, cumsum and cumprod without a dtype
  run with dtype=float32 when their input is of lower precision;
- the promoting operators (cat, stack, addcmul, index_put, ...) cast to
  the widest floating type among their inputs;
- a float32 leaf that requires grad (a weight) cast to `dtype` is cast once
  and kept until the region exits: autocast's weight cast cache.
"""
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

# Written from PyTorch's autocast documentation ("CUDA Ops that can
# autocast to float16 / to float32", "CUDA Ops that promote to the widest
# input type"), by the Python names under which the operators are called.
LOWER_PRECISION = frozenset("""
    __matmul__ __rmatmul__ matmul mm mv bmm addmm addmv addr addbmm baddbmm chain_matmul multi_dot linalg_multi_dot
    linear einsum conv1d conv2d conv3d conv_transpose1d conv_transpose2d conv_transpose3d conv_tbc
    prelu lstm_cell gru_cell rnn_tanh_cell rnn_relu_cell scaled_dot_product_attention
""".split())
FLOAT32 = frozenset("""
    __pow__ __rpow__ __rdiv__ __rtruediv__ pow acos asin cosh sinh tan erfinv exp expm1 log log10 log1p log2
    reciprocal rsqrt softplus softmin layer_norm group_norm norm normalize renorm dist pdist cdist
    cosine_similarity cosine_embedding_loss binary_cross_entropy_with_logits cross_entropy nll_loss kl_div l1_loss
    mse_loss smooth_l1_loss huber_loss hinge_embedding_loss margin_ranking_loss multilabel_margin_loss
    multi_margin_loss soft_margin_loss triplet_margin_loss poisson_nll_loss logsumexp
""".split())
# float32 through the operator's own dtype argument.
FLOAT32_DTYPE = frozenset("softmax log_softmax sum prod cumsum cumprod".split())
PROMOTE = frozenset("""
    addcdiv addcmul atan2 bilinear cross dot grid_sample index_put index_put_ scatter_add tensordot cat concat
    concatenate stack index_copy
""".split())

_LOW = (torch.float16, torch.bfloat16)


def _eligible(t):
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64 and \
        t.device.type in ("meta", "cuda")


class cuda_autocast(TorchFunctionMode):  # noqa: N801 - used as a context manager, like torch.autocast
    """`with cuda_autocast(torch.bfloat16): ...` runs as under torch.autocast("cuda")."""

    def __init__(self, dtype=torch.bfloat16, enabled=True):
        super().__init__()
        self.dtype = dtype
        self.enabled = enabled
        self.cache = {}  # id(weight) -> (weight, its cast)

    def __enter__(self):
        if not self.enabled:
            return self
        return super().__enter__()

    def __exit__(self, *exc):
        if not self.enabled:
            return False
        self.cache.clear()
        return super().__exit__(*exc)

    def _to_low(self, t):
        if not _eligible(t) or t.dtype == self.dtype:
            return t
        if t.dtype == torch.float32 and t.is_leaf and t.requires_grad and not t._is_view():
            hit = self.cache.get(id(t))
            if hit is not None and hit[0] is t:
                return hit[1]
            cast = t.to(self.dtype)
            self.cache[id(t)] = (t, cast)
            return cast
        return t.to(self.dtype)

    @staticmethod
    def _to_float32(t):
        return t.float() if _eligible(t) and t.dtype in _LOW else t

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in LOWER_PRECISION:
            args, kwargs = tree_map(self._to_low, (args, kwargs))
        elif name in FLOAT32:
            args, kwargs = tree_map(self._to_float32, (args, kwargs))
        elif name in FLOAT32_DTYPE:
            first = args[0] if args else None
            if _eligible(first) and first.dtype in _LOW and kwargs.get("dtype") is None:
                kwargs = dict(kwargs, dtype=torch.float32)
        elif name in PROMOTE:
            tensors = [t for t in tree_flatten((args, kwargs))[0] if _eligible(t)]
            dtypes = {t.dtype for t in tensors}
            if len(dtypes) > 1:
                widest = torch.float32 if torch.float32 in dtypes else next(iter(dtypes))
                args, kwargs = tree_map(lambda t: t.to(widest) if _eligible(t) and t.dtype != widest else t,
                                        (args, kwargs))
        return func(*args, **kwargs)
