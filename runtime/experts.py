"""Expert parallelism: route every token to the ranks that hold its experts and back, none dropped.

With n = ep ranks, E experts and E_l = E / n of them on each rank (rank r holds experts
[r E_l, (r+1) E_l)), one MoE layer on this rank's N tokens x (N, h), routed to top_idx (N, k) with
gate weights w (N, k):

    a      = the N k (token, slot) assignments, sorted by expert (stable)
    counts = tokens per expert (E,), sent as an (n, E_l) matrix: rank r learns from each source
             rank s how many rows it will receive for each of its experts     (all-to-all, ints)
    recv   = all_to_all(x[token(a)], rows per destination rank)               (dispatch)
    y_recv = swiglu of each row with its expert's weights (grouped by local expert)
    back   = all_to_all(y_recv, the reverse row counts)                        (combine)
    out_t  = sum_j w_tj * back[a = (t, j)]

Both data all-to-alls are autograd-aware (`all_to_all_uneven`: backward sends the grads back along
the same rows), so the expert weights' grads come from every rank's tokens and the tokens' grads
return to their ranks. Splits are uneven and carry every token: there is no capacity limit. Every
local expert runs, on zero rows if none reach it, so the autograd graph is the same on every rank.
"""

from __future__ import annotations

import torch

from autoplan.models.layers import swiglu
from autoplan.runtime.collectives import all_to_all_uneven, exchange, group_size


def expert_parallel_ffn(x: torch.Tensor, top_idx: torch.Tensor, weights: torch.Tensor,
                        w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
                        group) -> torch.Tensor:
    """sum_j weights[:, j] * swiglu_{top_idx[:, j]}(x) for x (N, h) with E_l local experts of
    E_l * ep (module docstring); returns (N, h)."""
    n, local = group_size(group), w_gate.shape[0]
    tokens, k = top_idx.shape
    expert = top_idx.reshape(-1)  # (N k,) assignment a = t k + j -> its expert
    order = torch.argsort(expert, stable=True)  # assignments by expert, then by token
    token = torch.div(order, k, rounding_mode="floor")
    send = x.index_select(0, token)  # (N k, h) in expert order
    counts = torch.bincount(expert, minlength=local * n).view(n, local)  # (n, E_l) to each rank
    recv_counts = exchange(counts, group)  # (n, E_l): from each source rank, per local expert
    send_rows, recv_rows = counts.sum(1).tolist(), recv_counts.sum(1).tolist()
    received = all_to_all_uneven(send, send_rows, recv_rows, group)  # (M, h) by source, expert
    local_expert = torch.arange(local).repeat(n).repeat_interleave(recv_counts.reshape(-1))
    by_expert = torch.argsort(local_expert, stable=True)  # (M,) rows grouped by local expert
    grouped = received.index_select(0, by_expert).split(recv_counts.sum(0).tolist())
    outputs = torch.cat([swiglu(rows, w_gate[e], w_up[e], w_down[e])
                         for e, rows in enumerate(grouped)])  # (M, h) grouped by expert
    y_received = outputs.new_zeros(outputs.shape).index_copy(0, by_expert, outputs)
    back = all_to_all_uneven(y_received, recv_rows, send_rows, group)  # (N k, h) expert order
    y = torch.zeros_like(back).index_copy(0, order, back).view(tokens, k, -1)  # (N, k, h)
    return (y * weights.unsqueeze(-1)).sum(1)
