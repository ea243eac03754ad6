"""The chain DP on arrays against brute force (tier 1), and the folded solve against one ILP over the
unfolded graph and against brute force (differential tests)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from autoplan.capture import capture
from autoplan.cost_model.intra_op import make_context, price_assignment
from autoplan.cost_model.intra_op_problem import build_intra_op_problem, resolve_strategies
from autoplan.errors import AutoplanError, InfeasibleError
from autoplan.capture.blocks import fold_graph
from autoplan.solver.folded import solve_folded
from autoplan.mesh import MeshShape
from autoplan.models import build_model, get_model_config
from autoplan.solver.intra_op import solve_tp
from autoplan.solver.chain import chain_cost, solve_chain, solve_chain_brute_force
from autoplan.solver.ilp import restrict, solve_brute_force, solve_ilp, solve_ilp_variants
from autoplan.cost_model.problem import ProblemVariant
from autoplan.strategies import StrategyRegistry, default_registry, elementwise_strategies, norm_strategies
from test_cost_model import zero_latency
from test_ilp import random_problem
from test_fold import NARROW, WIDE, EncoderDecoderLM, SkipBlock, StackLM, captured, dense, gpt, moe

# ------------------------------------------------------------------------------ the DP on arrays


def random_tables(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    sizes = [1] + [int(rng.integers(1, 5)) for _ in range(int(rng.integers(1, 6)))] + [1]
    tables = []
    for a, b in zip(sizes, sizes[1:]):
        table = rng.uniform(0, 1, (a, b))
        table[rng.random((a, b)) < 0.2] = np.inf
        tables.append(table)
    return tables


@pytest.mark.parametrize("seed", range(40))
def test_chain_matches_brute_force(seed):
    tables = random_tables(seed)
    try:
        brute = solve_chain_brute_force(tables)
    except InfeasibleError:
        with pytest.raises(InfeasibleError):
            solve_chain(tables)
        return
    dp = solve_chain(tables)
    assert dp.objective == pytest.approx(brute.objective, rel=1e-12)
    assert chain_cost(tables, dp.states) == pytest.approx(dp.objective, rel=1e-12)


def test_chain_reuses_one_table_and_picks_per_position():
    # a repeated block that prefers to stay in state 0 but must enter from, and leave to, state 1
    block = np.array([[0.0, 5.0], [1.0, 3.0]])
    tables = [np.array([[9.0, 0.0]]), block, block, block, np.array([[9.0], [0.0]])]
    solution = solve_chain(tables)
    assert solution.states == (1, 0, 0, 1)  # the boundary blocks differ from the middle one
    assert solution.objective == pytest.approx(0 + 1 + 0 + 5 + 0)


def runs_of_one_table(seed: int) -> list[np.ndarray]:
    """Entry and exit tables around runs of one repeated square table object (one block kind)."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 4))
    tables = [rng.uniform(0, 1, (1, n))]
    for _ in range(int(rng.integers(1, 3))):
        block = rng.uniform(0, 1, (n, n))
        block[rng.random((n, n)) < 0.25] = np.inf
        tables += [block] * int(rng.integers(1, 9))  # the same object: runs of >= 4 are chained by powers
    return tables + [rng.uniform(0, 1, (n, 1))]


def brute_force_if_small(tables: list[np.ndarray]):
    """solve_chain_brute_force when it tries at most 5000 sequences, else the step-by-step DP (itself
    checked against brute force above) on copies of the tables."""
    if np.prod([t.shape[1] for t in tables[:-1]], dtype=float) <= 5000:
        return solve_chain_brute_force(tables)
    return solve_chain([t.copy() for t in tables])


@pytest.mark.parametrize("seed", range(30))
def test_runs_chained_by_powers_match_brute_force_and_the_step_by_step_dp(seed):
    tables = runs_of_one_table(seed)
    copies = [t.copy() for t in tables]  # distinct objects: no runs, one step per table
    try:
        brute = brute_force_if_small(tables)
    except InfeasibleError:
        for chain in (tables, copies):
            with pytest.raises(InfeasibleError):
                solve_chain(chain)
        return
    powers, steps = solve_chain(tables), solve_chain(copies)
    assert len(powers.states) == len(tables) - 1
    for solution in (powers, steps):
        assert solution.objective == pytest.approx(brute.objective, rel=1e-12)
        assert chain_cost(tables, solution.states) == pytest.approx(brute.objective, rel=1e-12)


def test_a_long_run_reads_back_every_inner_state():
    # 99 blocks that alternate states 0 -> 1 -> 0 ... cheaply; staying put costs 1
    block = np.array([[1.0, 0.0], [0.0, 1.0]])
    tables = [np.array([[0.0, 5.0]])] + [block] * 99 + [np.array([[5.0], [0.0]])]
    solution = solve_chain(tables)
    assert solution.objective == pytest.approx(0.0)
    assert solution.states == tuple(1 - s % 2 for s in range(1, 101))


def test_chain_validation_names_the_bad_cut():
    with pytest.raises(AutoplanError, match="cut 0"):
        solve_chain([np.zeros((1, 2)), np.zeros((3, 1))])
    with pytest.raises(AutoplanError, match="first table"):
        solve_chain([np.zeros((2, 1))])
    with pytest.raises(AutoplanError, match="numbers or \\+inf"):
        solve_chain([np.array([[np.nan]])])


# ------------------------------------------------------------------------------ variants of one ILP


def random_variants(problem, seed: int, count: int = 4) -> list[ProblemVariant]:
    """Added costs on some nodes, some nodes restricted to a random non-empty subset of strategies."""
    rng = np.random.default_rng(seed)
    sizes = problem.num_strategies()
    variants = []
    for _ in range(count):
        nodes = rng.choice(len(sizes), size=min(3, len(sizes)), replace=False)
        extra = {int(v): rng.uniform(0, 1e-3, sizes[v]) for v in nodes[:2]}
        allowed = {int(v): tuple(sorted(int(i) for i in rng.choice(sizes[v], size=int(rng.integers(1, sizes[v] + 1)),
                                                                   replace=False))) for v in nodes[1:]}
        variants.append(ProblemVariant(extra, allowed))
    return variants


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("budget", [None, 0.5])
def test_variants_match_brute_force_of_each_restricted_problem(seed, budget):
    problem = random_problem(200 + seed, budget_quantile=budget)
    variants = random_variants(problem, seed)
    for variant, sol in zip(variants, solve_ilp_variants(problem, variants, time_limit_s=10)):
        sub, kept = restrict(problem, variant)
        assert all(sol.choice[v] in kept[v] for v in range(problem.num_nodes))
        assert sol.objective == pytest.approx(problem.objective_s(sol.choice) + variant.extra_s(sol.choice), rel=1e-12)
        try:
            brute = solve_brute_force(sub)
        except InfeasibleError:
            continue  # the restriction leaves nothing under the budget; the solver raised in that case too
        assert sol.objective == pytest.approx(brute.objective, rel=1e-6, abs=1e-12)


def test_variants_agree_across_backends_and_without_the_relaxation():
    problem = random_problem(7)
    variants = random_variants(problem, 7)
    highs = solve_ilp_variants(problem, variants, solver="highs", elimination=False)
    cbc = solve_ilp_variants(problem, variants, solver="cbc", elimination=False)
    assert {s.solver for s in highs} == {"highs"} and {s.solver for s in cbc} == {"cbc"}
    assert [s.objective for s in highs] == pytest.approx([s.objective for s in cbc], rel=1e-6)
    assert solve_ilp(problem, relaxation_first=False).objective == pytest.approx(solve_ilp(problem).objective, rel=1e-9)


def test_variant_validation_names_the_node():
    problem = random_problem(3)
    with pytest.raises(AutoplanError, match="node 0"):
        solve_ilp_variants(problem, [ProblemVariant(allowed={0: ()})])
    with pytest.raises(AutoplanError, match="node 1"):
        solve_ilp_variants(problem, [ProblemVariant(extra_costs_s={1: np.zeros(99)})])


# ------------------------------------------------------------------------------ folded vs unfolded


def zoo_graph(name: str, layers: int, seq: int = 32):
    cfg = dataclasses.replace(get_model_config(name), num_layers=layers)
    return cfg, capture(build_model(cfg, "meta", torch.bfloat16), cfg, 1, seq)


def assert_folded_equals_unfolded(graph, info, tp, microbatch, registry=None, cluster=None):
    registry, cluster = registry or default_registry(), cluster or zero_latency()
    mesh = MeshShape(dp=8 // tp, tp=tp)
    folded = solve_folded(fold_graph(graph), registry, info, cluster, mesh, microbatch)
    built = build_intra_op_problem(graph, registry, info, tp, cluster, mesh, microbatch)
    unfolded = solve_ilp(built.problem)
    assert folded.method == "chain" and folded.status == unfolded.status == "optimal"
    assert folded.objective == pytest.approx(unfolded.objective, rel=1e-9)
    # the folded choice, spread over every node, has the chained objective on the unfolded problem
    spread = [[s.name for s in built.strategies[k]].index(folded.assignment[n]) for n, k in built.mapping.items()]
    assert built.problem.objective_s(spread) == pytest.approx(folded.objective, rel=1e-9)
    strategies = resolve_strategies(graph, registry, info, tp, folded.assignment)
    ctx = make_context(graph, cluster, mesh, microbatch)
    # the ILP prices each op alone (no host pacing); shared conversions: once here, per consumer in the ILP
    cost = price_assignment(graph, strategies, ctx, host=False)
    assert cost.total_s + cost.shared_comm_s == pytest.approx(folded.objective, rel=1e-9)
    return folded, unfolded, built


@pytest.mark.parametrize("name", ["tiny-gpt", "tiny-llama", "tiny-moe"])
@pytest.mark.parametrize("layers", [1, 3])
@pytest.mark.parametrize("tp", [2, 4])
def test_folded_equals_unfolded_on_the_zoo(name, layers, tp):
    cfg, graph = zoo_graph(name, layers)
    for microbatch in (1, 64):
        folded, _, _ = assert_folded_equals_unfolded(graph, cfg.rule_info(), tp, microbatch)
        assert folded.num_ilps <= 3 * 3 + 3 + 3  # 3 kinds, once per pair of boundary placements


INFO = {"head_dim": NARROW.head_dim, "ffn_hidden": 96}
MIXED = {
    "dense_moe_alternating": lambda: StackLM([dense(), moe(), dense(), moe()]),
    "first_and_last_differ": lambda: StackLM([gpt(), dense(), dense(), moe()]),
    "two_widths": lambda: StackLM([dense(), dense(), dense(WIDE), dense(WIDE)], final_hidden=128, up_after=1),
    "skip_connection": lambda: StackLM([SkipBlock() for _ in range(4)], skip=True),
    "encoder_decoder": lambda: EncoderDecoderLM(encoders=2, decoders=3),
}


@pytest.mark.parametrize("model", sorted(MIXED))
@pytest.mark.parametrize("tp", [2, 4])
def test_folded_equals_unfolded_on_mixed_blocks(model, tp):
    graph = captured(MIXED[model], seq=32)
    assert len(graph.nodes) <= 300
    for microbatch in (1, 16):
        assert_folded_equals_unfolded(graph, INFO, tp, microbatch)


def small_registry(kinds: tuple[str, ...]) -> StrategyRegistry:
    """Few strategies, so that brute force over the whole graph stays small."""
    registry = StrategyRegistry()
    rules = {"norm": norm_strategies, "elementwise": elementwise_strategies}
    for kind in kinds:
        registry.register(kind, rules[kind])
    return registry


@pytest.mark.parametrize("name, layers, kinds", [("tiny-gpt", 1, ("norm", "elementwise")),
                                                 ("tiny-gpt", 2, ("elementwise",)),
                                                 ("tiny-llama", 1, ("norm", "elementwise"))])
def test_folded_and_unfolded_equal_brute_force_on_tiny_graphs(name, layers, kinds):
    cfg, graph = zoo_graph(name, layers, seq=16)
    registry = small_registry(kinds)
    for microbatch in (1, 64):
        folded, unfolded, built = assert_folded_equals_unfolded(graph, cfg.rule_info(), 2, microbatch, registry)
        assert np.prod(built.problem.num_strategies()) <= 3000
        brute = solve_brute_force(built.problem)
        assert folded.objective == pytest.approx(brute.objective, rel=1e-9)


def test_too_many_cut_states_fall_back_to_the_unfolded_ilp():
    cfg, graph = zoo_graph("tiny-gpt", 2)
    registry, info, cluster, mesh = default_registry(), cfg.rule_info(), zero_latency(), MeshShape(dp=4, tp=2)
    chained = solve_folded(fold_graph(graph), registry, info, cluster, mesh, 1)
    fallback = solve_folded(fold_graph(graph), registry, info, cluster, mesh, 1, max_cut_states=2)
    assert fallback.method.startswith("unfolded: a cut has 3 joint placements")
    assert fallback.objective == pytest.approx(chained.objective, rel=1e-9)


def test_planner_fold_and_no_fold_agree():
    cfg, graph = zoo_graph("tiny-llama", 3)
    args = (graph, default_registry(), cfg.rule_info(), zero_latency(), MeshShape(dp=2, tp=4), 8, "bfloat16")
    from autoplan.cost_model.compute import Efficiency
    folded = solve_tp(*args, Efficiency(), True, 10.0)
    unfolded = solve_tp(*args, Efficiency(), False, 10.0)
    assert folded.cost.total_s == pytest.approx(unfolded.cost.total_s, rel=1e-9)
    assert folded.status == unfolded.status == "optimal"
