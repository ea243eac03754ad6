"""The intra-op ILP (Alpa, Zheng et al. OSDI'22, section 4.2) over an `IntraOpProblem`.

Variables, for every node v with k_v > 1 strategies and every edge (u, v) between two such nodes:

    s_v in {0, 1}^{k_v},          sum_i s_v[i] = 1                       (one strategy per node)
    e_uv in [0, 1]^{k_u x k_v},   sum_j e_uv[i, j] = s_u[i]  for all i    (linearises s_u s_v^T)
                                  sum_i e_uv[i, j] = s_v[j]  for all j

    minimise   sum_v w_v c_v . s_v  +  sum_(u,v) w_uv <C_uv, e_uv>
    subject to sum_v w_v m_v . s_v <= budget                             (only with a memory budget)

All four are built in `_milp`. With s_u and s_v one-hot the two marginal constraints leave exactly
one non-zero entry, e_uv[i*, j*] = 1, so e_uv can stay continuous. Before any variable is made
(`_reduce`): nodes with one strategy are constants and edges touching them fold into the other
node's cost; edges whose matrix is additive (C[i, j] = a_i + b_j, e.g. all zeros) fold into both
nodes; parallel edges merge. The objective is solved in microseconds (seconds are tiny next to
solver tolerances) and reported in seconds, recomputed exactly from the chosen strategies.

Folded graphs (`autoplan.capture.blocks`, `autoplan.solver.folded`). A block of the folded graph is solved with its boundary fixed: for a
placement p of each tensor it reads from the previous block and a placement q of each tensor it
hands to the next, the block's problem is the one above over the block's nodes, with

    c_v[j] += C_(u,v)[p_u, j]    for every edge (u, v) entering the block (u outside: its output
                                  placement p_u is fixed, so the edge is a cost on v alone)
    S_u    := {i : output(i) = q_u}  for every node u whose output leaves the block (its strategies
                                  restricted to those that place the output as q_u)

and its optimum is the entry T[p, q] of the block's cost table. `autoplan.solver.chain` chains the
tables over the block sequence; every node and every edge of the graph lies in exactly one block
(an edge in its consumer's), so the chained objective is the unfolded objective of the same choice,
and the chain's minimum is the unfolded ILP's minimum.

Many variants of one problem (the boundary pairs of a block) without a memory budget are solved
exactly in one vectorised pass of variable elimination (`autoplan.solver.elimination`) when the pair
graph is narrow, as a transformer block's is (a chain with residual edges): that pass is cheaper
than one solver call per variant. Wider graphs, memory budgets and single problems (`solve_ilp`,
the unfolded graph) go to the ILP below.

Backends. HiGHS (highspy, driven directly: pulp's model building cost more than the solve on the
thousands of small block problems) solves the LP relaxation first: when its optimum is integral it
is optimal for the ILP, since the relaxation bounds every integral point from below; only otherwise
does it branch and bound. CBC (pulp's bundled binary) is the fallback without highspy. Both run with
a time limit; a run stopped by it reports status "feasible" (CBC still says "Optimal" in `LpStatus`
then, hence the check of `sol_status`).
"""

from __future__ import annotations

import dataclasses
import itertools
import time
import warnings
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import pulp

from autoplan.errors import AutoplanError, InfeasibleError
from autoplan.solver.elimination import elimination_plan, solve_by_elimination
from autoplan.cost_model.problem import IntraOpProblem, ProblemVariant

OBJECTIVE_SCALE = 1e6  # solve in microseconds
MEMORY_SCALE = 1e-9  # write the memory row in GB
REL_GAP = 1e-7
INTEGRALITY_TOL = 1e-7  # an LP solution this close to 0/1 counts as integral
SMALL_LP_COLUMNS = 2000  # below this, HiGHS solves the LP relaxation without presolve (a block: ~300 columns)


@dataclass(frozen=True)
class IntraOpSolution:
    choice: tuple[int, ...]  # strategy index per problem node
    objective: float  # seconds, problem.objective_s(choice)
    status: str  # "optimal" | "feasible" (stopped by the time limit)
    solver: str  # "highs" | "cbc" | "elimination" | "trivial" | "brute_force"
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
        if np.abs(m - (a[:, None] + b[None, :])).max() <= 1e-15:
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


@dataclass
class _Milp:
    """The ILP in matrix form: columns (s then e), rows lower <= A x <= upper, A as COO triplets."""

    cost: np.ndarray  # per column, microseconds
    integer: np.ndarray  # per column: s columns are binary, e columns continuous
    rows: list[int]
    cols: list[int]
    values: list[float]
    lower: list[float]
    upper: list[float]
    s_columns: dict[int, range]  # free node -> its s columns

    def add_row(self, cols: list[int], values: list[float], lower: float, upper: float) -> None:
        row = len(self.lower)
        self.rows.extend([row] * len(cols))
        self.cols.extend(cols)
        self.values.extend(values)
        self.lower.append(lower)
        self.upper.append(upper)


def _milp(problem: IntraOpProblem, reduced: _Reduced) -> _Milp:
    """Variables and constraints of the module docstring, over the free nodes of `reduced`."""
    costs: list[np.ndarray] = []
    s_columns: dict[int, range] = {}
    n_s = 0
    for v in reduced.free:
        s_columns[v] = range(n_s, n_s + len(reduced.node_cost[v]))
        costs.append(reduced.node_cost[v])
        n_s += len(reduced.node_cost[v])
    milp = _Milp(np.array([]), np.array([], dtype=bool), [], [], [], [], [], s_columns)
    for v in reduced.free:  # one strategy per node
        milp.add_row(list(s_columns[v]), [1.0] * len(s_columns[v]), 1.0, 1.0)
    base = n_s
    for (u, v), matrix in reduced.pairs.items():  # e_uv with its two marginal constraints
        ku, kv = matrix.shape
        for i in range(ku):
            milp.add_row([base + i * kv + j for j in range(kv)] + [s_columns[u][i]], [1.0] * kv + [-1.0], 0.0, 0.0)
        for j in range(kv):
            milp.add_row([base + i * kv + j for i in range(ku)] + [s_columns[v][j]], [1.0] * ku + [-1.0], 0.0, 0.0)
        costs.append(matrix.ravel())
        base += ku * kv
    if problem.memory_budget_bytes is not None:  # sum_v w_v m_v . s_v <= budget, in GB
        fixed = sum(w * m[0] for w, m in zip(problem.node_weights, problem.node_memory_bytes) if m.shape[0] == 1)
        cols = [c for v in reduced.free for c in s_columns[v]]
        values = [float(problem.node_weights[v] * m) * MEMORY_SCALE for v in reduced.free
                  for m in problem.node_memory_bytes[v]]
        milp.add_row(cols, values, -np.inf, (problem.memory_budget_bytes - fixed) * MEMORY_SCALE)
    milp.cost = np.concatenate(costs) * OBJECTIVE_SCALE if costs else np.zeros(0)
    milp.integer = np.arange(base) < n_s
    return milp


def _solver_name(name: str | None) -> str:
    """HiGHS when highspy is importable (or asked for), else CBC."""
    if name not in (None, "highs", "cbc"):
        raise AutoplanError(f"ILP solver {name!r} is unknown; use 'highs', 'cbc' or None (the best available)")
    if name == "cbc":
        return "cbc"
    try:
        import highspy  # noqa: F401
    except ImportError:
        if name == "highs":
            raise AutoplanError("HiGHS is not available: `pip install highspy`, or pass solver='cbc'") from None
        return "cbc"
    return "highs"


class _Highs:
    """One HiGHS model of a `_Milp`, solved for the given column costs and upper bounds; solving it
    again for other costs and bounds (`solve_ilp_variants`) hot-starts from the last basis.

    The LP relaxation first: an integral optimum of it is optimal for the ILP (the relaxation bounds
    every integral point from below), which spares the branch and bound on most blocks; only
    otherwise the ILP, after which the columns turn continuous again for the next solve."""

    def __init__(self, milp: _Milp) -> None:
        import highspy

        self.hs, self.milp, n = highspy, milp, len(milp.cost)
        self.h = highspy.Highs()
        for option, value in (("output_flag", False), ("threads", 1), ("mip_rel_gap", REL_GAP)):
            self.h.setOptionValue(option, value)
        lp = highspy.HighsLp()
        lp.num_col_, lp.num_row_ = n, len(milp.lower)
        lp.col_cost_, lp.col_lower_, lp.col_upper_ = milp.cost, np.zeros(n), np.ones(n)
        lp.row_lower_, lp.row_upper_ = np.array(milp.lower), np.array(milp.upper)
        order = np.lexsort((milp.rows, milp.cols))  # column-major
        cols = np.array(milp.cols, dtype=np.int64)[order]
        lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
        lp.a_matrix_.start_ = np.searchsorted(cols, np.arange(n + 1)).astype(np.int32)
        lp.a_matrix_.index_ = np.array(milp.rows, dtype=np.int32)[order]
        lp.a_matrix_.value_ = np.array(milp.values)[order]
        self.h.passModel(lp)
        self.columns = np.arange(n, dtype=np.int32)
        self.integer = np.flatnonzero(milp.integer).astype(np.int32)

    def _run(self, time_limit_s: float, presolve: bool) -> None:
        self.h.setOptionValue("time_limit", max(1e-3, time_limit_s))
        self.h.setOptionValue("presolve", "choose" if presolve else "off")
        self.h.run()

    def _integrality(self, value: int) -> None:  # 1: integer, 0: continuous
        types = np.full(len(self.integer), value, dtype=np.uint8)
        self.h.changeColsIntegrality(len(self.integer), self.integer, types)

    def solve(self, cost: np.ndarray, upper: np.ndarray, time_limit_s: float, relaxation_first: bool = True
              ) -> tuple[np.ndarray, str]:
        start, n, status_of = time.perf_counter(), len(cost), self.hs.HighsModelStatus
        self.h.changeColsCost(n, self.columns, cost)
        self.h.changeColsBounds(n, self.columns, np.zeros(n), upper)
        if relaxation_first:
            self._run(time_limit_s, presolve=n > SMALL_LP_COLUMNS)  # presolve costs more than it saves on blocks
            if self.h.getModelStatus() == status_of.kOptimal:
                x = np.array(self.h.getSolution().col_value)
                if np.all(np.abs(x[self.milp.integer] - np.round(x[self.milp.integer])) <= INTEGRALITY_TOL):
                    return x, "optimal"
            elif self.h.getModelStatus() == status_of.kInfeasible:
                return np.zeros(n), "infeasible"
        self._integrality(1)
        self._run(time_limit_s - (time.perf_counter() - start), presolve=True)
        status, x = self.h.getModelStatus(), np.array(self.h.getSolution().col_value)
        feasible = self.h.getInfo().primal_solution_status == self.hs.kSolutionStatusFeasible
        self._integrality(0)
        if status == status_of.kOptimal:
            return x, "optimal"
        if status == status_of.kInfeasible:
            return x, "infeasible"
        return x, "feasible" if feasible else f"none ({status.name})"


def _solve_highs(milp: _Milp, time_limit_s: float, relaxation_first: bool = True) -> tuple[np.ndarray, str]:
    return _Highs(milp).solve(milp.cost, np.ones(len(milp.cost)), time_limit_s, relaxation_first)


def _solve_cbc(milp: _Milp, time_limit_s: float) -> tuple[np.ndarray, str]:
    """The ILP through pulp's bundled CBC; a run cut by its limit still says "Optimal" in `LpStatus`,
    hence the check of `sol_status`."""
    prob = pulp.LpProblem("intra_op", pulp.LpMinimize)
    x = [_variable(prob, f"x{c}", pulp.LpBinary if milp.integer[c] else pulp.LpContinuous)
         for c in range(len(milp.cost))]
    prob += pulp.LpAffineExpression([(x[c], float(v)) for c, v in enumerate(milp.cost) if v] or 0)
    rows: list[list[tuple]] = [[] for _ in milp.lower]
    for r, c, v in zip(milp.rows, milp.cols, milp.values):
        rows[r].append((x[c], v))
    for r, (terms, lower, upper) in enumerate(zip(rows, milp.lower, milp.upper)):
        expr = pulp.LpAffineExpression(terms)
        prob += (expr == upper) if lower == upper else (expr <= upper), f"r{r}"
    with warnings.catch_warnings():  # pulp 3.3 deprecates its bundled CBC; it is still the fallback
        warnings.simplefilter("ignore", DeprecationWarning)
        prob.solve(pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit_s, gapRel=REL_GAP))
    values = np.array([v.varValue or 0.0 for v in x])
    status = {pulp.LpSolutionOptimal: "optimal", pulp.LpSolutionIntegerFeasible: "feasible",
              pulp.LpSolutionInfeasible: "infeasible"}.get(prob.sol_status, f"none ({pulp.LpStatus[prob.status]})")
    return values, status


def _variable(prob: pulp.LpProblem, name: str, cat: str) -> pulp.LpVariable:
    """A variable in [0, 1]: `prob.add_variable` where pulp has it (>= 3.3), else the older constructor."""
    if hasattr(prob, "add_variable"):
        return prob.add_variable(name, 0, 1, cat=cat)
    return pulp.LpVariable(name, 0, 1, cat=cat)


def _check_time_limit(time_limit_s: float) -> None:
    if not time_limit_s > 0:
        raise AutoplanError(f"time_limit_s must be > 0, got {time_limit_s!r}")


def _choice(problem: IntraOpProblem, milp: _Milp, x: np.ndarray, status: str, name: str) -> list[int]:
    """Each free node's strategy from a solved model; errors say what to change."""
    if status == "infeasible":
        raise InfeasibleError(f"the intra-op ILP is infeasible under the memory budget "
                              f"{problem.memory_budget_bytes!r} bytes (smallest possible "
                              f"{problem.min_memory_bytes():.4g} bytes) and the strategies allowed")
    if status not in ("optimal", "feasible"):
        raise AutoplanError(f"the intra-op ILP found no solution ({name}: {status}); raise time_limit_s")
    choice = [0] * problem.num_nodes
    for v, columns in milp.s_columns.items():
        choice[v] = int(np.argmax(x[columns.start:columns.stop]))
    return choice


def solve_ilp(problem: IntraOpProblem, *, time_limit_s: float = 60.0, solver: str | None = None,
              relaxation_first: bool = True) -> IntraOpSolution:
    """Optimal (or, when stopped by `time_limit_s`, best found) strategy choice; module docstring.
    `relaxation_first=False` sends HiGHS straight to branch and bound (for comparisons)."""
    _check_time_limit(time_limit_s)
    start = time.perf_counter()
    name = _solver_name(solver)
    _check_budget(problem)
    reduced = _reduce(problem)
    if not reduced.pairs and problem.memory_budget_bytes is None:
        choice = [0] * problem.num_nodes
        for v in reduced.free:  # separable: each node independently
            choice[v] = int(np.argmin(reduced.node_cost[v]))
        return IntraOpSolution(tuple(choice), problem.objective_s(choice), "optimal", "trivial",
                               time.perf_counter() - start)
    milp = _milp(problem, reduced)
    if name == "highs":
        x, status = _solve_highs(milp, time_limit_s, relaxation_first)
    else:
        x, status = _solve_cbc(milp, time_limit_s)
    choice = _choice(problem, milp, x, status, name)
    return IntraOpSolution(tuple(choice), problem.objective_s(choice), status, name, time.perf_counter() - start)


def restrict(problem: IntraOpProblem, variant: ProblemVariant) -> tuple[IntraOpProblem, list[list[int]]]:
    """The variant as a problem of its own, and per node the strategy indices it kept."""
    variant.check(problem)
    kept = [list(variant.allowed.get(v, range(k))) for v, k in enumerate(problem.num_strategies())]
    costs = [c + np.asarray(variant.extra_costs_s[v]) / problem.node_weights[v] if v in variant.extra_costs_s else c
             for v, c in enumerate(problem.node_costs_s)]  # added costs are not weighted
    sub = IntraOpProblem(problem.node_names, tuple(c[k] for c, k in zip(costs, kept)),
                         tuple(m[k] for m, k in zip(problem.node_memory_bytes, kept)), problem.node_weights,
                         problem.edges, tuple(m[np.ix_(kept[u], kept[v])] for (u, v), m
                                              in zip(problem.edges, problem.edge_costs_s)),
                         problem.edge_weights, problem.memory_budget_bytes)
    return sub, kept


def solve_ilp_variants(problem: IntraOpProblem, variants: Sequence[ProblemVariant], *, time_limit_s: float = 60.0,
                       solver: str | None = None, elimination: bool = True) -> list[IntraOpSolution]:
    """`solve_ilp` of every variant of `problem` (choices index the problem's strategies; objectives
    include the variant's added costs). Without a memory budget, and when the pair graph is narrow
    enough, all variants are solved exactly in one pass of variable elimination
    (`autoplan.solver.elimination`; `elimination=False` turns that off). Otherwise, with HiGHS the
    model is built once and re-solved per variant with its costs, and with s_v[i] <= 0 for each
    strategy it forbids; CBC solves each variant anew."""
    _check_time_limit(time_limit_s)
    name = _solver_name(solver)
    for variant in variants:
        variant.check(problem)
    if elimination and problem.memory_budget_bytes is None and variants:
        solutions = _solve_variants_by_elimination(problem, variants)
        if solutions is not None:
            return solutions
    if name == "cbc":
        solutions = []
        for variant in variants:
            sub, kept = restrict(problem, variant)
            sol = solve_ilp(sub, time_limit_s=time_limit_s, solver=name)
            choice = tuple(kept[v][i] for v, i in enumerate(sol.choice))
            solutions.append(dataclasses.replace(sol, choice=choice))
        return solutions
    _check_budget(problem)
    reduced = _reduce(problem)
    if not reduced.pairs and problem.memory_budget_bytes is None:
        return [_solve_separable(problem, reduced, variant) for variant in variants]
    milp = _milp(problem, reduced)
    model = _Highs(milp)
    solutions = []
    for variant in variants:
        start = time.perf_counter()
        cost, upper = milp.cost.copy(), np.ones(len(milp.cost))
        for v, extra in variant.extra_costs_s.items():
            if v in milp.s_columns:
                cost[milp.s_columns[v].start:milp.s_columns[v].stop] += np.asarray(extra) * OBJECTIVE_SCALE
        for v, allowed in variant.allowed.items():
            if v in milp.s_columns:
                forbidden = np.ones(len(milp.s_columns[v]), dtype=bool)
                forbidden[list(allowed)] = False
                upper[milp.s_columns[v].start:milp.s_columns[v].stop][forbidden] = 0.0
        x, status = model.solve(cost, upper, time_limit_s)
        choice = _choice(problem, milp, x, status, name)
        solutions.append(IntraOpSolution(tuple(choice), problem.objective_s(choice) + variant.extra_s(choice), status,
                                         name, time.perf_counter() - start))
    return solutions


def _solve_variants_by_elimination(problem: IntraOpProblem, variants: Sequence[ProblemVariant]
                                   ) -> list[IntraOpSolution] | None:
    """Every variant at once by exact variable elimination over the reduced problem; None when the
    elimination order would need too large a table (the ILP then solves them)."""
    start = time.perf_counter()
    reduced = _reduce(problem)
    sizes = {v: len(reduced.node_cost[v]) for v in reduced.free}
    plan = elimination_plan(sizes, list(reduced.pairs))
    if plan is None:
        return None
    if not sizes:  # nothing to choose: every node has one strategy
        return [IntraOpSolution((0,) * problem.num_nodes, problem.objective_s([0] * problem.num_nodes)
                                + variant.extra_s([0] * problem.num_nodes), "optimal", "trivial", 0.0)
                for variant in variants]
    unary = {v: np.tile(reduced.node_cost[v], (len(variants), 1)) for v in reduced.free}
    for i, variant in enumerate(variants):
        for v, extra in variant.extra_costs_s.items():
            if v in unary:
                unary[v][i] += extra
        for v, allowed in variant.allowed.items():
            if v in unary:
                forbidden = np.ones(sizes[v], dtype=bool)
                forbidden[list(allowed)] = False
                unary[v][i, forbidden] = np.inf
    _, found = solve_by_elimination(plan, unary, reduced.pairs)
    choices = np.zeros((len(variants), problem.num_nodes), dtype=np.int64)  # fixed nodes: their one strategy
    choices[:, :found.shape[1]] = found
    objectives = problem.objectives_s(choices)
    per_variant = (time.perf_counter() - start) / len(variants)
    return [IntraOpSolution(tuple(row), float(objective) + variant.extra_s(row), "optimal", "elimination", per_variant)
            for variant, row, objective in zip(variants, choices.tolist(), objectives)]


def _solve_separable(problem: IntraOpProblem, reduced: _Reduced, variant: ProblemVariant) -> IntraOpSolution:
    """A variant of a problem without pairs: each free node its cheapest allowed strategy."""
    start = time.perf_counter()
    choice = [0] * problem.num_nodes
    for v in reduced.free:
        cost = reduced.node_cost[v] + variant.extra_costs_s.get(v, 0.0)
        if v in variant.allowed:
            cost = np.where(np.isin(np.arange(len(cost)), variant.allowed[v]), cost, np.inf)
        choice[v] = int(np.argmin(cost))
    return IntraOpSolution(tuple(choice), problem.objective_s(choice) + variant.extra_s(choice), "optimal", "trivial",
                           time.perf_counter() - start)


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
