"""Triton kernels for the memory-bound ops around the matmuls, each with a plain-torch reference.

    y = rms_norm(x, weight, eps)                     layer_norm(x, weight, bias, eps)
    y = silu_mul(gate, up)                           bias_gelu(x, bias)        (tanh GELU)
    q = apply_rope(q, cos, sin)                      (rotate-half, as models.layers.apply_rope)
    loss = vocab_parallel_cross_entropy(logits_slice, targets, vocab_start, group)
    r = moe_routing(top_idx, experts);  xp = moe_permute(x, r);  out = moe_unpermute(yp, w, r)

Every function takes `backend="auto" | "triton" | "torch"` (see `dispatch.use_triton`): "auto"
runs Triton on CUDA when triton imports and torch on CPU; TRITON_INTERPRET=1 runs the Triton
kernels on CPU through the interpreter (the tests). The Triton paths are autograd Functions with
hand-written backward kernels; the torch paths are plain differentiable torch. Importing this
package never imports triton: each module builds its kernels on first use.
"""

from __future__ import annotations

from autoplan.runtime.kernels.activations import bias_gelu, silu_mul
from autoplan.runtime.kernels.cross_entropy import (cross_entropy_grad, cross_entropy_stats,
                                                    vocab_parallel_cross_entropy)
from autoplan.runtime.kernels.dispatch import Backend, use_triton
from autoplan.runtime.kernels.moe_permute import Routing, moe_combine, moe_permute, moe_routing, moe_unpermute
from autoplan.runtime.kernels.norms import layer_norm, rms_norm
from autoplan.runtime.kernels.rope import apply_rope

__all__ = ["Backend", "Routing", "apply_rope", "bias_gelu", "cross_entropy_grad",
           "cross_entropy_stats", "layer_norm", "moe_combine", "moe_permute", "moe_routing", "moe_unpermute",
           "rms_norm", "silu_mul", "use_triton", "vocab_parallel_cross_entropy"]
