"""Search time against depth: folded (TAPAS blocks + chain DP) against one ILP over the unfolded graph.

    python benchmarks/search_scaling.py                        # 12, 24, 48, 96 layers + Llama-3-8B
    python benchmarks/search_scaling.py --layers 12 24 --max-unfolded-layers 24 --ilp-time-limit 60

GPT-3 shapes (hidden 12288, 96 heads, seq 2048) at each depth on 16 nodes x 8 H100:

    one point   dp=16 x tp=8, microbatch 1: capture, fold, the folded intra-op solve (every kind of
                block once per pair of boundary placements, then the chain), and the unfolded one
                (build the whole problem, one ILP), both with HiGHS's LP relaxation first and with
                branch and bound only (`relaxation_first=False`, the classic Alpa solve); objectives
                (seconds per microbatch) and ILP statuses;
    grid        the intra-op work of a search: every (tp, microbatch) a global batch of 128 allows
                (pp = cp = ep = 1; 10 points), folded (fold once, then the tables per point) and
                unfolded (one ILP per point).

For information, at each depth: the whole search over that cluster (`search_plans` with the graph
already captured: every mesh, microbatch, ZeRO stage, recompute policy and schedule, each intra-op point
solved folded, then priced by the step model), the minimum over two runs.

Then the Llama-3-8B shape (32 layers, hidden 4096, seq 2048) on 8 x 8 H100 as dp=8 x tp=8, end to end
through `autoplan.api.estimate` (capture, fold, solve, price, Plan), and the whole `search` over
that cluster. Each GPT figure is the minimum over `--repeat` runs. The table shows process CPU
seconds, the stable figure on a shared machine (HiGHS runs on one thread); search_scaling.json has
wall seconds too, and the goals table shows both.

Goals (issue 4): folded search (fold + the folded intra-op solve: what folding speeds up; capture and
the whole outer search are shown beside it) at 96 layers <= 1.3x its time at 24 layers; >= 50x faster than the
unfolded one at 96 layers; same objective within 0.1%; Llama-3-8B end to end < 5 s. Issue 16: the whole
search (every mesh, stages of unequal size among them) at 96 layers <= 1.3x its time at 24. Prints a table and
draws time against layers (log scale) to benchmarks/out/search_scaling.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import NullFormatter  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from autoplan.cluster import parse_cluster  # noqa: E402
from autoplan.cost_model.intra_op_problem import build_intra_op_problem  # noqa: E402
from autoplan.capture.blocks import fold_graph
from autoplan.solver.folded import solve_folded  # noqa: E402
from autoplan.mesh import MeshShape  # noqa: E402
from autoplan.models import get_model_config  # noqa: E402
from autoplan.api import capture_model, estimate, search, search_plans  # noqa: E402
from autoplan.solver.ilp import solve_ilp  # noqa: E402
from autoplan.strategies import default_registry  # noqa: E402

SEQ = 2048
GPT_CLUSTER, GPT_MESH, GPT_BATCH = "16x8xh100", MeshShape(dp=16, tp=8), 128
LLAMA_CLUSTER, LLAMA_MESH, LLAMA_BATCH = "8x8xh100", MeshShape(dp=8, tp=8), 64


class Clock:
    """Wall and process CPU seconds of a block: `with Clock() as c: ...; c.wall_s, c.cpu_s`. As `timeit`
    does, the cyclic garbage collector is kept off during the block: a full collection over a captured
    graph's objects takes milliseconds and would land at random in the ~8 ms solves."""

    def __enter__(self) -> "Clock":
        self._enabled = gc.isenabled()
        gc.disable()
        self._wall, self._cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc) -> None:
        self.wall_s, self.cpu_s = time.perf_counter() - self._wall, time.process_time() - self._cpu
        if self._enabled:
            gc.enable()


def grid(cluster, global_batch: int) -> list[tuple[MeshShape, int]]:
    """The intra-op points a search visits (pp = cp = ep = 1): tp dividing the GPUs per node, dp the rest
    of the world, microbatch dividing the sequences per dp rank."""
    points = []
    for tp in (d for d in range(1, cluster.gpus_per_node + 1) if cluster.gpus_per_node % d == 0):
        dp = cluster.world_size // tp
        if global_batch % dp == 0:
            per_rank = global_batch // dp
            points += [(MeshShape(dp=dp, tp=tp), m) for m in range(1, per_rank + 1) if per_rank % m == 0]
    return points


def unfolded_solve(graph, registry, info, cluster, mesh, microbatch, time_limit_s, relaxation_first=True):
    built = build_intra_op_problem(graph, registry, info, mesh.tp, cluster, mesh, microbatch)
    return solve_ilp(built.problem, time_limit_s=time_limit_s, relaxation_first=relaxation_first)


def gpt_row(layers: int, unfolded: bool, time_limit_s: float, with_grid: bool, repeat: int) -> dict:
    config = dataclasses.replace(get_model_config("gpt3-175b"), name=f"gpt3-{layers}l", num_layers=layers)
    cluster, registry, info = parse_cluster(GPT_CLUSTER), default_registry(), config.rule_info()
    row: dict = {"layers": layers}

    def timed(key: str, fn, runs: int = repeat):
        """fn's result; its wall and CPU seconds, each the minimum over `runs` runs (a shared machine)."""
        walls, cpus = [], []
        for _ in range(runs):
            with Clock() as c:
                result = fn()
            walls.append(c.wall_s)
            cpus.append(c.cpu_s)
        row[key + "_s"], row[key + "_cpu_s"] = min(walls), min(cpus)
        return result

    graph = timed("capture", lambda: capture_model(config, SEQ))
    # capture computes each node's structural label with its record (capture time includes it)
    folded = timed("fold", lambda: fold_graph(graph))
    row.update(nodes=len(graph.nodes), kinds=folded.num_kinds)
    sol = timed("folded", lambda: solve_folded(folded, registry, info, cluster, GPT_MESH, 1, time_limit_s=time_limit_s))
    row.update(folded_objective_s=sol.objective, folded_status=sol.status, block_ilps=sol.num_ilps)
    points = grid(cluster, GPT_BATCH)
    if with_grid:
        timed("grid_folded", lambda: [solve_folded(fold_graph(graph), registry, info, cluster, mesh, m,
                                                   time_limit_s=time_limit_s) for mesh, m in points[:1]]
              + [solve_folded(folded, registry, info, cluster, mesh, m, time_limit_s=time_limit_s)
                 for mesh, m in points[1:]])
        row["grid_points"] = len(points)
    if with_grid:
        def whole_search():
            return search_plans(config, GPT_CLUSTER, GPT_BATCH, SEQ, graph=graph, info=info, baselines=False,
                                time_limit_s=time_limit_s)
        found = timed("whole_search", whole_search, runs=min(repeat, 2))
        stats = found.stats  # what the search visits grows with depth (more pp values, more that cannot fit)
        row.update(whole_search_mesh=str(found.plans[0].mesh), whole_search_configs=stats.configurations,
                   whole_search_priced=stats.priced, whole_search_cannot_fit=stats.cannot_fit,
                   whole_search_pruned_by_time=stats.pruned_by_time)
    if unfolded:
        ilp = timed("unfolded", lambda: unfolded_solve(graph, registry, info, cluster, GPT_MESH, 1, time_limit_s))
        row.update(unfolded_objective_s=ilp.objective, unfolded_status=ilp.status)
        bb = timed("unfolded_bb", lambda: unfolded_solve(graph, registry, info, cluster, GPT_MESH, 1, time_limit_s,
                                                         relaxation_first=False))
        row.update(unfolded_bb_objective_s=bb.objective, unfolded_bb_status=bb.status)
        if with_grid:
            timed("grid_unfolded", lambda: [unfolded_solve(graph, registry, info, cluster, mesh, m, time_limit_s)
                                            for mesh, m in points])
    return row


def llama_rows(time_limit_s: float, full_search: bool) -> dict:
    config = get_model_config("llama3-8b")
    row: dict = {}
    with Clock() as c:
        plan = estimate(config, LLAMA_CLUSTER, LLAMA_BATCH, SEQ, mesh=LLAMA_MESH, microbatch_size=1, zero_stage=1,
                        recompute="selective", time_limit_s=time_limit_s)
    row.update(estimate_s=c.wall_s, estimate_cpu_s=c.cpu_s, estimate_step_s=plan.predicted.step_time_s,
               estimate_solver=plan.provenance.solver)
    if full_search:
        with Clock() as c:
            best = search(config, LLAMA_CLUSTER, LLAMA_BATCH, SEQ, time_limit_s=time_limit_s)
        row.update(search_s=c.wall_s, search_cpu_s=c.cpu_s, search_mesh=str(best.mesh),
                   search_step_s=best.predicted.step_time_s)
    return row


def _cpu(row: dict, key: str) -> str:
    return f"{row[key + '_cpu_s']:.3f}" if key + "_cpu_s" in row else "-"


def _fold_solve(row: dict, suffix: str) -> float:
    return row["fold" + suffix] + row["folded" + suffix]


def print_table(console: Console, rows: list[dict]) -> None:
    table = Table(title=f"GPT-3 shapes (hidden 12288, seq {SEQ}) on {GPT_CLUSTER}: process CPU seconds (wall in "
                        f"search_scaling.json); one point = {GPT_MESH}, microbatch 1; grid = every (tp, microbatch) "
                        f"of global batch {GPT_BATCH}")
    for column in ("layers", "nodes", "kinds", "capture", "fold", "folded solve", "fold+solve", "unfolded",
                   "unfolded B&B only", "speedup", "grid: folded", "grid: unfolded", "grid speedup",
                   "whole search", "folded obj (ms)", "unfolded obj (ms)", "rel diff", "status f/u/bb"):
        table.add_column(column, justify="right")
    for r in rows:
        has_u, has_grid = "unfolded_s" in r, "grid_folded_s" in r
        table.add_row(
            str(r["layers"]), str(r["nodes"]), str(r["kinds"]), _cpu(r, "capture"), _cpu(r, "fold"), _cpu(r, "folded"),
            f"{_fold_solve(r, '_cpu_s'):.3f}", _cpu(r, "unfolded"), _cpu(r, "unfolded_bb"),
            f"{r['unfolded_cpu_s'] / _fold_solve(r, '_cpu_s'):.0f}x / {r['unfolded_bb_cpu_s'] / _fold_solve(r, '_cpu_s'):.0f}x"
            if has_u else "-",
            _cpu(r, "grid_folded"), _cpu(r, "grid_unfolded"),
            f"{r['grid_unfolded_cpu_s'] / r['grid_folded_cpu_s']:.0f}x" if has_u and has_grid else "-",
            _cpu(r, "whole_search"),
            f"{r['folded_objective_s'] * 1e3:.6f}", f"{r['unfolded_objective_s'] * 1e3:.6f}" if has_u else "-",
            f"{r['folded_objective_s'] / r['unfolded_objective_s'] - 1:+.1e}" if has_u else "-",
            "/".join(x[:3] for x in (r["folded_status"], r.get("unfolded_status", "-"), r.get("unfolded_bb_status", "-"))))
    console.print(table)


def goals(rows: list[dict], llama: dict) -> list[tuple[str, str, bool | None]]:
    by = {r["layers"]: r for r in rows}
    found: list[tuple[str, str, bool | None]] = []
    if 24 in by and 96 in by:
        measures = [("fold + solve, one point", lambda r, x: _fold_solve(r, x)),
                    ("capture + fold + solve, one point", lambda r, x: r["capture" + x] + _fold_solve(r, x))]
        if "grid_folded_s" in by[24] and "grid_folded_s" in by[96]:
            measures.append((f"intra-op search over the grid ({by[96]['grid_points']} points)",
                             lambda r, x: r["grid_folded" + x]))
        for label, value in measures:
            for unit, x in (("cpu", "_cpu_s"), ("wall", "_s")):
                ratio = value(by[96], x) / value(by[24], x)
                found.append((f"{label}: 96 layers <= 1.3x 24 layers ({unit})", f"{ratio:.2f}x", ratio <= 1.3))
    if 96 in by and "unfolded_s" in by[96]:
        r = by[96]
        for label, key in (("unfolded (LP relaxation first)", "unfolded"), ("unfolded, branch and bound only", "unfolded_bb")):
            for unit, x in (("cpu", "_cpu_s"), ("wall", "_s")):
                speedup = r[key + x] / _fold_solve(r, x)
                found.append((f"folded >= 50x faster than {label} at 96 layers, one point ({unit})", f"{speedup:.0f}x",
                              speedup >= 50))
        if "grid_unfolded_s" in r:
            speedup = r["grid_unfolded_cpu_s"] / r["grid_folded_cpu_s"]
            found.append(("folded >= 50x faster than unfolded at 96 layers, grid (cpu)", f"{speedup:.0f}x", speedup >= 50))
    for r in rows:
        if "unfolded_objective_s" in r:
            diff = max(abs(r["folded_objective_s"] / r[k] - 1) for k in ("unfolded_objective_s", "unfolded_bb_objective_s"))
            cut = [s for s in (r["unfolded_status"], r["unfolded_bb_status"]) if s != "optimal"]
            note = f" (unfolded ILP {cut}: cut by its time limit)" if cut else ""
            found.append((f"same objective within 0.1% at {r['layers']} layers", f"{diff:.1e}{note}", diff <= 1e-3))
    if 24 in by and 96 in by and "whole_search_s" in by[24] and "whole_search_s" in by[96]:
        ratio = by[96]["whole_search_cpu_s"] / by[24]["whole_search_cpu_s"]
        visits = "; ".join(f"{n} layers: {by[n]['whole_search_configs']} configurations, {by[n]['whole_search_priced']} "
                           f"priced, {by[n]['whole_search_cannot_fit']} unable to fit" for n in (24, 96))
        found.append(("whole search, graph captured, uneven stages in the space: 96 layers <= 1.3x 24 layers (cpu; "
                      "issue 16)", f"{ratio:.2f}x (cpu {by[24]['whole_search_cpu_s']:.2f} s -> "
                      f"{by[96]['whole_search_cpu_s']:.2f} s; {visits})", ratio <= 1.3))
    if llama:
        found.append(("Llama-3-8B on 8x8 (dp8 x tp8), end to end (estimate) < 5 s (wall)", f"{llama['estimate_s']:.2f} s "
                      f"(cpu {llama['estimate_cpu_s']:.2f} s)", llama["estimate_s"] < 5))
        if "search_s" in llama:
            found.append(("Llama-3-8B, whole search over 8x8xh100 (information)", f"{llama['search_s']:.2f} s "
                          f"(cpu {llama['search_cpu_s']:.2f} s), best {llama['search_mesh']}", None))
    return found


def plot(rows: list[dict], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(10, 4.5))
    layers = [r["layers"] for r in rows]
    series = [("capture", lambda r: r["capture_cpu_s"]), ("fold + folded solve", lambda r: _fold_solve(r, "_cpu_s")),
              ("capture + fold + folded solve", lambda r: r["capture_cpu_s"] + _fold_solve(r, "_cpu_s"))]
    for label, value in series:
        ax.plot(layers, [value(r) for r in rows], marker="o", label=label)
    for key, label in (("unfolded", "unfolded: build + one ILP (LP relaxation first)"),
                       ("unfolded_bb", "unfolded: build + branch and bound only"),
                       ("grid_folded", "grid: fold + folded solve per (tp, microbatch)"),
                       ("grid_unfolded", "grid: unfolded per (tp, microbatch)"),
                       ("whole_search", "whole search (graph captured)")):
        done = [r for r in rows if key + "_s" in r]
        if done:
            ax.plot([r["layers"] for r in done], [r[key + "_cpu_s"] for r in done], marker="s", linestyle="--",
                    label=label)
    ax.set(xscale="log", yscale="log", xlabel="layers", ylabel="process CPU seconds", xticks=layers,
           title="GPT-3 shapes on 16x8xh100: intra-op search time")
    ax.set_xticklabels([str(n) for n in layers])
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="center left", bbox_to_anchor=(1.02, 0.5), fontsize="small")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[12, 24, 48, 96])
    parser.add_argument("--max-unfolded-layers", type=int, default=96, help="skip the unfolded ILP above this depth")
    parser.add_argument("--ilp-time-limit", type=float, default=600.0, help="seconds per ILP (the unfolded one included)")
    parser.add_argument("--no-llama", action="store_true", help="skip the Llama-3-8B end-to-end runs")
    parser.add_argument("--no-full-search", action="store_true", help="skip the whole search over 8x8xh100")
    parser.add_argument("--no-grid", action="store_true", help="skip the solves over every (tp, microbatch) point")
    parser.add_argument("--repeat", type=int, default=3, help="runs per measurement; the minimum is kept")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "out")
    args = parser.parse_args()
    console = Console(width=240)
    capture_model(get_model_config("tiny-gpt"), 16)  # warm up: the first meta init imports torch._dynamo (~3 s)
    rows = []
    for layers in args.layers:
        rows.append(gpt_row(layers, layers <= args.max_unfolded_layers, args.ilp_time_limit, not args.no_grid,
                            args.repeat))
        console.print(f"[dim]{layers} layers done: {json.dumps({k: v for k, v in rows[-1].items()}, default=str)}[/dim]")
    llama = {} if args.no_llama else llama_rows(args.ilp_time_limit, not args.no_full_search)
    print_table(console, rows)
    table = Table(title="goals")
    for column in ("goal", "measured", "met"):
        table.add_column(column)
    for goal, measured, met in goals(rows, llama):
        table.add_row(goal, measured, "-" if met is None else ("yes" if met else "NO"))
    console.print(table)
    path = args.out / "search_scaling.png"
    plot(rows, path)
    (args.out / "search_scaling.json").write_text(json.dumps({"gpt3": rows, "llama3_8b": llama}, indent=1))
    console.print(f"plot: {path}")


if __name__ == "__main__":
    main()
