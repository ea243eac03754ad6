"""Row-wise RMSNorm and LayerNorm over the last dim, fp32 inside, output in the input's dtype.

For a row x of D values (w the weight, b the bias, g = dL/dy):

    RMSNorm    r = 1/sqrt(mean(x^2) + eps)        y = x*r*w
               dx = r*(g*w - xh*mean(g*w*xh))     xh = x*r
    LayerNorm  mu = mean(x), r = 1/sqrt(var(x) + eps) (biased var, as F.layer_norm)
               y = xh*w + b,  xh = (x - mu)*r
               dx = r*(g*w - xh*mean(g*w*xh) - mean(g*w))
    both       dw = sum over rows of g*xh,  db = sum over rows of g

Forward saves x, the weight and the per-row statistics (mu, r in fp32), never y. The backward kernel
is a grid-stride loop: a few programs per SM each walk many row blocks and keep their share of
dw / db in registers, writing one fp32 partial row each; torch sums the partials (P, D).
A program holds whole rows (the row width padded to a power of two): no spills for sm_90 up to
hidden 8192; above that the backward's accumulators spill a few hundred bytes per thread (ptxas),
which only the H200 can price (a column-chunked variant is the alternative).
The torch references (`rms_norm_torch`, `layer_norm_torch`) match `autoplan.models.layers.RMSNorm`
and `torch.nn.functional.layer_norm`. The CPU path is `layer_norm_torch` and, for RMSNorm,
`autoplan.models.layers.rms_norm`: the same values as the reference, keeping only x and r for
backward as the kernel does (autograd of the reference would keep xh too); float64 takes the
reference, which stays in float64.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch.autograd import Function

from autoplan.models.layers import rms_norm as lean_rms_norm
from autoplan.runtime.kernels.dispatch import (Backend, cdiv, device_guard, next_pow2, num_warps,
                                               persistent_programs, rows_per_program, upcast,
                                               use_triton)

_TILE_ELEMS = 4096  # on CUDA: one row per program from hidden 4096 up, several below


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """Reference: `autoplan.models.layers.RMSNorm.forward` (float64 inputs stay float64)."""
    x32 = upcast(x)
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (y * upcast(weight)).to(x.dtype)


def layer_norm_torch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     eps: float = 1e-5) -> torch.Tensor:
    """Reference: F.layer_norm in fp32 (float64 stays), cast back to x's dtype."""
    b = None if bias is None else upcast(bias)
    return F.layer_norm(upcast(x), x.shape[-1:], upcast(weight), b, eps).to(x.dtype)


@functools.cache
def _kernels() -> SimpleNamespace:
    global tl  # jitted kernels look `tl` up among the module globals (the interpreter insists)
    import triton
    import triton.language as tl

    @triton.jit
    def norm_fwd(x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, n_rows, n_cols, stride_x,
                 stride_y, eps, RMS: tl.constexpr, HAS_BIAS: tl.constexpr,
                 BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.arange(0, BLOCK_D)
        rmask, cmask = rows < n_rows, cols < n_cols
        mask = rmask[:, None] & cmask[None, :]
        r64 = rows.to(tl.int64)[:, None]
        x = tl.load(x_ptr + r64 * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if RMS:
            xc = x
        else:
            mean = tl.sum(x, axis=1) / n_cols
            xc = tl.where(mask, x - mean[:, None], 0.0)
            tl.store(mean_ptr + rows, mean, mask=rmask)
        rstd = tl.rsqrt(tl.sum(xc * xc, axis=1) / n_cols + eps)
        tl.store(rstd_ptr + rows, rstd, mask=rmask)
        w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        y = xc * rstd[:, None] * w[None, :]
        if HAS_BIAS:
            y += tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + r64 * stride_y + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def norm_bwd(dy_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, dx_ptr, dw_ptr, db_ptr, n_rows, n_cols,
                 stride_dy, stride_x, stride_dx, RMS: tl.constexpr, HAS_BIAS: tl.constexpr,
                 BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
        pid, n_prog = tl.program_id(0), tl.num_programs(0)
        cols = tl.arange(0, BLOCK_D)
        cmask = cols < n_cols
        w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        dw = tl.zeros([BLOCK_D], dtype=tl.float32)
        db = tl.zeros([BLOCK_D], dtype=tl.float32)
        for block in range(pid, tl.cdiv(n_rows, BLOCK_R), n_prog):
            rows = block * BLOCK_R + tl.arange(0, BLOCK_R)
            rmask = rows < n_rows
            mask = rmask[:, None] & cmask[None, :]
            r64 = rows.to(tl.int64)[:, None]
            x = tl.load(x_ptr + r64 * stride_x + cols[None, :], mask=mask, other=0.0)
            g = tl.load(dy_ptr + r64 * stride_dy + cols[None, :], mask=mask, other=0.0)
            g = g.to(tl.float32)
            rstd = tl.load(rstd_ptr + rows, mask=rmask, other=0.0)
            if RMS:
                xh = x.to(tl.float32) * rstd[:, None]
            else:
                mean = tl.load(mean_ptr + rows, mask=rmask, other=0.0)
                xh = (x.to(tl.float32) - mean[:, None]) * rstd[:, None]
            gw = g * w[None, :]
            dx = gw - xh * (tl.sum(gw * xh, axis=1) / n_cols)[:, None]
            if not RMS:
                dx -= (tl.sum(gw, axis=1) / n_cols)[:, None]
            dx = dx * rstd[:, None]
            tl.store(dx_ptr + r64 * stride_dx + cols[None, :], dx.to(dx_ptr.dtype.element_ty),
                     mask=mask)
            dw += tl.sum(g * xh, axis=0)
            if HAS_BIAS:
                db += tl.sum(g, axis=0)
        tl.store(dw_ptr + pid * n_cols + cols, dw, mask=cmask)
        if HAS_BIAS:
            tl.store(db_ptr + pid * n_cols + cols, db, mask=cmask)

    return SimpleNamespace(norm_fwd=norm_fwd, norm_bwd=norm_bwd)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t as (rows, D) with unit stride along D (a view where possible)."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def config(rows: int, cols: int, cuda: bool) -> dict[str, int]:
    """Launch parameters of both kernels for `rows` rows of `cols` values (whole rows per tile)."""
    block_d = next_pow2(cols)
    block_r = rows_per_program(rows, block_d, _TILE_ELEMS, cuda)
    return dict(BLOCK_R=block_r, BLOCK_D=block_d, num_warps=num_warps(block_r * block_d))


def _forward(x2, weight, bias, eps, rms):
    rows, cols = x2.shape
    y = torch.empty((rows, cols), dtype=x2.dtype, device=x2.device)
    rstd = torch.empty(rows, dtype=torch.float32, device=x2.device)
    mean = rstd if rms else torch.empty_like(rstd)  # unused by the RMS kernel
    cfg = config(rows, cols, x2.is_cuda)
    with device_guard(x2):
        _kernels().norm_fwd[(cdiv(rows, cfg["BLOCK_R"]),)](
            x2, weight, weight if bias is None else bias, y, mean, rstd, rows, cols,
            x2.stride(0), y.stride(0), eps, RMS=rms, HAS_BIAS=bias is not None, **cfg)
    return y, mean, rstd


def _backward(dy2, x2, weight, mean, rstd, has_bias, rms):
    rows, cols = x2.shape
    dx = torch.empty((rows, cols), dtype=x2.dtype, device=x2.device)
    cfg = config(rows, cols, x2.is_cuda)
    programs = persistent_programs(x2.device, cdiv(rows, cfg["BLOCK_R"]))
    dw = torch.empty((programs, cols), dtype=torch.float32, device=x2.device)
    db = torch.empty_like(dw) if has_bias else dw
    with device_guard(x2):
        _kernels().norm_bwd[(programs,)](
            dy2, x2, weight, mean, rstd, dx, dw, db, rows, cols, dy2.stride(0), x2.stride(0),
            dx.stride(0), RMS=rms, HAS_BIAS=has_bias, **cfg)
    return dx, dw.sum(0), db.sum(0) if has_bias else None


class _Norm(Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps, rms):
        x2, w = _rows(x), weight.contiguous()
        b = None if bias is None else bias.contiguous()
        y, mean, rstd = _forward(x2, w, b, eps, rms)
        ctx.save_for_backward(x2, w, mean, rstd)
        ctx.rms, ctx.has_bias, ctx.shape = rms, bias is not None, x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2, w, mean, rstd = ctx.saved_tensors
        dx, dw, db = _backward(_rows(dy), x2, w, mean, rstd, ctx.has_bias, ctx.rms)
        db = None if db is None else db.to(w.dtype)
        return dx.view(ctx.shape), dw.to(w.dtype), db, None, None


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, name: str) -> None:
    hidden = x.shape[-1]
    for what, t in (("weight", weight), ("bias", bias)):
        if t is not None and tuple(t.shape) != (hidden,):
            raise ValueError(f"{name}: {what} has shape {tuple(t.shape)}, expected ({hidden},) "
                             f"to match the last dim of x {tuple(x.shape)}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5,
             backend: Backend = "auto") -> torch.Tensor:
    """RMSNorm of x (..., D) with weight (D,); Triton or torch as `use_triton` decides."""
    _check(x, weight, None, "rms_norm")
    if x.numel() == 0 or not use_triton(x.device, backend):
        return rms_norm_torch(x, weight, eps) if x.dtype == torch.float64 else lean_rms_norm(x, weight, eps)
    return _Norm.apply(x, weight, None, eps, True)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               eps: float = 1e-5, backend: Backend = "auto") -> torch.Tensor:
    """LayerNorm of x (..., D) with weight (D,) and optional bias (D,)."""
    _check(x, weight, bias, "layer_norm")
    if x.numel() == 0 or not use_triton(x.device, backend):
        return layer_norm_torch(x, weight, bias, eps)
    return _Norm.apply(x, weight, bias, eps, False)
