"""Checks and assembly of a `ModuleProgram` (`runtime.module_program`): the user's own module under
a Plan. The order matters:

    1. checks without communication: the mesh axes this runtime runs (dp, tp), the recompute
       policy, the plan against the model (fingerprint of a transformers config, parameter
       names), dropout under tp, tied weights under tp, where the weights come from
    2. the process group and the ("dp", "tp") DeviceMesh
    3. weights: a model with weights is broadcast from rank 0 (so every rank distributes the
       same tensors); a model on meta is loaded after step 4
    4. tp styles (`runtime.module_styles`), parameters becoming DTensors on the tp mesh
    5. a meta model's parameters read from the checkpoint, each rank its slices (`runtime.weights`)
    6. ZeRO 3: FSDP2 over dp (`runtime.module_program`; ZeRO 1/2 are `runtime.grad_sync`'s)
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
from autoplan.runtime.launch import (_check_backend, check_cluster, _device, _device_for, _init_process_group, _timeout,
                                     _launched_world_size, check_memory_fits)
from autoplan.runtime.module_plan import ModulePlan, module_plan
from autoplan.runtime.module_program import ModuleProgram, block_lists, plan_mesh
from autoplan.runtime.module_styles import apply_module_plan
from autoplan.runtime.weights import load_checkpoint

RUNS_AXES = ("dp", "tp")


def check_module_plan(plan: Plan, model: nn.Module, cluster: ClusterSpec | str | None = None) -> ModulePlan:
    """Every check that needs no communication (module docstring, step 1); the module plan."""
    check_cluster(plan, cluster)
    other = {a: d for a, d in plan.mesh.degrees().items() if a not in RUNS_AXES and d > 1}
    if other:
        raise PlanError(f"the plan uses {other}; the runtime for your own module runs dp and tp "
                        f"(with ZeRO and sequence parallelism) so far: plan with pipeline, context "
                        f"and expert parallelism off (SearchOptions(pipeline=False, "
                        f"context_parallel=False, expert_parallel=False))")
    if plan.recompute != "none":
        raise PlanError(f"recompute {plan.recompute!r}: the runtime for your own module does not "
                        f"recompute activations yet; plan recompute 'none' "
                        f"(SearchOptions(recompute=('none',)))")
    _check_model(plan, model)
    if plan.mesh.tp > 1:
        _check_dropout(model)
        _check_tied(model)
    return module_plan(plan, model)


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


def _check_tied(model: nn.Module) -> None:
    seen: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            raise PlanError(f"parameters {seen[id(p)]!r} and {name!r} are tied (one tensor); the tp "
                            f"styles would split them apart, which this runtime does not handle yet: "
                            f"untie them (transformers: tie_word_embeddings=False) or plan tp=1")
        seen[id(p)] = name


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
    mesh = plan_mesh(plan, device.type)
    if source == "module":
        _broadcast_weights(model, device)
    model.train()
    apply_module_plan(model, mplan, mesh["tp"])
    if source == "meta":
        load_checkpoint(model, checkpoint, device)
    program = ModuleProgram(model, plan, mesh, mplan, device, check_finite)
    if program.fsdp:
        _shard_over_dp(model, mesh["dp"], plan.zero_stage)
    return program


def _shard_over_dp(model: nn.Module, dp_mesh, zero_stage: int) -> None:
    """FSDP2 on every block and the root (ZeRO 3; module_program docstring)."""
    from torch.distributed.fsdp import fully_shard

    reshard = zero_stage == 3
    for block in block_lists(model):
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard)
