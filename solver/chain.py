"""The chain DP over the segments of a folded graph (TAPAS folding over Alpa's intra-op ILP).

A folded graph is a sequence of segments 0..K-1 (prefix, blocks, glue, suffix). Cut c lies after
segment c; its state x_c in {0, .., n_c - 1} stands for the placements of every tensor that crosses
it. Segment s costs T_s[x_{s-1}, x_s]: its best intra-op choice given the placements it reads
(x_{s-1}) and the placements it must provide (x_s), +inf where that pair is impossible. With one
empty state before the first and after the last segment (n_{-1} = n_{K-1} = 1):

    minimise   sum_{s=0}^{K-1} T_s[x_{s-1}, x_s]      over x_0, .., x_{K-2}

solved forward by min-plus products with back-pointers,

    V_{-1} = [0],   V_s[j] = min_i V_{s-1}[i] + T_s[i, j],   objective = V_{K-1}[0],

in O(sum_s n_{s-1} n_s). A run of k segments sharing one square table T (the blocks of one kind
between equal cuts) is chained by min-plus powers instead: T^(2^a) by repeated squaring with the
midpoint of each entry, one step per binary digit of k, and the states inside a power read back
from the midpoints; O(n^3 log k) array work and O(k) integer lookups, so the chain's time stays flat
in depth. Ties go to the lowest state index (the first midpoint), so the answer is deterministic.
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
    steps: list[tuple[np.ndarray, int, list]] = []  # (back-pointers, power a, the run's midpoints)
    for table, count in _runs(checked):
        square = table.shape[0] == table.shape[1] and table.shape[0] <= MAX_DOUBLING_STATES
        powers = _powers(table, count) if square and count >= MIN_DOUBLING_RUN else [(table, None)]
        for a in _exponents(count) if len(powers) > 1 else [0] * count:
            total = value[:, None] + powers[a][0]  # [i, j]: reach state i before, then pay (T^(2^a))[i, j]
            best = np.argmin(total, axis=0)  # the first minimum: lowest state index on ties
            steps.append((best, a, powers))
            value = total[best, np.arange(total.shape[1])]
    if not np.isfinite(value[0]):
        raise InfeasibleError("no sequence of boundary placements is feasible: every path through the segment "
                              "tables has an infinite entry")
    after = [0]  # the state after each segment, last segment first
    for best, a, powers in reversed(steps):
        before = int(best[after[-1]])
        after += reversed(_inner_states(powers, a, before, after[-1]))
        after.append(before)
    return ChainSolution(float(value[0]), tuple(reversed(after[1:-1])))


MIN_DOUBLING_RUN = 4  # a run of this many equal tables is chained by powers (below: one step per table)
MAX_DOUBLING_STATES = 27  # powers cost n^3 per squaring: only for cuts with few states


def _runs(tables: list[np.ndarray]) -> list[tuple[np.ndarray, int]]:
    """Maximal runs of one table object repeated along the chain (one block kind between equal cuts)."""
    runs: list[tuple[np.ndarray, int]] = []
    for table in tables:
        if runs and runs[-1][0] is table:
            runs[-1] = (table, runs[-1][1] + 1)
        else:
            runs.append((table, 1))
    return runs


def _powers(table: np.ndarray, count: int) -> list[tuple[np.ndarray, np.ndarray | None]]:
    """Min-plus powers T^(2^a) for 2^a <= count, each with its midpoints: P_(a+1)[i, j] = min_m P_a[i, m]
    + P_a[m, j] and M_(a+1)[i, j] = the first minimising m. A run of k equal tables then costs
    O(n^3 log k) array work instead of k steps (the chain's time stays flat in depth)."""
    powers: list[tuple[np.ndarray, np.ndarray | None]] = [(table, None)]
    while 2 ** len(powers) <= count:
        last = powers[-1][0]
        total = last[:, :, None] + last[None, :, :]  # [i, m, j]
        middle = np.argmin(total, axis=1)
        powers.append((np.take_along_axis(total, middle[:, None, :], axis=1)[:, 0, :], middle))
    return powers


def _exponents(count: int) -> list[int]:
    """The powers of two that sum to `count`, largest first."""
    return [a for a in range(count.bit_length() - 1, -1, -1) if count >> a & 1]


def _inner_states(powers: list, a: int, i: int, j: int) -> list[int]:
    """The 2^a - 1 states inside a step of T^(2^a) from state i to state j, in chain order."""
    if a == 0:
        return []
    m = int(powers[a][1][i, j])
    return _inner_states(powers, a - 1, i, m) + [m] + _inner_states(powers, a - 1, m, j)


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
