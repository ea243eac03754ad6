"""Process groups of the mesh axes, and of the axes' combinations the runtime reduces over.

    tp, cp, ep, dp, pp   one group per axis: the ranks that differ only in that coordinate; but
                         cp spans ep x cp when the ep ranks are context-parallel ranks of the
                         dense layers (`MeshShape.ep_as` = "cp", `MeshShape.context_axes`): its
                         ranks in ascending order hold the sequence's chunks in order
    data                 dp x ep x cp: the ranks that hold the same dense parameter shards (same pp
                         and tp coordinates) and see different tokens; dense gradients are summed
                         over it and the loss averaged over it
    expert_data          dp x cp: the ranks that hold the same experts (same pp, ep, tp); expert
                         gradients are summed over it
    expert               the ranks a MoE layer spreads its experts over and dispatches tokens
                         to: ep, ep x tp when etp = 1, ep x tp_outer when 1 < etp < tp (MoE
                         parallel folding, `MeshShape.expert_axes`); its ranks in ascending order
                         hold the experts' blocks in order (rank i: experts [i E_l, (i+1) E_l)),
                         whatever the mesh order
    expert_tp            the ranks that split each of the same experts' FFN: tp_inner, the etp
                         ranks differing only in t_inner (`MeshShape.expert_tp_axes`); the tp
                         ranks when etp = tp (the tp group itself), one rank when etp = 1

Every process calls `torch.distributed.new_group` for every distinct rank set of every kind, in the
same order (kinds in `GROUP_AXES` order, groups by first rank), which torch requires; each keeps the
ones it belongs to. A rank set that two kinds share (data = dp when ep = cp = 1) gets one process
group. A kind of one rank gets no process group: nothing communicates on it.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist
from torch import nn

from autoplan.mesh import MeshShape

GROUP_AXES: dict[str, tuple[str, ...]] = {
    "tp": ("tp",), "cp": ("cp",), "ep": ("ep",), "dp": ("dp",), "pp": ("pp",),
    "data": ("dp", "ep", "cp"), "expert_data": ("dp", "cp"), "expert": ("ep", "tp"),
    "expert_tp": ("tp_inner",),
}


def kind_axes(mesh: MeshShape, kind: str) -> tuple[str, ...]:
    """The axes a group of `kind` spans on `mesh`: those of GROUP_AXES, "expert" and "expert_tp" as
    etp says (`MeshShape.expert_axes`, `expert_tp_axes`), "cp" with ep when ep_as = "cp" (the
    sequence split over ep x cp)."""
    if kind == "cp":
        return mesh.context_axes
    if kind == "expert_tp":
        return mesh.expert_tp_axes
    return mesh.expert_axes if kind == "expert" else GROUP_AXES[kind]


class RankGroup(nn.Module):
    """One process group along a mesh axis (or several). An `nn.Module` (without parameters) so that
    the rewritten GraphModule can fetch it as `self.tp` and pass it to the collectives, keeping the
    code readable.

    `ranks` are mesh ranks in group order (ascending); `index` is this process's position in it."""

    def __init__(self, axis: str, ranks: tuple[int, ...], index: int,
                 group: dist.ProcessGroup | None) -> None:
        super().__init__()
        self.axis, self.ranks, self.index, self.group = axis, ranks, index, group

    @property
    def size(self) -> int:
        return len(self.ranks)

    def extra_repr(self) -> str:
        return f"axis={self.axis}, ranks={list(self.ranks)}, index={self.index}"


def group_of(mesh: MeshShape, rank: int, axes: tuple[str, ...]) -> tuple[int, ...]:
    """The ranks that share every coordinate of `rank` except those along `axes` (mesh axes or
    sub-axes of tp), ascending."""
    found = [rank - sum(mesh.coord(rank, a) * mesh.stride(a) for a in axes)]
    for axis in axes:
        found = [base + i * mesh.stride(axis) for base in found for i in range(mesh.degree(axis))]
    return tuple(sorted(found))


def groups_of(mesh: MeshShape, axes: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
    """Every group along `axes`, each once, ordered by its first rank."""
    seen: dict[tuple[int, ...], None] = {}
    for rank in range(mesh.world_size):
        seen.setdefault(group_of(mesh, rank, axes), None)
    return tuple(seen)


def build_axis_groups(mesh: MeshShape, mesh_rank: int, global_rank_of=lambda r: r,
                      timeout: timedelta | None = None) -> dict[str, RankGroup]:
    """Create the groups of every kind in GROUP_AXES on every process; return this rank's.

    `global_rank_of` maps a mesh rank to a rank of the default process group. `timeout` bounds
    every collective on these groups (None: torch's default, 30 minutes on gloo: `new_group` does
    not inherit the default group's). Each group is described by its first kind, which
    collectives' errors name."""
    made: dict[tuple[int, ...], dist.ProcessGroup] = {}
    groups: dict[str, RankGroup] = {}
    for kind in GROUP_AXES:
        axes = kind_axes(mesh, kind)
        mine = group_of(mesh, mesh_rank, axes)
        if len(mine) == 1:
            groups[kind] = RankGroup(kind, mine, 0, None)
            continue
        for ranks in groups_of(mesh, axes):
            if ranks not in made:
                made[ranks] = dist.new_group([global_rank_of(r) for r in ranks],
                                             timeout=timeout, group_desc=kind)
        pg, index = made[mine], mine.index(mesh_rank)
        if dist.get_rank(pg) != index:  # collectives assume group order = ascending mesh rank
            raise RuntimeError(f"{kind} group {mine}: process group rank {dist.get_rank(pg)} != "
                               f"position {index} of mesh rank {mesh_rank}")
        groups[kind] = RankGroup(kind, mine, index, pg)
    return groups
