"""Tensor-parallel modules: what a `call_module` node becomes under a non-replicated strategy.

Every module keeps the parameter names of the module it replaces (`weight`, `bias`, `w_gate`,
`router.weight`, ...) with LOCAL shapes, so a rank's parameters are named as in the user's model.
`group` is the tensor-parallel process group; shapes use B batch, T sequence, h hidden, V vocab.

    RowParallelLinear       x (B, T, in/tp), W (out, in/tp) -> all-reduce (row) or reduce-scatter
                            along T (row_sp) of x W^T, then + b (b's grad summed over tp for row_sp)
    VocabParallelEmbedding  W (V/tp, h): look up the ids this rank owns, zero the rest, all-reduce
                            (vocab) or reduce-scatter along T (vocab_sp)
    GradSummed              any module run on a sequence shard with replicated parameters, each
                            wrapped in copy-to-region so its grad is summed over tp
    ParallelMoE             "ffn": experts split on the FFN dim, router replicated, experts' input
                            and gate weights wrapped in copy-to-region, output all-reduced;
                            "sequence": every weight wrapped in copy-to-region, local tokens only;
                            "expert" (etp < tp): local tokens, E/(ep tp/etp) experts here, each
                            1/etp of its FFN, the router wrapped in copy-to-region;
                            with an expert group, E/n experts here and tokens dispatched to them
    VocabParallelLoss       the kernel of runtime.kernels.cross_entropy on backend `plan.kernels`
    SequenceParallelLoss    see runtime.losses
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from autoplan.models.config import expert_capacity
from autoplan.runtime.collectives import (all_reduce, copy_to_region, group_size,
                                          reduce_from_region, reduce_scatter_along)
from autoplan.runtime.experts import expert_parallel_ffn, local_experts_ffn
from autoplan.runtime.kernels import vocab_parallel_cross_entropy
from autoplan.runtime.losses import sequence_parallel_cross_entropy


def _meta_param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, device="meta"))


def _reduce(y: torch.Tensor, group, scatter_dim: int | None) -> torch.Tensor:
    """Sum partial results over tp: all-reduce, or reduce-scatter along `scatter_dim`."""
    if scatter_dim is None:
        return reduce_from_region(y, group)
    return reduce_scatter_along(y, scatter_dim, group)


class RowParallelLinear(nn.Module):
    """y = reduce_tp(x_r W_r^T) + b; x (B, T, in/tp) -> (B, T, out) or (B, T/tp, out) for row_sp."""

    def __init__(self, in_local: int, out_features: int, bias: bool, group,
                 scatter_dim: int | None) -> None:
        super().__init__()
        self.weight = _meta_param(out_features, in_local)
        self.bias = _meta_param(out_features) if bias else None
        self.group, self.scatter_dim = group, scatter_dim

    def extra_repr(self) -> str:
        out, inp = self.weight.shape
        mode = "all-reduce" if self.scatter_dim is None else f"reduce-scatter dim {self.scatter_dim}"
        return f"in_local={inp}, out={out}, bias={self.bias is not None}, {mode}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _reduce(F.linear(x, self.weight), self.group, self.scatter_dim)
        if self.bias is None:
            return y
        # after a reduce-scatter the bias meets only this rank's tokens: its grad is partial
        bias = self.bias if self.scatter_dim is None else copy_to_region(self.bias, self.group)
        return y + bias


class VocabParallelEmbedding(nn.Module):
    """Rows [vocab_start, vocab_start + V/tp) of the table; ids (B, T) -> (B, T, h) summed over tp."""

    def __init__(self, vocab_local: int, hidden: int, vocab_start: int, group,
                 scatter_dim: int | None) -> None:
        super().__init__()
        self.weight = _meta_param(vocab_local, hidden)
        self.vocab_start, self.group, self.scatter_dim = vocab_start, group, scatter_dim

    def extra_repr(self) -> str:
        rows, hidden = self.weight.shape
        return f"rows=[{self.vocab_start}, {self.vocab_start + rows}), hidden={hidden}"

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])  # (B, T): owned by another rank
        y = F.embedding(local.masked_fill(outside, 0), self.weight)  # (B, T, h)
        y = y.masked_fill(outside.unsqueeze(-1), 0.0)
        return _reduce(y, self.group, self.scatter_dim)


class GradSummed(nn.Module):
    """Runs `module` unchanged on a shard of the tokens, its replicated parameters wrapped in
    copy-to-region (identity forward, all-reduce of the grad backward).

    The wrapped module's parameters and children are registered on this wrapper under their own
    names (so `layers.0.ln_1.weight` stays `layers.0.ln_1.weight`); the module itself is kept
    outside the module tree and called through `torch.func.functional_call`."""

    def __init__(self, module: nn.Module, group) -> None:
        super().__init__()
        object.__setattr__(self, "inner", module)
        for name, child in module.named_children():
            self.add_module(name, child)
        for name, param in module.named_parameters(recurse=False):
            self.register_parameter(name, param)
        self.group = group

    def extra_repr(self) -> str:
        return f"{type(self.inner).__name__}, grads summed over tp"

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        params = {n: copy_to_region(p, self.group) for n, p in self.named_parameters()}
        return torch.func.functional_call(self.inner, params, args)


class ParallelMoE(nn.Module):
    """Mixture of SwiGLU experts with the same maths as `MoEFeedForward`, run per strategy.

    mode "ffn": w_gate, w_up (E, h, f/tp), w_down (E, f/tp, h); out = all_reduce(sum_j w_j *
    swiglu_local(x)). The gate weights w_j and the experts' x see partial grads, so both pass
    through copy-to-region; the router runs replicated and its grads are already whole.
    mode "sequence": full weights, each through copy-to-region, on this rank's tokens.
    mode "replicate": full weights on every tp rank (only with expert parallelism).
    mode "expert" (etp < tp, MoE parallel folding): this rank's 1/tp of the tokens (split along
    the sequence), experts spread over the expert group ep x tp / etp, each expert's FFN split over
    `etp_group` (w_gate, w_up (E_l, h, f/etp), w_down (E_l, f/etp, h); whole experts when etp = 1);
    only the router passes through copy-to-region (it sees this rank's tokens), the experts' grads
    are whole already: the all-to-alls (and the etp all-gather) bring them every token routed to them.
    With `ep_group` (the expert group: ep ranks, or ep x tp in mode "expert") this rank holds
    E/n of its n ranks' experts and every routed token travels to its expert's rank and back
    (runtime.experts); the router stays whole.
    Every expert runs even on zero tokens, so the autograd graph (and the order of the collectives
    in backward) is the same on every rank whatever the routing."""

    def __init__(self, hidden: int, ffn_local: int, experts: int, top_k: int, group,
                 mode: str, ep_group=None, etp_group=None, capacity_factor: float = 0.0) -> None:
        super().__init__()
        self.top_k, self.group, self.mode, self.ep_group = top_k, group, mode, ep_group
        self.capacity_factor = capacity_factor  # 0: dropless; else `config.expert_capacity` per sequence slice
        self.etp_group = etp_group  # the expert_tp group under 1 < etp < tp, else None
        self.kernels = "auto"  # plan.kernels for the permute / silu * mul kernels (runtime.rewrite)
        self.ep = ep = group_size(ep_group) if ep_group is not None else 1
        self.router = nn.Linear(hidden, experts * ep, bias=False, device="meta")
        self.w_gate = _meta_param(experts, hidden, ffn_local)
        self.w_up = _meta_param(experts, hidden, ffn_local)
        self.w_down = _meta_param(experts, ffn_local, hidden)

    def capacity(self, group_tokens: int) -> int:
        """C per expert of a group of `group_tokens` tokens over all E experts (0: dropless)."""
        experts = self.w_gate.shape[0] * self.ep
        return expert_capacity(self.capacity_factor, group_tokens, self.top_k, experts) if self.capacity_factor else 0

    def extra_repr(self) -> str:
        experts, hidden, ffn = self.w_gate.shape
        ep = self.ep
        return (f"hidden={hidden}, ffn_local={ffn}, experts={experts}"
                f"{f' of {experts * ep} (ep={ep})' if ep > 1 else ''}, top_k={self.top_k}, "
                f"{self.mode}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_meta:  # shape inference: routing is data-dependent, the shape is not
            return torch.empty_like(x)
        g, seq, ffn = self.group, self.mode == "sequence", self.mode == "ffn"
        local_tokens = seq or self.mode == "expert"  # this rank's tokens only: partial router grads
        router_w = copy_to_region(self.router.weight, g) if local_tokens else self.router.weight
        wrap = (lambda t: copy_to_region(t, g)) if seq else (lambda t: t)
        w_gate, w_up, w_down = (wrap(p) for p in (self.w_gate, self.w_up, self.w_down))
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # (N, h)
        top_logits, top_idx = F.linear(flat, router_w).topk(self.top_k, dim=-1)  # (N, k)
        weights = F.softmax(top_logits.float(), dim=-1).to(x.dtype)  # (N, k)
        expert_in = flat
        if ffn:  # partial grads from the FFN shards: sum them over tp in backward
            weights, expert_in = copy_to_region(weights, g), copy_to_region(flat, g)
        limit = (self.capacity(shape[-2]), shape[-2])  # each sequence (slice) on this rank is a group
        if self.ep > 1:
            out = expert_parallel_ffn(expert_in, top_idx, weights, w_gate, w_up, w_down,
                                      self.ep_group, self.kernels, self.etp_group, *limit)
        else:
            out = local_experts_ffn(expert_in, top_idx, weights, w_gate, w_up, w_down,
                                    self.kernels, *limit)
        if ffn:
            return reduce_from_region(out.view(shape), g)
        return out.view(shape)


class VocabParallelLoss(nn.Module):
    """Mean token cross-entropy of logits split on the vocabulary (B, T, V/tp) vs targets (B, T),
    by the kernel of runtime.kernels.cross_entropy on backend `kernels` (torch on meta)."""

    def __init__(self, vocab_start: int, group, kernels: str = "auto") -> None:
        super().__init__()
        self.vocab_start, self.group, self.kernels = vocab_start, group, kernels

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        backend = "torch" if logits.is_meta else self.kernels
        return vocab_parallel_cross_entropy(logits, targets, self.vocab_start, self._reduce,
                                            backend=backend)

    def _reduce(self, t: torch.Tensor, op: str) -> torch.Tensor:
        """The all-reduces between the kernel's phases, through runtime.collectives (counted)."""
        return all_reduce(t, self.group, dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)


class SequenceParallelLoss(nn.Module):
    """Mean token cross-entropy of logits (B, T/tp, V) and targets (B, T/tp) split on T."""

    def __init__(self, group) -> None:
        super().__init__()
        self.group = group

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return sequence_parallel_cross_entropy(logits, targets, self.group)
