"""The intra-op ILP against brute force on small random problems (tier 1: arrays only)."""

from __future__ import annotations

import numpy as np
import pytest

from autoplan.errors import AutoplanError, InfeasibleError
from autoplan.solver.ilp import solve_brute_force, solve_ilp
from autoplan.cost_model.problem import IntraOpProblem


def random_problem(seed: int, budget_quantile: float | None = None) -> IntraOpProblem:
    """4-6 nodes with 1-3 strategies, random edges (some parallel, some touching 1-strategy nodes)."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(4, 7))
    sizes = [int(rng.integers(1, 4)) for _ in range(n)]
    costs = [rng.uniform(0, 1e-3, k) for k in sizes]
    memory = [rng.integers(1, 100, k).astype(float) * 1e9 for k in sizes]
    weights = [float(rng.integers(1, 4)) for _ in range(n)]
    edges, matrices, edge_weights = [], [], []
    for _ in range(int(rng.integers(n - 1, 2 * n))):
        u, v = (int(x) for x in rng.choice(n, 2, replace=False))
        edges.append((u, v))
        matrices.append(rng.uniform(0, 2e-3, (sizes[u], sizes[v])) * (rng.random() < 0.8))
        edge_weights.append(float(rng.integers(1, 3)))
    budget = None
    if budget_quantile is not None:
        lo = sum(w * m.min() for w, m in zip(weights, memory))
        hi = sum(w * m.max() for w, m in zip(weights, memory))
        budget = lo + budget_quantile * (hi - lo) + 0.5e9  # half a GB off any attainable total
    return IntraOpProblem(tuple(f"n{i}" for i in range(n)), tuple(costs), tuple(memory), tuple(weights),
                          tuple(edges), tuple(matrices), tuple(edge_weights), budget)


@pytest.mark.parametrize("seed", range(25))
def test_ilp_matches_brute_force(seed):
    problem = random_problem(seed)
    ilp, brute = solve_ilp(problem, time_limit_s=10), solve_brute_force(problem)
    assert ilp.status == "optimal"
    assert ilp.objective == pytest.approx(brute.objective, rel=1e-6, abs=1e-12)
    assert ilp.objective == pytest.approx(problem.objective_s(ilp.choice), rel=1e-12)


@pytest.mark.parametrize("seed", range(15))
def test_ilp_matches_brute_force_under_memory_budget(seed):
    problem = random_problem(100 + seed, budget_quantile=0.3)
    ilp, brute = solve_ilp(problem, time_limit_s=10), solve_brute_force(problem)
    assert problem.memory_bytes(ilp.choice) <= problem.memory_budget_bytes
    assert ilp.objective == pytest.approx(brute.objective, rel=1e-6, abs=1e-12)


@pytest.mark.parametrize("solver", ["cbc", "highs"])
def test_both_backends_agree(solver):
    problem = random_problem(7, budget_quantile=0.5)
    result = solve_ilp(problem, time_limit_s=10, solver=solver)
    assert result.solver == solver
    assert result.objective == pytest.approx(solve_brute_force(problem).objective, rel=1e-6)


def test_infeasible_budget_names_the_smallest_memory():
    problem = random_problem(3, budget_quantile=0.0)
    tight = IntraOpProblem(problem.node_names, problem.node_costs_s, problem.node_memory_bytes, problem.node_weights,
                           problem.edges, problem.edge_costs_s, problem.edge_weights, problem.min_memory_bytes() * 0.5)
    with pytest.raises(InfeasibleError, match="smallest possible memory") as err:
        solve_ilp(tight)
    assert f"{tight.min_memory_bytes():.4g}" in str(err.value)
    with pytest.raises(InfeasibleError):
        solve_brute_force(tight)


def test_single_strategy_nodes_are_constants():
    problem = IntraOpProblem(("a", "b", "c"), ([1.0], [2.0, 0.5], [3.0]), ([0.0], [0.0, 0.0], [0.0]), (1, 2, 1),
                             ((0, 1), (1, 2), (0, 2)), ([[0.0, 4.0]], [[0.0], [1.0]], [[5.0]]), (1, 1, 1))
    result = solve_ilp(problem)
    # b=0: 1 + 2*2 + 3 + 0 + 0 + 5 = 13; b=1: 1 + 2*0.5 + 3 + 4 + 1 + 5 = 15
    assert result.choice == (0, 0, 0) and result.objective == pytest.approx(13.0)
    assert result.solver == "trivial"


def test_problem_validation_names_the_bad_field():
    with pytest.raises(AutoplanError, match="shape"):
        IntraOpProblem(("a", "b"), ([1.0], [1.0, 2.0]), ([0.0], [0.0, 0.0]), (1, 1), ((0, 1),), ([[1.0]],), (1,))
    with pytest.raises(AutoplanError, match="finite"):
        IntraOpProblem(("a",), ([float("nan")],), ([0.0],), (1,), (), (), ())
    with pytest.raises(AutoplanError, match=r"edge \(0, 1\) costs must be finite and >= 0, got \[\[1.0, -1.0\]\]"):
        IntraOpProblem(("a", "b"), ([1.0], [1.0, 2.0]), ([0.0], [0.0, 0.0]), (1, 1), ((0, 1),), ([[1.0, -1.0]],), (1,))
    with pytest.raises(AutoplanError, match=r"node 'b' memory must be finite"):
        IntraOpProblem(("a", "b"), ([1.0], [1.0]), ([0.0], [float("inf")]), (1, 1), (), (), ())
    with pytest.raises(AutoplanError, match="different nodes"):
        IntraOpProblem(("a",), ([1.0],), ([0.0],), (1,), ((0, 0),), ([[1.0]],), (1,))
