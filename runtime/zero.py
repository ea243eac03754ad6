"""ZeRO stage 3 on the dp axis with torch's FSDP2 (`fully_shard`).

Each module of the rewritten graph that owns parameters becomes one FSDP unit over a DeviceMesh
made from the data process group (dp, and cp when context-parallel: the ranks that hold the same
tp shards), then the GraphModule itself becomes the root unit. A parameter's tp-local shard is
split once more along dim 0 over those ranks (a DTensor on their mesh):

    stage 3  reshard_after_forward=True: parameters are gathered again for backward; gradients
             are reduce-scattered (averaged over dp) in backward, optimizer states sharded
             (reshard_after_forward=False, parameters kept gathered to backward, for `zero_stage`
             2 if it is ever passed here; the runtime runs stage 2 as `runtime.grad_sync`'s
             distributed optimizer)

Tensor parallelism stays outside FSDP: it sees plain local tensors, and the graph's own
collectives run on the tp group as before. Stages 1 and 2 use `runtime.grad_sync` instead.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from autoplan.errors import PlanError

IN_PLACE_TARGETS = ("iadd", "isub", "imul", "itruediv", "add_", "sub_", "mul_", "div_")


def shard_over_dp(graph_module: fx.GraphModule, module_targets: tuple[str, ...], dp_group,
                  device: torch.device, zero_stage: int) -> None:
    """Apply `fully_shard` to every parameter-owning module of `module_targets` (the captured
    call_module targets, which recompute regions may have moved out of the top graph), then to
    the root."""
    _refuse_in_place(graph_module)
    mesh = DeviceMesh.from_group(dp_group, device.type)
    reshard = zero_stage == 3
    for target in dict.fromkeys(module_targets):
        module = graph_module.get_submodule(target)
        if next(module.parameters(), None) is not None:
            fully_shard(module, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(graph_module, mesh=mesh, reshard_after_forward=reshard)


def _refuse_in_place(graph_module: fx.GraphModule) -> None:
    """FSDP2 hooks the outputs of its units; an in-place op on one (`x += y`) would drop the hook."""
    graphs = [m.graph for m in graph_module.modules() if isinstance(m, fx.GraphModule)]
    for node in (n for graph in graphs for n in graph.nodes):
        name = getattr(node.target, "__name__", str(node.target))
        if node.op in ("call_function", "call_method") and name in IN_PLACE_TARGETS:
            raise PlanError(f"node {node.name!r} runs the in-place op {name!r}, which ZeRO stages 2 "
                            f"and 3 (FSDP2) cannot follow; write it out of place (x = x + y) or "
                            f"plan with zero_stage 0 or 1")


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tp-local tensor behind a dp-sharded DTensor (a collective over dp), else `t`."""
    return t.full_tensor() if isinstance(t, DTensor) else t
