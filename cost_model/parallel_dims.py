"""Context (Ulysses) and expert parallelism: their communication, and the rules their degrees obey.

Context parallelism, DeepSpeed-Ulysses style (Jacobs et al. 2023). The cp ranks of a group each hold
T / cp tokens of every sequence. Around the attention core an all-to-all turns q, k and v from
sequence-split into head-split (each rank then sees the whole sequence for heads / (tp cp) heads) and
another turns the output back:

    per layer and microbatch   4 all-to-alls forward (q, k, v, output) + 4 backward (their gradients),
                               each of B = mbs * T * width_per_tp_rank * itemsize bytes over cp ranks,
                               with its pack and unpack copies of B / cp; and where the ranks drift apart
                               (a CPU profile's skew), a wait before and after each attention core
                               (`ulysses_skew_s`)

Per rank, compute and activations then equal those of a microbatch of mbs / cp sequences of full
length (linear layers see T / cp tokens; attention sees T tokens for 1 / cp of the heads), which is how
the search prices them. Rules: heads divisible by tp * cp (kv heads are repeated when fewer than tp *
cp, as Ulysses does for grouped-query attention; their all-to-all then carries the repeated heads);
T divisible by tp * cp (sequence parallelism inside tp): `autoplan.validity.cp_problem`. The search also skips
fewer than `solver.space.MIN_TOKENS_PER_CP_RANK` tokens per rank, which runs but never pays.

Expert parallelism with Megatron Core's MoE parallel folding (Liu et al. 2025): the experts of each
MoE layer are split over ep ranks taken from the data-parallel ranks, so expert weights (and their
gradients and optimizer states) are divided by ep, and their gradients are reduced over the
data x context parallel ranks / ep. Each MoE layer sends every routed token to its expert and back:

    per MoE layer and microbatch  2 all-to-alls forward (dispatch, combine) + 2 backward, each of
                                  B = ep * tokens_per_rank * top_k * hidden * itemsize bytes over ep

Balanced routing is assumed (each rank computes tokens * top_k / ... as without ep); load imbalance
is ignored. With an expert capacity (`ModelConfig.capacity_factor`) the dispatch moves the padded
buffers: top_k is then capacity_factor * top_k (`ModelConfig.dispatched_rows_per_token`). Mesh representation: ep is its own mesh axis between dp and cp
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

import functools

import numpy as np

from autoplan.cluster import ClusterSpec
from autoplan.cost_model.comm import AxisGroup
from autoplan.cost_model.compute import Efficiency, memory_time_s
from autoplan.mesh import MeshShape



def axes_group(mesh: MeshShape, axes: tuple[str, ...], gpus_per_node: int) -> AxisGroup:
    """The network shape of one group spanning several mesh axes (e.g. dp x ep x cp for gradients)."""
    return _group_shape(tuple((mesh.degree(axis), mesh.stride(axis)) for axis in axes), gpus_per_node)


@functools.lru_cache(maxsize=4096)  # a pure function of a few ints, asked for every mesh the search enumerates
def _group_shape(spans: tuple[tuple[int, int], ...], gpus_per_node: int) -> AxisGroup:
    """The group of the ranks sum_a i_a stride_a (0 <= i_a < degree_a, spans = ((degree_a, stride_a), ...)):
    its size, the nodes it touches and the most of its ranks on one node."""
    ranks = np.zeros(1, dtype=np.int64)
    for degree, stride in spans:
        ranks = (ranks[:, None] + np.arange(degree) * stride).ravel()
    per_node = np.unique(ranks // gpus_per_node, return_counts=True)[1]
    return AxisGroup(int(ranks.size), int(per_node.size), int(per_node.max()))


def ulysses_all_to_all_s(tokens: float, q_width: float, kv_width: float, itemsize: float, cluster: ClusterSpec,
                         group: AxisGroup, efficiency: Efficiency | None = None) -> float:
    """Forward + backward seconds of one layer's Ulysses all-to-alls for one microbatch (module docstring), each
    with the two copies the runtime makes around it (`runtime.collectives.all_to_all_dim`: the rank's tensor
    packed into one chunk per peer, and the received chunks joined: both read and write the rank's share,
    tokens / cp x width, in a kernel each, at the memory-bound roofline).

    tokens: mbs * T of the whole cp group; widths: features per tp rank of q (and the output) and of k, v."""
    if group.size == 1:
        return 0.0
    efficiency = efficiency or Efficiency()  # the default: the datasheet links, a call cost each
    q = efficiency.collective_s("all_to_all", tokens * q_width * itemsize, cluster, group)
    kv = efficiency.collective_s("all_to_all", tokens * kv_width * itemsize, cluster, group)
    share = tokens / group.size * itemsize  # bytes per feature of one rank's tensor
    copies = sum(efficiency.kernels_s(memory_time_s(2 * share * width, cluster.device, efficiency, 1))
                 for width in (q_width, kv_width))
    return 2 * (2 * q + 2 * kv) + 2 * 2 * 2 * copies  # fwd + bwd, two calls of each width, two copies each


def ulysses_skew_s(forward_s: float, backward_s: float, attention_s: tuple[float, float],
                   efficiency: Efficiency) -> float:
    """What the ranks' skew adds at one layer's Ulysses all-to-alls per microbatch (`Efficiency.skew_s`; 0 where
    the profile fitted none): each pass blocks before its attention core (q, k and v's calls in a row wait once)
    and after it, so it waits once after the core's compute and once after the rest of the layer's. `forward_s`,
    `backward_s`: the layer's compute; `attention_s`: its core's (forward, backward)."""
    return sum(efficiency.skew_s(core) + efficiency.skew_s(max(0.0, total - core))
               for total, core in zip((forward_s, backward_s), attention_s))


def expert_all_to_all_s(tokens_per_rank: float, hidden: int, top_k: int, itemsize: float, cluster: ClusterSpec,
                        group: AxisGroup, efficiency: Efficiency | None = None) -> float:
    """Forward + backward seconds of one MoE layer's dispatch and combine for one microbatch."""
    if group.size == 1:
        return 0.0
    nbytes = group.size * tokens_per_rank * top_k * hidden * itemsize
    return 4 * (efficiency or Efficiency()).collective_s("all_to_all", nbytes, cluster, group)


def expert_tp_exchange_s(tokens_per_rank: float, hidden: int, top_k: int, itemsize: float, cluster: ClusterSpec,
                         group: AxisGroup, efficiency: Efficiency | None = None) -> float:
    """Forward + backward seconds of one MoE layer's expert-TP all-gather and reduce-scatter of the
    dispatched rows for one microbatch (module docstring); `tokens_per_rank`: the tokens this rank
    dispatches (already / tp)."""
    if group.size == 1:
        return 0.0
    nbytes = group.size * tokens_per_rank * top_k * hidden * itemsize
    efficiency = efficiency or Efficiency()
    gather = efficiency.collective_s("all_gather", nbytes, cluster, group)
    scatter = efficiency.collective_s("reduce_scatter", nbytes, cluster, group)
    return 2 * (gather + scatter)
