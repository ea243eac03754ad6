"""One-GPU training steps of the runtime's own program: measured step time and peak memory against the
plan's prediction (issues 17, 19, 20).

    python benchmarks/gpu_steps.py plan -d benchmarks/out/gpu_plans          # any machine: the plans
    python benchmarks/gpu_steps.py run -d benchmarks/out/gpu_plans -o steps.json   # on the GPU
    python benchmarks/gpu_steps.py compare benchmarks/data/h200_steps.json
    python benchmarks/gpu_steps.py phases benchmarks/data/h100_steps_isolated_second.json --profile h100

`plan` prices each case of `CASES` (built-in Llama and GPT shapes that fit one H200, bf16 autocast over
fp32 weights or bf16 parameters with fp32 masters, AdamW) with `autoplan.estimate` on a one-GPU cluster
(`--cluster`, default `1xh200`), by the device preset, and writes one plan file per case that the cost model
says fits the device's memory (and, with `--profile`, a second set priced with that hardware profile).
`run` compiles each plan with `autoplan.parallelize` on a one-rank NCCL group (the model built on meta,
parameters from the seeded init), takes `--warmup` untimed and `--steps` timed `train_step`s on fixed
random tokens, each timed by the wall clock between two `torch.cuda.synchronize()`s, and records the
median step, `torch.cuda.max_memory_allocated()` over the timed steps, the memory of one more step by
phase (`memory_phases`), and the plan's predicted step time, peak memory and their parts. Cases run in one
process count what an earlier case left allocated in a later case's `max_memory_allocated`, so `compare`
subtracts it where the phases were recorded (`own_peak_bytes`); `gpu_session.sh diagnose` runs each case
in a process of its own (`isolated`). A case that fails is recorded with its error; the rest still run.
`compare` prints measured against the current cost model's prediction of each case (re-priced on the
cluster the run recorded, by the preset or a profile): error = predicted / measured - 1.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from gpu_step_probes import (kernel_breakdown, memory_phases, saved_bytes_per_microbatch,  # noqa: E402
                             step_phases, timed_optimizer)
from json_out import write_json  # noqa: E402

CLUSTER = "1xh200"
# (name, family, layers, hidden, heads, kv heads, ffn, vocab, seq, microbatch, microbatches, recompute, precision)
CASES = (
    ("llama-1b-T4096-b1", "llama", 16, 2048, 16, 8, 7168, 32000, 4096, 1, 2, "none", "autocast"),
    ("llama-1b-T4096-b2-full", "llama", 16, 2048, 16, 8, 7168, 32000, 4096, 2, 2, "full", "autocast"),
    ("llama-1b-T2048-b4", "llama", 16, 2048, 16, 8, 7168, 32000, 2048, 4, 1, "none", "autocast"),
    ("llama-1b-T2048-b4-sel", "llama", 16, 2048, 16, 8, 7168, 32000, 2048, 4, 1, "selective", "autocast"),
    ("llama-h4096-8l-T4096-b1", "llama", 8, 4096, 32, 8, 14336, 128256, 4096, 1, 2, "none", "autocast"),
    ("gpt-1.3b-T2048-b4", "gpt", 24, 2048, 16, 16, 8192, 51200, 2048, 4, 1, "none", "autocast"),
    ("gpt-1.3b-T2048-b8-full", "gpt", 24, 2048, 16, 16, 8192, 51200, 2048, 8, 1, "full", "autocast"),
    ("llama-3b-T2048-b2", "llama", 28, 3072, 24, 8, 8192, 128256, 2048, 2, 2, "none", "autocast"),
    ("gpt-2.7b-T2048-b4", "gpt", 32, 2560, 20, 20, 10240, 51200, 2048, 4, 1, "none", "autocast"),
    ("gpt-2.7b-T2048-b4-sel", "gpt", 32, 2560, 20, 20, 10240, 51200, 2048, 4, 1, "selective", "autocast"),
    # bf16 parameters with fp32 masters, as the search plans bfloat16 runs
    ("bfm-llama-1b-T4096-b1", "llama", 16, 2048, 16, 8, 7168, 32000, 4096, 1, 2, "none", "bf16-master"),
    ("bfm-llama-1b-T2048-b4-sel", "llama", 16, 2048, 16, 8, 7168, 32000, 2048, 4, 1, "selective", "bf16-master"),
    ("bfm-gpt-1.3b-T2048-b4", "gpt", 24, 2048, 16, 16, 8192, 51200, 2048, 4, 1, "none", "bf16-master"),
    ("bfm-gpt-1.3b-T2048-b8-full", "gpt", 24, 2048, 16, 16, 8192, 51200, 2048, 8, 1, "full", "bf16-master"),
    ("bfm-llama-3b-T2048-b2", "llama", 28, 3072, 24, 8, 8192, 128256, 2048, 2, 2, "none", "bf16-master"),
)


def case_config(case):
    from autoplan.models.config import ModelConfig

    name, family, layers, h, heads, kv, ffn, vocab, seq = case[:9]
    return ModelConfig(name, family, layers, h, heads, kv, ffn, vocab, max(seq, 2048),
                       rope_theta=500000.0 if family == "llama" else 10000.0)


def cmd_plan(args) -> int:
    """Price every case (and with --profile a second time) and write its plan file."""
    from autoplan.profiler.profile import HardwareProfile

    out = Path(args.dir)
    out.mkdir(parents=True, exist_ok=True)
    profile = HardwareProfile.load(args.profile) if args.profile else None
    for case in CASES:
        name = case[0]
        for tag, prof in (("preset", None), ("profile", profile)):
            if tag == "profile" and prof is None:
                continue
            plan = price_case(case, prof, args.cluster)
            capacity = plan.cluster.device.memory_bytes
            if plan.predicted.peak_memory_bytes > capacity:
                print(f"{name} ({tag}): skipped, predicted {plan.predicted.peak_memory_bytes / 2**30:.2f} GiB "
                      f"over the device's {capacity / 2**30:.2f} GiB")
                continue
            plan.save(out / f"{name}.{tag}.json")
            print(f"{name} ({tag}): predicted {plan.predicted.step_time_s * 1e3:.1f} ms, "
                  f"{plan.predicted.peak_memory_bytes / 2**30:.2f} GiB")
    (out / "configs.json").write_text(json.dumps({c[0]: case_config(c).to_json() for c in CASES}, indent=1))
    return 0


def _predicted(plan) -> dict:
    p = plan.predicted
    return {"step_s": p.step_time_s, "peak_bytes": p.peak_memory_bytes, "time_parts": _parts(p.time),
            "memory_parts": _parts(p.memory)}


def _parts(obj) -> dict:
    import dataclasses

    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)
            if isinstance(getattr(obj, f.name), (int, float))}


def run_plan(plan, config, warmup: int, steps: int, diagnose: bool = False) -> dict:
    """Compile `plan` and time its steps (module docstring)."""
    import torch

    from autoplan.models import build_model
    from autoplan.runtime.launch import parallelize  # the zoo's runtime; `autoplan.api` needs the solver's pulp

    program = parallelize(build_model(config), plan.cluster, plan, config=config, seed=0)
    optimizer = program.make_optimizer(torch.optim.AdamW, lr=1e-5)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(config.vocab, (plan.global_batch, plan.seq_len), generator=gen)
    targets = torch.randint(config.vocab, (plan.global_batch, plan.seq_len), generator=gen)
    for _ in range(warmup):
        program.train_step(tokens, targets, optimizer)
    phases = memory_phases(program, optimizer, tokens, targets)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    with timed_optimizer(optimizer) as optimizer_s:
        for _ in range(steps):
            torch.cuda.synchronize()
            start = time.perf_counter()
            losses.append(program.train_step(tokens, targets, optimizer))
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
    result = {"step_s": statistics.median(times), "steps_s": times, "peak_bytes": torch.cuda.max_memory_allocated(),
              "losses": losses, "memory_phases": phases, "optimizer_s": statistics.median(optimizer_s())}
    try:  # a diagnostic: a failure here must not lose the step's measurement
        result["step_phases"] = step_phases(program, optimizer, tokens, targets)
    except Exception as exc:  # noqa: BLE001
        result["step_phases"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    if diagnose:
        result["kernels"] = kernel_breakdown(lambda: program.train_step(tokens, targets, optimizer))
        result["saved_bytes"] = saved_bytes_per_microbatch(program, plan, tokens, targets)
    return result


def cmd_run(args) -> int:
    import torch

    from autoplan.models.config import ModelConfig
    from autoplan.plan import Plan

    plans = Path(args.dir)
    configs = {k: ModelConfig.from_json(v) for k, v in json.loads((plans / "configs.json").read_text()).items()}
    result = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "cases": []}
    if args.append and Path(args.output).exists():  # one process per case: each adds its rows
        result = json.loads(Path(args.output).read_text())
    for path in sorted(plans.glob("*.json")):
        if path.name == "configs.json":
            continue
        name, tag = path.name.rsplit(".", 2)[:2]
        if args.only and name not in args.only:
            continue
        plan = Plan.load(path)
        result["cluster"] = plan.cluster.to_json()  # what `compare` re-prices on
        row = {"case": name, "priced_by": tag, "predicted": _predicted(plan)}
        try:
            if tag == "preset" or not any(r["case"] == name and "measured" in r for r in result["cases"]):
                row["measured"] = run_plan(plan, configs[name], args.warmup, args.steps, args.diagnose)
                row["measured"]["isolated"] = bool(args.only) and len(args.only) == 1  # gpu_session.sh diagnose
            else:  # the same program: measured once, under the preset's file
                row["measured"] = next(r["measured"] for r in result["cases"] if r["case"] == name and "measured" in r)
        except Exception as exc:  # recorded; the next case still runs
            row["error"] = f"{type(exc).__name__}: {exc}"[:600]
        result["cases"].append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "predicted"})[:400], flush=True)
        write_json(Path(args.output), result)
        gc.collect()  # the case's program, before the next one's peak is read
        torch.cuda.empty_cache()
    return 0


def price_case(case, profile=None, cluster=CLUSTER):
    """`case`'s plan on `cluster` (shorthand or ClusterSpec) as the current cost model prices it (`cmd_plan`'s
    estimate)."""
    from autoplan.api import estimate
    from autoplan.mesh import MeshShape

    seq, mbs, n_mb, recompute, precision = case[8:13]
    return estimate(case_config(case), cluster, mbs * n_mb, seq, mesh=MeshShape(), microbatch_size=mbs, zero_stage=0,
                    recompute=recompute, profile=profile, precision=precision)


STATE_BYTES_PER_PARAMETER = 16  # what the runtime keeps per parameter between steps: fp32 weights, gradients, m, v


def own_peak_bytes(measured: dict, config) -> tuple[float, float]:
    """(the case's own peak, the bytes earlier cases of the same process left allocated): runs whose steps
    recorded `memory_phases` subtract what was allocated before the step beyond this program's own states
    (STATE_BYTES_PER_PARAMETER per parameter), since `max_memory_allocated` counts every live tensor of
    the process; (peak, 0) for runs without them."""
    phases = measured.get("memory_phases")
    if not phases or measured.get("isolated"):  # a process of its own: nothing is left by another case
        return measured["peak_bytes"], 0.0
    left = max(0.0, phases["allocated_before"] - STATE_BYTES_PER_PARAMETER * config.num_parameters())
    return measured["peak_bytes"] - left, left


def recorded_cluster(data: dict):
    """The cluster a `run` file's plans were compiled for (files before it was recorded ran on `CLUSTER`)."""
    from autoplan.cluster import ClusterSpec

    return ClusterSpec.from_json(data["cluster"]) if "cluster" in data else CLUSTER


def comparison(data: dict, profile=None) -> list[dict]:
    """Per measured case of `data` (a `run` file): measured against today's cost model's prediction (the case
    re-priced on the run's cluster, by the preset or `profile`): step seconds, own peak bytes, what earlier cases
    left, and the errors predicted / measured - 1. Cases that failed or are not in CASES: {"case", "error"}."""
    cases, cluster = {c[0]: c for c in CASES}, recorded_cluster(data)
    rows = []
    for row in data["cases"]:
        if "measured" not in row or row["case"] not in cases:
            rows.append({"case": row["case"], "error": row.get("error", "not a case of CASES")})
            continue
        m, plan = row["measured"], price_case(cases[row["case"]], profile, cluster)
        p = plan.predicted
        peak, left = own_peak_bytes(m, case_config(cases[row["case"]]))
        rows.append({"case": row["case"], "step_s": m["step_s"], "predicted_step_s": p.step_time_s,
                     "step_error": p.step_time_s / m["step_s"] - 1, "peak_bytes": peak, "left_bytes": left,
                     "predicted_peak_bytes": p.peak_memory_bytes, "memory_error": p.peak_memory_bytes / peak - 1})
    return rows


def _measured_and_profile(args) -> tuple[dict, object]:
    """(the `run` file `args.measured`, the profile `args.profile` or None: the preset prices)."""
    from autoplan.profiler.profile import HardwareProfile

    return json.loads(Path(args.measured).read_text()), HardwareProfile.load(args.profile) if args.profile else None


def cmd_compare(args) -> int:
    """Measured against the prediction of today's cost model (the plans re-priced, by the preset or
    `--profile`)."""
    data, profile = _measured_and_profile(args)
    print(f"{data['device']}, torch {data['torch']}: one-GPU training steps of the runtime's program, priced "
          f"{'with ' + args.profile if profile else 'by the device preset'}")
    print(f"{'case':26} {'step meas ms':>12} {'pred ms':>8} {'err':>7} {'peak meas GiB':>13} {'pred GiB':>8} {'err':>7}"
          f" {'left by earlier GiB':>19}")
    rows = comparison(data, profile)
    for r in rows:
        if "error" in r:
            print(f"{r['case']:26} failed: {r['error'][:120]}")
            continue
        print(f"{r['case']:26} {r['step_s'] * 1e3:12.1f} {r['predicted_step_s'] * 1e3:8.1f} {r['step_error']:+7.1%} "
              f"{r['peak_bytes'] / 2**30:13.2f} {r['predicted_peak_bytes'] / 2**30:8.2f} {r['memory_error']:+7.1%} "
              f"{r['left_bytes'] / 2**30:19.2f}")
    priced = [r for r in rows if "error" not in r]
    if priced:
        print(f"median |error|: step {statistics.median(abs(r['step_error']) for r in priced):.1%}, "
              f"peak memory {statistics.median(abs(r['memory_error']) for r in priced):.1%}")
    return 0


def phase_rows(data: dict, profile=None) -> list[dict]:
    """Per measured case with `step_phases` (a `run` file's): the phases against the plan's parts, re-priced as
    `comparison` prices them: forward + backward against the compute part, the gradient norm and the optimizer
    against the optimizer part (the norm is priced in it: `cost_model.optimizer`), the step's setup and the sync's
    finish (not priced apart), and the spread of the timed steps. Seconds."""
    cases, cluster = {c[0]: c for c in CASES}, recorded_cluster(data)
    rows = []
    for row in data["cases"]:
        phases = row.get("measured", {}).get("step_phases", {})
        if row["case"] not in cases or "forward" not in phases:
            continue
        time_parts = price_case(cases[row["case"]], profile, cluster).predicted.time
        rows.append({"case": row["case"], "forward_backward_s": phases["forward"] + phases["backward"],
                     "compute_s": time_parts.compute_s, "setup_s": phases["setup"], "sync_s": phases.get("sync", 0.0),
                     "norm_optimizer_s": phases["loss_and_norm"] + phases["optimizer"],
                     "optimizer_s": time_parts.optimizer_s, "steps_s": row["measured"]["steps_s"]})
    return rows


def cmd_phases(args) -> int:
    """Each step's phases (`step_phases`: CUDA events, one step after the timed ones) against the parts priced."""
    data, profile = _measured_and_profile(args)
    print(f"{data['device']}: step phases measured / the plan's part, priced {'with ' + args.profile if profile else 'by the preset'}"
          f" (ms)")
    print(f"{'case':26} {'fwd+bwd / compute':>19} {'err':>7} {'setup':>6} {'sync':>6} {'norm+opt / optimizer':>21} "
          f"{'err':>7} {'timed steps':>15}")
    for r in phase_rows(data, profile):
        steps = r["steps_s"]
        print(f"{r['case']:26} {r['forward_backward_s'] * 1e3:8.1f} / {r['compute_s'] * 1e3:8.1f} "
              f"{r['compute_s'] / r['forward_backward_s'] - 1:+7.1%} {r['setup_s'] * 1e3:6.1f} {r['sync_s'] * 1e3:6.1f} "
              f"{r['norm_optimizer_s'] * 1e3:9.1f} / {r['optimizer_s'] * 1e3:9.1f} {r['optimizer_s'] / r['norm_optimizer_s'] - 1:+7.1%} "
              f"{min(steps) * 1e3:7.1f}-{max(steps) * 1e3:.1f}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan")
    p.add_argument("-d", "--dir", default="benchmarks/out/gpu_plans")
    p.add_argument("--profile")
    p.add_argument("--cluster", default=CLUSTER, help=f"a one-GPU cluster shorthand (default {CLUSTER})")
    r = sub.add_parser("run")
    r.add_argument("-d", "--dir", default="benchmarks/out/gpu_plans")
    r.add_argument("-o", "--output", default="steps.json")
    r.add_argument("--warmup", type=int, default=2)
    r.add_argument("--steps", type=int, default=5)
    r.add_argument("--only", nargs="+", metavar="CASE", help="run these cases alone")
    r.add_argument("--append", action="store_true", help="add to OUTPUT's cases (one process per case)")
    r.add_argument("--diagnose", action="store_true",
                   help="also one step's kernels by family (torch.profiler) and one microbatch's saved bytes")
    c = sub.add_parser("compare")
    c.add_argument("measured")
    c.add_argument("--profile", help="price with this hardware profile of the device (default: its preset)")
    f = sub.add_parser("phases")
    f.add_argument("measured")
    f.add_argument("--profile", help="price with this hardware profile of the device (default: its preset)")
    args = parser.parse_args(argv)
    return {"plan": cmd_plan, "run": cmd_run, "compare": cmd_compare, "phases": cmd_phases}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
