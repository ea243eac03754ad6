"""Variable elimination against the ILP and brute force on random variant sets (tier 1: arrays only)."""

from __future__ import annotations

import numpy as np
import pytest

from autoplan.solver.elimination import elimination_plan
from autoplan.solver.ilp import restrict, solve_brute_force, solve_ilp_variants
from autoplan.cost_model.problem import IntraOpProblem, ProblemVariant


def random_graph_problem(seed: int, n: int, density: float, max_strategies: int = 4,
                         min_strategies: int = 1, additive: float = 0.15) -> IntraOpProblem:
    """n nodes with min_strategies..max_strategies strategies, each pair joined with probability `density`
    (plus a path through all nodes, so it is connected), some matrices additive or zero."""
    rng = np.random.default_rng(seed)
    sizes = [int(rng.integers(min_strategies, max_strategies + 1)) for _ in range(n)]
    pairs = {(i, i + 1) for i in range(n - 1)}
    pairs |= {(i, j) for i in range(n) for j in range(i + 2, n) if rng.random() < density}
    edges, matrices = [], []
    for u, v in sorted(pairs):
        u, v = (v, u) if rng.random() < 0.3 else (u, v)  # either direction
        matrix = rng.uniform(0, 2e-3, (sizes[u], sizes[v]))
        if rng.random() < additive:  # additive: _reduce folds it into the nodes
            matrix = rng.uniform(0, 1e-3, (sizes[u], 1)) + rng.uniform(0, 1e-3, (1, sizes[v]))
        edges.append((u, v))
        matrices.append(matrix)
    return IntraOpProblem(tuple(f"n{i}" for i in range(n)), tuple(rng.uniform(0, 1e-3, k) for k in sizes),
                          tuple(np.ones(k) for k in sizes), tuple(float(rng.integers(1, 4)) for _ in range(n)),
                          tuple(edges), tuple(matrices), tuple(float(rng.integers(1, 3)) for _ in edges))


def random_variants(problem: IntraOpProblem, seed: int, count: int = 6) -> list[ProblemVariant]:
    rng = np.random.default_rng(seed)
    sizes = problem.num_strategies()
    variants = [ProblemVariant()]
    for _ in range(count - 1):
        nodes = rng.choice(len(sizes), size=min(4, len(sizes)), replace=False)
        extra = {int(v): rng.uniform(0, 2e-3, sizes[v]) for v in nodes[:2]}
        allowed = {int(v): tuple(sorted(int(i) for i in rng.choice(sizes[v], size=int(rng.integers(1, sizes[v] + 1)),
                                                                   replace=False))) for v in nodes[2:]}
        variants.append(ProblemVariant(extra, allowed))
    return variants


@pytest.mark.parametrize("seed", range(20))
def test_elimination_matches_brute_force_per_variant(seed):
    problem = random_graph_problem(seed, n=int(np.random.default_rng(seed).integers(3, 8)), density=0.35)
    variants = random_variants(problem, seed)
    solutions = solve_ilp_variants(problem, variants)
    assert {s.solver for s in solutions} <= {"elimination", "trivial"}
    for variant, sol in zip(variants, solutions):
        sub, kept = restrict(problem, variant)
        assert all(sol.choice[v] in kept[v] for v in range(problem.num_nodes))
        assert sol.objective == pytest.approx(problem.objective_s(sol.choice) + variant.extra_s(sol.choice), rel=1e-12)
        assert sol.objective == pytest.approx(solve_brute_force(sub).objective, rel=1e-9, abs=1e-15)


@pytest.mark.parametrize("seed", range(8))
def test_elimination_matches_the_ilp_on_larger_sparse_graphs(seed):
    problem = random_graph_problem(100 + seed, n=30, density=0.05)
    variants = random_variants(problem, seed, count=10)
    fast = solve_ilp_variants(problem, variants)
    ilp = solve_ilp_variants(problem, variants, elimination=False)
    assert {s.solver for s in fast} == {"elimination"} and {s.solver for s in ilp} == {"highs"}
    assert [s.objective for s in fast] == pytest.approx([s.objective for s in ilp], rel=1e-6)


def test_a_chain_with_skip_edges_needs_small_tables():
    """A transformer block: a path with residual edges two steps long has width 2, so no table holds
    more than k^3 entries however long it is."""
    pairs = [(i, i + 1) for i in range(40)] + [(i, i + 2) for i in range(0, 39, 3)]
    plan = elimination_plan({v: 4 for v in range(41)}, pairs)
    assert plan is not None and sorted(plan.order) == list(range(41))
    assert plan.largest_table <= 4 ** 3


def test_dense_graphs_fall_back_to_the_ilp():
    problem = random_graph_problem(5, n=7, density=1.0, max_strategies=5, min_strategies=5, additive=0.0)
    sizes = {v: k for v, k in enumerate(problem.num_strategies()) if k > 1}
    assert elimination_plan(sizes, [(u, v) for u, v in problem.edges if u in sizes and v in sizes],
                            max_table=64) is None
    variants = random_variants(problem, 5, count=3)
    solutions = solve_ilp_variants(problem, variants)  # complete graph: its first table has 5^7 > MAX_TABLE entries
    assert {s.solver for s in solutions} == {"highs"}
    assert [s.objective for s in solutions] == pytest.approx(
        [s.objective for s in solve_ilp_variants(problem, variants, elimination=False)], rel=1e-9)


def test_memory_budgets_go_to_the_ilp():
    problem = random_graph_problem(9, n=6, density=0.3)
    budgeted = IntraOpProblem(problem.node_names, problem.node_costs_s, problem.node_memory_bytes,
                              problem.node_weights, problem.edges, problem.edge_costs_s, problem.edge_weights,
                              memory_budget_bytes=1e12)
    assert {s.solver for s in solve_ilp_variants(budgeted, [ProblemVariant()])} == {"highs"}
