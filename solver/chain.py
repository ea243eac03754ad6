"""The chain DP over the segments of a folded graph (TAPAS folding over Alpa's intra-op ILP).

A folded graph is a sequence of segments 0..K-1 (prefix, blocks, glue, suffix). Cut c lies after
segment c; its state x_c in {0, .., n_c - 1} stands for the placements of every tensor that crosses
it. Segment s costs T_s[x_{s-1}, x_s]: its best intra-op choice given the placements it reads
(x_{s-1}) and the placements it must provide (x_s), +inf where that pair is impossible. With one
empty state before the first and after the last segment (n_{-1} = n_{K-1} = 1):

    minimise   sum_{s=0}^{K-1} T_s[x_{s-1}, x_s]      over x_0, .., x_{K-2}

solved forward by min-plus products with back-pointers,

    V_{-1} = [0],   V_s[j] = min_i V_{s-1}[i] + T_s[i, j],   objective = V_{K-1}[0],

in O(sum_s n_{s-1} n_s). Ties go to the lowest state index, so the answer is deterministic.
Arrays only: no graph, no torch (STYLE.md, "keep graphs out of solvers").
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from autoplan.errors import AutoplanError, InfeasibleError


@dataclass(frozen=True)
class ChainSolution:
    objective: float  # sum of the chosen table entries
    states: tuple[int, ...]  # x_0 .. x_{K-2}: the state chosen at each cut


def _check_tables(tables: Sequence[np.ndarray]) -> list[np.ndarray]:
    if not tables:
        raise AutoplanError("the chain needs at least one segment table")
    checked = [np.asarray(t, dtype=np.float64) for t in tables]
    seen: set[int] = set()  # a table repeated along the chain (one kind, many blocks) is checked once
    for s, table in enumerate(checked):
        if id(table) in seen:
            continue
        seen.add(id(table))
        if table.ndim != 2 or 0 in table.shape:
            raise AutoplanError(f"segment {s}: table must be a non-empty 2-D array, got shape {table.shape}")
        if np.isnan(table).any() or (table == -np.inf).any():
            raise AutoplanError(f"segment {s}: table entries must be numbers or +inf, got {table.tolist()}")
    if checked[0].shape[0] != 1 or checked[-1].shape[1] != 1:
        raise AutoplanError(f"the first table must have 1 row and the last 1 column, got shapes "
                            f"{checked[0].shape} and {checked[-1].shape}")
    for s in range(1, len(checked)):
        if checked[s - 1].shape[1] != checked[s].shape[0]:
            raise AutoplanError(f"cut {s - 1}: segment {s - 1} provides {checked[s - 1].shape[1]} states but segment "
                                f"{s} reads {checked[s].shape[0]}")
    return checked


def solve_chain(tables: Sequence[np.ndarray]) -> ChainSolution:
    """The cheapest state per cut (module docstring); InfeasibleError when every path is +inf."""
    checked = _check_tables(tables)
    value = np.zeros(1)
    back: list[np.ndarray] = []
    for table in checked:
        total = value[:, None] + table  # [i, j]: reach state i before, then pay T[i, j]
        best = np.argmin(total, axis=0)  # the first minimum: lowest state index on ties
        back.append(best)
        value = total[best, np.arange(table.shape[1])]
    if not np.isfinite(value[0]):
        raise InfeasibleError("no sequence of boundary placements is feasible: every path through the segment "
                              "tables has an infinite entry")
    states = [0]
    for best in reversed(back[1:]):
        states.append(int(best[states[-1]]))
    return ChainSolution(float(value[0]), tuple(reversed(states[1:])))


def chain_cost(tables: Sequence[np.ndarray], states: Sequence[int]) -> float:
    """sum_s T_s[x_{s-1}, x_s] of given cut states."""
    full = (0, *states, 0)
    return float(sum(np.asarray(t)[full[s], full[s + 1]] for s, t in enumerate(tables)))


def solve_chain_brute_force(tables: Sequence[np.ndarray]) -> ChainSolution:
    """Try every state sequence (for tests on short chains); ties go to the lexicographically first."""
    checked = _check_tables(tables)
    best, best_cost = None, np.inf
    for states in itertools.product(*(range(t.shape[1]) for t in checked[:-1])):
        cost = chain_cost(checked, states)
        if cost < best_cost:
            best, best_cost = states, cost
    if best is None:
        raise InfeasibleError("no sequence of boundary placements is feasible")
    return ChainSolution(float(best_cost), tuple(best))
