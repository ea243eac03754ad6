"""Rotary position embedding in the rotate-half form of `autoplan.models.layers.apply_rope`.

For a row x = [x1, x2] of d values at position t (halves of d/2), c = cos[t], s = sin[t]:

    y  = x*c + rotate_half(x)*s,   rotate_half([x1, x2]) = [-x2, x1]
       = [x1*c1 - x2*s1,  x2*c2 + x1*s2]
    dx = g*c + rotate_half^T(g*s),  rotate_half^T([u1, u2]) = [u2, -u1]
       = [g1*c1 + g2*s2,  g2*c2 - g1*s1]

computed in fp32 and cast to x's dtype; cos and sin get no gradient (they are buffers). x is
(B, H, T, d) with any strides but a unit one along d, so the (B, T, H, d) -> (B, H, T, d)
transpose in attention goes in without a copy, and the output keeps x's memory layout.
Other ranks are viewed as 4-D ((T, d) is (1, 1, T, d); (..., T, d) is (-1, ., T, d)).
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch
from torch.autograd import Function

from autoplan.runtime.kernels.dispatch import (Backend, cdiv, device_guard, next_pow2, num_warps,
                                               rows_per_program, upcast, use_triton)

_TILE_ELEMS = 2048  # of each half: 4096 values of x per program on CUDA


def apply_rope_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Reference: `autoplan.models.layers.apply_rope` (float64 stays float64)."""
    x1, x2 = upcast(x).chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (upcast(x) * cos + rotated * sin).to(x.dtype)


@functools.cache
def _kernels() -> SimpleNamespace:
    global tl  # jitted kernels look `tl` up among the module globals (the interpreter insists)
    import triton
    import triton.language as tl

    @triton.jit
    def rope(x_ptr, cos_ptr, sin_ptr, y_ptr, n_rows, heads, seq, half, stride_xb, stride_xh,
             stride_xt, stride_yb, stride_yh, stride_yt, BACKWARD: tl.constexpr,
             BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.arange(0, BLOCK_H)[None, :]
        mask = (rows < n_rows)[:, None] & (cols < half)
        r = rows.to(tl.int64)
        b, h, t = r // (heads * seq), (r // seq) % heads, r % seq
        x_row = (b * stride_xb + h * stride_xh + t * stride_xt)[:, None]
        y_row = (b * stride_yb + h * stride_yh + t * stride_yt)[:, None]
        cs_row = (t * 2 * half)[:, None]
        x1 = tl.load(x_ptr + x_row + cols, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_ptr + x_row + half + cols, mask=mask, other=0.0).to(tl.float32)
        c1 = tl.load(cos_ptr + cs_row + cols, mask=mask, other=0.0).to(tl.float32)
        c2 = tl.load(cos_ptr + cs_row + half + cols, mask=mask, other=0.0).to(tl.float32)
        s1 = tl.load(sin_ptr + cs_row + cols, mask=mask, other=0.0).to(tl.float32)
        s2 = tl.load(sin_ptr + cs_row + half + cols, mask=mask, other=0.0).to(tl.float32)
        if BACKWARD:
            y1 = x1 * c1 + x2 * s2
            y2 = x2 * c2 - x1 * s1
        else:
            y1 = x1 * c1 - x2 * s1
            y2 = x2 * c2 + x1 * s2
        tl.store(y_ptr + y_row + cols, y1.to(y_ptr.dtype.element_ty), mask=mask)
        tl.store(y_ptr + y_row + half + cols, y2.to(y_ptr.dtype.element_ty), mask=mask)

    return SimpleNamespace(rope=rope)


def config(rows: int, head_dim: int, cuda: bool) -> dict[str, int]:
    """Launch parameters: tiles of (BLOCK_R rows, BLOCK_H values of each half)."""
    block_h = next_pow2(head_dim // 2)
    block_r = rows_per_program(rows, block_h, _TILE_ELEMS, cuda)
    return dict(BLOCK_R=block_r, BLOCK_H=block_h, num_warps=num_warps(2 * block_r * block_h))


def _as_4d(x: torch.Tensor) -> torch.Tensor:
    """x (..., T, d) as (B, H, T, d), a view where possible, with unit stride along d."""
    x4 = x.view((1,) * (4 - x.dim()) + tuple(x.shape)) if x.dim() <= 4 else \
        x.reshape(-1, *x.shape[-3:])
    return x4 if x4.stride(-1) == 1 else x4.contiguous()


def _launch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool) -> torch.Tensor:
    x4 = _as_4d(x)
    y4 = torch.empty_like(x4)  # x's layout where x is dense
    B, H, T, d = x4.shape
    cfg = config(B * H * T, d, x4.is_cuda)
    with device_guard(x4):
        _kernels().rope[(cdiv(B * H * T, cfg["BLOCK_R"]),)](
            x4, cos, sin, y4, B * H * T, H, T, d // 2, *x4.stride()[:3], *y4.stride()[:3],
            BACKWARD=backward, **cfg)
    return y4.view(x.shape)


class _Rope(Function):
    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _launch(x, cos, sin, backward=False)

    @staticmethod
    def backward(ctx, dy):
        cos, sin = ctx.saved_tensors
        return _launch(dy, cos, sin, backward=True), None, None


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               backend: Backend = "auto") -> torch.Tensor:
    """RoPE on x (..., T, d) with cos, sin of T*d values ((T, d) or any shape that views as it)."""
    T, d = x.shape[-2:] if x.dim() >= 2 else (None, None)
    if d is None or d % 2 or cos.numel() != T * d or sin.numel() != T * d:
        raise ValueError(f"apply_rope: x {tuple(x.shape)} must be (..., T, d) with d even, and "
                         f"cos {tuple(cos.shape)}, sin {tuple(sin.shape)} must hold (T, d) values")
    if x.numel() == 0 or not use_triton(x.device, backend):
        return apply_rope_torch(x, cos.reshape(T, d), sin.reshape(T, d))
    return _Rope.apply(x, cos.reshape(T, d).contiguous(), sin.reshape(T, d).contiguous())
