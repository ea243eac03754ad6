"""Weights of the user's module on each rank: read this rank's slices of a Hugging Face checkpoint
directory into a model built on the meta device.

A checkpoint directory is what `save_pretrained` writes: `config.json` and `*.safetensors` files,
with `model.safetensors.index.json` mapping tensor names to files when there are several. Tensors
are named as the model's `state_dict` names them; a tied weight (an lm_head sharing the embedding)
is stored once, under any of its names.

After the tp styles are applied (`runtime.module_styles`), each parameter is a DTensor on the tp
mesh (or a plain tensor), still on meta. For each, this rank's slice is

    Replicate          the whole tensor
    Shard(d)           rows [i c, min((i + 1) c, n)) of dim d, n = its size, c = ceil(n / tp),
                       i = this rank's tp coordinate (torch.chunk's split, as DTensor's)

read with safetensors' `get_slice` (only those bytes), cast to the parameter's dtype, and wrapped
as a DTensor of the same placements. transformers' fused MoE experts, which checkpoints store per
expert, are read from those tensors, only this rank's experts (`runtime.expert_checkpoint`). Persistent buffers are read whole. Non-persistent buffers
(rotary tables) are not in checkpoints: a transformers model recomputes them with its own
`_init_weights`; any other module on meta with such a buffer is refused.
"""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from autoplan.errors import ConfigError
from autoplan.runtime.checkpoint_names import checkpoint_renamer, model_names
from autoplan.runtime.expert_checkpoint import read_per_expert

INDEX = "model.safetensors.index.json"


class CheckpointFiles(contextlib.AbstractContextManager):
    """The tensors of a safetensors checkpoint directory, opened lazily, by the model's names of them:
    `where` maps each to its file; `rename` (`runtime.checkpoint_names`) gives a stored key's model name."""

    def __init__(self, directory: str | Path, rename=None) -> None:
        self.directory = Path(directory)
        stored = self._index()
        self._stored = model_names(list(stored), rename)
        self.where = {name: stored[key] for name, key in self._stored.items()}
        self._stack = contextlib.ExitStack()
        self._open: dict[str, object] = {}

    def _index(self) -> dict[str, str]:
        """Tensor name -> file name, from the index file or every *.safetensors file's keys."""
        from safetensors import safe_open

        if not self.directory.is_dir():
            raise ConfigError(f"checkpoint {str(self.directory)!r} is not a directory; give the "
                              f"directory `save_pretrained` wrote (config.json + *.safetensors)")
        index = self.directory / INDEX
        if index.is_file():
            return dict(json.loads(index.read_text())["weight_map"])
        files = sorted(self.directory.glob("*.safetensors"))
        if not files:
            raise ConfigError(f"checkpoint {str(self.directory)!r} holds no *.safetensors file; "
                              f"save the model with save_pretrained (safetensors is its default)")
        where = {}
        for file in files:
            with safe_open(str(file), framework="pt") as handle:
                where.update({key: file.name for key in handle.keys()})
        return where

    def _handle(self, name: str):
        from safetensors import safe_open

        file = self.where[name]
        if file not in self._open:
            self._open[file] = self._stack.enter_context(safe_open(str(self.directory / file), framework="pt"))
        return self._open[file]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(self._stored[name]).get_shape())

    def read(self, name: str, index: tuple[slice, ...] = ()) -> torch.Tensor:
        """The tensor the model names `name`, or only `index` (one slice per leading dim) of it."""
        part = self._handle(name).get_slice(self._stored[name])
        return part[index] if index else part[:]

    def __exit__(self, *exc) -> None:
        self._stack.close()


def local_index(shape: tuple[int, ...], placements, coords: list[int], sizes: list[int]) -> tuple[slice, ...]:
    """This rank's slice of a tensor of `shape` under DTensor `placements` on a mesh of `sizes`
    where this rank sits at `coords` (module docstring; one Shard per tensor dim at most)."""
    index = [slice(None)] * len(shape)
    for placement, coord, size in zip(placements, coords, sizes):
        if isinstance(placement, Shard):
            dim = placement.dim % len(shape)
            if index[dim] != slice(None):
                raise ConfigError(f"a tensor of shape {shape} is sharded twice on dim {dim}; the "
                                  f"loader reads one shard per dim (load before ZeRO sharding)")
            chunk = math.ceil(shape[dim] / size)
            index[dim] = slice(min(coord * chunk, shape[dim]), min((coord + 1) * chunk, shape[dim]))
    while index and index[-1] == slice(None):
        index.pop()
    return tuple(index)


def _checkpoint_name(names: list[str], files: CheckpointFiles) -> str:
    """The first of a tensor's names (tied aliases) that the checkpoint holds (under the model's names)."""
    for name in names:
        if name in files.where:
            return name
    sample = ", ".join(sorted(files.where)[:4])
    raise ConfigError(f"checkpoint {str(files.directory)!r} does not match the model: it has no tensor "
                      f"{names[0]!r} (the first parameter missing; the checkpoint holds "
                      f"{len(files.where)} tensors, e.g. {sample}); load a checkpoint of this model")


def _load_tensor(names: list[str], current: torch.Tensor, files: CheckpointFiles, device) -> torch.Tensor:
    """This rank's part of the tensor `names[0]` (a DTensor when `current` is one), read from `files`;
    fused expert weights stored per expert read from those (`runtime.expert_checkpoint`)."""
    if not any(n in files.where for n in names):
        found = _load_per_expert(names[0], current, files, device)
        if found is not None:
            return found
    key = _checkpoint_name(names, files)
    stored = files.shape(key)
    if stored != tuple(current.shape):
        raise ConfigError(f"checkpoint {str(files.directory)!r} does not match the model: "
                          f"{names[0]!r} has shape {tuple(current.shape)} in the model but "
                          f"{stored} in the checkpoint ({key!r})")
    if not isinstance(current, DTensor):
        return files.read(key).to(device=device, dtype=current.dtype)
    mesh = current.device_mesh
    index = local_index(stored, current.placements, mesh.get_coordinate(), list(mesh.shape))
    # a slice of a later dim is strided; FSDP2 shards only contiguous parameters
    local = files.read(key, index).to(device=device, dtype=current.dtype).contiguous()
    return DTensor.from_local(local, mesh, current.placements, run_check=False,
                              shape=current.shape, stride=current.stride())


def _load_per_expert(name: str, current: torch.Tensor, files: CheckpointFiles, device) -> torch.Tensor | None:
    """This rank's part of fused expert weight `name` from its per-expert tensors, or None."""
    mesh = current.device_mesh if isinstance(current, DTensor) else None
    index = local_index(tuple(current.shape), current.placements, mesh.get_coordinate(), list(mesh.shape)) \
        if mesh is not None else ()
    local = read_per_expert(name, tuple(current.shape), index, files)
    if local is None:
        return None
    wanted = tuple(current.to_local().shape) if mesh is not None else tuple(current.shape)
    if tuple(local.shape) != wanted:
        raise ConfigError(f"checkpoint {str(files.directory)!r} does not match the model: {name!r} has shape "
                          f"{tuple(current.shape)} in the model, but its experts' tensors give {tuple(local.shape)} "
                          f"for this rank's part {wanted}")
    local = local.to(device=device, dtype=current.dtype).contiguous()
    if mesh is None:
        return local
    return DTensor.from_local(local, mesh, current.placements, run_check=False, shape=current.shape,
                              stride=current.stride())


@torch.no_grad()
def load_checkpoint(model: nn.Module, directory: str | Path, device: torch.device) -> None:
    """Replace every meta parameter and buffer of `model` by this rank's part of it, read from the
    checkpoint `directory` (module docstring). Tied parameters stay tied."""
    aliases: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    done: dict[int, nn.Parameter] = {}
    with CheckpointFiles(directory, checkpoint_renamer(model)) as files:
        for path, module in model.named_modules():
            for attr, p in list(module._parameters.items()):
                if p is None:
                    continue
                if id(p) not in done:
                    local = _load_tensor(aliases[id(p)], p, files, device)
                    done[id(p)] = nn.Parameter(local, requires_grad=p.requires_grad)
                module._parameters[attr] = done[id(p)]
            _load_buffers(model, path, module, files, device)


def _load_buffers(model: nn.Module, path: str, module: nn.Module, files: CheckpointFiles, device) -> None:
    """Persistent meta buffers from the checkpoint; non-persistent ones by transformers' init."""
    missing = []
    for attr, b in list(module._buffers.items()):
        if b is None or not b.is_meta:
            continue
        name = f"{path}.{attr}" if path else attr
        if attr not in module._non_persistent_buffers_set:
            module._buffers[attr] = _load_tensor([name], b, files, device)
        else:
            module._buffers[attr] = torch.empty_like(b, device=device)
            missing.append(name)
    if missing and not hasattr(model, "_init_weights"):
        raise ConfigError(f"buffers {missing} of a model on meta are not saved in checkpoints "
                          f"(non-persistent) and this model has no transformers `_init_weights` "
                          f"to recompute them; build the model on CPU, or register them persistent")
    if missing:
        _init_buffers(model, module)


def _init_buffers(model: nn.Module, module: nn.Module) -> None:
    """transformers' `_init_weights` on `module` for its non-persistent buffers (rotary tables, Gemma's
    embed_scale), its parameters (already loaded) marked initialised: transformers' init functions
    leave a tensor so marked as it is."""
    params = [p for p in module._parameters.values() if p is not None and not hasattr(p, "_is_hf_initialized")]
    for p in params:
        p._is_hf_initialized = True
    try:
        model._init_weights(module)
    finally:
        for p in params:
            del p._is_hf_initialized
