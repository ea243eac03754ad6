"""The intra-op ILP (Alpa, Zheng et al. OSDI'22, section 4.2) over an `IntraOpProblem`.

Variables, for every node v with k_v > 1 strategies and every edge (u, v) between two such nodes:

    s_v in {0, 1}^{k_v},          sum_i s_v[i] = 1                       (one strategy per node)
    e_uv in [0, 1]^{k_u x k_v},   sum_j e_uv[i, j] = s_u[i]  for all i    (linearises s_u s_v^T)
                                  sum_i e_uv[i, j] = s_v[j]  for all j

    minimise   sum_v w_v c_v . s_v  +  sum_(u,v) w_uv <C_uv, e_uv>
    subject to sum_v w_v m_v . s_v <= budget                             (only with a memory budget)

With s_u and s_v one-hot the two marginal constraints leave exactly one non-zero entry,
e_uv[i*, j*] = 1, so e_uv can stay continuous (`_add_edge`). Before any variable is made
(`_reduce`): nodes with one strategy are constants and edges touching them fold into the other
node's cost; edges whose matrix is additive (C[i, j] = a_i + b_j, e.g. all zeros) fold into both
nodes; parallel edges merge. The objective is solved in microseconds (seconds are tiny next to
solver tolerances) and reported in seconds, recomputed exactly from the chosen strategies.

pulp drives HiGHS (through highspy) when available, else CBC, always with a time limit; a run
stopped by its limit reports status "feasible" (CBC then still says "Optimal" in `LpStatus`,
hence the check of `sol_status`).
"""

from __future__ import annotations

import itertools
import time
import warnings
from dataclasses import dataclass

import numpy as np
import pulp

from autoplan.errors import AutoplanError, InfeasibleError
from autoplan.solver.problem import IntraOpProblem

OBJECTIVE_SCALE = 1e6  # solve in microseconds
MEMORY_SCALE = 1e-9  # write the memory row in GB
REL_GAP = 1e-7


@dataclass(frozen=True)
class IntraOpSolution:
    choice: tuple[int, ...]  # strategy index per problem node
    objective: float  # seconds, problem.objective_s(choice)
    status: str  # "optimal" | "feasible" (stopped by the time limit)
    solver: str  # "highs" | "cbc" | "trivial" | "brute_force"
    solve_time_s: float


@dataclass
class _Reduced:
    """The problem after `_reduce`: free nodes, their folded costs, and pair matrices between them."""

    free: list[int]
    node_cost: dict[int, np.ndarray]  # weighted, for free nodes
    pairs: dict[tuple[int, int], np.ndarray]  # weighted, u < v, both free


def _reduce(problem: IntraOpProblem) -> _Reduced:
    sizes = problem.num_strategies()
    free = [v for v, k in enumerate(sizes) if k > 1]
    cost = {v: problem.node_weights[v] * problem.node_costs_s[v] for v in free}
    pairs: dict[tuple[int, int], np.ndarray] = {}
    for (u, v), matrix, weight in zip(problem.edges, problem.edge_costs_s, problem.edge_weights):
        m = weight * matrix
        if sizes[u] == 1 and sizes[v] == 1:
            continue  # a constant: the objective is recomputed from the choice at the end
        if sizes[u] == 1:
            cost[v] = cost[v] + m[0, :]
        elif sizes[v] == 1:
            cost[u] = cost[u] + m[:, 0]
        else:
            key, m = ((u, v), m) if u < v else ((v, u), m.T)
            pairs[key] = pairs[key] + m if key in pairs else m
    for (u, v), m in list(pairs.items()):
        a, b = m[:, 0], m[0, :] - m[0, 0]
        if np.allclose(m, a[:, None] + b[None, :], rtol=0, atol=1e-15):
            cost[u], cost[v] = cost[u] + a, cost[v] + b
            del pairs[(u, v)]
    return _Reduced(free, cost, pairs)


def _check_budget(problem: IntraOpProblem) -> None:
    if problem.memory_budget_bytes is None:
        return
    smallest = problem.min_memory_bytes()
    if smallest > problem.memory_budget_bytes:
        raise InfeasibleError(
            f"no strategy choice fits the memory budget: the smallest possible memory is {smallest:.4g} bytes "
            f"but the budget is {problem.memory_budget_bytes:.4g} bytes ({smallest - problem.memory_budget_bytes:.4g} "
            f"over); raise the budget or add strategies that shard more")


def _make_solver(name: str | None, time_limit_s: float):
    """HiGHS when available (or asked for), else CBC; both with a time limit."""
    if name not in (None, "highs", "cbc"):
        raise AutoplanError(f"ILP solver {name!r} is unknown; use 'highs', 'cbc' or None (the best available)")
    if name in (None, "highs"):
        highs = pulp.HiGHS(msg=False, timeLimit=time_limit_s, gapRel=REL_GAP, threads=1)
        if highs.available():
            return "highs", highs
        if name == "highs":
            raise AutoplanError("HiGHS is not available: `pip install highspy`, or pass solver='cbc'")
    with warnings.catch_warnings():  # pulp 3.3 deprecates its bundled CBC; it is still the fallback
        warnings.simplefilter("ignore", DeprecationWarning)
        return "cbc", pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit_s, gapRel=REL_GAP)


def _variable(prob: pulp.LpProblem, name: str, cat: str) -> pulp.LpVariable:
    """A variable in [0, 1]: `prob.add_variable` where pulp has it (>= 3.3), else the older constructor."""
    if hasattr(prob, "add_variable"):
        return prob.add_variable(name, 0, 1, cat=cat)
    return pulp.LpVariable(name, 0, 1, cat=cat)


def _add_edge(prob: pulp.LpProblem, s_u: list, s_v: list, matrix: np.ndarray, tag: str, terms: list) -> None:
    """e_uv with its two marginal constraints; appends <C, e> to the objective terms."""
    ku, kv = matrix.shape
    e = [[_variable(prob, f"e{tag}_{i}_{j}", pulp.LpContinuous) for j in range(kv)] for i in range(ku)]
    for i in range(ku):
        prob += pulp.lpSum(e[i]) == s_u[i], f"row{tag}_{i}"
    for j in range(kv):
        prob += pulp.lpSum(e[i][j] for i in range(ku)) == s_v[j], f"col{tag}_{j}"
    terms.extend((e[i][j], float(matrix[i, j]) * OBJECTIVE_SCALE) for i in range(ku) for j in range(kv) if matrix[i, j])


def _build(problem: IntraOpProblem, reduced: _Reduced) -> tuple[pulp.LpProblem, dict[int, list]]:
    prob = pulp.LpProblem("intra_op", pulp.LpMinimize)
    s = {v: [_variable(prob, f"s{v}_{i}", pulp.LpBinary) for i in range(len(reduced.node_cost[v]))]
         for v in reduced.free}
    terms: list = []
    for v in reduced.free:
        prob += pulp.lpSum(s[v]) == 1, f"one{v}"
        terms.extend((x, float(c) * OBJECTIVE_SCALE) for x, c in zip(s[v], reduced.node_cost[v]) if c)
    for (u, v), matrix in reduced.pairs.items():
        _add_edge(prob, s[u], s[v], matrix, f"{u}_{v}", terms)
    prob += pulp.LpAffineExpression(terms) if terms else pulp.LpAffineExpression(0)
    if problem.memory_budget_bytes is not None:
        fixed = sum(w * m[0] for w, m in zip(problem.node_weights, problem.node_memory_bytes) if m.shape[0] == 1)
        row = [(x, float(problem.node_weights[v] * m) * MEMORY_SCALE)
               for v in reduced.free for x, m in zip(s[v], problem.node_memory_bytes[v]) if m]
        prob += pulp.LpAffineExpression(row) <= (problem.memory_budget_bytes - fixed) * MEMORY_SCALE, "memory"
    return prob, s


def solve_ilp(problem: IntraOpProblem, *, time_limit_s: float = 60.0, solver: str | None = None) -> IntraOpSolution:
    """Optimal (or, when stopped by `time_limit_s`, best found) strategy choice; module docstring."""
    if not time_limit_s > 0:
        raise AutoplanError(f"time_limit_s must be > 0, got {time_limit_s!r}")
    start = time.perf_counter()
    _check_budget(problem)
    reduced = _reduce(problem)
    choice = [0] * problem.num_nodes
    if not reduced.pairs and problem.memory_budget_bytes is None:
        for v in reduced.free:  # separable: each node independently
            choice[v] = int(np.argmin(reduced.node_cost[v]))
        return IntraOpSolution(tuple(choice), problem.objective_s(choice), "optimal", "trivial",
                               time.perf_counter() - start)
    prob, s = _build(problem, reduced)
    name, backend = _make_solver(solver, time_limit_s)
    prob.solve(backend)
    status = _status(prob, problem)
    for v, xs in s.items():
        choice[v] = int(np.argmax([x.varValue or 0.0 for x in xs]))
    return IntraOpSolution(tuple(choice), problem.objective_s(choice), status, name, time.perf_counter() - start)


def _status(prob: pulp.LpProblem, problem: IntraOpProblem) -> str:
    if prob.sol_status == pulp.LpSolutionOptimal:
        return "optimal"
    if prob.sol_status == pulp.LpSolutionIntegerFeasible:
        return "feasible"
    if prob.sol_status == pulp.LpSolutionInfeasible:
        raise InfeasibleError(f"the intra-op ILP is infeasible under the memory budget "
                              f"{problem.memory_budget_bytes:.4g} bytes (smallest possible "
                              f"{problem.min_memory_bytes():.4g} bytes)")
    raise AutoplanError(f"the intra-op ILP found no solution (pulp status {pulp.LpStatus[prob.status]}, "
                        f"solution status {prob.sol_status}); raise time_limit_s")


def solve_brute_force(problem: IntraOpProblem) -> IntraOpSolution:
    """Try every choice (for tests on small problems); ties go to the lexicographically first."""
    start = time.perf_counter()
    _check_budget(problem)
    budget = problem.memory_budget_bytes
    best, best_cost = None, float("inf")
    for choice in itertools.product(*(range(k) for k in problem.num_strategies())):
        if budget is not None and problem.memory_bytes(choice) > budget:
            continue
        cost = problem.objective_s(choice)
        if cost < best_cost:
            best, best_cost = choice, cost
    if best is None:  # unreachable after _check_budget; kept for safety
        raise InfeasibleError(f"no choice fits the memory budget {budget:.4g} bytes")
    return IntraOpSolution(tuple(best), best_cost, "optimal", "brute_force", time.perf_counter() - start)
