"""Tensor-parallel cross-entropy, equal to `LMLoss` (mean over the tokens whose target is not
`ignore_index`, computed in fp32).

Vocabulary-parallel (logits (B, T, V/tp), rank r owning columns [start, start + V/tp)):

    m_t   = all_reduce_max(max_v z_tv)                      z: this rank's logits
    s_t   = all_reduce_sum(sum_v exp(z_tv - m_t))
    zy_t  = all_reduce_sum(z_t,y_t - m_t if this rank owns y_t else 0)   (one all-reduce with s_t)
    loss  = sum_t valid_t (log s_t - zy_t) / sum_t valid_t
    dz_tv = dloss * valid_t (exp(z_tv - m_t) / s_t - [v == y_t]) / sum_t valid_t     (local only)

No rank ever holds a full-vocabulary row. Sequence-parallel (logits (B, T/tp, V)): each rank sums
its tokens' losses; one all-reduce of (sum, count) gives the mean, and the grad of the sum is local.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.autograd import Function

from autoplan.runtime.collectives import all_reduce, reduce_from_region

IGNORE_INDEX = -100  # F.cross_entropy's default, which LMLoss uses


class _VocabParallelCrossEntropy(Function):
    @staticmethod
    def forward(ctx, logits, targets, vocab_start, group, ignore_index):
        z = logits.float()  # (B, T, V/tp)
        vmax = all_reduce(z.amax(dim=-1), group, dist.ReduceOp.MAX)  # (B, T)
        exp = (z - vmax.unsqueeze(-1)).exp_()  # (B, T, V/tp)
        local_t = targets - vocab_start
        owned = (local_t >= 0) & (local_t < z.shape[-1])  # (B, T)
        safe = local_t.masked_fill(~owned, 0)
        picked = z.gather(-1, safe.unsqueeze(-1)).squeeze(-1) - vmax
        stats = all_reduce(torch.stack((exp.sum(dim=-1), picked.masked_fill(~owned, 0.0))), group)
        sum_exp, target_logit = stats.unbind(0)  # (B, T) each
        valid = targets != ignore_index
        count = valid.sum().clamp(min=1).to(z.dtype)
        loss = ((sum_exp.log() - target_logit) * valid).sum() / count
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, safe, owned & valid, valid, count)
        ctx.logits_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, dloss):
        softmax, safe, owned_valid, valid, count = ctx.saved_tensors
        grad = softmax * valid.unsqueeze(-1)  # ignored tokens get no grad
        grad.scatter_add_(-1, safe.unsqueeze(-1), -owned_valid.unsqueeze(-1).to(grad.dtype))
        grad.mul_(dloss / count)
        return grad.to(ctx.logits_dtype), None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, vocab_start: int,
                                 group, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Mean cross-entropy of vocabulary-sharded logits (B, T, V/tp) against targets (B, T)."""
    return _VocabParallelCrossEntropy.apply(logits, targets, vocab_start, group, ignore_index)


def sequence_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, group,
                                    ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Mean cross-entropy over all tp ranks' tokens of logits (B, T/tp, V), targets (B, T/tp)."""
    vocab = logits.shape[-1]
    local_sum = F.cross_entropy(logits.float().reshape(-1, vocab), targets.reshape(-1),
                                ignore_index=ignore_index, reduction="sum")
    count = (targets != ignore_index).sum().to(local_sum.dtype)
    total = reduce_from_region(torch.stack((local_sum, count)), group)  # (sum, count) over tp
    return total[0] / total[1].clamp(min=1)
