"""ZeRO stage 3 on the dp axis with torch's FSDP2 (`fully_shard`).

The parameter-owning modules of each transformer layer become one FSDP unit together (`fully_shard`
of the layer's modules as a list, as torchtitan shards a block), over a DeviceMesh made from the data
process group (dp, and cp when context-parallel: the ranks that hold the same tp shards); then the
GraphModule itself becomes the root unit, holding the modules of no layer (embedding, final norm,
head). One unit per layer and one for the ends is what the cost model prices (`cost_model.step`:
one all-gather per unit forward, one all-gather and one reduce-scatter backward). A unit per module
(9 per Llama layer) paid FSDP2's fixed costs per unit (hooks, copies, a collective's latency) that
many times: on 2 gloo ranks, benchmarks/step_fidelity.py's 4-layer Llama took 0.83 s of CPU per step
so, 0.68 s with a unit per layer, 0.63 s under ZeRO 0 (2026-11-25, medians of 12 steps). A
parameter's tp-local shard is split once more along dim 0 over those ranks (a DTensor on their mesh):

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
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from autoplan.errors import PlanError

IN_PLACE_TARGETS = ("iadd", "isub", "imul", "itruediv", "add_", "sub_", "mul_", "div_")


def shard_over_dp(graph_module: fx.GraphModule, module_targets: tuple[str, ...], module_layers: tuple[int | None, ...],
                  dp_group, device: torch.device, zero_stage: int, precision: str = "autocast") -> None:
    """Apply `fully_shard` to the modules of each layer together (`layer_units`), then to the root."""
    _refuse_in_place(graph_module)
    mesh = DeviceMesh.from_group(dp_group, device.type)
    reshard, policy = zero_stage == 3, fsdp_precision(precision)
    for modules in layer_units(graph_module, module_targets, module_layers):
        fully_shard(modules, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
    fully_shard(graph_module, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)


def fsdp_precision(precision: str) -> MixedPrecisionPolicy:
    """FSDP2's policy for a plan precision (both runtimes): under "bf16-master" the sharded float32
    parameters are the master weights, gathered in bfloat16 for compute, and gradients reduce-scattered
    in float32 (torchtitan's MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)); under
    "autocast" FSDP2 leaves dtypes alone (torch.autocast casts)."""
    if precision == "bf16-master":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def layer_units(graph_module: nn.Module, module_targets: tuple[str, ...],
                module_layers: tuple[int | None, ...]) -> list[list[nn.Module]]:
    """The parameter-owning modules of `module_targets` (the captured call_module targets, which
    recompute regions may have moved out of the top graph) grouped by their layer (`module_layers`,
    one per target), in graph order; modules of no layer are left to the root unit."""
    if len(module_targets) != len(module_layers):
        raise PlanError(f"{len(module_targets)} module targets but {len(module_layers)} layers for them")
    units: dict[int, list[nn.Module]] = {}
    for target, layer in zip(module_targets, module_layers):
        module = graph_module.get_submodule(target)
        if layer is None or next(module.parameters(), None) is None:
            continue
        unit = units.setdefault(layer, [])
        if all(m is not module for m in unit):
            unit.append(module)
    return list(units.values())


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
