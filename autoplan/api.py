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

import dataclasses
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Mapping, Sequence

from autoplan.capture import CapturedGraph, capture
from autoplan.cluster import ClusterSpec, parse_cluster
from autoplan.cost_model.compute import Efficiency, calibrate
from autoplan.validity import SCHEDULE_1F1B, SCHEDULE_INTERLEAVED
from autoplan.errors import AutoplanError, ConfigError, PlanError
from autoplan.mesh import MeshShape
from autoplan.models import build_model, get_model_config
from autoplan.models.config import ModelConfig
from autoplan.plan import DTYPES, KERNELS, PRECISIONS, Plan, searched_precision
from autoplan.recompute_policy import recompute_policy
from autoplan.solver.baselines import BASELINE_NAMES, baselines_of
from autoplan.solver.context import SearchContext
from autoplan.solver.search import BaselineResult, SearchResult, check_config, price_given, run_search
from autoplan.solver.space import SearchOptions
from autoplan.strategies import StrategyRegistry
from autoplan.validate import check_choice, check_int, check_number, check_tokens, shown

if TYPE_CHECKING:
    import torch

    from autoplan.profiler.profile import HardwareProfile

Progress = Callable[[str], None]


def plan_from_assignment(graph: CapturedGraph, config: ModelConfig, cluster: ClusterSpec, mesh: MeshShape,
                         assignment: Mapping[str, str], microbatch_size: int, num_microbatches: int,
                         zero_stage: int, recompute: str, *, registry: StrategyRegistry | None = None,
                         dtype: str = "bfloat16", efficiency: Efficiency | None = None,
                         search_time_s: float = 0.0, solver: str = "", notes: tuple[str, ...] = (),
                         schedule: str = "1f1b", virtual_stages: int = 1,
                         stage_layers: Sequence[int] | None = None, precision: str = "autocast") -> Plan:
    """The Plan of a given strategy assignment (node name -> strategy name; missing nodes replicate),
    with its predicted step time and memory; stages as `estimate` makes them."""
    batch = microbatch_size * num_microbatches * mesh.batch_shards
    cfg = check_config(config, cluster, batch, graph.seq_len, mesh, microbatch_size, zero_stage, recompute, schedule,
                       virtual_stages, heads_rule=False, stage_layers=stage_layers, precision=precision, dtype=dtype)
    return price_given(config, cluster, batch, graph.seq_len, cfg, assignment=assignment, dtype=dtype,
                       efficiency=efficiency, registry=registry, fold=True, time_limit_s=60.0, graph=graph,
                       notes=notes, search_time_s=search_time_s, solver=solver)


def resolve_inputs(model: ModelConfig | str, cluster: ClusterSpec | str, global_batch: int, seq_len: int, dtype: str
             ) -> tuple[ModelConfig, ClusterSpec]:
    """The model config and cluster spec from names or objects, with the batch and sequence checked."""
    check_arguments("resolve_inputs", locals())
    check_tokens(global_batch, seq_len)
    config = get_model_config(model) if isinstance(model, str) else model
    cluster = cluster if isinstance(cluster, ClusterSpec) else parse_cluster(os.fspath(cluster))
    return config, cluster


def _expect(types: tuple, expected: str) -> Callable[[str, object], None]:
    """A rule refusing a value that is none of `types`, saying what is `expected`."""
    def rule(what: str, value: object) -> None:
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            raise ConfigError(f"{what}={shown(value)}: expected {expected}")
    return rule


def _profile_rule(what: str, value: object) -> None:
    from autoplan.profiler.profile import HardwareProfile

    _expect((HardwareProfile, type(None)), "a HardwareProfile (`HardwareProfile.load(path)`) or None")(what, value)


def _callable_rule(what: str, value: object) -> None:
    if value is not None and not callable(value):
        raise ConfigError(f"{what}={shown(value)}: expected a function taking a progress message, or None")


NONE = type(None)
# The public arguments and their rules: the type (bool is no count), the range, the choices.
def _check_recompute_name(what: str, value: object) -> None:
    """A recompute policy's name ("none", "selective", "matmul-only", "full", "full:4")."""
    if not isinstance(value, str):
        raise ConfigError(f"{what}={value!r}: expected a recompute policy name such as 'selective' or 'full:4'")
    try:
        recompute_policy(value)
    except PlanError as exc:
        raise ConfigError(f"{what}: {exc}") from None


ARGUMENT_RULES: dict[str, Callable[[str, object], None]] = {
    "model": _expect((str, ModelConfig), "a known model name such as 'tiny-gpt' (see `autoplan models`) or a ModelConfig"),
    "cluster": _expect((str, os.PathLike, ClusterSpec), "a cluster shorthand such as '1x8xh100', a cluster YAML/JSON "
                                                        "path, or a ClusterSpec"),
    "global_batch": check_int, "seq_len": check_int, "top": check_int, "max_microbatch_size": check_int,
    "microbatch_size": check_int, "virtual_stages": check_int, "seed": lambda what, v: check_int(what, v, 0),
    "zero_stage": lambda what, v: check_choice(what, v, (0, 1, 2, 3)),
    "dtype": lambda what, v: check_choice(what, v, DTYPES),
    "kernels": lambda what, v: check_choice(what, v, KERNELS),
    "precision": lambda what, v: v is None or check_choice(what, v, PRECISIONS),  # None: `searched_precision`
    "recompute": lambda what, v: _check_recompute_name(what, v),
    "schedule": lambda what, v: check_choice(what, v, (SCHEDULE_1F1B, SCHEDULE_INTERLEAVED)),
    "time_limit_s": check_number,
    "fold": _expect((bool,), "True or False"), "baselines": _expect((bool,), "True or False"),
    "mesh": _expect((MeshShape,), "a MeshShape, e.g. MeshShape(dp=2, tp=4)"),
    "options": _expect((SearchOptions, NONE), "a SearchOptions or None"),
    "efficiency": _expect((Efficiency, NONE), "an Efficiency or None"),
    "registry": _expect((StrategyRegistry, NONE), "a StrategyRegistry or None"),
    "graph": _expect((CapturedGraph, NONE), "a CapturedGraph captured at this seq_len, or None"),
    "info": _expect((Mapping, NONE), "a mapping of strategy-rule info, or None"),
    "profile": _profile_rule, "progress": _callable_rule,
    "plan": _expect((Plan, str, os.PathLike, NONE), "a Plan, the path of a plan file, or None (search for one)"),
    "config": _expect((ModelConfig, NONE), "a ModelConfig or None"),
}


def check_arguments(call: str, given: Mapping[str, object]) -> None:
    """Refuse, before any work, a public argument of `call` whose rule (`ARGUMENT_RULES`) it breaks; the
    message names the call, the argument, its value and what is expected. `given`: the call's locals()."""
    for name, value in given.items():
        if name in ARGUMENT_RULES:
            ARGUMENT_RULES[name](f"autoplan.{call}: {name}", value)


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
                 kernels: str = "auto", precision: str | None = None) -> "SearchResult":
    """The `top` best plans (distinct configurations, best first), the baselines beside them, and search
    statistics (`autoplan.solver.search`). `options` narrows the space (`autoplan.solver.space.SearchOptions`);
    `max_microbatch_size` is a shorthand for its field of that name. `graph` / `info`: a graph captured
    elsewhere (e.g. `autoplan.capture.hf.capture_hf_for_planner`) and its strategy-rule info. `precision`:
    how a bfloat16 plan holds its weights (`autoplan.plan.PRECISIONS`); None: bf16-master for bfloat16,
    autocast otherwise (`autoplan.plan.searched_precision`)."""
    check_arguments("search_plans", locals())
    config, cluster = resolve_inputs(model, cluster, global_batch, seq_len, dtype)
    cluster, efficiency = calibrate(cluster, efficiency, profile, kernels, dtype)
    options = options or SearchOptions(max_microbatch_size=max_microbatch_size)
    return run_search(config, cluster, global_batch, seq_len, top=top, options=options, baselines=baselines,
                      dtype=dtype, fold=fold, time_limit_s=time_limit_s, efficiency=efficiency, registry=registry,
                      progress=progress, graph=graph_source(config, seq_len, dtype, graph), info=info,
                      precision=precision)


def search(model: "ModelConfig | str | torch.nn.Module", cluster: ClusterSpec | str, global_batch: int, seq_len: int, *,
           dtype: str = "bfloat16", fold: bool = True, time_limit_s: float = 60.0, progress: Progress | None = None,
           max_microbatch_size: int = 16, options: "SearchOptions | None" = None,
           efficiency: Efficiency | None = None, registry: StrategyRegistry | None = None,
           profile: "HardwareProfile | None" = None, kernels: str = "auto", config: ModelConfig | None = None,
           precision: str | None = None) -> Plan:
    """The fastest plan that fits; InfeasibleError, with the numbers and what would help, when none does.
    `precision`: as `search_plans`'s (None: the one it picks for the dtype).
    `model` may also be an nn.Module (a transformers causal LM, or a hand-written module with `config=`
    its ModelConfig): the fastest plan the runtime for your own module runs (`search_module_plans`, in the
    module's own dtype); a zoo module is planned from its config."""
    if _is_module(model) and is_zoo_model(model):
        model = getattr(model, "config", model)
    elif _is_module(model):
        return search_module_plans(model, cluster, global_batch, seq_len, config=config, progress=progress,
                                   fold=fold, time_limit_s=time_limit_s, profile=profile, kernels=kernels,
                                   options=options or module_search_options(max_microbatch_size),
                                   precision=precision).plans[0]
    check_arguments("search", locals())
    return search_plans(model, cluster, global_batch, seq_len, dtype=dtype, fold=fold, time_limit_s=time_limit_s,
                        progress=progress, max_microbatch_size=max_microbatch_size, options=options,
                        efficiency=efficiency, registry=registry, profile=profile, kernels=kernels,
                        precision=precision).plans[0]


def estimate(model: ModelConfig | str, cluster: ClusterSpec | str, global_batch: int, seq_len: int, *,
             mesh: MeshShape, microbatch_size: int, zero_stage: int, recompute: str, dtype: str = "bfloat16",
             fold: bool = True, time_limit_s: float = 60.0, efficiency: Efficiency | None = None,
             registry: StrategyRegistry | None = None, graph: CapturedGraph | None = None,
             schedule: str = "1f1b", virtual_stages: int = 1, profile: "HardwareProfile | None" = None,
             kernels: str = "auto", stage_layers: Sequence[int] | None = None,
             info: Mapping | None = None, precision: str | None = "autocast") -> Plan:
    """The Plan of one given configuration (any pp, dp, ep, cp, tp), the intra-op solver choosing the
    strategies; it may not fit (its notes say). Bad values raise ConfigError naming values that work.
    `stage_layers`: the layers of each of the pp x v pipeline chunks in the order the layers flow through
    them (chunk c of pipeline rank s at position c pp + s; `autoplan.validity.stages_problem`), e.g.
    Llama 3 405B's (0, 1, ..., 1, 0) on pp=16, v=8; None: the stage search's partition.
    `graph` / `info`: a graph captured elsewhere and its strategy-rule info (as in `search_plans`);
    `precision`: how a bfloat16 plan holds its weights (`autoplan.plan.PRECISIONS`; None: the one the search
    picks for the dtype, `autoplan.plan.searched_precision`)."""
    check_arguments("estimate", locals())
    precision = precision or searched_precision(dtype)
    config, cluster = resolve_inputs(model, cluster, global_batch, seq_len, dtype)
    cluster, efficiency = calibrate(cluster, efficiency, profile, kernels, dtype)
    cfg = check_config(config, cluster, global_batch, seq_len, mesh, microbatch_size, zero_stage, recompute, schedule,
                       virtual_stages, stage_layers=stage_layers, precision=precision, dtype=dtype)
    return price_given(config, cluster, global_batch, seq_len, cfg, assignment=None, dtype=dtype, efficiency=efficiency,
                       registry=registry, fold=fold, time_limit_s=time_limit_s,
                       graph=graph_source(config, seq_len, dtype, graph), info=info,
                       notes=("estimate of a given configuration",))


def baseline_plans(model: ModelConfig | str, cluster: ClusterSpec | str, global_batch: int, seq_len: int, *,
                   names: tuple[str, ...] = BASELINE_NAMES, dtype: str = "bfloat16",
                   efficiency: Efficiency | None = None, registry: StrategyRegistry | None = None,
                   options: SearchOptions | None = None) -> tuple[BaselineResult, ...]:
    """The baselines as Plans (or why each has none), without a search."""
    check_arguments("baseline_plans", locals())
    if not (isinstance(names, tuple) and set(names) <= set(BASELINE_NAMES)):
        raise ConfigError(f"autoplan.baseline_plans: names={shown(names)}: expected a tuple of {BASELINE_NAMES}")
    config, cluster = resolve_inputs(model, cluster, global_batch, seq_len, dtype)
    return baselines_of(config, cluster, global_batch, seq_len, graph_source(config, seq_len, dtype, None),
                        names=names, dtype=dtype, efficiency=efficiency, registry=registry, options=options)


def parallelize(model, cluster: "ClusterSpec | str", plan: "Plan | str | None" = None, *,
                config: "ModelConfig | None" = None, global_batch: int | None = None,
                seq_len: int | None = None, seed: int = 0, checkpoint=None, top: int = 8,
                timeout_s: float | None = None, check_finite: bool = True):
    """Compile `model` into this rank's program under `plan`, searching for a plan when none is given.

    `model` is one of: an autoplan zoo model (ideally built on meta; parameters come from the
    seeded init: `autoplan.runtime.launch`); a transformers causal LM or any nn.Module whose
    forward(input_ids) returns logits, trained from its own weights, or, built on meta, from the
    Hugging Face checkpoint directory `checkpoint` (`autoplan.runtime.module_launch`); or the path
    of such a checkpoint directory (the model is built on meta from its config.json and loaded).
    `plan` may be a Plan or the path of a plan file. Without a plan, `global_batch` and `seq_len`
    are required: a zoo model is planned from its config; a transformers model is captured
    (`capture_hf_for_planner`), a hand-written module too (`capture_hf`, with `config=` its
    ModelConfig), and the first of the `top` best plans the module runtime can run is taken. Must run inside an initialised torch.distributed job (torchrun) or one this call
    can initialise from the environment.

    `timeout_s` bounds how long any collective waits for the other ranks (the timeout of the process
    groups this call creates; None: 300 s): a stalled rank then ends the job instead of hanging it.
    With `check_finite` (default; zoo models), `train_step` raises `TrainingDivergedError` on every
    rank, before the optimizer step, when the global loss or gradient norm is not finite."""
    sizes = {"global_batch": global_batch, "seq_len": seq_len}
    check_arguments("parallelize", {"cluster": cluster, "plan": plan, "config": config, "seed": seed}
                    | {name: value for name, value in sizes.items() if value is not None})
    cluster = cluster if isinstance(cluster, ClusterSpec) else parse_cluster(os.fspath(cluster))
    if isinstance(plan, (str, os.PathLike)):
        plan = Plan.load(plan)
    if isinstance(model, (str, Path)):
        model, checkpoint = hf_model_on_meta(model), model
    if is_zoo_model(model):
        return _parallelize_zoo(model, cluster, plan, config, global_batch, seq_len, seed, timeout_s, check_finite)
    from autoplan.runtime.module_launch import agree_on_plan, parallelize_module_program

    if plan is None:  # planned once, on rank 0
        plan = agree_on_plan(lambda: plan_module(model, cluster, global_batch, seq_len, top=top, config=config),
                             timeout_s=timeout_s)
    return parallelize_module_program(model, plan, cluster=cluster, checkpoint=checkpoint, timeout_s=timeout_s,
                                      check_finite=check_finite)


def _is_module(model) -> bool:
    """An nn.Module (torch is imported wherever one exists, so this never imports it)."""
    nn = sys.modules.get("torch.nn")
    return nn is not None and isinstance(model, nn.Module)


def is_zoo_model(model) -> bool:
    """A module of autoplan's zoo (`autoplan.models`), which the graph-rewriting runtime runs."""
    return type(model).__module__.startswith("autoplan.models.")


def hf_model_on_meta(directory: "str | Path"):
    """The transformers causal LM of a checkpoint directory's config.json, built on meta (float32,
    SDPA attention, or eager where the architecture has no SDPA path) for `parallelize` to load with
    `checkpoint=directory`."""
    import torch

    from autoplan.capture.hf import build_hf_model, load_hf_config

    return build_hf_model(load_hf_config(directory), torch.float32, experts=None)


def _parallelize_zoo(model, cluster: ClusterSpec, plan: "Plan | None", config: "ModelConfig | None",
                     global_batch: int | None, seq_len: int | None, seed: int, timeout_s: float | None,
                     check_finite: bool):
    from autoplan.runtime.launch import parallelize as _parallelize

    config = config or getattr(model, "config", None)
    if plan is None:
        if global_batch is None or seq_len is None or config is None:
            raise AutoplanError("parallelize without a plan needs global_batch=, seq_len= and a model that carries .config (or config=)")
        plan = search(config, cluster, global_batch, seq_len)
    return _parallelize(model, cluster, plan, config=config, seed=seed, timeout_s=timeout_s,
                        check_finite=check_finite)


def module_search_options(max_microbatch_size: int = 16) -> SearchOptions:
    """The part of the space the runtime for your own module runs (`autoplan.runtime.module_launch`):
    pp (its schedules), dp and tp (with sequence parallelism), cp (Ulysses, `runtime.module_context`),
    ZeRO 0-3, microbatching, every recompute policy, ep (transformers' MoE experts) on data-parallel
    ranks (not folded over cp: ep_over_cp off); plans it does not run (ep with ZeRO over dp, dropout
    under tp, cp on a hand-written module, ...) are refused by `check_module_plan` and skipped."""
    return SearchOptions(max_microbatch_size=max_microbatch_size, context_parallel=True, expert_parallel=True,
                         ep_over_cp=False)


def search_module_plans(model, cluster: ClusterSpec | str, global_batch: int, seq_len: int, *, top: int = 1,
                        candidates: int = 8, dtype: str | None = None, config: ModelConfig | None = None,
                        **search) -> SearchResult:
    """The `top` best plans for `model` (on meta or with weights) that the module runtime runs: a search
    over `module_search_options` on the model's captured graph for the max(top, candidates) best, of
    which the first `top` that `check_module_plan` accepts are kept (it refuses some for the model
    itself, such as dropout under tp, or tied weights that tp would hold differently). `model`: a
    transformers causal LM, or a hand-written module whose forward(input_ids, labels, use_cache) returns
    the loss, with `config` (`_module_graph`). `dtype`: the model's parameter dtype when None.
    `search`: more keywords of `search_plans` (progress, profile, kernels, baselines, fold,
    time_limit_s). PlanError naming why each was refused when none is accepted."""
    from autoplan.capture.hf_rules import hf_registry
    from autoplan.runtime.module_launch import check_module_plan

    cluster = parse_cluster(cluster) if isinstance(cluster, str) else cluster
    dtype = dtype or str(next(model.parameters()).dtype).removeprefix("torch.")
    summary, graph, info = _module_graph(model, seq_len, dtype, config)
    search.setdefault("options", module_search_options())
    found = search_plans(summary, cluster, global_batch, seq_len, top=max(top, candidates), dtype=dtype,
                         graph=graph, info=info, registry=hf_registry(), **search)
    runnable, refused = [], []
    for plan in found.plans:
        try:
            check_module_plan(plan, model, cluster)
            runnable.append(plan)
        except PlanError as exc:
            refused.append(f"{plan.mesh}: {exc}")
    if not runnable:
        raise PlanError("none of the best plans runs on the module runtime:\n  " + "\n  ".join(refused))
    return dataclasses.replace(found, plans=tuple(_noted(plan, MODULE_SPACE_NOTE) for plan in runnable[:top]))


def _module_graph(model, seq_len: int, dtype: str, config: ModelConfig | None):
    """(summary, graph, rule info) for the planner: a transformers model's from its config
    (`capture_hf_for_planner`); a hand-written module's graph exported as it is (`capture_hf`), its
    summary the `config` the caller gives (the sizes the strategy rules and the memory model read)."""
    import torch

    from autoplan.capture.hf import capture_hf, capture_hf_for_planner

    hf_config = getattr(model, "config", None)
    if hasattr(hf_config, "to_dict"):
        return capture_hf_for_planner(hf_config, seq_len, dtype)
    if not isinstance(config, ModelConfig):
        raise PlanError(f"planning {type(model).__name__}, a module without a transformers config, needs "
                        f"config=ModelConfig(name, family, layers, hidden, heads, kv_heads, ffn_hidden, vocab, "
                        f"max_seq) describing it (config={shown(config)}); or pass a plan")
    return config, capture_hf(model, 1, seq_len, getattr(torch, dtype)), config.rule_info()


MODULE_SPACE_NOTE = ("searched the space the runtime for your own module runs: pp, dp and tp (sequence parallel "
                     "variants), cp, ZeRO 0-3, microbatching, recompute, ep (over data-parallel ranks)")


def _noted(plan: Plan, note: str) -> Plan:
    return dataclasses.replace(plan, provenance=dataclasses.replace(
        plan.provenance, notes=(*plan.provenance.notes, note)))


def plan_module(model, cluster: ClusterSpec, global_batch: int | None, seq_len: int | None, *,
                top: int = 8, config: ModelConfig | None = None) -> "Plan":
    """The fastest of the `top` best plans for `model` that the module runtime runs
    (`search_module_plans`; `config`: a hand-written module's summary)."""
    if global_batch is None or seq_len is None:
        raise PlanError(f"parallelize without a plan needs global_batch= and seq_len= (given {global_batch}, "
                        f"{seq_len}) to plan {type(model).__name__}; or pass plan=")
    return search_module_plans(model, cluster, global_batch, seq_len, top=1, candidates=top, config=config,
                               baselines=False).plans[0]
