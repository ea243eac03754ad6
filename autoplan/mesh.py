"""The device mesh: degrees of the parallel axes and their order over ranks.

Ranks are laid out row-major over `order` (outermost first), so the LAST axis of `order` is the
fastest-varying one: with the default order ("pp", "dp", "ep", "cp", "tp") tensor-parallel ranks are
consecutive and, when tp divides the GPUs per node, stay inside one node (as in Megatron-LM).

    rank = sum_a coord[a] * stride[a],   stride[a] = prod(degree[b] for b after a in order)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from autoplan.errors import ConfigError
from autoplan.placement import AXIS_NAMES

DEFAULT_ORDER: tuple[str, ...] = ("pp", "dp", "ep", "cp", "tp")


@dataclass(frozen=True)
class MeshShape:
    """Degrees of pp x dp x ep x cp x tp and their rank order (outermost first)."""

    pp: int = 1
    dp: int = 1
    tp: int = 1
    cp: int = 1
    ep: int = 1
    order: tuple[str, ...] = DEFAULT_ORDER

    def __post_init__(self) -> None:
        for axis in AXIS_NAMES:
            degree = getattr(self, axis)
            if not isinstance(degree, int) or isinstance(degree, bool) or degree < 1:
                raise ConfigError(f"mesh degree {axis}={degree!r} must be a positive integer")
        if sorted(self.order) != sorted(AXIS_NAMES):
            raise ConfigError(
                f"mesh order {self.order!r} must name each of {', '.join(AXIS_NAMES)} exactly once"
            )

    @property
    def world_size(self) -> int:
        return math.prod(self.degree(a) for a in AXIS_NAMES)

    def degree(self, axis: str) -> int:
        return int(getattr(self, axis))

    def degrees(self) -> dict[str, int]:
        return {a: self.degree(a) for a in AXIS_NAMES}

    def stride(self, axis: str) -> int:
        """Rank distance between neighbours along `axis`."""
        after = self.order[self.order.index(axis) + 1 :]
        return math.prod(self.degree(a) for a in after)

    def coords(self, rank: int) -> dict[str, int]:
        """Coordinate of `rank` along every axis."""
        if not 0 <= rank < self.world_size:
            raise ConfigError(f"rank {rank} is outside the mesh of {self.world_size} ranks")
        return {a: (rank // self.stride(a)) % self.degree(a) for a in AXIS_NAMES}

    def rank_of(self, coords: dict[str, int]) -> int:
        return sum(coords.get(a, 0) * self.stride(a) for a in AXIS_NAMES)

    def group_of(self, rank: int, axis: str) -> tuple[int, ...]:
        """The ranks that share every coordinate of `rank` except along `axis`, in axis order."""
        base = rank - self.coords(rank)[axis] * self.stride(axis)
        return tuple(base + i * self.stride(axis) for i in range(self.degree(axis)))

    def groups(self, axis: str) -> tuple[tuple[int, ...], ...]:
        """Every group along `axis`, each once, ordered by its first rank."""
        seen: dict[tuple[int, ...], None] = {}
        for rank in range(self.world_size):
            seen.setdefault(self.group_of(rank, axis), None)
        return tuple(seen)

    def nodes_spanned(self, axis: str, gpus_per_node: int) -> int:
        """How many nodes one group along `axis` touches (ranks fill nodes in rank order)."""
        group = self.group_of(0, axis)
        return len({r // gpus_per_node for r in group})

    def ranks_per_node(self, axis: str, gpus_per_node: int) -> int:
        """How many ranks of one group along `axis` share a node."""
        return self.degree(axis) // self.nodes_spanned(axis, gpus_per_node)

    def to_json(self) -> dict:
        return {**self.degrees(), "order": list(self.order)}

    @classmethod
    def from_json(cls, data: dict) -> "MeshShape":
        unknown = set(data) - set(AXIS_NAMES) - {"order"}
        if unknown:
            raise ConfigError(f"mesh has unknown keys {sorted(unknown)}; allowed: {list(AXIS_NAMES)} and 'order'")
        order = tuple(data.get("order", DEFAULT_ORDER))
        return cls(**{a: data.get(a, 1) for a in AXIS_NAMES}, order=order)

    def __str__(self) -> str:
        return " x ".join(f"{a}{self.degree(a)}" for a in self.order if self.degree(a) > 1) or "single device"
