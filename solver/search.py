"""The outer search: every parallel dimension, priced by one step model, as a branch and bound.

    1. enumerate the configurations (`search_space`); drop those whose memory lower bound exceeds
       the device before anything is solved or priced;
    2. price the baselines (`baselines`: Megatron-style, FSDP): their step times seed the bound;
    3. group the rest by intra-op key (tp, sequences per rank per microbatch = mbs / cp, or mbs / (cp ep) when
       the ep ranks split the sequence too (ep_as = "cp"), etp: the MoE
       strategies depend on it, `strategies.moe_strategies`); visit the keys
       in order of their best time lower bound (the roofline's compute rate in the pipeline formula)
       and stop once that bound exceeds the K-th best step time found;
    4. per key: solve the intra-op problem (`planner.solve_tp`; under 1 < etp < tp the etp = 1 solve's choice,
       the same problem up to a constant, `SearchContext._folded_ilp_solution`) and price each configuration whose
       bound with the solution's exact per-layer times stays below the K-th best; for tp > 1, price
       the configurations that did not fit again with Megatron-LM's assignment with sequence
       parallelism, whose lower activation memory can fit where the time-optimal assignment does not;
       where recomputing every layer fits and recomputing none does not, the fewest layers "full:k" that fit
       (bisection over k: memory falls and time grows with k)
       (each mesh comes in each order of its axes over ranks that changes its links, `search_space.mesh_orders`;
       the roofline bound does not depend on the order, the exact per-layer bound does, through the links)
    5. the K best configurations that fit, by (step time, simpler configuration first), become Plans.

Both bounds are sound, so the result equals pricing everything; the order of visits only changes how
much is pruned. Same inputs, same plans.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Callable, Mapping

from autoplan.cluster import ClusterSpec
from autoplan.cost_model.compute import Efficiency
from autoplan.cost_model.pipeline import SCHEDULE_1F1B, SCHEDULE_INTERLEAVED
from autoplan.cost_model.parallel_dims import batch_problem, check, cp_problem, ep_problem, etp_problem, tp_problem
from autoplan.cost_model.step import Priced
from autoplan.errors import ConfigError, PlanError
from autoplan.mesh import MeshShape
from autoplan.models.config import ModelConfig
from autoplan.plan import Plan
from autoplan.recompute_policy import check_recompute
from autoplan.solver.baselines import all_baselines
from autoplan.solver.context import (VARIANT_ILP, VARIANT_MEGATRON, BaselineResult, GraphSource, Progress, ProgressMessage,
                                     SearchContext)
from autoplan.solver.intra_op import fold_note
from autoplan.cost_model.step_config import Config
from autoplan.solver.space import (FlopsPerSequence, SearchOptions, enumerate_configs, infeasible,
                                   memory_lower_bound, parameter_split, time_lower_bound_s)
from autoplan.strategies import StrategyRegistry

# ---------------------------------------------------------------------------------- the search


@dataclass(frozen=True)
class SearchStats:
    configurations: int
    pruned_by_memory: int
    pruned_by_time: int
    priced: int
    returned: int  # plans returned (at most top)
    ilp_solves: int
    search_time_s: float


@dataclass(frozen=True)
class SearchResult:
    plans: tuple[Plan, ...]  # best first
    baselines: tuple[BaselineResult, ...]
    stats: SearchStats
    priced: tuple[Priced, ...] = ()  # the ranked configurations the plans come from


class _Best:
    """The K best distinct configurations priced so far."""

    def __init__(self, k: int) -> None:
        self.k, self.items = k, []

    def add(self, priced: Priced) -> None:
        same = [p for p in self.items if p.config == priced.config]
        if same and same[0].rank_key() <= priced.rank_key():
            return
        self.items = sorted([p for p in self.items if p.config != priced.config] + [priced], key=Priced.rank_key)[:self.k]

    def threshold_s(self) -> float:
        """Prune what cannot beat the K-th best (with a hair of slack, so that exact ties are priced)."""
        return self.items[-1].step_time_s * (1 + 1e-9) if len(self.items) == self.k else float("inf")


def _keys(configs: list[Config], flops: FlopsPerSequence, peak: float) -> list[tuple[float, tuple, list]]:
    """(best bound, key, [(bound, config)...] sorted) per intra-op key (tp, microbatch per rank, etp), sorted by
    bound."""
    groups: dict[tuple, list] = {}
    for cfg in configs:
        key = (cfg.tp, cfg.rank_microbatch, cfg.mesh.etp)
        groups.setdefault(key, []).append((time_lower_bound_s(cfg, flops, peak), cfg))
    found = []
    for key, items in groups.items():
        items.sort(key=lambda bc: (bc[0], bc[1].sort_key()))
        found.append((items[0][0], key, items))
    return sorted(found, key=lambda entry: (entry[0], entry[1]))


class _Ranking:
    """The K best fitting configurations overall, and the K best a Plan can express. Pruning by the latter's
    K-th time (never below the former's) is sound for both: the overall best is never pruned."""

    def __init__(self, k: int, expressible: Callable[[Config], bool]) -> None:
        self.all, self.plans, self.expressible = _Best(k), _Best(k), expressible

    def add(self, priced: Priced) -> None:
        self.all.add(priced)
        if self.expressible(priced.config):
            self.plans.add(priced)

    def threshold_s(self) -> float:
        return self.plans.threshold_s()


def _fewest_recomputed_layers(ctx: SearchContext, block, cfg: Config, ranking: _Ranking) -> int:
    """Where "full" fits and "none" does not: price "full:k" for the fewest layers k that fit, by bisection
    (fewer recomputed layers keep more and re-run less), and rank it; returns how many were priced."""
    if ctx.steps.price(block, cfg.replace(recompute="none")).fits:
        return 1  # nothing need be recomputed: "none" is ranked on its own
    fits, misses, found, priced = block.num_layers, 0, None, 1
    while fits - misses > 1:
        middle = (fits + misses) // 2
        candidate = ctx.steps.price(block, cfg.replace(recompute=f"full:{middle}"))
        priced += 1
        fits, misses, found = (middle, misses, candidate) if candidate.fits else (fits, middle, found)
    if found is not None:
        ranking.add(found)
    return priced


def _branch_and_bound(ctx: SearchContext, keys: list, ranking: _Ranking, report: Progress,
                      partial: bool = True) -> tuple[int, int, Priced | None]:
    """Steps 3-4 of the module docstring; (configurations pruned by time, priced, smallest that did not fit).
    `partial`: also search the fewest fully recomputed layers where "full" fits (`_fewest_recomputed_layers`)."""
    pruned = priced_count = 0
    smallest: Priced | None = None
    for done, (key_bound, (tp, microbatch, etp), items) in enumerate(keys, 1):
        if key_bound > ranking.threshold_s():
            return pruned + sum(len(entry[2]) for entry in keys[done - 1:]), priced_count, smallest
        report(ProgressMessage(f"[{done}/{len(keys)}] solving the intra-op ILP for tp={tp}"
                               f"{f', etp={etp}' if etp != tp else ''}, microbatch per rank={microbatch}",
                               done, len(keys)))
        retry = items
        for variant in (VARIANT_ILP, VARIANT_MEGATRON) if tp > 1 else (VARIANT_ILP,):
            misfits = []
            for bound, cfg in retry:
                if bound > ranking.threshold_s():
                    pruned += variant == VARIANT_ILP
                    continue
                # tp's links follow the order; with tp inside a node the same strategies cost no more, so that
                # block's bound prunes first, without pricing the spread one, where that holds for every size
                block, spread = ctx.block(tp, microbatch, variant, etp=etp), ctx.tp_spread(cfg.mesh)
                if ((spread is None or ctx.costs_no_less(spread)) and
                        ctx.steps.lower_bound_s(block, cfg) > ranking.threshold_s()):
                    pruned += variant == VARIANT_ILP
                    continue
                if spread is not None:
                    block = ctx.block(tp, microbatch, variant, mesh=cfg.mesh, etp=etp)
                    if ctx.steps.lower_bound_s(block, cfg) > ranking.threshold_s():
                        pruned += variant == VARIANT_ILP
                        continue
                priced = ctx.steps.price(block, cfg)
                priced_count += 1
                if priced.fits:
                    ranking.add(priced)
                    if partial and cfg.recompute == "full":
                        priced_count += _fewest_recomputed_layers(ctx, block, cfg, ranking)
                    continue
                misfits.append((bound, cfg))
                if smallest is None or priced.peak_memory_bytes < smallest.peak_memory_bytes:
                    smallest = priced
            retry = misfits  # Megatron's assignment keeps less memory: try it where the optimum does not fit
            if not retry:
                break
    return pruned, priced_count, smallest


def run_search(config: ModelConfig, cluster: ClusterSpec, global_batch: int, seq_len: int, *, top: int = 1,
               options: SearchOptions | None = None, baselines: bool = True, dtype: str = "bfloat16",
               fold: bool = True, time_limit_s: float = 60.0, efficiency: Efficiency | None = None,
               registry: StrategyRegistry | None = None, progress: Progress | None = None,
               graph: GraphSource, info: Mapping | None = None) -> SearchResult:
    """The K best plans (module docstring); InfeasibleError, with the numbers, when none fits. `graph` and
    `info`: a graph captured elsewhere (at batch 1 and this seq_len) and its strategy-rule info."""
    start, report = time.perf_counter(), progress or (lambda message: None)
    if top < 1:
        raise ConfigError(f"top={top} must be >= 1")
    options = options or SearchOptions()
    if not callable(graph) and not any(n.op_kind == "moe" for n in graph.nodes):
        options = dataclasses.replace(options, expert_tensor_parallel=False)  # no MoE layer for etp to change
    configs = enumerate_configs(config, cluster, global_batch, seq_len, options)
    sizes = parameter_split(config)
    bounds = [(memory_lower_bound(config, c, seq_len, dtype, sizes), c) for c in configs]
    fitting = [c for bound, c in bounds if bound <= cluster.device.memory_bytes]
    if not fitting:
        smallest = min(bounds, key=lambda bc: (bc[0], bc[1].sort_key()))
        raise infeasible(config, cluster, seq_len, dtype, smallest[0], smallest[1])
    report(ProgressMessage(f"capturing {config.name} at seq {seq_len}"))
    ctx = SearchContext(config, cluster, global_batch, seq_len, dtype=dtype, efficiency=efficiency,
                        registry=registry, fold=fold, time_limit_s=time_limit_s, graph=graph, info=info)
    ranking = _Ranking(top, lambda c: True)
    found_baselines = all_baselines(ctx, options) if baselines else ()
    for b in found_baselines:
        if b.priced is not None:
            ranking.add(b.priced)
    keys = _keys(fitting, ctx.flops_per_sequence(),
                 cluster.device.peak_flops_for(dtype) * ctx.efficiency.max_matmul(cluster.device, dtype))
    pruned, priced_count, smallest = _branch_and_bound(ctx, keys, ranking, report, options.partial_recompute)
    if not ranking.plans.items:
        raise infeasible(config, cluster, seq_len, dtype, smallest.peak_memory_bytes, smallest.config, bound=False)
    stats = SearchStats(len(configs), len(configs) - len(fitting), pruned, priced_count, len(ranking.plans.items),
                        ctx.ilp_solves, time.perf_counter() - start)
    plans = _plans(ctx, ranking, found_baselines, stats, options)
    report(ProgressMessage(f"best: {plans[0].mesh}, {plans[0].predicted.step_time_s:.3f} s per step", len(keys), len(keys)))
    baseline_plans = tuple(BaselineResult(b.name, ctx.plan(b.priced, 0.0, (f"baseline: {b.name}",)) if b.priced else None,
                                          b.reason) for b in found_baselines)
    return SearchResult(plans, baseline_plans, stats, tuple(ranking.all.items))


def _notes(ctx: SearchContext, priced: Priced, rank: int, found_baselines, stats: SearchStats,
           options: SearchOptions) -> list[str]:
    notes = [f"searched {stats.configurations} configurations (pp x dp x ep x cp x tp and their order over ranks, "
             f"{'the experts etp, the ep ranks as data- or context-parallel ranks, ' if ctx.config.experts else ''}"
             f"microbatches, ZeRO "
             f"{'/'.join(map(str, options.zero_stages))}, recompute {'/'.join(options.recompute)}, 1F1B and "
             f"interleaved schedules): {stats.pruned_by_memory} pruned by the memory bound, {stats.pruned_by_time} "
             f"by the time bound, {stats.priced} priced after {stats.ilp_solves} intra-op solves",
             f"intra-op {fold_note(ctx.fold, ctx.fold_map)}", f"rank {rank} of the {stats.returned} returned"]
    if priced.variant == VARIANT_MEGATRON:
        notes.append("tp strategies: Megatron-LM's assignment with sequence parallelism (it keeps less activation "
                     "memory than the intra-op optimum, which was slower for this configuration)")
    for b in found_baselines:
        notes.append(f"baseline {b.name}: " + (
            f"{b.priced.config.describe()}, {b.priced.step_time_s:.4g} s per step; this plan has "
            f"{b.priced.step_time_s / priced.step_time_s:.2f}x its throughput" if b.priced else f"none ({b.reason})"))
    return notes


def _plans(ctx: SearchContext, ranking: _Ranking, found_baselines, stats: SearchStats,
           options: SearchOptions) -> tuple[Plan, ...]:
    """Plans of the ranked configurations the Plan type can express; the best says so when a faster one was not."""
    unexpressed = [p for p in ranking.all.items if not ranking.expressible(p.config)
                   and p.step_time_s < ranking.plans.items[0].step_time_s]
    extra = [f"a faster configuration was priced that this Plan version cannot express (ep ranks split the batch "
             f"but the Plan counts only dp as data-parallel): {p.config.describe()}, {p.step_time_s:.4g} s per step"
             for p in unexpressed[:1]]
    return tuple(ctx.plan(priced, stats.search_time_s,
                          tuple(_notes(ctx, priced, rank, found_baselines, stats, options) + (extra if rank == 1 else [])))
                 for rank, priced in enumerate(ranking.plans.items, 1))


# ---------------------------------------------------------------------------------- one configuration


def check_config(config: ModelConfig, cluster: ClusterSpec, global_batch: int, seq_len: int, mesh: MeshShape,
                 microbatch_size: int, zero_stage: int, recompute: str, schedule: str, virtual_stages: int,
                 heads_rule: bool = True) -> Config:
    """A Config for a user-given configuration; ConfigError naming the rule and values that would work.
    `heads_rule`: tp must split the attention heads (off when an assignment decides the strategies)."""
    if mesh.world_size != cluster.world_size:
        raise ConfigError(f"mesh {mesh} has pp x dp x ep x cp x tp = {mesh.world_size} ranks but the cluster "
                          f"{cluster.describe()} has {cluster.world_size}")
    if mesh.tp > 1 and heads_rule:
        check(tp_problem(config.heads, config.kv_heads, mesh.tp))
    folded = mesh.ep_as == "cp"  # the ep ranks split the sequence with cp: the rules see cp x ep
    check(cp_problem(config.heads, mesh.tp, mesh.context_parallel, seq_len, "cp x ep" if folded else "cp"))
    check(ep_problem(config.experts, mesh.ep, mesh.dp * mesh.ep))
    check(etp_problem(config.experts, mesh.ep, mesh.tp, mesh.etp, seq_len, mesh.context_parallel,
                      config.ffn_hidden))
    check(batch_problem(global_batch, mesh.batch_shards, microbatch_size, "dp (ep as cp)" if folded else "dp"))
    if mesh.pp > config.num_layers:
        raise ConfigError(f"pp={mesh.pp} exceeds the {config.num_layers} layers of {config.name}; use pp <= {config.num_layers}")
    if zero_stage not in (0, 1, 2, 3):
        raise ConfigError(f"zero_stage={zero_stage!r} must be 0-3")
    try:
        check_recompute(recompute, config.num_layers)
    except PlanError as exc:
        raise ConfigError(str(exc)) from None
    m = global_batch // (mesh.batch_shards * microbatch_size)
    if schedule == SCHEDULE_INTERLEAVED:
        if mesh.pp == 1 or virtual_stages < 2 or config.num_layers % (mesh.pp * virtual_stages) or m % mesh.pp:
            raise ConfigError(f"interleaved 1F1B needs pp > 1, v >= 2, the {config.num_layers} layers divisible by "
                              f"pp x v = {mesh.pp * virtual_stages} and the {m} microbatches divisible by pp={mesh.pp}")
    elif schedule != SCHEDULE_1F1B or virtual_stages != 1:
        raise ConfigError(f"schedule {schedule!r} with v={virtual_stages}: use '1f1b' (v=1) or 'interleaved-1f1b' (v >= 2)")
    return Config(mesh, microbatch_size, m, zero_stage, recompute, schedule, virtual_stages)


def price_given(config: ModelConfig, cluster: ClusterSpec, global_batch: int, seq_len: int, cfg: Config, *,
                assignment: Mapping[str, str] | None, dtype: str, efficiency: Efficiency | None,
                registry: StrategyRegistry | None, fold: bool, time_limit_s: float, graph: GraphSource,
                notes: tuple[str, ...], search_time_s: float | None = None, solver: str | None = None) -> Plan:
    """The Plan of one configuration: the intra-op solver's strategies, or `assignment` when given."""
    start = time.perf_counter()
    ctx = SearchContext(config, cluster, global_batch, seq_len, dtype=dtype, efficiency=efficiency, registry=registry,
                        fold=fold, time_limit_s=time_limit_s, graph=graph)
    variant = VARIANT_ILP if assignment is None else "given"
    priced = ctx.price(cfg, variant, assignment)
    elapsed = time.perf_counter() - start if search_time_s is None else search_time_s
    return ctx.plan(priced, elapsed, notes, assignment, solver)
