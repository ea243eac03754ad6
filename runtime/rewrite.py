"""The graph rewrite: a model on meta + a Plan + this rank's mesh groups -> a per-rank GraphModule.

1. Capture the model with `autoplan.capture.capture` at the plan's (microbatch_size, seq_len): the
   node names are the planner's. Each node's strategy is the `Strategy` the plan carries
   (`plan.op(node).resolved`: input / output / parameter placements on tp), as the planner priced it.
2. Each `call_module` node whose strategy is not "replicate" gets the module that executes it on
   local shards (`_parallel_module`; see runtime.modules). Attention "heads" keeps the original
   module: it reads its head counts from the widths it is given.
3. Each tensor edge u -> v (input i) gets the conversion from u's output placement to v's input
   placement, as a call_function node fed by `tp = self.tp`:

       R -> S(d)      tp_split(x, d, tp)       slice fwd, all-gather bwd
       S(d) -> R      tp_gather(x, d, tp)      all-gather fwd, slice bwd
       S(a) -> S(b)   tp_all_to_all(x, a, b, tp)
       grad_partial input (the consumer's x.grad is a partial sum over tp):
       R -> R         tp_copy(x, tp)           identity fwd, all-reduce bwd (Megatron's f)
       S(d) -> R      tp_gather_rs(x, d, tp)   all-gather fwd, reduce-scatter bwd

   One conversion node serves every consumer that needs the same one (so the q, k and v
   projections share a single all-reduce of their partial input grads).

4. Context parallelism (runtime.context, on the groups' "cp": the cp ranks, or the ep x cp ranks
   when the ep ranks are context-parallel ones to the dense layers, mesh ep_as = "cp"; C ranks):
   every activation holds this rank's T/C tokens; each attention core's q, k, v pass through
   `cp_heads` (all-to-all from sequence to head shards) and its output through `cp_sequence`
   (back); position indices get this rank's global offset. The MoE layers of step 5 route those
   T/C tokens per token as they would a batch shard's.
5. Expert parallelism: each MoE layer holds E/n experts of the expert group (groups "expert":
   the n = ep ranks, or n = ep x tp / etp when etp < tp) and dispatches tokens to their experts'
   ranks (runtime.experts). Under etp < tp its strategy "expert" reads its tokens split along the
   sequence over tp (step 3 slices a replicated input and all-gathers the output where the next op
   wants it whole), so each tp rank dispatches its own 1/tp of the tokens; each expert's FFN is
   split over the etp ranks of the "expert_tp" group (whole when etp = 1).
6. Under mixed precision, one cast of each tensor that several linears of a layer read
   (runtime.casts). The fused kernels of runtime.kernels (runtime.kernel_ops) for norms, RoPE, the loss and the
   MLP activations, on the backend `plan.kernels` names ("auto": Triton on CUDA, torch on CPU).
7. Recomputation as the plan's policy says (runtime.recompute): each recomputed layer's subgraph in
   torch's selective activation checkpointing, saving the outputs of the op families the policy names.

The result prints as Python: `print(rewritten.graph_module.code)`.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch import nn

from autoplan.capture import NodeInfo, capture
from autoplan.errors import PlanError
from autoplan.models.config import ModelConfig
from autoplan.placement import Partial, Placement, Replicate, Shard
from autoplan.plan import Plan
from autoplan.recompute_policy import RecomputePolicy, recompute_policy
from autoplan.runtime import collectives as C
from autoplan.runtime.casts import share_casts
from autoplan.runtime.context import apply_context_parallel
from autoplan.runtime.groups import RankGroup
from autoplan.runtime.kernel_ops import RopeTables, apply_kernels, kernel_module
from autoplan.runtime.modules import (GradSummed, ParallelMoE, RowParallelLinear,
                                      SequenceParallelLoss, VocabParallelEmbedding,
                                      VocabParallelLoss)
from autoplan.runtime.recompute import apply_recompute
from autoplan.strategies import EXPERT_WEIGHTS, Strategy, replicate_only

R = Replicate()
DEFAULT_REPLICATED_KINDS = ("placeholder", "output")  # may be left out of a plan


# ---------------------------------------------------------------- conversions (graph functions)


def tp_split(x: torch.Tensor, dim: int, tp: RankGroup) -> torch.Tensor:
    return C.split_along(x, dim, tp.group)


def tp_gather(x: torch.Tensor, dim: int, tp: RankGroup) -> torch.Tensor:
    return C.gather_along(x, dim, tp.group)


def tp_all_to_all(x: torch.Tensor, src_dim: int, dst_dim: int, tp: RankGroup) -> torch.Tensor:
    return C.all_to_all_dims(x, src_dim, dst_dim, tp.group)


def tp_copy(x: torch.Tensor, tp: RankGroup) -> torch.Tensor:
    return C.copy_to_region(x, tp.group)


def tp_gather_rs(x: torch.Tensor, dim: int, tp: RankGroup) -> torch.Tensor:
    return C.gather_fwd_reduce_scatter_bwd(x, dim, tp.group)


def conversion(src: Placement, dst: Placement, grad_partial: bool, where: str
               ) -> tuple[object, tuple[int, ...]] | None:
    """(graph function, its dim arguments) turning `src` into `dst`, or None when none is needed."""
    if isinstance(src, Partial) or isinstance(dst, Partial):
        raise PlanError(f"{where}: Partial placements between ops are not executed by this runtime "
                        f"(strategies reduce their own outputs); got {src} -> {dst}")
    if grad_partial:
        if dst != R:
            raise PlanError(f"{where}: a grad_partial input must be Replicate, got {dst}")
        return (tp_copy, ()) if src == R else (tp_gather_rs, (src.dim,))
    if src == dst:
        return None
    if src == R:
        return tp_split, (dst.dim,)
    if dst == R:
        return tp_gather, (src.dim,)
    return tp_all_to_all, (src.dim, dst.dim)


# ---------------------------------------------------------------- the rewrite


@dataclass(frozen=True)
class ParamLayout:
    """A parameter of the user's model as one rank holds it (names are the same in the program)."""

    name: str
    shape: tuple[int, ...]  # full shape
    placement: Placement  # on tp
    grad_partial: bool  # replicated, used on a shard of the tokens: grad summed over tp
    expert: bool = False  # an expert weight: dim 0 (experts) split over the expert group
    node: str = ""  # the captured node that uses it
    folded: bool = False  # an expert weight whose expert group spans tp too (etp < tp): no tp split
    ffn_split: Placement | None = None  # folded, 1 < etp < tp: its FFN dim, split over expert_tp

    def pieces(self, groups: dict[str, RankGroup]) -> list[tuple[Placement, int, int]]:
        """(placement, index, degree) per splitting axis, outer first: the argument of
        `init.nested_bounds`. Experts take their block by their position in the expert group, then
        (1 < etp < tp) their FFN slice by their position in the expert_tp group."""
        experts, tp, etp = groups["expert"], groups["tp"], groups["expert_tp"]
        outer = [(Shard(0), experts.index, experts.size)] if self.expert else []
        if self.folded:
            return outer + ([(self.ffn_split, etp.index, etp.size)] if self.ffn_split else [])
        return outer + [(self.placement, tp.index, tp.size)]


@dataclass
class Rewritten:
    graph_module: fx.GraphModule
    params: dict[str, ParamLayout]
    strategies: dict[str, Strategy]  # by node name
    infos: dict[str, NodeInfo] = field(default_factory=dict)  # the capture's, by node name
    module_targets: tuple[str, ...] = ()  # call_module targets, in graph order
    recompute: RecomputePolicy = RecomputePolicy("none")  # the policy applied (the plan's)
    recomputed_layers: tuple[int, ...] = ()  # the layers run as recomputed regions
    module_layers: tuple[int | None, ...] = ()  # the layer of each target (None: embedding, head): FSDP units


def meta_copy(model: nn.Module) -> nn.Module:
    """A deep copy of `model` whose parameters and buffers are on meta (the original is untouched,
    and a CPU model's weights are not copied)."""
    memo = {}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        meta = torch.empty_like(t, device="meta")
        memo[id(t)] = nn.Parameter(meta, t.requires_grad) if isinstance(t, nn.Parameter) else meta
    return copy.deepcopy(model, memo)


def rewrite(model: nn.Module, config: ModelConfig, plan: Plan,
            groups: dict[str, RankGroup] | RankGroup) -> Rewritten:
    """The per-rank program of `plan` for this rank's coordinates in `groups` (runtime.groups; a
    single RankGroup means tp, every other axis of degree 1). Parameters stay on meta."""
    groups = _complete(groups)
    tp, experts = groups["tp"], groups["expert"]
    folded = plan.mesh.etp < plan.mesh.tp
    etp_group = groups["expert_tp"] if 1 < plan.mesh.etp < plan.mesh.tp else None
    captured = capture(meta_copy(model), config, plan.microbatch_size, plan.seq_len,
                       getattr(torch, plan.dtype))
    gm, infos = captured.graph_module, {n.name: n for n in captured.nodes}
    strategies = resolve_strategies(plan, captured.nodes)
    params: dict[str, ParamLayout] = {}
    planned = {p.name: dict(p.placements) for p in plan.params}
    targets, target_layers, rope_tables = [], [], RopeTables()
    for node in gm.graph.nodes:
        if node.op == "call_module":
            targets.append(node.target)
            target_layers.append(infos[node.name].layer)
            current = gm.get_submodule(node.target)
            original = kernel_module(current, plan.kernels, rope_tables)
            expert = experts.size > 1 and infos[node.name].op_kind == "moe"
            params.update(_layouts(node.name, node.target, original, strategies[node.name], planned,
                                   expert, folded, etp_group is not None))
            replacement = _parallel_module(original, infos[node.name], strategies[node.name], tp,
                                           experts if expert else None, plan.kernels, etp_group)
            if isinstance(replacement, ParallelMoE):
                replacement.kernels = plan.kernels  # its permute / silu * mul kernels
            if replacement is not current:
                _set_submodule(gm, node.target, replacement)
    if tp.size > 1:
        gm.add_submodule("tp", tp)
        _insert_conversions(gm.graph, infos, strategies)
    if groups["cp"].size > 1:
        apply_context_parallel(gm, infos, strategies, groups["cp"], tp.size, config.head_dim)
    if plan.dtype != "float32":
        share_casts(gm, getattr(torch, plan.dtype), infos)
    apply_kernels(gm.graph, plan.kernels)
    policy = recompute_policy(plan.recompute)
    layers = apply_recompute(gm, policy, infos, config.num_layers)
    gm.graph.lint()
    gm.recompile()
    return Rewritten(gm, params, strategies, infos, tuple(targets), policy, layers, tuple(target_layers))


def _complete(groups: dict[str, RankGroup] | RankGroup) -> dict[str, RankGroup]:
    """Every axis kind of runtime.groups, one-rank groups where `groups` does not say."""
    if isinstance(groups, RankGroup):
        groups = {"tp": groups}
    full = {k: RankGroup(k, (0,), 0, None) for k in ("tp", "cp", "ep", "dp", "pp", "data",
                                                      "expert_data")}
    full["expert"] = groups.get("ep", full["ep"])  # experts over ep alone unless told
    full["expert_tp"] = groups.get("tp", full["tp"])  # and their FFN over tp
    return {**full, **groups}


def resolve_strategies(plan: Plan, nodes: tuple[NodeInfo, ...]) -> dict[str, Strategy]:
    """Each node's strategy as the plan resolved it (`OpPlacement.resolved`): the runtime executes the
    plan, it never asks the strategy rules again."""
    found = {}
    for node in nodes:
        op = plan.op(node.name)
        if op is None and (node.op_kind in DEFAULT_REPLICATED_KINDS or node.output is None):
            found[node.name] = replicate_only(node, plan.mesh.tp, {})[0]
            continue
        if op is None:
            raise PlanError(f"node {node.name!r} ({node.op_kind} {node.target}) is missing from the "
                            f"plan's op placements; the plan was made for another model or capture")
        if op.resolved is None:
            raise PlanError(f"plan: op {node.name!r} carries no resolved strategy (a plan written by hand or "
                            f"by another tool); re-make it with `autoplan search` or `autoplan estimate`")
        strategy = op.resolved
        if strategy.name != op.strategy:
            raise PlanError(f"node {node.name!r}: the plan names strategy {op.strategy!r} but carries the "
                            f"resolved strategy {strategy.name!r}; re-make the plan with `autoplan search` or "
                            f"`autoplan estimate` rather than editing it")
        planned = dict(op.output).get("tp")
        if planned is not None and node.output is not None and planned != strategy.output:
            raise PlanError(f"node {node.name!r}: the plan says its output is {planned} on tp but "
                            f"strategy {op.strategy!r} produces {strategy.output}")
        found[node.name] = strategy
    return found


EXPERT_FFN_DIMS = {"w_gate": Shard(2), "w_up": Shard(2), "w_down": Shard(1)}  # split over etp


def _layouts(node: str, path: str, module: nn.Module, strategy: Strategy,
             planned: dict[str, dict], expert_parallel: bool, folded: bool = False,
             ffn_split: bool = False) -> dict[str, ParamLayout]:
    """Each parameter's layout; `folded`: etp < tp, `ffn_split`: 1 < etp < tp (expert weights'
    FFN dim split over the expert_tp group)."""
    out = {}
    for pname, param in module.named_parameters():
        name = f"{path}.{pname}"
        placement = strategy.param_placement(pname)
        said = planned.get(name, {})
        if said.get("tp") not in (None, placement):
            raise PlanError(f"parameter {name!r}: the plan places it {said['tp']} on tp but the "
                            f"strategy {strategy.name!r} of its op needs {placement}")
        expert = expert_parallel and pname in EXPERT_WEIGHTS
        if said.get("ep") not in (None, Shard(0) if expert else R):
            raise PlanError(f"parameter {name!r}: the plan places it {said['ep']} on ep; the "
                            f"runtime splits expert weights on dim 0 (S(0)) and replicates the rest")
        grad_partial = any(s.name == pname and s.grad_partial for s in strategy.params)
        split = EXPERT_FFN_DIMS[pname] if expert and folded and ffn_split else None
        out[name] = ParamLayout(name, tuple(param.shape), placement, grad_partial, expert, node,
                                expert and folded, split)
    return out


def _set_submodule(gm: fx.GraphModule, target: str, module: nn.Module) -> None:
    parent, _, leaf = target.rpartition(".")
    setattr(gm.get_submodule(parent) if parent else gm, leaf, module)


def _insert_conversions(graph: fx.Graph, infos: dict[str, NodeInfo],
                        strategies: dict[str, Strategy]) -> None:
    first = next(n for n in graph.nodes if n.op != "placeholder")
    with graph.inserting_before(first):
        tp_node = graph.get_attr("tp")
    by_name = {n.name: n for n in graph.nodes}
    made: dict[tuple, fx.Node] = {}
    for node in list(graph.nodes):
        info, strategy = infos.get(node.name), strategies.get(node.name)
        if info is None or strategy is None:
            continue
        if len(strategy.inputs) != len(info.inputs):
            raise PlanError(f"node {node.name!r}: strategy {strategy.name!r} describes "
                            f"{len(strategy.inputs)} inputs, the node has {len(info.inputs)}")
        for producer_name, spec in zip(info.inputs, strategy.inputs):
            src = strategies[producer_name].output
            where = f"edge {producer_name} -> {node.name}"
            step = conversion(src, spec.placement, spec.grad_partial, where)
            if step is None:
                continue
            key = (producer_name, str(src), str(spec.placement), spec.grad_partial)
            if key not in made:
                fn, dims = step
                with graph.inserting_before(node):
                    made[key] = graph.create_node("call_function", fn,
                                                  (by_name[producer_name], *dims, tp_node),
                                                  name=f"{producer_name}_{fn.__name__[3:]}")
                made[key].meta.update(layer=info.layer, tp_placement=spec.placement,
                                      conversion=(fn.__name__, str(src), str(spec.placement)))
            node.replace_input_with(by_name[producer_name], made[key])


# ---------------------------------------------------------------- parallel modules


def _parallel_module(module: nn.Module, info: NodeInfo, strategy: Strategy, tp: RankGroup,
                     ep: RankGroup | None = None, kernels: str = "auto",
                     etp: RankGroup | None = None) -> nn.Module:
    """The module that runs `strategy` for node `info` on this rank (meta parameters); `ep` for a
    MoE layer whose experts are split over the ranks of an expert group (ep, or ep x tp / etp),
    `etp` the expert_tp group splitting each expert's FFN under 1 < etp < tp."""
    kind, name, g, n, r = info.op_kind, strategy.name, tp.group, tp.size, tp.index
    if kind == "moe" and ep is not None:
        experts, hidden, ffn = module.w_gate.shape
        if experts % ep.size:
            raise PlanError(f"node {info.name!r}: {experts} experts cannot be split over the "
                            f"{ep.size} ranks of the expert group (ep, x tp when etp < tp); plan "
                            f"an ep (and etp) whose group size divides {experts}")
        split = n if name == "ffn" else etp.size if etp is not None else 1
        if ffn % split:
            raise PlanError(f"node {info.name!r}: the experts' FFN width {ffn} cannot be split over "
                            f"{split} ranks (etp); plan an etp that divides {ffn}")
        return ParallelMoE(hidden, ffn // split, experts // ep.size, module.top_k, g, name,
                           ep_group=ep.group, etp_group=etp.group if etp is not None else None,
                           capacity_factor=module.capacity_factor)
    if name == "replicate" or (kind, name) == ("attention", "heads"):
        return module
    if kind == "linear" and name == "column":
        return nn.Linear(module.in_features, module.out_features // n, bias=module.bias is not None,
                         device="meta")
    if kind == "linear" and name in ("row", "row_sp"):
        return RowParallelLinear(module.in_features // n, module.out_features,
                                 module.bias is not None, g, 1 if name == "row_sp" else None)
    if (kind, name) in (("linear", "sequence"), ("norm", "sequence")):
        return GradSummed(module, g)
    if kind == "embedding" and name in ("vocab", "vocab_sp"):
        rows = module.num_embeddings // n
        return VocabParallelEmbedding(rows, module.embedding_dim, r * rows, g,
                                      1 if name == "vocab_sp" else None)
    if (kind, name) == ("embedding", "hidden"):
        return nn.Embedding(module.num_embeddings, module.embedding_dim // n,
                            padding_idx=module.padding_idx, device="meta")
    if kind == "cross_entropy" and name == "vocab":
        return VocabParallelLoss(r * info.input_metas[0].shape[-1] // n, g, kernels)
    if (kind, name) == ("cross_entropy", "sequence"):
        return SequenceParallelLoss(g)
    if kind == "moe" and name in ("ffn", "sequence"):
        experts, hidden, ffn = module.w_gate.shape
        ffn_local = ffn // n if name == "ffn" else ffn
        return ParallelMoE(hidden, ffn_local, experts, module.top_k, g, name,
                           capacity_factor=module.capacity_factor)
    raise PlanError(f"node {info.name!r}: the runtime has no implementation of strategy {name!r} "
                    f"for op kind {kind!r} ({info.target})")
