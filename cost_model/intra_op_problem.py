"""The intra-op problem arrays of a graph (or of one segment of a folded graph) on the tp axis: every
node's strategies with their costs, and the resharding cost matrix of every edge, as the solver reads
them (`cost_model.problem.IntraOpProblem`). The formulation is in `cost_model.intra_op`'s docstring;
the per-node and per-edge costs are that module's.
"""

from __future__ import annotations


from typing import TYPE_CHECKING, Mapping, NamedTuple

import numpy as np

from autoplan.cluster import ClusterSpec
from autoplan.cost_model.compute import (Efficiency)
from autoplan.cost_model.memory import (StateBytes, state_bytes_for)
from autoplan.errors import AutoplanError
from autoplan.mesh import MeshShape
from autoplan.placement import Placement
from autoplan.cost_model.problem import IntraOpProblem, ProblemVariant
from autoplan.strategies import InputSpec, Strategy, StrategyRegistry

if TYPE_CHECKING:
    from autoplan.capture import CapturedGraph, NodeInfo, TensorMeta
from autoplan.cost_model.intra_op import (CostContext, edge_cost_matrix, make_context, node_comm_s,
                                          node_compute_s, node_state_bytes, reshard_s)

# ---------------------------------------------------------------------------------- the problem


class BuiltProblem(NamedTuple):
    problem: IntraOpProblem
    strategies: list[list[Strategy]]  # per problem node
    mapping: dict[str, int]  # every graph node -> its problem node


def build_intra_op_problem(graph: "CapturedGraph", registry: StrategyRegistry, info: Mapping, tp: int,
                           cluster: ClusterSpec, mesh: MeshShape, microbatch_size: int, dtype: str = "bfloat16",
                           *, efficiency: Efficiency | None = None,
                           memory_budget_bytes: float | None = None) -> BuiltProblem:
    """The intra-op problem of the whole `graph` on a tp axis of degree `tp` (`cost_model.intra_op`'s
    docstring), one problem node per graph node; the folded solve builds per-segment problems instead
    (`segment_arrays`)."""
    if mesh.tp != tp:
        raise AutoplanError(f"tp={tp} disagrees with the mesh {mesh} (tp={mesh.tp})")
    ctx = make_context(graph, cluster, mesh, microbatch_size, dtype, efficiency)
    nodes = graph.nodes
    mapping = {n.name: k for k, n in enumerate(nodes)}
    by_name = graph_strategies(graph, registry, info, tp)
    strategies = [by_name[n.name] for n in nodes]
    state = state_bytes_for(dtype)
    costs = [np.array([sum(node_compute_s(n, s, ctx)) + sum(node_comm_s(n, s, ctx)) for s in ss])
             for n, ss in zip(nodes, strategies)]
    memory = [np.array([node_state_bytes(n, s, tp, state) for s in ss]) for n, ss in zip(nodes, strategies)]
    edges, matrices = [], []
    for v, node in enumerate(nodes):
        for k, producer in enumerate(node.inputs):
            u = mapping[producer]
            matrix = edge_cost_matrix(node.input_metas[k], strategies[u], strategies[v], k, ctx)
            if matrix.any():
                edges.append((u, v))
                matrices.append(matrix)
    problem = IntraOpProblem(tuple(n.name for n in nodes), tuple(costs), tuple(memory), (1.0,) * len(nodes),
                             tuple(edges), tuple(matrices), (1.0,) * len(edges), memory_budget_bytes)
    return BuiltProblem(problem, strategies, mapping)


def assignment_from_choice(built: BuiltProblem, choice) -> dict[str, str]:
    """Graph node name -> chosen strategy name, for every node (folded choices spread to every layer)."""
    return {name: built.strategies[k][choice[k]].name for name, k in built.mapping.items()}


def graph_strategies(graph: "CapturedGraph", registry: StrategyRegistry, info: Mapping, tp: int,
                     nodes=None) -> dict[str, list[Strategy]]:
    """Valid strategies of every node (or of `nodes`), asking the registry once per distinct node shape
    (`CapturedGraph.rule_table`)."""
    if nodes is None:
        ids, firsts = graph.rule_table
        by_id = [registry.strategies(graph.nodes[k], tp, info) for k in firsts]
        return dict(zip(graph.index.names, map(by_id.__getitem__, ids)))
    cache: dict[tuple, list[Strategy]] = {}
    found = {}
    for node in nodes:
        key = node.rule_key  # what a strategy rule may read: equal keys, equal strategies
        if key not in cache:
            cache[key] = registry.strategies(node, tp, info)
        found[node.name] = cache[key]
    return found


def resolve_strategies(graph: "CapturedGraph", registry: StrategyRegistry, info: Mapping, tp: int,
                       assignment: Mapping[str, str]) -> dict[str, Strategy]:
    """The Strategy objects of an assignment (node name -> strategy name); missing nodes take their first
    strategy: replicate (a MoE under etp < tp has only "expert"). Matched once per (node shape, name)."""
    names = graph.index.names
    unknown = sorted(set(assignment) - set(names))
    if unknown:
        raise AutoplanError(f"assignment names nodes that are not in the graph: {unknown[:5]}")
    ids, firsts = graph.rule_table
    options = [registry.strategies(graph.nodes[k], tp, info) for k in firsts]
    pairs = list(zip(ids, map(assignment.get, names)))  # (node shape, wanted name) per node
    first_named = dict(zip(reversed(pairs), reversed(names)))  # each pair's first node, for the error
    matched = {pair: _match(first_named[pair], options[pair[0]], pair[1], tp) for pair in dict.fromkeys(pairs)}
    return dict(zip(names, map(matched.__getitem__, pairs)))


def _match(name: str, options: list[Strategy], wanted: str | None, tp: int) -> Strategy:
    """The strategy named `wanted` among a node's `options` (None: its first)."""
    match = [s for s in options if s.name == wanted] if wanted is not None else options[:1]
    if not match:
        raise AutoplanError(f"node {name!r} has no strategy {wanted!r} at tp={tp}; valid: {[s.name for s in options]}")
    return match[0]


# ---------------------------------------------------------------------------------- segments


class SegmentArrays(NamedTuple):
    """One segment's nodes and inner edges priced at one (tp, microbatch), unfolded."""

    names: tuple[str, ...]
    strategies: list[list[Strategy]]  # per position
    costs: list[np.ndarray]  # seconds per strategy
    memory: list[np.ndarray]  # bytes per strategy
    edges: list[tuple[int, int]]  # (producer, consumer) positions, edges with some cost only
    matrices: list[np.ndarray]


def segment_arrays(nodes: "list[NodeInfo]", strategies: list[list[Strategy]], ctx: CostContext,
                   state: StateBytes) -> SegmentArrays:
    """Node costs, memory and inner edge matrices of the segment made of `nodes` (in any order)."""
    position = {n.name: p for p, n in enumerate(nodes)}
    costs = [np.array([sum(node_compute_s(n, s, ctx)) + sum(node_comm_s(n, s, ctx)) for s in ss])
             for n, ss in zip(nodes, strategies)]
    memory = [np.array([node_state_bytes(n, s, ctx.degree, state) for s in ss]) for n, ss in zip(nodes, strategies)]
    edges, matrices = [], []
    for v, node in enumerate(nodes):
        for k, producer in enumerate(node.inputs):
            if producer not in position:
                continue
            u = position[producer]
            matrix = edge_cost_matrix(node.input_metas[k], strategies[u], strategies[v], k, ctx)
            if matrix.any():
                edges.append((u, v))
                matrices.append(matrix)
    return SegmentArrays(tuple(n.name for n in nodes), list(strategies), costs, memory, edges, matrices)


def entry_costs(meta: "TensorMeta", src: Placement, consumer: list[Strategy], index: int, ctx: CostContext
                ) -> np.ndarray:
    """Seconds to feed input `index` of each consumer strategy from a producer whose output is placed `src`."""
    cache: dict[InputSpec, float] = {}
    for s in consumer:
        if s.inputs[index] not in cache:
            cache[s.inputs[index]] = sum(reshard_s(meta, src, s.inputs[index], ctx))
    return np.array([cache[s.inputs[index]] for s in consumer])


def segment_problem(arrays: SegmentArrays) -> IntraOpProblem:
    """The segment's own problem: its nodes with every strategy and its inner edges, unit weights."""
    return IntraOpProblem(arrays.names, tuple(arrays.costs), tuple(arrays.memory), (1.0,) * len(arrays.names),
                          tuple(arrays.edges), tuple(arrays.matrices), (1.0,) * len(arrays.edges))


def boundary_variant(arrays: SegmentArrays, entries: list[tuple[int, np.ndarray]],
                     outputs: Mapping[int, Placement]) -> ProblemVariant:
    """The segment's boundary fixed: `entries` (position, cost row) add the costs of the edges entering
    it; a node in `outputs` keeps only the strategies that place its output as given."""
    extra: dict[int, np.ndarray] = {}
    for p, row in entries:
        extra[p] = extra[p] + row if p in extra else row
    allowed = {}
    for p, placement in outputs.items():
        allowed[p] = tuple(i for i, s in enumerate(arrays.strategies[p]) if s.output == placement)
        if not allowed[p]:
            raise AutoplanError(f"node {arrays.names[p]!r} has no strategy whose output is {placement}; "
                                f"its strategies: {[s.name for s in arrays.strategies[p]]}")
    return ProblemVariant(extra, allowed)
