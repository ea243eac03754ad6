"""Activation recomputation as the plan says, by moving regions of the graph into checkpointed
sub-GraphModules.

    "full"       one region per transformer layer: every node of layer i (the capture's
                 `NodeInfo.layer`, or `meta["layer"]` for nodes the runtime inserted, such as the
                 tensor-parallel conversions, which belong to the node they feed)
    "selective"  the plan's `recompute_nodes`, the ops the cost model priced as recomputed
                 (written by the planner from `cost_model.memory.selective_recompute_nodes`: attention
                 cores and the pointwise ops that keep their own inputs), one region per (layer,
                 enclosing module):
                 the attention core; the MLP's activation and gating product
    "none"       nothing

A region R becomes `recompute(self.recompute_<layer>_<i>, *inputs)`, placed where R's last node was,
with `recompute(region, *args) = torch.utils.checkpoint.checkpoint(region, *args,
use_reentrant=False)` under `set_checkpoint_early_stop(False)`: forward keeps only the region's
inputs; backward re-runs the whole region (its collectives too, in the same order on every rank)
and then differentiates it. The ops and their order are unchanged, so the numbers equal those
without recomputation (bit for bit, as tests/test_runtime_recompute.py checks).

R may move as one call only if no node outside R that runs before R's last node uses a value of R;
candidates are grown node by node in graph order and cut where that would break.
"""

from __future__ import annotations

import operator

import torch.fx as fx
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from autoplan.capture import NodeInfo
from autoplan.errors import PlanError

SKIPPED_OPS = ("placeholder", "output", "get_attr")


def recompute(region: fx.GraphModule, *args):
    """Run `region` keeping only its inputs for backward (non-reentrant checkpoint). The whole
    region is re-run (early_stop=False), as the cost model prices it and as runtime.counting
    predicts its collectives; stopping early would skip a layer's trailing ops."""
    with set_checkpoint_early_stop(False):  # the context manager exists in every torch we support
        return checkpoint(region, *args, use_reentrant=False)


def node_layer(node: fx.Node, infos: dict[str, NodeInfo]) -> int | None:
    """The transformer layer a node of the rewritten graph belongs to: the capture's for captured
    nodes, `meta["layer"]` for nodes the runtime inserted (that of the node they serve)."""
    info = infos.get(node.name)
    return info.layer if info is not None else node.meta.get("layer")


def apply_recompute(gm: fx.GraphModule, policy: str, infos: dict[str, NodeInfo],
                    recompute_nodes: tuple[str, ...]) -> int:
    """Move the regions of `policy` into checkpointed submodules; returns how many."""
    if policy == "none":
        return 0
    if policy not in ("full", "selective"):
        raise PlanError(f"recompute policy {policy!r} must be 'none', 'selective' or 'full'")
    candidates: dict[tuple, list[fx.Node]] = {}
    if policy == "full":
        for node in gm.graph.nodes:
            layer = node_layer(node, infos)
            if node.op not in SKIPPED_OPS and layer is not None:
                candidates.setdefault((layer,), []).append(node)
    else:
        chosen = set(recompute_nodes)  # the plan's: what the cost model priced as recomputed
        for node in gm.graph.nodes:
            if node.name in chosen:
                info = infos[node.name]
                candidates.setdefault((info.layer, info.module_path), []).append(node)
    per_layer: dict[int | None, int] = {}
    for key, nodes in candidates.items():
        for region in _valid_regions(nodes):
            index = per_layer[key[0]] = per_layer.get(key[0], -1) + 1
            _extract(gm, region, f"recompute_{key[0]}_{index}", key[0])
    gm.graph.lint()
    return sum(n + 1 for n in per_layer.values())


def _valid_regions(nodes: list[fx.Node]) -> list[list[fx.Node]]:
    """`nodes` (graph order) cut into the longest runs that can move as one call."""
    position = {n: i for i, n in enumerate(nodes[0].graph.nodes)}
    runs: list[list[fx.Node]] = []
    for node in nodes:
        if runs and _movable(runs[-1] + [node], position):
            runs[-1].append(node)
        else:
            runs.append([node])
    return runs


def _movable(region: list[fx.Node], position: dict[fx.Node, int]) -> bool:
    inside, last = set(region), position[region[-1]]
    return all(position[user] > last for n in region for user in n.users if user not in inside)


def _extract(gm: fx.GraphModule, region: list[fx.Node], name: str, layer: int | None) -> None:
    inside = set(region)
    inputs = list(dict.fromkeys(a for n in region for a in n.all_input_nodes
                                if a not in inside and a.op != "get_attr"))
    outputs = [n for n in region if any(u not in inside for u in n.users)]
    sub = fx.Graph()
    env: dict[fx.Node, fx.Node] = {a: sub.placeholder(a.name) for a in inputs}
    for n in region:
        for a in n.all_input_nodes:
            if a.op == "get_attr" and a not in env:
                env[a] = sub.get_attr(a.target)
        env[n] = sub.node_copy(n, lambda a: env[a])
    sub.output(env[outputs[0]] if len(outputs) == 1 else tuple(env[o] for o in outputs))
    gm.add_submodule(name, fx.GraphModule(gm, sub, class_name=name))
    graph = gm.graph
    with graph.inserting_after(region[-1]):
        module = graph.get_attr(name)
    with graph.inserting_after(module):
        call = graph.create_node("call_function", recompute, (module, *inputs),
                                 name=f"{name}_out")
    results = [call]
    if len(outputs) > 1:
        results = []
        for i in range(len(outputs)):
            with graph.inserting_after(results[-1] if results else call):
                results.append(graph.call_function(operator.getitem, (call, i)))
    for made in (module, call, *results):
        made.meta["layer"] = layer
    for out, new in zip(outputs, results):
        out.replace_all_uses_with(new, delete_user_cb=lambda user: user not in inside)
    for n in reversed(region):
        graph.erase_node(n)
