"""Costs of per-op tensor-parallel strategies, as an `IntraOpProblem` for the solver.

For one tp degree and microbatch size, every captured node v gets its strategies S_v
(`autoplan.strategies`) and, per strategy s, per microbatch:

    node cost   c_v[s] = t_fwd + t_bwd                     (the op's kernels at their rooflines on s's
                        + sum of s.fwd_comm and s.bwd_comm  share, `node_compute_s`; collectives on the
                                                            tp axis, `comm.collective_time_s`)
    node memory m_v[s] = (weight + grad + optimizer) bytes of v's parameters at s's tp sharding

and every tensor edge u -> v (v's input i) a matrix C[s_u, s_v] = resharding time from s_u.output to
s_v.inputs[i] (`reshard_collectives`):

    same placement        fwd -          bwd -            (grad_partial: bwd all-reduce)
    R -> S(d)             fwd slice      bwd all-gather
    S(d) -> R             fwd all-gather bwd -            (grad_partial: bwd reduce-scatter; Megatron SP)
    S(a) -> S(b)          fwd all-to-all bwd all-to-all
    P -> R / S(d)         fwd all-reduce / reduce-scatter; bwd as from R

Tensors without gradients (token ids, targets) have no backward term. The graph is captured once at
a small batch; FLOPs and activation bytes scale by microbatch / capture batch, parameter bytes do not.

Shared conversions: the runtime converts a tensor once for all the consumers that need the same
placement (q, k and v read one all-gathered norm output and sum their partial input gradients in one
collective). The ILP's edges are pairwise, so it counts such a conversion once per consumer: a
conservative surrogate that moves every choice of the shared input alike. `price_assignment` counts
it once, and reports what the ILP counted on top (`AssignmentCost.shared_comm_s`): priced + shared =
the ILP objective of the same choice.

Segments (the exact folded solve, `autoplan.solver.folded.solve_folded`): `segment_arrays` prices the nodes
of one block and the edges inside it once per (tp, microbatch); `segment_problem` is the block's own
problem and `boundary_variant` fixes its boundary, as the math in `autoplan.solver.ilp` says: an edge
entering the block from a producer whose output placement is p becomes the cost row C[p, :] on its
consumer (`entry_costs`), and a node whose output leaves the block keeps only the strategies that
place it as asked.
"""

from __future__ import annotations

import functools

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping

import numpy as np

from autoplan.capture.graph import attention_keys
from autoplan.cluster import ClusterSpec
from autoplan.cost_model.comm import AxisGroup
from autoplan.cost_model.attention_cost import attention_kernels, attention_time_s, rope_time_s
from autoplan.cost_model.compute import (MOE_KERNELS, OP_KERNELS, Efficiency, grad_accumulation_bytes, linear_time_s,
                                         memory_op_bytes, memory_time_s, op_time_s)
from autoplan.cost_model.host import host_paced_s
from autoplan.cost_model.memory import StateBytes, comm_tensor_nbytes, local_nbytes, param_placements, scaled_nbytes
from autoplan.errors import AutoplanError
from autoplan.mesh import MeshShape
from autoplan.placement import Partial, Placement, Replicate, Shard
from autoplan.recompute_policy import KINDS, captured_op_family
from autoplan.strategies import InputSpec, Strategy, expert_dims

if TYPE_CHECKING:
    from autoplan.capture import CapturedGraph, NodeInfo, TensorMeta

FLOAT_DTYPES = ("bfloat16", "float16", "float32", "float64")
DEFAULT_HEAD_DIM = 128  # when a graph's attention modules do not say
Collectives = tuple[tuple[str, bool], ...]  # (kind, acts on the 1/tp shard rather than the full tensor)


@dataclass(frozen=True)
class CostContext:
    """Everything a per-op price depends on besides the op: hardware, mesh, dtype, batch scaling."""

    cluster: ClusterSpec
    mesh: MeshShape
    dtype: str
    efficiency: Efficiency
    capture_batch: int
    batch_scale: float  # microbatch size / capture batch
    axis: str = "tp"
    head_dim: int = DEFAULT_HEAD_DIM  # of the attention cores (`attention_head_dim`)
    rope: bool = False  # whether the attention cores rotate q and k themselves (`attention_rope`)
    group: AxisGroup = field(init=False, repr=False, compare=False)
    reshard_memo: dict = field(init=False, repr=False, compare=False)  # `reshard_s` by (meta, src, dst)

    def __post_init__(self) -> None:
        object.__setattr__(self, "group", AxisGroup.of(self.mesh, self.axis, self.cluster.gpus_per_node))
        object.__setattr__(self, "reshard_memo", {})
        object.__setattr__(self, "efficiency", self.efficiency.resolved(self.cluster.device))

    @property
    def degree(self) -> int:
        return self.mesh.degree(self.axis)

    def collective_s(self, kind: str, nbytes: float) -> float:
        return self.efficiency.collective_s(kind, nbytes, self.cluster, self.group)


def _attention_core(graph: "CapturedGraph"):
    """The module of the graph's first attention core, or None (no attention, or a module not found)."""
    node = next((n for n in graph.nodes if n.op_kind == "attention"), None)
    if node is None:
        return None
    try:
        return graph.graph_module.get_submodule(node.module_path)
    except (AttributeError, TypeError, ValueError):
        return None


def attention_head_dim(graph: "CapturedGraph") -> int:
    """The head dim of the graph's attention cores (read from their modules), else DEFAULT_HEAD_DIM."""
    try:
        return int(_attention_core(graph).head_dim)
    except (AttributeError, TypeError, ValueError):
        return DEFAULT_HEAD_DIM


def attention_rope(graph: "CapturedGraph") -> bool:
    """Whether the graph's attention cores apply RoPE to q and k inside them (the zoo's `Attention(rope=True)`; a
    traced model's rotation outside its attention core is captured, and priced, as ops of its own)."""
    return bool(getattr(_attention_core(graph), "rope", False))


def make_context(graph: "CapturedGraph", cluster: ClusterSpec, mesh: MeshShape, microbatch_size: float,
                 dtype: str = "bfloat16", efficiency: Efficiency | None = None) -> CostContext:
    if microbatch_size <= 0:
        raise AutoplanError(f"microbatch_size must be > 0, got {microbatch_size}")
    return CostContext(cluster, mesh, dtype, efficiency or Efficiency(), graph.batch_size,
                       microbatch_size / graph.batch_size, head_dim=attention_head_dim(graph),
                       rope=attention_rope(graph))


# ---------------------------------------------------------------------------------- node costs


def _local_param_bytes(node: "NodeInfo", strategy: Strategy, tp: int) -> float:
    return float(sum(local_nbytes(m.nbytes, p, tp) for _, m, p in param_placements(node, strategy)))


def _linear_shape(node: "NodeInfo", strategy: Strategy, ctx: CostContext) -> tuple[float, float, float]:
    """(m tokens, n out, k in) of the GEMM one rank runs: the weight's tp shard splits n (column) or
    k (row), otherwise a split strategy splits the tokens (sequence)."""
    x = node.input_metas[0]
    m, k, n = x.numel / x.shape[-1] * ctx.batch_scale, float(x.shape[-1]), float(node.output.shape[-1])
    weight = next((p for name, _, p in param_placements(node, strategy) if name.endswith("weight")), None)
    if isinstance(weight, Shard):
        return (m, n / ctx.degree, k) if weight.dim == 0 else (m, n, k / ctx.degree)
    return m * strategy.compute_fraction, n, k


def _moe_shape(node: "NodeInfo", strategy: Strategy, ctx: CostContext) -> tuple[float, float, float]:
    """A representative expert GEMM (tokens per expert, ffn per rank, expert width) for the MoE's
    efficiency; tokens per expert from the FLOPs (6 width ffn per routed token and expert)."""
    x, dims = node.input_metas[0], expert_dims(node)
    if dims is None:
        return x.numel / x.shape[-1] * ctx.batch_scale, float(x.shape[-1]), float(x.shape[-1])
    experts, width, ffn = dims
    per_expert = max(1.0, node.fwd_flops * ctx.batch_scale / (6.0 * width * ffn * experts))
    # experts split over ranks on dim 0 (etp < tp): each expert's FFN split etp ways, whole for etp = 1
    folded = strategy.name == "expert"
    share = 1.0 / strategy.expert_ffn_split if folded else strategy.compute_fraction
    return per_expert, max(1.0, ffn * share), float(width)


def node_compute_s(node: "NodeInfo", strategy: Strategy, ctx: CostContext) -> tuple[float, float]:
    """(forward, backward) seconds of the node's share under `strategy` at the microbatch: its kernels
    at their rooflines, each at least the launch floor (`cost_model.compute`), plus the weight-gradient
    accumulation in backward (one kernel per parameter tensor)."""
    if node.fwd_flops == 0 and node.fwd_bytes == 0:
        return 0.0, 0.0
    device, dtype, eff = ctx.cluster.device, ctx.dtype, ctx.efficiency
    params = _local_param_bytes(node, strategy, ctx.degree)
    share = ctx.batch_scale * strategy.compute_fraction
    accumulate = eff.kernels_s(memory_time_s(grad_accumulation_bytes(params), device, eff), len(node.params))
    if node.op_kind == "linear":
        fwd, bwd = linear_time_s(*_linear_shape(node, strategy, ctx), node.output.nbytes / node.output.numel,
                                 device, dtype, eff)
        return fwd, bwd + accumulate
    if node.op_kind == "attention":
        q = node.input_metas[0]
        batch_heads = q.shape[0] * ctx.batch_scale * q.shape[-1] / ctx.head_dim * strategy.compute_fraction
        fwd, bwd = attention_time_s(batch_heads, q.shape[1], ctx.head_dim, q.nbytes / q.numel, device, dtype, eff,
                                    attention_keys(node))
        if not ctx.rope:
            return fwd, bwd
        rotated = (q.nbytes + node.input_metas[1].nbytes) * ctx.batch_scale * strategy.compute_fraction  # q and k
        rope_fwd, rope_bwd = rope_time_s(rotated, 2, device, eff)
        return fwd + rope_fwd, bwd + rope_bwd
    if node.op_kind == "moe":
        e = eff.gemm_efficiency(*_moe_shape(node, strategy, ctx), device, dtype)
        rate = device.peak_flops_for(dtype) * e
        moved = (node.fwd_bytes - _traffic_param_bytes(node)) * share + params
        fwd_eff, bwd_eff = (eff.for_node(node, strategy.name, d, b) for d, b in (("fwd", moved), ("bwd", 2 * moved)))
        fwd = max(node.fwd_flops * share / rate, memory_time_s(moved, device, fwd_eff))
        bwd = max(node.bwd_flops * share / rate, memory_time_s(2 * moved, device, bwd_eff))
        return eff.kernels_s(fwd, MOE_KERNELS[0]), eff.kernels_s(bwd, MOE_KERNELS[1]) + accumulate
    fwd_bytes, bwd_bytes = memory_op_bytes(node, params)
    extra = params if node.op_kind != "embedding" else 0.0  # a norm reads its weights (the embedding's rows are in)
    kernels = OP_KERNELS.get(node.op_kind, (1, 1))
    fwd_bytes, bwd_bytes = fwd_bytes * share + extra, bwd_bytes * share + extra
    # the measured efficiency of the kernel that runs the node (Triton, or a CPU's torch fallback), per pass and size
    fwd_eff, bwd_eff = (eff.for_node(node, strategy.name, d, b) for d, b in (("fwd", fwd_bytes), ("bwd", bwd_bytes)))
    fwd = op_time_s(node.fwd_flops * share, fwd_bytes, device, dtype, fwd_eff, kernels[0], allocates=True)
    bwd = op_time_s(node.bwd_flops * share, bwd_bytes, device, dtype, bwd_eff, kernels[1], allocates=True)
    return fwd, bwd + accumulate


def node_kernels(node: "NodeInfo", ctx: CostContext) -> tuple[int, int]:
    """(forward, backward) kernels the node launches, as `node_compute_s` counts them for the floor: a
    linear 1 / 2 (dX, dW), attention flash 1 / 2 or materialized one per kernel of `attention_kernels`,
    MoE and memory-bound ops per `MOE_KERNELS` / `OP_KERNELS`; plus one accumulation into .grad per
    parameter tensor in backward. Nodes that move nothing (views) launch none. An attention core's RoPE kernels
    are not counted: the host's cost per kernel is measured on a block that runs them (`profiler.dispatch`), so
    its figure holds their dispatch already."""
    if node.fwd_flops == 0 and node.fwd_bytes == 0:
        return 0, 0
    accumulate = len(node.params)
    if node.op_kind == "linear":
        return 1, 2 + accumulate
    if node.op_kind == "attention":
        if ctx.efficiency.attention.kind == "flash":
            return 1, 2
        forward, backward = attention_kernels(ctx.efficiency.attention, 2)
        return len(forward), len(backward)
    fwd, bwd = MOE_KERNELS if node.op_kind == "moe" else OP_KERNELS.get(node.op_kind, (1, 1))
    return fwd, bwd + accumulate


def _traffic_param_bytes(node: "NodeInfo") -> float:
    """Parameter bytes inside the node's fwd_bytes (embeddings read only their gathered rows)."""
    if node.op_kind in ("embedding", "placeholder", "output", "other"):
        return 0.0
    return float(sum(meta.nbytes for _, meta in node.params))


def node_comm_s(node: "NodeInfo", strategy: Strategy, ctx: CostContext) -> tuple[float, float]:
    """(forward, backward) seconds of the collectives the strategy itself issues on the tp axis."""
    def total(comms) -> float:
        return sum(ctx.collective_s(c.kind, comm_tensor_nbytes(node, c, ctx.capture_batch, ctx.batch_scale))
                   for c in comms)
    return total(strategy.fwd_comm), total(strategy.bwd_comm)


def node_state_bytes(node: "NodeInfo", strategy: Strategy, tp: int, state: StateBytes) -> float:
    """Weights + gradients + optimizer states of the node's parameters at the strategy's tp sharding."""
    per_param = state.weight + state.grad + state.optimizer
    return per_param * sum(local_nbytes(m.numel, p, tp) for _, m, p in param_placements(node, strategy))


# ---------------------------------------------------------------------------------- resharding


@functools.lru_cache(maxsize=4096)  # a pure function of a few placements, asked ~10^3 times per solve
def reshard_collectives(src: Placement, dst: InputSpec, differentiable: bool = True) -> tuple[Collectives, Collectives]:
    """(forward, backward) collectives to turn a tensor placed `src` into `dst` (module docstring)."""
    want = dst.placement
    if src == want:
        fwd: Collectives = ()
    elif isinstance(src, Partial):
        fwd = (("all_reduce" if isinstance(want, Replicate) else "reduce_scatter", False),)
    elif isinstance(src, Replicate):
        fwd = ()  # each rank slices its shard
    elif isinstance(want, Replicate):
        fwd = (("all_gather", False),)
    else:
        fwd = (("all_to_all", False),)
    if not differentiable:
        return fwd, ()
    target = Replicate() if isinstance(src, Partial) else src  # the gradient the producer needs
    return fwd, _grad_collectives(want, target, dst.grad_partial)


def _grad_collectives(have: Placement, target: Placement, partial: bool) -> Collectives:
    """Collectives that turn the gradient arriving in `have` (a partial sum if `partial`) into `target`."""
    if partial and isinstance(have, Replicate):
        return (("all_reduce" if isinstance(target, Replicate) else "reduce_scatter", False),)
    first: Collectives = (("all_reduce", True),) if partial else ()  # a partial shard: reduce it in place
    if have == target or (isinstance(have, Replicate) and isinstance(target, Shard)):
        return first
    return first + ((("all_gather" if isinstance(target, Replicate) else "all_to_all"), False),)


def reshard_s(meta: "TensorMeta", src: Placement, dst: InputSpec, ctx: CostContext) -> tuple[float, float]:
    """(forward, backward) seconds to reshard one tensor edge at the microbatch (memoised in `ctx`:
    one activation shape feeds many edges)."""
    key = (meta, src, dst)
    if key not in ctx.reshard_memo:
        full = scaled_nbytes(meta, ctx.capture_batch, ctx.batch_scale)
        fwd, bwd = reshard_collectives(src, dst, meta.dtype in FLOAT_DTYPES)

        def total(collectives: Collectives) -> float:
            return sum(ctx.collective_s(kind, full / ctx.degree if on_shard else full) for kind, on_shard in collectives)
        ctx.reshard_memo[key] = total(fwd), total(bwd)
    return ctx.reshard_memo[key]


def edge_cost_matrix(meta: "TensorMeta", producer: list[Strategy], consumer: list[Strategy], index: int,
                     ctx: CostContext) -> np.ndarray:
    """C[i, j] = fwd + bwd seconds to feed input `index` of consumer strategy j from producer strategy i:
    each distinct (output placement, input spec) pair priced once, then spread by index arrays."""
    outputs, rows = _distinct([s.output for s in producer])
    inputs, cols = _distinct([s.inputs[index] for s in consumer])
    priced = np.array([[sum(reshard_s(meta, src, dst, ctx)) for dst in inputs] for src in outputs])
    return priced[np.ix_(rows, cols)]


def _distinct(items: list) -> tuple[list, np.ndarray]:
    """The distinct items in order of first appearance, and each item's index among them."""
    codes: dict = {}
    index = np.array([codes.setdefault(x, len(codes)) for x in items], dtype=np.intp)
    return list(codes), index


# ---------------------------------------------------------------------------------- pricing


@dataclass(frozen=True)
class AssignmentCost:
    """Seconds per microbatch of one assignment over the unfolded graph, split for the step model."""

    fwd_compute_s: float
    bwd_compute_s: float
    fwd_comm_s: float  # tp collectives of the ops and of resharding, forward
    bwd_comm_s: float
    layer_fwd_compute_s: float  # the layers' forward: what full recompute re-runs
    layer_fwd_comm_s: float
    layer_saved_fwd_s: tuple[tuple[str, float], ...] = ()  # (family, the layers' forward of its ops):
    # what a recompute policy saving that family does not re-run (`autoplan.recompute_policy`)
    layer_recompute_s: tuple[tuple[str, float], ...] = ()  # (recompute kind, seconds its re-run of the layers
    # adds, the host's share priced: `layer_rerun_s`); empty without host pricing
    shared_comm_s: float = 0.0  # conversions shared by several consumers, counted again by the pairwise ILP
    attention_s: tuple[float, float] = (0.0, 0.0)  # the attention cores' (forward, backward) kernel seconds

    @property
    def total_s(self) -> float:
        """The intra-op objective of the same choice, less `shared_comm_s` (module docstring)."""
        return self.fwd_compute_s + self.bwd_compute_s + self.fwd_comm_s + self.bwd_comm_s


def price_assignment(graph: "CapturedGraph", strategies: Mapping[str, Strategy], ctx: CostContext,
                     host: bool = True) -> AssignmentCost:
    """Per-microbatch compute and tp communication of `strategies` (node name -> Strategy), each
    conversion of a tensor counted once however many consumers share it (module docstring). With `host`,
    the compute of the nodes priced together is at least the host's dispatch of their kernels, forward
    and backward apart (`cost_model.compute`, `node_kernels`); without it, the kernels' own times.

    Equal nodes (the same op in every layer) are priced once: the memo keys hold strategies and
    placements by identity (all alive in `strategies` for the whole call), which hashes far faster
    than their nested dataclasses; an equal but distinct object only costs a memo miss."""
    node_memo: dict[tuple, tuple[float, float, float, float]] = {}
    edge_memo: dict[tuple, tuple[float, float]] = {}
    converted: set[tuple] = set()  # (producer, source placement, input spec): conversions already made
    canonical: dict[int, str] = {}  # id -> repr of the placements and specs met: equal values, equal keys

    def value(obj) -> str:
        if id(obj) not in canonical:
            canonical[id(obj)] = repr(obj)
        return canonical[id(obj)]

    sums = dict.fromkeys(("fc", "bc", "fm", "bm", "lfc", "lfm", "shared", "af", "ab"), 0.0)
    host_s = (ctx.efficiency.host_kernel_s or 0.0) if host else 0.0
    count = host and (host_s or ctx.efficiency.host_recompute_s)  # kernels are counted for the host's share
    paced: dict[str, list[tuple[float, int]]] = {"f": [], "b": [], "lf": []}  # (device s, kernels) in run order
    layer_ops: list[tuple[str, float, int]] = []  # (family, forward device s, forward kernels) of the layers' nodes
    calls: list[tuple[float, float, bool, bool]] = []  # per node: (forward s, backward s, blocking calls after each)
    skewed = host and ctx.efficiency.collective_skew  # the ranks' skew at each blocking call (`comm`, inside a step)
    families: dict[str, float] = {}
    for node in graph.nodes:
        strategy = strategies[node.name]
        key = (node.rule_key, node.fwd_flops, node.bwd_flops, node.fwd_bytes, node.bwd_bytes, id(strategy))
        if key not in node_memo:
            node_memo[key] = node_compute_s(node, strategy, ctx) + node_comm_s(node, strategy, ctx)
        fwd, bwd, comm_f, comm_b = node_memo[key]
        for producer, meta, spec in zip(node.inputs, node.input_metas, strategy.inputs):
            src = strategies[producer].output
            edge = (meta.shape, meta.dtype, id(src), id(spec))
            if edge not in edge_memo:
                edge_memo[edge] = reshard_s(meta, src, spec, ctx)
            conversion = (producer, value(src), value(spec))
            if conversion in converted:
                sums["shared"] += edge_memo[edge][0] + edge_memo[edge][1]
                continue
            converted.add(conversion)
            comm_f, comm_b = comm_f + edge_memo[edge][0], comm_b + edge_memo[edge][1]
        sums["fc"] += fwd
        sums["bc"] += bwd
        if node.op_kind == "attention":
            sums["af"], sums["ab"] = sums["af"] + fwd, sums["ab"] + bwd
        if skewed:
            calls.append((fwd, bwd, comm_f > 0, comm_b > 0))
        if count:
            kernels = node_kernels(node, ctx)
            paced["f"].append((fwd, kernels[0]))
            paced["b"].append((bwd, kernels[1]))
            if node.layer is not None:
                paced["lf"].append((fwd, kernels[0]))
                layer_ops.append((captured_op_family(node.op_kind), fwd, kernels[0]))
        sums["fm"] += comm_f
        sums["bm"] += comm_b
        if node.layer is not None:
            sums["lfc"] += fwd
            sums["lfm"] += comm_f
            family = captured_op_family(node.op_kind)
            families[family] = families.get(family, 0.0) + fwd
    if host_s:  # the host issues forward in graph order, backward in reverse (`host.host_paced_s`)
        serial, (forward_s, backward_s) = bool(ctx.efficiency.host_serial), host_phases(ctx)
        sums["fc"], sums["lfc"] = host_paced_s(paced["f"], forward_s, serial), host_paced_s(paced["lf"], forward_s, serial)
        sums["bc"] = host_paced_s(paced["b"][::-1], backward_s, serial)
    if skewed:
        cyclic = any(node.layer is not None for node in graph.nodes)
        forward = skew_s([(f, call) for f, _, call, _ in calls], ctx.efficiency, cyclic)
        sums["fm"] += forward
        sums["lfm"] += forward if cyclic else 0.0
        sums["bm"] += skew_s([(b, call) for _, b, _, call in reversed(calls)], ctx.efficiency, cyclic)
    rerun = layer_rerun_s(layer_ops, ctx) if count else ()
    return AssignmentCost(sums["fc"], sums["bc"], sums["fm"], sums["bm"], sums["lfc"], sums["lfm"],
                          tuple(sorted(families.items())), layer_recompute_s=rerun, shared_comm_s=sums["shared"],
                          attention_s=(sums["af"], sums["ab"]))


def skew_s(ops: list[tuple[float, bool]], efficiency, cyclic: bool) -> float:
    """The ranks' skew at the blocking calls of `ops` (compute seconds, whether a blocking call follows it; in run
    order): the sum over calls of `Efficiency.skew_s` of the compute since the call before. `cyclic`: a layer among
    layers, whose compute after its last call runs before its first call of the next layer."""
    gaps, since = [], 0.0
    for compute, call in ops:
        since += compute
        if call:
            gaps.append(since)
            since = 0.0
    if gaps and cyclic:
        gaps[0] += since
    return sum(efficiency.skew_s(gap) for gap in gaps)


def host_phases(ctx: CostContext) -> tuple[float, float]:
    """(forward, backward) host seconds per kernel: a profile's by pass (`Efficiency.host_phase_kernel_s`) where
    it measured them, else `host_kernel_s` for both."""
    host_s = ctx.efficiency.host_kernel_s or 0.0
    if not host_s or ctx.efficiency.host_phase_kernel_s is None:
        return host_s, host_s
    return ctx.efficiency.host_phase_kernel_s


def layer_rerun_s(layer_ops: list[tuple[str, float, int]], ctx: CostContext) -> tuple[tuple[str, float], ...]:
    """((recompute kind, seconds), ...): what recomputing the layers adds to a microbatch under each kind the
    efficiency has a host cost for (`Efficiency.host_recompute_s`: forward r_f and re-run r_b per forward kernel):

        forward  paced(the layers' forward ops, h + r_f) - paced(the same, h): the host's share in forward,
                 which the GEMMs of a wide layer hide
        re-run   paced(the ops whose family the kind does not save, at their forward device time, and the
                 saved ones at none, each op's kernels at r_b): replaying a saved output costs the host too

    paced: `host.host_paced_s`, a host/device pipeline on a GPU, one after the other on a CPU
    (`Efficiency.host_serial`); h the host's dispatch per forward kernel (`host_phases`)."""
    serial, host_s, out = bool(ctx.efficiency.host_serial), host_phases(ctx)[0], []
    forward = [(fwd, k) for _, fwd, k in layer_ops]
    plain = host_paced_s(forward, host_s, serial)
    for kind, forward_s, rerun_s in ctx.efficiency.host_recompute_s or ():
        saves = KINDS.get(kind, frozenset())
        rerun = [(0.0 if family in saves else fwd, k) for family, fwd, k in layer_ops]
        out.append((kind, host_paced_s(forward, host_s + forward_s, serial) - plain
                    + host_paced_s(rerun, rerun_s, serial)))
    return tuple(out)
