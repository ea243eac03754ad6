"""Context (Ulysses) and expert parallelism: their communication, and the rules their degrees obey.

Context parallelism, DeepSpeed-Ulysses style (Jacobs et al. 2023). The cp ranks of a group each hold
T / cp tokens of every sequence. Around the attention core an all-to-all turns q, k and v from
sequence-split into head-split (each rank then sees the whole sequence for heads / (tp cp) heads) and
another turns the output back:

    per layer and microbatch   4 all-to-alls forward (q, k, v, output) + 4 backward (their gradients),
                               each of B = mbs * T * width_per_tp_rank * itemsize bytes over cp ranks

Per rank, compute and activations then equal those of a microbatch of mbs / cp sequences of full
length (linear layers see T / cp tokens; attention sees T tokens for 1 / cp of the heads), which is how
the search prices them. Rules: heads divisible by tp * cp (kv heads are repeated when fewer than tp *
cp, as Ulysses does for grouped-query attention; their all-to-all then carries the repeated heads);
T divisible by tp * cp (sequence parallelism inside tp); at least MIN_TOKENS_PER_CP_RANK tokens per rank.

Expert parallelism with Megatron Core's MoE parallel folding (Liu et al. 2025): the experts of each
MoE layer are split over ep ranks taken from the data-parallel ranks, so expert weights (and their
gradients and optimizer states) are divided by ep, and their gradients are reduced over the
data x context parallel ranks / ep. Each MoE layer sends every routed token to its expert and back:

    per MoE layer and microbatch  2 all-to-alls forward (dispatch, combine) + 2 backward, each of
                                  B = ep * tokens_per_rank * top_k * hidden * itemsize bytes over ep

Balanced routing is assumed (each rank computes tokens * top_k / ... as without ep); capacity factors
and load imbalance are ignored. Mesh representation: ep is its own mesh axis between dp and cp
(order pp, dp, ep, cp, tp), the dense layers are data-parallel over dp x ep, so ep divides the
data-parallel degree.

Expert parallelism folded over context parallelism (`MeshShape.ep_as` = "cp"): the ep ranks are, to
the non-expert layers, more context-parallel ranks: each sequence is split over the ep x cp ranks, the
Ulysses group spans them (`MeshShape.context_axes`), and the batch is split over dp alone. Every rule
and formula above for cp then holds with cp x ep in place of cp (`MeshShape.context_parallel`); the
MoE layers still spread their experts over the ep ranks, each dispatching the same tokens per rank as
when the ep ranks split the batch (routing is per token).

Expert tensor parallelism (`MeshShape.etp`): with etp < tp the MoE layers also fold f = tp / etp of
the tp ranks into expert parallelism. Each tp rank takes 1 / tp of the tokens (the "expert" strategy:
sequence split), the dispatch and combine run over the ep x f ranks (`MeshShape.expert_axes`, their
links from the mesh order) with tokens_per_rank / tp each, experts are divided by ep x f and each
expert's FFN by etp (expert GEMMs at ffn / etp; parameters split over ep x f x etp = ep x tp), no tp
all-reduce of their outputs, and their gradients still reduce over dp x cp. With 1 < etp < tp the
etp ranks sharing experts exchange the dispatched rows (`expert_tp_exchange_s`):

    per MoE layer and microbatch  fwd: all-gather of the dispatched rows + reduce-scatter of the partial
                                  outputs, bwd: the same two, each of
                                  B = etp * tokens_per_rank / tp * top_k * hidden * itemsize bytes over etp

Rules: a MoE model, etp dividing tp and the experts' FFN width, the experts divisible by ep x f, the
sequence by tp x cp (`etp_problem`).
"""

from __future__ import annotations

import numpy as np

from autoplan.cluster import ClusterSpec
from autoplan.cost_model.calibration import CollectiveCalibration
from autoplan.cost_model.comm import AxisGroup, group_collective_time_s
from autoplan.errors import ConfigError
from autoplan.mesh import MeshShape

MIN_TOKENS_PER_CP_RANK = 1024  # below this the all-to-all latencies and flash-attention tiles of 128 rows underfill


def axes_group(mesh: MeshShape, axes: tuple[str, ...], gpus_per_node: int) -> AxisGroup:
    """The network shape of one group spanning several mesh axes (e.g. dp x ep x cp for gradients)."""
    ranks = np.zeros(1, dtype=np.int64)
    for axis in axes:
        ranks = (ranks[:, None] + np.arange(mesh.degree(axis)) * mesh.stride(axis)).ravel()
    per_node = np.unique(ranks // gpus_per_node, return_counts=True)[1]
    return AxisGroup(int(ranks.size), int(per_node.size), int(per_node.max()))


def ulysses_all_to_all_s(tokens: float, q_width: float, kv_width: float, itemsize: float, cluster: ClusterSpec,
                         group: AxisGroup, measured: CollectiveCalibration | None = None) -> float:
    """Forward + backward seconds of one layer's Ulysses all-to-alls for one microbatch (module docstring).

    tokens: mbs * T of the whole cp group; widths: features per tp rank of q (and the output) and of k, v."""
    if group.size == 1:
        return 0.0
    q = group_collective_time_s("all_to_all", tokens * q_width * itemsize, cluster, group, measured)
    kv = group_collective_time_s("all_to_all", tokens * kv_width * itemsize, cluster, group, measured)
    return 2 * (2 * q + 2 * kv)


def expert_all_to_all_s(tokens_per_rank: float, hidden: int, top_k: int, itemsize: float, cluster: ClusterSpec,
                        group: AxisGroup, measured: CollectiveCalibration | None = None) -> float:
    """Forward + backward seconds of one MoE layer's dispatch and combine for one microbatch."""
    if group.size == 1:
        return 0.0
    nbytes = group.size * tokens_per_rank * top_k * hidden * itemsize
    return 4 * group_collective_time_s("all_to_all", nbytes, cluster, group, measured)


def expert_tp_exchange_s(tokens_per_rank: float, hidden: int, top_k: int, itemsize: float, cluster: ClusterSpec,
                         group: AxisGroup, measured: CollectiveCalibration | None = None) -> float:
    """Forward + backward seconds of one MoE layer's expert-TP all-gather and reduce-scatter of the
    dispatched rows for one microbatch (module docstring); `tokens_per_rank`: the tokens this rank
    dispatches (already / tp)."""
    if group.size == 1:
        return 0.0
    nbytes = group.size * tokens_per_rank * top_k * hidden * itemsize
    gather = group_collective_time_s("all_gather", nbytes, cluster, group, measured)
    scatter = group_collective_time_s("reduce_scatter", nbytes, cluster, group, measured)
    return 2 * (gather + scatter)


# ---------------------------------------------------------------------------------- rules


def nearest_multiples(value: int, step: int) -> tuple[int, ...]:
    """The multiples of `step` just below and just above `value` (positive ones only)."""
    below, above = (value // step) * step, -(-value // step) * step
    return tuple(sorted({v for v in (below, above) if v > 0} or {step}))


def _nearest_divisors(value: int, of: int, limit: int | None = None) -> list[int]:
    options = [d for d in range(1, of + 1) if of % d == 0 and (limit is None or d <= limit)]
    return sorted(options, key=lambda d: (abs(d - value), d))[:2]


def tp_problem(heads: int, kv_heads: int, tp: int) -> str | None:
    """Why `tp` cannot split the attention heads, or None."""
    if heads % tp == 0 and kv_heads % tp == 0:
        return None
    valid = [d for d in range(1, heads + 1) if heads % d == 0 and kv_heads % d == 0]
    near = sorted(valid, key=lambda d: (abs(d - tp), d))[:2]
    return (f"tp={tp} does not divide the attention heads (heads={heads}, kv_heads={kv_heads}); "
            f"nearest tp that work: {', '.join(map(str, sorted(near)))}")


def cp_problem(heads: int, tp: int, cp: int, seq_len: int, name: str = "cp") -> str | None:
    """Why context parallelism of degree `cp` (with `tp`) cannot run this sequence, or None. `name`: what
    the message calls the degree (e.g. "cp x ep" when the ep ranks split the sequence too)."""
    if cp == 1:
        return None
    if heads % (tp * cp):
        near = _nearest_divisors(cp, heads // tp if heads % tp == 0 else 1)
        return (f"{name}={cp} with tp={tp}: heads={heads} is not divisible by tp x {name} = {tp * cp}; "
                f"nearest {name} that work: {', '.join(map(str, sorted(near)))}")
    if seq_len % (tp * cp) or seq_len // cp < MIN_TOKENS_PER_CP_RANK:
        largest = max((c for c in range(1, cp + 1) if seq_len % (tp * c) == 0 and seq_len // c >= MIN_TOKENS_PER_CP_RANK
                       and heads % (tp * c) == 0), default=1)
        need = max(cp * MIN_TOKENS_PER_CP_RANK, tp * cp)
        return (f"sequence {seq_len} is too short for {name}={cp}: each context-parallel rank needs >= "
                f"{MIN_TOKENS_PER_CP_RANK} tokens and the sequence must divide by tp x {name} = {tp * cp}; use "
                f"{name} <= {largest} or a sequence of at least {-(-need // (tp * cp)) * tp * cp}")
    return None


def ep_problem(experts: int, ep: int, data_parallel: int) -> str | None:
    """Why `ep` cannot split the experts over the data-parallel ranks, or None."""
    if ep == 1:
        return None
    if experts == 0:
        return f"ep={ep} needs a mixture-of-experts model; this model has no experts (use ep=1)"
    if experts % ep or data_parallel % ep:
        valid = [d for d in range(1, experts + 1) if experts % d == 0 and data_parallel % d == 0]
        near = sorted(valid, key=lambda d: (abs(d - ep), d))[:2]
        return (f"ep={ep} must divide the experts ({experts}) and the data-parallel degree dp x ep ({data_parallel}); "
                f"nearest ep that work: {', '.join(map(str, sorted(near)))}")
    return None


def etp_problem(experts: int, ep: int, tp: int, etp: int, seq_len: int, cp: int = 1,
                ffn: int | None = None) -> str | None:
    """Why expert tensor-parallel degree `etp` cannot run with this model and mesh, or None. `ffn`: the
    experts' FFN width (None: not checked)."""
    if etp == tp:
        return None
    if experts == 0:
        return (f"etp={etp} with tp={tp} needs a mixture-of-experts model (etp is the tensor-parallel degree of "
                f"the experts); this model has none: leave etp unset (= tp)")
    if tp % etp:
        divisors = [d for d in range(1, tp + 1) if tp % d == 0]
        return f"etp={etp} must divide tp={tp} (the tp ranks an expert's FFN is split over); use one of {divisors}"
    if experts % (ep * tp // etp):
        return (f"etp={etp} spreads the {experts} experts over ep x tp / etp = {ep} x {tp // etp} ranks, which "
                f"does not divide them; use etp={tp}, or an ep whose ep x {tp // etp} divides {experts}")
    if seq_len % (tp * cp):
        return (f"etp={etp} splits each sequence's tokens over tp x cp = {tp * cp} ranks, which does not divide "
                f"seq_len {seq_len}; use etp={tp} or a sequence divisible by {tp * cp}")
    if ffn is not None and ffn % etp:
        return (f"etp={etp} splits each expert's FFN width {ffn} over {etp} ranks, which does not divide it; use "
                f"an etp dividing {ffn} (etp=1 keeps the experts whole)")
    return None


def batch_problem(global_batch: int, data_parallel: int, microbatch_size: int, name: str = "dp") -> str | None:
    """Why the global batch cannot be split into microbatches over the data-parallel ranks, or None. `name`:
    what the message calls their count."""
    step = data_parallel * microbatch_size
    if global_batch % step == 0:
        return None
    near = ", ".join(map(str, nearest_multiples(global_batch, step)))
    if microbatch_size == 1:
        return f"global batch {global_batch} is not divisible by {name}={data_parallel}; nearest that work: {near}"
    return (f"global batch {global_batch} is not divisible by {name}={data_parallel} x microbatch {microbatch_size} = "
            f"{step}; nearest that work: {near}")


def check(problem: str | None) -> None:
    """Raise ConfigError with the message of a rule that failed."""
    if problem:
        raise ConfigError(problem)
