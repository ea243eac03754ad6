"""Checkpoints through torch.distributed.checkpoint (DCP), in the model's own terms: every tensor is
saved under its FULL name with its FULL (global) shape, so a run saved under one plan resumes under
any other plan of the same model.

What is saved, per parameter `name` of the user's model:

    model.<name>              the parameter (under master weights, plan precision "bf16-master": its
                              fp32 master, `grad_sync.GradSync.param_masters`, so it loads in full precision)
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
sharded over dp by ZeRO 3 (FSDP2) are gathered over dp first (their tp-local piece); under ZeRO 1/2
the distributed optimizer's slices of each state are gathered whole over dp first
(`grad_sync.ShardedOptimizer.param_states`) and each rank loads its slice back (`scatter_states`).

The runtime for the user's own module saves under the same keys, its tensors as it holds them
(DTensors under tp / ep / FSDP2, each pipeline stage its own modules: `runtime.module_checkpoint`),
with the same files, manifest, checks and atomic saves below.

Beside DCP's files, `autoplan.json` (plain JSON, the manifest) records the format, the model's name
and fingerprint, the training step, the mesh, the optimizer's class, the parameter shapes, and the
size and SHA-256 of every other file (runtime.checkpoint_files). The optimizer's hyperparameters
(lr, betas, ...) are not saved: the resuming run's optimizer has its own.

Loading checks, before DCP reads anything: the model (another model's checkpoint is refused,
naming both fingerprints), the optimizer class, then every recorded file's size and SHA-256 (a
missing, truncated or changed file is refused by name); then it reads DCP's `.metadata` with a
restricted unpickler that can call nothing outside DCP's metadata types
(runtime.checkpoint_reader), so a crafted checkpoint runs no code, and only tensors in recorded
files are read. Checkpoints of format 1 (saved before checksums) still load, unverified, with a
warning; saving them again adds the checksums. Hashing is split over the ranks and the digests
gathered (runtime.rank_agreement): every rank must see the same directory, as DCP itself requires
(one node, or a filesystem shared by all ranks). Every refusal is a CheckpointError on every rank.

Atomic saves: rank 0 creates `<dir>.tmp-<token>` and marks it as autoplan's (`.autoplan-save`
naming the token); every rank writes into it; rank 0 hashes the files (with the others) and writes
the manifest, then moves a previous checkpoint at `<dir>` aside to `<dir>.old-<token>` (marked
first), renames the new one into place and deletes the old one. A crash at any point leaves either
the previous checkpoint or the new one complete (after a crash between the two renames,
`<dir>.old-<token>` is the previous one, and `load(<dir>)` finds it). A crashed save leaves a
marked `<dir>.tmp-*`, which the next successful save removes. Nothing autoplan did not write is
renamed or deleted: a save onto a non-empty directory without autoplan's manifest is refused, and
`<dir>.tmp-*` / `<dir>.old-*` directories without autoplan's marker are left alone.

Numbered checkpoints (`save_in_series`, for `--save-every`): `<parent>/step-NNNNNN`, the newest
`keep` kept; `load(<parent>)` takes the newest that verifies (warning about any newer one skipped).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Replicate as DReplicate
from torch.distributed.tensor import Shard as DShard

from autoplan.placement import Shard
from autoplan.runtime import checkpoint_files as files
from autoplan.runtime.checkpoint_files import FORMAT, KIND, MANIFEST, CheckpointError
from autoplan.runtime.checkpoint_reader import (DCP_METADATA, SafeReader, read_dcp_metadata,
                                                storage_files)
from autoplan.runtime.rank_agreement import first_error, gather_texts, rank_world, shared_token
from autoplan.runtime.zero import full_tensor

if TYPE_CHECKING:
    from autoplan.runtime.program import RankProgram

__all__ = ["CheckpointError", "load", "read_metadata", "resolve", "save", "save_in_series"]


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
    """The optimizer that holds the states (grad_sync.ShardedOptimizer wraps one)."""
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
    if hasattr(optimizer, "param_states"):  # grad_sync.ShardedOptimizer: its slices gathered whole
        return {names[pid]: states for pid, states in optimizer.param_states().items()}
    return {names[id(p)]: {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
            for p, state in _inner(optimizer).state.items()}


# ------------------------------------------------------------------ state dicts


def _state_dict(program: "RankProgram", optimizer: torch.optim.Optimizer | None,
                for_load: bool) -> tuple[dict[str, torch.Tensor], list]:
    """DCP's state dict and, for loading, the (destination, loaded tensor) copies to do after
    (none for the user's own module: DCP loads into its tensors, `runtime.module_checkpoint`)."""
    own = getattr(program, "checkpoint_tensors", None)  # the user's module: its tensors as it holds them
    if own is not None:
        return own({} if optimizer is None else _states(program, optimizer)), []
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

    masters = program.grad_sync.param_masters() if program.grad_sync is not None else {}
    for name, param in program.named_local_parameters():  # the fp32 masters under master weights
        add(f"model.{name}", name, masters.get(id(param), param))
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


def _raise_first(message: str | None, device: torch.device) -> None:
    """Raise the first error of any rank (in rank order) on every rank: all stop together, and
    none is left waiting for the others in a later collective."""
    found = first_error(message, device)
    if found:
        raise CheckpointError(found)


def _dcp_failure(exc: BaseException) -> str:
    """One line per rank of DCP's CheckpointException (its str carries whole tracebacks)."""
    failures = getattr(exc, "failures", {}) or {}
    return "; ".join(f"rank {rank}: {type(pair[0]).__name__}: {pair[0]}"
                     for rank, pair in sorted(failures.items())) or str(exc)


# ------------------------------------------------------------------ save


def _metadata(program: "RankProgram", step: int, optimizer: torch.optim.Optimizer | None,
              digests: dict[str, dict]) -> dict:
    plan = program.plan
    kind = None if optimizer is None else type(_inner(optimizer)).__name__
    return {"kind": KIND, "format": FORMAT,
            "model": {"name": plan.model.name, "fingerprint": plan.model.fingerprint},
            "step": step, "mesh": plan.mesh.to_json(), "optimizer": kind,
            "parameters": program.checkpoint_shapes() if hasattr(program, "checkpoint_shapes") else
            {n: list(layout.shape) for n, layout in sorted(program.all_layouts.items())},
            "files": digests}


def _model_error(program: "RankProgram", meta: dict, where: str, action: str) -> str | None:
    want, plan = meta.get("model", {}), program.plan
    if want.get("fingerprint") == plan.model.fingerprint:
        return None
    return (f"checkpoint {where!r} holds model {want.get('name')!r} with fingerprint "
            f"{want.get('fingerprint')}, but this program runs model {plan.model.name!r} with "
            f"fingerprint {plan.model.fingerprint}: {action}")


def _target_error(program: "RankProgram", path: Path) -> str | None:
    """Why `save` may not replace `path` (checkpoint_files.target_error, or another model's)."""
    error = files.target_error(path)
    if error is None and files.is_checkpoint(path):
        error = _model_error(program, files.read_manifest(path), str(path),
                             "refusing to overwrite it; save to another directory")
    return error


def _digests(tmp: Path, device: torch.device) -> dict[str, dict]:
    """{name: {bytes, sha256}} of every file DCP wrote: each rank hashes every world-th file and
    all gather the parts (`_commit` checks that the ranks saw the same files)."""
    rank, world = rank_world()
    names = files.list_files(tmp)
    mine = {name: files.digest(tmp / name) for name in names[rank::world]}
    merged = {}
    for part in gather_texts(json.dumps(mine), device):
        merged.update(json.loads(part))
    return merged


def _commit(path: Path, tmp: Path, token: str, manifest: dict) -> None:
    """Rank 0, once every rank has written and hashed: manifest, swap into place, leftovers."""
    if sorted(manifest["files"]) != files.list_files(tmp):
        raise CheckpointError(f"the ranks saw different files in {str(tmp)!r}: a checkpoint "
                              f"directory must be the same directory for every rank (one node, "
                              f"or a shared filesystem)")
    files.write_json(tmp / MANIFEST, manifest)
    files.swap_into_place(tmp, path, token)
    files.remove_leftovers(path.parent, lambda stem: stem == path.name)


def save(program: "RankProgram", directory: str | Path, optimizer: torch.optim.Optimizer | None,
         step: int = 0) -> Path:
    """Save model and optimizer state to `directory` atomically (module docstring); every rank
    calls it. Refuses to replace anything but an empty directory or a checkpoint of this model."""
    path, device, (rank, _) = Path(directory), program.device, rank_world()
    _raise_first(_target_error(program, path) if rank == 0 else None, device)
    state, _ = _state_dict(program, optimizer, for_load=False)
    token = shared_token(device)
    tmp, error = files.sibling(path, "tmp", token), None
    if rank == 0:
        try:
            files.begin(tmp, token)
        except OSError as exc:
            error = f"cannot create {str(tmp)!r} to save a checkpoint into: {exc}"
    _raise_first(error, device)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dcp.save(state, checkpoint_id=str(tmp))
    except CheckpointException as exc:  # a BaseException
        raise CheckpointError(f"writing checkpoint {str(path)!r} failed ({_dcp_failure(exc)}); "
                              f"a previous checkpoint there is unchanged") from None
    # dcp.save returns on every rank after rank 0 wrote .metadata (its last step broadcasts the
    # result of `finish`), so every rank lists the same finished files
    manifest = _metadata(program, step, optimizer, _digests(tmp, device))
    if rank == 0:
        try:
            _commit(path, tmp, token, manifest)
        except (OSError, CheckpointError) as exc:
            error = f"cannot finish checkpoint {str(path)!r}: {exc}"
    _raise_first(error, device)
    return path


def save_in_series(program: "RankProgram", parent: str | Path,
                   optimizer: torch.optim.Optimizer | None, step: int, keep: int = 0) -> Path:
    """Save into `parent`/step-NNNNNN (the step, 6 digits or more); with `keep` > 0, then delete
    all but `keep` numbered checkpoints there: this one and the others of the largest steps.
    `load(parent)` loads the newest that verifies."""
    parent, device, (rank, _) = Path(parent), program.device, rank_world()
    error = None
    if rank == 0 and files.is_checkpoint(parent):
        error = (f"{str(parent)!r} is itself a checkpoint; numbered checkpoints (--save-every) "
                 f"go into a directory of their own: choose another")
    _raise_first(error, device)
    path = save(program, parent / files.series_name(step), optimizer, step)
    if keep > 0:
        if rank == 0:
            try:
                files.prune_series(parent, keep, path)
            except OSError as exc:
                error = f"saved {str(path)!r}, but could not delete older checkpoints: {exc}"
        _raise_first(error, device)
    return path


# ------------------------------------------------------------------ load


def resolve(directory: str | Path) -> Path:
    """The checkpoint `load(directory)` tries first (checkpoint_files.candidates)."""
    return files.candidates(directory)[0]


def read_metadata(directory: str | Path) -> dict:
    """autoplan.json of the checkpoint `load(directory)` tries first."""
    return files.read_manifest(resolve(directory))


def _optimizer_error(meta: dict, optimizer: torch.optim.Optimizer | None, where: str) -> str | None:
    if optimizer is None or meta.get("optimizer") == type(_inner(optimizer)).__name__:
        return None
    return (f"checkpoint {where!r} holds optimizer states of {meta.get('optimizer')}, but the "
            f"optimizer to load into is a {type(_inner(optimizer)).__name__}: pass "
            f"optimizer=None to load the parameters only, or make the same optimizer")


def _verify_share(path: Path, meta: dict) -> str | None:
    """This rank's share (every world-th recorded file) of checking the files against the
    manifest; None for a format-1 checkpoint, which records no checksums."""
    recorded = meta.get("files")
    if recorded is None and meta.get("format") == 1:
        return None
    if not isinstance(recorded, dict) or DCP_METADATA not in recorded:
        return (f"checkpoint {str(path)!r}: its {MANIFEST} records no {DCP_METADATA} among its "
                f"files: it is damaged; resume from another checkpoint")
    rank, world = rank_world()
    for name in sorted(recorded)[rank::world]:
        error = files.verify_file(path, name, recorded[name])
        if error:
            return error
    return None


def _choose(program: "RankProgram", directory: str | Path,
            optimizer: torch.optim.Optimizer | None) -> tuple[Path, dict]:
    """The checkpoint to load and its manifest: the first candidate whose files verify. Another
    model's checkpoint or another optimizer's states are refused outright."""
    found, skipped = files.candidates(directory), []
    for path in found:
        meta = files.read_manifest(path)
        for error in (_model_error(program, meta, str(directory),
                                   "load a checkpoint of this model"),
                      _optimizer_error(meta, optimizer, str(directory))):
            if error:
                raise CheckpointError(error)
        try:
            _raise_first(_verify_share(path, meta), program.device)
        except CheckpointError as exc:
            if len(found) == 1:
                raise
            skipped.append(str(exc))
            continue
        _warn(path, meta, skipped)
        return path, meta
    raise CheckpointError(f"no complete checkpoint in {str(directory)!r}: " + "; ".join(skipped))


def _warn(path: Path, meta: dict, skipped: list[str]) -> None:
    if rank_world()[0] != 0:
        return
    if skipped:
        warnings.warn(f"loading {str(path)!r}: newer checkpoints do not verify and were skipped: "
                      + "; ".join(skipped), stacklevel=3)
    if meta.get("files") is None:
        warnings.warn(f"checkpoint {str(path)!r} was saved without checksums (format 1): its "
                      f"files are not verified; save it again to add them", stacklevel=3)


def _dcp_metadata(path: Path, meta: dict, device: torch.device):
    """DCP's metadata of `path`, through the restricted unpickler; its tensors must lie in files
    inside the checkpoint that the manifest recorded (and `_verify_share` checked)."""
    metadata, error = None, None
    try:
        metadata = read_dcp_metadata(path)
        recorded = meta.get("files")
        bad = sorted(n for n in storage_files(metadata)
                     if not files.inside(n) or (recorded is not None and n not in recorded))
        if bad:
            error = (f"checkpoint {str(path)!r}: DCP's metadata points at files that are not "
                     f"recorded in its {MANIFEST} ({bad[:3]}); refusing to read them")
    except CheckpointError as exc:
        error = str(exc)
    _raise_first(error, device)
    return metadata


def load(program: "RankProgram", directory: str | Path,
         optimizer: torch.optim.Optimizer | None) -> dict:
    """Load model (and optimizer) state saved under any plan of this model; returns the
    checkpoint's manifest. `directory`: a checkpoint, or a folder of numbered ones (the newest
    that verifies is loaded). Every rank calls it; every refusal is a CheckpointError."""
    path, meta = _choose(program, directory, optimizer)
    metadata = _dcp_metadata(path, meta, program.device)
    if optimizer is not None:
        init_optimizer_state(optimizer, [p for _, p in program.named_local_parameters()])
    state, copies = _state_dict(program, optimizer, for_load=True)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dcp.load(state, storage_reader=SafeReader(path, metadata))
    except CheckpointException as exc:  # a BaseException
        raise CheckpointError(f"reading checkpoint {str(path)!r} failed: "
                              f"{_dcp_failure(exc)}") from None
    _copy_back(copies)
    if hasattr(optimizer, "scatter_states"):  # ShardedOptimizer: its slices of what was loaded
        optimizer.scatter_states()
    if program.grad_sync is not None and program.grad_sync.main is not None:
        program.grad_sync.scatter_masters()  # master weights: the loaded fp32 masters, then the parameters
    return meta
