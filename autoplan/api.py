"""The public entry points: plan (`search`, `search_plans`, `estimate`, `plan_from_assignment`,
`baseline_plans`) and run (`parallelize`). This is the last stage of the data flow: it captures the
model (`autoplan.capture`), hands the graph to the search (`autoplan.solver`), and compiles a plan
with the runtime (`autoplan.runtime`).

    plan = autoplan.search("gpt3-175b", "128x8xh100", global_batch=1536, seq_len=2048)
    search_plans(..., top=K)                             the K best, the baselines and search statistics
    estimate(..., mesh=..., microbatch_size=..., ...)    one given configuration, intra-op solved
    plan_from_assignment(graph, ..., assignment, ...)    one given configuration and tp assignment

    # under torchrun, one process per rank:
    program = autoplan.parallelize(model, "1x4xcpu", plan=plan)
    loss = program.train_step(tokens, targets, optimizer)

The outer search space and its bounds are in `autoplan.solver.space`, the step model (pipeline stages,
bubble, p2p, context and expert parallelism, data-parallel sync, memory per stage) in
`autoplan.cost_model.step`, the stage partition DP in `autoplan.solver.stages`, the baselines in
`autoplan.solver.baselines`.

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

from typing import TYPE_CHECKING, Callable, Mapping, Sequence

from autoplan.capture import CapturedGraph, capture
from autoplan.cluster import ClusterSpec, parse_cluster
from autoplan.cost_model.compute import Efficiency, calibrate
from autoplan.errors import ConfigError
from autoplan.mesh import MeshShape
from autoplan.models import build_model, get_model_config
from autoplan.models.config import ModelConfig
from autoplan.plan import Plan
from autoplan.solver.baselines import BASELINE_NAMES, baselines_of
from autoplan.solver.context import SearchContext
from autoplan.solver.search import BaselineResult, SearchResult, check_config, price_given, run_search
from autoplan.solver.space import SearchOptions
from autoplan.strategies import StrategyRegistry

if TYPE_CHECKING:
    from autoplan.profiler.profile import HardwareProfile

Progress = Callable[[str], None]


def plan_from_assignment(graph: CapturedGraph, config: ModelConfig, cluster: ClusterSpec, mesh: MeshShape,
                         assignment: Mapping[str, str], microbatch_size: int, num_microbatches: int,
                         zero_stage: int, recompute: str, *, registry: StrategyRegistry | None = None,
                         dtype: str = "bfloat16", efficiency: Efficiency | None = None,
                         search_time_s: float = 0.0, solver: str = "", notes: tuple[str, ...] = (),
                         schedule: str = "1f1b", virtual_stages: int = 1,
                         stage_layers: Sequence[int] | None = None) -> Plan:
    """The Plan of a given strategy assignment (node name -> strategy name; missing nodes replicate),
    with its predicted step time and memory; stages as `estimate` makes them."""
    batch = microbatch_size * num_microbatches * mesh.batch_shards
    cfg = check_config(config, cluster, batch, graph.seq_len, mesh, microbatch_size, zero_stage, recompute, schedule,
                       virtual_stages, heads_rule=False, stage_layers=stage_layers)
    return price_given(config, cluster, batch, graph.seq_len, cfg, assignment=assignment, dtype=dtype,
                       efficiency=efficiency, registry=registry, fold=True, time_limit_s=60.0, graph=graph,
                       notes=notes, search_time_s=search_time_s, solver=solver)


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
    import torch

    return capture(build_model(config, "meta", getattr(torch, dtype)), config, 1, seq_len, getattr(torch, dtype))


def graph_source(config: ModelConfig, seq_len: int, dtype: str, graph: CapturedGraph | None
                 ) -> "CapturedGraph | Callable[[], CapturedGraph]":
    """`graph` when it was captured at `seq_len`, else a capture of `config` made when the search first
    needs it (a search whose every configuration fails the memory bound captures nothing)."""
    if graph is not None and graph.seq_len == seq_len:
        return graph
    return lambda: capture_model(config, seq_len, dtype)


def search_context(config: ModelConfig, cluster: ClusterSpec, global_batch: int, seq_len: int, *,
                   dtype: str = "bfloat16", graph: CapturedGraph | None = None, **options) -> SearchContext:
    """The search's context for one model, cluster, batch and sequence (`autoplan.solver.context`), capturing
    `config` when no graph of this sequence is given: to price configurations one by one."""
    return SearchContext(config, cluster, global_batch, seq_len, dtype=dtype,
                         graph=graph_source(config, seq_len, dtype, graph), **options)


def search_plans(model: ModelConfig | str, cluster: ClusterSpec | str, global_batch: int, seq_len: int, *,
                 top: int = 1, baselines: bool = True, dtype: str = "bfloat16", fold: bool = True,
                 time_limit_s: float = 60.0, progress: Progress | None = None, max_microbatch_size: int = 16,
                 options: "SearchOptions | None" = None, efficiency: Efficiency | None = None,
                 registry: StrategyRegistry | None = None, profile: "HardwareProfile | None" = None,
                 graph: CapturedGraph | None = None, info: Mapping | None = None,
                 kernels: str = "auto") -> "SearchResult":
    """The `top` best plans (distinct configurations, best first), the baselines beside them, and search
    statistics (`autoplan.solver.search`). `options` narrows the space (`autoplan.solver.space.SearchOptions`);
    `max_microbatch_size` is a shorthand for its field of that name. `graph` / `info`: a graph captured
    elsewhere (e.g. `autoplan.capture.hf.capture_hf_for_planner`) and its strategy-rule info."""
    config, cluster = resolve_inputs(model, cluster, global_batch, seq_len, dtype)
    cluster, efficiency = calibrate(cluster, efficiency, profile, kernels)
    options = options or SearchOptions(max_microbatch_size=max_microbatch_size)
    return run_search(config, cluster, global_batch, seq_len, top=top, options=options, baselines=baselines,
                      dtype=dtype, fold=fold, time_limit_s=time_limit_s, efficiency=efficiency, registry=registry,
                      progress=progress, graph=graph_source(config, seq_len, dtype, graph), info=info)


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
             kernels: str = "auto", stage_layers: Sequence[int] | None = None) -> Plan:
    """The Plan of one given configuration (any pp, dp, ep, cp, tp), the intra-op solver choosing the
    strategies; it may not fit (its notes say). Bad values raise ConfigError naming values that work.
    `stage_layers`: the layers of each of the pp x v pipeline chunks in the order the layers flow through
    them (chunk c of pipeline rank s at position c pp + s; `autoplan.validity.stages_problem`), e.g.
    Llama 3 405B's (0, 1, ..., 1, 0) on pp=16, v=8; None: the stage search's partition."""
    config, cluster = resolve_inputs(model, cluster, global_batch, seq_len, dtype)
    cluster, efficiency = calibrate(cluster, efficiency, profile, kernels)
    cfg = check_config(config, cluster, global_batch, seq_len, mesh, microbatch_size, zero_stage, recompute, schedule,
                       virtual_stages, stage_layers=stage_layers)
    return price_given(config, cluster, global_batch, seq_len, cfg, assignment=None, dtype=dtype, efficiency=efficiency,
                       registry=registry, fold=fold, time_limit_s=time_limit_s,
                       graph=graph_source(config, seq_len, dtype, graph),
                       notes=("estimate of a given configuration",))


def baseline_plans(model: ModelConfig | str, cluster: ClusterSpec | str, global_batch: int, seq_len: int, *,
                   names: tuple[str, ...] = BASELINE_NAMES, dtype: str = "bfloat16",
                   efficiency: Efficiency | None = None, registry: StrategyRegistry | None = None,
                   options: SearchOptions | None = None) -> tuple[BaselineResult, ...]:
    """The baselines as Plans (or why each has none), without a search."""
    config, cluster = resolve_inputs(model, cluster, global_batch, seq_len, dtype)
    return baselines_of(config, cluster, global_batch, seq_len, graph_source(config, seq_len, dtype, None),
                        names=names, dtype=dtype, efficiency=efficiency, registry=registry, options=options)


def parallelize(model, cluster: "ClusterSpec | str", plan: "Plan | str | None" = None, *, config: "ModelConfig | None" = None,
                global_batch: int | None = None, seq_len: int | None = None, seed: int = 0,
                timeout_s: float | None = None, check_finite: bool = True):
    """Compile `model` into this rank's program under `plan`, searching for a plan when none is given.

    `model` is an autoplan model (ideally built on the meta device: only this rank's shards are
    ever allocated). `plan` may be a Plan or the path of a plan file. Without a plan, `global_batch`
    and `seq_len` are required and the plan is searched for `cluster`. Must run inside an
    initialised torch.distributed job (torchrun) or one this call can initialise from the environment.

    `timeout_s` bounds how long any collective waits for the other ranks (the timeout of the process
    groups this call creates; None: 300 s): a stalled rank then ends the job instead of hanging
    it. With `check_finite` (default), `train_step` raises `TrainingDivergedError` on every rank,
    before the optimizer step, when the global loss or gradient norm is not finite.
    """
    from autoplan.cluster import ClusterSpec, parse_cluster
    from autoplan.errors import AutoplanError
    from autoplan.plan import Plan
    from autoplan.runtime.launch import parallelize as _parallelize

    cluster = cluster if isinstance(cluster, ClusterSpec) else parse_cluster(cluster)
    config = config or getattr(model, "config", None)
    if isinstance(plan, str):
        plan = Plan.load(plan)
    if plan is None:
        if global_batch is None or seq_len is None or config is None:
            raise AutoplanError("parallelize without a plan needs global_batch=, seq_len= and a model that carries .config (or config=)")
        plan = search(config, cluster, global_batch, seq_len)
    return _parallelize(model, cluster, plan, config=config, seed=seed, timeout_s=timeout_s,
                        check_finite=check_finite)
