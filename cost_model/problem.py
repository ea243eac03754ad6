"""The intra-op sharding problem as plain arrays: nodes with strategy costs, edges with resharding costs.

    node v:  k_v strategies; cost c_v[k] (s), memory m_v[k] (bytes), weight w_v (how many graph
             nodes it stands for after folding)
    edge e:  (u, v) with a cost matrix C_e of shape [k_u, k_v] (s) and a weight w_e

    objective(choice) = sum_v w_v c_v[choice_v] + sum_e w_e C_e[choice_u, choice_v]
    memory(choice)    = sum_v w_v m_v[choice_v]          (<= memory_budget_bytes when one is given)

A `ProblemVariant` changes a problem without copying it: costs d_v added to some nodes (objective +=
sum_v d_v[choice_v]) and some nodes restricted to some of their strategies. A folded graph's block is
one problem solved under one variant per pair of boundary placements (`autoplan.solver.ilp`).

No graph, no torch: the solver sees only these arrays (STYLE.md, "keep graphs out of solvers").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np

from autoplan.errors import AutoplanError


def _frozen_array(values, ndim: int, what: str, check: bool = True) -> np.ndarray:
    """A read-only float64 copy of `values`; `check=False` leaves the finite, >= 0 test to the caller
    (`_check_entries` tests many arrays at once: a block problem has ~70 of them)."""
    array = np.array(values, dtype=np.float64)
    if array.ndim != ndim:
        raise AutoplanError(f"{what} must be {ndim}-dimensional, got shape {array.shape}")
    if check and array.size and not (array.min() >= 0 and array.max() < np.inf):  # NaN fails both comparisons
        raise AutoplanError(f"{what} must be finite and >= 0, got {array.tolist()}")
    array.setflags(write=False)
    return array


def _check_entries(arrays: Sequence[np.ndarray], whats: Sequence[str]) -> None:
    """Every entry of every array finite and >= 0, tested in one pass; the first culprit named."""
    flat = np.concatenate([a.ravel() for a in arrays]) if arrays else np.zeros(0)
    if flat.size and not (flat.min() >= 0 and flat.max() < np.inf):  # NaN fails both comparisons
        for array, what in zip(arrays, whats):
            _frozen_array(array, array.ndim, what)


@dataclass(frozen=True, eq=False)
class IntraOpProblem:
    """Arrays of one intra-op ILP (module docstring); validated and made read-only at construction."""

    node_names: tuple[str, ...]
    node_costs_s: tuple[np.ndarray, ...]
    node_memory_bytes: tuple[np.ndarray, ...]
    node_weights: tuple[float, ...]
    edges: tuple[tuple[int, int], ...]
    edge_costs_s: tuple[np.ndarray, ...]
    edge_weights: tuple[float, ...]
    memory_budget_bytes: float | None = None

    def __post_init__(self) -> None:
        n = len(self.node_names)
        if not (len(self.node_costs_s) == len(self.node_memory_bytes) == len(self.node_weights) == n):
            raise AutoplanError(f"problem has {n} node names but {len(self.node_costs_s)} cost arrays, "
                                f"{len(self.node_memory_bytes)} memory arrays and {len(self.node_weights)} weights")
        costs = tuple(_frozen_array(c, 1, f"node {name!r} costs", check=False)
                      for name, c in zip(self.node_names, self.node_costs_s))
        memory = tuple(_frozen_array(m, 1, f"node {name!r} memory", check=False)
                       for name, m in zip(self.node_names, self.node_memory_bytes))
        for name, c, m in zip(self.node_names, costs, memory):
            if c.shape[0] == 0 or c.shape != m.shape:
                raise AutoplanError(f"node {name!r} needs >= 1 strategy and as many memory entries as costs; "
                                    f"got {c.shape[0]} costs and {m.shape[0]} memory entries")
        if not (len(self.edges) == len(self.edge_costs_s) == len(self.edge_weights)):
            raise AutoplanError(f"problem has {len(self.edges)} edges but {len(self.edge_costs_s)} cost matrices "
                                f"and {len(self.edge_weights)} weights")
        edges = tuple((int(u), int(v)) for u, v in self.edges)
        matrices = []
        for (u, v), matrix in zip(edges, self.edge_costs_s):
            if not (0 <= u < n and 0 <= v < n) or u == v:
                raise AutoplanError(f"edge ({u}, {v}) must join two different nodes among 0..{n - 1}")
            matrix = _frozen_array(matrix, 2, f"edge ({u}, {v}) costs", check=False)
            if matrix.shape != (costs[u].shape[0], costs[v].shape[0]):
                raise AutoplanError(f"edge ({u}, {v}) cost matrix has shape {matrix.shape}, expected "
                                    f"({costs[u].shape[0]}, {costs[v].shape[0]}) strategies")
            matrices.append(matrix)
        _check_entries(costs + memory + tuple(matrices),
                       [f"node {name!r} costs" for name in self.node_names]
                       + [f"node {name!r} memory" for name in self.node_names]
                       + [f"edge {e} costs" for e in edges])
        for what, weights in (("node", self.node_weights), ("edge", self.edge_weights)):
            if any(not np.isfinite(w) or w <= 0 for w in weights):
                raise AutoplanError(f"{what} weights must be finite and > 0, got {list(weights)}")
        if self.memory_budget_bytes is not None and not self.memory_budget_bytes >= 0:
            raise AutoplanError(f"memory_budget_bytes must be >= 0 or None, got {self.memory_budget_bytes!r}")
        object.__setattr__(self, "node_names", tuple(self.node_names))
        object.__setattr__(self, "node_costs_s", costs)
        object.__setattr__(self, "node_memory_bytes", memory)
        object.__setattr__(self, "node_weights", tuple(float(w) for w in self.node_weights))
        object.__setattr__(self, "edges", edges)
        object.__setattr__(self, "edge_costs_s", tuple(matrices))
        object.__setattr__(self, "edge_weights", tuple(float(w) for w in self.edge_weights))

    @property
    def num_nodes(self) -> int:
        return len(self.node_names)

    def num_strategies(self) -> tuple[int, ...]:
        return tuple(c.shape[0] for c in self.node_costs_s)

    def check_choice(self, choice: Sequence[int]) -> None:
        sizes = self.num_strategies()
        if len(choice) != len(sizes) or any(not 0 <= int(k) < s for k, s in zip(choice, sizes)):
            raise AutoplanError(f"choice {list(choice)} does not pick one of {list(sizes)} strategies per node")

    def objective_s(self, choice: Sequence[int]) -> float:
        """sum_v w_v c_v[choice_v] + sum_e w_e C_e[choice_u, choice_v], in seconds."""
        self.check_choice(choice)
        total = sum(w * c[k] for w, c, k in zip(self.node_weights, self.node_costs_s, choice))
        total += sum(w * m[choice[u], choice[v]] for (u, v), m, w in zip(self.edges, self.edge_costs_s, self.edge_weights))
        return float(total)

    def objectives_s(self, choices: np.ndarray) -> np.ndarray:
        """`objective_s` of each row of `choices` (rows x nodes, valid indices), by array indexing."""
        total = np.zeros(len(choices))
        for v, (w, c) in enumerate(zip(self.node_weights, self.node_costs_s)):
            total += w * c[choices[:, v]]
        for (u, v), m, w in zip(self.edges, self.edge_costs_s, self.edge_weights):
            total += w * m[choices[:, u], choices[:, v]]
        return total

    def memory_bytes(self, choice: Sequence[int]) -> float:
        """sum_v w_v m_v[choice_v]."""
        self.check_choice(choice)
        return float(sum(w * m[k] for w, m, k in zip(self.node_weights, self.node_memory_bytes, choice)))

    def min_memory_bytes(self) -> float:
        """The smallest memory any choice reaches (the constraint is separable over nodes)."""
        return float(sum(w * m.min() for w, m in zip(self.node_weights, self.node_memory_bytes)))


@dataclass(frozen=True, eq=False)
class ProblemVariant:
    """Costs (seconds per strategy) added to some nodes; some nodes restricted to the strategy indices
    in `allowed`. Node indices and strategy indices are those of the problem it varies."""

    extra_costs_s: Mapping[int, np.ndarray] = field(default_factory=dict)
    allowed: Mapping[int, tuple[int, ...]] = field(default_factory=dict)

    def check(self, problem: IntraOpProblem) -> None:
        sizes = problem.num_strategies()
        for v, extra in self.extra_costs_s.items():
            if not 0 <= v < len(sizes) or np.shape(extra) != (sizes[v],):
                raise AutoplanError(f"variant adds costs of shape {np.shape(extra)} to node {v}; the problem has "
                                    f"{len(sizes)} nodes and node {v} has {sizes[v] if 0 <= v < len(sizes) else '?'} "
                                    f"strategies")
        for v, allowed in self.allowed.items():
            if not 0 <= v < len(sizes) or not allowed or any(not 0 <= i < sizes[v] for i in allowed):
                raise AutoplanError(f"variant allows strategies {list(allowed)} of node {v}: it needs at least one "
                                    f"index among the node's strategies")

    def extra_s(self, choice: Sequence[int]) -> float:
        """sum_v d_v[choice_v]."""
        return float(sum(extra[choice[v]] for v, extra in self.extra_costs_s.items()))
