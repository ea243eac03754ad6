"""Cost-model fidelity: published training runs priced by `autoplan estimate`, predicted against published
teraFLOP/s per GPU, each row with where it comes from.

    python benchmarks/fidelity.py                 # every row; benchmarks/out/fidelity.json and fidelity.png
    python benchmarks/fidelity.py --only llama    # the rows whose name holds "llama"
    python benchmarks/fidelity.py --only llama --layout solver   # Llama 3 with the solver's tp strategies

Rows (sources; what the source leaves unsaid is assumed the same way for every row of a group):

    megatron-*   Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
                 Megatron-LM", SC'21, Table 1: GPT 1.7B-1T on 32-3072 A100-80GB. Priced as
                 benchmarks/megatron_table1.py prices them (its `price_published`: Megatron-LM of 2021's
                 materialized attention and unoverlapped gradient all-reduce, equal chunks, ZeRO 0, full
                 recompute), with the paper's FLOP count (its equation 3).
    llama3-405b  Grattafiori et al., "The Llama 3 Herd of Models", arXiv 2407.21783, Table 4: 8,192 and
                 16,384 H100-80GB at sequence 8,192 and 16,384 at 131,072 (cp 16); tp 8, pp 16, 16M tokens
                 per batch; 430 / 400 / 380 TFLOP/s per GPU (BF16 MFU 43 / 41 / 38%). Section 3.3.2: the
                 interleaved schedule with one layer fewer on the first and the last stage, so that the first
                 chunk holds only the embedding and the last only the head: v = 8 chunks of one layer,
                 `--stage-layers 0,1*126,0`. Assumed: microbatch 1 (16M tokens over dp sequences of 8K is 32
                 or 16 per data-parallel rank: microbatches, as 1F1B needs them), ZeRO-1 (the paper shards
                 optimizer states and gradients; the runtime refuses ZeRO-2 with pp, and estimate applies the
                 same rule), and the least recompute (none, selective, full) that the memory model fits in
                 80 GB, full where none does (the paper does not say), and Megatron-Core's default gradient
                 bucket size (max(40M, 1M x dp) elements, `autoplan.grad_buckets`; the paper, under "numerical
                 stability", says gradients are accumulated and reduce-scattered in fp32, which the plan
                 precision bf16-master prices; the bucket size it does not say). Priced with Megatron-LM's tensor-
                 parallel layout with sequence parallelism (`plan_from_assignment`; section 3.3.2: column and row
                 projections, the norms on sequence shards), as the run had it; `--layout solver` prices them with
                 the intra-op solver's own strategies (`estimate`), solved for the tokens a rank holds (under cp
                 16 and microbatch 1, 8K of a 128K sequence). Predicted TFLOP/s per GPU =
                 predicted MFU x 989.4 TFLOP/s, the dense BF16 peak the paper's 430 = 43% implies.

Not here yet: a GPT-3 175B row from Megatron-LM's own examples (none found with a published throughput
that states its whole configuration).

Each row says whether the estimate fits the device (the memory model is issue 19's). The PNG plots
predicted against published with the 15% band. Goal (issue 16): at least 13 of every 16 within 15%.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))  # benchmarks/ as run by path: megatron_table1 beside it
import megatron_table1 as table1  # noqa: E402

from autoplan.api import capture_model, estimate, plan_from_assignment  # noqa: E402
from autoplan.cluster import parse_cluster  # noqa: E402
from autoplan.cost_model.compute import Efficiency  # noqa: E402
from autoplan.mesh import MeshShape  # noqa: E402
from autoplan.models import get_model_config  # noqa: E402
from autoplan.plan import Plan  # noqa: E402
from autoplan.solver.intra_op import megatron_assignment  # noqa: E402
from autoplan.strategies import default_registry  # noqa: E402

OUT = Path(__file__).parent / "out"
TOLERANCE = 0.15
H100_BF16_PEAK_TFLOPS = 989.4
LLAMA3 = "Grattafiori et al. 2024 (arXiv 2407.21783), Table 4"
RECOMPUTE_ORDER = ("none", "selective", "full")


@dataclass(frozen=True)
class Published:
    """One published run: its name, source, setup in words, throughput, and how to price it."""

    name: str
    source: str
    setup: str
    gpus: int
    tflops_per_gpu: float  # published
    price: Callable[[], tuple[Plan, float]]  # (plan, predicted TFLOP/s per GPU)


def megatron_rows() -> list[Published]:
    """SC'21 Table 1, priced by megatron_table1 (module docstring)."""
    def price(row) -> tuple[Plan, float]:
        plan = table1.price_published(row)
        return plan, row.tflops_per_gpu_at(plan.predicted.step_time_s)

    return [Published(f"megatron-{r.name}", "Narayanan et al., SC'21, Table 1",
                      f"GPT {r.name}, tp {r.tp} x pp {r.pp} (v {r.virtual_stages}), batch {r.batch}, A100",
                      r.gpus, r.tflops_per_gpu, lambda r=r: price(r)) for r in table1.ROWS]


# Llama 3's training stack ran on Meta's hosts: their dispatch of kernels is not the one measured here (autoplan's
# eager runtime on the lent H200, `cost_model.compute`), so it is not priced, as for Megatron-LM's runs; its gradient
# buckets are assumed Megatron-Core's default size (max(40M, 1M x dp) elements; the paper does not say), not this
# runtime's 25 MiB, which over 128 data ranks would be 466 latency-bound calls per step (`autoplan.grad_buckets`)
META_HOSTS = Efficiency(host_kernel_s=0.0, host_recompute_s=(), grad_buckets="megatron-core")


def llama3_price(gpus: int, cp: int, seq: int, layout: str = "megatron") -> tuple[Plan, float]:
    """Llama 3 405B on `gpus` H100 (module docstring), with Megatron-LM's tensor-parallel layout and sequence
    parallelism, as the run had it (`layout` "solver": the intra-op solver's): the least recompute that fits,
    else full."""
    config = dataclasses.replace(get_model_config("llama3-405b"), max_seq=max(seq, 8192))
    graph = capture_model(config, seq)
    mesh = MeshShape(pp=16, dp=gpus // (8 * 16 * cp), tp=8, cp=cp)
    assignment = megatron_assignment(graph, default_registry(), mesh.tp, config.rule_info(), sequence_parallel=True)
    batch, cluster = 16 * 2**20 // seq, parse_cluster(f"{gpus // 8}x8xh100")
    shared = dict(schedule="interleaved-1f1b", virtual_stages=8, stage_layers=(0,) + (1,) * 126 + (0,),
                  efficiency=META_HOSTS, precision="bf16-master")  # bf16 weights, fp32 masters, as Megatron-LM keeps them
    plans = []
    for recompute in RECOMPUTE_ORDER:
        if layout == "solver":
            plans.append(estimate(config, cluster, batch, seq, mesh=mesh, microbatch_size=1, zero_stage=1,
                                  recompute=recompute, graph=graph, **shared))
        else:
            plans.append(plan_from_assignment(graph, config, cluster, mesh, assignment, 1, batch // mesh.batch_shards,
                                              1, recompute, **shared))
        if plans[-1].predicted.peak_memory_bytes <= plans[-1].cluster.device.memory_bytes:
            break
    return plans[-1], plans[-1].predicted.mfu * H100_BF16_PEAK_TFLOPS


def llama3_rows(layout: str = "megatron") -> list[Published]:
    runs = ((8192, 1, 8192, 430.0), (16384, 1, 8192, 400.0), (16384, 16, 131072, 380.0))
    return [Published(f"llama3-405b-{gpus // 1024}k-seq{seq // 1024}k", LLAMA3,
                      f"tp 8 x cp {cp} x pp 16 (v 8, 0,1*126,0) x dp {gpus // (128 * cp)}, 16M tokens, H100"
                      + ("" if layout == "megatron" else f", {layout}'s tp layout"),
                      gpus, tflops, lambda g=gpus, c=cp, s=seq: llama3_price(g, c, s, layout))
            for gpus, cp, seq, tflops in runs]


def run(rows: list[Published], console: Console) -> list[dict]:
    results = []
    for row in rows:
        console.print(f"[dim]pricing {row.name} ...[/]")
        plan, predicted = row.price()
        results.append({"name": row.name, "source": row.source, "setup": row.setup, "gpus": row.gpus,
                        "published_tflops": row.tflops_per_gpu, "predicted_tflops": predicted,
                        "error": predicted / row.tflops_per_gpu - 1, "recompute": plan.recompute,
                        "step_s": plan.predicted.step_time_s,
                        "peak_memory_gb": plan.predicted.peak_memory_bytes / 1e9,
                        "fits": plan.predicted.peak_memory_bytes <= plan.cluster.device.memory_bytes})
    return results


def print_table(results: list[dict], console: Console) -> None:
    table = Table(title="published vs predicted teraFLOP/s per GPU", title_justify="left")
    for column in ("run", "source", "setup", "GPUs", "published", "predicted", "error", "recompute", "memory GB"):
        table.add_column(column, justify="right" if column in ("GPUs", "published", "predicted", "error",
                                                               "memory GB") else "left")
    for r in results:
        colour = "green" if abs(r["error"]) <= TOLERANCE else "red"
        table.add_row(r["name"], r["source"], r["setup"], str(r["gpus"]), f"{r['published_tflops']:.0f}",
                      f"{r['predicted_tflops']:.1f}", f"[{colour}]{r['error']:+.1%}[/]", r["recompute"],
                      f"{r['peak_memory_gb']:.1f}{'' if r['fits'] else ' (over)'}")
    console.print(table)


def plot(results: list[dict], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(6.5, 6))
    top = 1.15 * max(max(r["published_tflops"], r["predicted_tflops"]) for r in results)
    ax.plot([0, top], [0, top], color="black", linewidth=1, label="predicted = published")
    ax.fill_between([0, top], [0, top * (1 - TOLERANCE)], [0, top * (1 + TOLERANCE)], color="grey", alpha=0.2,
                    label=f"within {TOLERANCE:.0%}")
    for group, marker in (("megatron", "o"), ("llama3", "s")):
        mine = [r for r in results if r["name"].startswith(group)]
        ax.scatter([r["published_tflops"] for r in mine], [r["predicted_tflops"] for r in mine], marker=marker,
                   label=mine[0]["source"] if mine else group)
        for r in mine:
            ax.annotate(r["name"].split("-", 1)[1], (r["published_tflops"], r["predicted_tflops"]), fontsize=7,
                        xytext=(3, 3), textcoords="offset points")
    ax.set(xlim=(0, top), ylim=(0, top), xlabel="published TFLOP/s per GPU", ylabel="predicted TFLOP/s per GPU",
           title="autoplan estimate of published training runs")
    ax.legend(fontsize="small", loc="upper left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="price only the rows whose name holds this text")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--layout", choices=("megatron", "solver"), default="megatron",
                        help="Llama 3's tensor-parallel strategies: Megatron-LM's, as the run had them, or the "
                             "intra-op solver's (estimate)")
    args = parser.parse_args(argv)
    console = Console(width=220)
    rows = [r for r in megatron_rows() + llama3_rows(args.layout) if not args.only or args.only in r.name]
    results = run(rows, console)
    print_table(results, console)
    within = sum(abs(r["error"]) <= TOLERANCE for r in results)
    console.print(f"within {TOLERANCE:.0%}: {within} of {len(results)} "
                  f"(issue 16's goal: 13 of every 16, {13 / 16:.0%}); mean error "
                  f"{sum(r['error'] for r in results) / len(results):+.1%}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "fidelity.json").write_text(json.dumps(results, indent=1))
    plot(results, args.out / "fidelity.png")
    console.print(f"wrote {args.out / 'fidelity.json'} and {args.out / 'fidelity.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
