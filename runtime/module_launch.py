"""Checks and assembly of a `ModuleProgram` (`runtime.module_program`): the user's own module under
a Plan. The order matters:

    1. checks without communication: the recompute policy against the model's blocks
       (`runtime.module_recompute`), the plan against the model (fingerprint of a transformers
       config, parameter names), a forward that pipeline stages can cut (`runtime.module_stages`),
       dropout under tp, tied weights under tp (held alike by every holder), experts under ep,
       attention under cp (`runtime.module_context`), where the weights come from
    2. the process group and the ("dp", "ep", "cp", "tp") DeviceMesh (with "pp" first with a pipeline)
    3. weights: a model with weights is broadcast from rank 0 (so every rank distributes the
       same tensors); a model on meta is loaded after step 4. With a pipeline, the model then
       keeps only this rank's stages' modules (`runtime.module_pipeline`), so that step 4 distributes
       its own stages' experts and tp styles
    4. tp styles (`runtime.module_styles`), parameters becoming DTensors on the tp mesh; expert
       weights this rank's experts, DTensors on the ("ep", "tp") mesh (`runtime.module_experts`)
    5. a meta model's parameters read from the checkpoint, each rank its slices (`runtime.weights`)
    6. cp: the model's attention goes through this program's Ulysses function (`runtime.module_context`)
    7. recompute: each block the policy names runs as one checkpointed region (`runtime.module_recompute`;
       with a pipeline, those of the blocks this rank holds, by the model's layer indices)
    8. ZeRO 3: FSDP2 over dp x cp (`runtime.module_program`), outside the recomputed regions; ZeRO 1/2
       are `runtime.grad_sync`'s distributed optimizer
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from autoplan.cluster import ClusterSpec
from autoplan.errors import AutoplanError, ConfigError, PlanError
from autoplan.plan import Plan
from autoplan.recompute_policy import recompute_policy
from autoplan.runtime.launch import (_check_backend, check_cluster, _device, _device_for, _init_process_group, _timeout,
                                     _launched_world_size, check_memory_fits)
from autoplan.runtime.module_context import check_context_model, install
from autoplan.runtime.module_experts import distribute_experts, expert_weight_names, experts_modules
from autoplan.runtime.module_pipeline import PipelinedModuleProgram, held_module_plan, pipeline_mesh
from autoplan.runtime.module_plan import ModulePlan, module_plan
from autoplan.runtime.module_program import ModuleProgram, block_lists, plan_mesh
from autoplan.runtime.module_recompute import apply_module_recompute, check_recompute_blocks
from autoplan.runtime.module_stages import cut_stages
from autoplan.runtime.module_styles import apply_module_plan, tied_groups, weight_layout
from autoplan.runtime.pipeline import rank_stages
from autoplan.runtime.weights import load_checkpoint

def check_module_plan(plan: Plan, model: nn.Module, cluster: ClusterSpec | str | None = None) -> ModulePlan:
    """Every check that needs no communication (module docstring, step 1); the module plan."""
    check_cluster(plan, cluster)
    _check_experts(plan, model)
    if plan.mesh.cp > 1:
        check_context_model(plan, model)
    check_recompute_blocks(plan.recompute, model, plan.model.num_layers)
    _check_model(plan, model)
    mplan = module_plan(plan, model)
    if plan.mesh.pp > 1:
        cut_stages(model, plan)  # PlanError where the model's forward cannot be cut into the stages
    if plan.mesh.tp > 1:
        _check_dropout(model)
        _check_tied(model, mplan)
    return mplan


def _check_experts(plan: Plan, model: nn.Module) -> None:
    """ep: on data-parallel ranks (ep_as "dp"), ZeRO 0, over experts modules (`runtime.module_experts`)."""
    if plan.mesh.ep == 1:
        return
    if plan.mesh.ep_as != "dp":
        raise PlanError(f"ep={plan.mesh.ep} over context-parallel ranks (ep_as={plan.mesh.ep_as!r}): the runtime "
                        f"for your own module runs ep on data-parallel ranks; plan ep_as='dp'")
    if plan.zero_stage > 0 and plan.mesh.dp * plan.mesh.cp > 1:
        raise PlanError(f"ep={plan.mesh.ep} with ZeRO {plan.zero_stage} over dp x cp = {plan.mesh.dp} x "
                        f"{plan.mesh.cp}: the runtime for your own module shards no expert weight with FSDP2 "
                        f"yet; plan zero_stage=0 with ep")
    if plan.mesh.tp > 1 and plan.mesh.etp not in (None, plan.mesh.tp):
        raise PlanError(f"etp={plan.mesh.etp} < tp={plan.mesh.tp}: the runtime for your own module does not fold "
                        f"tp ranks into expert parallelism; plan etp = tp")
    if not expert_weight_names(plan):
        raise PlanError(f"the plan has ep={plan.mesh.ep} but splits no expert weight over ep: re-plan this model")
    experts_modules(plan, model)


def _check_model(plan: Plan, model: nn.Module) -> None:
    """The plan was made for this model: same config fingerprint (transformers), and every
    parameter the plan places is one of the model's."""
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "to_dict"):
        from autoplan.capture.hf import hf_model_config

        found = hf_model_config(config).fingerprint()
        if found != plan.model.fingerprint:
            raise PlanError(f"model fingerprint {found} != plan model fingerprint "
                            f"{plan.model.fingerprint} ({plan.model.name}): this plan was made "
                            f"for another model; re-plan this one")
    names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    for p in plan.params:
        if p.name not in names:
            raise PlanError(f"the plan places parameter {p.name!r}, which the model does not have "
                            f"(it has {len(names)} parameters, e.g. {sorted(names)[:3]}); the "
                            f"plan was made for another model: re-plan this one")


def _check_dropout(model: nn.Module) -> None:
    """Dropout under tp: the ranks of a replicated region would draw different masks."""
    found = [f"{p}: p={m.p}" for p, m in model.named_modules() if isinstance(m, nn.Dropout) and m.p > 0]
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "to_dict"):
        found += [f"config.{k}={v}" for k, v in config.to_dict().items()
                  if ("dropout" in k or "pdrop" in k) and isinstance(v, float) and v > 0]
    if found:
        raise PlanError(f"dropout under tensor parallelism ({', '.join(found[:4])}): the tp ranks "
                        f"would draw different masks where they compute the same values, and this "
                        f"runtime does not seed dropout per region yet; set dropout to 0 (e.g. "
                        f"config.attention_dropout = 0.0) or plan tp=1")


def _check_tied(model: nn.Module, mplan: ModulePlan) -> None:
    """Tied weights under tp: every module holding the one tensor must hold it alike (an embedding
    vocab-parallel and a head column-parallel over the vocabulary both hold S(0); or all replicated),
    so that it stays one tensor (`module_styles.apply_module_plan`)."""
    for group in tied_groups(model):
        paths = {name: name.rpartition(".")[0] for name in group}
        layouts = {n: weight_layout(mplan.style(p), model.get_submodule(p)) for n, p in paths.items()}
        if len(set(layouts.values())) > 1:
            found = ", ".join(f"{n}: {lay}" for n, lay in layouts.items())
            raise PlanError(f"parameters {' and '.join(map(repr, group))} are tied (one tensor), but the "
                            f"plan holds them differently on tp ({found}); tied weights run when every "
                            f"holder keeps the same layout: the embedding vocab-parallel and the head "
                            f"column-parallel (both S(0)), or both replicated. Plan them so, untie them "
                            f"(transformers: tie_word_embeddings=False), or plan tp=1")


def _weights_source(model: nn.Module, checkpoint: str | Path | None) -> str:
    """"meta" (load `checkpoint`) or "module" (the module's own tensors)."""
    on_meta = [t.is_meta for t in model.parameters()]
    if any(on_meta) and not all(on_meta):
        raise ConfigError("some of the model's parameters are on meta and some are not: build it "
                          "wholly on meta (to load a checkpoint) or wholly with weights")
    if all(on_meta) and on_meta:
        if checkpoint is None:
            raise ConfigError("the model is on the meta device and no checkpoint= was given: pass "
                              "checkpoint=DIR (a save_pretrained directory), or build the model "
                              "with weights")
        return "meta"
    if checkpoint is not None:
        raise ConfigError("checkpoint= loads a model built on meta, but this model has weights: "
                          "build it on meta (with torch.device('meta')) to load the checkpoint")
    return "module"


@torch.no_grad()
def _broadcast_weights(model: nn.Module, device: torch.device) -> None:
    """Every rank takes rank 0's parameters and buffers (the weights a user loaded on each)."""
    model.to(device)
    for t in list(model.parameters()) + list(model.buffers()):
        dist.broadcast(t.data, src=0)


def agree_on_plan(make_plan: Callable[[], Plan], backend: str | None = None,
                  timeout_s: float | None = None) -> Plan:
    """The plan `make_plan` returns on rank 0, on every rank (a search may differ between ranks: a
    time limit, a tie): rank 0 plans, then broadcasts the plan's JSON or its error."""
    _init_process_group(_check_backend(backend), _timeout(timeout_s))
    box: list = [None, None]
    if dist.get_rank() == 0:
        try:
            box[0] = make_plan().to_json()
        except AutoplanError as exc:
            box[1] = f"{type(exc).__name__}: {exc}"
    dist.broadcast_object_list(box, src=0)
    if box[1] is not None:
        raise PlanError(f"planning on rank 0 failed: {box[1]}")
    return Plan.from_json(box[0])


def parallelize_module_program(model: nn.Module, plan: Plan, *, cluster: ClusterSpec | str | None = None,
                               checkpoint: str | Path | None = None, backend: str | None = None,
                               check_memory: bool = True, timeout_s: float | None = None,
                               check_finite: bool = True) -> ModuleProgram:
    """This rank's program for `plan` over the user's `model` (module docstring); `check_finite`:
    train_step stops on a non-finite loss or gradient norm (`runtime.module_program`)."""
    mplan = check_module_plan(plan, model, cluster)
    source = _weights_source(model, checkpoint)
    world = _launched_world_size(None)
    if world != plan.mesh.world_size:
        raise PlanError(f"launched world size {world} != plan mesh world size {plan.mesh.world_size} "
                        f"({plan.mesh}); launch {plan.mesh.world_size} processes or plan for {world}")
    backend = _check_backend(backend)
    if check_memory:
        check_memory_fits(plan, _device_for(backend))
    _init_process_group(backend, _timeout(timeout_s))  # None: launch.DEFAULT_TIMEOUT_S
    device = _device()
    pipelined = plan.mesh.pp > 1
    mesh = pipeline_mesh(plan, device.type) if pipelined else plan_mesh(plan, device.type)
    if source == "module":
        _broadcast_weights(model, device)
    if pipelined:  # this rank keeps only its stages' modules (runtime.module_pipeline)
        cut = cut_stages(model, plan)
        cut.prune(rank_stages(plan, mesh.get_local_rank("pp")))
    model.train()
    apply_module_plan(model, held_module_plan(mplan, model) if pipelined else mplan, mesh["tp"])
    distribute_experts(plan, model, mesh)
    if source == "meta":
        load_checkpoint(model, checkpoint, device)
    program = (PipelinedModuleProgram(model, plan, mesh, mplan, device, check_finite, cut) if pipelined
               else ModuleProgram(model, plan, mesh, mplan, device, check_finite))
    if program.context is not None:
        install(model, program.context)
    program.recomputed_layers = apply_module_recompute(  # checked in step 1
        model, recompute_policy(plan.recompute), cut.held_blocks() if pipelined else None)
    if program.fsdp:
        roots = program.stage_modules if pipelined else [model]
        _shard_over_dp(model, roots, program.replica_mesh, plan.zero_stage, plan.precision)
    return program


def _shard_over_dp(model: nn.Module, roots: list[nn.Module], dp_mesh, zero_stage: int, precision: str) -> None:
    """FSDP2 over `dp_mesh` (dp x cp) on every block and the roots: the model, or its pipeline stages
    (ZeRO 3; module_program docstring), with the plan precision's policy (`zero.fsdp_precision`)."""
    from torch.distributed.fsdp import fully_shard

    from autoplan.runtime.zero import fsdp_precision

    reshard, policy = zero_stage == 3, fsdp_precision(precision)
    for block in block_lists(model):
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=policy)
    for root in roots:
        fully_shard(root, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=policy)
