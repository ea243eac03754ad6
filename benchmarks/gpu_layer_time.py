"""Per-rank layer time on a GPU: one transformer layer's forward + backward as a tensor-parallel rank
runs it, measured, against what the cost model predicts for it (issue 16).

    python benchmarks/gpu_layer_time.py measure -o layer_times.json      # on a CUDA device, ~1-2 min
    python benchmarks/gpu_layer_time.py compare benchmarks/data/h200_layer_times.json
    python benchmarks/gpu_layer_time.py compare benchmarks/data/h200_layer_times.json --profile profiles/h200.json
    python benchmarks/gpu_layer_time.py measure --dry-run -o /tmp/x.json  # CPU: tiny shapes, the code path only
    python benchmarks/gpu_layer_time.py flash benchmarks/data/h200_layer_times.json  # the flash kernels alone

What is measured (`measure`): the zoo's own block (`LlamaBlock`: RMSNorm, GQA attention with RoPE,
SwiGLU; `GPTBlock`: LayerNorm, MHA, tanh-GELU MLP; both with residual adds) at the shapes one rank of
Megatron-LM's tensor parallelism holds (no sequence parallelism): q, k, v, gate, up and fc keep
out / tp features, o_proj, down_proj and proj in / tp, norms and residual adds the whole hidden; and
the leaf modules and gelu / silu * mul swapped for the runtime's kernels (`profiler.dispatch.runtime_block`), as
the runtime runs them on CUDA ("triton") and as plain torch ("torch"). Input (mbs, T, h) in bf16;
forward, then backward of a random output gradient; the parameters' .grad accumulate across
iterations, as a microbatch after the first does. Timed by CUDA events per iteration after warm-up, 20
iterations per case in each of `--rounds` passes over the cases (odd passes in reverse order); the layer
time is the median of its samples. Where the GPU work is short the host's dispatch sets the time, and
that varies from pass to pass: the samples of every pass are kept. The tp collectives are not run (one GPU): they are priced apart.

What is predicted (`compare`, on any machine): the same layer of a 2-layer model of the same family
and shapes, planned with Megatron's assignment at that tp on 8 GPUs of the measured device's preset
(`api.plan_from_assignment`), its layer ops' forward and backward compute per microbatch on one rank
(`cost_model.intra_op.price_assignment` over layer 0's nodes, as the step model prices a layer, the
host's dispatch of its kernels included), with the device's default
calibration, or with a hardware profile of the device (`--profile`). Error = predicted / measured - 1.
Issue 16's goal: median |error| <= 10%, p90 <= 15% over hidden 2048-12288 and tp 1-8.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from autoplan.profiler.dispatch import runtime_block

sys.path.insert(0, str(Path(__file__).parent))
from json_out import write_json  # noqa: E402

HIDDENS = (2048, 4096, 8192, 12288)
TPS = (1, 2, 4, 8)
HEAD_DIM = 128


@dataclass(frozen=True)
class Case:
    """One measured layer: family, shapes and the tp degree whose rank it is."""

    family: str  # "llama" | "gpt"
    hidden: int
    tp: int
    seq: int
    mbs: int = 1

    @property
    def name(self) -> str:
        return f"{self.family}-h{self.hidden}-tp{self.tp}-T{self.seq}-b{self.mbs}"


def model_config(case: Case, layers: int = 2):
    """The zoo config of `case`'s family: head_dim 128; llama: 8 kv heads, SwiGLU width ~3.5 h
    (rounded to 256); gpt: MHA, MLP 4 h."""
    from autoplan.models.config import ModelConfig

    h, heads = case.hidden, max(1, case.hidden // HEAD_DIM)
    if case.family == "llama":
        ffn = -(-int(3.5 * h) // 256) * 256
        return ModelConfig(f"layer-{case.name}", "llama", layers, h, heads, min(8, heads), ffn, 32000,
                           max(case.seq, 2048), rope_theta=500000.0)
    return ModelConfig(f"layer-{case.name}", "gpt", layers, h, heads, heads, 4 * h, 32000, max(case.seq, 2048))


def default_cases(dry_run: bool = False) -> list[Case]:
    """Both families x HIDDENS x TPS at T = 4096, mbs 1; plus the llama h4096 layers at T 2048 and 8192
    (attention's share moves with T). Dry run: two tiny cases."""
    if dry_run:
        return [Case("llama", 256, 2, 64), Case("gpt", 256, 1, 64)]
    cases = [Case(f, h, tp, 4096) for f in ("llama", "gpt") for h in HIDDENS for tp in TPS]
    cases += [Case("llama", 4096, tp, seq) for seq in (2048, 8192) for tp in TPS]
    return cases


# ------------------------------------------------------------------------------------ measure


def time_layer(block, x, dy, warmup: int, iters: int) -> dict[str, list[float]]:
    """Forward and forward + backward seconds of `iters` CUDA-event-timed iterations after `warmup`."""
    import torch

    for _ in range(warmup):
        block(x).backward(dy)
    torch.cuda.synchronize()
    events = [[torch.cuda.Event(enable_timing=True) for _ in range(3)] for _ in range(iters)]
    for start, mid, end in events:
        start.record()
        y = block(x)
        mid.record()
        y.backward(dy)
        end.record()
    torch.cuda.synchronize()
    return {"fwd": [s.elapsed_time(m) * 1e-3 for s, m, _ in events],
            "fwd_bwd": [s.elapsed_time(e) * 1e-3 for s, _, e in events]}


def kernel_breakdown(block, x, dy, iters: int = 2) -> list[dict]:
    """Device seconds per kernel name over one forward + backward (torch.profiler, CUDA activity), the
    kernels sorted by time: where a mismatch comes from."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            block(x).backward(dy)
        torch.cuda.synchronize()
    rows = []
    for evt in prof.key_averages():
        t = getattr(evt, "device_time_total", None)
        t = getattr(evt, "cuda_time_total", 0.0) if t is None else t
        if t:
            rows.append({"kernel": evt.key[:120], "s": t * 1e-6 / iters, "calls": evt.count / iters})
    return sorted(rows, key=lambda r: -r["s"])[:25]


def measure_case(case: Case, backend: str, device, dry_run: bool, breakdown: bool) -> dict:
    """Per-iteration samples of `case` under `backend` (NaN-free on CUDA; one untimed pass on CPU)."""
    import torch

    dtype = torch.float32 if dry_run else torch.bfloat16
    block = runtime_block(model_config(case), case.tp, device, dtype, backend)
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(case.mbs, case.seq, case.hidden, device=device, dtype=dtype, generator=gen, requires_grad=True)
    dy = torch.randn(case.mbs, case.seq, case.hidden, device=device, dtype=dtype, generator=gen)
    if dry_run:  # the code path, on CPU: no events
        block(x).backward(dy)
        return {"fwd": [], "fwd_bwd": []}
    out = time_layer(block, x, dy, warmup=3, iters=20)
    if breakdown:
        out["kernels"] = kernel_breakdown(block, x, dy)
    return out


def cmd_measure(args) -> int:
    """Every case and backend, in `args.rounds` rounds (odd rounds in reverse order, so a drift of the
    machine's state does not follow the case order); each row's times are the medians of its samples."""
    import torch

    dry = args.dry_run
    if not dry and not torch.cuda.is_available():
        print("measure needs a CUDA device (or --dry-run on CPU for the code path)", file=sys.stderr)
        return 2
    device = torch.device("cpu" if dry else "cuda")
    result = {"device": "cpu" if dry else torch.cuda.get_device_name(0), "torch": torch.__version__,
              "head_dim": HEAD_DIM, "cases": []}
    backends = ("torch",) if dry else tuple(args.backends)
    cases = [c for c in default_cases(dry) if not args.only or any(c.name.startswith(p) for p in args.only)]
    rows: dict[tuple, dict] = {}
    for r in range(args.rounds):
        for case in cases if r % 2 == 0 else cases[::-1]:
            for backend in backends:
                row = rows.setdefault((case.name, backend), {"family": case.family, "hidden": case.hidden,
                                                             "tp": case.tp, "seq": case.seq, "mbs": case.mbs,
                                                             "backend": backend, "fwd": [], "fwd_bwd": []})
                try:
                    got = measure_case(case, backend, device, dry, breakdown=r == 0 and backend == "triton")
                except Exception as exc:  # a case that fails is reported, the rest still measured
                    row["error"] = f"{type(exc).__name__}: {exc}"[:400]
                    continue
                row["fwd"] += got["fwd"]
                row["fwd_bwd"] += got["fwd_bwd"]
                row.setdefault("kernels", got.get("kernels", []))
                if row["fwd_bwd"]:
                    row["fwd_s"], row["fwd_bwd_s"] = statistics.median(row["fwd"]), statistics.median(row["fwd_bwd"])
                print(json.dumps({k: v for k, v in row.items() if k not in ("kernels", "fwd", "fwd_bwd")}), flush=True)
                result["cases"] = list(rows.values())
                write_json(Path(args.output), result)
                if not dry:
                    torch.cuda.empty_cache()
    return 0


def cmd_host(args) -> int:
    """The host's seconds per priced kernel (`profiler.dispatch`) on blocks of several widths and token
    counts, each far from GPU-bound: whether the profile's small block stands for the layers it prices."""
    import torch

    from autoplan.profiler.dispatch import measure_host_kernel_s

    rows = []
    for family, hidden, seq in ((("llama", 256, 128), ("llama", 1024, 128), ("llama", 4096, 16), ("llama", 4096, 64),
                                 ("gpt", 4096, 16), ("llama", 8192, 16))):
        config = model_config(Case(family, hidden, 1, max(seq, 2048)))
        per_kernel, per_block, kernels, _ = measure_host_kernel_s(torch.device("cuda"), False, config, seq)
        rows.append({"family": family, "hidden": hidden, "seq": seq, "host_kernel_s": per_kernel,
                     "block_s": per_block, "kernels": kernels})
        print(json.dumps(rows[-1]), flush=True)
        write_json(Path(args.output), {"device": torch.cuda.get_device_name(0), "rows": rows})
    return 0


# ------------------------------------------------------------------------------------ predict


def predicted_layer_s(case: Case, device_preset: str, profile=None, kernels: str = "triton") -> dict[str, float]:
    """The cost model's forward and backward compute seconds of one layer of `case` on one tp rank
    (module docstring): layer 0's nodes priced together under the plan's strategies, as the step model
    prices a layer (`cost_model.intra_op.price_assignment`, the host's dispatch included)."""
    from dataclasses import replace

    from autoplan.api import capture_model, plan_from_assignment
    from autoplan.cluster import parse_cluster
    from autoplan.cost_model.compute import calibrate
    from autoplan.cost_model.intra_op import make_context, price_assignment
    from autoplan.mesh import MeshShape
    from autoplan.solver.intra_op import megatron_assignment
    from autoplan.strategies import default_registry, strategy_info

    config = model_config(case)
    graph = capture_model(config, case.seq, "bfloat16")
    assignment = megatron_assignment(graph, default_registry(), case.tp, strategy_info(config.rule_info(), case.tp, None))
    cluster, efficiency = calibrate(parse_cluster(f"8x{device_preset}"), None, profile, kernels, "bfloat16")
    mesh = MeshShape(dp=8 // case.tp, tp=case.tp)
    plan = plan_from_assignment(graph, config, cluster, mesh, assignment, case.mbs, 1, 0, "none", efficiency=efficiency)
    strategies = {op.node: op.resolved for op in plan.ops}
    layer = replace(graph, nodes=tuple(n for n in graph.nodes if n.layer == 0))
    ctx = make_context(graph, cluster, MeshShape(dp=8 // case.tp, tp=case.tp), case.mbs, "bfloat16", efficiency)
    cost = price_assignment(layer, strategies, ctx)
    return {"fwd_s": cost.fwd_compute_s, "bwd_s": cost.bwd_compute_s}


def comparison(measured: dict, profile, backend: str, device_preset: str) -> list[dict]:
    rows = []
    for m in measured["cases"]:
        if m.get("backend") != backend or "error" in m:
            continue
        case = Case(m["family"], m["hidden"], m["tp"], m["seq"], m["mbs"])
        p = predicted_layer_s(case, device_preset, profile, "triton" if backend == "triton" else "torch")
        pred = p["fwd_s"] + p["bwd_s"]
        rows.append({"case": case.name, "measured_s": m["fwd_bwd_s"], "predicted_s": pred,
                     "fwd_measured_s": m["fwd_s"], "fwd_predicted_s": p["fwd_s"],
                     "error": pred / m["fwd_bwd_s"] - 1})
    return rows


def summary(rows: list[dict]) -> dict[str, float]:
    errs = sorted(abs(r["error"]) for r in rows)
    if not errs:
        return {"cases": 0}
    p90 = errs[min(len(errs) - 1, int(round(0.9 * (len(errs) - 1))))]
    return {"cases": len(errs), "median_abs_error": statistics.median(errs), "p90_abs_error": p90,
            "mean_error": statistics.mean(r["error"] for r in rows)}


FLASH_FORWARD = ("fprop",)  # cuDNN's SDPA kernels by name: the forward's, and the backward's (main + helpers)
FLASH_BACKWARD = ("bprop", "cudnn::fusion")


def flash_rows(measured: dict, device_preset: str) -> list[dict]:
    """Per measured case with cuDNN's flash kernels (the `triton` backend's breakdown): the kernels' forward and
    backward seconds, the GEMM curve's rate at the attention's shape (`Efficiency.attention_efficiency`, FLOPs
    counted in full), each pass's measured rate over it, and the priced seconds (`attention_cost.attention_time_s`)."""
    from autoplan.cluster import preset
    from autoplan.cost_model.attention_cost import attention_time_s
    from autoplan.cost_model.compute import Efficiency

    device = preset(device_preset).device
    efficiency, head_dim, rows = Efficiency().resolved(device), measured["head_dim"], []
    for m in measured["cases"]:
        kernels = m.get("kernels") if m.get("backend") == "triton" else None
        fwd = sum(k["s"] for k in kernels or () if any(p in k["kernel"] for p in FLASH_FORWARD))
        bwd = sum(k["s"] for k in kernels or () if any(p in k["kernel"] for p in FLASH_BACKWARD))
        if not (fwd and bwd):
            continue
        case = Case(m["family"], m["hidden"], m["tp"], m["seq"], m["mbs"])
        batch_heads, seq = case.mbs * case.hidden // head_dim / case.tp, case.seq
        flops = 4 * batch_heads * seq * seq * head_dim
        curve = device.peak_flops_for("bfloat16") * efficiency.attention_efficiency(batch_heads * seq, seq, head_dim,
                                                                                    device, "bfloat16")
        priced = attention_time_s(batch_heads, seq, head_dim, 2, device, "bfloat16", efficiency)
        rows.append({"case": case.name, "fwd_s": fwd, "bwd_s": bwd, "fwd_over_curve": flops / fwd / curve,
                     "bwd_over_curve": 2 * flops / bwd / curve, "fwd_priced_s": priced[0], "bwd_priced_s": priced[1]})
    return rows


def cmd_flash(args) -> int:
    """The flash kernels' rates over the GEMM curve (what `attention_cost.GPU_FLASH_RATES` is fitted to) and today's price."""
    rows = flash_rows(json.loads(Path(args.measured).read_text()), args.device)
    print(f"{'case':32} {'fwd us':>8} {'priced':>8} {'bwd us':>8} {'priced':>8} {'fwd/curve':>9} {'bwd/curve':>9}")
    for r in rows:
        print(f"{r['case']:32} {r['fwd_s'] * 1e6:8.0f} {r['fwd_priced_s'] * 1e6:8.0f} {r['bwd_s'] * 1e6:8.0f} "
              f"{r['bwd_priced_s'] * 1e6:8.0f} {r['fwd_over_curve']:9.3f} {r['bwd_over_curve']:9.3f}")
    if rows:
        med = {k: statistics.median(r[k] for r in rows) for k in ("fwd_over_curve", "bwd_over_curve")}
        err = {p: statistics.median(abs(r[f"{p}_priced_s"] / r[f"{p}_s"] - 1) for r in rows) for p in ("fwd", "bwd")}
        print(f"{len(rows)} cases: rate over the curve, median forward {med['fwd_over_curve']:.3f}, backward "
              f"{med['bwd_over_curve']:.3f}; priced median |error| forward {err['fwd']:.1%}, backward {err['bwd']:.1%}")
    return 0


def cmd_compare(args) -> int:
    from autoplan.profiler.profile import HardwareProfile

    measured = json.loads(Path(args.measured).read_text())
    profile = HardwareProfile.load(args.profile) if args.profile else None
    rows = comparison(measured, profile, args.backend, args.device)
    print(f"{measured['device']}, torch {measured['torch']}: one layer's forward + backward on one tp rank, "
          f"backend {args.backend}, priced {'with ' + args.profile if profile else 'by the ' + args.device + ' preset'}")
    print(f"{'case':32} {'measured ms':>12} {'predicted ms':>13} {'error':>8}   fwd meas/pred ms")
    for r in rows:
        print(f"{r['case']:32} {r['measured_s'] * 1e3:12.3f} {r['predicted_s'] * 1e3:13.3f} {r['error']:+8.1%}"
              f"   {r['fwd_measured_s'] * 1e3:.3f} / {r['fwd_predicted_s'] * 1e3:.3f}")
    s = summary(rows)
    if s["cases"]:
        print(f"{s['cases']} cases: median |error| {s['median_abs_error']:.1%}, p90 {s['p90_abs_error']:.1%}, "
              f"mean {s['mean_error']:+.1%}  (goal: median <= 10%, p90 <= 15%)")
    if args.json:
        write_json(Path(args.json), {"summary": s, "rows": rows})
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    m = sub.add_parser("measure", help="time the layers on this CUDA device")
    m.add_argument("-o", "--output", default="layer_times.json")
    m.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU: the code path only, no timings")
    m.add_argument("--only", nargs="+", metavar="PREFIX", help="the cases whose names start so (e.g. gpt-h8192)")
    m.add_argument("--backends", nargs="+", choices=("triton", "torch"), default=("triton", "torch"))
    m.add_argument("--rounds", type=int, default=2, help="passes over the cases (odd ones in reverse order)")
    c = sub.add_parser("compare", help="the cost model's prediction against a measured file")
    c.add_argument("measured")
    c.add_argument("--profile", help="a hardware profile of the measured device (default: its preset)")
    c.add_argument("--backend", choices=("triton", "torch"), default="triton")
    c.add_argument("--device", default="h200", help="the cluster preset of the measured device")
    c.add_argument("--json", help="write the rows and the summary here")
    f = sub.add_parser("flash", help="cuDNN's flash kernels of a measured file against the GEMM curve and the price")
    f.add_argument("measured")
    f.add_argument("--device", default="h200", help="the cluster preset of the measured device")
    h = sub.add_parser("host", help="the host's dispatch per kernel on blocks of several sizes (CUDA)")
    h.add_argument("-o", "--output", default="host_dispatch.json")
    args = parser.parse_args(argv)
    return {"measure": cmd_measure, "compare": cmd_compare, "flash": cmd_flash, "host": cmd_host}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
