"""Pipeline stage partition: contiguous layer ranges that minimise the slowest stage under a memory limit.

Arrays only (no torch, no graph). Per layer i in 0..L-1:

    t[i]   seconds per microbatch (forward + backward + recompute + communication of the layer)
    w[i]   static bytes: model states, which do not grow with the microbatches in flight
    a[i]   activation bytes per microbatch in flight
    p[i]   transient bytes needed only while the layer runs (full recompute's working set)

The first stage also carries `first` (the embeddings) and the last stage `last` (final norm, head,
loss), each a `Part` with the same four fields. Stage s of pp, holding layers [i, j) with j - i >= n_min[s]
(`min_layers`: one each by default; the step model lets the first and last stages hold none, and an
interleaved rank v chunks' worth, `autoplan.validity.stage_min_layers`):

    time(s, i, j)   = sum t[i:j] + overhead_s[s] + [s == 0] first.t + [s == pp-1] last.t
    memory(s, i, j) = sum w[i:j] + f[s] * sum a[i:j] + max p[i:j] + extra_bytes[s]
                      + [s == 0] (first.w + f[0] first.a) + [s == pp-1] (last.w + f[s] last.a)
                      (the transient max also takes first.p / last.p on those stages)

with f[s] the microbatches stage s keeps in flight (1F1B: min(m, pp - s)). The partition minimises
max_s time(s) subject to memory(s) <= limit for every s.

Dynamic program over (stage, end layer), O(pp L^2), vectorised over the start and end layers (stage s only
over the starts and ends that leave every stage its least layers; the range maxima of p from a sparse table):

    best[0][j] = time(0, 0, j)                                      if j >= n_min[0] and memory(0, 0, j) fits
    best[s][j] = min_{i <= j - n_min[s]} max(best[s-1][i], time(s, i, j))   over i where memory(s, i, j) fits

Memory is compared with a relative tolerance of MEMORY_RTOL. The answer is best[pp-1][L]; ties go to the smallest start layer of each stage, walking back from the
last, so the result is deterministic (`partition_bounds`: the bounds alone, as the search reads them). Where every
layer is the same, the same partition is found from the stages' layer counts instead (`solver.stage_counts`).
`partition_brute_force` tries every composition (tests only).
`partition_fits` says, in O(pp L), whether any partition meets the memory limit: the search asks it
before pricing a configuration, so that one that cannot fit costs no DP and no pricing.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from autoplan.cost_model.pipeline import MEMORY_RTOL, StageProblem
from autoplan.errors import AutoplanError
from autoplan.solver.stage_counts import counts_decide, counts_fit, partition_counts

@dataclass(frozen=True)
class StageBounds:
    """Stage s holds layers [bounds[s], bounds[s + 1])."""

    bounds: tuple[int, ...]

    @property
    def ranges(self) -> tuple[tuple[int, int], ...]:
        return tuple(zip(self.bounds[:-1], self.bounds[1:]))


@dataclass(frozen=True)
class StagePartition:
    """Stage s holds layers [bounds[s], bounds[s + 1]); its time and memory as the problem defines them."""

    bounds: tuple[int, ...]
    stage_time_s: tuple[float, ...]
    stage_memory_bytes: tuple[float, ...]

    @property
    def bottleneck_s(self) -> float:
        return max(self.stage_time_s)

    @property
    def ranges(self) -> tuple[tuple[int, int], ...]:
        return tuple(zip(self.bounds[:-1], self.bounds[1:]))


def evaluate_partition(problem: StageProblem, bounds: Sequence[int]) -> StagePartition:
    """Times and memory of a given partition (bounds[0] = 0 <= ... <= bounds[pp] = L, stage s holding at
    least min_layers[s])."""
    pp, L = problem.num_stages, problem.num_layers
    bounds = tuple(int(b) for b in bounds)
    if (len(bounds) != pp + 1 or bounds[0] != 0 or bounds[-1] != L
            or any(c - b < n for b, c, n in zip(bounds, bounds[1:], problem.min_layers))):
        raise AutoplanError(f"bounds {list(bounds)} must rise from 0 to {L} in {pp} steps of at least "
                            f"{[int(n) for n in problem.min_layers]} layers")
    ranges = list(zip(bounds[:-1], bounds[1:]))
    return StagePartition(bounds, tuple(problem.stage_time_s(s, i, j) for s, (i, j) in enumerate(ranges)),
                          tuple(problem.stage_memory_bytes(s, i, j) for s, (i, j) in enumerate(ranges)))


def _range_tables(problem: StageProblem, memory: bool = True) -> tuple:
    """[i, j] tables over start i and end j (0..L): sums of t, w, a over [i, j) and max of p (`memory` False:
    t only, the others None)."""

    def sums(values: np.ndarray) -> np.ndarray:
        prefix = np.concatenate(([0.0], np.cumsum(values)))
        return prefix[None, :] - prefix[:, None]

    if not memory:
        return sums(problem.layer_time_s), None, None, None
    return (sums(problem.layer_time_s), sums(problem.layer_static_bytes), sums(problem.layer_activation_bytes),
            _range_peaks(problem.layer_transient_bytes))


def _range_peaks(values: np.ndarray) -> np.ndarray:
    """[i, j] = max(values[i:j]) for j > i, 0 elsewhere (values are >= 0), from a sparse table: level k holds
    the maxima of the 2^k values from each start, and [i, j) is covered by the two blocks of the largest
    2^k <= j - i that start at i and end at j (a few array operations instead of one per start)."""
    L = len(values)
    levels = np.zeros((max(1, L.bit_length()), L + 1))
    levels[0, :L] = values
    for k in range(1, levels.shape[0]):
        half = 1 << (k - 1)
        levels[k, :L + 1 - half] = np.maximum(levels[k - 1, :L + 1 - half], levels[k - 1, half:])
    start, end = np.triu_indices(L + 1, 1)
    k = np.array([n.bit_length() - 1 for n in range(L + 1)])[end - start]
    peak = np.zeros((L + 1, L + 1))
    peak[start, end] = np.maximum(levels[k, start], levels[k, end - (1 << k)])
    return peak


def _with_ends(problem: StageProblem, s: int, time_s, memory, transient):
    """Stage s's seconds, memory before its activations, and transient bytes: its ranges' sums and peak
    plus what the stage adds itself (sends, temporaries, the embedding on the first, the head on the last;
    nothing is added where that is 0, which would leave every sum, all >= 0, as it is)."""
    flight = problem.in_flight[s]
    if problem.overhead_s[s]:
        time_s = time_s + problem.overhead_s[s]
    if problem.extra_bytes[s]:
        memory = memory + problem.extra_bytes[s]
    for part, here in ((problem.first, s == 0), (problem.last, s == problem.num_stages - 1)):
        if here:
            time_s = time_s + part.time_s
            memory = memory + part.static_bytes + flight * part.activation_bytes
            transient = np.maximum(transient, part.transient_bytes)
    return time_s, memory, transient


def partition_stages(problem: StageProblem) -> StagePartition | None:
    """The partition minimising the slowest stage under the memory limit (module docstring), or None
    when no partition fits (or there are fewer layers than the stages' minimums)."""
    found = partition_bounds(problem)
    return None if found is None else evaluate_partition(problem, found.bounds)


def partition_bounds(problem: StageProblem) -> StageBounds | None:
    """`partition_stages`' partition, its bounds alone: the step model sums its stages from prefix sums
    itself, so the search skips the pp slices per stage that `evaluate_partition` takes. Identical layers
    (one repeated block under one recompute policy) are partitioned from their counts
    (`solver.stage_counts`), the rest by the DP over boundaries (`boundary_dp`)."""
    if counts_decide(problem):
        counts = partition_counts(problem)
        return None if counts is None else StageBounds(tuple(int(b) for b in np.cumsum((0,) + counts)))
    return boundary_dp(problem)


def boundary_dp(problem: StageProblem) -> StageBounds | None:
    """The DP over (stage, end layer) of the module docstring, O(pp L^2)."""
    pp, L = problem.num_stages, problem.num_layers
    if problem.min_layers.sum() > L:
        return None
    tables = _range_tables(problem, np.isfinite(problem.memory_limit_bytes))
    span = np.arange(L + 1)[None, :] - np.arange(L + 1)[:, None]  # [i, j]: j - i layers
    best = np.full(L + 1, np.inf)
    best[0] = 0.0
    choice = np.zeros((pp, L + 1), dtype=np.int64)
    before = np.concatenate(([0], np.cumsum(problem.min_layers))).astype(int)  # least layers of stages < s
    long_enough = {n: span >= n for n in set(problem.min_layers.tolist())}  # [i, j]: j - i >= n, per least n
    for s in range(pp):
        # stage s starts where stages < s can end and ends where stages > s can still hold their least: the
        # rest of the [i, j] table is unfit or unreachable (inf), so its rows and columns are left out
        rows = slice(before[s], L - (before[pp] - before[s]) + 1)
        cols = slice(before[s + 1], L - (before[pp] - before[s + 1]) + 1)
        candidate = _candidates(problem, s, [t[rows, cols] if t is not None else 0.0 for t in tables],
                                long_enough[problem.min_layers[s]][rows, cols], best[rows])
        picked = np.argmin(candidate, axis=0)
        choice[s, cols] = picked + rows.start
        best = np.full(L + 1, np.inf)
        best[cols] = candidate[picked, np.arange(candidate.shape[1])]
    if not np.isfinite(best[L]):
        return None
    bounds = [L]
    for s in range(pp - 1, -1, -1):
        bounds.append(int(choice[s][bounds[-1]]))
    return StageBounds(tuple(bounds[::-1]))


def _candidates(problem: StageProblem, s: int, tables: list, long_enough: np.ndarray, best: np.ndarray) -> np.ndarray:
    """max(best[i], time(s, i, j)) over a band of starts i (rows) and ends j (columns), inf where stage s
    cannot hold [i, j): fewer layers than its least (`long_enough` False), or (under a finite limit) more
    memory than the limit."""
    times, static, act, peak = tables
    time_s, memory, transient = _with_ends(problem, s, times, static, peak)
    fits = long_enough
    if np.isfinite(problem.memory_limit_bytes):  # without a limit (the fastest partition) every range fits
        fits = fits & (memory + problem.in_flight[s] * act + transient
                       <= problem.memory_limit_bytes * (1 + MEMORY_RTOL))
    return np.where(fits, np.maximum(best[:, None], time_s), np.inf)


def partition_fits(problem: StageProblem) -> bool:
    """Whether any partition meets the memory limit, time aside: whether `partition_stages` finds one, in
    O(pp L). Stage by stage, each takes the longest range that fits, leaving the later stages their
    minimums; a stage that starts later holds a sub-range of what it could have held, so reaching
    further never hurts and the greedy walk is exact. Where counts decide, from the stages' caps in O(1) array
    operations (`stage_counts.counts_fit`)."""
    if counts_decide(problem):
        return counts_fit(problem)
    pp, L = problem.num_stages, problem.num_layers
    later = np.concatenate((np.cumsum(problem.min_layers[::-1])[::-1], [0.0]))  # minimums of stages s..pp-1
    if later[0] > L:
        return False
    static, act = (np.concatenate(([0.0], np.cumsum(a))) for a in (problem.layer_static_bytes,
                                                                   problem.layer_activation_bytes))
    limit, start = problem.memory_limit_bytes * (1 + MEMORY_RTOL), 0
    for s in range(pp):
        cap = L - int(later[s + 1])  # the later stages' minimums stay theirs: ends past cap are not tried
        if cap < start:
            return False
        ends = np.arange(start, cap + 1)
        peak = np.concatenate(([0.0], np.maximum.accumulate(problem.layer_transient_bytes[start:cap])))
        _, memory, transient = _with_ends(problem, s, 0.0, static[ends] - static[start], peak)
        fits = memory + problem.in_flight[s] * (act[ends] - act[start]) + transient <= limit  # True, then False
        end = cap if fits.all() else start + int(np.argmin(fits)) - 1
        if end - start < problem.min_layers[s]:
            return False
        start = end
    return start == L


def partition_brute_force(problem: StageProblem) -> StagePartition | None:
    """Every composition of L layers into pp stages of at least min_layers each (tests only); ties: the first
    found."""
    pp, L = problem.num_stages, problem.num_layers
    best: StagePartition | None = None
    for cuts in itertools.combinations_with_replacement(range(L + 1), pp - 1):
        bounds = (0, *cuts, L)
        if any(c - b < n for b, c, n in zip(bounds, bounds[1:], problem.min_layers)):
            continue
        candidate = evaluate_partition(problem, bounds)
        if any(m > problem.memory_limit_bytes * (1 + MEMORY_RTOL) for m in candidate.stage_memory_bytes):
            continue
        if best is None or candidate.bottleneck_s < best.bottleneck_s:
            best = candidate
    return best
