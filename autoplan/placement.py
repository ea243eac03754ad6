"""Mesh axes and tensor placements, with DTensor's meaning.

A placement says how a tensor is laid out over the ranks of ONE mesh axis:

- `Shard(dim)`: each rank holds one contiguous 1/n slice of tensor dim `dim` (ranks in order).
- `Replicate()`: each rank holds the whole tensor.
- `Partial("sum")`: each rank holds a summand; the tensor is the sum over the axis.

"axis" always means a mesh axis and "dim" a tensor dimension. Placements print short for logs
(`S(0)`, `R`, `P`) and parse back from those strings, which is also their JSON form.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum
from typing import Union

from autoplan.errors import ConfigError


class MeshAxis(str, Enum):
    """The mesh axes autoplan knows, outermost first in the default rank order."""

    PP = "pp"
    DP = "dp"
    EP = "ep"
    CP = "cp"
    TP = "tp"

    def __str__(self) -> str:
        return self.value


AXIS_NAMES: tuple[str, ...] = tuple(a.value for a in MeshAxis)


@dataclass(frozen=True)
class Shard:
    """Split tensor dim `dim` evenly over the axis (negative dims count from the end)."""

    dim: int

    def __str__(self) -> str:
        return f"S({self.dim})"


@dataclass(frozen=True)
class Replicate:
    """Every rank of the axis holds the full tensor."""

    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True)
class Partial:
    """Every rank holds a partial value; the tensor is their reduction (only "sum" is used)."""

    reduce_op: str = "sum"

    def __post_init__(self) -> None:
        if self.reduce_op != "sum":
            raise ConfigError(f"Partial reduce_op {self.reduce_op!r} is not supported; use 'sum'")

    def __str__(self) -> str:
        return "P"


Placement = Union[Shard, Replicate, Partial]

_SHARD_RE = re.compile(r"^S\((-?\d+)\)$")


def parse_placement(text: str) -> Placement:
    """Inverse of `str(placement)`: 'S(0)' -> Shard(0), 'R' -> Replicate(), 'P' -> Partial()."""
    text = text.strip()
    if text == "R":
        return Replicate()
    if text in ("P", "P(sum)"):
        return Partial()
    match = _SHARD_RE.match(text)
    if match:
        return Shard(int(match.group(1)))
    raise ConfigError(f"placement {text!r} is not one of 'R', 'P' or 'S(<dim>)' (e.g. 'S(0)')")


def check_axis(name: str) -> str:
    """Return `name` if it is a known mesh axis, else raise with the list of axes."""
    if name not in AXIS_NAMES:
        raise ConfigError(f"mesh axis {name!r} is unknown; expected one of {', '.join(AXIS_NAMES)}")
    return name
