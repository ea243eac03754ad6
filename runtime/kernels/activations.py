"""Fused elementwise activations, fp32 inside, output in the input's dtype.

    silu_mul (the SwiGLU activation)   y = silu(a) * b,   silu(a) = a*s, s = sigmoid(a)
        da = g*b*s*(1 + a*(1 - s)),  db = g*silu(a)
    bias_gelu (GELU, tanh approximation as F.gelu(approximate="tanh"))
        z = x + bias,  u = k0*(z + k1*z^3),  k0 = sqrt(2/pi),  k1 = 0.044715
        y = 0.5*z*(1 + tanh(u)) = z*q,  q = sigmoid(2u)
        dx = g*(q + z*q*(1 - q)*2*k0*(1 + 3*k1*z^2)),  dbias = sum over rows of dx

Inputs are seen as (rows, cols) with unit stride along cols, so the two halves of a fused gate/up
projection (`t.chunk(2, -1)`) go in without a copy. Tiles are (BLOCK_R, BLOCK_C) on a 2-D grid.
The bias-GELU backward walks row blocks in a grid-stride loop per column block and writes fp32
partial bias grads (P, cols), summed by torch. 2*k0 = 1.5957691216057308 and 3*k1 = 0.134145
are literals in the kernels (a jitted kernel reads no module globals). Only the inputs are
saved for backward, on the torch path too (`_SiluMulSaved`, `_GeluSaved`: the references' values,
and their gradients bit for bit, keeping only the inputs).
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch.autograd import Function

from autoplan.runtime.kernels.dispatch import (Backend, cdiv, device_guard, next_pow2, num_warps,
                                               persistent_programs, rows_per_program, upcast,
                                               use_triton)

_TILE_ELEMS = 4096


class _SiluMulSaved(Function):
    """`silu_mul_torch` keeping only a and b for backward, as the kernel does (autograd of the
    reference would keep fp32 copies of a and b and silu(a) too); the backward is autograd's own
    formulas in the same order, so the gradients are bitwise those of the reference."""

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return silu_mul_torch(a, b)

    @staticmethod
    def backward(ctx, dy):
        a, b = ctx.saved_tensors
        a32, b32, g = upcast(a), upcast(b), upcast(dy)
        da = torch.ops.aten.silu_backward(g * b32, a32)
        return da.to(a.dtype), (g * F.silu(a32)).to(b.dtype)


class _GeluSaved(Function):
    """`bias_gelu_torch` without a bias, keeping only x for backward (autograd of the reference
    would keep an fp32 copy of a half-precision x); gradients bitwise the reference's."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return bias_gelu_torch(x)

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        return torch.ops.aten.gelu_backward(upcast(dy), upcast(x), approximate="tanh").to(x.dtype)


def silu_mul_torch(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Reference: silu(a) * b in fp32 (float64 stays), cast to a's dtype."""
    return (F.silu(upcast(a)) * upcast(b)).to(a.dtype)


def bias_gelu_torch(x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Reference: F.gelu(x + bias, approximate="tanh") in fp32 (float64 stays), in x's dtype."""
    z = upcast(x) if bias is None else upcast(x) + upcast(bias)
    return F.gelu(z, approximate="tanh").to(x.dtype)


@functools.cache
def _kernels() -> SimpleNamespace:
    global tl  # jitted kernels look `tl` up among the module globals (the interpreter insists)
    import triton
    import triton.language as tl

    @triton.jit
    def silu_mul_fwd(a_ptr, b_ptr, y_ptr, n_rows, n_cols, stride_a, stride_b, stride_y,
                     BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
        r, c = rows.to(tl.int64)[:, None], cols[None, :]
        a = tl.load(a_ptr + r * stride_a + c, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + r * stride_b + c, mask=mask, other=0.0).to(tl.float32)
        y = a * tl.sigmoid(a) * b
        tl.store(y_ptr + r * stride_y + c, y.to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def silu_mul_bwd(g_ptr, a_ptr, b_ptr, da_ptr, db_ptr, n_rows, n_cols, stride_g, stride_a,
                     stride_b, stride_d, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
        r, c = rows.to(tl.int64)[:, None], cols[None, :]
        g = tl.load(g_ptr + r * stride_g + c, mask=mask, other=0.0).to(tl.float32)
        a = tl.load(a_ptr + r * stride_a + c, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + r * stride_b + c, mask=mask, other=0.0).to(tl.float32)
        s = tl.sigmoid(a)
        da = g * b * s * (1.0 + a * (1.0 - s))
        tl.store(da_ptr + r * stride_d + c, da.to(da_ptr.dtype.element_ty), mask=mask)
        tl.store(db_ptr + r * stride_d + c, (g * a * s).to(db_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def bias_gelu_fwd(x_ptr, bias_ptr, y_ptr, n_rows, n_cols, stride_x, stride_y,
                      HAS_BIAS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
        r, c = rows.to(tl.int64)[:, None], cols[None, :]
        z = tl.load(x_ptr + r * stride_x + c, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            z += tl.load(bias_ptr + c, mask=c < n_cols, other=0.0).to(tl.float32)
        q = tl.sigmoid(1.5957691216057308 * (z + 0.044715 * z * z * z))
        tl.store(y_ptr + r * stride_y + c, (z * q).to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def bias_gelu_bwd(g_ptr, x_ptr, bias_ptr, dx_ptr, dbias_ptr, n_rows, n_cols, stride_g,
                      stride_x, stride_dx, HAS_BIAS: tl.constexpr, BLOCK_R: tl.constexpr,
                      BLOCK_C: tl.constexpr):
        pid, n_prog = tl.program_id(0), tl.num_programs(0)
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        cmask = cols < n_cols
        bias = tl.zeros([BLOCK_C], dtype=tl.float32)
        if HAS_BIAS:
            bias = tl.load(bias_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        dbias = tl.zeros([BLOCK_C], dtype=tl.float32)
        for block in range(pid, tl.cdiv(n_rows, BLOCK_R), n_prog):
            rows = block * BLOCK_R + tl.arange(0, BLOCK_R)
            mask = (rows < n_rows)[:, None] & cmask[None, :]
            r, c = rows.to(tl.int64)[:, None], cols[None, :]
            g = tl.load(g_ptr + r * stride_g + c, mask=mask, other=0.0).to(tl.float32)
            z = tl.load(x_ptr + r * stride_x + c, mask=mask, other=0.0).to(tl.float32)
            z += bias[None, :]
            q = tl.sigmoid(1.5957691216057308 * (z + 0.044715 * z * z * z))
            du = 1.5957691216057308 * (1.0 + 0.134145 * z * z)
            dx = g * (q + z * q * (1.0 - q) * du)
            tl.store(dx_ptr + r * stride_dx + c, dx.to(dx_ptr.dtype.element_ty), mask=mask)
            dbias += tl.sum(tl.where(mask, dx, 0.0), axis=0)
        if HAS_BIAS:
            tl.store(dbias_ptr + pid * n_cols + cols, dbias, mask=cmask)

    return SimpleNamespace(silu_mul_fwd=silu_mul_fwd, silu_mul_bwd=silu_mul_bwd,
                           bias_gelu_fwd=bias_gelu_fwd, bias_gelu_bwd=bias_gelu_bwd)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t as (rows, cols) with unit stride along cols (a view where possible)."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def config(rows: int, cols: int, cuda: bool) -> dict[str, int]:
    """Launch parameters of the four kernels: tiles of up to 1024 columns."""
    block_c = min(next_pow2(cols), 1024)
    block_r = rows_per_program(rows, block_c, _TILE_ELEMS, cuda)
    return dict(BLOCK_R=block_r, BLOCK_C=block_c, num_warps=num_warps(block_r * block_c))


def _grid(rows: int, cols: int, cfg: dict[str, int]) -> tuple[int, int]:
    return cdiv(rows, cfg["BLOCK_R"]), cdiv(cols, cfg["BLOCK_C"])


class _SiluMul(Function):
    @staticmethod
    def forward(ctx, a, b):
        a2, b2 = _rows(a), _rows(b)
        rows, cols = a2.shape
        cfg = config(rows, cols, a2.is_cuda)
        y = torch.empty((rows, cols), dtype=a.dtype, device=a.device)
        with device_guard(a2):
            _kernels().silu_mul_fwd[_grid(rows, cols, cfg)](
                a2, b2, y, rows, cols, a2.stride(0), b2.stride(0), y.stride(0), **cfg)
        ctx.save_for_backward(a2, b2)
        ctx.shape = a.shape
        return y.view(a.shape)

    @staticmethod
    def backward(ctx, dy):
        a2, b2 = ctx.saved_tensors
        g = _rows(dy)
        rows, cols = a2.shape
        cfg = config(rows, cols, a2.is_cuda)
        da = torch.empty((rows, cols), dtype=a2.dtype, device=a2.device)
        db = torch.empty((rows, cols), dtype=b2.dtype, device=a2.device)
        with device_guard(a2):
            _kernels().silu_mul_bwd[_grid(rows, cols, cfg)](
                g, a2, b2, da, db, rows, cols, g.stride(0), a2.stride(0), b2.stride(0),
                da.stride(0), **cfg)
        return da.view(ctx.shape), db.view(ctx.shape)


class _BiasGelu(Function):
    @staticmethod
    def forward(ctx, x, bias):
        x2 = _rows(x)
        rows, cols = x2.shape
        cfg = config(rows, cols, x2.is_cuda)
        b = None if bias is None else bias.contiguous()
        y = torch.empty((rows, cols), dtype=x.dtype, device=x.device)
        with device_guard(x2):
            _kernels().bias_gelu_fwd[_grid(rows, cols, cfg)](
                x2, x2 if b is None else b, y, rows, cols, x2.stride(0), y.stride(0),
                HAS_BIAS=b is not None, **cfg)
        ctx.save_for_backward(x2, b)
        ctx.shape = x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2, b = ctx.saved_tensors
        g = _rows(dy)
        rows, cols = x2.shape
        cfg = config(rows, cols, x2.is_cuda)
        row_blocks, col_blocks = _grid(rows, cols, cfg)
        # about 4 programs per SM in all, each walking its rows for one column block
        programs = persistent_programs(x2.device, row_blocks, per_sm=max(1, 4 // col_blocks))
        dx = torch.empty((rows, cols), dtype=x2.dtype, device=x2.device)
        dbias = torch.empty((programs, cols), dtype=torch.float32, device=x2.device)
        with device_guard(x2):
            _kernels().bias_gelu_bwd[(programs, col_blocks)](
                g, x2, x2 if b is None else b, dx, dbias, rows, cols, g.stride(0), x2.stride(0),
                dx.stride(0), HAS_BIAS=b is not None, **cfg)
        db = None if b is None else dbias.sum(0).to(b.dtype)
        return dx.view(ctx.shape), db


def silu_mul(a: torch.Tensor, b: torch.Tensor, backend: Backend = "auto") -> torch.Tensor:
    """The SwiGLU activation silu(a) * b of two same-shaped tensors (gate, up)."""
    if a.shape != b.shape:
        raise ValueError(f"silu_mul: gate {tuple(a.shape)} and up {tuple(b.shape)} must have "
                         f"the same shape")
    if a.numel() == 0 or not use_triton(a.device, backend):
        return _SiluMulSaved.apply(a, b)
    return _SiluMul.apply(a, b)


def bias_gelu(x: torch.Tensor, bias: torch.Tensor | None = None,
              backend: Backend = "auto") -> torch.Tensor:
    """gelu_tanh(x + bias) for x (..., f) and bias (f,) or None."""
    if bias is not None and tuple(bias.shape) != (x.shape[-1],):
        raise ValueError(f"bias_gelu: bias has shape {tuple(bias.shape)}, expected "
                         f"({x.shape[-1]},) to match the last dim of x {tuple(x.shape)}")
    if x.numel() == 0 or not use_triton(x.device, backend):
        return bias_gelu_torch(x, bias) if bias is not None else _GeluSaved.apply(x)
    return _BiasGelu.apply(x, bias)
