"""The collectives one training step issues, as the plan predicts them, counted by (kind, group).

`expected_collectives(plan, config, pp_index)` derives them from the plan alone (its strategies,
the edges between them, its mesh, microbatches and recompute policy) for a rank at pipeline
coordinate `pp_index`; `RankProgram.count_collectives()` counts what the runtime really issues
(runtime.collectives), and the tests compare the two. Per microbatch, for every captured node this
rank runs:

    its strategy's own collectives on tp:
        row                   fwd all-reduce
        row_sp                fwd reduce-scatter, bwd all-gather (+ bwd all-reduce of the bias grad)
        vocab / vocab_sp      fwd all-reduce / fwd reduce-scatter + bwd all-gather
        sequence (any op)     bwd all-reduce per parameter (each one's grad summed over tp)
        cross_entropy vocab   fwd 2 all-reduces (max; then sum-exp and target logit together)
        cross_entropy seq.    fwd all-reduce of (loss sum, count)
        moe ffn               fwd all-reduce, bwd 2 all-reduces (the input's and the gate weights')
        moe expert (etp < tp) bwd all-reduce of the router's grad (its tokens split over tp)
    the conversion of each input edge whose placements differ (one per producer and kind):
        R -> S(d)             bwd all-gather       S(d) -> R       fwd all-gather
        S(a) -> S(b)          fwd + bwd all-to-all
        grad_partial R -> R   bwd all-reduce       grad_partial S(d) -> R   fwd all-gather, bwd
                                                                            reduce-scatter
        (backward ones only where the producer's value needs a gradient: not for token ids,
        targets or positions)
    cp > 1, attention:        fwd 4 all-to-alls (q, k, v to heads, output back), bwd 4, on the
                              context group (cp, or ep x cp under ep_as = "cp") when it has more
                              than one rank
    experts spread, moe:      fwd 3 all-to-alls (counts, dispatch, combine; 2 under an expert capacity,
                              whose row counts are known), bwd 2, on the expert
                              group (ep, or ep x tp / etp when etp < tp) when it has more than one rank
    1 < etp < tp, moe:        fwd 2 all-gathers (row counts, rows) + 1 reduce-scatter (partial
                              outputs), bwd 1 all-gather + 1 reduce-scatter, on the expert_tp group
    recomputed layers:        every forward collective of the layer's nodes once more in backward,
                              whatever the policy saves (`autoplan.recompute_policy`: collectives
                              are never saved)

Per step: the above times num_microbatches; the gradient buckets (runtime.grad_sync) of the dense
gradients over the data ranks (dp x ep x cp) and of the expert gradients over dp x cp, whatever etp and
ep_as (when those groups have more than one rank, and not under ZeRO 3, whose FSDP2 reduce-scatters are
torch's own): one all-reduce each under ZeRO 0, a reduce-scatter and an all-gather of the parameters
under ZeRO 1/2 (one bucket per group and dtype: the models counted here fill less than
`autoplan.grad_buckets.GRAD_BUCKET_BYTES`; dense and expert gradients share it when their groups
hold the same ranks); the
loss's all-reduce over pp (pp > 1) and over the data ranks (carrying the gradient norm's terms
too, runtime.health); with the finiteness check on (`check_finite`, the default), one all-reduce
over tp (tp > 1) of the gradient norm's terms. Not counted: torch's own collectives
(FSDP2, the pipeline schedules' sends and receives).

Group names: a group is named by the narrowest kind with the same ranks, in the order data,
expert_data, expert, expert_tp, pp, dp, ep, cp, tp (so with only dp > 1, the data group is "dp",
and with etp = tp the expert group is "ep" and the expert_tp group "tp").
"""

from __future__ import annotations

from collections import Counter

import torch

from autoplan.capture import CapturedGraph, NodeInfo, capture
from autoplan.mesh import MeshShape
from autoplan.models import build_model
from autoplan.models.config import ModelConfig
from autoplan.placement import Replicate
from autoplan.plan import Plan
from autoplan.recompute_policy import recompute_policy
from autoplan.runtime.groups import GROUP_AXES, kind_axes
from autoplan.runtime.pipeline import stage_walk
from autoplan.runtime.rewrite import resolve_strategies
from autoplan.strategies import EXPERT_WEIGHTS, Strategy

NAME_ORDER = ("data", "expert_data", "expert", "expert_tp", "pp", "dp", "ep", "cp", "tp")  # later = narrower

Collectives = Counter  # (kind, group name) -> calls


def group_name(mesh: MeshShape, kind: str) -> str:
    """The name the runtime's counter gives the group of `kind` (module docstring)."""
    axes = {a for a in kind_axes(mesh, kind) if mesh.degree(a) > 1}
    same = [k for k in NAME_ORDER if {a for a in kind_axes(mesh, k) if mesh.degree(a) > 1} == axes]
    return same[-1]


def _op_collectives(node: NodeInfo, strategy: Strategy) -> tuple[list[str], list[str]]:
    """(forward, backward) collective kinds on tp of one node's own strategy."""
    kind, name = node.op_kind, strategy.name
    params = len(node.params)
    if name == "row":
        return ["all_reduce"], []
    if name == "row_sp":
        has_bias = any(p.endswith(".bias") for p, _ in node.params)
        return ["reduce_scatter"], ["all_gather"] + ["all_reduce"] * has_bias
    if kind == "embedding" and name == "vocab":
        return ["all_reduce"], []
    if kind == "embedding" and name == "vocab_sp":
        return ["reduce_scatter"], ["all_gather"]
    if kind == "cross_entropy":
        return {"vocab": (["all_reduce"] * 2, []), "sequence": (["all_reduce"], [])}.get(name,
                                                                                        ([], []))
    if kind == "moe" and name == "ffn":
        return ["all_reduce"], ["all_reduce"] * 2
    if kind == "moe" and name == "expert":
        return [], ["all_reduce"] * sum(p.grad_partial for p in strategy.params)
    if name == "sequence":
        return [], ["all_reduce"] * params
    return [], []


def _conversion(src, dst, grad_partial: bool) -> tuple[list[str], list[str]]:
    if grad_partial:
        return ([], ["all_reduce"]) if src == Replicate() else (["all_gather"], ["reduce_scatter"])
    if src == dst:
        return [], []
    if src == Replicate():
        return [], ["all_gather"]
    if dst == Replicate():
        return ["all_gather"], []
    return ["all_to_all"], ["all_to_all"]


def _needs_grad(graph: CapturedGraph) -> dict[str, bool]:
    """Whether each node's value has a gradient (it depends on a parameter)."""
    found: dict[str, bool] = {}
    for node in graph.nodes:
        found[node.name] = bool(node.params) or any(found.get(i, False) for i in node.inputs)
    return found


def node_stages(graph: CapturedGraph, plan: Plan) -> dict[str, int]:
    """Global pipeline stage of every captured node (as runtime.pipeline assigns them)."""
    return dict(zip((n.name for n in graph.nodes), stage_walk((n.layer for n in graph.nodes), plan)))


def expected_collectives(plan: Plan, config: ModelConfig, pp_index: int = 0,
                         graph: CapturedGraph | None = None,
                         check_finite: bool = True) -> Collectives:
    """What one `train_step` of the rank at pipeline coordinate `pp_index` issues through the
    runtime's collectives (module docstring), for a program made with `check_finite`."""
    mesh = plan.mesh
    if graph is None:
        graph = capture(build_model(config, "meta"), config, plan.microbatch_size, plan.seq_len,
                        getattr(torch, plan.dtype))
    strategies = resolve_strategies(plan, graph.nodes)
    stages = node_stages(graph, plan)
    mine = {s.chunk * mesh.pp + s.stage for s in plan.stages if s.stage == pp_index}
    grad = _needs_grad(graph)
    names = {k: group_name(mesh, k) for k in GROUP_AXES}
    policy = recompute_policy(plan.recompute)
    per_microbatch: Collectives = Counter()
    converted: set[tuple] = set()

    def add(kinds: list[str], group: str, times: int = 1) -> None:
        for kind in kinds:
            per_microbatch[(kind, names[group])] += times

    for node in graph.nodes:
        if node.op_kind in ("placeholder", "output"):
            continue
        local = stages[node.name] in mine
        recomputed = 2 if policy.recomputes(node.layer, config.num_layers) else 1
        strategy = strategies[node.name]
        if mesh.tp > 1:
            fwd, bwd = _op_collectives(node, strategy)
            for producer, spec in zip(node.inputs, strategy.inputs):
                src = strategies[producer].output
                key = (producer, str(src), str(spec.placement), spec.grad_partial)
                if key in converted:  # one conversion node serves every such consumer
                    continue
                converted.add(key)
                c_fwd, c_bwd = _conversion(src, spec.placement, spec.grad_partial)
                fwd, bwd = fwd + c_fwd, bwd + (c_bwd if grad[producer] else [])
            if local:
                add(fwd, "tp", recomputed)
                add(bwd, "tp")
        if local and mesh.context_parallel > 1 and node.op_kind == "attention":
            add(["all_to_all"] * 4, "cp", recomputed)
            add(["all_to_all"] * 4, "cp")
        if local and mesh.expert_parallel > 1 and node.op_kind == "moe":
            add(["all_to_all"] * (2 if config.capacity_factor else 3), "expert", recomputed)  # capacity: no counts
            add(["all_to_all"] * 2, "expert")
        if local and 1 < mesh.etp < mesh.tp and node.op_kind == "moe":
            add(["all_gather"] * 2 + ["reduce_scatter"], "expert_tp", recomputed)
            add(["all_gather", "reduce_scatter"], "expert_tp")
    total = Counter({key: n * plan.num_microbatches for key, n in per_microbatch.items()})
    data, expert_data = mesh.dp * mesh.ep * mesh.cp, mesh.dp * mesh.cp
    local_params = {p for n in graph.nodes if stages[n.name] in mine for p, _ in n.params}
    experts = {p for p in local_params
               if mesh.expert_parallel > 1 and p.rsplit(".", 1)[-1] in EXPERT_WEIGHTS}
    sync = ["all_reduce"] if plan.zero_stage == 0 else ["reduce_scatter", "all_gather"]
    synced = ({names["data"]} if data > 1 and local_params - experts else set()) | (
        {names["expert_data"]} if expert_data > 1 and experts else set())  # one group: one bucket
    if plan.zero_stage < 3 or data == 1:
        for kind, group in ((k, g) for k in sync for g in synced):
            total[(kind, group)] += 1
    if mesh.pp > 1:
        total[("all_reduce", names["pp"])] += 1
    if data > 1:
        total[("all_reduce", names["data"])] += 1
    if check_finite and mesh.tp > 1:
        total[("all_reduce", names["tp"])] += 1
    return total
