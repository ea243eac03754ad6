"""The search context: one model, cluster, global batch and sequence, with the captured graph and every
intra-op solution and priced block found so far, shared by the outer search (`solver.search`) and the
baselines (`solver.baselines`); and the Plan of a priced configuration.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from fractions import Fraction
from typing import Callable, Mapping

from autoplan import __version__
from autoplan.capture.blocks import fold_graph
from autoplan.capture.tp_roles import tp_roles
from autoplan.capture.graph import CapturedGraph
from autoplan.cluster import ClusterSpec
from autoplan.cost_model.assignment import tp_solution
from autoplan.cost_model.comm import COLLECTIVE_KINDS, AxisGroup
from autoplan.cost_model.compute import Efficiency
from autoplan.cost_model.intra_op import CostContext, attention_head_dim, attention_rope, make_context
from autoplan.cost_model.intra_op_problem import graph_strategies
from autoplan.cost_model.layer_runs import LayerRuns
from autoplan.cost_model.memory import is_batched, param_placements
from autoplan.cost_model.parts import BlockCosts, SolutionParts, block_costs, solution_parts
from autoplan.recompute_policy import captured_op_family
from autoplan.cost_model.step import Priced, StepEnv, StepModel
from autoplan.errors import ConfigError
from autoplan.mesh import MeshShape
from autoplan.models.config import ModelConfig
from autoplan.placement import Replicate, Shard
from autoplan.plan import ModelRef, OpPlacement, ParamPlacement, Plan, Predicted, Provenance, StageSpec
from autoplan.solver.intra_op import megatron_assignment, solve_assignment
from autoplan.cost_model.step_config import Config
from autoplan.solver.space import FlopsPerSequence
from autoplan.solver.stages import partition_bounds
from autoplan.strategies import Strategy, StrategyRegistry, default_registry, is_expert_weight, strategy_info

GraphSource = CapturedGraph | Callable[[], CapturedGraph]  # a graph, or what captures it on first need

VARIANT_ILP = "ilp"
VARIANT_MEGATRON = "megatron-sp"


class ProgressMessage(str):
    """A progress line that also says how far the search is: `done` of `total` intra-op keys."""

    done: int
    total: int

    def __new__(cls, text: str, done: int = 0, total: int = 0) -> "ProgressMessage":
        message = super().__new__(cls, text)
        message.done, message.total = done, total
        return message


Progress = Callable[[str], None]


class SearchContext:
    """One model, cluster, global batch and sequence: the captured graph and what was solved so far."""

    def __init__(self, config: ModelConfig, cluster: ClusterSpec, global_batch: int, seq_len: int, *,
                 dtype: str = "bfloat16", efficiency: Efficiency | None = None, registry: StrategyRegistry | None = None,
                 fold: bool = True, time_limit_s: float = 60.0, graph: GraphSource, info: Mapping | None = None
                 ) -> None:
        self.config, self.cluster, self.global_batch, self.seq_len, self.dtype = config, cluster, global_batch, seq_len, dtype
        self.efficiency = (efficiency or Efficiency()).resolved(cluster.device)  # one GEMM curve for the search
        self.registry = registry or default_registry()
        # a pre-captured graph (e.g. a Hugging Face export) brings its own strategy-rule info
        self.info = dict(info) if info is not None else config.rule_info()
        self.fold, self.time_limit_s = fold, time_limit_s
        self.graph = graph() if callable(graph) else graph
        self.head_dim, self.rope = attention_head_dim(self.graph), attention_rope(self.graph)
        self.fold_map = fold_graph(self.graph) if fold else None
        self._layer_runs: LayerRuns | None = None
        self.steps = StepModel(StepEnv(config, cluster, seq_len, dtype, self.efficiency, int(self.info.get("head_dim") or 0)), partition_bounds)
        self._blocks: dict[tuple, BlockCosts] = {}
        self._solutions: dict[tuple, SolutionParts] = {}
        self._by_assignment: dict[tuple, SolutionParts] = {}  # (tp, etp, assignment): `_parts`
        self._assignments: dict[tuple, dict[str, str]] = {}
        self._roles: dict[str, str] | None = None  # `capture.tp_roles` of the graph, for Megatron's assignments
        self._spread: dict[tuple, AxisGroup | None] = {}
        self._no_less: dict[AxisGroup, bool] = {}
        self.ilp_solves = 0

    def flops_per_sequence(self) -> FlopsPerSequence:
        g, batch = self.graph, self.graph.batch_size
        families: dict[str, float] = {}
        for n in g.nodes:
            if n.layer is not None:
                family = captured_op_family(n.op_kind)
                families[family] = families.get(family, 0.0) + n.fwd_flops / batch
        layers = len({n.layer for n in g.nodes if n.layer is not None})
        return FlopsPerSequence(g.total_fwd_flops() / batch, g.total_bwd_flops() / batch, sum(families.values()),
                                tuple(sorted(families.items())), layers)

    def assignment(self, variant: str, tp: int, etp: int | None = None) -> dict[str, str]:
        if variant != VARIANT_MEGATRON:
            raise ConfigError(f"unknown strategy variant {variant!r}; expected {VARIANT_ILP!r} or {VARIANT_MEGATRON!r}")
        etp = tp if etp is None else etp
        if (variant, tp, etp) not in self._assignments:
            if self._roles is None:  # the same at every tp: a deep model's retries ask at several
                self._roles = tp_roles(self.graph)
            self._assignments[(variant, tp, etp)] = megatron_assignment(
                self.graph, self.registry, tp, strategy_info(self.info, tp, etp), sequence_parallel=True,
                roles=self._roles)
        return self._assignments[(variant, tp, etp)]

    def solution(self, tp: int, microbatch: int, variant: str = VARIANT_ILP,
                 assignment: Mapping[str, str] | None = None, etp: int | None = None) -> SolutionParts:
        """The tp strategies at a whole `microbatch` (cached): the intra-op solver's, or an assignment's;
        `etp` (None: tp) decides the MoE layers' strategies."""
        etp = tp if etp is None else etp
        key = (tp, microbatch, variant, tuple(sorted(assignment.items())) if assignment is not None else None, etp)
        if key not in self._solutions:
            # tp innermost: the solver sees its own group
            mesh = MeshShape(dp=self.cluster.world_size // tp, tp=tp, etp=etp)
            if variant == VARIANT_ILP and 1 < etp < tp:
                chosen, solver, status = self._folded_ilp_choice(tp, microbatch)
            elif variant == VARIANT_ILP:
                chosen, solver, status = solve_assignment(self.graph, self.registry, self.info, self.cluster, mesh,
                                                          microbatch, self.dtype, self.efficiency, self.fold,
                                                          self.time_limit_s, self.fold_map)
                self.ilp_solves += 1
            else:
                chosen = dict(assignment) if assignment is not None else self.assignment(variant, tp, etp)
                solver, status = variant, "optimal"
            self._solutions[key] = self._parts(mesh, microbatch, chosen, solver, status)
        return self._solutions[key]

    def _parts(self, mesh: MeshShape, microbatch: int, chosen: Mapping[str, str], solver: str, status: str
               ) -> SolutionParts:
        """An assignment split into parts at `microbatch`. Its strategies, saved tensors and tallies do not
        depend on the microbatch (`block` prices the parts at each), and the solver often chooses the same
        assignment at several: those passes over every node run once per distinct assignment, each
        microbatch getting its own TpSolution."""
        shared = (mesh.tp, mesh.etp, tuple(sorted(chosen.items())))
        if shared not in self._by_assignment:
            sol = tp_solution(self.graph, self.registry, self.info, self.cluster, mesh, microbatch, chosen,
                              self.dtype, self.efficiency, solver, status, lines=False)
            self._by_assignment[shared] = solution_parts(self.graph, sol, self.layer_runs())
        parts = self._by_assignment[shared]
        ctx = make_context(self.graph, self.cluster, mesh, microbatch, self.dtype, self.efficiency)
        sol = dataclasses.replace(parts.solution, microbatch_size=microbatch, solver=solver, status=status, ctx=ctx)
        return dataclasses.replace(parts, solution=sol)

    def layer_runs(self) -> LayerRuns:
        """The graph's runs of alike layers (`cost_model.layer_runs`), found on first need."""
        if self._layer_runs is None:
            self._layer_runs = LayerRuns.of(self.graph, self.fold_map or fold_graph(self.graph))
        return self._layer_runs

    def _folded_ilp_choice(self, tp: int, microbatch: int) -> tuple[dict[str, str], str, str]:
        """The intra-op optimum under 1 < etp < tp without another ILP: every etp < tp gives each MoE its one
        strategy "expert" with the same placements, so the problems differ by a constant (the MoE's expert GEMM
        width) and share their argmin; the etp = 1 solve's choice (priced at this etp by the caller)."""
        whole = self.solution(tp, microbatch, VARIANT_ILP, etp=1).solution
        return whole.assignment, whole.solver, whole.status

    def block(self, tp: int, microbatch: Fraction, variant: str = VARIANT_ILP,
              assignment: Mapping[str, str] | None = None, mesh: MeshShape | None = None,
              etp: int | None = None) -> BlockCosts:
        """The tp solution for `microbatch` sequences per rank (mbs / cp, maybe below 1), priced part by part
        at exactly that microbatch (cached). The strategies are solved at that microbatch too, the tokens a rank
        really holds: under cp > mbs a rank holds a slice of one sequence, and a whole one (16x the tokens at cp
        16, microbatch 1) made splitting the tokens and replicating the weights look cheaper.
        `mesh`: the configuration's, whose order may spread its tp groups over nodes (cp or ep innermost): the
        tp communication of the same strategies (solved with tp inside a node) is then priced over those links.
        `etp`: the experts' tensor-parallel degree (None: tp)."""
        spread = self.tp_spread(mesh) if mesh is not None else None
        etp = tp if etp is None else etp
        key = (tp, microbatch, variant, tuple(sorted(assignment.items())) if assignment is not None else None, spread,
               etp)
        if key not in self._blocks:
            parts = self.solution(tp, microbatch, variant, assignment, etp)
            mesh = mesh if spread is not None else MeshShape(dp=self.cluster.world_size // tp, tp=tp)
            ctx = CostContext(self.cluster, mesh, self.dtype, self.efficiency, self.graph.batch_size,
                              float(microbatch) / self.graph.batch_size, head_dim=self.head_dim, rope=self.rope)
            self._blocks[key] = block_costs(self.graph, parts, ctx, variant, microbatch)
        return self._blocks[key]

    def tp_spread(self, mesh: MeshShape) -> AxisGroup | None:
        """The tp group of `mesh` when it leaves one node (its order), else None (cached)."""
        key = (mesh.pp, mesh.dp, mesh.ep, mesh.cp, mesh.tp, mesh.order)
        if key not in self._spread:
            group = AxisGroup.of(mesh, "tp", self.cluster.gpus_per_node)
            self._spread[key] = group if group.nodes > 1 else None
        return self._spread[key]

    def costs_no_less(self, group: AxisGroup) -> bool:
        """Whether every collective over `group` takes at least as long as over a group of its size inside
        one node, at every size (the times are affine in the bytes: compare intercept and slope)."""
        inside = AxisGroup(group.size, 1, group.size)
        if group not in self._no_less:
            at = [[self.efficiency.collective_s(kind, b, self.cluster, g) for b in (0.0, 1e9)]
                  for kind in COLLECTIVE_KINDS for g in (group, inside)]
            self._no_less[group] = all(s0 >= i0 and s1 - s0 >= i1 - i0 for (s0, s1), (i0, i1) in zip(at[::2], at[1::2]))
        return self._no_less[group]

    def price(self, cfg: Config, variant: str = VARIANT_ILP, assignment: Mapping[str, str] | None = None) -> Priced:
        return self.steps.price(self.block(cfg.tp, cfg.rank_microbatch, variant, assignment, cfg.mesh, cfg.etp), cfg)

    def plan(self, priced: Priced, search_time_s: float = 0.0, notes: tuple[str, ...] = (),
             assignment: Mapping[str, str] | None = None, solver: str | None = None) -> Plan:
        """The Plan of a priced configuration (placements from its tp solution)."""
        cfg = priced.config
        sol = self.block(cfg.tp, cfg.rank_microbatch, priced.variant, assignment, cfg.mesh, cfg.etp).solution
        params, ops = _placements(self.graph, sol.strategies, cfg)
        fits = () if priced.fits else (f"does not fit: {priced.peak_memory_bytes / 1e9:.1f} GB per GPU > "
                                        f"{self.cluster.device.memory_bytes / 1e9:.1f} GB",)
        c = self.config
        return Plan(
            model=ModelRef(c.name, c.fingerprint(), c.num_layers, c.num_parameters()), cluster=self.cluster,
            mesh=cfg.mesh, microbatch_size=cfg.microbatch_size, num_microbatches=cfg.num_microbatches,
            global_batch=self.global_batch, seq_len=self.seq_len, zero_stage=cfg.zero_stage, recompute=cfg.recompute,
            schedule=cfg.schedule, stages=tuple(StageSpec(s, a, b, chunk) for s, chunk, a, b in priced.stages),
            params=params, ops=ops, predicted=self.predicted(priced),
            provenance=Provenance(__version__, search_time_s, sol.solver if solver is None else solver,
                                  notes + _uncovered_note(self.graph, self.registry)
                                  + self._replicated_note(cfg.tp, cfg.etp) + fits
                                  + (self.efficiency.kernels.note(self.efficiency.memory),
                                     self.efficiency.floor_note())),
            dtype=self.dtype, kernels=self.efficiency.kernels.option, precision=cfg.precision)

    def _replicated_note(self, tp: int, etp: int) -> tuple[str, ...]:
        """The ops that do work (FLOPs or bytes) and that no strategy rule can shard at this tp, so they run
        whole on every tp rank, by kind and target: count and share of the forward FLOPs, every kind listed
        (largest share first), so a plan says all it could not shard."""
        if tp == 1:
            return ()
        options = graph_strategies(self.graph, self.registry, strategy_info(self.info, tp, etp), tp)
        shares: dict[str, list] = {}
        for node in self.graph.nodes:
            if (node.fwd_flops or node.fwd_bytes) and all(s.name == "replicate" for s in options[node.name]):
                entry = shares.setdefault(f"{node.op_kind} {node.target}", [0, 0.0])
                entry[0], entry[1] = entry[0] + 1, entry[1] + node.fwd_flops
        if not shares:
            return ()
        total = self.graph.total_fwd_flops()
        largest = sorted(shares.items(), key=lambda kv: (-kv[1][1], -kv[1][0], kv[0]))
        listed = ", ".join(f"{count} x {op} ({flops / total:.1%} of forward FLOPs)" for op, (count, flops) in largest)
        return (f"left replicated at tp={tp} (no sharding rule applies to them): {listed}",)

    def predicted(self, priced: Priced) -> Predicted:
        step = priced.step_time_s
        model_flops = 3 * self.graph.total_fwd_flops() / self.graph.batch_size * self.global_batch
        peak = self.cluster.device.peak_flops_for(self.dtype) * self.cluster.world_size
        return Predicted(step_time_s=step, mfu=model_flops / (step * peak),
                         tokens_per_s=self.global_batch * self.seq_len / step,
                         peak_memory_bytes=priced.peak_memory_bytes, memory=priced.memory, time=priced.time)


def _placements(graph: CapturedGraph, strategies: Mapping[str, Strategy], cfg: Config
                ) -> tuple[tuple[ParamPlacement, ...], tuple[OpPlacement, ...]]:
    """Per parameter: tp placement, dp (ZeRO-3 shards), ep (experts split); per op: its output's."""
    dp_param = Shard(0) if cfg.zero_stage == 3 else Replicate()
    # a batched output: the batch over dp, the sequence dim over the context axes (cp, and ep where its ranks are
    # context-parallel ones); the same for every op of the configuration
    batched = (("dp", Shard(0)),) + tuple((axis, Shard(1)) for axis in cfg.mesh.context_axes
                                          if cfg.mesh.degree(axis) > 1)
    params: dict[str, ParamPlacement] = {}
    ops = []
    for node in graph.nodes:
        strategy = strategies[node.name]
        for name, _, placement in param_placements(node, strategy):
            if name in params:  # a shared parameter: its first user's placement
                continue
            where = (("tp", placement), ("dp", dp_param))
            if cfg.ep > 1 and node.op_kind == "moe" and is_expert_weight(name):
                where += (("ep", Shard(0)),)
            params[name] = ParamPlacement(name, where)
        output = ()
        if node.output is not None:
            output = (("tp", strategy.output),)
            if is_batched(node.output, graph.batch_size):
                output += batched
        ops.append(OpPlacement(node.name, strategy.name, output, node.module_path, strategy))
    return tuple(params.values()), tuple(ops)


def _uncovered_note(graph: CapturedGraph, registry: StrategyRegistry) -> tuple[str, ...]:
    kinds = sorted({n.op_kind for n in graph.nodes if not registry.has_rule(n.op_kind)})
    if not kinds:
        return ()
    count = sum(1 for n in graph.nodes if n.op_kind in kinds)
    return (f"{count} ops of kinds {kinds} have no sharding rule and run replicated",)



@dataclass(frozen=True)
class BaselineResult:
    """A baseline's plan, or why there is none."""

    name: str
    plan: Plan | None
    reason: str = ""
