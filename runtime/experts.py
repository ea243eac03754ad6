"""MoE experts on this rank: the local loop, and expert parallelism (tokens routed to the ranks that
hold their experts and back, none dropped), through the permute / unpermute kernels of
runtime.kernels.moe_permute and the fused silu * mul of runtime.kernels.activations.

Local (`local_experts_ffn`): x (N, h) routed to top_idx (N, k) with gate weights w (N, k):

    r      = moe_routing(top_idx, E)      the N k (token, slot) assignments, sorted by expert (stable)
    xp     = moe_permute(x, r)            (N k, h): expert e owns a contiguous run of rows
    yp     = swiglu of each run with its expert's weights     (`grouped_swiglu`)
    out_t  = sum_j w_tj * yp[pos(t, j)]   moe_unpermute(yp, w, r), summed in fp32

Expert parallel (`expert_parallel_ffn`), n = ep ranks, E_l = E / n experts per rank (rank r holds
[r E_l, (r+1) E_l)):

    send   = moe_permute(x, r) with r over all E experts        (N k, h) in expert order
    counts = tokens per expert (E,), sent as an (n, E_l) matrix: rank r learns from each source
             rank s how many rows it will receive for each of its experts     (all-to-all, ints)
    recv   = all_to_all(send, rows per destination rank)         (dispatch; by source, then expert)
    g      = moe_permute(recv, r') with r' = the k = 1 routing of recv's rows by local expert
    y      = grouped_swiglu(g), put back in recv's order by the inverse permutation of r'
    back   = all_to_all(y, the reverse row counts)                (combine; in send's order)
    out_t  = moe_unpermute(back, w, r)

Expert tensor parallelism 1 < etp < tp (`etp_group`, the expert_tp group of runtime.groups: the
etp ranks holding the same experts, each 1/etp of every expert's FFN, w_gate / w_up (E_l, h, f/etp),
w_down (E_l, f/etp, h)). Between the dispatch and the combine:

    all    = all_gather over etp of recv (and of recv_counts, to know every peer's rows)
    g      = all's rows grouped by local expert;  y = grouped_swiglu(g) on this FFN shard (partial)
    mine   = reduce_scatter (sum) over etp of y, back in all's order: each peer gets its own rows

so every peer computes its FFN shard for the tokens of all etp peers; the sum of the partial outputs
over the etp FFN shards is the whole SwiGLU. Uneven row counts: each peer's rows are padded to the largest
(`collectives.gather_rows_uneven`); the backward of the gather is the reduce-scatter and vice versa,
so the expert weights' grads come from every token routed to them and need no further reduction.

Both data all-to-alls are autograd-aware (`all_to_all_uneven`: backward sends the grads back along
the same rows), so the expert weights' grads come from every rank's tokens and the tokens' grads
return to their ranks. Splits are uneven and carry every token: there is no capacity limit.

`backend` is `plan.kernels` ("auto": Triton on CUDA, torch on CPU; `kernels.dispatch.use_triton`);
the torch path is the kernels' torch references, which compute the same values (bitwise in fp32
for k <= 2; for k > 2 the weighted sum runs over slots instead of experts, a reassociation). Every
local expert runs, on zero rows if none reach it, so the autograd graph (and the order of the
collectives in backward) is the same on every rank whatever the routing.
"""

from __future__ import annotations

import torch

from autoplan.runtime.collectives import (all_gather_dim, all_to_all_uneven, exchange,
                                          gather_rows_uneven, group_size,
                                          reduce_scatter_rows_uneven)
from autoplan.runtime.kernels import Routing, moe_permute, moe_routing, moe_unpermute, silu_mul


def expert_swiglu(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
                  backend: str = "auto") -> torch.Tensor:
    """(silu(x @ w_gate) * (x @ w_up)) @ w_down for one expert's rows x (M, h), the activation by
    `kernels.silu_mul` (the kernel, or its torch path): the values of `layers.swiglu`, keeping the
    gate and up projections and their product for backward, not silu's output too."""
    return silu_mul(x @ w_gate, x @ w_up, backend=backend) @ w_down


def grouped_swiglu(rows: torch.Tensor, counts: torch.Tensor, w_gate: torch.Tensor,
                   w_up: torch.Tensor, w_down: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """rows (M, h) grouped by expert, counts[e] of them for expert e (E,): each run through its
    expert's SwiGLU (E = w_gate.shape[0]; every expert runs, on zero rows too); (M, h). Under
    autocast the rows are cast once here, not by each of the gate and up GEMMs."""
    if torch.is_autocast_enabled(rows.device.type) and rows.is_floating_point():
        rows = rows.to(torch.get_autocast_dtype(rows.device.type))
    runs = rows.split(counts.tolist())
    return torch.cat([expert_swiglu(run, w_gate[e], w_up[e], w_down[e], backend)
                      for e, run in enumerate(runs)])


def local_experts_ffn(x: torch.Tensor, top_idx: torch.Tensor, weights: torch.Tensor,
                      w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
                      backend: str = "auto") -> torch.Tensor:
    """sum_j weights[:, j] * swiglu_{top_idx[:, j]}(x) for x (N, h), every expert on this rank
    (module docstring); returns (N, h)."""
    routing = moe_routing(top_idx, w_gate.shape[0])
    xp = moe_permute(x, routing, backend)  # (N k, h) grouped by expert
    yp = grouped_swiglu(xp, routing.tokens_per_expert, w_gate, w_up, w_down, backend)
    return moe_unpermute(yp, weights, routing, backend)


def _inverse(routing: Routing, segments: torch.Tensor) -> Routing:
    """The k = 1 routing that undoes `routing` (k = 1): moe_permute(moe_permute(y, routing), inverse)
    == y. Its rows fall into the `segments` runs (counts) of the original order."""
    pos = routing.pos.reshape(-1)
    return Routing(token=pos, order=pos, pos=routing.order.view(-1, 1), tokens_per_expert=segments)


def expert_parallel_ffn(x: torch.Tensor, top_idx: torch.Tensor, weights: torch.Tensor,
                        w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
                        group, backend: str = "auto", etp_group=None) -> torch.Tensor:
    """sum_j weights[:, j] * swiglu_{top_idx[:, j]}(x) for x (N, h) with E_l local experts of
    E_l * n over the n ranks of `group`, each expert's FFN split over `etp_group` when given
    (module docstring); returns (N, h)."""
    n, local = group_size(group), w_gate.shape[0]
    routing = moe_routing(top_idx, local * n)
    send = moe_permute(x, routing, backend)  # (N k, h) in expert order
    counts = routing.tokens_per_expert.view(n, local)  # (n, E_l) to each rank
    recv_counts = exchange(counts, group)  # (n, E_l): from each source rank, per local expert
    send_rows, recv_rows = counts.sum(1).tolist(), recv_counts.sum(1).tolist()
    received = all_to_all_uneven(send, send_rows, recv_rows, group)  # (M, h) by source, expert
    y_received = _local_experts(received, recv_counts, (w_gate, w_up, w_down), backend, etp_group)
    back = all_to_all_uneven(y_received, recv_rows, send_rows, group)  # (N k, h) expert order
    return moe_unpermute(back, weights, routing, backend)


def _local_experts(received: torch.Tensor, recv_counts: torch.Tensor, experts: tuple,
                   backend: str, etp_group=None) -> torch.Tensor:
    """The SwiGLU outputs of the dispatched rows `received` (M, h), laid out by source rank then
    local expert with `recv_counts` (n, E_l) of them, in the same order. With `etp_group` the rows
    of every etp peer join (all-gather), this rank's FFN shard runs on all of them, and the summed
    partial outputs return to their peers (reduce-scatter)."""
    gathered = etp_group is not None and group_size(etp_group) > 1
    if gathered:
        peer_counts = all_gather_dim(recv_counts, 0, etp_group)  # (etp n, E_l): every peer's rows
        rows = [int(c.sum()) for c in peer_counts.chunk(group_size(etp_group))]
        received, recv_counts = gather_rows_uneven(received, rows, etp_group), peer_counts
    local = recv_counts.shape[1]
    local_expert = torch.arange(local, device=recv_counts.device).repeat(recv_counts.shape[0])
    local_expert = local_expert.repeat_interleave(recv_counts.reshape(-1))  # (M,)
    regroup = moe_routing(local_expert.unsqueeze(1), local)  # k = 1: rows by local expert
    grouped = moe_permute(received, regroup, backend)  # (M, h) grouped by local expert
    outputs = grouped_swiglu(grouped, regroup.tokens_per_expert, *experts, backend)
    y = moe_permute(outputs, _inverse(regroup, recv_counts.reshape(-1)), backend)
    if gathered:  # partial sums over the FFN shards, back to the peers whose rows they are
        y = reduce_scatter_rows_uneven(y, rows, etp_group)
    return y
