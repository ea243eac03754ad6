"""One cast of a shared input under mixed precision (plan dtype bfloat16 or float16, run under
torch.autocast with float32 parameters).

Autocast casts each matmul's input by itself, so a float32 tensor read by several linears (a norm's
output feeding q, k and v, or gate and up) is copied once per linear, and each linear keeps its own
copy for backward. `share_casts` inserts one `autocast_copy` node after such a tensor's producer,
read by all of those linears: the same values, one copy made and kept.

The copy belongs to the linears' layer (`meta["layer"]`), so a recomputed layer re-makes it rather
than keeping it as a region input. The linears' input gradients then meet in the compute dtype
before the copy's backward returns them as float32 (autocast summed them in float32).
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch import nn

from autoplan.capture import NodeInfo
from autoplan.runtime.modules import GradSummed, RowParallelLinear
from autoplan.runtime.recompute import node_layer


def autocast_copy(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in `dtype` (floating tensors only; no copy when it already is)."""
    return x.to(dtype) if x.is_floating_point() else x


def _casts_input(gm: fx.GraphModule, user: fx.Node, node: fx.Node) -> bool:
    """Whether `user` is a linear that autocast runs on `node` as its input."""
    if user.op != "call_module" or not user.args or user.args[0] is not node:
        return False
    module = gm.get_submodule(user.target)
    if isinstance(module, GradSummed):
        module = module.inner
    return isinstance(module, (nn.Linear, RowParallelLinear))


def share_casts(gm: fx.GraphModule, dtype: torch.dtype, infos: dict[str, NodeInfo]) -> int:
    """Give every tensor read by two or more linears of one layer a single cast to `dtype` (module
    docstring); returns how many casts were inserted."""
    graph, inserted = gm.graph, 0
    for node in list(graph.nodes):
        users = [u for u in node.users if _casts_input(gm, u, node)]
        layers = {node_layer(u, infos) for u in users}
        if len(users) < 2 or len(layers) != 1:
            continue
        with graph.inserting_after(node):
            cast = graph.call_function(autocast_copy, (node, dtype))
        cast.meta["layer"] = layers.pop()
        for user in users:
            user.replace_input_with(node, cast)
        inserted += 1
    return inserted
