"""Exact min-sum by variable elimination, for many variants of one intra-op problem at once.

The intra-op objective without a memory budget is a sum of unary and pairwise terms over the free
nodes (after `autoplan.solver.ilp._reduce`):

    minimise  f(x) = sum_v c_v[x_v] + sum_(u,v) C_uv[x_u, x_v]       x_v in {0, .., k_v - 1}

Variable elimination (non-serial dynamic programming, Bertele and Brioschi 1972) removes one node x
at a time: the factors that mention x are summed over the union S of their other nodes and x is
minimised out,

    g(x_S) = min_x sum_{factors F with x in F} F(x, x_S),     arg(x_S) = the minimising x,

and g replaces them. After every node is gone the remaining constant is the optimum; walking the
order backwards, each x = arg(x_S) of the nodes already fixed gives an optimal choice. The work is
sum over steps of prod_{v in S + x} k_v: tiny for a transformer block (a chain with residual edges,
|S| <= 2), exponential in the width of the order on dense graphs, so `elimination_plan` refuses an
order whose largest table exceeds `max_table`, and the caller falls back to the ILP.

Variants. A block of a folded graph is solved once per pair of boundary placements: the pairwise
terms stay, unary terms change (costs added) and some strategies are forbidden (cost +inf). Every
factor carries a leading variant axis (size 1 for the shared pair terms), so one elimination pass
solves all V variants with numpy broadcasting instead of V solver runs. Ties go to the lowest
strategy index. Arrays only: no graph, no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

MAX_TABLE = 1 << 16  # entries of the largest intermediate table per variant before the ILP takes over


@dataclass(frozen=True)
class EliminationPlan:
    """An order of the free nodes and, per step, the other nodes of the new factor (sorted)."""

    order: tuple[int, ...]
    scopes: tuple[tuple[int, ...], ...]
    largest_table: int


def elimination_plan(sizes: dict[int, int], pairs: Sequence[tuple[int, int]],
                     max_table: int = MAX_TABLE) -> EliminationPlan | None:
    """Greedy min-fill order (ties: fewest neighbours, then lowest index) over the interaction graph
    of `pairs`; None when some step's table (the node and its neighbours) exceeds `max_table`."""
    neighbours: dict[int, set[int]] = {v: set() for v in sizes}
    for u, v in pairs:
        neighbours[u].add(v)
        neighbours[v].add(u)
    order, scopes, largest = [], [], 1

    def fill(v: int) -> int:
        near = neighbours[v]  # pairs of v's neighbours not yet joined, each counted from both ends
        return sum(len(near - neighbours[a]) - 1 for a in near) // 2

    while neighbours:
        v = min(neighbours, key=lambda x: (fill(x), len(neighbours[x]), x))
        scope = tuple(sorted(neighbours.pop(v)))
        table = sizes[v] * math.prod(sizes[u] for u in scope)
        if table > max_table:
            return None
        largest = max(largest, table)
        for a in scope:  # the new factor joins v's neighbours to each other
            neighbours[a].discard(v)
            neighbours[a].update(b for b in scope if b != a)
        order.append(v)
        scopes.append(scope)
    return EliminationPlan(tuple(order), tuple(scopes), largest)


def _aligned(scope: tuple[int, ...], table: np.ndarray, joint: tuple[int, ...]) -> np.ndarray:
    """`table` (axes: variant, then `scope`) with its node axes moved to their places in `joint` and
    size-1 axes for the nodes of `joint` it lacks, ready to broadcast."""
    where = [joint.index(v) for v in scope]
    if where != sorted(where):
        perm = sorted(range(len(scope)), key=where.__getitem__)
        table = table.transpose(0, *(1 + i for i in perm))
        where = sorted(where)
    shape = [table.shape[0]] + [1] * len(joint)
    for place, size in zip(where, table.shape[1:]):
        shape[1 + place] = size
    return table.reshape(shape)


def solve_by_elimination(plan: EliminationPlan, unary: dict[int, np.ndarray],
                         pairs: dict[tuple[int, int], np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Minimise the module docstring's objective for every variant.

    unary[v]: (V, k_v) costs per variant (+inf forbids); pairs[(u, v)]: (k_u, k_v), shared by all.
    Returns (objective (V,), choice (V, n) with choice[:, v] for every node of `unary`; other
    columns 0), n = 1 + the largest node index."""
    variants = next(iter(unary.values())).shape[0]
    factors: list[tuple[tuple[int, ...], np.ndarray]] = [((v,), c) for v, c in unary.items()]
    factors += [((u, v), m[None]) for (u, v), m in pairs.items()]
    constant = np.zeros(variants)
    steps = []
    for v, scope in zip(plan.order, plan.scopes):
        joint = (v, *scope)
        mine = [f for f in factors if v in f[0]]
        factors = [f for f in factors if v not in f[0]]
        total = sum(_aligned(s, t, joint) for s, t in mine)
        total = np.broadcast_to(total, (variants, *(total.shape[1:])))
        steps.append((v, scope, np.argmin(total, axis=1)))  # (V, *scope)
        reduced = np.min(total, axis=1)
        if scope:
            factors.append((scope, reduced))
        else:
            constant = constant + reduced
    choice = np.zeros((variants, 1 + max(unary)), dtype=np.int64)
    rows = np.arange(variants)
    for v, scope, arg in reversed(steps):
        choice[:, v] = arg[(rows, *(choice[:, u] for u in scope))]
    return constant, choice
