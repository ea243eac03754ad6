"""The folded solve (TAPAS): solve each kind of block of a `FoldedGraph` once per pair of boundary
placements, then chain the tables (`autoplan.capture.blocks` finds the blocks).

The folded solve (`solve_folded`). At one (tp, microbatch), a cut's state is the joint output
placement of its slots (R, S(1), S(2) each, for the tensors whose producer has a choice). For each
kind and each pair of states the chain needs, the kind's ILP is solved with that boundary fixed
(`autoplan.solver.ilp`: all pairs at once by exact variable elimination when the block's pair graph
is narrow, else one ILP model per kind, re-solved per pair), giving the tables T_kind[p, q];
`autoplan.solver.chain` picks a state per cut, and each segment takes its kind's solution for its
pair. Every node and edge lies in exactly one segment, so the chain's objective is the unfolded
objective of the spread choice and its minimum is the unfolded ILP's minimum (tests/test_chain.py).
Strategy rules may read a node's label only (not its module path) for this to hold. A cut with more
than `max_cut_states` joint placements falls back to one unfolded ILP.
"""
from __future__ import annotations

import itertools
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping

import numpy as np

from autoplan.capture.blocks import MAX_CUT_STATES, FoldedGraph, Segment
from autoplan.cluster import ClusterSpec
from autoplan.cost_model.compute import Efficiency
from autoplan.cost_model.intra_op import make_context
from autoplan.cost_model.intra_op_problem import assignment_from_choice, boundary_variant, build_intra_op_problem, entry_costs, graph_strategies, segment_arrays, segment_problem
from autoplan.cost_model.memory import state_bytes_for
from autoplan.mesh import MeshShape
from autoplan.solver.chain import solve_chain
from autoplan.solver.ilp import solve_ilp, solve_ilp_variants
from autoplan.strategies import StrategyRegistry

if TYPE_CHECKING:
    pass

# ---------------------------------------------------------------------------------- the folded solve


@dataclass(frozen=True)
class FoldedSolution:
    """The chosen strategy of every node, by a chain over per-kind cost tables (or one unfolded ILP)."""

    assignment: dict[str, str]  # node name -> strategy name, every node
    objective: float  # seconds per microbatch: the unfolded problem's objective of `assignment`
    status: str  # "optimal" | "feasible" (some block ILP stopped by its time limit)
    solver: str  # "highs" | "cbc" | "elimination" | "trivial"
    method: str  # "chain" | "unfolded: <why>"
    num_ilps: int  # block problems solved: one per kind and boundary pair
    solve_time_s: float


@dataclass
class _Entry:
    objective: float
    names: tuple[str, ...]  # strategy name per position
    status: str
    solver: str


class _Tables:
    """Cost table entries T_kind[p, q] at one (tp, microbatch): `prepare` finds the pairs of boundary
    placements the chain needs and solves each kind's pairs as variants of one problem."""

    def __init__(self, folded: FoldedGraph, strategies: dict[str, list], placements: list, ctx, dtype: str,
                 time_limit_s: float, solver: str | None) -> None:
        self.folded, self.strategies, self.placements, self.ctx = folded, strategies, placements, ctx
        self.state = state_bytes_for(dtype)
        self.time_limit_s, self.solver = time_limit_s, solver
        self.first = {seg.kind: seg for seg in reversed(folded.segments)}  # each kind's first segment
        self.entries: dict[tuple, _Entry] = {}
        self.tables: dict[tuple, np.ndarray] = {}

    def keys(self, s: int, before: tuple, after: tuple) -> tuple[tuple, tuple] | None:
        """(reads, provides) of segment s between cut states `before` and `after`: the placement read
        by each edge of `Segment.reads`, and the placement of each node the segment provides; None
        when a slot passed through would change placement."""
        seg = self.folded.segments[s]
        if any(what == "slot" and after[c] != before[r] for c, (what, r) in enumerate(seg.provides)):
            return None
        return (tuple(before[slot] for slot, _, _ in seg.reads),
                tuple(after[c] for c, (what, _) in enumerate(seg.provides) if what == "node"))

    def prepare(self, bounds: list[tuple[tuple, ...]]) -> None:
        """Solve every entry some segment needs between the states `bounds[s]` and `bounds[s + 1]`."""
        needed: dict[int, dict[tuple, None]] = defaultdict(dict)  # kind -> keys, in order of first need
        patterns = set()
        for s, seg in enumerate(self.folded.segments):
            pattern = (seg.kind, id(bounds[s]), id(bounds[s + 1]))  # equal cuts share one states tuple
            if pattern in patterns:
                continue
            patterns.add(pattern)
            for x in bounds[s]:
                for y in bounds[s + 1]:
                    keys = self.keys(s, x, y)
                    if keys is not None:
                        needed[seg.kind][keys] = None
        for kind, keys in needed.items():
            self._solve_kind(kind, list(keys))

    def _solve_kind(self, kind: int, keys: list[tuple[tuple, tuple]]) -> None:
        seg, nodes = self.first[kind], self.folded.kind_nodes[kind]
        arrays = segment_arrays(nodes, [self.strategies[n] for n in seg.nodes], self.ctx, self.state)
        rows: dict[tuple, np.ndarray] = {}

        def row(p: int, k: int, src: int) -> np.ndarray:
            if (p, k, src) not in rows:
                placement = self.placements[src]
                rows[(p, k, src)] = entry_costs(nodes[p].input_metas[k], placement, arrays.strategies[p], k, self.ctx)
            return rows[(p, k, src)]

        provided = [p for what, p in seg.provides if what == "node"]
        variants = [boundary_variant(arrays, [(p, row(p, k, src)) for (_, p, k), src in zip(seg.reads, reads)],
                                     {p: self.placements[c] for p, c in zip(provided, provides)})
                    for reads, provides in keys]
        solutions = solve_ilp_variants(segment_problem(arrays), variants, time_limit_s=self.time_limit_s,
                                       solver=self.solver)
        for key, sol in zip(keys, solutions):
            names = tuple(arrays.strategies[p][i].name for p, i in enumerate(sol.choice))
            self.entries[(kind, *key)] = _Entry(sol.objective, names, sol.status, sol.solver)

    def entry(self, kind: int, reads: tuple, provides: tuple) -> _Entry:
        return self.entries[(kind, reads, provides)]

    def table(self, s: int, before: tuple[tuple, ...], after: tuple[tuple, ...]) -> np.ndarray:
        """T[i, j] of segment s between the joint placements `before[i]` and `after[j]` of its two cuts;
        segments of one kind between equal state lists share one table."""
        key = (self.folded.segments[s].kind, id(before), id(after))  # equal cuts share one states tuple
        if key not in self.tables:
            table = np.full((len(before), len(after)), np.inf)
            for i, x in enumerate(before):
                for j, y in enumerate(after):
                    keys = self.keys(s, x, y)
                    if keys is not None:
                        table[i, j] = self.entry(self.folded.segments[s].kind, *keys).objective
            self.tables[key] = table
        return self.tables[key]


def _cut_states(folded: FoldedGraph, firsts: dict[int, Segment], strategies: dict[str, list]
                ) -> tuple[list[tuple[tuple[int, ...], ...]], list]:
    """The joint placements of each cut's slots, as tuples of placement codes, and the placement of each
    code. A slot's placements are those of the node providing it (read off its kind's first segment:
    position p of every segment of a kind has the same strategies) or, passed through, of the slot before."""
    codes: dict = {}  # placement -> small int (cheap to hash)
    by_node: dict[str, tuple[int, ...]] = {}
    shared: dict[tuple, tuple] = {}  # equal cuts share one states tuple
    states, before = [], []
    for seg in folded.segments[:-1]:
        slots = []
        for what, r in seg.provides:
            if what == "slot":
                slots.append(before[r])
                continue
            name = firsts[seg.kind].nodes[r]
            if name not in by_node:
                by_node[name] = tuple(codes.setdefault(s.output, len(codes)) for s in strategies[name])
                by_node[name] = tuple(dict.fromkeys(by_node[name]))  # distinct, in order of first appearance
            slots.append(by_node[name])
        key = tuple(slots)
        if key not in shared:
            shared[key] = tuple(itertools.product(*slots))
        states.append(shared[key])
        before = slots
    return states, list(codes)


def solve_folded(folded: FoldedGraph, registry: StrategyRegistry, info: Mapping, cluster: ClusterSpec,
                 mesh: MeshShape, microbatch_size: int, dtype: str = "bfloat16", *,
                 efficiency: Efficiency | None = None, time_limit_s: float = 60.0,
                 solver: str | None = None, max_cut_states: int = MAX_CUT_STATES) -> FoldedSolution:
    """The unfolded intra-op optimum, solving each kind once per pair of boundary placements and
    chaining the tables (`autoplan.solver.ilp` and `autoplan.solver.chain` docstrings). A cut with more
    than `max_cut_states` joint placements falls back to one ILP over the unfolded graph."""
    start = time.perf_counter()
    graph = folded.graph
    ctx = make_context(graph, cluster, mesh, microbatch_size, dtype, efficiency)
    firsts = {seg.kind: seg for seg in reversed(folded.segments)}
    # a kind's nodes share its strategies: ask for its first segment's only
    strategies = graph_strategies(graph, registry, info, mesh.tp, [n for nodes in folded.kind_nodes for n in nodes])
    states, placements = _cut_states(folded, firsts, strategies)
    widest = max((len(x) for x in states), default=1)
    if widest > max_cut_states:
        return _solve_unfolded(folded, registry, info, cluster, mesh, microbatch_size, dtype, efficiency,
                               time_limit_s, solver, f"a cut has {widest} joint placements (> {max_cut_states})", start)
    tables = _Tables(folded, strategies, placements, ctx, dtype, time_limit_s, solver)
    bounds = [((),), *states, ((),)]
    tables.prepare(bounds)
    chain = solve_chain([tables.table(s, bounds[s], bounds[s + 1]) for s in range(len(folded.segments))])
    cut_states = [()] + [x[i] for x, i in zip(states, chain.states)] + [()]
    assignment: dict[str, str] = {}
    picked: dict[tuple, tuple[str, ...]] = {}  # blocks of one kind between equal states: one entry
    for s, seg in enumerate(folded.segments):
        key = (seg.kind, id(seg.reads), id(seg.provides), cut_states[s], cut_states[s + 1])
        if key not in picked:
            picked[key] = tables.entry(seg.kind, *tables.keys(s, cut_states[s], cut_states[s + 1])).names
        assignment.update(zip(seg.nodes, picked[key]))
    used = {e.solver for e in tables.entries.values()}
    status = "optimal" if all(e.status == "optimal" for e in tables.entries.values()) else "feasible"
    name = next((x for x in ("highs", "cbc", "elimination") if x in used), "trivial")
    return FoldedSolution(assignment, chain.objective, status, name, "chain", len(tables.entries),
                          time.perf_counter() - start)


def _solve_unfolded(folded: FoldedGraph, registry: StrategyRegistry, info: Mapping, cluster: ClusterSpec,
                    mesh: MeshShape, microbatch_size: int, dtype: str, efficiency: Efficiency | None,
                    time_limit_s: float, solver: str | None, why: str, start: float) -> FoldedSolution:
    built = build_intra_op_problem(folded.graph, registry, info, mesh.tp, cluster, mesh, microbatch_size, dtype,
                                   efficiency=efficiency)
    sol = solve_ilp(built.problem, time_limit_s=time_limit_s, solver=solver)
    return FoldedSolution(assignment_from_choice(built, sol.choice), sol.objective, sol.status, sol.solver,
                          f"unfolded: {why}", 1, time.perf_counter() - start)
