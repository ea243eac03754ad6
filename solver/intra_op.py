"""The intra-op solve of one (tp, microbatch): the strategy of every op, chosen by an ILP over the
graph (Alpa), folded (TAPAS: `autoplan.solver.folded`) or not; and Megatron-LM's hand-written
assignment, priced the same way, for the baselines.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping

from autoplan.capture.blocks import FoldedGraph, fold_graph
from autoplan.capture.tp_roles import tp_roles
from autoplan.cluster import ClusterSpec
from autoplan.cost_model.assignment import TpSolution, tp_solution
from autoplan.cost_model.compute import Efficiency
from autoplan.cost_model.intra_op_problem import assignment_from_choice, build_intra_op_problem, graph_strategies
from autoplan.mesh import MeshShape
from autoplan.solver.folded import solve_folded
from autoplan.solver.ilp import solve_ilp
from autoplan.strategies import FEAT, SEQ, StrategyRegistry, strategy_info

if TYPE_CHECKING:
    from autoplan.capture.graph import CapturedGraph


def solve_assignment(graph: CapturedGraph, registry: StrategyRegistry, info: Mapping, cluster: ClusterSpec,
                     mesh: MeshShape, microbatch_size: int, dtype: str, efficiency: Efficiency, fold: bool,
                     time_limit_s: float, fold_map: FoldedGraph | None = None) -> tuple[dict[str, str], str, str]:
    """(assignment, solver, status) of the intra-op optimum for one (tp, microbatch): with `fold`, each kind of
    block solved once per pair of boundary placements and the tables chained (`autoplan.capture.blocks`,
    `autoplan.solver.folded`; `fold_map` passes a `fold_graph(graph)` made before); without, one ILP over the
    unfolded graph. Both reach the same objective. The mesh's etp decides the MoE layers' strategies
    (`strategies.moe_strategies`)."""
    info = strategy_info(info, mesh.tp, mesh.etp)
    if fold:
        folded = fold_map if fold_map is not None else fold_graph(graph)
        solution = solve_folded(folded, registry, info, cluster, mesh, microbatch_size, dtype, efficiency=efficiency,
                                time_limit_s=time_limit_s)
        return solution.assignment, solution.solver, solution.status
    built = build_intra_op_problem(graph, registry, info, mesh.tp, cluster, mesh, microbatch_size, dtype,
                                   efficiency=efficiency)
    ilp = solve_ilp(built.problem, time_limit_s=time_limit_s)
    return assignment_from_choice(built, ilp.choice), ilp.solver, ilp.status


def solve_tp(graph: CapturedGraph, registry: StrategyRegistry, info: Mapping, cluster: ClusterSpec, mesh: MeshShape,
             microbatch_size: int, dtype: str, efficiency: Efficiency, fold: bool, time_limit_s: float,
             fold_map: FoldedGraph | None = None) -> TpSolution:
    """The intra-op optimum for one (tp, microbatch) (`solve_assignment`), priced (`tp_solution`)."""
    assignment, solver, status = solve_assignment(graph, registry, info, cluster, mesh, microbatch_size, dtype,
                                                  efficiency, fold, time_limit_s, fold_map)
    return tp_solution(graph, registry, info, cluster, mesh, microbatch_size, assignment, dtype, efficiency,
                       solver, status)


def _keeping_features(options, placements: list) -> str:
    """The first strategy of a view that takes its feature-sharded inputs as they are, else "replicate"."""
    if not placements or any(p != FEAT for p in placements):
        return "replicate"
    return next((s.name for s in options if len(s.inputs) == len(placements)
                 and all(spec.placement == FEAT for spec in s.inputs)), "replicate")


def megatron_assignment(graph: CapturedGraph, registry: StrategyRegistry, tp: int, info: Mapping,
                        sequence_parallel: bool = False, roles: Mapping[str, str] | None = None) -> dict[str, str]:
    """Megatron-LM's tensor parallelism as an assignment: column for the projections into attention
    cores, MLP activations and the loss, row for those out of attention cores and column projections
    (`autoplan.capture.tp_roles`: by the data flow, so fused and differently named projections are found;
    where it finds no role, by name: q/k/v/fc/gate/up and lm_head column, o_proj/proj/down_proj row), vocab for embeddings and cross-entropy, heads for
    attention, ffn for MoE (expert under etp < tp, its only strategy), features for pointwise ops between
    column and row, replicate elsewhere (and wherever the wanted strategy is not valid at this tp).

    With `sequence_parallel` (Korthikanti et al. 2022): row projections and embeddings reduce-scatter
    along the sequence (row_sp, vocab_sp), norms and the pointwise ops of the residual stream run on
    sequence shards, and column projections all-gather their input. `roles`: `tp_roles(graph)` found before
    (it does not depend on tp)."""
    column = ("q_proj", "k_proj", "v_proj", "fc", "gate_proj", "up_proj", "lm_head")
    row = ("o_proj", "proj", "down_proj")
    roles = tp_roles(graph) if roles is None else roles  # by the data flow; the names above where it finds none
    wanted_by_kind = {"embedding": "vocab", "cross_entropy": "vocab", "attention": "heads", "moe": "ffn"}
    if sequence_parallel:
        wanted_by_kind |= {"embedding": "vocab_sp", "norm": "sequence"}
    assignment: dict[str, str] = {}
    output: dict[str, object] = {}
    options = graph_strategies(graph, registry, info, tp)  # asked once per distinct node shape
    tables: dict[int, tuple[dict, object]] = {}  # per distinct options list (alive in `options`): by name, fallback
    for node in graph.nodes:
        wanted = wanted_by_kind.get(node.op_kind, "replicate")
        if node.op_kind == "linear":
            leaf = node.module_path.rsplit(".", 1)[-1]
            role = roles.get(node.name) or ("column" if leaf in column else "row" if leaf in row else "replicate")
            wanted = ("row_sp" if sequence_parallel else "row") if role == "row" else role
        elif node.op_kind == "elementwise":
            placements = [output[u] for u in node.inputs]
            if placements and all(p == FEAT for p in placements):
                wanted = "features"
            elif sequence_parallel and SEQ in placements and FEAT not in placements:
                wanted = "sequence"
        elif node.op_kind == "view":  # between column and row (a Conv1D's reshapes, a dropout's copy): keep the shard
            wanted = _keeping_features(options[node.name], [output[u] for u in node.inputs])
        node_options = options[node.name]
        if id(node_options) not in tables:
            valid = {s.name: s for s in node_options}
            # a MoE under etp < tp has one strategy
            tables[id(node_options)] = (valid, valid.get("replicate") or next(iter(valid.values())))
        valid, fallback = tables[id(node_options)]
        chosen = valid.get(wanted, valid.get("row", fallback) if wanted == "row_sp" else fallback)
        assignment[node.name] = chosen.name
        output[node.name] = chosen.output
    return assignment


def fold_note(fold: bool, fold_map: FoldedGraph | None) -> str:
    """How the intra-op problem was solved, for the plan's notes."""
    if not fold or fold_map is None:
        return "unfolded (fold=False): one ILP over the whole graph"
    return f"folded: {fold_map.describe()}, each kind solved once per pair of boundary placements, then chained"
