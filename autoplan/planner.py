"""The planner: capture once, solve one intra-op ILP per (tp, microbatch), price every ZeRO stage and
recompute policy, keep what fits, return the fastest as a Plan.

Search space (this issue): pp = cp = ep = 1; tp over the divisors of the GPUs per node (tensor
parallelism stays inside a node) that divide the world size; dp = world / tp, which must divide the
global batch; microbatch size over the divisors of global_batch / dp up to `max_microbatch_size`;
ZeRO 0-3; recompute none / selective / full.

Step time model, per optimizer step of n = num_microbatches microbatches (pp = 1, no bubble):

    compute_s       = n * (F + B + R_c)          F, B: forward / backward compute of one microbatch
                                                  (backward FLOPs 2x forward, inside the op costs);
                                                  R_c: recomputed forward (full: every layer;
                                                  selective: attention and pointwise ops)
    communication_s = n * (T_f + T_b + R_t)      tp collectives of ops and resharding, all exposed
                                                  (Megatron's TP comm is on the critical path);
                                                  R_t: the layers' forward tp comm under full recompute
                    + exposed dp gradient sync    collective - its overlap window, floored at 0:
        ZeRO 0: all-reduce(grads)                  overlapped with the last microbatch's backward
        ZeRO 1: reduce-scatter(grads)              same window;  + all-gather(weights) after the
                                                  optimizer, overlapped with the next first forward
        ZeRO 2: reduce-scatter(grads) per microbatch, each in its backward; all-gather as ZeRO 1
        ZeRO 3: per microbatch all-gather(weights) in its forward, all-gather + reduce-scatter in
                its backward
        dp collectives run in per-layer buckets (num_layers + 1), so their latency terms count.
    optimizer_s     = Adam, memory bound: (2 * optimizer + grad + weight) bytes per local parameter
                      (local: / dp under ZeRO >= 1) at HBM bandwidth
    MFU             = 3 * forward FLOPs * global_batch / (step_time * world * peak bf16), no recompute
    tokens_per_s    = global_batch * seq_len / step_time

Assumptions: dp traffic (inter-node when tp fills a node) and tp traffic (NVLink) do not contend;
compute overlaps dp communication perfectly inside its window.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Mapping

import torch

import autoplan
from autoplan.capture import CapturedGraph, capture
from autoplan.cluster import ClusterSpec, parse_cluster
from autoplan.cost_model.comm import AxisGroup, group_collective_time_s
from autoplan.cost_model.compute import Efficiency, op_time_s
from autoplan.cost_model.intra_op import (AssignmentCost, assignment_from_choice, build_intra_op_problem,
                                          fold_mapping, make_context, price_assignment, resolve_strategies)
from autoplan.cost_model.memory import (SavedTensor, activation_bytes, is_batched, largest_comm_buffer_bytes,
                                        model_state_bytes, param_placements, parameter_count_by_layer,
                                        saved_tensors, state_bytes_for, temporary_bytes)
from autoplan.errors import ConfigError, InfeasibleError
from autoplan.mesh import MeshShape
from autoplan.models import build_model, get_model_config
from autoplan.models.config import ModelConfig
from autoplan.placement import Replicate, Shard
from autoplan.plan import (RECOMPUTE_POLICIES, MemoryBreakdown, ModelRef, OpPlacement, ParamPlacement, Plan,
                           Predicted, Provenance, StageSpec, TimeBreakdown)
from autoplan.solver.ilp import solve_ilp
from autoplan.strategies import FEAT, Strategy, StrategyRegistry, default_registry

Progress = Callable[[str], None]
ZERO_STAGES = (0, 1, 2, 3)


# ---------------------------------------------------------------------------------- pricing


@dataclass(frozen=True)
class TpSolution:
    """One (tp, microbatch) point: the strategies chosen and what the step model needs of them."""

    tp: int
    microbatch_size: int
    assignment: dict[str, str]
    strategies: dict[str, Strategy]
    cost: AssignmentCost  # seconds per microbatch
    saved: tuple[SavedTensor, ...]  # activations at the capture batch
    local_params: float  # parameters per rank after tp
    largest_layer_params: float
    comm_buffer_bytes: float
    dp_group: AxisGroup
    solver: str = ""
    status: str = "optimal"


@dataclass(frozen=True)
class Candidate:
    """A priced configuration."""

    mesh: MeshShape
    microbatch_size: int
    num_microbatches: int
    zero_stage: int
    recompute: str
    time: TimeBreakdown
    memory: MemoryBreakdown

    @property
    def step_time_s(self) -> float:
        return self.time.total_s()

    @property
    def peak_memory_bytes(self) -> float:
        return self.memory.total_bytes()

    def describe(self) -> str:
        return (f"{self.mesh}, microbatch {self.microbatch_size} x {self.num_microbatches}, ZeRO-{self.zero_stage}, "
                f"recompute {self.recompute}")


def model_info(config: ModelConfig) -> dict:
    """What the strategy rules need from the config."""
    return {"head_dim": config.head_dim, "ffn_hidden": config.ffn_hidden}


def tp_solution(graph: CapturedGraph, registry: StrategyRegistry, info: Mapping, cluster: ClusterSpec,
                mesh: MeshShape, microbatch_size: int, assignment: Mapping[str, str], dtype: str,
                efficiency: Efficiency, solver: str = "", status: str = "optimal") -> TpSolution:
    """Everything the step model needs about `assignment` at this (tp, microbatch)."""
    tp = mesh.tp
    strategies = resolve_strategies(graph, registry, info, tp, assignment)
    ctx = make_context(graph, cluster, mesh, microbatch_size, dtype, efficiency)
    by_layer = parameter_count_by_layer(graph, strategies, tp)
    return TpSolution(tp, microbatch_size, {n.name: strategies[n.name].name for n in graph.nodes}, strategies,
                      price_assignment(graph, strategies, ctx), saved_tensors(graph, strategies, tp, info),
                      float(sum(by_layer.values())), max(by_layer.values(), default=0.0),
                      largest_comm_buffer_bytes(graph, strategies, tp, microbatch_size),
                      AxisGroup.of(mesh, "dp", cluster.gpus_per_node), solver, status)


def solve_tp(graph: CapturedGraph, registry: StrategyRegistry, info: Mapping, cluster: ClusterSpec, mesh: MeshShape,
             microbatch_size: int, dtype: str, efficiency: Efficiency, fold: bool, time_limit_s: float,
             fold_map: Mapping[str, str] | None = None) -> TpSolution:
    """The ILP's strategies for one (tp, microbatch)."""
    built = build_intra_op_problem(graph, registry, info, mesh.tp, cluster, mesh, microbatch_size, dtype, fold,
                                   efficiency=efficiency, fold_map=fold_map)
    solution = solve_ilp(built.problem, time_limit_s=time_limit_s)
    assignment = assignment_from_choice(built, solution.choice)
    return tp_solution(graph, registry, info, cluster, mesh, microbatch_size, assignment, dtype, efficiency,
                       solution.solver, solution.status)


def _dp_s(kind: str, nbytes: float, cluster: ClusterSpec, group: AxisGroup, buckets: int) -> float:
    return buckets * group_collective_time_s(kind, nbytes / buckets, cluster, group)


def _exposed_dp_s(sol: TpSolution, cluster: ClusterSpec, n_micro: int, zero: int,
                  dtype: str, buckets: int, bwd_window_s: float) -> float:
    """dp gradient / weight traffic not hidden behind compute (module docstring)."""
    state = state_bytes_for(dtype)
    grads, weights = state.grad * sol.local_params, state.weight * sol.local_params
    fwd_window_s = sol.cost.fwd_compute_s
    if zero == 0:
        return max(0.0, _dp_s("all_reduce", grads, cluster, sol.dp_group, buckets) - bwd_window_s)
    rs = _dp_s("reduce_scatter", grads, cluster, sol.dp_group, buckets)
    ag = _dp_s("all_gather", weights, cluster, sol.dp_group, buckets)
    if zero == 1:
        return max(0.0, rs - bwd_window_s) + max(0.0, ag - fwd_window_s)
    if zero == 2:
        return n_micro * max(0.0, rs - bwd_window_s) + max(0.0, ag - fwd_window_s)
    return n_micro * (max(0.0, ag - fwd_window_s) + max(0.0, ag + rs - bwd_window_s))


def price(sol: TpSolution, graph: CapturedGraph, cluster: ClusterSpec, mesh: MeshShape, num_microbatches: int,
          zero_stage: int, recompute: str, dtype: str, efficiency: Efficiency,
          info: Mapping | None = None) -> Candidate:
    """Step time and peak memory per rank of one configuration (module docstring)."""
    if recompute not in RECOMPUTE_POLICIES:
        raise ConfigError(f"recompute {recompute!r} must be one of {RECOMPUTE_POLICIES}")
    cost, n = sol.cost, num_microbatches
    re_compute = {"none": 0.0, "selective": cost.selective_fwd_compute_s, "full": cost.layer_fwd_compute_s}[recompute]
    re_comm = cost.layer_fwd_comm_s if recompute == "full" else 0.0
    buckets = len(graph.layers()) + 1
    dp_exposed = _exposed_dp_s(sol, cluster, n, zero_stage, dtype, buckets, cost.bwd_compute_s + re_compute)
    state = state_bytes_for(dtype)
    opt_params = sol.local_params / (mesh.dp if zero_stage >= 1 else 1)
    opt_bytes = (2 * state.optimizer + state.grad + state.weight) * opt_params
    optimizer_s = op_time_s(0.0, opt_bytes, cluster.device, dtype, efficiency)
    times = TimeBreakdown(compute_s=n * (cost.fwd_compute_s + cost.bwd_compute_s + re_compute),
                          communication_s=n * (cost.fwd_comm_s + cost.bwd_comm_s + re_comm) + dp_exposed,
                          bubble_s=0.0, optimizer_s=optimizer_s)
    weights, grads, optimizer = model_state_bytes(sol.local_params, mesh.dp, zero_stage, state)
    activations = activation_bytes(graph, sol.strategies, sol.tp, sol.microbatch_size, recompute, info, sol.saved)
    temporary = temporary_bytes(sol.comm_buffer_bytes, sol.largest_layer_params, zero_stage, state)
    memory = MemoryBreakdown(weights, grads, optimizer, activations, temporary)
    return Candidate(mesh, sol.microbatch_size, num_microbatches, zero_stage, recompute, times, memory)


# ---------------------------------------------------------------------------------- plans


def _predicted(candidate: Candidate, graph: CapturedGraph, cluster: ClusterSpec, global_batch: int,
               dtype: str) -> Predicted:
    step = candidate.step_time_s
    model_flops = 3 * graph.total_fwd_flops() / graph.batch_size * global_batch
    peak = cluster.device.peak_flops_for(dtype) * cluster.world_size
    return Predicted(step_time_s=step, mfu=model_flops / (step * peak),
                     tokens_per_s=global_batch * graph.seq_len / step,
                     peak_memory_bytes=candidate.peak_memory_bytes, memory=candidate.memory, time=candidate.time)


def _placements(graph: CapturedGraph, strategies: Mapping[str, Strategy], zero_stage: int
                ) -> tuple[tuple[ParamPlacement, ...], tuple[OpPlacement, ...]]:
    dp_param = Shard(0) if zero_stage == 3 else Replicate()
    params: dict[str, ParamPlacement] = {}
    ops = []
    for node in graph.nodes:
        strategy = strategies[node.name]
        for name, _, placement in param_placements(node, strategy):
            params.setdefault(name, ParamPlacement(name, (("tp", placement), ("dp", dp_param))))
        output = ()
        if node.output is not None:
            output = (("tp", strategy.output),)
            if is_batched(node.output, graph.batch_size):
                output += (("dp", Shard(0)),)
        ops.append(OpPlacement(node.name, strategy.name, output))
    return tuple(params.values()), tuple(ops)


def _uncovered_note(graph: CapturedGraph, registry: StrategyRegistry) -> tuple[str, ...]:
    kinds = sorted({n.op_kind for n in graph.nodes if not registry.has_rule(n.op_kind)})
    if not kinds:
        return ()
    count = sum(1 for n in graph.nodes if n.op_kind in kinds)
    return (f"{count} ops of kinds {kinds} have no sharding rule and run replicated",)


def plan_from_assignment(graph: CapturedGraph, config: ModelConfig, cluster: ClusterSpec, mesh: MeshShape,
                         assignment: Mapping[str, str], microbatch_size: int, num_microbatches: int,
                         zero_stage: int, recompute: str, *, registry: StrategyRegistry | None = None,
                         dtype: str = "bfloat16", efficiency: Efficiency | None = None,
                         search_time_s: float = 0.0, solver: str = "", notes: tuple[str, ...] = ()) -> Plan:
    """The Plan of a given strategy assignment (node name -> strategy name; missing nodes replicate),
    with its predicted step time and memory."""
    _check_mesh(mesh, cluster)
    registry = registry or default_registry()
    efficiency = efficiency or Efficiency()
    info = model_info(config)
    sol = tp_solution(graph, registry, info, cluster, mesh, microbatch_size, assignment, dtype, efficiency, solver)
    return _plan(graph, config, cluster, sol, mesh, num_microbatches, zero_stage, recompute, dtype, efficiency,
                 registry, search_time_s, notes)


def _plan(graph: CapturedGraph, config: ModelConfig, cluster: ClusterSpec, sol: TpSolution, mesh: MeshShape,
          num_microbatches: int, zero_stage: int, recompute: str, dtype: str, efficiency: Efficiency,
          registry: StrategyRegistry, search_time_s: float, notes: tuple[str, ...]) -> Plan:
    candidate = price(sol, graph, cluster, mesh, num_microbatches, zero_stage, recompute, dtype, efficiency,
                      model_info(config))
    global_batch = sol.microbatch_size * num_microbatches * mesh.dp
    params, ops = _placements(graph, sol.strategies, zero_stage)
    fits = candidate.peak_memory_bytes <= cluster.device.memory_bytes
    notes = notes + _uncovered_note(graph, registry) + (() if fits else (
        f"does not fit: {candidate.peak_memory_bytes / 1e9:.1f} GB per GPU > {cluster.device.memory_bytes / 1e9:.1f} GB",))
    return Plan(
        model=ModelRef(config.name, config.fingerprint(), config.num_layers, config.num_parameters()),
        cluster=cluster, mesh=mesh, microbatch_size=sol.microbatch_size, num_microbatches=num_microbatches,
        global_batch=global_batch, seq_len=graph.seq_len, zero_stage=zero_stage, recompute=recompute,
        schedule="1f1b", stages=(StageSpec(0, 0, config.num_layers),), params=params, ops=ops,
        predicted=_predicted(candidate, graph, cluster, global_batch, dtype),
        provenance=Provenance(autoplan.__version__, search_time_s, sol.solver, notes), dtype=dtype)


def megatron_assignment(graph: CapturedGraph, registry: StrategyRegistry, tp: int, info: Mapping) -> dict[str, str]:
    """Megatron-LM's tensor parallelism as an assignment: column for q/k/v/fc/gate/up projections and
    the lm_head, row for o_proj/proj/down_proj, vocab for embeddings and cross-entropy, heads for
    attention, ffn for MoE, features for pointwise ops between column and row, replicate elsewhere
    (and wherever the wanted strategy is not valid at this tp)."""
    column = ("q_proj", "k_proj", "v_proj", "fc", "gate_proj", "up_proj", "lm_head")
    row = ("o_proj", "proj", "down_proj")
    wanted_by_kind = {"embedding": "vocab", "cross_entropy": "vocab", "attention": "heads", "moe": "ffn"}
    assignment: dict[str, str] = {}
    output: dict[str, object] = {}
    for node in graph.nodes:
        leaf = node.module_path.rsplit(".", 1)[-1]
        wanted = wanted_by_kind.get(node.op_kind, "replicate")
        if node.op_kind == "linear":
            wanted = "column" if leaf in column else "row" if leaf in row else "replicate"
        if node.op_kind == "elementwise" and node.inputs and all(output[u] == FEAT for u in node.inputs):
            wanted = "features"
        valid = {s.name: s for s in registry.strategies(node, tp, info)}
        chosen = valid.get(wanted, valid["replicate"])
        assignment[node.name] = chosen.name
        output[node.name] = chosen.output
    return assignment


# ---------------------------------------------------------------------------------- search


def _check_mesh(mesh: MeshShape, cluster: ClusterSpec) -> None:
    if mesh.world_size != cluster.world_size:
        raise ConfigError(f"mesh {mesh} has {mesh.world_size} ranks but the cluster {cluster.describe()} has "
                          f"{cluster.world_size}")
    if mesh.pp * mesh.cp * mesh.ep != 1:
        raise ConfigError(f"mesh {mesh}: pp, cp and ep must be 1 for now (pipeline, context and expert "
                          f"parallelism arrive with later issues)")


def _resolve(model: ModelConfig | str, cluster: ClusterSpec | str, global_batch: int, seq_len: int, dtype: str
             ) -> tuple[ModelConfig, ClusterSpec]:
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


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _search_grid(cluster: ClusterSpec, global_batch: int, max_microbatch_size: int) -> list[tuple[int, int, int]]:
    """(tp, dp, microbatch) triples of the search space (module docstring)."""
    grid = []
    for tp in _divisors(cluster.gpus_per_node):
        dp = cluster.world_size // tp
        if cluster.world_size % tp or global_batch % dp:
            continue
        grid += [(tp, dp, mbs) for mbs in _divisors(global_batch // dp) if mbs <= max_microbatch_size]
    if not grid:
        raise ConfigError(f"global batch {global_batch} is not divisible by dp = world / tp for any tp dividing "
                          f"{cluster.gpus_per_node} GPUs per node (world {cluster.world_size}); use a global batch "
                          f"that is a multiple of {cluster.world_size // cluster.gpus_per_node}")
    return grid


def _infeasible(candidates: list[Candidate], cluster: ClusterSpec, config: ModelConfig) -> InfeasibleError:
    best = min(candidates, key=lambda c: (c.peak_memory_bytes, c.step_time_s))
    need, have, m = best.peak_memory_bytes, cluster.device.memory_bytes, best.memory
    knobs = [f"more GPUs (about {math.ceil(need / have * cluster.num_nodes)} nodes of {cluster.gpus_per_node})"]
    knobs += ["ZeRO-3"] if best.zero_stage < 3 and best.mesh.dp > 1 else []
    knobs += ["full recompute"] if best.recompute != "full" else []
    knobs += ["a smaller microbatch"] if best.microbatch_size > 1 else ["a shorter sequence"]
    return InfeasibleError(
        f"no configuration of {config.name} fits {cluster.describe()}: the smallest needs {need / 1e9:.1f} GB per GPU "
        f"({best.describe()}: parameters {m.parameters_bytes / 1e9:.1f}, gradients {m.gradients_bytes / 1e9:.1f}, "
        f"optimizer {m.optimizer_bytes / 1e9:.1f}, activations {m.activations_bytes / 1e9:.1f}, temporary "
        f"{m.temporary_bytes / 1e9:.1f} GB) but each {cluster.device.name} has {have / 1e9:.1f} GB: {(need - have) / 1e9:.1f} GB "
        f"over. What would help: {', '.join(knobs)}; pipeline parallelism arrives with a later issue.")


def _fold_note(fold: bool, fold_map: Mapping[str, str] | None, graph: CapturedGraph) -> str:
    if not fold:
        return "unfolded (fold=False)"
    if fold_map is None:
        return "unfolded: the layers differ in structure, so they were not folded"
    return f"folded: {len(graph.layers())} identical layers solved as one"


def search(model: ModelConfig | str, cluster: ClusterSpec | str, global_batch: int, seq_len: int, *,
           dtype: str = "bfloat16", fold: bool = True, time_limit_s: float = 60.0, progress: Progress | None = None,
           max_microbatch_size: int = 16, efficiency: Efficiency | None = None,
           registry: StrategyRegistry | None = None) -> Plan:
    """The fastest plan that fits (module docstring); InfeasibleError, with the numbers, when none does."""
    start = time.perf_counter()
    report = progress or (lambda message: None)
    config, cluster = _resolve(model, cluster, global_batch, seq_len, dtype)
    registry, efficiency, info = registry or default_registry(), efficiency or Efficiency(), model_info(config)
    grid = _search_grid(cluster, global_batch, max_microbatch_size)
    report(f"capturing {config.name} at seq {seq_len}")
    graph = capture_model(config, seq_len, dtype)
    fold_map = fold_mapping(graph) if fold else None
    candidates: list[tuple[Candidate, TpSolution]] = []
    for tp, dp, mbs in grid:
        mesh = MeshShape(dp=dp, tp=tp)
        report(f"solving the intra-op ILP for tp={tp}, microbatch={mbs}")
        sol = solve_tp(graph, registry, info, cluster, mesh, mbs, dtype, efficiency, fold, time_limit_s, fold_map)
        n_micro = global_batch // (dp * mbs)
        for zero in ZERO_STAGES:
            for recompute in RECOMPUTE_POLICIES:
                candidate = price(sol, graph, cluster, mesh, n_micro, zero, recompute, dtype, efficiency, info)
                candidates.append((candidate, sol))
    fitting = [(c, s) for c, s in candidates if c.peak_memory_bytes <= cluster.device.memory_bytes]
    if not fitting:
        raise _infeasible([c for c, _ in candidates], cluster, config)
    best, sol = min(fitting, key=lambda cs: (cs[0].step_time_s, cs[0].mesh.tp, cs[0].microbatch_size,
                                               cs[0].zero_stage, RECOMPUTE_POLICIES.index(cs[0].recompute)))
    notes = (f"searched {len(candidates)} configurations (tp in {sorted({g[0] for g in grid})}, microbatch in "
             f"{sorted({g[2] for g in grid})}, ZeRO 0-3, recompute none/selective/full); {len(fitting)} fit in "
             f"{cluster.device.memory_bytes / 1e9:.0f} GB",
             "pp = cp = ep = 1: pipeline, context and expert parallelism are not searched yet",
             f"intra-op ILP {_fold_note(fold, fold_map, graph)}; status {sol.status}")
    report(f"best: {best.describe()}, {best.step_time_s:.3f} s per step")
    return _plan(graph, config, cluster, sol, best.mesh, best.num_microbatches, best.zero_stage, best.recompute,
                 dtype, efficiency, registry, time.perf_counter() - start, notes)


def estimate(model: ModelConfig | str, cluster: ClusterSpec | str, global_batch: int, seq_len: int, *,
             mesh: MeshShape, microbatch_size: int, zero_stage: int, recompute: str, dtype: str = "bfloat16",
             fold: bool = True, time_limit_s: float = 60.0, efficiency: Efficiency | None = None,
             registry: StrategyRegistry | None = None, graph: CapturedGraph | None = None) -> Plan:
    """The Plan of one given configuration, the ILP choosing the strategies; it may not fit (its notes say)."""
    start = time.perf_counter()
    config, cluster = _resolve(model, cluster, global_batch, seq_len, dtype)
    _check_mesh(mesh, cluster)
    if global_batch % (mesh.dp * microbatch_size):
        raise ConfigError(f"global_batch {global_batch} is not divisible by dp {mesh.dp} x microbatch {microbatch_size}")
    registry, efficiency, info = registry or default_registry(), efficiency or Efficiency(), model_info(config)
    graph = graph or capture_model(config, seq_len, dtype)
    sol = solve_tp(graph, registry, info, cluster, mesh, microbatch_size, dtype, efficiency, fold, time_limit_s)
    n_micro = global_batch // (mesh.dp * microbatch_size)
    return _plan(graph, config, cluster, sol, mesh, n_micro, zero_stage, recompute, dtype, efficiency, registry,
                 time.perf_counter() - start, ("estimate of a given configuration",))
