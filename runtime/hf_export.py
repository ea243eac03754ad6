"""Write a trained `ModuleProgram`'s weights as a Hugging Face checkpoint directory, one that
`transformers.AutoModelForCausalLM.from_pretrained(OUT)` loads.

Every rank gathers the full state dict (`ModuleProgram.full_state_dict`, a collective); rank 0
builds the model's class on meta from a copy of its config, assigns the weights, recomputes the
non-persistent buffers with transformers' own init, and calls `save_pretrained` into a new
directory `<OUT>.tmp-<token>` marked as autoplan's (`.autoplan-export`), which is then renamed to
OUT. OUT may be new, an empty directory, or an earlier export of autoplan (it carries the marker;
it is set aside and deleted once the new one is in place); anything else is the user's and is
never overwritten.
"""

from __future__ import annotations

import copy
import json
import os
import secrets
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from autoplan.errors import ConfigError

MARKER = ".autoplan-export"


def export_target_error(out: Path) -> str | None:
    """Why an export may not write `out`, or None (module docstring)."""
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        return f"cannot export to {str(out)!r}: it exists and is not a directory; choose a new directory"
    if not out.exists() or not any(out.iterdir()) or (out / MARKER).is_file():
        return None
    return (f"refusing to export to {str(out)!r}: it is a non-empty directory autoplan did not write "
            f"(no {MARKER}), and an export replaces the whole directory; choose a new or empty one")


def _agree(error: str | None) -> None:
    """Raise `error` (rank 0's) on every rank, so that no rank waits in a collective alone."""
    box = [error]
    if dist.is_initialized():
        dist.broadcast_object_list(box, src=0)
    if box[0] is not None:
        raise ConfigError(box[0])


def _rebuild(model, state: dict[str, torch.Tensor]):
    """A CPU copy of the transformers `model`'s class holding `state`."""
    from torch.distributed.fsdp import FSDPModule

    cls = next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))  # FSDP2 subclasses it
    with torch.device("meta"):
        fresh = cls(copy.deepcopy(model.config))
    fresh.load_state_dict(state, strict=True, assign=True)
    for path, module in fresh.named_modules():
        if any(b.is_meta for b in module.buffers(recurse=False)):
            for name, b in list(module._buffers.items()):
                if b is not None and b.is_meta:
                    module._buffers[name] = torch.empty_like(b, device="cpu")
            fresh._init_weights(module)  # the rotary tables, from the config
    if hasattr(fresh, "tie_weights"):
        fresh.tie_weights()
    return fresh


def save_hf(program, out: str | Path) -> Path:
    """Write `program`'s model as a Hugging Face checkpoint at `out` (module docstring); a
    collective: call it on every rank. Returns the path."""
    out = Path(out)
    model = program.model
    if not hasattr(model, "save_pretrained") or not hasattr(model, "config"):
        raise ConfigError(f"save_hf writes transformers models; {type(model).__name__} is not one: "
                          f"save program.full_state_dict() with torch.save or safetensors instead")
    rank = dist.get_rank() if dist.is_initialized() else 0
    _agree(export_target_error(out) if rank == 0 else None)
    state = program.full_state_dict()
    if rank == 0:
        token = secrets.token_hex(4)
        tmp = out.parent / f"{out.name}.tmp-{token}"
        tmp.mkdir(parents=True)
        (tmp / MARKER).write_text(json.dumps({"kind": "autoplan-hf-export", "token": token}) + "\n")
        _rebuild(model, state).save_pretrained(tmp)
        _swap(tmp, out, token)
    if dist.is_initialized():
        dist.barrier()
    return out


def _swap(tmp: Path, out: Path, token: str) -> None:
    """Move the finished `tmp` to `out`; an earlier export there is set aside, then deleted."""
    old = None
    if out.exists() and (out / MARKER).is_file():
        old = out.parent / f"{out.name}.old-{token}"
        os.rename(out, old)
    os.rename(tmp, out)  # onto a new path or an empty directory
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
