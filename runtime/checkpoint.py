"""Checkpoints through torch.distributed.checkpoint (DCP), in the model's own terms: every tensor is
saved under its FULL name with its FULL (global) shape, so a run saved under one plan resumes under
any other plan of the same model.

What is saved, per parameter `name` of the user's model:

    model.<name>              the parameter
    optim.<name>.<key>        each optimizer state tensor of the parameter's shape (AdamW:
                              exp_avg, exp_avg_sq); a 0-d state (AdamW's step) is saved whole

Each rank hands DCP its pieces as DTensors on a DeviceMesh of the ranks of its pipeline stage (axes
dp, ep, cp, tp in mesh order; built without process groups, DCP only needs coordinates): Shard(d) on
tp for tensor-parallel shards, Shard(0) on ep for expert weights, Replicate elsewhere. Under
etp = 1 < tp an expert weight is Shard(0) on both ep and tp: DTensor splits dim 0 over them in mesh
order, which is the ascending rank order of the expert group, the order its experts are spread in.
Under 1 < etp < tp its DeviceMesh has tp as two dims, tp_outer (t // etp) then tp_inner (t % etp):
Shard(0) on ep and tp_outer (the expert group, in the same order), Shard(FFN dim) on tp_inner. DCP writes
each distinct piece once and, on load, reads whatever slice the new layout asks for. Parameters
sharded over dp by ZeRO 2/3 (FSDP2) are gathered over dp first (their tp-local piece); under ZeRO 1
each rank saves and loads the states of the parameters whose optimizer states it owns.

Beside DCP's files, `autoplan.json` (plain JSON) records the format, the model's name and
fingerprint, the training step, the mesh, the optimizer's class and the parameter shapes. The
optimizer's hyperparameters (lr, betas, ...) are not saved: the resuming run's optimizer has its
own. Loading refuses a checkpoint of another model, naming both fingerprints, before reading
anything else, and optimizer states of another optimizer class.

Atomic saves: every rank writes into `<dir>.tmp-<token>`; once all have finished, rank 0 writes
autoplan.json there, then moves a previous `<dir>` aside to `<dir>.old-<token>`, renames the new one
into place and deletes the old one. A crash at any point leaves either the previous checkpoint or the
new one complete (after a crash between the two renames, `<dir>.old-<token>` is the previous one,
and `load_checkpoint(<dir>)` finds it). A crashed save leaves only a `<dir>.tmp-*` directory, which
the next successful save removes.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Replicate as DReplicate
from torch.distributed.tensor import Shard as DShard

from autoplan.errors import AutoplanError
from autoplan.placement import Shard
from autoplan.runtime.zero import full_tensor

if TYPE_CHECKING:
    from autoplan.runtime.program import RankProgram

FORMAT = 1
METADATA = "autoplan.json"


class CheckpointError(AutoplanError):
    """A checkpoint that is missing, incomplete, or of another model."""


# ------------------------------------------------------------------ layout


def checkpoint_mesh(program: "RankProgram", split_tp: bool = False) -> DeviceMesh:
    """The ranks of this rank's pipeline stage as a DeviceMesh over the other axes (no groups);
    `split_tp`: with the tp axis as its two halves ("tp_outer", "tp_inner", `MeshShape.coord`),
    for expert weights under 1 < etp < tp, split over both (DTensor splits a mesh dim one way)."""
    mesh = program.plan.mesh
    axes = tuple(a for a in mesh.order if a != "pp")
    if split_tp:
        at = axes.index("tp")
        axes = axes[:at] + ("tp_outer", "tp_inner") + axes[at + 1:]
    base = mesh.coord(program.mesh_rank, "pp") * mesh.stride("pp")
    ranks = [base]
    for axis in axes:  # row-major over `axes`: the last one varies fastest
        ranks = [r + c * mesh.stride(axis) for r in ranks for c in range(mesh.degree(axis))]
    shape = [mesh.degree(a) for a in axes]
    ranks = [program.global_rank_of(r) for r in ranks]
    return DeviceMesh(program.device.type, torch.tensor(ranks).view(shape), mesh_dim_names=axes,
                      _init_backend=False)


def _placements(program: "RankProgram", name: str, mesh: DeviceMesh) -> list:
    layout = program.layouts[name]
    found = []
    for axis in mesh.mesh_dim_names:
        if axis in ("tp", "tp_outer") and layout.folded:  # experts spread over ep x tp (/ etp)
            found.append(DShard(0))
        elif axis == "tp_inner" and layout.ffn_split is not None:  # their FFN over etp
            found.append(DShard(layout.ffn_split.dim))
        elif axis == "tp" and isinstance(layout.placement, Shard):
            found.append(DShard(layout.placement.dim % len(layout.shape)))
        elif axis == "ep" and layout.expert:
            found.append(DShard(0))
        else:
            found.append(DReplicate())
    return found


def _as_global(local: torch.Tensor, mesh: DeviceMesh, placements: list,
               shape: tuple[int, ...]) -> DTensor:
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size(shape),
                              stride=torch.empty(shape, device="meta").stride())


# ------------------------------------------------------------------ optimizer states


def _inner(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer that holds the states (ZeroRedundancyOptimizer wraps one)."""
    return getattr(optimizer, "optim", optimizer)


def init_optimizer_state(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> None:
    """Create the optimizer's states (if it has none) by one step with zero grads and lr 0, which
    leaves the parameters unchanged (as `torch.distributed.checkpoint.state_dict` does)."""
    if _inner(optimizer).state:
        return
    for p in params:
        p.grad = torch.zeros_like(p)
    lrs = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)


def _states(program: "RankProgram", optimizer: torch.optim.Optimizer
            ) -> dict[str, dict[str, torch.Tensor]]:
    """name -> this rank's optimizer state tensors of that parameter (only the owned ones under
    ZeRO 1)."""
    names = {id(p): n for n, p in program.named_local_parameters()}
    return {names[id(p)]: {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
            for p, state in _inner(optimizer).state.items()}


# ------------------------------------------------------------------ state dicts


def _state_dict(program: "RankProgram", optimizer: torch.optim.Optimizer | None,
                for_load: bool) -> tuple[dict[str, torch.Tensor], list]:
    """DCP's state dict and, for loading, the (destination, loaded tensor) copies to do after."""
    plain = checkpoint_mesh(program)
    etp, tp = program.plan.mesh.etp, program.plan.mesh.tp
    split = checkpoint_mesh(program, split_tp=True) if 1 < etp < tp else None  # expert weights' mesh
    state, copies = {}, []

    def add(key: str, name: str, value: torch.Tensor) -> None:
        layout = program.layouts[name]
        mesh = split if layout.ffn_split is not None else plain
        if value.dim() == 0:  # a step counter: the same on every rank
            state[key] = value.detach().clone() if for_load else value.detach()
            if for_load:
                copies.append((value, state[key]))
            return
        local = full_tensor(value.detach())
        if for_load:
            local = torch.empty_like(local)
            copies.append((value, local))
        state[key] = _as_global(local, mesh, _placements(program, name, mesh), layout.shape)

    for name, param in program.named_local_parameters():
        add(f"model.{name}", name, param)
    if optimizer is not None:
        for name, tensors in _states(program, optimizer).items():
            for key, value in tensors.items():
                add(f"optim.{name}.{key}", name, value)
    return state, copies


@torch.no_grad()
def _copy_back(copies: list) -> None:
    """Loaded tensors into parameters and states (a dp-sharded DTensor takes its own rows)."""
    for dest, loaded in copies:
        if isinstance(dest, DTensor):
            mesh = dest.device_mesh
            rank = mesh.get_local_rank()
            piece = loaded.chunk(mesh.size(), dim=0)[rank]
            dest.to_local().copy_(piece)
        else:
            dest.copy_(loaded)


# ------------------------------------------------------------------ save / load


def _metadata(program: "RankProgram", step: int,
              optimizer: torch.optim.Optimizer | None) -> dict:
    plan = program.plan
    kind = None if optimizer is None else type(_inner(optimizer)).__name__
    return {"format": FORMAT, "model": {"name": plan.model.name,
                                        "fingerprint": plan.model.fingerprint},
            "step": step, "mesh": plan.mesh.to_json(), "optimizer": kind,
            "parameters": {n: list(layout.shape) for n, layout in sorted(program.all_layouts.items())}}


def read_metadata(directory: str | Path) -> dict:
    """autoplan.json of a checkpoint (the one `load_checkpoint` would read)."""
    path = resolve(directory)
    try:
        return json.loads((path / METADATA).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{str(path)!r} is not a complete autoplan checkpoint: cannot read "
                              f"{METADATA} ({exc})") from None


def resolve(directory: str | Path) -> Path:
    """`directory`, or the previous checkpoint an interrupted save left at `<dir>.old-*`."""
    path = Path(directory)
    if (path / METADATA).is_file():
        return path
    old = sorted(path.parent.glob(path.name + ".old-*"), key=os.path.getmtime)
    if not path.exists() and old:
        return old[-1]
    if not path.exists():
        raise CheckpointError(f"no checkpoint at {str(path)!r}: the directory does not exist")
    return path


def _check_model(program: "RankProgram", meta: dict, where: str, action: str) -> None:
    want, plan = meta.get("model", {}), program.plan
    if want.get("fingerprint") != plan.model.fingerprint:
        raise CheckpointError(
            f"checkpoint {where!r} holds model {want.get('name')!r} with fingerprint "
            f"{want.get('fingerprint')}, but this program runs model {plan.model.name!r} with "
            f"fingerprint {plan.model.fingerprint}: {action}")


def _token() -> str:
    """One random hex token, the same on every rank."""
    value = torch.tensor([secrets.randbits(62) if dist.get_rank() == 0 else 0], dtype=torch.int64)
    dist.broadcast(value, src=0)
    return f"{int(value):016x}"


def save(program: "RankProgram", directory: str | Path, optimizer: torch.optim.Optimizer | None,
         step: int = 0) -> Path:
    """Save model and optimizer state to `directory` atomically (module docstring); every rank
    calls it. Refuses to replace a checkpoint of another model."""
    path = Path(directory)
    if (path / METADATA).is_file():
        _check_model(program, read_metadata(path), str(path),
                     "refusing to overwrite it; save to another directory")
    state, _ = _state_dict(program, optimizer, for_load=False)
    token = _token()
    tmp = path.parent / f"{path.name}.tmp-{token}"
    import torch.distributed.checkpoint as dcp

    dcp.save(state, checkpoint_id=str(tmp))
    dist.barrier()
    if dist.get_rank() == 0:
        _write_json(tmp / METADATA, _metadata(program, step, optimizer))
        old = path.parent / f"{path.name}.old-{token}"
        if path.exists():
            os.rename(path, old)
        os.rename(tmp, path)
        _fsync_dir(path.parent)
        shutil.rmtree(old, ignore_errors=True)
        for stale in path.parent.glob(f"{path.name}.tmp-*"):  # left by saves that crashed
            shutil.rmtree(stale, ignore_errors=True)
    dist.barrier()
    return path


def load(program: "RankProgram", directory: str | Path,
         optimizer: torch.optim.Optimizer | None) -> dict:
    """Load model (and optimizer) state saved under any plan of this model; returns the
    checkpoint's autoplan.json. Every rank calls it."""
    path = resolve(directory)
    meta = read_metadata(path)
    _check_model(program, meta, str(directory), "load a checkpoint of this model")
    if optimizer is not None and meta.get("optimizer") != type(_inner(optimizer)).__name__:
        raise CheckpointError(f"checkpoint {str(directory)!r} holds optimizer states of "
                              f"{meta.get('optimizer')}, but the optimizer to load into is a "
                              f"{type(_inner(optimizer)).__name__}: pass optimizer=None to load "
                              f"the parameters only, or make the same optimizer")
    if optimizer is not None:
        init_optimizer_state(optimizer, [p for _, p in program.named_local_parameters()])
    state, copies = _state_dict(program, optimizer, for_load=True)
    import torch.distributed.checkpoint as dcp

    dcp.load(state, checkpoint_id=str(path))
    _copy_back(copies)
    return meta


def _write_json(path: Path, data: dict) -> None:
    with open(path, "w") as handle:
        handle.write(json.dumps(data, indent=1) + "\n")
        handle.flush()
        os.fsync(handle.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
