"""Expert parallelism for the user's own MoE modules (transformers' fused experts: Mixtral's
`MixtralExperts`, Qwen2-MoE's `Qwen2MoeExperts`), run with the dispatch of the zoo's MoE.

Which modules. The plan places each expert weight ("ep", Shard(0)) (`solver.context`, the names of
`autoplan.strategies.EXPERT_FFN_DIMS`: gate_up_proj (E, 2f, h), down_proj (E, h, f)); the module
holding them is an experts module whose forward is `(x (N, h), top_k_index (N, k), top_k_weights
(N, k)) -> (N, h)`. Its parameters stay the module's own, under their own names; only where they
live and how the forward runs change:

    weights   each expert weight becomes a DTensor on the ("ep", "tp") mesh, [Shard(0), Replicate()]:
              the rank at ep coordinate e holds experts [e E_l, (e+1) E_l), E_l = E / ep (sliced from
              the module's tensors, or read as that slice of the checkpoint: `runtime.weights`)
    forward   the token dispatch of `runtime.experts.expert_parallel_ffn` around the module's own
              computation, over the ep group (the ranks of one dp and tp coordinate):

        r      = moe_routing(top_k_index, E)         the N k (token, slot) copies sorted by expert
        send   = moe_permute(x, r)                   (N k, h); ep runs of E_l experts each
        counts = copies per expert as (ep, E_l), exchanged (all-to-all of ints)
        recv   = all_to_all(send)                    dispatch: (M, h), by source rank then expert
        y      = the module's forward on recv with its E_l local experts: ids = each row's local
                 expert, k = 1, weight 1 (an exact product), so the module's own kernels run
        back   = all_to_all(y)                       combine: (N k, h) in send's order
        out    = moe_unpermute(back, top_k_weights, r) = sum_j w_tj y_tj, summed in fp32

This is what the cost model prices for ep (`cost_model.parallel_dims.expert_all_to_all_s`: per MoE
layer and microbatch two all-to-alls of the N k routed rows forward, two backward). Both all-to-alls
are autograd-aware (backward sends the grads back along the same rows), so the expert weights' grads
come from every ep rank's tokens and the tokens' grads return to their ranks; the router's grad
flows through the weights of `moe_unpermute`. No capacity limit: every token reaches its experts.

Gradients (`sync_expert_gradients`): the dense layers are data-parallel over dp x ep, the experts
over dp only (the ranks holding the same experts). With each rank's loss scaled by dp ep / N, the
expert grads are summed over dp and divided by dp x ep, as the dense ones are summed over dp x ep
and divided by dp x ep.
"""

from __future__ import annotations

import contextlib
import types

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from autoplan.errors import PlanError
from autoplan.plan import Plan
from autoplan.placement import Shard as PlanShard
from autoplan.runtime.collectives import all_to_all_uneven, exchange
from autoplan.runtime.kernels import moe_permute, moe_routing, moe_unpermute


def expert_weight_names(plan: Plan) -> list[str]:
    """The parameters the plan splits over ep: ("ep", Shard(0))."""
    return [p.name for p in plan.params if dict(p.placements).get("ep") == PlanShard(0)]


def experts_modules(plan: Plan, model: nn.Module) -> dict[str, nn.Module]:
    """{module path: experts module} holding the plan's expert weights (those the model holds: with a
    pipeline, this rank's stages'); PlanError where a module
    holds a parameter the plan does not split with them, or the experts do not divide by ep."""
    ep = plan.mesh.ep
    found: dict[str, nn.Module] = {}
    present = {n for n, _ in model.named_parameters()}
    for name in expert_weight_names(plan):
        if name not in present:  # on another pipeline stage (`module_stages.StageCut.prune`)
            continue
        path = name.rpartition(".")[0]
        found[path] = model.get_submodule(path)
    for path, module in found.items():
        names = [f"{path}.{n}" for n, _ in module.named_parameters(recurse=False)]
        mixed = sorted(set(names) - set(expert_weight_names(plan)))
        if mixed:
            raise PlanError(f"module {path!r} holds expert weights and also {mixed}, which the plan does not "
                            f"split over ep; the expert-parallel runtime runs modules whose parameters are "
                            f"all expert weights (transformers' fused experts)")
        experts = next(module.parameters()).shape[0]
        if experts % ep:
            raise PlanError(f"module {path!r} holds {experts} experts, which ep={ep} does not divide; plan an "
                            f"ep that divides {experts}")
    return found


@torch.no_grad()
def distribute_experts(plan: Plan, model: nn.Module, mesh: DeviceMesh) -> list[nn.Parameter]:
    """Make every expert weight this rank's slice (a DTensor [Shard(0), Replicate()] on the mesh's
    ("ep", "tp") submesh) and every experts module's forward the dispatch (module docstring);
    returns the expert parameters."""
    if plan.mesh.ep == 1:
        return []
    sub = mesh["ep", "tp"]
    placements = [Shard(0), Replicate()]
    group, rank = mesh.get_group("ep"), mesh.get_local_rank("ep")
    held = []
    for module in experts_modules(plan, model).values():
        for attr, p in list(module._parameters.items()):
            local = p.chunk(plan.mesh.ep)[rank] if not p.is_meta else torch.empty(
                (p.shape[0] // plan.mesh.ep, *p.shape[1:]), dtype=p.dtype, device="meta")
            tensor = DTensor.from_local(local.contiguous(), sub, placements, run_check=False,
                                        shape=p.shape, stride=p.stride())
            module._parameters[attr] = nn.Parameter(tensor, requires_grad=p.requires_grad)
            held.append(module._parameters[attr])
        _dispatch_forward(module, group, plan.mesh.ep, plan.kernels)
    return held


@contextlib.contextmanager
def _local_weights(module: nn.Module):
    """For the call, the module's attributes name its expert weights' local tensors (`to_local`:
    differentiable, the grads land on the DTensor parameters), shadowing the parameters."""
    names = [n for n, p in module.named_parameters(recurse=False) if isinstance(p, DTensor)]
    for n in names:
        object.__setattr__(module, n, module._parameters[n].to_local())
    try:
        yield
    finally:
        for n in names:
            del module.__dict__[n]


def _dispatch_forward(module: nn.Module, group, ep: int, backend: str) -> None:
    """Replace `module.forward` by the dispatch around its own forward (module docstring)."""
    own = type(module).forward
    experts = next(module.parameters()).shape[0]
    module.num_experts = experts // ep  # transformers' experts size their routing tables by it

    def forward(self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        local = experts // ep
        routing = moe_routing(top_k_index, experts)
        send = moe_permute(x, routing, backend)  # (N k, h) in expert order
        counts = routing.tokens_per_expert.view(ep, local)  # (ep, E_l) to each rank
        recv_counts = exchange(counts, group)  # (ep, E_l) from each source rank
        send_rows, recv_rows = counts.sum(1).tolist(), recv_counts.sum(1).tolist()
        received = all_to_all_uneven(send, send_rows, recv_rows, group)  # (M, h)
        ids = torch.arange(local, device=x.device).repeat(ep).repeat_interleave(recv_counts.reshape(-1))
        ones = torch.ones((received.shape[0], 1), dtype=top_k_weights.dtype, device=x.device)
        with _local_weights(self):
            y = own(self, received, ids.unsqueeze(1), ones)
        if received.requires_grad and not y.requires_grad:  # no rows here: keep backward's all-to-all
            y = y + received * 0
        back = all_to_all_uneven(y, recv_rows, send_rows, group)  # (N k, h) in send's order
        return moe_unpermute(back, top_k_weights, routing, backend)

    module.forward = types.MethodType(forward, module)
