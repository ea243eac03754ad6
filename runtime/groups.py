"""Process groups of the mesh axes.

Every process calls `torch.distributed.new_group` for every group of every axis, in the same
order (axes in `AXES_WITH_GROUPS` order, groups by first rank as `MeshShape.groups` lists them),
which torch requires; each keeps the one it belongs to.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from autoplan.mesh import MeshShape

AXES_WITH_GROUPS = ("dp", "tp")  # the axes this runtime executes; pp, cp and ep are refused


class AxisGroup(nn.Module):
    """One process group along a mesh axis. An `nn.Module` (without parameters) so that the rewritten
    GraphModule can fetch it as `self.tp` and pass it to the collectives, keeping the code readable.

    `ranks` are mesh ranks in axis order; `index` is this process's coordinate on the axis."""

    def __init__(self, axis: str, ranks: tuple[int, ...], index: int,
                 group: dist.ProcessGroup | None) -> None:
        super().__init__()
        self.axis, self.ranks, self.index, self.group = axis, ranks, index, group

    @property
    def size(self) -> int:
        return len(self.ranks)

    def extra_repr(self) -> str:
        return f"axis={self.axis}, ranks={list(self.ranks)}, index={self.index}"


def build_axis_groups(mesh: MeshShape, mesh_rank: int, global_rank_of=lambda r: r
                      ) -> dict[str, AxisGroup]:
    """Create the groups of every axis in AXES_WITH_GROUPS on every process; return this rank's.

    An axis of degree 1 gets a one-rank AxisGroup with no process group: nothing communicates on
    it. `global_rank_of` maps a mesh rank to a rank of the default process group."""
    groups: dict[str, AxisGroup] = {}
    coords = mesh.coords(mesh_rank)
    for axis in AXES_WITH_GROUPS:
        mine = mesh.group_of(mesh_rank, axis)
        if mesh.degree(axis) == 1:
            groups[axis] = AxisGroup(axis, mine, 0, None)
            continue
        for ranks in mesh.groups(axis):
            pg = dist.new_group([global_rank_of(r) for r in ranks])
            if ranks == mine:
                if dist.get_rank(pg) != coords[axis]:  # collectives assume axis order = group order
                    raise RuntimeError(f"{axis} group {ranks}: process group rank "
                                       f"{dist.get_rank(pg)} != mesh coordinate {coords[axis]}")
                groups[axis] = AxisGroup(axis, ranks, coords[axis], pg)
    return groups
