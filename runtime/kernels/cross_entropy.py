"""Vocabulary-parallel softmax cross-entropy: no rank ever holds a full-vocabulary row.

Rank r holds logits z (N, V_r) for the vocabulary slice [start_r, start_r + V_r) and all N targets.
Token n's loss is lse_n - z_n,y_n with lse the log-sum-exp over the whole vocabulary:

    phase 1 (kernel, per rank)    m_r = max_v z_v,  s_r = sum_v exp(z_v - m_r),
                                  zy_r = z_y if start_r <= y < start_r + V_r else 0
    between (two all-reduces)     M = max_r m_r;  (S, zy) = sum_r (s_r * exp(m_r - M), zy_r)
    phase 2 (per token, in torch) lse = M + log S,  loss_n = lse_n - zy_n  (0 where y_n is ignored)
    backward (kernel, local)      dz_v = (exp(z_v - lse) - [start_r + v == y]) * c_n

with c_n = dloss * valid_n / count for "mean" (count = valid tokens, at least 1), dloss * valid_n
for "sum", dloss_n * valid_n for "none". Phase 2 works on (N,) vectors, too little for a kernel.
Forward saves the logits (alive anyway as the input) and lse (N,); the backward recomputes the
softmax while it writes the grad, so HBM traffic is one read in forward, one read and one write in
backward, and no (N, V_r) fp32 temporary exists. The all-reduces take a process group (NCCL or
gloo), a callable `reduce(t, op)` with op in {"max", "sum"} returning the reduced tensor, or None
for one rank. The torch reference of each phase is the CPU path; `losses.py`'s maths is the same.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import SimpleNamespace
from typing import Literal, NamedTuple, Union

import torch
import torch.distributed as dist
from torch.autograd import Function

from autoplan.runtime.kernels.dispatch import (Backend, cdiv, device_guard, next_pow2, num_warps,
                                               rows_per_program, upcast, use_triton)

IGNORE_INDEX = -100  # F.cross_entropy's default
Reduce = Callable[[torch.Tensor, str], torch.Tensor]
Group = Union["dist.ProcessGroup", Reduce, None]
Reduction = Literal["mean", "sum", "none"]


class Stats(NamedTuple):
    """Phase 1 of one rank, each (N,) fp32: local max, sum of exp(z - max), target logit or 0."""

    vmax: torch.Tensor
    sumexp: torch.Tensor
    target_logit: torch.Tensor


# ------------------------------------------------------------------ torch references (CPU path)


def stats_torch(logits: torch.Tensor, targets: torch.Tensor, vocab_start: int) -> Stats:
    """Phase 1 of logits (N, V_r) and targets (N,), in fp32 (float64 stays)."""
    z = upcast(logits)
    vmax = z.amax(dim=-1)
    sumexp = (z - vmax.unsqueeze(-1)).exp().sum(dim=-1)
    local = targets - vocab_start
    owned = (local >= 0) & (local < z.shape[-1])
    picked = z.gather(-1, local.clamp(0, z.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
    return Stats(vmax, sumexp, torch.where(owned, picked, 0.0))


def grad_torch(logits: torch.Tensor, targets: torch.Tensor, vocab_start: int, lse: torch.Tensor,
               scale: torch.Tensor) -> torch.Tensor:
    """Backward of logits (N, V_r): (softmax - onehot) * scale, in the logits' dtype."""
    z = upcast(logits)
    grad = (z - lse.unsqueeze(-1)).exp()
    local = targets - vocab_start
    owned = (local >= 0) & (local < z.shape[-1])
    grad.scatter_add_(-1, local.clamp(0, z.shape[-1] - 1).unsqueeze(-1),
                      -owned.to(grad.dtype).unsqueeze(-1))
    return (grad * scale.unsqueeze(-1)).to(logits.dtype)


# ------------------------------------------------------------------ Triton kernels


@functools.cache
def _kernels() -> SimpleNamespace:
    global tl  # jitted kernels look `tl` up among the module globals (the interpreter insists)
    import triton
    import triton.language as tl

    @triton.jit
    def ce_stats(z_ptr, t_ptr, max_ptr, sum_ptr, zy_ptr, n_rows, n_vocab, stride_z, vocab_start,
                 BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        rmask = rows < n_rows
        r = tl.minimum(rows, n_rows - 1).to(tl.int64)  # padding rows re-read the last row
        row_ptr = z_ptr + r[:, None] * stride_z
        m = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
        s = tl.zeros([BLOCK_R], dtype=tl.float32)
        for v0 in range(0, n_vocab, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V)
            z = tl.load(row_ptr + cols[None, :], mask=(cols < n_vocab)[None, :],
                        other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(z, axis=1))
            s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new[:, None]), axis=1)
            m = m_new
        local = tl.load(t_ptr + r) - vocab_start
        owned = (local >= 0) & (local < n_vocab)
        zy = tl.load(z_ptr + r * stride_z + local, mask=owned, other=0.0).to(tl.float32)
        tl.store(max_ptr + rows, m, mask=rmask)
        tl.store(sum_ptr + rows, s, mask=rmask)
        tl.store(zy_ptr + rows, zy, mask=rmask)

    @triton.jit
    def ce_grad(z_ptr, t_ptr, lse_ptr, scale_ptr, g_ptr, n_rows, n_vocab, stride_z, stride_g,
                vocab_start, BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        rmask = rows < n_rows
        r = tl.minimum(rows, n_rows - 1).to(tl.int64)
        lse = tl.load(lse_ptr + r)[:, None]
        scale = tl.load(scale_ptr + r)[:, None]
        local = (tl.load(t_ptr + r) - vocab_start)[:, None]
        for v0 in range(0, n_vocab, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V)[None, :]
            mask = rmask[:, None] & (cols < n_vocab)
            z = tl.load(z_ptr + r[:, None] * stride_z + cols, mask=mask, other=0.0)
            p = tl.exp(z.to(tl.float32) - lse)
            p = tl.where(cols == local, p - 1.0, p) * scale
            tl.store(g_ptr + r[:, None] * stride_g + cols, p.to(g_ptr.dtype.element_ty), mask=mask)

    return SimpleNamespace(ce_stats=ce_stats, ce_grad=ce_grad)


def config(rows: int, vocab: int, cuda: bool) -> dict[str, int]:
    """Launch parameters of both kernels: one token per program and 4096-wide vocab chunks on
    CUDA; 256-wide chunks in the interpreter, so small tests still loop over the slice."""
    block_v = min(next_pow2(vocab), 4096 if cuda else 256)
    block_r = rows_per_program(rows, block_v, 4096, cuda)
    return dict(BLOCK_R=block_r, BLOCK_V=block_v, num_warps=num_warps(block_r * block_v))


def stats_triton(logits: torch.Tensor, targets: torch.Tensor, vocab_start: int) -> Stats:
    rows, vocab = logits.shape
    out = torch.empty((3, rows), dtype=torch.float32, device=logits.device)
    cfg = config(rows, vocab, logits.is_cuda)
    with device_guard(logits):
        _kernels().ce_stats[(cdiv(rows, cfg["BLOCK_R"]),)](
            logits, targets, out[0], out[1], out[2], rows, vocab, logits.stride(0), vocab_start,
            **cfg)
    return Stats(*out.unbind(0))


def grad_triton(logits: torch.Tensor, targets: torch.Tensor, vocab_start: int, lse: torch.Tensor,
                scale: torch.Tensor) -> torch.Tensor:
    rows, vocab = logits.shape
    grad = torch.empty((rows, vocab), dtype=logits.dtype, device=logits.device)
    cfg = config(rows, vocab, logits.is_cuda)
    with device_guard(logits):
        _kernels().ce_grad[(cdiv(rows, cfg["BLOCK_R"]),)](
            logits, targets, lse, scale, grad, rows, vocab, logits.stride(0), grad.stride(0),
            vocab_start, **cfg)
    return grad


# ------------------------------------------------------------------ phases, autograd Function


def as_reduce(group: Group) -> Reduce:
    """The all-reduce between phases: identity for None, the callable itself, or NCCL / gloo."""
    if group is None:
        return lambda t, op: t
    if callable(group):
        return group

    def reduce(t: torch.Tensor, op: str) -> torch.Tensor:
        if dist.get_world_size(group) > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM,
                            group=group)
        return t

    return reduce


def combine_stats(stats: Stats, reduce: Reduce) -> tuple[torch.Tensor, torch.Tensor]:
    """(lse, target logit), each (N,), over the whole vocabulary from this rank's phase 1."""
    vmax = reduce(stats.vmax.clone(), "max")
    scaled = torch.stack((stats.sumexp * (stats.vmax - vmax).exp(), stats.target_logit))
    sumexp, target_logit = reduce(scaled, "sum").unbind(0)
    return vmax + sumexp.log(), target_logit


def token_losses(lse: torch.Tensor, target_logit: torch.Tensor, valid: torch.Tensor
                 ) -> torch.Tensor:
    """Phase 2: per-token loss (N,), 0 where the target is ignored."""
    return torch.where(valid, lse - target_logit, 0.0)


def _grad_scale(dloss: torch.Tensor, valid: torch.Tensor, reduction: Reduction) -> torch.Tensor:
    """c_n of the module docstring, (N,) fp32."""
    dloss, valid = upcast(dloss), valid.to(upcast(dloss).dtype)
    if reduction == "none":
        return dloss.reshape(-1) * valid
    if reduction == "mean":
        return dloss * valid / valid.sum().clamp(min=1.0)
    return dloss * valid


class _VocabParallelCrossEntropy(Function):
    @staticmethod
    def forward(ctx, logits, targets, vocab_start, reduce, ignore_index, reduction, triton):
        z = logits.reshape(-1, logits.shape[-1])
        z = z if z.stride(-1) == 1 else z.contiguous()
        t = targets.reshape(-1).long().contiguous()  # int64: torch's gather wants it
        stats = (stats_triton if triton else stats_torch)(z, t, vocab_start)
        lse, target_logit = combine_stats(stats, reduce)
        valid = t != ignore_index
        losses = token_losses(lse, target_logit, valid)
        ctx.save_for_backward(z, t, lse, valid)
        ctx.config = vocab_start, reduction, triton, logits.shape
        if reduction == "none":
            return losses.view(targets.shape)
        total = losses.sum()
        return total / valid.sum().clamp(min=1) if reduction == "mean" else total

    @staticmethod
    def backward(ctx, dloss):
        z, t, lse, valid = ctx.saved_tensors
        vocab_start, reduction, triton, shape = ctx.config
        scale = _grad_scale(dloss, valid, reduction)
        grad = (grad_triton if triton else grad_torch)(z, t, vocab_start, lse, scale)
        return grad.view(shape), None, None, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, vocab_start: int = 0,
                                 group: Group = None, ignore_index: int = IGNORE_INDEX,
                                 reduction: Reduction = "mean", backend: Backend = "auto"
                                 ) -> torch.Tensor:
    """Cross-entropy of this rank's logits (..., V_r) for vocabulary [vocab_start, vocab_start +
    V_r) against targets (...) of global ids; every rank of `group` calls it with its own slice.
    Returns an fp32 scalar ("mean", "sum") or per-token losses shaped like targets ("none")."""
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"vocab_parallel_cross_entropy: logits {tuple(logits.shape)} must be "
                         f"targets' shape {tuple(targets.shape)} plus a vocabulary dim")
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction {reduction!r} is not one of 'mean', 'sum', 'none'")
    triton = logits.numel() > 0 and use_triton(logits.device, backend)
    return _VocabParallelCrossEntropy.apply(logits, targets, vocab_start, as_reduce(group),
                                            ignore_index, reduction, triton)


def cross_entropy_stats(logits: torch.Tensor, targets: torch.Tensor, vocab_start: int,
                        backend: Backend = "auto") -> Stats:
    """Phase 1 alone, for callers that schedule the all-reduces themselves: logits (N, V_r)."""
    use = logits.numel() > 0 and use_triton(logits.device, backend)
    z = logits if logits.stride(-1) == 1 else logits.contiguous()
    return (stats_triton if use else stats_torch)(z, targets.long().contiguous(), vocab_start)


def cross_entropy_grad(logits: torch.Tensor, targets: torch.Tensor, vocab_start: int,
                       lse: torch.Tensor, scale: torch.Tensor, backend: Backend = "auto"
                       ) -> torch.Tensor:
    """The backward alone: (softmax - onehot) * scale for logits (N, V_r), lse and scale (N,)."""
    use = logits.numel() > 0 and use_triton(logits.device, backend)
    z = logits if logits.stride(-1) == 1 else logits.contiguous()
    if not use:
        return grad_torch(z, targets.long(), vocab_start, lse, scale)
    return grad_triton(z, targets.long().contiguous(), vocab_start, lse.float().contiguous(),
                       scale.float().contiguous())
