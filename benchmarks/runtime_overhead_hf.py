"""Runtime overhead on a transformers model: one training step of autoplan's runtime for your own
module against the same model under transformers' own tensor-parallel plan, on CPU with gloo.

    python benchmarks/runtime_overhead.py --model hf        # 4 ranks (this file does the work)
    python benchmarks/runtime_overhead.py --model hf --rounds 6 --steps 3

Model: `transformers.LlamaConfig` at the size of runtime_overhead.py's small-llama (4 layers, hidden
512, 8 heads of which 4 key/value heads, FFN 1536, vocabulary 8192, untied embeddings), built once
with seed 0 and written with save_pretrained into a temporary directory; batch 2 x 256 tokens, fp32,
AdamW, 4 ranks. Every method loads that directory and trains on the same tokens:

    transformers     from_pretrained(DIR, distributed_config=DistributedConfig(tp_plan="auto")):
                     the model's `base_model_tp_plan` over tp=4 (column q/k/v, gate and up, row o
                     and down, vocabulary-split embedding, lm_head split and its logits gathered
                     whole on every rank, the loss computed whole); zero_grad, model(input_ids,
                     labels=input_ids).loss, backward, AdamW step. Needs `accelerate` (dev extra).
    autoplan tp4     autoplan.parallelize(DIR, plan=...) with the Megatron assignment at tp=4 (the
                     same layout, but vocabulary-parallel cross-entropy instead of gathered logits)
                     -> ModuleProgram.train_step (which also checks the loss and gradient norm)
    autoplan tp4 sp  the same with sequence parallelism (norms and residuals on sequence shards)
    autoplan plan    the plan the planner picks for this model on 1x4xcpu (search_module_plans)

Timing as in runtime_overhead.py (`time_alternating`): median and quartiles of rank 0's wall time
per step and the median CPU time; overhead = median(autoplan tp4) / median(transformers) - 1.
Writes benchmarks/out/runtime_overhead_hf.json.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import tempfile
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from runtime_overhead import OUT, _free_port, _summary, join_gloo, time_alternating

WORLD, SEQ, BATCH, SEED, LR = 4, 256, 2, 0, 1e-4


def small_llama_hf():
    """The transformers twin of runtime_overhead.small_llama (module docstring)."""
    from transformers import LlamaConfig

    return LlamaConfig(num_hidden_layers=4, hidden_size=512, num_attention_heads=8, num_key_value_heads=4,
                       intermediate_size=1536, vocab_size=8192, max_position_embeddings=SEQ,
                       tie_word_embeddings=False)


def write_checkpoint(directory: Path) -> None:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(SEED)
    AutoModelForCausalLM.from_config(small_llama_hf(), dtype=torch.float32).save_pretrained(directory)


def plans(directory: Path) -> dict:
    """{method: Plan} for the autoplan methods, made by the planner (module docstring)."""
    from autoplan.api import hf_model_on_meta, plan_from_assignment, search_module_plans
    from autoplan.capture.hf import capture_hf_for_planner
    from autoplan.capture.hf_rules import hf_registry
    from autoplan.cluster import parse_cluster
    from autoplan.mesh import MeshShape
    from autoplan.solver.intra_op import megatron_assignment
    from autoplan.strategies import strategy_info

    cluster, registry = parse_cluster(f"1x{WORLD}xcpu"), hf_registry()
    summary, graph, info = capture_hf_for_planner(directory, SEQ, "float32")
    found = {}
    for name, sp in (("autoplan tp4", False), ("autoplan tp4 sp", True)):
        chosen = megatron_assignment(graph, registry, WORLD, strategy_info(info, WORLD, WORLD), sp)
        found[name] = plan_from_assignment(graph, summary, cluster, MeshShape(tp=WORLD), chosen, BATCH, 1, 0, "none",
                                           registry=registry, dtype="float32")
    found["autoplan plan"] = search_module_plans(hf_model_on_meta(directory), cluster, BATCH, SEQ, dtype="float32",
                                                 baselines=False).plans[0]
    return found


# ------------------------------------------------------------------ in the ranks


def _transformers_step(directory: str, tokens: torch.Tensor):
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32,
                                                 distributed_config=DistributedConfig(tp_plan="auto"))
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)

    def step() -> float:
        optimizer.zero_grad(set_to_none=True)
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        return float(loss.detach())
    return step


def _autoplan_step(directory: str, plan, tokens: torch.Tensor):
    import autoplan

    program = autoplan.parallelize(directory, f"1x{WORLD}xcpu", plan=plan)
    optimizer = program.make_optimizer(torch.optim.AdamW, lr=LR)
    targets = tokens.roll(-1, dims=1)
    targets[:, -1] = -100  # transformers' labels=input_ids: T - 1 targets per row
    return lambda: program.train_step(tokens, targets, optimizer)


def _rank(rank: int, port: int, directory: str, plans_: dict, rounds: int, steps: int, out: str) -> None:
    warnings.simplefilter("ignore")
    join_gloo(rank, WORLD, port)
    tokens = torch.randint(8192, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    methods = {"transformers": _transformers_step(directory, tokens)}
    methods |= {name: _autoplan_step(directory, plan, tokens) for name, plan in plans_.items()}
    first, times, cpu = time_alternating(methods, rounds, steps)
    if rank == 0:
        Path(out).write_text(json.dumps({"first_loss": first, "times": times, "cpu": cpu}))
    dist.barrier()
    dist.destroy_process_group()


# ------------------------------------------------------------------ driver


def run(rounds: int, steps: int) -> dict:
    """Spawn the 4 ranks, time every method, print the table; the result as written to JSON."""
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp) / "small-llama-hf"
        write_checkpoint(directory)
        plans_ = plans(directory)
        out = str(Path(tmp) / "rank0.json")
        mp.start_processes(_rank, args=(_free_port(), str(directory), plans_, rounds, steps, out), nprocs=WORLD,
                           start_method="spawn")
        data = json.loads(Path(out).read_text())
    result = {name: {**_summary(t), "cpu_median_ms": 1e3 * statistics.median(data["cpu"][name])}
              for name, t in data["times"].items()}
    result["overhead"] = result["autoplan tp4"]["median_ms"] / result["transformers"]["median_ms"] - 1
    result["first_loss"] = data["first_loss"]
    result["plans"] = {name: f"{plan.mesh}, ZeRO-{plan.zero_stage}, microbatch {plan.microbatch_size}"
                       for name, plan in plans_.items()}
    result["config"] = {"model": "small-llama-hf", "params": _params(), "world": WORLD, "seq": SEQ,
                        "batch": BATCH, "torch": torch.__version__, "cpus": os.cpu_count(),
                        "load_avg": os.getloadavg()}
    _print(result)
    OUT.mkdir(exist_ok=True)
    (OUT / "runtime_overhead_hf.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


def _params() -> int:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return sum(p.numel() for p in AutoModelForCausalLM.from_config(small_llama_hf()).parameters())


def _print(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    c = result["config"]
    table = Table(title=f"{c['model']} ({c['params'] / 1e6:.1f}M params) on {c['world']} gloo ranks, {c['cpus']} "
                        f"CPUs, batch {c['batch']} x {c['seq']} tokens, fp32 AdamW; load average {c['load_avg'][0]:.1f}")
    for col in ("method", "plan", "median ms", "p25 ms", "p75 ms", "CPU ms (rank 0)", "steps", "first loss"):
        table.add_column(col, justify="left" if col in ("method", "plan") else "right", no_wrap=True)
    for name, mesh in (("transformers", "tp4 (its tp_plan)"), *result["plans"].items()):  # mesh, knobs
        s = result[name]
        table.add_row(name, mesh, f"{s['median_ms']:.1f}", f"{s['p25_ms']:.1f}", f"{s['p75_ms']:.1f}",
                      f"{s['cpu_median_ms']:.1f}", str(s["steps"]), f"{result['first_loss'][name]:.6f}")
    Console(width=150).print(table)
    print(f"autoplan tp4 against transformers' tp_plan: {100 * result['overhead']:+.1f}% wall time per step")
    losses = list(result["first_loss"].values())
    if not all(math.isclose(loss, losses[0], rel_tol=1e-5) for loss in losses):
        print("warning: the first-step losses differ: the methods do not train the same model")
