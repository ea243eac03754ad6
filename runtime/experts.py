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
return to their ranks. Without a capacity (`capacity` 0, dropless) splits are uneven and carry
every token, so how many rows a rank's experts receive depends on the routing.

Expert capacity C (`capacity` > 0, `models.config.expert_capacity`; GShard's padded dispatch): the
tokens are G groups of `group_tokens` (the sequences, or this rank's slices of them), and each
expert takes at most C rows of each group, the first in token order; the pairs past them are dropped
(their output row is zero, their gate weight gets no gradient). Every expert's buffer is padded to
exactly G C rows (`capacity_slots`: expert-major, then group, then slot; zero rows where fewer come):

    buf    = rows of x at slots.gather (E G C, h), zero rows for padding          (`gather_slots`)
    local  y = grouped_swiglu(buf) with G C rows per expert
    ep     every rank sends E_l G C rows to each rank and receives as many (no count exchange),
           the received rows run as above (`_local_experts`), and come back the same way
    out_n  = sum_j w_nj * y[slots.pos[n, j]], a dropped pair reading a zero row    (`moe_combine`)

so the rows a rank's experts hold are E G C whatever the routing: the bound the cost model prices.

`backend` is `plan.kernels` ("auto": Triton on CUDA, torch on CPU; `kernels.dispatch.use_triton`);
the torch path is the kernels' torch references, which compute the same values (bitwise in fp32
for k <= 2; for k > 2 the weighted sum runs over slots instead of experts, a reassociation). Every
local expert runs, on zero rows if none reach it, so the autograd graph (and the order of the
collectives in backward) is the same on every rank whatever the routing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from autoplan.runtime.collectives import (all_gather_dim, all_to_all_uneven, exchange,
                                          gather_rows_uneven, group_size,
                                          reduce_scatter_rows_uneven)
from autoplan.runtime.kernels import (Routing, moe_combine, moe_permute, moe_routing, moe_unpermute,
                                     silu_mul)


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


@dataclass(frozen=True)
class Slots:
    """A padded dispatch buffer of E experts x G groups x C rows (module docstring); int64."""

    gather: torch.Tensor  # (E G C,) the token of each buffer row; N (a zero row) where it is padding
    pos: torch.Tensor  # (N, k) the buffer row of each (token, slot) pair; E G C (a zero row) if dropped
    rows_per_expert: int  # G C


def capacity_slots(top_idx: torch.Tensor, experts: int, group_tokens: int, capacity: int) -> Slots:
    """The slots of the pairs routed to `top_idx` (N, k) over `experts`, at most `capacity` rows per
    expert of each group of `group_tokens` consecutive tokens, the first in token order."""
    tokens, k = top_idx.shape
    if group_tokens <= 0 or tokens % group_tokens:
        raise ValueError(f"capacity_slots: {tokens} tokens are not groups of {group_tokens}")
    groups = tokens // group_tokens
    flat = top_idx.reshape(-1).long()
    order = torch.argsort(flat, stable=True)  # pairs by expert, then token
    token = order // k
    key = flat[order] * groups + token // group_tokens  # (expert, group) of each sorted pair: ascending
    counts = torch.bincount(key, minlength=experts * groups)
    rank = torch.arange(key.numel(), device=key.device) - (counts.cumsum(0) - counts)[key]
    keep = rank < capacity
    row = key * capacity + rank
    size = experts * groups * capacity
    gather = torch.full((size,), tokens, dtype=torch.long, device=flat.device)
    gather[row[keep]] = token[keep]
    pos = torch.full((tokens * k,), size, dtype=torch.long, device=flat.device)
    pos[order[keep]] = row[keep]
    return Slots(gather, pos.view(tokens, k), groups * capacity)


def gather_slots(x: torch.Tensor, slots: Slots) -> torch.Tensor:
    """x (N, h) -> the buffer (E G C, h): each slot's token row, zero where it is padding."""
    return _with_zero_row(x).index_select(0, slots.gather)


def combine_slots(y: torch.Tensor, weights: torch.Tensor, slots: Slots, backend: str) -> torch.Tensor:
    """sum_j weights[:, j] * y[slots.pos[:, j]] for the buffer's outputs y (E G C, h): (N, h)."""
    return moe_combine(_with_zero_row(y), weights, slots.pos, backend)


def _with_zero_row(x: torch.Tensor) -> torch.Tensor:
    return torch.cat([x, x.new_zeros(1, x.shape[1])])


def local_experts_ffn(x: torch.Tensor, top_idx: torch.Tensor, weights: torch.Tensor,
                      w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
                      backend: str = "auto", capacity: int = 0, group_tokens: int = 0) -> torch.Tensor:
    """sum_j weights[:, j] * swiglu_{top_idx[:, j]}(x) for x (N, h), every expert on this rank, at most
    `capacity` rows per expert of each group of `group_tokens` tokens where `capacity` > 0 (module
    docstring); returns (N, h)."""
    experts = w_gate.shape[0]
    if capacity:
        slots = capacity_slots(top_idx, experts, group_tokens, capacity)
        counts = torch.full((experts,), slots.rows_per_expert, dtype=torch.long)
        y = grouped_swiglu(gather_slots(x, slots), counts, w_gate, w_up, w_down, backend)
        return combine_slots(y, weights, slots, backend)
    routing = moe_routing(top_idx, experts)
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
                        group, backend: str = "auto", etp_group=None, capacity: int = 0,
                        group_tokens: int = 0) -> torch.Tensor:
    """sum_j weights[:, j] * swiglu_{top_idx[:, j]}(x) for x (N, h) with E_l local experts of
    E_l * n over the n ranks of `group`, each expert's FFN split over `etp_group` when given, at most
    `capacity` rows per expert of each group of `group_tokens` tokens where `capacity` > 0 (module
    docstring); returns (N, h)."""
    n, local = group_size(group), w_gate.shape[0]
    if capacity:
        return _padded_dispatch(x, weights, capacity_slots(top_idx, local * n, group_tokens, capacity),
                                (w_gate, w_up, w_down), group, backend, etp_group)
    routing = moe_routing(top_idx, local * n)
    send = moe_permute(x, routing, backend)  # (N k, h) in expert order
    counts = routing.tokens_per_expert.view(n, local)  # (n, E_l) to each rank
    recv_counts = exchange(counts, group)  # (n, E_l): from each source rank, per local expert
    send_rows, recv_rows = counts.sum(1).tolist(), recv_counts.sum(1).tolist()
    received = all_to_all_uneven(send, send_rows, recv_rows, group)  # (M, h) by source, expert
    y_received = _local_experts(received, recv_counts, (w_gate, w_up, w_down), backend, etp_group)
    back = all_to_all_uneven(y_received, recv_rows, send_rows, group)  # (N k, h) expert order
    return moe_unpermute(back, weights, routing, backend)


def _padded_dispatch(x: torch.Tensor, weights: torch.Tensor, slots: Slots, experts: tuple, group,
                     backend: str, etp_group=None) -> torch.Tensor:
    """`expert_parallel_ffn` with an expert capacity: every rank sends and receives E_l G C rows per
    rank, so the row counts are known without an exchange (module docstring)."""
    n, local = group_size(group), experts[0].shape[0]
    send = gather_slots(x, slots)  # (E G C, h): expert-major, so rank r's experts are one run
    rows = [local * slots.rows_per_expert] * n
    received = all_to_all_uneven(send, rows, rows, group)  # (n E_l G C, h) by source, expert
    counts = torch.full((n, local), slots.rows_per_expert, dtype=torch.long, device=x.device)
    y_received = _local_experts(received, counts, experts, backend, etp_group)
    back = all_to_all_uneven(y_received, rows, rows, group)  # (E G C, h) in send's order
    return combine_slots(back, weights, slots, backend)


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
