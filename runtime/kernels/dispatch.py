"""Choosing between the Triton kernels and their plain-torch references.

    use_triton(device, "auto")     Triton on CUDA when triton imports; torch everywhere else,
                                   except that TRITON_INTERPRET=1 runs Triton's interpreter on CPU
    use_triton(device, "triton")   Triton or an error saying why it cannot run
    use_triton(device, "torch")    always the torch reference

triton is imported on the first call that needs it (`load_triton`), never when this package is
imported, so everything works without triton installed. The interpreter flag is read from the
environment at each call here; triton reads it once, when it is first imported (its language
builtins differ), so a process that interprets must set it before anything imports triton.
Each kernel module builds its kernels once, on first use (`_kernels()`, cached).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
from types import ModuleType
from typing import Literal

import torch

from autoplan.errors import ConfigError

Backend = Literal["auto", "triton", "torch"]
BACKENDS = ("auto", "triton", "torch")


@functools.cache
def load_triton() -> tuple[ModuleType, ModuleType] | None:
    """(triton, triton.language), or None where triton is not installed or fails to import."""
    try:
        return importlib.import_module("triton"), importlib.import_module("triton.language")
    except Exception:  # ImportError, or a broken install raising anything at import
        return None


def interpreting() -> bool:
    """True when TRITON_INTERPRET=1: Triton kernels run on CPU tensors through the interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_triton(device: torch.device | str, backend: Backend = "auto") -> bool:
    """Whether the kernels for tensors on `device` run in Triton (True) or plain torch (False)."""
    if backend not in BACKENDS:
        raise ConfigError(f"kernel backend {backend!r} is not one of {BACKENDS}")
    if backend == "torch":
        return False
    device = torch.device(device)
    runnable = device.type == "cuda" or interpreting()
    if backend == "auto":  # triton is not even imported where it could not run
        return runnable and load_triton() is not None
    if load_triton() is None:
        raise ConfigError("kernel backend 'triton' needs triton: `pip install 'autoplan[triton]'`, "
                          "or use backend 'auto' or 'torch'")
    if not runnable:
        raise ConfigError(f"kernel backend 'triton' runs on CUDA, or on CPU only under "
                          f"TRITON_INTERPRET=1; tensors are on {device}: use backend 'auto' or "
                          f"'torch'")
    return True


def device_guard(t: torch.Tensor) -> contextlib.AbstractContextManager:
    """Makes t's GPU the current one for a launch (triton launches on the current device)."""
    return torch.cuda.device(t.device) if t.device.type == "cuda" else contextlib.nullcontext()


def persistent_programs(device: torch.device, work_items: int, per_sm: int = 2) -> int:
    """How many programs a grid-stride kernel launches: a few per SM on CUDA, 2 in the
    interpreter (each program instance costs about a millisecond there), never more than the
    work."""
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        return max(1, min(work_items, sms * per_sm))
    return max(1, min(work_items, 2))


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def rows_per_program(rows: int, row_block: int, target_elems: int, cuda: bool) -> int:
    """Rows in one program's tile of `row_block` columns: about `target_elems` elements on CUDA,
    8192 in the interpreter (large enough for few program instances, small enough that tests of
    modest shapes still run several programs and their grid-stride loops)."""
    target = target_elems if cuda else 8192
    return max(1, min(next_pow2(max(rows, 1)), target // row_block))


def num_warps(tile_elems: int) -> int:
    """Warps for a program whose tile holds `tile_elems` values: about 8 per thread, which keeps
    the kernels here under 128 registers without spills (ptxas for sm_90: 16 warps of 46-93
    registers at 4096-value tiles), so two programs fit on an SM at once."""
    return max(4, min(32, next_pow2(tile_elems // 256)))


def upcast(t: torch.Tensor) -> torch.Tensor:
    """t in fp32, or kept in float64: the torch references compute in at least fp32."""
    return t.to(torch.promote_types(t.dtype, torch.float32))
