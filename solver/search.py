"""The outer search: every parallel dimension, priced by one step model, as a branch and bound.

    1. enumerate the configurations (`solver.space.fitting_configs`); drop those whose memory lower bound
       exceeds the device before anything is solved or priced (the bound reads the mesh, the microbatch and
       the ZeRO stage only: such groups are counted, never made);
    2. price the baselines (`baselines`: Megatron-style, FSDP): their step times seed the bound;
    3. group the rest by intra-op key (tp, sequences per rank per microbatch = mbs / cp, or mbs / (cp ep) when
       the ep ranks split the sequence too (ep_as = "cp"), etp: the MoE
       strategies depend on it, `strategies.moe_strategies`); visit the keys
       in order of their best time lower bound (the roofline's compute rate in the pipeline formula)
       and stop once that bound exceeds the K-th best step time found;
    4. per key: solve the intra-op problem (`solver.intra_op.solve_tp`; under 1 < etp < tp the etp = 1 solve's choice,
       the same problem up to a constant, `SearchContext._folded_ilp_solution`) and price each configuration whose
       floor with the solution's exact per-layer times stays below the K-th best (`StepModel.priced_above`,
       `cost_model.step_bounds`: the pipeline with its sends and its slowest rank's least time, the optimizer step,
       the data-parallel sync at its least; for "full", a floor under the "full:k" it leads to as well); for tp > 1, price
       the configurations that did not fit again with Megatron-LM's assignment with sequence
       parallelism, whose lower activation memory can fit where the time-optimal assignment does not (and
       the "full" ones whose "none" did not fit: there it may need fewer recomputed layers);
       where recomputing every layer fits and recomputing none does not, the fewest layers "full:k" that fit
       (bisection over k: memory falls and time grows with k; a k that fits no partition is a miss without
       pricing, and the bisection stops once the floor under every k left exceeds the K-th best)
       (each mesh comes in each order of its axes over ranks that changes its links, `solver.space.mesh_orders`;
       the roofline bound does not depend on the order, the exact per-layer bound does, through the links);
       a configuration whose stages fit no partition counts as not fitting without being priced: most of a
       deep model's configurations are such. First an O(1) floor under the busiest rank's memory, sound for
       every partition (`StepModel.memory_floor_bytes`: the ranks' states, temporaries and activations held
       the fewest times, over pp), then the exact check (`stages.partition_fits`, O(pp L)); a Megatron retry,
       made for memory alone, meets the floor before its time bounds (pruned by time or not, one that cannot
       fit is never ranked)
    5. the K best configurations that fit, by (step time, simpler configuration first), become Plans.

The bounds, the floor and the fit check are sound, so the result equals pricing everything; the order of visits only changes how
much is pruned. Same inputs, same plans.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Mapping, Sequence

from autoplan.cluster import ClusterSpec
from autoplan.cost_model.compute import Efficiency
from autoplan.cost_model.pipeline import MEMORY_RTOL
from autoplan.cost_model.step import Priced
from autoplan.errors import ConfigError
from autoplan.mesh import MeshShape
from autoplan.models.config import ModelConfig
from autoplan.plan import Plan, precision_problem, searched_precision
from autoplan.solver.baselines import all_baselines
from autoplan.solver.context import (VARIANT_ILP, VARIANT_MEGATRON, BaselineResult, GraphSource, Progress, ProgressMessage,
                                     SearchContext)
from autoplan.solver.intra_op import fold_note
from autoplan.cost_model.step_config import Config
from autoplan.solver.stage_counts import counts_decide
from autoplan.solver.stages import partition_fits
from autoplan.solver.space import (FlopsPerSequence, SearchOptions, enumerate_configs, fitting_configs, infeasible,
                                   memory_lower_bound, parameter_split, time_lower_bound_s)
from autoplan.strategies import StrategyRegistry
from autoplan.validity import check, configuration_problems

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
    cannot_fit: int = 0  # (configuration, strategy variant) whose stages fit no partition: not priced


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


def _fewest_recomputed_layers(ctx: SearchContext, block, cfg: Config, ranking: _Best, fitted: dict) -> int:
    """Where "full" fits and "none" does not: price "full:k" for the fewest layers k that fit, by bisection
    (fewer recomputed layers keep more and re-run less), and rank it; returns how many were priced.
    `fitted`: whether each (block, configuration) priced or found unable to fit so far fits. What cannot fit
    any partition (`_cannot_fit`) is a miss without pricing; the bisection ends early once the floor under
    every "full:k" left (k above the most found not to fit) exceeds the K-th best: it would rank nothing."""
    priced = 0
    plain = cfg.replace(recompute="none")
    if fitted.get((id(block), plain)) is None and not _cannot_fit(ctx, block, plain):
        fitted[(id(block), plain)], priced = ctx.steps.price(block, plain).fits, 1
    if fitted.get((id(block), plain), False):
        return priced  # nothing need be recomputed: "none" is ranked on its own
    fits, misses, found = block.num_layers, 0, None
    while fits - misses > 1 and not ctx.steps.priced_above(block, cfg, ranking.threshold_s(), misses + 1):
        middle = (fits + misses) // 2
        candidate = cfg.replace(recompute=f"full:{middle}")
        if _cannot_fit(ctx, block, candidate):
            misses = middle
            continue
        candidate = ctx.steps.price(block, candidate)
        priced += 1
        fits, misses, found = (middle, misses, candidate) if candidate.fits else (fits, middle, found)
    if found is not None:
        ranking.add(found)
    return priced


def _branch_and_bound(ctx: SearchContext, keys: list, ranking: _Best, report: Progress, partial: bool = True
                      ) -> tuple[int, int, int, Priced | None]:
    """Steps 3-4 of the module docstring; (configurations pruned by time, priced, found unable to fit without
    pricing, smallest that did not fit). `partial`: also search the fewest fully recomputed layers where
    "full" fits (`_fewest_recomputed_layers`)."""
    pruned = priced_count = 0
    smallest: Priced | None = None
    unpriced: list = []  # (block, configuration) that cannot fit, not priced
    fitted: dict[tuple, bool] = {}  # (id(block), configuration): whether it fits, where priced or found unable to
    for done, (key_bound, (tp, microbatch, etp), items) in enumerate(keys, 1):
        if key_bound > ranking.threshold_s():
            return pruned + sum(len(entry[2]) for entry in keys[done - 1:]), priced_count, len(unpriced), smallest
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
                if variant != VARIANT_ILP and _over_floor(ctx, block, cfg):
                    # a retry is for memory: one that cannot fit ends here, before its time bounds, whose
                    # verdict would change nothing but this count (the order's links move no byte)
                    unpriced.append((block, cfg))
                    continue
                # "full" leads to the fewest "full:k" that fit where "none" does not: a floor under those too
                fewer = int(partial and cfg.recompute == "full" and not fitted.get((id(block), cfg.replace(
                    recompute="none")), False))
                if ((spread is None or ctx.costs_no_less(spread)) and
                        ctx.steps.priced_above(block, cfg, ranking.threshold_s(), fewer)):
                    pruned += variant == VARIANT_ILP
                    if fewer and variant == VARIANT_ILP:  # the floor is this assignment's: Megatron's leaner
                        misfits.append((bound, cfg))  # layers may fit with fewer re-run, and run faster
                    continue
                if spread is not None:
                    block = ctx.block(tp, microbatch, variant, mesh=cfg.mesh, etp=etp)
                    if ctx.steps.priced_above(block, cfg, ranking.threshold_s(), fewer):
                        pruned += variant == VARIANT_ILP
                        continue
                if _cannot_fit(ctx, block, cfg):
                    unpriced.append((block, cfg))
                    misfits.append((bound, cfg))
                    fitted[(id(block), cfg)] = False
                    continue
                priced = ctx.steps.price(block, cfg)
                priced_count += 1
                fitted[(id(block), cfg)] = priced.fits
                if priced.fits:
                    ranking.add(priced)
                    if partial and cfg.recompute == "full":
                        priced_count += _fewest_recomputed_layers(ctx, block, cfg, ranking, fitted)
                        if not fitted.get((id(block), cfg.replace(recompute="none")), False):
                            misfits.append((bound, cfg))  # Megatron's leaner layers may re-run fewer
                    continue
                misfits.append((bound, cfg))
                if smallest is None or priced.peak_memory_bytes < smallest.peak_memory_bytes:
                    smallest = priced
            retry = misfits  # Megatron's assignment keeps less memory: try it where the optimum does not fit
            if not retry:
                break
    if not ranking.items:  # nothing fits: the error names the configuration closest to fitting
        for block, cfg in unpriced:
            priced = ctx.steps.price(block, cfg)
            if smallest is None or priced.peak_memory_bytes < smallest.peak_memory_bytes:
                smallest = priced
    return pruned, priced_count, len(unpriced), smallest


def _over_floor(ctx: SearchContext, block, cfg: Config) -> bool:
    """Whether the floor under the busiest rank's memory (`StepModel.memory_floor_bytes`) exceeds the device."""
    return ctx.steps.memory_floor_bytes(block, cfg) > ctx.cluster.device.memory_bytes * (1 + MEMORY_RTOL)


def _cannot_fit(ctx: SearchContext, block, cfg: Config) -> bool:
    """Whether no partition of `cfg` into stages fits the memory: pricing would find the same, at the cost
    of a stage DP. First the O(1) floor under the busiest rank (`StepModel.memory_floor_bytes`, sound for
    every partition), then the exact check (`stages.partition_fits`, O(pp L)). Interleaved ranks of unequal
    layers hold other layers than the contiguous ranges the exact check tries, so those are priced, unless
    a rank's sums depend on its count of layers alone (`stage_counts.counts_decide`: the same layers, or a
    first layer of its own that rank 0's first chunk holds either way)."""
    if _over_floor(ctx, block, cfg):
        return True
    problem = ctx.steps.stage_problem(block, cfg)
    if cfg.virtual_stages > 1 and len(block.distinct) > 1 and not counts_decide(problem):
        return False
    return not partition_fits(problem)


def run_search(config: ModelConfig, cluster: ClusterSpec, global_batch: int, seq_len: int, *, top: int = 1,
               options: SearchOptions | None = None, baselines: bool = True, dtype: str = "bfloat16",
               fold: bool = True, time_limit_s: float = 60.0, efficiency: Efficiency | None = None,
               registry: StrategyRegistry | None = None, progress: Progress | None = None,
               graph: GraphSource, info: Mapping | None = None, precision: str | None = None) -> SearchResult:
    """The K best plans (module docstring); InfeasibleError, with the numbers, when none fits. `graph` and
    `info`: a graph captured elsewhere (at batch 1 and this seq_len) and its strategy-rule info. `precision`:
    every configuration's (`autoplan.plan.PRECISIONS`; None: `searched_precision(dtype)`); ConfigError when
    it cannot run `dtype` (`precision_problem`)."""
    start, report = time.perf_counter(), progress or (lambda message: None)
    if top < 1:
        raise ConfigError(f"top={top} must be >= 1")
    precision = precision or searched_precision(dtype)
    problem = precision_problem(precision, dtype)
    if problem:
        raise ConfigError(problem)
    options = dataclasses.replace(options or SearchOptions(), precision=precision)
    if not callable(graph) and not any(n.op_kind == "moe" for n in graph.nodes):
        options = dataclasses.replace(options, expert_tensor_parallel=False)  # no MoE layer for etp to change
    fitting, num_configs = fitting_configs(config, cluster, global_batch, seq_len, options, dtype)
    if not fitting:  # the error names the configuration closest to fitting
        sizes = parameter_split(config)
        smallest = min(((memory_lower_bound(config, c, seq_len, dtype, sizes), c)
                        for c in enumerate_configs(config, cluster, global_batch, seq_len, options)),
                       key=lambda bc: (bc[0], bc[1].sort_key()))
        raise infeasible(config, cluster, seq_len, dtype, smallest[0], smallest[1])
    report(ProgressMessage(f"capturing {config.name} at seq {seq_len}"))
    ctx = SearchContext(config, cluster, global_batch, seq_len, dtype=dtype, efficiency=efficiency,
                        registry=registry, fold=fold, time_limit_s=time_limit_s, graph=graph, info=info)
    ranking = _Best(top)
    found_baselines = all_baselines(ctx, options) if baselines else ()
    for b in found_baselines:
        if b.priced is not None:
            ranking.add(b.priced)
    keys = _keys(fitting, ctx.flops_per_sequence(),
                 cluster.device.peak_flops_for(dtype) * ctx.efficiency.max_matmul(cluster.device, dtype))
    pruned, priced_count, cannot_fit, smallest = _branch_and_bound(ctx, keys, ranking, report,
                                                                   options.partial_recompute)
    if not ranking.items:
        raise infeasible(config, cluster, seq_len, dtype, smallest.peak_memory_bytes, smallest.config, bound=False)
    stats = SearchStats(num_configs, num_configs - len(fitting), pruned, priced_count, len(ranking.items),
                        ctx.ilp_solves, time.perf_counter() - start, cannot_fit)
    plans = _plans(ctx, ranking, found_baselines, stats, options)
    report(ProgressMessage(f"best: {plans[0].mesh}, {plans[0].predicted.step_time_s:.3f} s per step", len(keys), len(keys)))
    baseline_plans = tuple(BaselineResult(b.name, ctx.plan(b.priced, 0.0, (f"baseline: {b.name}",)) if b.priced else None,
                                          b.reason) for b in found_baselines)
    return SearchResult(plans, baseline_plans, stats, tuple(ranking.items))


def _notes(ctx: SearchContext, priced: Priced, rank: int, found_baselines, stats: SearchStats,
           options: SearchOptions) -> list[str]:
    notes = [f"searched {stats.configurations} configurations (pp x dp x ep x cp x tp and their order over ranks, "
             f"{'the experts etp, the ep ranks as data- or context-parallel ranks, ' if ctx.config.experts else ''}"
             f"microbatches, ZeRO "
             f"{'/'.join(map(str, options.zero_stages))}, recompute {'/'.join(options.recompute)}, 1F1B and "
             f"interleaved schedules): {stats.pruned_by_memory} pruned by the memory bound, {stats.pruned_by_time} "
             f"by the time bound, {stats.cannot_fit} found unable to fit any stage partition and "
             f"{stats.priced} priced after {stats.ilp_solves} intra-op solves",
             f"intra-op {fold_note(ctx.fold, ctx.fold_map)}", f"rank {rank} of the {stats.returned} returned"]
    if priced.variant == VARIANT_MEGATRON:
        notes.append("tp strategies: Megatron-LM's assignment with sequence parallelism (it keeps less activation "
                     "memory than the intra-op optimum, which was slower for this configuration)")
    for b in found_baselines:
        notes.append(f"baseline {b.name}: " + (
            f"{b.priced.config.describe()}, {b.priced.step_time_s:.4g} s per step; this plan has "
            f"{b.priced.step_time_s / priced.step_time_s:.2f}x its throughput" if b.priced else f"none ({b.reason})"))
    return notes


def _plans(ctx: SearchContext, ranking: _Best, found_baselines, stats: SearchStats,
           options: SearchOptions) -> tuple[Plan, ...]:
    """Plans of the ranked configurations, best first."""
    return tuple(ctx.plan(priced, stats.search_time_s, tuple(_notes(ctx, priced, rank, found_baselines, stats, options)))
                 for rank, priced in enumerate(ranking.items, 1))


# ---------------------------------------------------------------------------------- one configuration


def check_config(config: ModelConfig, cluster: ClusterSpec, global_batch: int, seq_len: int, mesh: MeshShape,
                 microbatch_size: int, zero_stage: int, recompute: str, schedule: str, virtual_stages: int,
                 heads_rule: bool = True, stage_layers: Sequence[int] | None = None, precision: str = "autocast",
                 dtype: str = "bfloat16") -> Config:
    """A Config for a user-given configuration; ConfigError naming the first rule it breaks
    (`autoplan.validity`: the rules the runtime applies too) and values that would work.
    `heads_rule`: tp must split the attention heads (off when an assignment decides the strategies);
    `stage_layers`: the layers of each pipeline chunk in flow order (None: the stage search's); `precision`:
    `autoplan.plan.PRECISIONS`, which must suit `dtype`."""
    if mesh.world_size != cluster.world_size:
        raise ConfigError(f"mesh {mesh} has pp x dp x ep x cp x tp = {mesh.world_size} ranks but the cluster "
                          f"{cluster.describe()} has {cluster.world_size}")
    given = None if stage_layers is None else tuple(int(n) for n in stage_layers)
    check(configuration_problems(config, mesh, global_batch, seq_len, microbatch_size, zero_stage, recompute,
                                 schedule, virtual_stages, heads_rule, given))
    problem = precision_problem(precision, dtype)
    if problem:
        raise ConfigError(problem)
    m = global_batch // (mesh.batch_shards * microbatch_size)
    return Config(mesh, microbatch_size, m, zero_stage, recompute, schedule, virtual_stages, given, precision)


def price_given(config: ModelConfig, cluster: ClusterSpec, global_batch: int, seq_len: int, cfg: Config, *,
                assignment: Mapping[str, str] | None, dtype: str, efficiency: Efficiency | None,
                registry: StrategyRegistry | None, fold: bool, time_limit_s: float, graph: GraphSource,
                notes: tuple[str, ...], search_time_s: float | None = None, solver: str | None = None,
                info: Mapping | None = None) -> Plan:
    """The Plan of one configuration: the intra-op solver's strategies, or `assignment` when given.
    `info`: the strategy-rule info of a graph captured elsewhere (default: the config's)."""
    start = time.perf_counter()
    ctx = SearchContext(config, cluster, global_batch, seq_len, dtype=dtype, efficiency=efficiency, registry=registry,
                        fold=fold, time_limit_s=time_limit_s, graph=graph, info=info)
    variant = VARIANT_ILP if assignment is None else "given"
    priced = ctx.price(cfg, variant, assignment)
    elapsed = time.perf_counter() - start if search_time_s is None else search_time_s
    return ctx.plan(priced, elapsed, notes, assignment, solver)
