"""MoE token permute / unpermute: group the top_k copies of each token by expert, and back.

Tokens x (N, h) routed to experts e (N, k) become N*k rows sorted by expert id (stably, so each
expert sees its tokens in token order, as `MoEFeedForward`'s loop over `torch.where` does):

    routing       order = argsort(e.flatten(), stable)  the (token, slot) pair i = n*k + j of each
                                                         sorted row p;  token[p] = order[p] // k
                  pos[n, j] = p where order[p] = n*k + j;  tokens_per_expert[E] = bincount(e)
    permute       xp[p] = x[token[p]]                    (N*k, h); expert e owns a contiguous run
        backward  dx[n] = sum_j dxp[pos[n, j]]
    unpermute     out[n] = sum_j w[n, j] * y[pos[n, j]]  (N, h), fp32 sums, w the routing weights
        backward  dy[pos[n, j]] = w[n, j] * dout[n],  dw[n, j] = <dout[n], y[pos[n, j]]>

Each output row is written by exactly one program, so there are no atomics and the results do
not depend on scheduling. `tokens_per_expert` gives the split sizes of an expert-parallel
all-to-all. `moe_combine` is the unpermute's sum over rows in any layout: runtime.experts uses it
for the padded buffers of an expert capacity, whose dropped pairs read a zero row.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from torch.autograd import Function

from autoplan.runtime.kernels.dispatch import (Backend, cdiv, device_guard, next_pow2, num_warps,
                                               rows_per_program, upcast, use_triton)

_TILE_ELEMS = 4096


@dataclass(frozen=True)
class Routing:
    """Where each of the N*k (token, slot) copies goes; all int64, on the tokens' device."""

    token: torch.Tensor  # (N*k,) source token of each sorted row
    order: torch.Tensor  # (N*k,) pair index n*k + j of each sorted row
    pos: torch.Tensor  # (N, k) sorted row of each pair
    tokens_per_expert: torch.Tensor  # (E,)


def moe_routing(expert_idx: torch.Tensor, num_experts: int) -> Routing:
    """The routing of expert ids (N, k), e.g. the indices of `router_logits.topk(k)`."""
    if expert_idx.dim() != 2:
        raise ValueError(f"moe_routing: expert ids {tuple(expert_idx.shape)} must be (N, k)")
    flat = expert_idx.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    pos = torch.empty_like(order)
    pos[order] = torch.arange(order.numel(), device=order.device)
    return Routing(token=order // expert_idx.shape[1], order=order,
                   pos=pos.view(expert_idx.shape),
                   tokens_per_expert=torch.bincount(flat, minlength=num_experts))


# ------------------------------------------------------------------ torch references (CPU path)


def permute_torch(x: torch.Tensor, routing: Routing) -> torch.Tensor:
    """x (N, h) -> (N*k, h) in expert order."""
    return x.index_select(0, routing.token)


def unpermute_torch(y: torch.Tensor, weights: torch.Tensor, routing: Routing) -> torch.Tensor:
    """y (N*k, h) in expert order, weights (N, k) -> (N, h), summed in fp32."""
    return combine_torch(y, weights, routing.pos)


def combine_torch(y: torch.Tensor, weights: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """out[n] = sum_j w[n, j] * y[pos[n, j]] for y (M, h), weights and pos (N, k): (N, h), fp32 sums."""
    rows = upcast(y[pos])  # (N, k, h)
    return (rows * upcast(weights).unsqueeze(-1)).sum(dim=1).to(y.dtype)


# ------------------------------------------------------------------ Triton kernels


@functools.cache
def _kernels() -> SimpleNamespace:
    global tl  # jitted kernels look `tl` up among the module globals (the interpreter insists)
    import triton
    import triton.language as tl

    @triton.jit
    def gather_rows(src_ptr, idx_ptr, dst_ptr, n_rows, n_cols, stride_src, stride_dst,
                    BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = (tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H))[None, :]
        rmask = rows < n_rows
        mask = rmask[:, None] & (cols < n_cols)
        src = tl.load(idx_ptr + rows, mask=rmask, other=0).to(tl.int64)[:, None]
        v = tl.load(src_ptr + src * stride_src + cols, mask=mask)
        tl.store(dst_ptr + rows.to(tl.int64)[:, None] * stride_dst + cols, v, mask=mask)

    @triton.jit
    def combine_rows(src_ptr, pos_ptr, w_ptr, dst_ptr, n_tokens, k, n_cols, stride_src,
                     stride_dst, HAS_W: tl.constexpr, BLOCK_R: tl.constexpr,
                     BLOCK_H: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = (tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H))[None, :]
        rmask = rows < n_tokens
        mask = rmask[:, None] & (cols < n_cols)
        r = rows.to(tl.int64)
        acc = tl.zeros([BLOCK_R, BLOCK_H], dtype=tl.float32)
        for j in range(k):
            p = tl.load(pos_ptr + r * k + j, mask=rmask, other=0)[:, None]
            v = tl.load(src_ptr + p * stride_src + cols, mask=mask, other=0.0).to(tl.float32)
            if HAS_W:
                v *= tl.load(w_ptr + r * k + j, mask=rmask, other=0.0).to(tl.float32)[:, None]
            acc += v
        tl.store(dst_ptr + r[:, None] * stride_dst + cols, acc.to(dst_ptr.dtype.element_ty),
                 mask=mask)

    @triton.jit
    def unpermute_bwd(g_ptr, y_ptr, pos_ptr, w_ptr, dy_ptr, dw_ptr, n_tokens, k, n_cols,
                      stride_g, stride_y, stride_dy, BLOCK_R: tl.constexpr,
                      BLOCK_H: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        rmask = rows < n_tokens
        r = rows.to(tl.int64)
        for j in range(k):
            p = tl.load(pos_ptr + r * k + j, mask=rmask, other=0)[:, None]
            w = tl.load(w_ptr + r * k + j, mask=rmask, other=0.0).to(tl.float32)[:, None]
            dot = tl.zeros([BLOCK_R], dtype=tl.float32)
            for h0 in range(0, n_cols, BLOCK_H):
                cols = (h0 + tl.arange(0, BLOCK_H))[None, :]
                mask = rmask[:, None] & (cols < n_cols)
                g = tl.load(g_ptr + r[:, None] * stride_g + cols, mask=mask, other=0.0)
                g = g.to(tl.float32)
                y = tl.load(y_ptr + p * stride_y + cols, mask=mask, other=0.0).to(tl.float32)
                dot += tl.sum(g * y, axis=1)
                tl.store(dy_ptr + p * stride_dy + cols, (w * g).to(dy_ptr.dtype.element_ty),
                         mask=mask)
            tl.store(dw_ptr + r * k + j, dot, mask=rmask)

    return SimpleNamespace(gather_rows=gather_rows, combine_rows=combine_rows,
                           unpermute_bwd=unpermute_bwd)


def config(rows: int, hidden: int, cuda: bool) -> dict[str, int]:
    """Launch parameters of the three kernels: (BLOCK_R rows, BLOCK_H columns) tiles."""
    block_h = min(next_pow2(hidden), 2048 if cuda else 256)
    block_r = rows_per_program(rows, block_h, _TILE_ELEMS, cuda)
    return dict(BLOCK_R=block_r, BLOCK_H=block_h, num_warps=num_warps(block_r * block_h))


def _unit_cols(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _gather(src: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    rows, hidden = idx.numel(), src.shape[1]
    dst = torch.empty((rows, hidden), dtype=src.dtype, device=src.device)
    cfg = config(rows, hidden, src.is_cuda)
    with device_guard(src):
        _kernels().gather_rows[(cdiv(rows, cfg["BLOCK_R"]), cdiv(hidden, cfg["BLOCK_H"]))](
            src, idx, dst, rows, hidden, src.stride(0), dst.stride(0), **cfg)
    return dst


def _combine(src: torch.Tensor, pos: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    (tokens, k), hidden = pos.shape, src.shape[1]
    dst = torch.empty((tokens, hidden), dtype=src.dtype, device=src.device)
    cfg = config(tokens, hidden, src.is_cuda)
    with device_guard(src):
        _kernels().combine_rows[(cdiv(tokens, cfg["BLOCK_R"]), cdiv(hidden, cfg["BLOCK_H"]))](
            src, pos, pos if weights is None else weights, dst, tokens, k, hidden, src.stride(0),
            dst.stride(0), HAS_W=weights is not None, **cfg)
    return dst


class _Permute(Function):
    @staticmethod
    def forward(ctx, x, token, pos):
        ctx.save_for_backward(pos)
        return _gather(_unit_cols(x), token)

    @staticmethod
    def backward(ctx, dxp):
        (pos,) = ctx.saved_tensors
        return _combine(_unit_cols(dxp), pos, None), None, None


class _Unpermute(Function):
    @staticmethod
    def forward(ctx, y, weights, pos):
        y, weights = _unit_cols(y), weights.contiguous()
        ctx.save_for_backward(y, weights, pos)
        return _combine(y, pos, weights)

    @staticmethod
    def backward(ctx, dout):
        y, weights, pos = ctx.saved_tensors
        g = _unit_cols(dout)
        (tokens, k), hidden = pos.shape, y.shape[1]
        # every row of a permutation is some pair's; a padded buffer's (runtime.experts) may be no pair's: 0
        fill = torch.empty_like if y.shape[0] == tokens * k else torch.zeros_like
        dy = fill(y, memory_format=torch.contiguous_format)
        dw = torch.empty((tokens, k), dtype=torch.float32, device=y.device)
        cfg = config(tokens, hidden, y.is_cuda)
        with device_guard(y):
            _kernels().unpermute_bwd[(cdiv(tokens, cfg["BLOCK_R"]),)](
                g, y, pos, weights, dy, dw, tokens, k, hidden, g.stride(0), y.stride(0),
                dy.stride(0), **cfg)
        return dy, dw.to(weights.dtype), None


def moe_permute(x: torch.Tensor, routing: Routing, backend: Backend = "auto") -> torch.Tensor:
    """x (N, h) -> (N*k, h): token copies grouped by expert; differentiable in x."""
    if x.dim() != 2 or x.shape[0] != routing.pos.shape[0]:
        raise ValueError(f"moe_permute: x {tuple(x.shape)} must be (N, h) with N = "
                         f"{routing.pos.shape[0]} tokens of the routing")
    if x.numel() == 0 or not use_triton(x.device, backend):
        return permute_torch(x, routing)
    return _Permute.apply(x, routing.token, routing.pos)


def moe_unpermute(y: torch.Tensor, weights: torch.Tensor, routing: Routing,
                  backend: Backend = "auto") -> torch.Tensor:
    """y (N*k, h) in expert order, weights (N, k) -> (N, h) = sum_j w[n, j] * y[pos[n, j]];
    differentiable in y and in the weights (so the router trains)."""
    if y.dim() != 2 or y.shape[0] != routing.token.numel() or weights.shape != routing.pos.shape:
        raise ValueError(f"moe_unpermute: y {tuple(y.shape)} must be (N*k, h) with N*k = "
                         f"{routing.token.numel()}, weights {tuple(weights.shape)} must be "
                         f"{tuple(routing.pos.shape)}")
    return moe_combine(y, weights, routing.pos, backend)


def moe_combine(y: torch.Tensor, weights: torch.Tensor, pos: torch.Tensor,
                backend: Backend = "auto") -> torch.Tensor:
    """out[n] = sum_j w[n, j] * y[pos[n, j]] for rows y (M, h) in any layout (`moe_unpermute`'s sum;
    the padded buffers of an expert capacity, runtime.experts); differentiable in y and the weights."""
    if y.numel() == 0 or not use_triton(y.device, backend):
        return combine_torch(y, weights, pos)
    return _Unpermute.apply(y, weights, pos)
