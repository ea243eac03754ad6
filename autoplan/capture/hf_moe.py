"""transformers' mixture-of-experts blocks captured as one "moe" node, as the zoo's `MoEFeedForward`.

A transformers 5 MoE block (Mixtral's `MixtralSparseMoeBlock`, Qwen2-MoE's `Qwen2MoeSparseMoeBlock`)
holds a router (`gate`: a module whose `weight` is (E, h)) and a fused experts module (`experts`:
`gate_up_proj` (E, 2f, h), `down_proj` (E, h, f), `autoplan.strategies.EXPERT_FFN_DIMS`), and may
hold shared experts beside them (Qwen2-MoE's `shared_expert`, `shared_expert_gate`: ordinary
linears, planned as a dense MLP, as the zoo's DeepSeekMoE shared experts are).

The "moe" node is the routed part: every op of the router and the experts (router linear, softmax,
top-k, renormalisation, sort / histc / grouped GEMMs / weighted sum of the experts) and the block's
own ops between them, from the block's flattened input x (N, h) to the experts' output (N, h);
recorded (B, T, h) -> (B, T, h) like the zoo's. Its parameters are the router's weight and the two
expert weights, under the block's module path, so that the MoE strategies (`autoplan.strategies.
moe_strategies`), expert parallelism (expert weights split by ep, `solver.context`), the dispatch
and combine all-to-alls (`cost_model.step`), the MoE compute and activation models price it as
they price the zoo's MoE: one mechanism. Costs, the zoo's formula (`autoplan.capture.fx`):

    fwd FLOPs = 2 N h E + top_k * 3 * 2 N h f      (router + top_k SwiGLU experts per token)
    fwd bytes = x + parameters + output            bwd = 2 x fwd (FLOPs and bytes)

A block whose ops do not form one such region (x feeds it more than once, an inner tensor is read
outside it) is left unfused: its grouped linears then stay "linear" ops, as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx
from torch import nn

from autoplan.strategies import EXPERT_FFN_DIMS


@dataclass(frozen=True)
class MoeBlock:
    """One MoE block of the model: its module path, its router's and its experts' paths."""

    path: str
    router: str
    experts: str


def moe_blocks(model: nn.Module) -> list[MoeBlock]:
    """The MoE blocks of `model`: a module holding 3-D expert weights (`EXPERT_FFN_DIMS` names),
    whose parent holds a sibling module with a (E, h) `weight` (the router)."""
    modules = dict(model.named_modules())
    found = []
    for path, module in modules.items():
        weights = {n: p for n, p in module.named_parameters(recurse=False) if n in EXPERT_FFN_DIMS and p.dim() == 3}
        parent, _, _ = path.rpartition(".")
        if not weights or not parent:
            continue
        experts = next(iter(weights.values())).shape[0]
        router = next((f"{parent}.{name}" for name, child in modules[parent].named_children()
                       if f"{parent}.{name}" != path and isinstance(getattr(child, "weight", None), torch.Tensor)
                       and child.weight.dim() == 2 and child.weight.shape[0] == experts), None)
        if router is not None:
            found.append(MoeBlock(parent, router, path))
    return found


def moe_region(block: MoeBlock, graph: fx.Graph, paths: dict, is_op) -> tuple[set[str], fx.Node] | None:
    """(member names, output node) of `block`'s routed part in the exported graph (module docstring),
    or None when it is not one region. `paths`: fx node name -> (module path, class); `is_op`: whether
    an fx node is an op (not a parameter, constant or skipped node)."""
    inside = lambda n: _within(paths[n.name][0], block.router) or _within(paths[n.name][0], block.experts)  # noqa: E731
    outputs = [n for n in graph.nodes if n.op == "call_function" and is_op(n) and _within(paths[n.name][0], block.experts)
               and any(not inside(u) and is_op(u) for u in n.users)]
    if len(outputs) != 1:
        return None
    members, todo = set(), [outputs[0]]
    while todo:  # backwards from the experts' output through the router, the experts and the block's glue
        n = todo.pop()
        if n.name in members or n.op != "call_function" or not is_op(n):
            continue
        if not (inside(n) or paths[n.name][0] == block.path):
            continue
        members.add(n.name)
        todo.extend(n.all_input_nodes)
    by_name = {n.name: n for n in graph.nodes}
    leaking = True
    while leaking:  # a tensor read outside (the flattened x the shared experts also read) is an input
        leaking = [m for m in members if m != outputs[0].name
                   and any(u.name not in members and is_op(u) for u in by_name[m].users)]
        members -= set(leaking)
    return members, outputs[0]


def moe_forward_flops(x_shape: tuple, params: dict, top_k: int) -> float:
    """2 N h E + top_k 3 2 N h f (module docstring), x (B, T, h); `params`: last name part -> shape."""
    experts, hidden, ffn = params["down_proj"]
    rows = x_shape[0] * x_shape[1]
    return float(2 * rows * hidden * experts + top_k * 3 * 2 * rows * hidden * ffn)


def _within(path: str, module: str) -> bool:
    return path == module or path.startswith(module + ".")
