"""Text that says why a plan costs what it costs, and why one plan beats another.

    explain_plan(plan)        where the step time and the memory go: per part (compute, communication,
                              bubble, optimizer; parameters, gradients, optimizer states, activations,
                              temporary), per pipeline stage, and per op family (the strategies the plan
                              chose and what each costs per microbatch, re-priced from the plan's
                              assignment with `cost_model.intra_op.price_assignment`; and the activations
                              each family's ops leave for backward under the plan's recompute policy,
                              `cost_model.activations`)
    compare_plans(a, b)       which is faster and why: the configuration differences, then every time
                              and memory part, largest difference first
    side_by_side(plans)       a table of several plans (`autoplan search --top K`, `--baseline`)

The CLI commands (`cmd_explain`, `cmd_compare`) and their argument parsers live here too; `autoplan.cli`
registers them.
"""

from __future__ import annotations

import argparse
import re
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import replace
from typing import Callable, Iterator

from autoplan.cli.args import positive_int
from autoplan.cli.hf_model import explain_inputs
from autoplan.plan import Plan

EP_MARGIN_LINE = "ep routing imbalance margin"  # the busiest ep rank's routed rows over the mean's (cost_model.step)

GB = 1e9


def _s(value: float) -> str:
    return f"{value * 1e3:,.1f} ms" if abs(value) < 1 else f"{value:,.3f} s"


def _gb(value: float) -> str:
    return f"{value / GB:,.2f} GB"


def _bytes(value: float) -> str:
    """GB, MB or kB, whichever keeps three significant digits for small models too."""
    for unit, scale in (("GB", GB), ("MB", 1e6)):
        if value >= 0.1 * scale:
            return f"{value / scale:,.2f} {unit}"
    return f"{value / 1e3:,.1f} kB"


def _table(header: list[str], rows: list[list[str]], right: set[int] | None = None) -> list[str]:
    """Plain aligned columns (text the CLI prints and tests read)."""
    right = right if right is not None else set(range(1, len(header)))
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    fmt = lambda row: "  ".join(str(c).rjust(w) if i in right else str(c).ljust(w)  # noqa: E731
                                for i, (c, w) in enumerate(zip(row, widths))).rstrip()
    return [fmt(header), fmt(["-" * w for w in widths]), *(fmt(r) for r in rows)]


def describe_config(plan: Plan) -> str:
    m = plan.mesh
    virtual = len({s.chunk for s in plan.stages})
    schedule = plan.schedule + (f", {virtual} virtual stages" if virtual > 1 else "")
    etp = f" etp={m.etp}" if m.etp != m.tp else ""
    ep_as = f" ep_as=cp (sequence over cp x ep = {m.context_parallel})" if m.ep_as == "cp" else ""
    return (f"{m} (pp={m.pp} dp={m.dp} ep={m.ep} cp={m.cp} tp={m.tp}{etp}{ep_as}), microbatch {plan.microbatch_size} x "
            f"{plan.num_microbatches}, ZeRO-{plan.zero_stage}, recompute {plan.recompute}, {schedule}")


def _time_parts(plan: Plan) -> list[tuple[str, float]]:
    t = plan.predicted.time
    return [("compute", t.compute_s), ("communication (exposed)", t.communication_s), ("pipeline bubble", t.bubble_s),
            ("optimizer", t.optimizer_s)]


def _memory_parts(plan: Plan) -> list[tuple[str, float]]:
    m = plan.predicted.memory
    return [("parameters", m.parameters_bytes), ("gradients", m.gradients_bytes), ("optimizer states", m.optimizer_bytes),
            ("activations", m.activations_bytes), (EP_MARGIN_LINE, m.ep_imbalance_bytes),
            ("temporary buffers", m.temporary_bytes)]


def _phases_line(m) -> str:
    """Which of the two phases is the peak (`cost_model.step_sums.peak_phase`)."""
    step = (f"the optimizer step {_gb(m.optimizer_step_bytes)} (weights less autocast's copies + gradients + "
            f"optimizer states + AdamW's temporary)")
    if m.peaks_at_optimizer_step():
        return f"  peak at {step}; forward + backward {_gb(m.forward_backward_bytes())}"
    return f"  peak at the end of a forward {_gb(m.forward_backward_bytes())}; {step}"


def _stages_text(plan: Plan) -> list[str]:
    if plan.mesh.pp == 1:
        return [f"  one stage: layers 0-{plan.model.num_layers - 1}"]
    by_stage: dict[int, list[str]] = defaultdict(list)
    for s in sorted(plan.stages, key=lambda s: (s.stage, s.chunk)):
        # a chunk may hold no layer: the embedding alone (first) or the head alone (last)
        by_stage[s.stage].append(f"{s.first_layer}-{s.last_layer - 1}" if s.last_layer > s.first_layer else "none")
    lines = [f"  stage {stage}: layers {', '.join(by_stage[stage])}" for stage in sorted(by_stage)]
    return lines if len(lines) <= 12 else lines[:5] + [f"  ... ({len(lines) - 10} stages)"] + lines[-5:]


# ---------------------------------------------------------------------------------- per op family


def op_family(node_name: str) -> str:
    """'layers_12_attn_q_proj' -> 'layers.*.attn_q_proj', 'model_layers_3_mlp_up_proj' (a Hugging Face
    export) -> 'model_layers.*.mlp_up_proj': the first number inside the name is the layer's index;
    'add_7' -> 'add' (fx's numbering at the end dropped)."""
    parts = node_name.split("_")
    while len(parts) > 1 and parts[-1].isdigit():
        parts.pop()
    layer = next((i for i in range(1, len(parts) - 1) if parts[i].isdigit()), None)
    if layer is not None:
        return "_".join(parts[:layer]) + ".*." + "_".join(parts[layer + 1:])
    return "_".join(parts)


def op_family_costs(plan: Plan, graph, config, profile=None, registry=None, info=None
                    ) -> list[tuple[str, str, int, float, float, float]]:
    """(family, strategy, ops, forward s, backward s, tp communication s) per microbatch on one rank, the
    kernels' own times (without the host's dispatch, which paces ops priced together: `_beyond_kernels_text`),
    re-priced from the plan's strategies (the ones it carries; a version-1 plan's names resolved by the
    rules: `registry` / `info` for a graph captured elsewhere, a Hugging Face export; default the zoo's),
    with the hardware `profile` when given (as `estimate --profile` priced it); largest total first."""
    from fractions import Fraction

    from autoplan.cost_model.compute import calibrate
    from autoplan.cost_model.intra_op import make_context, price_assignment
    from autoplan.cost_model.intra_op_problem import resolve_strategies
    from autoplan.mesh import MeshShape

    from autoplan.strategies import default_registry, strategy_info

    tp = plan.mesh.tp
    strategies = {op.node: op.resolved for op in plan.ops if op.resolved is not None}
    if len(strategies) < len(graph.nodes):  # a version-1 plan carries names only
        info = strategy_info(info if info is not None else config.rule_info(), tp, plan.mesh.etp)
        strategies = resolve_strategies(graph, registry or default_registry(), info, tp,
                                        {op.node: op.strategy for op in plan.ops})
    cluster, efficiency = calibrate(plan.cluster, None, profile, plan.kernels, plan.dtype)
    microbatch = Fraction(plan.microbatch_size, plan.mesh.context_parallel)
    ctx = make_context(graph, cluster, MeshShape(dp=cluster.world_size // tp, tp=tp), float(microbatch), plan.dtype,
                       efficiency)
    groups: dict[tuple[str, str], list] = defaultdict(list)
    for node in graph.nodes:
        groups[(op_family(node.name), strategies[node.name].name)].append(node)
    rows = []
    for (family, strategy), nodes in groups.items():
        cost = price_assignment(replace(graph, nodes=tuple(nodes)), strategies, ctx, host=False)  # kernels' own time
        rows.append((family, strategy, len(nodes), cost.fwd_compute_s, cost.bwd_compute_s, cost.fwd_comm_s + cost.bwd_comm_s))
    return sorted(rows, key=lambda r: (-(r[3] + r[4] + r[5]), r[0], r[1]))


def _model_for(plan: Plan, config=None):
    """The model config and its capture for `plan`, or (None, why not)."""
    from autoplan.models import get_model_config, known_models
    from autoplan.api import capture_model

    if config is None:
        if plan.model.name not in known_models():
            return None, f"the model {plan.model.name!r} is not a preset; pass its config file to see per-op costs"
        config = get_model_config(plan.model.name)
    if config.fingerprint() != plan.model.fingerprint:
        return None, f"the config given is not the plan's model (fingerprint {config.fingerprint()} != {plan.model.fingerprint})"
    return (config, capture_model(config, plan.seq_len, plan.dtype)), ""


# ---------------------------------------------------------------------------------- explain, compare


def explain_plan(plan: Plan, config=None, graph=None, ops: bool = True, max_ops: int = 12, profile=None,
                 registry=None, info=None) -> str:
    """Where the time and memory of `plan` go (module docstring), as text. `graph`, with `registry`
    and `info` for a graph captured elsewhere: the per-op costs without capturing the zoo model;
    `profile`: the hardware profile the per-op table is priced with."""
    p = plan.predicted
    lines = [f"{plan.model.name} on {plan.cluster.describe()}: global batch {plan.global_batch} x seq {plan.seq_len}",
             f"  {describe_config(plan)}",
             f"  {_s(p.step_time_s)} per step, {p.tokens_per_s:,.0f} tokens/s, MFU {p.mfu * 100:.1f}%", "",
             "step time (the slowest stage sets the pace; bubble = the other stages' fill and drain)"]
    total_t = max(p.time.total_s(), 1e-30)
    lines += _table(["part", "time", "share"], [[n, _s(v), f"{v / total_t:.1%}"] for n, v in _time_parts(plan)])
    capacity = plan.cluster.device.memory_bytes
    lines += ["", f"memory per GPU (the heaviest stage): {_gb(p.peak_memory_bytes)} of {_gb(capacity)}"
                  f" ({'fits' if p.peak_memory_bytes <= capacity else 'DOES NOT FIT'})"]
    total_m = max(p.memory.forward_backward_bytes(), 1e-30)
    lines += _table(["part (forward + backward)", "memory", "share"],
                    [[n, _gb(v), f"{v / total_m:.1%}"] for n, v in _memory_parts(plan) if v or n != EP_MARGIN_LINE])
    lines += [_phases_line(p.memory)]
    lines += ["", f"pipeline stages ({plan.schedule})"] + _stages_text(plan)
    if ops and plan.ops:
        lines += ["", *_ops_text(plan, config, graph, max_ops, profile, registry, info)]
    if plan.provenance.notes:
        lines += ["", "notes"] + [f"  - {n}" for n in plan.provenance.notes]
    return "\n".join(lines)


def _ops_text(plan: Plan, config, graph, max_ops: int, profile=None, registry=None, info=None) -> list[str]:
    if graph is None:
        found, why = _model_for(plan, config)
        if found is None:
            return [f"per-op costs: not shown ({why})"]
        config, graph = found
    rows = op_family_costs(plan, graph, config, profile, registry, info)
    total = sum(r[3] + r[4] + r[5] for r in rows) or 1e-30
    head = (f"per op family: seconds per microbatch on one rank (microbatch {plan.microbatch_size}"
            f"{_context_text(plan.mesh)}), the whole model, tp strategies as chosen")
    table = [[f, s, str(n), _s(fw), _s(bw), _s(c), f"{(fw + bw + c) / total:.1%}"] for f, s, n, fw, bw, c in rows[:max_ops]]
    rest = rows[max_ops:]
    if rest:
        table.append([f"({len(rest)} more families)", "", str(sum(r[2] for r in rest)), _s(sum(r[3] for r in rest)),
                      _s(sum(r[4] for r in rest)), _s(sum(r[5] for r in rest)),
                      f"{sum(r[3] + r[4] + r[5] for r in rest) / total:.1%}"])
    return ([head] + _table(["op family", "strategy", "ops", "forward", "backward", "tp comm", "share"], table, {2, 3, 4, 5, 6})
            + _beyond_kernels_text(plan, sum(r[3] + r[4] for r in rows)) + [""]
            + _activations_text(plan, graph, config, max_ops))


def _beyond_kernels_text(plan: Plan, kernels_s: float) -> list[str]:
    """A line saying how much of the plan's compute per microbatch is not its kernels' own time: the host's
    dispatch of small kernels (`cost_model.host`), what recompute re-runs, and autocast's weight casts
    (`StepModel.cast_s`)."""
    per_microbatch = plan.predicted.time.compute_s / max(plan.num_microbatches, 1)
    if per_microbatch <= kernels_s * 1.001:
        return []
    from autoplan.cost_model.memory import state_bytes_for

    casts = ", autocast's casts of the weights and their gradients" if state_bytes_for(plan.dtype, plan.precision).cast \
        else ""
    return [f"  the plan's compute is {_s(per_microbatch)} per microbatch, {_s(per_microbatch - kernels_s)} more than "
            f"the kernels above: the host's dispatch of kernels too short to hide it, what recompute re-runs{casts}"]


def activation_families(plan: Plan, graph, config) -> tuple[list[tuple[str, float]], float]:
    """([(op family, bytes its ops leave for backward)], largest first, after under ep the routing
    imbalance margin's bytes (held and re-run: the busiest rank's excess over the mean); the most a
    recomputed layer adds while it is re-run, at the mean) per microbatch on one rank under the plan's
    recompute policy."""
    from autoplan.cost_model.storages import activation_bytes, held_storages
    from autoplan.cost_model.memory import plan_activation_bytes, plan_activations
    from autoplan.recompute_policy import recompute_policy

    acts, scale = plan_activations(plan, graph, config.rule_info(), False)
    policy = recompute_policy(plan.recompute)
    families: dict[str, float] = defaultdict(float)
    for storage in held_storages(acts, policy):
        families[op_family(storage.node)] += storage.nbytes * (scale if storage.batched else 1.0)
    rows, at_mean = sorted(families.items(), key=lambda fb: (-fb[1], fb[0])), activation_bytes(acts, policy, scale)
    margin = sum(plan_activation_bytes(plan, graph, config.rule_info())) - sum(at_mean) if plan.mesh.pp == 1 else 0.0
    return ([(EP_MARGIN_LINE, margin)] if margin > 0 else []) + rows, at_mean[1]


def _activations_text(plan: Plan, graph, config, max_rows: int) -> list[str]:
    if plan.mesh.pp > 1:
        return ["activations per op family: shown for pp = 1 plans (one stage holds every layer)"]
    rows, transient = activation_families(plan, graph, config)
    total = sum(b for _, b in rows) or 1e-30
    table = [[f, _bytes(b), f"{b / total:.1%}"] for f, b in rows[:max_rows]]
    if rows[max_rows:]:
        rest = sum(b for _, b in rows[max_rows:])
        table.append([f"({len(rows) - max_rows} more families)", _bytes(rest), f"{rest / total:.1%}"])
    head = (f"activations per op family: bytes one microbatch's forward leaves for backward on one rank, recompute "
            f"{plan.recompute} (a recomputed layer adds {_bytes(transient)} while backward re-runs it)")
    return [head] + _table(["op family", "held", "share"], table)


def _context_text(mesh) -> str:
    """How the microbatch's sequences are split over context-parallel ranks, for the per-op table's title."""
    if mesh.context_parallel == 1:
        return ""
    return f" / cp x ep {mesh.context_parallel}" if mesh.ep_as == "cp" else f" / cp {mesh.cp}"


def _config_differences(a: Plan, b: Plan) -> list[tuple[str, str, str]]:
    fields = [("mesh", str(a.mesh), str(b.mesh))]
    fields += [(axis, str(a.mesh.degree(axis)), str(b.mesh.degree(axis))) for axis in ("pp", "dp", "ep", "cp", "tp")]
    etp = [str(m.etp) if m.etp != m.tp else "= tp" for m in (a.mesh, b.mesh)]  # shown only where one differs
    fields += [("etp (experts' tp)", *etp)]
    fields += [("ep ranks are, to dense layers", *(f"{m.ep_as} ranks" for m in (a.mesh, b.mesh)))]
    fields += [("microbatch size", str(a.microbatch_size), str(b.microbatch_size)),
               ("microbatches", str(a.num_microbatches), str(b.num_microbatches)),
               ("ZeRO stage", str(a.zero_stage), str(b.zero_stage)), ("recompute", a.recompute, b.recompute),
               ("schedule", a.schedule, b.schedule),
               ("virtual stages", str(len({s.chunk for s in a.stages})), str(len({s.chunk for s in b.stages})))]
    return [f for f in fields if f[1] != f[2]]


def compare_plans(a: Plan, b: Plan, names: tuple[str, str] = ("A", "B")) -> str:
    """Which plan is faster and why (module docstring), as text."""
    na, nb = names
    pa, pb = a.predicted, b.predicted
    lines = []
    same_work = (a.model.fingerprint, a.global_batch, a.seq_len) == (b.model.fingerprint, b.global_batch, b.seq_len)
    if not same_work:
        lines.append(f"note: the plans do different work ({a.model.name} {a.global_batch} x {a.seq_len} vs "
                     f"{b.model.name} {b.global_batch} x {b.seq_len}); compared by tokens per second")
    if a.cluster != b.cluster:
        lines.append(f"note: different clusters ({a.cluster.describe()} vs {b.cluster.describe()})")
    for name, plan in ((na, a), (nb, b)):
        lines.append(f"{name}: {describe_config(plan)}; {_s(plan.predicted.step_time_s)} per step, "
                     f"{plan.predicted.tokens_per_s:,.0f} tokens/s, MFU {plan.predicted.mfu * 100:.1f}%, "
                     f"{_gb(plan.predicted.peak_memory_bytes)} per GPU")
    fast, slow = (na, nb) if pa.tokens_per_s >= pb.tokens_per_s else (nb, na)
    ratio = max(pa.tokens_per_s, pb.tokens_per_s) / max(min(pa.tokens_per_s, pb.tokens_per_s), 1e-30)
    if ratio == 1.0:
        lines.append("verdict: equally fast")
    else:
        lines.append(f"verdict: {fast} is {ratio:.2f}x faster than {slow} (it saves "
                     f"{_s(abs(pb.step_time_s - pa.step_time_s))} per step)" if same_work else
                     f"verdict: {fast} has {ratio:.2f}x the throughput of {slow}")
    diffs = _config_differences(a, b)
    if diffs:
        lines += ["", "configuration differences"] + _table(["", na, nb], [list(d) for d in diffs])
    time_rows = sorted(zip(_time_parts(a), _time_parts(b)), key=lambda ab: -abs(ab[0][1] - ab[1][1]))
    lines += ["", f"step time by part, largest difference first ({nb} - {na})"]
    lines += _table(["part", na, nb, "difference"], [[x[0], _s(x[1]), _s(y[1]), ("+" if y[1] >= x[1] else "-") + _s(abs(y[1] - x[1]))]
                                                      for x, y in time_rows])
    mem_rows = sorted(zip(_memory_parts(a), _memory_parts(b)), key=lambda ab: -abs(ab[0][1] - ab[1][1]))
    lines += ["", f"memory per GPU by part, largest difference first ({nb} - {na})"]
    lines += _table(["part", na, nb, "difference"], [[x[0], _gb(x[1]), _gb(y[1]), ("+" if y[1] >= x[1] else "-") + _gb(abs(y[1] - x[1]))]
                                                      for x, y in mem_rows])
    lead_part = time_rows[0]
    if lead_part[0][1] != lead_part[1][1]:
        lines += ["", f"why: the largest difference is {lead_part[0][0]} "
                      f"({_s(lead_part[0][1])} for {na}, {_s(lead_part[1][1])} for {nb})" + _reason(a, b, lead_part[0][0], names)]
    return "\n".join(lines)


def _reason(a: Plan, b: Plan, part: str, names: tuple[str, str]) -> str:
    """A short cause for the largest time difference, from the configuration."""
    if part == "pipeline bubble":
        frac = [(p.mesh.pp - 1) / (p.num_microbatches * len({s.chunk for s in p.stages})) for p in (a, b)]
        return (f": bubble fraction (pp - 1) / (m v) is {frac[0]:.3f} for {names[0]} and {frac[1]:.3f} for {names[1]}")
    if part.startswith("communication"):
        cp = [f"{p.mesh.context_parallel}" + (" (cp x ep)" if p.mesh.ep_as == "cp" else "") for p in (a, b)]
        return f": tp={a.mesh.tp} vs {b.mesh.tp}, cp={cp[0]} vs {cp[1]}, ZeRO-{a.zero_stage} vs ZeRO-{b.zero_stage}"
    if part == "compute":
        return f": recompute {a.recompute} vs {b.recompute}, microbatch {a.microbatch_size} vs {b.microbatch_size}"
    return ""


def side_by_side(plans: list[tuple[str, Plan | None, str]]) -> str:
    """One column per plan: (name, plan or None, why none)."""
    rows: list[list[str]] = []
    present = [(n, p) for n, p, _ in plans if p is not None]
    best = min((p.predicted.step_time_s for _, p in present), default=None)
    for name, plan, why in plans:
        if plan is None:
            rows.append([name, "-", "-", "-", "-", "-", "-", why])
            continue
        p = plan.predicted
        rows.append([name, str(plan.mesh), f"{plan.microbatch_size} x {plan.num_microbatches}",
                     f"Z{plan.zero_stage} {plan.recompute} {plan.schedule}", _s(p.step_time_s),
                     f"{p.mfu * 100:.1f}%", _gb(p.peak_memory_bytes), f"{p.step_time_s / best:.2f}x" if best else ""])
    return "\n".join(_table(["plan", "mesh", "microbatch", "ZeRO, recompute, schedule", "step", "MFU", "memory",
                             "time vs best"], rows, {4, 5, 6, 7}))


# ---------------------------------------------------------------------------------- command line


def add_explain_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("explain", help="where a plan's step time and memory go, per part, stage and op family")
    p.add_argument("plan", help="a plan JSON file")
    p.add_argument("--model-config", metavar="FILE", help="the model's config file, for per-op costs of a model that is not a preset")
    p.add_argument("--hf-model", metavar="DIR", help="the Hugging Face checkpoint directory (or config folder) the "
                   "plan was made for, for per-op costs of its captured graph")
    p.add_argument("--no-ops", action="store_true", help="skip the per-op table (no capture)")
    p.add_argument("--max-ops", type=positive_int, default=12, help="op families to list (default 12)")
    p.add_argument("--profile", metavar="FILE", help="price the per-op table with this hardware profile (a file, or a shipped one by name: h200), as "
                                                     "`estimate --profile` / `search --profile` priced the plan")
    return p


def add_compare_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("compare", help="which of two plans is faster, and why")
    p.add_argument("a", help="a plan JSON file")
    p.add_argument("b", help="another plan JSON file")
    return p


def add_search_options(parser: argparse.ArgumentParser) -> None:
    """--top and --baseline for `autoplan search`."""
    parser.add_argument("--top", type=positive_int, default=1, metavar="K", help="print the K best plans side by side")
    parser.add_argument("--baseline", choices=("megatron", "fsdp", "all"), action="append",
                        help="also print a Megatron-style and/or FSDP plan priced by the same model (repeatable)")
    parser.add_argument("--save-top", metavar="DIR", help="with --top, write plan-1.json ... plan-K.json here")


def cmd_explain(args) -> int:
    plan = Plan.load(args.plan)
    config = None
    if getattr(args, "model_config", None):
        from autoplan.models import load_model_config

        config = load_model_config(args.model_config)
    profile = None
    if getattr(args, "profile", None):
        from autoplan.profiler.profile import HardwareProfile

        profile = HardwareProfile.load(args.profile)  # calibrate refuses another device's
    captured = {}
    if getattr(args, "hf_model", None) and not getattr(args, "no_ops", False):
        captured = explain_inputs(args.hf_model, plan)  # its config, graph, strategy rules and their info
    config = captured.pop("config", config)
    print(explain_plan(plan, config=config, ops=not getattr(args, "no_ops", False), max_ops=getattr(args, "max_ops", 12),
                       profile=profile, **captured))
    return 0


def cmd_compare(args) -> int:
    a, b = Plan.load(args.a), Plan.load(args.b)
    print(compare_plans(a, b, names=(_short(args.a), _short(args.b))))
    return 0


def _short(path: str) -> str:
    return re.sub(r"\.json$", "", path.rsplit("/", 1)[-1]) or path


def search_report(result, baselines: list[str] | None) -> str:
    """The text of `autoplan search --top K [--baseline ...]` for a `SearchResult`."""
    wanted = {"megatron", "fsdp"} if baselines and "all" in baselines else set(baselines or ())
    rows = [(f"#{k}", plan, "") for k, plan in enumerate(result.plans, 1)]
    rows += [(b.name, b.plan, b.reason) for b in result.baselines if b.name in wanted]
    s = result.stats
    footer = (f"{s.configurations} configurations, {s.pruned_by_memory} pruned by memory, {s.pruned_by_time} by time, "
              f"{s.cannot_fit} fit no stage partition, {s.priced} priced, {s.ilp_solves} intra-op solves, "
              f"{s.search_time_s:.2f} s")
    return side_by_side(rows) + "\n" + footer


def save_top(result, directory: str) -> list[str]:
    from pathlib import Path

    written = []
    for k, plan in enumerate(result.plans, 1):
        path = Path(directory) / f"plan-{k}.json"
        plan.save(path)
        written.append(str(path))
    return written


@contextmanager
def search_progress(console=None) -> Iterator[Callable[[str], None]]:
    """A rich progress bar fed by the search's `progress` callback (`solver.context.ProgressMessage`)."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=console, transient=True) as bar:
        task = bar.add_task("searching", total=None)

        def update(message: str) -> None:
            done, total = getattr(message, "done", 0), getattr(message, "total", 0)
            bar.update(task, description=str(message)[:70], completed=done, total=total or None)

        yield update
