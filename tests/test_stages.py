"""Stage partition DP and pipeline formulas (tier 1: arrays only), against brute force."""

from __future__ import annotations

import numpy as np
import pytest

from autoplan.cluster import parse_cluster
from autoplan.cost_model.pipeline import (chunk_ranges, chunk_sizes, in_flight_microbatches, p2p_per_microbatch_s,
                                          pipeline_time_s)
from autoplan.errors import AutoplanError, ConfigError
from autoplan.mesh import MeshShape
from autoplan.cost_model.pipeline import Part, StageProblem
from autoplan.solver.stage_counts import counts_decide
from autoplan.solver.stages import (boundary_dp, evaluate_partition, partition_bounds, partition_brute_force,
                                    partition_fits, partition_stages)
from autoplan.validity import pipeline_problem, stage_layers_text, stage_min_layers, stages_problem


def random_problem(rng: np.random.Generator, layers: int, pp: int, tight: float) -> StageProblem:
    """Random layers; the memory limit a fraction `tight` of the way from the smallest to the largest need."""
    in_flight = np.array([float(min(4, pp - s)) for s in range(pp)])
    problem = StageProblem(rng.uniform(0.5, 2.0, layers), rng.uniform(0, 3, layers), rng.uniform(0, 1, layers),
                           rng.uniform(0, 2, layers) * rng.integers(0, 2), in_flight, np.inf,
                           Part(rng.uniform(0, 2), rng.uniform(0, 3), rng.uniform(0, 1)),
                           Part(rng.uniform(0, 3), rng.uniform(0, 3), rng.uniform(0, 2), rng.uniform(0, 1)),
                           rng.uniform(0, 0.1, pp), rng.uniform(0, 1, pp))
    unconstrained = partition_brute_force(problem)
    low = min(max(evaluate_partition(problem, (0, *cuts, layers)).stage_memory_bytes)
              for cuts in __import__("itertools").combinations(range(1, layers), pp - 1))
    limit = low + tight * (max(unconstrained.stage_memory_bytes) - low)
    return StageProblem(problem.layer_time_s, problem.layer_static_bytes, problem.layer_activation_bytes,
                        problem.layer_transient_bytes, in_flight, limit, problem.first, problem.last,
                        problem.overhead_s, problem.extra_bytes)


@pytest.mark.parametrize("seed", range(40))
def test_dp_matches_brute_force_on_random_arrays(seed):
    rng = np.random.default_rng(seed)
    layers, pp = int(rng.integers(1, 9)), int(rng.integers(1, 5))
    if pp > layers:
        assert partition_stages(StageProblem(np.ones(layers), np.ones(layers), np.ones(layers), np.zeros(layers),
                                             np.ones(pp), np.inf)) is None
        return
    problem = random_problem(rng, layers, pp, tight=float(rng.uniform(-0.2, 1.2)))
    fast, slow = partition_stages(problem), partition_brute_force(problem)
    assert (fast is None) == (slow is None)
    if fast is None:
        return
    assert fast.bottleneck_s == pytest.approx(slow.bottleneck_s, rel=1e-12)
    assert max(fast.stage_memory_bytes) <= problem.memory_limit_bytes * (1 + 1e-12)
    assert fast == evaluate_partition(problem, fast.bounds)  # times and memory as the problem defines them


def test_uniform_layers_split_evenly_and_the_head_pushes_layers_forward():
    problem = StageProblem(np.ones(8), np.zeros(8), np.zeros(8), np.zeros(8), np.ones(4), np.inf)
    assert partition_stages(problem).bounds == (0, 2, 4, 6, 8)
    heavy_head = StageProblem(np.ones(8), np.zeros(8), np.zeros(8), np.zeros(8), np.ones(2), np.inf,
                              last=Part(time_s=2.0))
    assert partition_stages(heavy_head).bounds == (0, 5, 8)  # 5 | 3 + 2


def test_memory_limit_moves_layers_off_the_first_stage():
    """1F1B: stage 0 keeps pp microbatches, the last keeps one, so memory pushes layers backwards."""
    pp, layers = 2, 6
    problem = StageProblem(np.ones(layers), np.zeros(layers), np.ones(layers), np.zeros(layers),
                           np.array([in_flight_microbatches(s, pp, 8) for s in range(pp)]), 4.0)
    partition = partition_stages(problem)
    assert partition.bounds == (0, 2, 6)  # 2 layers x 2 in flight = 4 <= 4; 4 x 1 = 4
    assert partition.stage_memory_bytes == (4.0, 4.0)
    assert partition_stages(StageProblem(**{**problem.__dict__, "memory_limit_bytes": 3.0})) is None


def test_bad_arrays_are_refused():
    with pytest.raises(AutoplanError, match="one length"):
        StageProblem(np.ones(3), np.ones(2), np.ones(3), np.ones(3), np.ones(1), 1.0)
    with pytest.raises(AutoplanError, match="finite and >= 0"):
        StageProblem(-np.ones(3), np.ones(3), np.ones(3), np.ones(3), np.ones(1), 1.0)
    with pytest.raises(AutoplanError, match="steps of at least"):
        evaluate_partition(StageProblem(np.ones(3), np.ones(3), np.ones(3), np.ones(3), np.ones(2), 1.0), (0, 3, 3))


# ------------------------------------------------------------------------------ pipeline formulas


def test_1f1b_and_interleaved_step_formulas():
    t, m, pp = 0.1, 8, 4
    steady, bubble = pipeline_time_s([t] * pp, m)
    assert steady + bubble == pytest.approx((m + pp - 1) * t)  # 1F1B
    steady, bubble = pipeline_time_s([t] * pp, m, virtual_stages=2)
    assert steady + bubble == pytest.approx((m + (pp - 1) / 2) * t)  # interleaved: bubble / v
    steady, bubble = pipeline_time_s([0.1, 0.3], 4)
    assert (steady, bubble) == pytest.approx((4 * 0.3, 0.1))  # the slowest stage sets the pace


def test_in_flight_microbatches():
    assert [in_flight_microbatches(s, 4, 8) for s in range(4)] == [4, 3, 2, 1]
    assert [in_flight_microbatches(s, 4, 2) for s in range(4)] == [2, 2, 2, 1]  # capped by m
    # interleaved, stage 0: pp (1 + (pp - 1) / (pp v)) (Korthikanti et al. 2022)
    assert in_flight_microbatches(0, 4, 16, 2) == pytest.approx(4 * (1 + 3 / 8))
    assert in_flight_microbatches(3, 4, 16, 2) < in_flight_microbatches(0, 4, 16, 2)
    with pytest.raises(ConfigError):
        in_flight_microbatches(4, 4, 8)


def test_chunks_split_each_rank_evenly_with_the_ends_taking_the_smaller_shares():
    # 126 layers on pp 16 x v 8: Llama 3 405B, the first chunk only the embedding, the last only the head
    sizes = chunk_sizes([7] + [8] * 14 + [7], 8)
    assert sizes == (0,) + (1,) * 126 + (0,)
    assert chunk_sizes([5, 6, 4], 2) == (2, 3, 2, 3, 3, 2)  # flow order: chunk 0 of ranks 0..2, then chunk 1
    ranges = chunk_ranges((2, 3, 2, 3, 3, 2), 3)
    assert [r[:2] for r in ranges] == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)]
    assert [r[2:] for r in ranges] == [(0, 2), (2, 5), (5, 7), (7, 10), (10, 13), (13, 15)]  # they tile the layers
    assert chunk_ranges((0, 3, 0), 3)[0][2:] == (0, 0)  # a chunk of no layer
    with pytest.raises(ConfigError, match="pp=2"):
        chunk_ranges((1, 2, 3), 2)


def test_validity_takes_uneven_stages_and_chunks_that_do_not_divide():
    assert stage_min_layers(4, 2) == (1, 2, 2, 1) and stage_min_layers(1, 1) == (1,)
    assert pipeline_problem(5, 2, "interleaved-1f1b", 2, 2) is None  # 5 layers over pp x v = 4 chunks
    assert pipeline_problem(126, 16, "interleaved-1f1b", 8, 16) is None  # Llama 3 405B: 128 chunks
    assert "at least 126 layers" in pipeline_problem(125, 16, "interleaved-1f1b", 8, 16)
    assert "divisible by pp=2" in pipeline_problem(5, 2, "interleaved-1f1b", 2, 3)
    assert stages_problem(5, 2, 2, (2, 1, 1, 1)) is None and stages_problem(4, 2, 1, (0, 4)) is None
    message = stages_problem(5, 2, 2, (2, 2, 1))
    assert "3 chunks, 5 layers" in message and "pp x v = 2 x 2 = 4" in message and "chunk 1 of each" in message
    assert "chunk 1 holds 0 layers" in stages_problem(5, 2, 2, (3, 0, 1, 1))
    assert stage_layers_text((0,) + (1,) * 126 + (0,)) == "0,1*126,0"


@pytest.mark.parametrize("seed", range(30))
def test_dp_with_stage_minimums_matches_brute_force(seed):
    """Stages allowed to hold none (the embedding or head alone) or needing several layers (v chunks)."""
    rng = np.random.default_rng(100 + seed)
    pp = int(rng.integers(2, 5))
    layers, minimums = int(rng.integers(pp, 9)), rng.integers(0, 3, pp)
    if minimums.sum() > layers:
        assert partition_stages(StageProblem(np.ones(layers), np.ones(layers), np.ones(layers), np.zeros(layers),
                                             np.ones(pp), np.inf, min_layers=minimums)) is None
        return
    base = random_problem(rng, layers, pp, tight=float(rng.uniform(0.0, 1.2)))
    problem = StageProblem(**{**base.__dict__, "min_layers": minimums})
    fast, slow = partition_stages(problem), partition_brute_force(problem)
    assert (fast is None) == (slow is None)
    if fast is not None:
        assert fast.bottleneck_s == pytest.approx(slow.bottleneck_s, rel=1e-12)
        assert all(b - a >= n for (a, b), n in zip(fast.ranges, minimums))


@pytest.mark.parametrize("seed", range(60))
def test_the_greedy_fit_check_agrees_with_the_dp(seed):
    rng = np.random.default_rng(300 + seed)
    pp = int(rng.integers(1, 6))
    layers = int(rng.integers(pp, 12))
    base = random_problem(rng, layers, pp, tight=float(rng.uniform(-0.3, 1.2))) if layers <= 8 else StageProblem(
        rng.uniform(0.5, 2, layers), rng.uniform(0, 3, layers), rng.uniform(0, 1, layers), rng.uniform(0, 2, layers),
        np.array([float(pp - s) for s in range(pp)]), float(rng.uniform(2, 20)), Part(0.1, 1.0, 0.5), Part(0.2, 2.0))
    for minimums in (base.min_layers, rng.integers(0, 3, pp)):
        problem = StageProblem(**{**base.__dict__, "min_layers": minimums})
        assert partition_fits(problem) == (partition_stages(problem) is not None)


def test_a_heavy_head_gets_a_stage_of_its_own_where_that_is_fastest():
    problem = StageProblem(np.ones(6), np.zeros(6), np.zeros(6), np.zeros(6), np.ones(4), np.inf,
                           last=Part(time_s=2.0), min_layers=np.array([0, 1, 1, 0]))
    assert partition_stages(problem).bounds == (0, 2, 4, 6, 6)  # 2 | 2 | 2 | head: the slowest is 2
    with pytest.raises(AutoplanError, match="at least"):
        evaluate_partition(StageProblem(**{**problem.__dict__, "min_layers": np.ones(4)}), (0, 2, 4, 6, 6))


def test_p2p_crosses_the_link_of_the_pp_axis():
    cluster = parse_cluster("2x8xh100")  # NVLink 450 GB/s 5 us; NDR 50 GB/s 10 us
    assert p2p_per_microbatch_s(1e9, cluster, MeshShape(dp=16)) == 0.0
    across = p2p_per_microbatch_s(1e9, cluster, MeshShape(pp=2, tp=8))
    inside = p2p_per_microbatch_s(1e9, cluster, MeshShape(pp=2, dp=2, tp=4, order=("dp", "pp", "ep", "cp", "tp")))
    assert across == pytest.approx(2 * (1e9 / 50e9 + 10e-6))
    assert inside == pytest.approx(2 * (1e9 / 450e9 + 5e-6))


def identical_problem(rng: np.random.Generator, integer: bool) -> StageProblem:
    """Identical layers (one repeated block; sometimes a first layer of its own), the embedding and head, sends,
    uneven minimums, a memory limit (or none); `integer`: every time and byte an integer, so the DP's range sums
    are exact."""
    pp = int(rng.integers(1, 7))
    layers = int(rng.integers(1, 40))
    draw = (lambda hi: float(rng.integers(0, hi + 1))) if integer else (lambda hi: float(rng.uniform(0, hi)))
    t, w, a, p = draw(4) + 1, draw(3), draw(2), draw(3) * int(rng.integers(0, 2))
    in_flight = np.array([float(min(int(rng.integers(1, 6)), pp - s)) for s in range(pp)])
    first, last = Part(draw(6), draw(5), draw(2)), Part(draw(9), draw(5), draw(3), draw(4))
    minimums = rng.integers(0, 3, pp) if rng.integers(0, 2) else np.ones(pp)
    arrays = [np.full(layers, x) for x in (t, w, a, p)]
    if rng.integers(0, 2):  # a first layer of its own (its input resharded from the embedding), on stage 0
        minimums[0] = max(1, minimums[0])
        for values, hi in zip(arrays, (5, 3, 2, 3)):
            values[0] = draw(hi) + (values is arrays[0])
    unlimited = StageProblem(*arrays, in_flight, np.inf, first, last, np.array([draw(2)] * pp),
                             np.array([draw(3) for _ in range(pp)]), minimums)
    fastest = boundary_dp(unlimited)
    if fastest is None or rng.integers(0, 4) == 0:
        return unlimited
    need = max(unlimited.stage_memory_bytes(s, i, j) for s, (i, j) in enumerate(fastest.ranges))
    limit = need * float(rng.uniform(0.4, 1.1)) if not integer else float(int(need * rng.uniform(0.4, 1.1)))
    return StageProblem(**{**unlimited.__dict__, "memory_limit_bytes": limit})


@pytest.mark.parametrize("seed", range(300))
def test_identical_layers_from_counts_give_the_dp_bounds(seed):
    """`partition_bounds` of identical layers (from counts, `solver.stage_counts`) against the DP over boundaries,
    with a first layer of its own on stage 0 or not:
    the same bounds, ties included, where the sums are exact (integers); the same bottleneck and a partition
    that fits otherwise."""
    rng = np.random.default_rng(700 + seed)
    integer = seed % 2 == 0
    problem = identical_problem(rng, integer)
    assert counts_decide(problem)
    counted, swept = partition_bounds(problem), boundary_dp(problem)
    assert (counted is None) == (swept is None)
    if counted is None:
        return
    if integer:
        assert counted == swept
    mine, theirs = evaluate_partition(problem, counted.bounds), evaluate_partition(problem, swept.bounds)
    assert mine.bottleneck_s == pytest.approx(theirs.bottleneck_s, rel=1e-12)
    assert max(mine.stage_memory_bytes) <= problem.memory_limit_bytes * (1 + 1e-9)


@pytest.mark.parametrize("seed", range(40))
def test_the_vectorised_fit_of_a_partition_is_the_per_stage_one(seed):
    """`StageProblem.fits` (prefix sums over every stage at once) against `stage_memory_bytes` stage by stage,
    limits at and around the largest stage's memory, stages holding no layer among them."""
    rng = np.random.default_rng(900 + seed)
    pp, layers = int(rng.integers(1, 6)), int(rng.integers(1, 12))
    problem = StageProblem(rng.uniform(0.5, 2, layers), rng.uniform(0, 3, layers), rng.uniform(0, 1, layers),
                           rng.uniform(0, 2, layers) * rng.integers(0, 2), rng.integers(1, 5, pp).astype(float), np.inf,
                           Part(0.1, float(rng.uniform(0, 3)), 0.5, float(rng.uniform(0, 3))),
                           Part(0.2, 2.0, float(rng.uniform(0, 1)), float(rng.uniform(0, 3))),
                           extra_bytes=rng.uniform(0, 1, pp), min_layers=np.zeros(pp))
    bounds = (0, *sorted(rng.integers(0, layers + 1, pp - 1).tolist()), layers)
    largest = max(problem.stage_memory_bytes(s, a, b) for s, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])))
    assert problem.fits(bounds)
    for limit in (largest, np.nextafter(largest, 0), largest * (1 + 1e-6), largest * (1 - 1e-6)):
        limited = StageProblem(**{**problem.__dict__, "memory_limit_bytes": limit})
        assert limited.fits(bounds) == (largest <= limit)


@pytest.mark.parametrize("seed", range(100))
def test_the_fit_check_from_counts_agrees_with_the_dp(seed):
    """`partition_fits` where counts decide (`stage_counts.counts_fit`, from the stages' caps) against the DP."""
    problem = identical_problem(np.random.default_rng(1700 + seed), integer=seed % 2 == 0)
    assert partition_fits(problem) == (boundary_dp(problem) is not None)
