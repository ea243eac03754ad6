"""Memory fidelity: the activation bytes a plan predicts per rank against what the run holds, on CPU.

    python benchmarks/memory_fidelity.py                       # the whole grid (a few minutes)
    python benchmarks/memory_fidelity.py --cases llama tp2     # rows whose id holds every word

Grid: three small models of the zoo's families (4 layers, hidden 256, 8 heads; Llama and MoE with 4
kv heads; MoE 8 experts, top 2) x strategies (one rank; tp = 2 Megatron; tp = 2 with sequence
parallelism; cp = 2 Ulysses; ep = 2 for the MoE, dropless and with an expert capacity of CAPACITY:
"ep2-cap") x float32 and bfloat16 (autocast over float32
parameters) x recompute none, selective, matmul-only, full, full:2. Plans come from
`autoplan.api.plan_from_assignment`; sequences of 1024 tokens (2048 under cp, whose rules want
1024 per rank), microbatch 1 (2 for the MoE: more tokens per expert).

    predicted  `cost_model.memory.plan_activation_bytes`: bytes held after one microbatch's
               forward, and the most a recomputed layer holds while backward re-runs it
    measured   `runtime.memory_probe.measure_saved_bytes` on each rank: the storages the forward
               made that are alive after it (parameters and tensors made from them alone left out;
               checkpoints' inputs and caches in), and the most a region's re-run holds
    error      predicted / measured - 1, per rank; a case's row gives its worst rank. Under ep the
               routing decides how many rows each rank's experts get: the plan prices the busiest rank
               (the routed rows at the mean over the expert group times 1 + the held margin, or the
               re-run margin for a re-run layer: `ep_imbalance_margins`), so an ep case is checked
               against its busiest rank (the most any rank holds); the summary also gives the
               prediction at the mean (no margin) against the mean of the ranks, and the margins the
               ep cases needed (the routed rows their busiest rank held over the mean's). With an
               expert capacity ("ep2-cap") the buffers are padded to it: every rank is checked, no margin

    python benchmarks/memory_fidelity.py --module             # the module runtime's grid

pp (`pp2`: 1F1B, `pp2-v2`: interleaved 1F1B, 2 chunks per rank; gpt and llama, PP_MICROBATCHES
microbatches, recompute none / selective / full): `runtime.memory_probe.measure_step_peak` over a whole
step (the most the forwards leave alive at once: the microbatches in flight and the pipeline's own
buffers) against `cost_model.memory.stage_activation_bytes`, per pipeline rank.

The module runtime (`--module`): transformers' Llama (GQA) and GPT-2 (its tanh GELU op by op, Conv1D
projections), 2 layers, hidden 128, 256 tokens, microbatch 2, float32, built from one seed and run by
`autoplan.parallelize` as they are, x dp (one rank), tp = 2 (Megatron; GPT-2 with its tied head
vocab-parallel and its attention replicated), tp = 2 with sequence parallelism (Llama) x the policies;
predicted over the graph `capture_hf` records (`CapturedGraph.own_forward`: the model's own ops).

Every case runs in fresh processes (one, or two gloo ranks), one forward and backward each.
Writes benchmarks/out/memory_fidelity.json and benchmarks/out/memory_fidelity.png (predicted
against measured, and the error by policy).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import statistics
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

OUT = Path(__file__).parent / "out"
TOLERANCE = 0.05  # the goal of issue 19: within 5% per rank
POLICIES = ("none", "selective", "matmul-only", "full", "full:2")
DTYPES = ("float32", "bfloat16", "bf16-master")  # bf16-master: bfloat16 parameters, fp32 masters (plan precision)
SEQ, CP_SEQ = 1024, 2048  # cp: each context-parallel rank needs >= 1024 tokens (parallel_dims.cp_problem)
STRATEGIES = {  # name: (mesh degrees, assignment), ranks = their product
    "single": (dict(), "replicate"),
    "tp2": (dict(tp=2), "megatron"),
    "tp2-sp": (dict(tp=2), "megatron-sp"),
    "cp2": (dict(cp=2), "replicate"),
    "ep2": (dict(ep=2), "replicate"),
    "ep2-cap": (dict(ep=2), "replicate"),  # with an expert capacity (CAPACITY): padded dispatch, no margin
    "ep4": (dict(ep=4), "replicate"),  # 4 ranks, 2 experts each
    "pp2": (dict(pp=2), "replicate"),  # 1F1B, PP_MICROBATCHES: a whole step, each rank's peak
    "pp2-v2": (dict(pp=2), "replicate"),  # interleaved 1F1B, 2 chunks per rank
}
PP_MICROBATCHES, PP_POLICIES = 4, ("none", "selective", "full")
BUSIEST_RANK = ("ep2", "ep4")  # dropless ep: checked against the busiest rank, priced with the margins
CAPACITY = 1.25  # the expert capacity factor of the "-cap" cases (models.config.expert_capacity)


def bench_models() -> dict:
    from autoplan.models.config import ModelConfig

    shape = dict(num_layers=4, hidden=256, heads=8, vocab=1024, max_seq=CP_SEQ)
    return {"gpt": ModelConfig("bench-gpt", "gpt", kv_heads=8, ffn_hidden=1024, **shape),
            "llama": ModelConfig("bench-llama", "llama", kv_heads=4, ffn_hidden=768, **shape),
            "moe": ModelConfig("bench-moe", "moe", kv_heads=4, ffn_hidden=384, experts=8, top_k=2, **shape)}


def cases(words: list[str]) -> list[tuple[str, str, str, str, str]]:
    """(id, family, strategy, dtype, policy) of the grid, the ids holding every word of `words`."""
    found = []
    for family in ("gpt", "llama", "moe"):
        for strategy in STRATEGIES:
            if strategy.startswith("ep") and family != "moe" or strategy.startswith("pp") and family == "moe":
                continue
            for dtype in DTYPES:
                for policy in PP_POLICIES if strategy.startswith("pp") else POLICIES:
                    cid = f"{family} {strategy} {dtype} {policy}"
                    if all(w in cid.split() for w in words):
                        found.append((cid, family, strategy, dtype, policy))
    return found


def make_plan(config, strategy: str, dtype: str, policy: str):
    """The plan of one case through the public planning API."""
    from autoplan.api import capture_model, plan_from_assignment
    from autoplan.cluster import parse_cluster
    from autoplan.mesh import MeshShape
    from autoplan.solver.intra_op import megatron_assignment
    from autoplan.strategies import default_registry

    degrees, assignment = STRATEGIES[strategy]
    mesh = MeshShape(dp=1, **degrees)
    graph = capture_model(config, CP_SEQ if mesh.cp > 1 else SEQ, "bfloat16" if dtype == "bf16-master" else dtype)
    chosen = {}
    if assignment.startswith("megatron"):
        chosen = megatron_assignment(graph, default_registry(), mesh.tp, config.rule_info(), assignment == "megatron-sp")
    microbatch = 2 if config.experts else 1
    pipeline = dict(virtual_stages=2, schedule="interleaved-1f1b") if strategy.endswith("-v2") else {}
    precision = dict(dtype="bfloat16", precision="bf16-master") if dtype == "bf16-master" else dict(dtype=dtype)
    plan = plan_from_assignment(graph, config, parse_cluster(f"{mesh.world_size}xcpu"), mesh, chosen, microbatch,
                                PP_MICROBATCHES if mesh.pp > 1 else 1, 0, policy, **precision, **pipeline)
    return plan, graph


def predict(config, plan, graph, imbalance: bool = True) -> list[tuple[float, float]]:
    """(held, re-run) bytes the memory model prices on each rank: under ep the busiest rank's, or (`imbalance`
    False) the mean over the expert group's; under pp each pipeline rank's peak over a step."""
    from autoplan.cost_model.memory import plan_activation_bytes, stage_activation_bytes

    if plan.mesh.pp > 1:
        return stage_activation_bytes(plan, graph, config.rule_info(), imbalance)
    return [plan_activation_bytes(plan, graph, config.rule_info(), imbalance)] * plan.mesh.world_size


# ------------------------------------------------------------------------------ the ranks


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, config, plan, out: str) -> None:
    """One rank: build the program, run one forward and backward under the probe, save the bytes."""
    from autoplan.models import build_model
    from autoplan.runtime.launch import parallelize
    from autoplan.runtime.memory_probe import measure_saved_bytes, measure_step_peak

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        program = parallelize(build_model(config, device="meta"), None, plan, config=config)
        gen = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, config.vocab, (plan.global_batch, plan.seq_len), generator=gen)
        shard = program.shard_batch(tokens, tokens.roll(-1, dims=1))
        if program.pipeline is not None:  # a whole step: the microbatches in flight
            def step():
                with program._autocast():
                    program.pipeline.step(*shard)
            measured = measure_step_peak(step, program, program.pipeline.modules)
        else:
            _, measured = measure_saved_bytes(lambda: program(*shard), program)
        torch.save([measured.saved_bytes, measured.recompute_bytes], Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def measure(config, plan) -> list[tuple[int, int]]:
    """(saved, recompute) bytes of each rank of a fresh run of `plan`."""
    world = plan.mesh.world_size
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_rank, args=(world, _free_port(), config, plan, out), nprocs=world, join=True,
                           start_method="spawn")
        return [tuple(torch.load(Path(out) / f"rank{r}.pt")) for r in range(world)]


# ------------------------------------------------------------------------------ report


def _error(predicted: float, measured: float) -> float:
    return predicted / measured - 1 if measured else (0.0 if predicted == 0 else float("inf"))


def run_case(models: dict, case: tuple) -> dict:
    cid, family, strategy, dtype, policy = case
    config = models[family]
    if strategy.endswith("-cap"):
        config = dataclasses.replace(config, name=f"{config.name}-cap", capacity_factor=CAPACITY)
    plan, graph = make_plan(config, strategy, dtype, policy)
    predicted, at_mean = predict(config, plan, graph), predict(config, plan, graph, False)
    mean = [statistics.mean(p[i] for p in at_mean) for i in (0, 1)]  # over the ranks (pp: their stages)
    margins = _margins(config, plan, graph)
    ranks = measure(config, plan)
    pairs = list(zip(predicted, ranks))
    if strategy in BUSIEST_RANK:  # ep: the busiest rank against the plan's price of it
        pairs = [(predicted[0], max(ranks, key=lambda r: r[i])) for i in (0, 1)]
    (held, transient) = max(predicted)  # the busiest rank's, for the table
    return {"id": cid, "family": family, "strategy": strategy, "dtype": dtype, "policy": policy,
            "predicted_bytes": held, "predicted_recompute_bytes": transient,
            "predicted_ranks": [list(p) for p in predicted],
            "predicted_mean_bytes": mean[0], "predicted_mean_recompute_bytes": mean[1],
            "measured_bytes": [r[0] for r in ranks], "measured_recompute_bytes": [r[1] for r in ranks],
            "errors": [_error(p[0], r[0]) for p, r in pairs[:1 if strategy in BUSIEST_RANK else None]],
            "recompute_errors": [_error(p[1], r[1]) for p, r in pairs[1 if strategy in BUSIEST_RANK else 0:]],
            "checked_recompute_bytes": [r[1] for _, r in pairs[1 if strategy in BUSIEST_RANK else 0:]],
            "mean_error": _error(mean[0], statistics.mean(r[0] for r in ranks)),
            "margins": list(margins),
            "needed_margin": [_needed(mean[i], (held, transient)[i], max(r[i] for r in ranks), margin)
                              for i, margin in enumerate(margins)]}


def _margins(config, plan, graph) -> tuple[float, float]:
    """The plan's (held, re-run) ep imbalance margins (`cost_model.activations.ep_imbalance_margins`)."""
    from autoplan.cost_model.memory import plan_activations

    return plan_activations(plan, graph, config.rule_info())[0].margins


def _needed(mean: float, priced: float, busiest: float, margin: float) -> float | None:
    """The imbalance margin at which the prediction equals the busiest rank's bytes (the prediction is
    linear in it: `priced` at `margin`), or None where nothing is routed."""
    return margin * (busiest - mean) / (priced - mean) if priced > mean and margin else None


def _worst(errors: list[float]) -> float:
    return max(errors, key=abs)


def table(rows: list[dict]) -> str:
    lines = [f"{'case':34s} {'predicted MB':>12s} {'measured MB':>12s} {'error':>7s}  {'re-run pred.':>12s} "
             f"{'measured':>9s} {'error':>7s}   (ep: the busiest rank)"]
    for r in rows:  # each case's worst rank (ep: its busiest), predicted and measured
        ranks = r.get("predicted_ranks") or [[r["predicted_bytes"], r["predicted_recompute_bytes"]]]
        shown = []
        for i, key in ((0, "errors"), (1, "recompute_errors")):
            k = max(range(len(r[key])), key=lambda j: abs(r[key][j]))
            measured = r["measured_bytes" if i == 0 else "checked_recompute_bytes"]
            if r["strategy"] in BUSIEST_RANK:
                shown.append((ranks[0][i], max(r["measured_bytes" if i == 0 else "measured_recompute_bytes"]),
                              r[key][k]))
            else:
                shown.append((ranks[k if len(ranks) > 1 else 0][i], measured[k], r[key][k]))
        (p0, m0, e0), (p1, m1, e1) = shown
        lines.append(f"{r['id']:34s} {p0 / 1e6:12.3f} {m0 / 1e6:12.3f} {e0:+7.2%}  {p1 / 1e6:12.3f} {m1 / 1e6:9.3f} {e1:+7.2%}")
    return "\n".join(lines)


def summary(rows: list[dict]) -> dict:
    """Median and largest |error| over every checked (case, rank): each rank, the busiest under ep; how
    many are within TOLERANCE; the prediction at margin 0 against each case's mean over its ranks; under
    ep, the margin each case needed and whether the prediction bounds the busiest rank."""
    held = [abs(e) for r in rows for e in r["errors"]]
    again = [abs(e) for r in rows for e, b in zip(r["recompute_errors"], r["checked_recompute_bytes"]) if b]
    mean = [abs(r["mean_error"]) for r in rows]
    ep = [r for r in rows if r["strategy"] in BUSIEST_RANK]
    return {"cases": len(rows), "rank_measurements": len(held),
            "ep_cases": len(ep), "ep_needed_margin_max": [max((r["needed_margin"][i] for r in ep
                                                           if r["needed_margin"][i] is not None), default=0.0)
                                                      for i in (0, 1)],  # held, re-run
            "ep_busiest_rank_bounded": sum(e >= 0 for r in ep for e in _checked(r)),
            "ep_busiest_rank_checks": sum(len(_checked(r)) for r in ep),
            "ep_at_mean_max_rank_excess": max((b / r["predicted_mean_bytes"] - 1 for r in ep for b in r["measured_bytes"]),
                                              default=0.0),  # the busiest rank over the mean's price
            "median_abs_error": statistics.median(held), "max_abs_error": max(held),
            "within_tolerance": sum(e <= TOLERANCE for e in held),
            "mean_of_ranks_max_abs_error": max(mean), "mean_of_ranks_within_tolerance": sum(e <= TOLERANCE for e in mean),
            "recompute_median_abs_error": statistics.median(again) if again else 0.0,
            "recompute_max_abs_error": max(again, default=0.0),
            "recompute_within_tolerance": sum(e <= TOLERANCE for e in again), "recompute_measurements": len(again)}


def _checked(row: dict) -> list[float]:
    """A case's checked errors: held after the forward, and while a layer is re-run where one is."""
    return row["errors"] + [e for e, b in zip(row["recompute_errors"], row["checked_recompute_bytes"]) if b]


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 5))
    for strategy in dict.fromkeys(r["strategy"] for r in rows):
        points = [(b / 1e6, r["predicted_bytes"] / 1e6) for r in rows if r["strategy"] == strategy
                  for b in r["measured_bytes"]]
        if points:
            left.scatter(*zip(*points), s=14, label=strategy)
    low, high = left.get_xlim()
    for factor, style in ((1.0, "-"), (1 + TOLERANCE, ":"), (1 - TOLERANCE, ":")):
        left.plot([low, high], [low * factor, high * factor], "k" + style, linewidth=0.8)
    left.set(xscale="log", yscale="log", xlabel="measured MB per rank", ylabel="predicted MB",
             title="activations held after a forward")
    left.legend()
    errors = [[100 * e for r in rows if r["policy"] == p for e in r["errors"]] for p in POLICIES]
    right.boxplot(errors, tick_labels=POLICIES)
    right.axhspan(-100 * TOLERANCE, 100 * TOLERANCE, color="0.9")
    right.set(ylabel="error, % (predicted / measured - 1)", title="per rank, by recompute policy")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# ------------------------------------------------------------------------------ the module runtime

MODULE_SEQ, MODULE_BATCH = 256, 2
MODULE_STRATEGIES = ("dp", "tp2", "tp2-sp")  # GPT-2 under tp: tied vocab-parallel head, attention replicated


def hf_configs() -> dict:
    """transformers' Llama (GQA) and GPT-2 (tanh GELU op by op, Conv1D), 2 layers, hidden 128."""
    import transformers

    llama = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=128, num_attention_heads=4,
                                     num_key_value_heads=2, intermediate_size=256, vocab_size=256,
                                     max_position_embeddings=MODULE_SEQ, tie_word_embeddings=False)
    gpt2 = transformers.GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=256, n_positions=MODULE_SEQ,
                                   resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, summary_first_dropout=0.0,
                                   bos_token_id=0, eos_token_id=0)
    return {"llama": llama, "gpt2": gpt2}


def module_cases(words: list[str]) -> list[tuple[str, str, str, str]]:
    """(id, model, strategy, policy) of the module runtime's grid, the ids holding every word."""
    return [(cid, model, strategy, policy) for model in ("llama", "gpt2") for strategy in MODULE_STRATEGIES
            for policy in POLICIES if not (model == "gpt2" and strategy == "tp2-sp")
            for cid in [f"module {model} {strategy} {policy}"] if all(w in cid.split() for w in words)]


def module_plan(model: str, strategy: str, policy: str):
    """(plan, (held, re-run) predicted bytes) over the graph `capture_hf` records (`own_forward`)."""
    from autoplan.api import plan_from_assignment
    from autoplan.capture.hf import capture_hf_for_planner
    from autoplan.capture.hf_rules import hf_registry
    from autoplan.cluster import parse_cluster
    from autoplan.cost_model.memory import plan_activation_bytes
    from autoplan.mesh import MeshShape
    from autoplan.solver.intra_op import megatron_assignment
    from autoplan.strategies import strategy_info

    tp = 2 if strategy.startswith("tp2") else 1
    summary, graph, _ = capture_hf_for_planner(hf_configs()[model], MODULE_SEQ, "float32")
    registry, info = hf_registry(), strategy_info(summary.rule_info(), tp, tp)
    chosen = {}
    if tp > 1:
        chosen = (_gpt2_tied_head(graph, registry, tp, info) if model == "gpt2"
                  else megatron_assignment(graph, registry, tp, info, strategy.endswith("sp")))
    plan = plan_from_assignment(graph, summary, parse_cluster(f"1x{tp}xcpu"), MeshShape(dp=1, tp=tp), chosen,
                                MODULE_BATCH, 1, 0, policy, registry=registry, dtype="float32")
    return plan, plan_activation_bytes(plan, graph, summary.rule_info())


def _gpt2_tied_head(graph, registry, tp: int, info: dict) -> dict[str, str]:
    """GPT-2 under tp (as tests/test_runtime_modules.py runs it): the tied embedding vocab-parallel and
    the lm_head column over the vocabulary, each MLP column then row, the attention replicated."""
    from autoplan.placement import Shard

    found = {n.name: {"embedding": "vocab", "cross_entropy": "vocab"}[n.op_kind] for n in graph.nodes
             if n.op_kind in ("embedding", "cross_entropy") and n.module_path != "transformer.wpe"}
    between = False
    for n in graph.nodes:
        if n.op_kind == "linear" and (n.module_path == "lm_head" or n.module_path.endswith(".mlp.c_fc")):
            found[n.name], between = "column", n.module_path != "lm_head"
        elif n.op_kind == "linear" and n.module_path.endswith(".mlp.c_proj"):
            found[n.name], between = "row", False
        elif between:
            last = Shard(len(n.output.shape) - 1)
            found[n.name] = next(s.name for s in registry.strategies(n, tp, info) if s.output == last)
    return found


def _module_rank(rank: int, world: int, port: int, model: str, plan, out: str) -> None:
    """One rank of the module runtime: the model's own module under `autoplan.parallelize`, one
    microbatch's forward and backward under the probe."""
    import warnings

    import transformers

    import autoplan
    from autoplan.runtime.memory_probe import measure_saved_bytes

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        module = transformers.AutoModelForCausalLM.from_config(hf_configs()[model], attn_implementation="sdpa")
        program = autoplan.parallelize(module, f"1x{world}xcpu", plan)
        tokens = torch.randint(0, 256, (MODULE_BATCH, MODULE_SEQ), generator=torch.Generator().manual_seed(0))
        rows = program._rows(tokens)[:plan.microbatch_size]
        targets = rows.roll(-1, dims=1)
        targets[:, -1] = -100
        with program._loss_context():
            _, measured = measure_saved_bytes(lambda: program._token_loss_sum(rows, targets), program.model)
        torch.save([measured.saved_bytes, measured.recompute_bytes], Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def run_module_case(case: tuple) -> dict:
    cid, model, strategy, policy = case
    plan, (held, transient) = module_plan(model, strategy, policy)
    world = plan.mesh.world_size
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_module_rank, args=(world, _free_port(), model, plan, out), nprocs=world, join=True,
                           start_method="spawn")
        ranks = [tuple(torch.load(Path(out) / f"rank{r}.pt")) for r in range(world)]
    return {"id": cid, "family": model, "strategy": strategy, "dtype": "float32", "policy": policy,
            "predicted_bytes": held, "predicted_recompute_bytes": transient, "predicted_mean_bytes": held,
            "predicted_mean_recompute_bytes": transient, "measured_bytes": [r[0] for r in ranks],
            "measured_recompute_bytes": [r[1] for r in ranks], "errors": [_error(held, r[0]) for r in ranks],
            "recompute_errors": [_error(transient, r[1]) for r in ranks],
            "checked_recompute_bytes": [r[1] for r in ranks],
            "mean_error": _error(held, statistics.mean(r[0] for r in ranks)), "needed_margin": [None, None]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="*", default=[], help="run the cases whose id holds every word")
    parser.add_argument("--from-json", metavar="FILE", help="print the table, summary and plot of a saved run")
    parser.add_argument("--module", action="store_true", help="the module runtime's grid (transformers' Llama and "
                        "GPT-2 under dp, tp2, tp2 with sp) instead of the zoo's")
    args = parser.parse_args(argv)
    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        report(saved["rows"], saved["command"])
        return
    rows = []
    if args.module:
        for case in module_cases(args.cases):
            rows.append(run_module_case(case))
            print(table(rows[-1:]).splitlines()[-1], flush=True)
    else:
        models = bench_models()
        for case in cases(args.cases):
            rows.append(run_case(models, case))
            print(table(rows[-1:]).splitlines()[-1], flush=True)
    if not rows:
        sys.exit(f"no case id holds every word of {args.cases}")
    report(rows, " ".join(["python benchmarks/memory_fidelity.py", *(["--module"] if args.module else []),
                           *(["--cases", *args.cases] if args.cases else [])]))


def report(rows: list[dict], command: str) -> None:
    """Write benchmarks/out/memory_fidelity.{json,png} (the module runtime's: memory_fidelity_module.*)
    and print the table and the summary."""
    OUT.mkdir(exist_ok=True)
    result = {"summary": summary(rows), "rows": rows, "command": command}
    name = "memory_fidelity_module" if "--module" in command else "memory_fidelity"
    (OUT / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(rows, OUT / f"{name}.png")
    print()
    print(table(rows))
    print()
    print(json.dumps(result["summary"], indent=1))


if __name__ == "__main__":
    main()
