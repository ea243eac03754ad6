"""One tensor-parallel assignment priced: the strategies chosen at one (tp, microbatch) and what the step
model needs of them (`TpSolution`). `tp_solution` resolves an assignment (node name -> strategy name)
against the strategy rules and prices it; the intra-op solve that chooses the assignment is
`autoplan.solver.intra_op`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping

from autoplan.cluster import ClusterSpec
from autoplan.cost_model.comm import AxisGroup
from autoplan.cost_model.compute import Efficiency
from autoplan.cost_model.intra_op import AssignmentCost, CostContext, make_context, price_assignment
from autoplan.cost_model.intra_op_problem import resolve_strategies
from autoplan.cost_model.activations import RunShape, activations
from autoplan.cost_model.storages import Activations
from autoplan.cost_model.memory import comm_buffer_lines, largest_comm_buffer_bytes, parameter_count_by_layer
from autoplan.mesh import MeshShape
from autoplan.strategies import Strategy, StrategyRegistry, strategy_info

if TYPE_CHECKING:
    from autoplan.capture.graph import CapturedGraph


@dataclass(frozen=True)
class TpSolution:
    """One (tp, microbatch) point: the strategies chosen and what the step model needs of them. The
    whole-graph figures (`cost`, the parameter counts, the buffer at `microbatch_size`) are computed on
    first use: the search prices parts instead (`autoplan.cost_model.parts`), and each is a pass over every node."""

    tp: int
    microbatch_size: int
    assignment: dict[str, str]
    strategies: dict[str, Strategy]
    info: dict  # the strategy rules' info (head_dim, rope, etp)
    dtype: str
    dp_group: AxisGroup
    solver: str = ""
    status: str = "optimal"
    comm_lines: tuple[tuple[float, float], ...] = ()  # `memory.comm_buffer_lines`: the buffer at any microbatch
    graph: CapturedGraph | None = field(default=None, compare=False, repr=False)
    ctx: CostContext | None = field(default=None, compare=False, repr=False)
    activation_cache: dict = field(default_factory=dict, compare=False, repr=False)  # (context, spread,
    # imbalance, master) -> Activations; one dict may serve every solution of the same assignment (they differ in microbatch only)

    def activations(self, context: int = 1, spread: int = 1, imbalance: bool = True,
                    master: bool = False) -> Activations:
        """The storages one forward keeps (`cost_model.activations`) under mixed precision when the dtype
        is not float32, with a context group of `context` ranks and MoE experts `spread` over a group
        (their routed rows for the busiest rank, or the mean: `RunShape.imbalance`); `master`: parameters
        held in the compute dtype (precision "bf16-master": no autocast copies, a bf16 residual stream)."""
        key = (context, spread, imbalance, master)
        walked = self.activation_cache.get((context, spread, True, master))
        if key not in self.activation_cache and walked is not None and not walked.margined:
            self.activation_cache[key] = walked  # no routed rows: the same storages either way
        if key not in self.activation_cache:
            efficiency = self.ctx.efficiency if self.ctx is not None else None
            triton = efficiency is not None and efficiency.kernels.triton
            shape = RunShape(self.dtype != "float32", context, spread, triton, imbalance, master)
            attention = efficiency.attention if efficiency is not None else None
            self.activation_cache[key] = activations(self.graph, self.strategies, self.tp, self.info, shape, attention)
        return self.activation_cache[key]

    @functools.cached_property
    def cost(self) -> AssignmentCost:
        """Seconds per microbatch of the whole graph (`intra_op.price_assignment`)."""
        return price_assignment(self.graph, self.strategies, self.ctx)

    @functools.cached_property
    def _params_by_layer(self) -> dict:
        return parameter_count_by_layer(self.graph, self.strategies, self.tp)

    @property
    def local_params(self) -> float:
        """Parameters per rank after tp."""
        return float(sum(self._params_by_layer.values()))

    @property
    def largest_layer_params(self) -> float:
        return max(self._params_by_layer.values(), default=0.0)

    @property
    def comm_buffer_bytes(self) -> float:
        """The largest tp collective buffer at `microbatch_size`."""
        return largest_comm_buffer_bytes(self.graph, self.strategies, self.tp, self.microbatch_size, self.comm_lines)


def tp_solution(graph: CapturedGraph, registry: StrategyRegistry, info: Mapping, cluster: ClusterSpec,
                mesh: MeshShape, microbatch_size: int, assignment: Mapping[str, str], dtype: str,
                efficiency: Efficiency, solver: str = "", status: str = "optimal", lines: bool = True) -> TpSolution:
    """Everything the step model needs about `assignment` at this (tp, microbatch) and the mesh's etp.
    `lines`: False leaves `comm_lines` to the caller (`parts.solution_parts` finds them on fewer nodes)."""
    tp, info = mesh.tp, strategy_info(info, mesh.tp, mesh.etp)
    strategies = resolve_strategies(graph, registry, info, tp, assignment)
    ctx = make_context(graph, cluster, mesh, microbatch_size, dtype, efficiency)
    # every node named (`resolve_strategies` refuses unknown names): the names are the assignment's
    names = dict(assignment) if len(assignment) == len(strategies) else {n: s.name for n, s in strategies.items()}
    return TpSolution(tp, microbatch_size, names, strategies,
                      dict(info), dtype, AxisGroup.of(mesh, "dp", cluster.gpus_per_node), solver, status,
                      comm_buffer_lines(graph, strategies, tp) if lines else (), graph, ctx)
