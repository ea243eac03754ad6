"""What `runtime.checkpoint` saves and loads for the runtime for the user's own module
(`ModuleProgram`, `PipelinedModuleProgram`): the same keys, files, manifest and checks as the zoo's
checkpoints, with the tensors handed to DCP as the module holds them.

    model.<name>          the parameter under the model's own name: as it is, a DTensor under tp,
                          ep or FSDP2 (ZeRO 3), whose placements DCP reads to save each distinct
                          piece once and to load whatever slice the resuming layout asks for; a
                          plain tensor where a rank holds it whole (DCP keeps one copy)
    optim.<name>.<key>    each optimizer state of it: AdamW's own states are DTensors like their
                          parameter; `grad_sync.ShardedOptimizer`'s (ZeRO 1/2) are gathered whole
                          over dp in the parameter's local shape (`param_states`) and wrapped here
                          as DTensors of the parameter's mesh and placements; a 0-d state (AdamW's
                          step) is saved whole

Under a pipeline each rank holds only its stages' modules (`StageCut.prune`), so each stage saves
and loads its own parameters. DCP loads in place into these tensors (the local pieces of DTensors
included), so nothing is copied back afterwards; `runtime.checkpoint.load` then hands a
ShardedOptimizer its slices (`scatter_states`). Keys are the same for every plan of the model, so a
checkpoint saved under one plan resumes under any other. `runtime.checkpoint` reaches these
through the program (`ModuleProgram.checkpoint_tensors` / `checkpoint_shapes`).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import torch
from torch.distributed.tensor import DTensor

from autoplan.runtime.rank_agreement import gather_texts

if TYPE_CHECKING:
    from autoplan.runtime.module_program import ModuleProgram


def laid_out_like(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """`local` (a state in the parameter's local shape) as a tensor laid out like `param`."""
    if not isinstance(param, DTensor) or isinstance(local, DTensor) or local.dim() == 0:
        return local.detach()
    return DTensor.from_local(local.detach(), param.device_mesh, param.placements, run_check=False,
                              shape=param.shape, stride=param.stride())


def module_state_dict(program: "ModuleProgram", states: dict[str, dict[str, torch.Tensor]]
                      ) -> dict[str, torch.Tensor]:
    """DCP's state dict of this rank (module docstring); `states`: name -> the optimizer's state
    tensors of that parameter (`runtime.checkpoint._states`)."""
    params = dict(program.named_local_parameters())
    masters = program.grad_sync.param_masters() if program.grad_sync is not None else {}
    found = {f"model.{name}": laid_out_like(p, masters[id(p)]) if id(p) in masters else p.detach()
             for name, p in params.items()}
    for name, tensors in states.items():
        for key, value in tensors.items():
            found[f"optim.{name}.{key}"] = laid_out_like(params[name], value)
    return found


def parameter_shapes(program: "ModuleProgram") -> dict[str, list[int]]:
    """Every parameter's full shape under its name, over all pipeline stages (a collective)."""
    mine = {name: list(p.shape) for name, p in program.named_local_parameters()}
    merged: dict[str, list[int]] = {}
    for part in gather_texts(json.dumps(mine), program.device):
        merged.update(json.loads(part))
    return dict(sorted(merged.items()))
