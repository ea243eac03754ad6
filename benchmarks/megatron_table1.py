"""Megatron-LM's Table 1, priced by autoplan: predicted against published teraFLOP/s per GPU.

    python benchmarks/megatron_table1.py                  # all ten rows, with the planner's own choice
    python benchmarks/megatron_table1.py --rows 1.7B 1T --no-search

The ten weak-scaling configurations of Narayanan et al., "Efficient Large-Scale Language Model Training
on GPU Clusters Using Megatron-LM" (SC'21), Table 1: GPT models of 1.7B to 1T parameters on 32 to 3072
A100-80GB (DGX A100: 8 per node, NVLink, 8 HDR InfiniBand cards per node = the `a100` preset), sequence
2048, vocabulary 51,200, microbatch 1, fp16 mixed precision, full activation recomputation, and for
pp > 1 the interleaved 1F1B schedule with the scatter / gather optimisation (section 5.1).

Each row is priced by `autoplan.api.estimate` (what `autoplan estimate` runs: the intra-op solver picks the
tensor-parallel strategies) as a GPT `ModelConfig` (family gpt, ffn 4h, learned positions), on the
software the paper ran, which is part of what was measured (`MEGATRON_2021`):

    attention    materialized: QK^T and PV batched GEMMs with the T x T scores in HBM, a fused
                 scale-mask-softmax and attention dropout (0.1): FlashAttention came a year later
    gradients    all-reduced after the whole backward, not overlapped with it (Megatron-LM's local DDP)

Everything else is the one global cost model (`autoplan.cost_model`), the same for every row: no
per-row factor. Two things the paper does not state are assumed, the same way for every row: the
number of model chunks v of the interleaved schedule (the smallest v >= 2 that divides the layers per
stage; Table 1 lists none) and ZeRO stage 0 (Megatron-LM of 2021 kept full optimizer states). The
layers are split evenly over the chunks, as Megatron-LM of 2021 did (`Row.stage_layers`; the stage
search would weigh the head and move layers off the last stage).

FLOPs are counted as the paper does (its equation 3, recomputation included):

    F = 96 B s l h^2 (1 + s / (6 h) + V / (16 l h))  per iteration;  teraFLOP/s per GPU = F / (step_s * GPUs)

Columns: "estimate" is the goal's number; "as run" prices the paper's own tensor-parallel layout
(Megatron-LM of 2021: column / row projections, no sequence parallelism, which the intra-op solver
prefers when it is faster), for a like-for-like comparison. "planner" is `autoplan.api.search` on the same
cluster, batch, sequence and software: its choice and its predicted step time against the published
configuration's (issue 5: the choice must be predicted at least as fast; speedup >= 1.00).

Goal (issue 3): the estimate within 15% of the published figure on at least 8 of the 10 rows. Writes
benchmarks/out/megatron_table1.json.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from autoplan.cluster import ClusterSpec, parse_cluster
from autoplan.cost_model.compute import AttentionKernel, Efficiency
from autoplan.mesh import MeshShape
from autoplan.models.config import ModelConfig
from autoplan.plan import Plan
from autoplan.api import capture_model, estimate, plan_from_assignment, search
from autoplan.solver.intra_op import megatron_assignment
from autoplan.strategies import default_registry

OUT = Path(__file__).parent / "out"
SEQ, VOCAB, DTYPE = 2048, 51200, "float16"
TOLERANCE = 0.15  # the goal: |predicted / published - 1| <= 15% ...
GOAL_ROWS = 8  # ... on at least 8 of the 10 rows
# Megatron-LM of 2021 as it ran: materialized attention with dropout, the gradient all-reduce after backward,
# and its hosts' dispatch and recomputation bookkeeping not priced (host_kernel_s = 0, host_recompute_s = ()): what
# `cost_model.compute` measured is autoplan's own eager runtime on the lent H200's host; Megatron-LM's fused kernels on its DGX hosts were not measured here
MEGATRON_2021 = Efficiency(attention=AttentionKernel("materialized", dropout=True), overlap_grad_reduce=False,
                           host_kernel_s=0.0, host_recompute_s=())


@dataclass(frozen=True)
class Row:
    """One row of Table 1 as published: model shape, parallel degrees, GPUs, batch, achieved throughput."""

    name: str
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    batch: int
    tflops_per_gpu: float  # published teraFLOP/s per GPU
    percent_of_peak: int  # published, of the A100's 312 teraFLOP/s

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)

    @property
    def virtual_stages(self) -> int:
        """The smallest v >= 2 dividing the layers per stage (module docstring); 1 without pipelining."""
        if self.pp == 1:
            return 1
        per_stage = self.layers // self.pp
        return min(v for v in range(2, per_stage + 1) if per_stage % v == 0) if per_stage > 1 else 1

    @property
    def stage_layers(self) -> tuple[int, ...] | None:
        """Equal chunks, layers / (pp v) each (module docstring); None without pipelining."""
        chunks = self.pp * self.virtual_stages
        return (self.layers // chunks,) * chunks if self.pp > 1 else None

    @property
    def schedule(self) -> str:
        return "interleaved-1f1b" if self.virtual_stages > 1 else "1f1b"

    def config(self) -> ModelConfig:
        return ModelConfig(f"megatron-{self.name.lower()}", "gpt", self.layers, self.hidden, self.heads, self.heads,
                           4 * self.hidden, VOCAB, SEQ)

    def cluster(self) -> ClusterSpec:
        return parse_cluster(f"{self.gpus // 8}x8xa100")

    def mesh(self) -> MeshShape:
        return MeshShape(pp=self.pp, dp=self.dp, tp=self.tp)

    def paper_flops(self) -> float:
        """Equation 3 of Narayanan et al.: FLOPs per iteration, recomputation included."""
        b, s, l, h, v = self.batch, SEQ, self.layers, self.hidden, VOCAB
        return 96 * b * s * l * h**2 * (1 + s / (6 * h) + v / (16 * l * h))

    def tflops_per_gpu_at(self, step_time_s: float) -> float:
        return self.paper_flops() / (step_time_s * self.gpus) / 1e12


# Narayanan et al., SC'21, Table 1 (heads, hidden, layers, t, p, GPUs, batch, teraFLOP/s per GPU, % of peak)
ROWS = (
    Row("1.7B", 24, 2304, 24, 1, 1, 32, 512, 137, 44),
    Row("3.6B", 32, 3072, 30, 2, 1, 64, 512, 138, 44),
    Row("7.5B", 32, 4096, 36, 4, 1, 128, 512, 142, 46),
    Row("18B", 48, 6144, 40, 8, 1, 256, 1024, 135, 43),
    Row("39B", 64, 8192, 48, 8, 2, 512, 1536, 138, 44),
    Row("76B", 80, 10240, 60, 8, 4, 1024, 1792, 140, 45),
    Row("145B", 96, 12288, 80, 8, 8, 1536, 2304, 148, 47),
    Row("310B", 128, 16384, 96, 8, 16, 1920, 2160, 155, 50),
    Row("530B", 128, 20480, 105, 8, 35, 2520, 2520, 163, 52),
    Row("1T", 160, 25600, 128, 8, 64, 3072, 3072, 163, 52),
)


def price_published(row: Row, graph=None) -> Plan:
    """The published configuration through `autoplan.api.estimate` (module docstring)."""
    return estimate(row.config(), row.cluster(), row.batch, SEQ, mesh=row.mesh(), microbatch_size=1, zero_stage=0,
                    recompute="full", dtype=DTYPE, efficiency=MEGATRON_2021, graph=graph, schedule=row.schedule,
                    virtual_stages=row.virtual_stages, stage_layers=row.stage_layers)


def price_as_run(row: Row, graph) -> Plan:
    """The published configuration with Megatron-LM's 2021 tensor-parallel layout (no sequence parallelism)."""
    config = row.config()
    assignment = megatron_assignment(graph, default_registry(), row.tp, config.rule_info(), sequence_parallel=False)
    return plan_from_assignment(graph, config, row.cluster(), row.mesh(), assignment, 1, row.batch // row.dp, 0, "full",
                                dtype=DTYPE, efficiency=MEGATRON_2021, schedule=row.schedule,
                                virtual_stages=row.virtual_stages, stage_layers=row.stage_layers)


def describe(plan: Plan) -> str:
    virtual = len({s.chunk for s in plan.stages})
    schedule = "" if plan.mesh.pp == 1 else (" 1F1B" if virtual == 1 else f" v={virtual}")
    return f"{plan.mesh} mbs{plan.microbatch_size} Z{plan.zero_stage} {plan.recompute[:3]}{schedule}"


def run_row(row: Row, with_search: bool = True) -> dict:
    start = time.perf_counter()
    graph = capture_model(row.config(), SEQ, DTYPE)
    published = price_published(row, graph)
    as_run = price_as_run(row, graph)
    predicted = row.tflops_per_gpu_at(published.predicted.step_time_s)
    result = {
        "row": asdict(row), "virtual_stages": row.virtual_stages, "paper_flops": row.paper_flops(),
        "step_s": published.predicted.step_time_s, "predicted_tflops": predicted,
        "error": predicted / row.tflops_per_gpu - 1, "time": asdict(published.predicted.time),
        "peak_memory_gb": published.predicted.peak_memory_bytes / 1e9,
        "as_run_step_s": as_run.predicted.step_time_s,
        "as_run_tflops": row.tflops_per_gpu_at(as_run.predicted.step_time_s),
    }
    result["as_run_error"] = result["as_run_tflops"] / row.tflops_per_gpu - 1
    if with_search:
        chosen = search(row.config(), row.cluster(), row.batch, SEQ, dtype=DTYPE, efficiency=MEGATRON_2021)
        result.update(planner=describe(chosen), planner_step_s=chosen.predicted.step_time_s,
                      speedup=published.predicted.step_time_s / chosen.predicted.step_time_s)
    result["wall_s"] = time.perf_counter() - start
    return result


def print_table(results: list[dict], console: Console) -> None:
    table = Table(title="Megatron-LM SC'21 Table 1: predicted vs published teraFLOP/s per GPU (A100, paper's FLOP count)",
                  title_justify="left")
    for column in ("model", "GPUs", "t x p (v)", "batch", "published", "estimate", "error", "as run", "error ",
                   "step s", "planner's choice", "its step s", "speedup"):
        table.add_column(column, justify="left" if column in ("model", "planner's choice") else "right")
    for r in results:
        row = r["row"]
        within = abs(r["error"]) <= TOLERANCE
        table.add_row(row["name"], str(row["gpus"]), f"{row['tp']} x {row['pp']} ({r['virtual_stages']})", str(row["batch"]),
                      f"{row['tflops_per_gpu']:.0f} ({row['percent_of_peak']}%)", f"{r['predicted_tflops']:.1f}",
                      f"[{'green' if within else 'red'}]{r['error']:+.1%}[/]", f"{r['as_run_tflops']:.1f}",
                      f"{r['as_run_error']:+.1%}", f"{r['step_s']:.2f}", r.get("planner", "-"),
                      f"{r['planner_step_s']:.2f}" if "planner_step_s" in r else "-",
                      f"{r['speedup']:.2f}x" if "speedup" in r else "-")
    console.print(table)


def summary(results: list[dict]) -> dict:
    within = sum(abs(r["error"]) <= TOLERANCE for r in results)
    as_run = sum(abs(r["as_run_error"]) <= TOLERANCE for r in results)
    searched = [r for r in results if "speedup" in r]
    return {"rows": len(results), "within_15pct": within, "as_run_within_15pct": as_run,
            "goal_met": within >= GOAL_ROWS if len(results) == len(ROWS) else None,
            "mean_error": sum(r["error"] for r in results) / len(results),
            "max_abs_error": max(abs(r["error"]) for r in results),
            "planner_at_least_as_fast": all(r["speedup"] >= 1 - 1e-9 for r in searched) if searched else None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", nargs="*", choices=[r.name for r in ROWS], help="rows to price (default: all)")
    parser.add_argument("--no-search", action="store_true", help="skip the planner's own choice")
    args = parser.parse_args(argv)
    console = Console(width=200)
    rows = [r for r in ROWS if not args.rows or r.name in args.rows]
    results = []
    for row in rows:
        console.print(f"[dim]pricing {row.name} on {row.gpus} GPUs ...[/]")
        results.append(run_row(row, with_search=not args.no_search))
    print_table(results, console)
    totals = summary(results)
    console.print(f"within 15%: {totals['within_15pct']} of {totals['rows']} (goal: {GOAL_ROWS} of {len(ROWS)}); "
                  f"as run: {totals['as_run_within_15pct']}; mean error {totals['mean_error']:+.1%}, "
                  f"largest {totals['max_abs_error']:.1%}")
    if totals["planner_at_least_as_fast"] is not None:
        console.print(f"planner's choice predicted at least as fast as the published configuration on every row: "
                      f"{totals['planner_at_least_as_fast']}")
    OUT.mkdir(exist_ok=True)
    (OUT / "megatron_table1.json").write_text(json.dumps({"results": results, "summary": totals}, indent=1))
    return 0 if totals["goal_met"] in (True, None) else 1


if __name__ == "__main__":
    raise SystemExit(main())
