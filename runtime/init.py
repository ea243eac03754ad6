"""Seeded, shard-exact parameter initialisation.

A parameter's full values are defined without ever building the full tensor. View it as rows along
dim 0 (row = one index of dim 0, prod(shape[1:]) elements) and cut the rows into fixed chunks of
`rows_per_chunk(shape)` rows; chunk c is filled from its own `torch.Generator` seeded with

    seed_c = first 8 bytes of sha256(f"{seed}/{name}/{c}")   (stable across processes and runs)

so any row range or column slice comes from generating only the chunks it touches. A tensor-parallel
rank allocates only its shard, and its values equal that slice of the single-device initialisation.

Rules (GPT-2 style, L = number of layers):

    Linear / Embedding weight, MoE w_gate / w_up     N(0, 0.02)
    output projections (o_proj, proj, down_proj, w_down)   N(0, 0.02 / sqrt(2 L))
    biases, LayerNorm biases                          0
    LayerNorm / RMSNorm weights                       1
    anything else                                     N(0, 0.02) if 2-D or more, else 0
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass

import torch
from torch import nn

from autoplan.errors import ConfigError
from autoplan.models.layers import MoEFeedForward, RMSNorm
from autoplan.placement import Placement, Replicate, Shard

CHUNK_ELEMENTS = 1 << 16  # ~64k values per generator: small enough to slice cheaply
BASE_STD = 0.02
OUTPUT_PROJECTIONS = frozenset({"o_proj", "proj", "down_proj", "w_down"})

Bounds = tuple[tuple[int, int], ...]  # [start, stop) per tensor dim


@dataclass(frozen=True)
class InitRule:
    """How one parameter starts: "normal" with `std`, "zeros" or "ones"."""

    kind: str
    std: float = 0.0


def init_rules(model: nn.Module, num_layers: int | None = None) -> dict[str, InitRule]:
    """The rule of every parameter of `model`, by fully qualified name."""
    layers = num_layers if num_layers is not None else _count_layers(model)
    rules = {}
    for module_name, module in model.named_modules():
        for pname, _ in module.named_parameters(recurse=False):
            full = f"{module_name}.{pname}" if module_name else pname
            rules[full] = _rule(module, module_name.rsplit(".", 1)[-1], pname, layers)
    return rules


def _count_layers(model: nn.Module) -> int:
    found = {m.group(1) for name, _ in model.named_parameters()
             for m in [re.search(r"(?:^|\.)layers\.(\d+)\.", name)] if m}
    return max(1, len(found))


def _rule(module: nn.Module, module_leaf: str, pname: str, layers: int) -> InitRule:
    scaled = InitRule("normal", BASE_STD / math.sqrt(2 * layers))
    if pname == "bias":
        return InitRule("zeros")
    if isinstance(module, (nn.LayerNorm, RMSNorm)):
        return InitRule("ones")
    if isinstance(module, MoEFeedForward):
        return scaled if pname in OUTPUT_PROJECTIONS else InitRule("normal", BASE_STD)
    if isinstance(module, (nn.Linear, nn.Embedding)):
        return scaled if module_leaf in OUTPUT_PROJECTIONS else InitRule("normal", BASE_STD)
    param = getattr(module, pname)
    return InitRule("normal", BASE_STD) if param.dim() >= 2 else InitRule("zeros")


def rows_per_chunk(shape: tuple[int, ...]) -> int:
    row = math.prod(shape[1:])
    return max(1, CHUNK_ELEMENTS // max(row, 1))


def chunk_seed(seed: int, name: str, chunk: int) -> int:
    digest = hashlib.sha256(f"{seed}/{name}/{chunk}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def shard_bounds(shape: tuple[int, ...], placement: Placement, rank: int, degree: int) -> Bounds:
    """The index range of `rank`'s piece of a tensor of `shape` laid out by `placement`."""
    full = tuple((0, s) for s in shape)
    if isinstance(placement, Replicate) or degree == 1:
        return full
    if not isinstance(placement, Shard):
        raise ConfigError(f"cannot initialise a parameter with placement {placement}: parameters "
                          f"are Replicate or Shard(dim)")
    dim = placement.dim % len(shape)
    if shape[dim] % degree:
        raise ConfigError(f"parameter of shape {shape}: dim {dim} (size {shape[dim]}) is not "
                          f"divisible by {degree} ranks")
    step = shape[dim] // degree
    return full[:dim] + ((rank * step, (rank + 1) * step),) + full[dim + 1:]


def nested_bounds(shape: tuple[int, ...], pieces: list[tuple[Placement, int, int]]) -> Bounds:
    """The index range of one rank's piece when several mesh axes split a tensor in turn, each
    (placement, this rank's index on the axis, the axis degree) taking its share of the range the
    previous ones left (outer axis first: ep, then tp)."""
    bounds = tuple((0, s) for s in shape)
    for placement, rank, degree in pieces:
        if isinstance(placement, Replicate) or degree == 1:
            continue
        dim = placement.dim % len(shape)
        (lo, hi), = shard_bounds((bounds[dim][1] - bounds[dim][0],), Shard(0), rank, degree)
        start = bounds[dim][0]
        bounds = bounds[:dim] + ((start + lo, start + hi),) + bounds[dim + 1:]
    return bounds


def init_local(name: str, shape: tuple[int, ...], rule: InitRule, seed: int, bounds: Bounds,
               dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> torch.Tensor:
    """Exactly `full_init(name)[bounds]`, generating only the row chunks that `bounds` touches."""
    local_shape = tuple(stop - start for start, stop in bounds)
    if rule.kind in ("zeros", "ones"):
        fill = 0.0 if rule.kind == "zeros" else 1.0
        return torch.full(local_shape, fill, dtype=dtype, device=device)
    if rule.kind != "normal":
        raise ConfigError(f"parameter {name!r}: unknown init kind {rule.kind!r}")
    if not shape:  # a 0-d parameter is one row of one value
        return _rows(name, (1,), rule, seed, 0, 1).reshape(()).to(dtype=dtype, device=device)
    (row_start, row_stop), rest = bounds[0], bounds[1:]
    inner = (slice(None),) + tuple(slice(a, b) for a, b in rest)
    per = rows_per_chunk(shape)
    pieces = []
    for chunk in range(row_start // per, (row_stop - 1) // per + 1 if row_stop > row_start else 0):
        lo, hi = chunk * per, min((chunk + 1) * per, shape[0])
        block = _rows(name, shape, rule, seed, chunk, hi - lo)  # rows [lo, hi)
        pieces.append(block[max(row_start, lo) - lo: min(row_stop, hi) - lo][inner])
    out = torch.cat(pieces) if pieces else torch.empty(local_shape)
    return out.to(dtype=dtype, device=device).contiguous()


def _rows(name: str, shape: tuple[int, ...], rule: InitRule, seed: int, chunk: int, rows: int
          ) -> torch.Tensor:
    gen = torch.Generator(device="cpu")
    gen.manual_seed(chunk_seed(seed, name, chunk))
    values = torch.randn((rows, *shape[1:]), generator=gen, dtype=torch.float32)
    return values.mul_(rule.std)


def init_shard(name: str, shape: tuple[int, ...], rule: InitRule, seed: int, placement: Placement,
               rank: int, degree: int, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu") -> torch.Tensor:
    """Rank `rank`'s piece (of `degree` along the placement's axis) of parameter `name`."""
    bounds = shard_bounds(tuple(shape), placement, rank, degree)
    return init_local(name, tuple(shape), rule, seed, bounds, dtype, device)


@torch.no_grad()
def init_parameters(model: nn.Module, seed: int, num_layers: int | None = None) -> nn.Module:
    """Fill every parameter of a (non-meta) single-device `model` in place; returns `model`."""
    rules = init_rules(model, num_layers)
    for name, param in model.named_parameters():
        if param.is_meta:
            raise ConfigError(f"init_parameters: parameter {name!r} is on the meta device; call "
                              f"model.to_empty(device='cpu') first")
        full = tuple((0, s) for s in param.shape)
        param.copy_(init_local(name, tuple(param.shape), rules[name], seed, full, param.dtype,
                               param.device))
    return model
