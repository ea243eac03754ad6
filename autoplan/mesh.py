"""The device mesh: degrees of the parallel axes and their order over ranks.

Ranks are laid out row-major over `order` (outermost first), so the LAST axis of `order` is the
fastest-varying one: with the default order ("pp", "dp", "ep", "cp", "tp") tensor-parallel ranks are
consecutive and, when tp divides the GPUs per node, stay inside one node (as in Megatron-LM).

    rank = sum_a coord[a] * stride[a],   stride[a] = prod(degree[b] for b after a in order)

`etp`, the expert tensor-parallel degree, is no axis: it says how MoE layers use the tp ranks
(Megatron Core's MoE parallel folding, Liu et al. 2025), any divisor of tp. The tp coordinate t splits
as t = t_outer * etp + t_inner, f = tp / etp: etp consecutive tp ranks (same t_outer) hold the same
experts, each 1/etp of every expert's FFN; the f values of t_outer are expert-parallel ranks. So a MoE
layer spreads its experts over ep x f ranks (`expert_axes`, `expert_parallel`: the "expert" group,
the dispatch all-to-all) and splits each expert's FFN over the etp ranks differing only in t_inner
(`expert_tp_axes`: the "expert_tp" group), while attention keeps tp. etp = tp (the default): f = 1,
experts over ep, their FFN over tp like the dense layers. etp = 1: experts whole over ep x tp. The
two halves of tp are sub-axes ("tp_outer", "tp_inner") that `degree`, `stride` and `coord` know
(SUB_AXES); they are never in `order` (t_inner is the fast half, as in Megatron Core).

`ep_as`, no axis either, says what the ep ranks are to the non-expert layers (attention, dense FFNs,
embeddings), which never hold different experts. "dp" (the default): extra data-parallel ranks, the
batch split over dp x ep (`batch_shards`). "cp": extra context-parallel ranks (Megatron Core's MoE
parallel folding over context parallelism), each sequence split over the ep x cp ranks
(`context_axes`, `context_parallel`) and attention's Ulysses group spanning them, so one set of
ranks serves cp = 8 attention and ep = 8 experts. MoE routing is per token, so the expert layers do
not care whether a rank's tokens come from a batch or a sequence split. Either way the ranks that
hold the same dense shards are dp x ep x cp and those holding the same experts dp x cp.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from autoplan.errors import ConfigError
from autoplan.placement import AXIS_NAMES

DEFAULT_ORDER: tuple[str, ...] = ("pp", "dp", "ep", "cp", "tp")
EP_AS = ("dp", "cp")  # what the ep ranks are to the non-expert layers (module docstring)
SUB_AXES = ("tp_outer", "tp_inner")  # the halves of tp under 1 < etp < tp (module docstring)


@dataclass(frozen=True)
class MeshShape:
    """Degrees of pp x dp x ep x cp x tp, their rank order (outermost first), the expert
    tensor-parallel degree `etp` (module docstring; None: tp), and `ep_as`, what the ep ranks are
    to the non-expert layers: "dp" (batch split over dp x ep) or "cp" (sequence over ep x cp)."""

    pp: int = 1
    dp: int = 1
    tp: int = 1
    cp: int = 1
    ep: int = 1
    order: tuple[str, ...] = DEFAULT_ORDER
    etp: int | None = None
    ep_as: str = "dp"

    def __post_init__(self) -> None:
        for axis in AXIS_NAMES:
            degree = getattr(self, axis)
            if not isinstance(degree, int) or isinstance(degree, bool) or degree < 1:
                raise ConfigError(f"mesh degree {axis}={degree!r} must be a positive integer")
        if sorted(self.order) != sorted(AXIS_NAMES):
            raise ConfigError(
                f"mesh order {self.order!r} must name each of {', '.join(AXIS_NAMES)} exactly once"
            )
        if self.etp is None:
            object.__setattr__(self, "etp", self.tp)
        check_etp(self.etp, self.tp)
        if self.ep_as not in EP_AS:
            raise ConfigError(f"mesh ep_as={self.ep_as!r} must be 'dp' (the ep ranks split the batch of the "
                              f"non-expert layers) or 'cp' (they split its sequence, as more context-parallel "
                              f"ranks)")
        if self.ep == 1:  # nothing to fold: one spelling, so that equal meshes compare equal
            object.__setattr__(self, "ep_as", "dp")

    @property
    def context_axes(self) -> tuple[str, ...]:
        """The axes over which the non-expert layers split each sequence (attention's Ulysses group):
        ep and cp when ep_as == "cp", else cp."""
        return ("ep", "cp") if self.ep_as == "cp" else ("cp",)

    @property
    def context_parallel(self) -> int:
        """How many ways the non-expert layers split each sequence: cp * ep when ep_as == "cp", else cp."""
        return self.cp * self.ep if self.ep_as == "cp" else self.cp

    @property
    def batch_shards(self) -> int:
        """How many ways the global batch is split (ranks seeing different sequences, per pp, cp and tp
        coordinate): dp when ep_as == "cp", else dp * ep."""
        return self.dp if self.ep_as == "cp" else self.dp * self.ep

    @property
    def expert_axes(self) -> tuple[str, ...]:
        """The (sub-)axes whose ranks hold different experts of a MoE layer: ep; and tp when etp = 1,
        its outer half "tp_outer" when 1 < etp < tp."""
        if self.etp == self.tp:
            return ("ep",)
        return ("ep", "tp") if self.etp == 1 else ("ep", "tp_outer")

    @property
    def expert_tp_axes(self) -> tuple[str, ...]:
        """The (sub-)axes over which each expert's FFN is split: tp when etp = tp, its inner half
        "tp_inner" when 1 < etp < tp, none when etp = 1."""
        if self.etp == self.tp:
            return ("tp",)
        return () if self.etp == 1 else ("tp_inner",)

    @property
    def expert_parallel(self) -> int:
        """How many ranks one MoE layer's experts are spread over: ep * tp / etp."""
        return self.ep * self.tp // self.etp

    @property
    def world_size(self) -> int:
        return math.prod(self.degree(a) for a in AXIS_NAMES)

    def degree(self, axis: str) -> int:
        """The degree of a mesh axis, or of a half of tp ("tp_outer": tp / etp, "tp_inner": etp)."""
        if axis in SUB_AXES:
            return self.tp // self.etp if axis == "tp_outer" else int(self.etp)
        return int(getattr(self, axis))

    def degrees(self) -> dict[str, int]:
        return {a: self.degree(a) for a in AXIS_NAMES}

    def stride(self, axis: str) -> int:
        """Rank distance between neighbours along `axis` (a sub-axis of tp: t_inner moves like tp,
        t_outer by etp tp steps)."""
        if axis in SUB_AXES:
            return self.stride("tp") * (self.etp if axis == "tp_outer" else 1)
        after = self.order[self.order.index(axis) + 1 :]
        return math.prod(self.degree(a) for a in after)

    def coord(self, rank: int, axis: str) -> int:
        """Coordinate of `rank` along a mesh axis or a sub-axis of tp."""
        return (rank // self.stride(axis)) % self.degree(axis)

    def coords(self, rank: int) -> dict[str, int]:
        """Coordinate of `rank` along every axis."""
        if not 0 <= rank < self.world_size:
            raise ConfigError(f"rank {rank} is outside the mesh of {self.world_size} ranks")
        return {a: self.coord(rank, a) for a in AXIS_NAMES}

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
        """The degrees and order; "etp" only where it differs from tp and "ep_as" only where it is
        "cp" (files of plans made before they existed, and of dense models, stay as they were)."""
        extra = {"etp": self.etp} if self.etp != self.tp else {}
        extra.update({"ep_as": self.ep_as} if self.ep_as != "dp" else {})
        return {**self.degrees(), "order": list(self.order), **extra}

    @classmethod
    def from_json(cls, data: dict) -> "MeshShape":
        unknown = set(data) - set(AXIS_NAMES) - {"order", "etp", "ep_as"}
        if unknown:
            raise ConfigError(f"mesh has unknown keys {sorted(unknown)}; allowed: {list(AXIS_NAMES)}, 'order', "
                              f"'etp' and 'ep_as'")
        order = tuple(data.get("order", DEFAULT_ORDER))
        return cls(**{a: data.get(a, 1) for a in AXIS_NAMES}, order=order, etp=data.get("etp"),
                   ep_as=data.get("ep_as", "dp"))

    def __str__(self) -> str:
        axes = " x ".join(f"{a}{self.degree(a)}" for a in self.order if self.degree(a) > 1) or "single device"
        folded = [f"etp{self.etp}"] * (self.etp != self.tp) + ["ep as cp"] * (self.ep_as == "cp")
        return axes + (f" ({', '.join(folded)})" if folded else "")


def check_etp(etp: object, tp: int) -> None:
    """Refuse an expert tensor-parallel degree that is not a positive divisor of tp."""
    if not isinstance(etp, int) or isinstance(etp, bool) or etp < 1 or tp % etp:
        divisors = [d for d in range(1, tp + 1) if tp % d == 0]
        raise ConfigError(f"mesh etp={etp!r} must be a positive divisor of tp={tp} (the tp ranks a MoE expert's "
                          f"FFN is split over); use one of {divisors}")
