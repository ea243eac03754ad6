"""Hand-style configurations, priced by the same step model as the search, so plans can be put beside them.

Megatron-style (Narayanan et al., SC'21): tp = the largest divisor of the GPUs per node that divides
the attention heads and kv heads; the smallest pp (dividing world / tp, at most the layers) whose
configuration fits; dp = world / (tp pp); microbatch 1; 1F1B; selective recompute; Megatron-LM's
tensor-parallel assignment with sequence parallelism (`solver.intra_op.megatron_assignment`); the distributed
optimizer (ZeRO-1), as current Megatron-LM recipes use it; stages balanced by the same stage DP.

FSDP / ZeRO-3: tp = pp = 1, dp = world, ZeRO-3, the lightest recompute policy under which anything
fits (in the search's order: none, selective, matmul-only, full) and, under it, the largest microbatch
that fits (up to the search's `max_microbatch_size`).

Both are points of the search space (same assignment variants, microbatches and schedules), so the
search's best plan is never predicted slower than either.
"""

from __future__ import annotations

from dataclasses import dataclass

from autoplan.cluster import ClusterSpec
from autoplan.cost_model.compute import Efficiency
from autoplan.models.config import ModelConfig
from autoplan.cost_model.step import Priced
from autoplan.errors import ConfigError
from autoplan.plan import Plan, searched_precision
from autoplan.solver.context import VARIANT_ILP, VARIANT_MEGATRON, BaselineResult, GraphSource, SearchContext
from autoplan.cost_model.step_config import Config
from autoplan.solver.space import SearchOptions, divisors, divisors_up_to, memory_lower_bound
from autoplan.strategies import StrategyRegistry

BASELINE_NAMES = ("megatron", "fsdp")


@dataclass(frozen=True)
class Baseline:
    name: str
    priced: Priced | None
    reason: str = ""


def megatron_tp(config: ModelConfig, cluster: ClusterSpec) -> int:
    """GPUs per node, capped by the heads: the largest divisor of both (and of the kv heads)."""
    return max(t for t in divisors(cluster.gpus_per_node)
               if cluster.world_size % t == 0 and config.heads % t == 0 and config.kv_heads % t == 0)


def _fits(ctx: SearchContext, cfg: Config, variant: str, precision: str | None = None) -> Priced | None:
    """`cfg` priced under the search's `precision` (None: the one it picks for the dtype, `searched_precision`;
    Megatron-LM keeps bf16 masters too), or None when it does not fit."""
    cfg = cfg.replace(precision=precision or searched_precision(ctx.dtype))
    if memory_lower_bound(ctx.config, cfg, ctx.seq_len, ctx.dtype) > ctx.cluster.device.memory_bytes:
        return None
    priced = ctx.price(cfg, variant)
    return priced if priced.fits else None


def megatron_baseline(ctx: SearchContext, precision: str | None = None) -> Baseline:
    """The Megatron-style configuration of the module docstring under `precision` (`_fits`), or why there is none."""
    config, cluster, batch = ctx.config, ctx.cluster, ctx.global_batch
    tp = megatron_tp(config, cluster)
    variant = VARIANT_MEGATRON if tp > 1 else VARIANT_ILP
    tried = []
    for pp in (p for p in divisors(cluster.world_size // tp) if p <= config.num_layers):
        dp = cluster.world_size // (tp * pp)
        if batch % dp:
            continue
        tried.append(pp)
        priced = _fits(ctx, Config.of(tp, 1, pp, 1, dp, 1, batch // dp, 1, "selective"), variant, precision)
        if priced is not None:
            return Baseline("megatron", priced)
    if not tried:
        return Baseline("megatron", None, f"no pp makes dp = world / (tp={tp} x pp) divide the global batch {batch}")
    return Baseline("megatron", None, f"tp={tp}, microbatch 1, selective recompute, ZeRO-1 does not fit with any pp in {tried}")


def fsdp_baseline(ctx: SearchContext, options: SearchOptions | None = None, precision: str | None = None) -> Baseline:
    """The FSDP / ZeRO-3 configuration of the module docstring under `precision` (`_fits`), or why there is none."""
    options = options or SearchOptions()
    world, batch = ctx.cluster.world_size, ctx.global_batch
    if batch % world:
        return Baseline("fsdp", None, f"the global batch {batch} is not divisible by dp = world = {world}")
    sizes = sorted(divisors_up_to(batch // world, options.max_microbatch_size), reverse=True)
    for recompute in options.recompute:
        for mbs in sizes:
            priced = _fits(ctx, Config.of(1, 1, 1, 1, world, mbs, batch // (world * mbs), 3, recompute), VARIANT_ILP,
                           precision)
            if priced is not None:
                return Baseline("fsdp", priced)
    return Baseline("fsdp", None, f"ZeRO-3 over all {world} GPUs does not fit even at microbatch {min(sizes, default=1)} "
                                  f"with full recompute")


def all_baselines(ctx: SearchContext, options: SearchOptions | None = None) -> tuple[Baseline, ...]:
    """Both baselines beside a search of `options`, under its precision."""
    precision = options.precision if options else None
    return megatron_baseline(ctx, precision), fsdp_baseline(ctx, options, precision)


def baselines_of(config: ModelConfig, cluster: ClusterSpec, global_batch: int, seq_len: int, graph: GraphSource, *,
                 names: tuple[str, ...] = BASELINE_NAMES, dtype: str = "bfloat16",
                 efficiency: Efficiency | None = None, registry: StrategyRegistry | None = None,
                 options: SearchOptions | None = None) -> tuple[BaselineResult, ...]:
    """The baselines `names` as Plans (or why each has none), without a search."""
    unknown = set(names) - set(BASELINE_NAMES)
    if unknown:
        raise ConfigError(f"unknown baselines {sorted(unknown)}; known: {', '.join(BASELINE_NAMES)}")
    ctx = SearchContext(config, cluster, global_batch, seq_len, dtype=dtype, efficiency=efficiency, registry=registry,
                        graph=graph)
    found = []
    for name in names:
        b = megatron_baseline(ctx) if name == "megatron" else fsdp_baseline(ctx, options)
        plan: Plan | None = ctx.plan(b.priced, 0.0, (f"baseline: {name}",)) if b.priced else None
        found.append(BaselineResult(name, plan, b.reason))
    return tuple(found)
