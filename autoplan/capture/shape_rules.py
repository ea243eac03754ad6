"""Output shapes of the common capture ops by rule, without running their meta kernels.

Why: on the meta device, torch runs pointwise ops, norms and losses through its Python reference
decompositions, and the first of those imports torch._dynamo (about 2 s, more than the rest of a
planning run's capture). The ops below cover what the built-in models trace to; any other op, or one
of these with unusual inputs (non-floating tensors, no tensor at all), returns None and runs on meta
as before. tests/test_capture.py checks the rules against meta execution on every model family.

    Linear          x (..., in)                 -> (..., out),          dtype of x and weight promoted
    Embedding       idx (...)                   -> (..., dim),          weight dtype
    LayerNorm, RMSNorm, MoEFeedForward  x       -> x's shape and dtype
    CausalAttention q (B, T, Hq d), k, v        -> (B, T, Hq d),        q's dtype (checks as forward)
    LMLoss          logits, targets             -> (),                  float32
    pointwise       tensors and scalars         -> broadcast shape,     torch.result_type
"""

from __future__ import annotations

import torch
from torch import nn

from autoplan.models.layers import CausalAttention, LMLoss, MoEFeedForward, RMSNorm

UNARY = {"neg", "gelu", "silu", "relu", "tanh", "sigmoid", "exp", "rsqrt", "sqrt"}
BINARY = {"add", "iadd", "add_", "sub", "isub", "sub_", "mul", "imul", "mul_", "truediv", "div", "pow"}


def _empty(shape, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(tuple(shape), dtype=dtype, device="meta")


def module_output(module: nn.Module, args: tuple) -> torch.Tensor | None:
    """The output of a leaf module called on meta `args`, by the rules of the module docstring."""
    x = args[0] if args else None
    if not isinstance(x, torch.Tensor):
        return None
    if isinstance(module, nn.Linear) and x.is_floating_point():
        return _empty((*x.shape[:-1], module.out_features), torch.promote_types(x.dtype, module.weight.dtype))
    if isinstance(module, nn.Embedding) and not x.is_floating_point():
        return _empty((*x.shape, module.embedding_dim), module.weight.dtype)
    if isinstance(module, (nn.LayerNorm, RMSNorm, MoEFeedForward)) and x.is_floating_point():
        return _empty(x.shape, x.dtype)
    if isinstance(module, CausalAttention) and len(args) == 3 and x.dim() == 3:
        module.check_shapes(x, args[1])
        return _empty(x.shape, x.dtype)
    if isinstance(module, LMLoss):
        return _empty((), torch.float32)
    return None


def function_output(name: str, args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The output of a pointwise function or method `name` (its readable target) on meta `args`."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if not tensors or any(not t.is_floating_point() for t in tensors):
        return None
    if any(not isinstance(a, (torch.Tensor, int, float)) for a in args):
        return None
    if name in UNARY and len(args) == 1:
        return _empty(args[0].shape, args[0].dtype)
    if name in BINARY and len(args) == 2 and set(kwargs) <= {"alpha"}:
        shape = torch.broadcast_shapes(*(t.shape for t in tensors))
        dtype = torch.result_type(*args) if isinstance(args[0], torch.Tensor) else torch.result_type(args[1], args[0])
        if name in ("truediv", "div") and not dtype.is_floating_point:
            return None
        return _empty(shape, dtype)
    return None

