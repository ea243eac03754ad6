"""The stage partition of identical layers, from block counts: `solver.stages`' problem where every layer has
the same t, w, a and p (a model of one repeated block under one recompute policy), without the O(pp L^2) DP.
The first layer may differ (the search's GPT-3 blocks often price it apart from the rest) where stage 0 holds at
least one layer (interleaved ranks hold v - 1 or more): it is then always stage 0's first (`counts_decide`).

A stage's time and memory then depend only on how many layers n it holds (and on the stage: its sends, its
in-flight microbatches, the embedding on the first, the head on the last; stage 0's first layer its own t, w,
a, p):

    T[s, n] = n t + overhead_s[s] + [s == 0] first.t + [s == pp-1] last.t
    M[s, n] = n w + f[s] n a + [n > 0] p + extra_bytes[s] + the ends' static, f[s] x activation and transient
              bytes (the transient the larger of p and theirs)

both nondecreasing in n. Stage s takes n in [n_min[s], cap[s]] (cap: the most layers whose memory fits). Under a
bottleneck T it can take any count in [n_min[s], hi_s(T)], hi_s(T) = the most n <= cap[s] with T[s, n] <= T, so
the first s + 1 stages can hold exactly j layers within T iff every hi_r(T) >= n_min[r] and
sum_{r <= s} n_min[r] <= j <= F_s(T) = sum_{r <= s} hi_r(T). The DP's best[s][j] is the least T among the T[r, n]
with F_s(T) >= j (F_s is nondecreasing in T): one sorted candidate list and a matrix of hi_r, O(pp L log L) in a
few array operations.

The DP breaks ties by the smallest start layer of each stage, walking back from the last: the stage ending at j
takes the most layers n with T[s, n] <= best[s][j] that it may hold and that leave the stages before it at least
their minimums (min(hi_s(best[s][j]), j - sum_{r < s} n_min[r])); that bound is reached, since best[s][j] is
feasible. With exact sums (integer t, w, a, p) the bounds equal the DP's (tests/test_stages.py); in floating
point the DP's range sums (prefix-sum differences) of the same count differ in their last bits, so where two
partitions tie exactly, the DP's choice between them followed that rounding and this one follows the counts.
"""

from __future__ import annotations

import numpy as np

from autoplan.cost_model.pipeline import MEMORY_RTOL, StageProblem

ARRAYS = ("layer_time_s", "layer_static_bytes", "layer_activation_bytes", "layer_transient_bytes")


def counts_decide(problem: StageProblem) -> bool:
    """Whether each stage's time and memory depend on its layer count alone: every layer after the first is the
    same, and the first is too or stage 0 holds at least one layer (so the first is always stage 0's)."""
    if not all(getattr(problem, a)[1:].min(initial=np.inf) == getattr(problem, a)[1:].max(initial=-np.inf)
               or problem.num_layers == 1 for a in ARRAYS):
        return False
    same_first = problem.num_layers == 1 or all(getattr(problem, a)[0] == getattr(problem, a)[1] for a in ARRAYS)
    return same_first or problem.min_layers[0] >= 1


def _end_terms(problem: StageProblem) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per stage: the seconds, the bytes before its layers' (sends' buffers, temporaries, the ends' static and
    in-flight activations) and the ends' transient bytes it adds to its layers'."""
    pp, flight = problem.num_stages, problem.in_flight
    seconds, nbytes, transient = problem.overhead_s.copy(), problem.extra_bytes.copy(), np.zeros(pp)
    for part, s in ((problem.first, 0), (problem.last, pp - 1)):
        seconds[s] += part.time_s
        nbytes[s] += part.static_bytes + flight[s] * part.activation_bytes
        transient[s] = max(transient[s], part.transient_bytes)
    return seconds, nbytes, transient


def count_tables(problem: StageProblem) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(rows, row, caps): the distinct rows T[., n] over n = 0..L layers (module docstring; the stages' differ only
    by their constant, and stage 0's where its first layer differs, `counts_decide`), each stage's row, and
    `count_caps`."""
    pp, L = problem.num_stages, problem.num_layers
    seconds, nbytes, transient = _end_terms(problem)
    first = [float(getattr(problem, a)[0]) for a in ARRAYS]
    t, w, a, p = [float(getattr(problem, name)[-1]) for name in ARRAYS]
    odd = first != [t, w, a, p]  # stage 0: the first layer, then n - 1 of the rest
    n = np.arange(L + 1, dtype=np.float64)
    keys = [(float(seconds[s]), odd and s == 0) for s in range(pp)]
    distinct = list(dict.fromkeys(keys))
    rows = np.array([np.concatenate(([c], first[0] + n[:-1] * t + c)) if own else n * t + c for c, own in distinct])
    return rows, np.array([distinct.index(k) for k in keys]), count_caps(problem, nbytes, transient)


def count_caps(problem: StageProblem, nbytes: np.ndarray | None = None, transient: np.ndarray | None = None
               ) -> np.ndarray:
    """The most layers each stage's memory M[s, n] fits (-1: not even none; L under no limit); `nbytes` and
    `transient`: `_end_terms`' (found here when not given)."""
    pp, L = problem.num_stages, problem.num_layers
    if not np.isfinite(problem.memory_limit_bytes):
        return np.full(pp, L)
    if nbytes is None or transient is None:
        _, nbytes, transient = _end_terms(problem)
    first = [float(getattr(problem, a)[0]) for a in ARRAYS]
    t, w, a, p = [float(getattr(problem, name)[-1]) for name in ARRAYS]
    n = np.arange(L + 1, dtype=np.float64)
    memory = (n * w + problem.in_flight[:, None] * (n * a) + nbytes[:, None]
              + np.maximum(np.where(n > 0, p, 0.0), transient[:, None]))
    if first != [t, w, a, p]:
        rest = n[:-1]
        peak = np.maximum(np.where(rest > 0, np.maximum(p, first[3]), first[3]), transient[0])
        memory[0, 1:] = (first[1] + rest * w + problem.in_flight[0] * (first[2] + rest * a) + nbytes[0] + peak)
    fits = memory <= problem.memory_limit_bytes * (1 + MEMORY_RTOL)  # True up to a stage's cap, then False
    return np.where(fits.all(axis=1), L, np.argmin(fits, axis=1) - 1)


def partition_counts(problem: StageProblem) -> tuple[int, ...] | None:
    """The layers of each stage in `solver.stages.partition_bounds`' partition where counts decide
    (`counts_decide`; module docstring), or None where no partition fits."""
    pp, L = problem.num_stages, problem.num_layers
    least = problem.min_layers.astype(int)
    rows, row, caps = count_tables(problem)
    if least.sum() > L or (caps < least).any():
        return None
    candidates = np.unique(rows)
    # [s, c]: the most layers stage s may hold within candidates[c] (below its least: it cannot start)
    within = np.stack([np.searchsorted(r, candidates, side="right") - 1 for r in rows])
    hi = np.minimum(within[row], caps[:, None])
    ok = np.logical_and.accumulate(hi >= least[:, None], axis=0)
    reach = np.where(ok, np.cumsum(hi, axis=0), -1)  # [s, c]: F_s(candidates[c]), nondecreasing in c
    before = np.concatenate(([0], np.cumsum(least)))
    counts, end = [0] * pp, L
    for s in range(pp - 1, -1, -1):
        at = int(np.searchsorted(reach[s], end, side="left"))  # best[s][end] = candidates[at]
        if at == len(candidates):
            return None
        counts[s] = end if s == 0 else min(int(hi[s, at]), end - int(before[s]))
        end -= counts[s]
    return tuple(counts)


def counts_fit(problem: StageProblem) -> bool:
    """Whether any partition meets the memory limit, time aside, where counts decide: every stage's least
    layers fit (least <= cap) and the caps hold every layer (any counts in those boxes that add up to L do)."""
    least, caps = problem.min_layers.astype(int), count_caps(problem)
    return bool((caps >= least).all() and least.sum() <= problem.num_layers <= caps.sum())
