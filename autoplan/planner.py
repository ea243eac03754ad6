"""The planner's public entry points, and the intra-op solve of one (tp, microbatch) that the outer search
calls once per key.

    search(model, cluster, global_batch, seq_len)        the fastest plan            (`autoplan.outer_search`)
    search_plans(..., top=K)                             the K best, the baselines and search statistics
    estimate(..., mesh=..., microbatch_size=..., ...)    one given configuration, intra-op solved
    plan_from_assignment(graph, ..., assignment, ...)    one given configuration and tp assignment

The outer search space and its bounds are in `autoplan.search_space`, the step model (pipeline stages,
bubble, p2p, context and expert parallelism, data-parallel sync, memory per stage) in `autoplan.pricing`,
the stage partition DP in `solver.stages`, the baselines in `autoplan.baselines`.

MFU = 3 * forward FLOPs * global_batch / (step_time * world * peak FLOP/s of the dtype), recompute not
counted; tokens_per_s = global_batch * seq_len / step_time.

`profile` (search, search_plans, estimate): a `HardwareProfile` of the cluster's kind of device
(`autoplan.profiler.profile`); it replaces the GEMM efficiency curve, the HBM bandwidth and, for groups
inside a node, the collective links (`cost_model.compute.calibrate`). A profile of another device is
refused (ProfileError). `kernels` (the plan's option, "auto" | "triton" | "torch"): where it resolves to
the runtime's Triton kernels, the nodes they run are priced at the profile's measured kernel efficiencies
(`cost_model.kernels`); the plan's notes say whether those were measured or assumed.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Mapping

import torch

from autoplan.capture import CapturedGraph, capture
from autoplan.cluster import ClusterSpec, parse_cluster
from autoplan.cost_model.comm import AxisGroup
from autoplan.cost_model.compute import Efficiency, calibrate
from autoplan.cost_model.intra_op import (AssignmentCost, CostContext, assignment_from_choice,
                                          build_intra_op_problem, make_context, price_assignment,
                                          resolve_strategies)
from autoplan.cost_model.memory import (SavedTensor, comm_buffer_lines, largest_comm_buffer_bytes,
                                        parameter_count_by_layer, saved_tensors)
from autoplan.errors import ConfigError
from autoplan.fold import FoldedGraph, fold_graph, solve_folded
from autoplan.mesh import MeshShape
from autoplan.models import build_model, get_model_config
from autoplan.models.config import ModelConfig
from autoplan.plan import Plan
from autoplan.solver.ilp import solve_ilp
from autoplan.strategies import FEAT, SEQ, Strategy, StrategyRegistry, strategy_info

if TYPE_CHECKING:
    from autoplan.outer_search import SearchResult
    from autoplan.profiler.profile import HardwareProfile
    from autoplan.search_space import SearchOptions

Progress = Callable[[str], None]


# ---------------------------------------------------------------------------------- intra-op solutions


@dataclass(frozen=True)
class TpSolution:
    """One (tp, microbatch) point: the strategies chosen and what the step model needs of them. The
    whole-graph figures (`cost`, the parameter counts, the buffer at `microbatch_size`) are computed on
    first use: the search prices parts instead (`autoplan.parts`), and each is a pass over every node."""

    tp: int
    microbatch_size: int
    assignment: dict[str, str]
    strategies: dict[str, Strategy]
    saved: tuple[SavedTensor, ...]  # activations at the capture batch
    dp_group: AxisGroup
    solver: str = ""
    status: str = "optimal"
    comm_lines: tuple[tuple[float, float], ...] = ()  # `memory.comm_buffer_lines`: the buffer at any microbatch
    graph: CapturedGraph | None = field(default=None, compare=False, repr=False)
    ctx: CostContext | None = field(default=None, compare=False, repr=False)

    @functools.cached_property
    def cost(self) -> AssignmentCost:
        """Seconds per microbatch of the whole graph (`intra_op.price_assignment`)."""
        return price_assignment(self.graph, self.strategies, self.ctx)

    @functools.cached_property
    def _params_by_layer(self) -> dict:
        return parameter_count_by_layer(self.graph, self.strategies, self.tp)

    @property
    def local_params(self) -> float:
        """Parameters per rank after tp."""
        return float(sum(self._params_by_layer.values()))

    @property
    def largest_layer_params(self) -> float:
        return max(self._params_by_layer.values(), default=0.0)

    @property
    def comm_buffer_bytes(self) -> float:
        """The largest tp collective buffer at `microbatch_size`."""
        return largest_comm_buffer_bytes(self.graph, self.strategies, self.tp, self.microbatch_size, self.comm_lines)


def model_info(config: ModelConfig) -> dict:
    """What the strategy rules need from the config."""
    return {"head_dim": config.head_dim, "ffn_hidden": config.ffn_hidden}


def tp_solution(graph: CapturedGraph, registry: StrategyRegistry, info: Mapping, cluster: ClusterSpec,
                mesh: MeshShape, microbatch_size: int, assignment: Mapping[str, str], dtype: str,
                efficiency: Efficiency, solver: str = "", status: str = "optimal") -> TpSolution:
    """Everything the step model needs about `assignment` at this (tp, microbatch) and the mesh's etp."""
    tp, info = mesh.tp, strategy_info(info, mesh.tp, mesh.etp)
    strategies = resolve_strategies(graph, registry, info, tp, assignment)
    ctx = make_context(graph, cluster, mesh, microbatch_size, dtype, efficiency)
    return TpSolution(tp, microbatch_size, {n.name: strategies[n.name].name for n in graph.nodes}, strategies,
                      saved_tensors(graph, strategies, tp, info, ctx.efficiency.attention),
                      AxisGroup.of(mesh, "dp", cluster.gpus_per_node), solver, status,
                      comm_buffer_lines(graph, strategies, tp), graph, ctx)


def solve_tp(graph: CapturedGraph, registry: StrategyRegistry, info: Mapping, cluster: ClusterSpec, mesh: MeshShape,
             microbatch_size: int, dtype: str, efficiency: Efficiency, fold: bool, time_limit_s: float,
             fold_map: FoldedGraph | None = None) -> TpSolution:
    """The intra-op optimum for one (tp, microbatch): with `fold`, each kind of block solved once per pair
    of boundary placements and the tables chained (`autoplan.fold`; `fold_map` passes a `fold_graph(graph)`
    made before); without, one ILP over the unfolded graph. Both reach the same objective. The mesh's etp
    decides the MoE layers' strategies (`strategies.moe_strategies`)."""
    info = strategy_info(info, mesh.tp, mesh.etp)
    if fold:
        folded = fold_map if fold_map is not None else fold_graph(graph)
        solution = solve_folded(folded, registry, info, cluster, mesh, microbatch_size, dtype, efficiency=efficiency,
                                time_limit_s=time_limit_s)
        assignment, solver, status = solution.assignment, solution.solver, solution.status
    else:
        built = build_intra_op_problem(graph, registry, info, mesh.tp, cluster, mesh, microbatch_size, dtype, False,
                                       efficiency=efficiency)
        ilp = solve_ilp(built.problem, time_limit_s=time_limit_s)
        assignment, solver, status = assignment_from_choice(built, ilp.choice), ilp.solver, ilp.status
    return tp_solution(graph, registry, info, cluster, mesh, microbatch_size, assignment, dtype, efficiency,
                       solver, status)


def plan_from_assignment(graph: CapturedGraph, config: ModelConfig, cluster: ClusterSpec, mesh: MeshShape,
                         assignment: Mapping[str, str], microbatch_size: int, num_microbatches: int,
                         zero_stage: int, recompute: str, *, registry: StrategyRegistry | None = None,
                         dtype: str = "bfloat16", efficiency: Efficiency | None = None,
                         search_time_s: float = 0.0, solver: str = "", notes: tuple[str, ...] = (),
                         schedule: str = "1f1b", virtual_stages: int = 1) -> Plan:
    """The Plan of a given strategy assignment (node name -> strategy name; missing nodes replicate),
    with its predicted step time and memory; stages from the stage DP when pp > 1."""
    from autoplan.outer_search import check_config, price_given

    batch = microbatch_size * num_microbatches * mesh.batch_shards
    cfg = check_config(config, cluster, batch, graph.seq_len, mesh, microbatch_size, zero_stage, recompute, schedule,
                       virtual_stages, heads_rule=False)
    return price_given(config, cluster, batch, graph.seq_len, cfg, assignment=assignment, dtype=dtype,
                       efficiency=efficiency, registry=registry, fold=True, time_limit_s=60.0, graph=graph,
                       notes=notes, search_time_s=search_time_s, solver=solver)


def megatron_assignment(graph: CapturedGraph, registry: StrategyRegistry, tp: int, info: Mapping,
                        sequence_parallel: bool = False) -> dict[str, str]:
    """Megatron-LM's tensor parallelism as an assignment: column for q/k/v/fc/gate/up projections and
    the lm_head, row for o_proj/proj/down_proj, vocab for embeddings and cross-entropy, heads for
    attention, ffn for MoE (expert under etp < tp, its only strategy), features for pointwise ops between
    column and row, replicate elsewhere (and wherever the wanted strategy is not valid at this tp).

    With `sequence_parallel` (Korthikanti et al. 2022): row projections and embeddings reduce-scatter
    along the sequence (row_sp, vocab_sp), norms and the pointwise ops of the residual stream run on
    sequence shards, and column projections all-gather their input."""
    column = ("q_proj", "k_proj", "v_proj", "fc", "gate_proj", "up_proj", "lm_head")
    row = ("o_proj", "proj", "down_proj")
    wanted_by_kind = {"embedding": "vocab", "cross_entropy": "vocab", "attention": "heads", "moe": "ffn"}
    if sequence_parallel:
        wanted_by_kind |= {"embedding": "vocab_sp", "norm": "sequence"}
    assignment: dict[str, str] = {}
    output: dict[str, object] = {}
    for node in graph.nodes:
        leaf = node.module_path.rsplit(".", 1)[-1]
        wanted = wanted_by_kind.get(node.op_kind, "replicate")
        if node.op_kind == "linear":
            wanted = "column" if leaf in column else ("row_sp" if sequence_parallel else "row") if leaf in row else "replicate"
        placements = [output[u] for u in node.inputs]
        if node.op_kind == "elementwise" and placements and all(p == FEAT for p in placements):
            wanted = "features"
        elif node.op_kind == "elementwise" and sequence_parallel and SEQ in placements and FEAT not in placements:
            wanted = "sequence"
        valid = {s.name: s for s in registry.strategies(node, tp, info)}
        fallback = valid.get("replicate") or next(iter(valid.values()))  # a MoE under etp < tp has one strategy
        chosen = valid.get(wanted, valid.get("row", fallback) if wanted == "row_sp" else fallback)
        assignment[node.name] = chosen.name
        output[node.name] = chosen.output
    return assignment


# ---------------------------------------------------------------------------------- search


def resolve_inputs(model: ModelConfig | str, cluster: ClusterSpec | str, global_batch: int, seq_len: int, dtype: str
             ) -> tuple[ModelConfig, ClusterSpec]:
    """The model config and cluster spec from names or objects, with the batch and sequence checked."""
    config = get_model_config(model) if isinstance(model, str) else model
    cluster = parse_cluster(cluster) if isinstance(cluster, str) else cluster
    for what, value in (("global_batch", global_batch), ("seq_len", seq_len)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{what}={value!r} must be a positive integer")
    if dtype not in ("bfloat16", "float16", "float32"):
        raise ConfigError(f"dtype {dtype!r} must be bfloat16, float16 or float32")
    return config, cluster


def capture_model(config: ModelConfig, seq_len: int, dtype: str = "bfloat16") -> CapturedGraph:
    """Capture `config` once at batch 1 on the meta device (costs scale with the microbatch)."""
    return capture(build_model(config, "meta", getattr(torch, dtype)), config, 1, seq_len, getattr(torch, dtype))


def _fold_note(fold: bool, fold_map: FoldedGraph | None, graph: CapturedGraph) -> str:
    if not fold or fold_map is None:
        return "unfolded (fold=False): one ILP over the whole graph"
    return f"folded: {fold_map.describe()}, each kind solved once per pair of boundary placements, then chained"


def fold_for_search(graph: CapturedGraph, fold: bool) -> FoldedGraph | None:
    """The fold plumbing: what `solve_tp` takes as `fold_map`, made once per search context."""
    return fold_graph(graph) if fold else None


fold_note = _fold_note


def search_plans(model: ModelConfig | str, cluster: ClusterSpec | str, global_batch: int, seq_len: int, *,
                 top: int = 1, baselines: bool = True, dtype: str = "bfloat16", fold: bool = True,
                 time_limit_s: float = 60.0, progress: Progress | None = None, max_microbatch_size: int = 16,
                 options: "SearchOptions | None" = None, efficiency: Efficiency | None = None,
                 registry: StrategyRegistry | None = None, profile: "HardwareProfile | None" = None,
                 graph: CapturedGraph | None = None, info: Mapping | None = None,
                 kernels: str = "auto") -> "SearchResult":
    """The `top` best plans (distinct configurations, best first), the baselines beside them, and search
    statistics (`autoplan.outer_search`). `options` narrows the space (`autoplan.search_space.SearchOptions`);
    `max_microbatch_size` is a shorthand for its field of that name. `graph` / `info`: a graph captured
    elsewhere (e.g. `autoplan.capture_hf.capture_hf_for_planner`) and its strategy-rule info."""
    from autoplan.outer_search import run_search
    from autoplan.search_space import SearchOptions

    config, cluster = resolve_inputs(model, cluster, global_batch, seq_len, dtype)
    cluster, efficiency = calibrate(cluster, efficiency, profile, kernels)
    options = options or SearchOptions(max_microbatch_size=max_microbatch_size)
    return run_search(config, cluster, global_batch, seq_len, top=top, options=options, baselines=baselines,
                      dtype=dtype, fold=fold, time_limit_s=time_limit_s, efficiency=efficiency, registry=registry,
                      progress=progress, graph=graph, info=info)


def search(model: ModelConfig | str, cluster: ClusterSpec | str, global_batch: int, seq_len: int, *,
           dtype: str = "bfloat16", fold: bool = True, time_limit_s: float = 60.0, progress: Progress | None = None,
           max_microbatch_size: int = 16, options: "SearchOptions | None" = None,
           efficiency: Efficiency | None = None, registry: StrategyRegistry | None = None,
           profile: "HardwareProfile | None" = None, kernels: str = "auto") -> Plan:
    """The fastest plan that fits; InfeasibleError, with the numbers and what would help, when none does."""
    return search_plans(model, cluster, global_batch, seq_len, dtype=dtype, fold=fold, time_limit_s=time_limit_s,
                        progress=progress, max_microbatch_size=max_microbatch_size, options=options,
                        efficiency=efficiency, registry=registry, profile=profile, kernels=kernels).plans[0]


def estimate(model: ModelConfig | str, cluster: ClusterSpec | str, global_batch: int, seq_len: int, *,
             mesh: MeshShape, microbatch_size: int, zero_stage: int, recompute: str, dtype: str = "bfloat16",
             fold: bool = True, time_limit_s: float = 60.0, efficiency: Efficiency | None = None,
             registry: StrategyRegistry | None = None, graph: CapturedGraph | None = None,
             schedule: str = "1f1b", virtual_stages: int = 1, profile: "HardwareProfile | None" = None,
             kernels: str = "auto") -> Plan:
    """The Plan of one given configuration (any pp, dp, ep, cp, tp), the intra-op solver choosing the
    strategies; it may not fit (its notes say). Bad values raise ConfigError naming values that work."""
    from autoplan.outer_search import check_config, price_given

    config, cluster = resolve_inputs(model, cluster, global_batch, seq_len, dtype)
    cluster, efficiency = calibrate(cluster, efficiency, profile, kernels)
    cfg = check_config(config, cluster, global_batch, seq_len, mesh, microbatch_size, zero_stage, recompute, schedule,
                       virtual_stages)
    return price_given(config, cluster, global_batch, seq_len, cfg, assignment=None, dtype=dtype, efficiency=efficiency,
                       registry=registry, fold=fold, time_limit_s=time_limit_s, graph=graph,
                       notes=("estimate of a given configuration",))
