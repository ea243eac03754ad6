"""Triton kernels against torch eager and torch.compile: time, achieved bandwidth, % of copy.

    python benchmarks/kernels.py                         # every kernel, bf16, on the local GPU
    python benchmarks/kernels.py --kernels rms_norm cross_entropy --markdown
    python benchmarks/kernels.py --dry-run               # CPU: tiny shapes, torch path only

For each kernel, pass (fwd, bwd) and shape, three variants of the same maths:

    triton    autoplan.runtime.kernels, backend="triton"
    eager     the module's torch reference (the CPU path), backend="torch"
    compile   torch.compile of that reference (cross_entropy: of F.cross_entropy on fp32 logits)

time_s is the median of CUDA-event windows after warm-up (`autoplan.profiler.gemm.median_call_s`);
bwd is `torch.autograd.grad` of one forward's output, repeated. Bandwidth is `bytes / time_s`
with `bytes` the least HBM traffic the pass needs: every input read once and every output written
once, per-row statistics included, each kernel's formula in `BYTES` below. It does not count
what a variant does beyond that (eager's fp32 temporaries, the (P, D) fp32 partial weight grads
of the norms' backward), so it is an effective bandwidth, comparable across variants. `%copy` is
that bandwidth over the device-to-device copy bandwidth measured here first
(`autoplan.profiler.memory`: 2 * buffer_bytes / time of a 1 GiB copy; about 4.0 TB/s on the H200).
Tensors are at least 64 MiB, larger than the 50-60 MB L2, so no flush between calls is needed.

Goal (issue 7): every kernel >= 80% of copy bandwidth, faster than eager everywhere, not slower
than torch.compile. `--json PATH` writes the rows for the cost model's kernel efficiencies.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from autoplan.models.layers import rope_cos_sin
from autoplan.runtime import kernels as K

# the package's attribute `moe_permute` is the function; this is the module
moe = importlib.import_module("autoplan.runtime.kernels.moe_permute")

# Realistic shapes: 8k-32k tokens, hidden 4096-12288, vocabulary slices 16k-64k.
SHAPES: dict[str, list[dict[str, int]]] = {
    "rms_norm": [dict(tokens=8192, hidden=4096), dict(tokens=16384, hidden=8192),
                 dict(tokens=32768, hidden=12288)],
    "layer_norm": [dict(tokens=8192, hidden=4096), dict(tokens=16384, hidden=8192),
                   dict(tokens=32768, hidden=12288)],
    "silu_mul": [dict(tokens=8192, ffn=14336), dict(tokens=16384, ffn=14336),
                 dict(tokens=32768, ffn=28672)],
    "bias_gelu": [dict(tokens=8192, ffn=16384), dict(tokens=16384, ffn=32768),
                  dict(tokens=32768, ffn=6144)],
    "rope": [dict(batch=1, heads=32, seq=8192, head_dim=128),
             dict(batch=2, heads=64, seq=8192, head_dim=128),
             dict(batch=4, heads=96, seq=8192, head_dim=128)],
    "cross_entropy": [dict(tokens=8192, vocab=16032), dict(tokens=16384, vocab=32064),
                      dict(tokens=32768, vocab=64128)],
    "moe_permute": [dict(tokens=8192, hidden=4096, experts=8, top_k=2),
                    dict(tokens=16384, hidden=4096, experts=64, top_k=8),
                    dict(tokens=32768, hidden=6144, experts=8, top_k=2)],
}
DRY_RUN_DIVISOR = 64  # --dry-run divides every size but head_dim / experts / top_k by this


def _norm_bytes(s, b):
    n, d = s["tokens"], s["hidden"]  # fwd: x, w -> y, stats;  bwd: dy, x, w, stats -> dx, dw
    return (2 * n * d + d) * b + 8 * n, (3 * n * d + 2 * d) * b + 8 * n


# (fwd_bytes, bwd_bytes) of a shape at `b` bytes per element, per the module docstring
BYTES: dict[str, Callable[[dict[str, int], int], tuple[int, int]]] = {
    "rms_norm": _norm_bytes,
    "layer_norm": _norm_bytes,
    # fwd: a, b -> y;  bwd: g, a, b -> da, db
    "silu_mul": lambda s, b: (3 * s["tokens"] * s["ffn"] * b, 5 * s["tokens"] * s["ffn"] * b),
    # fwd: x, bias -> y;  bwd: g, x, bias -> dx, dbias
    "bias_gelu": lambda s, b: ((2 * s["tokens"] * s["ffn"] + s["ffn"]) * b,
                               (3 * s["tokens"] * s["ffn"] + 2 * s["ffn"]) * b),
    # both: x (or dy), cos, sin (fp32, T x d) -> y (or dx)
    "rope": lambda s, b: (2 * (2 * s["batch"] * s["heads"] * s["seq"] * s["head_dim"] * b
                               + 2 * 4 * s["seq"] * s["head_dim"]),) * 2,
    # fwd: logits, targets -> 3 fp32 stats;  bwd: logits, targets, lse, scale -> grad
    "cross_entropy": lambda s, b: (s["tokens"] * (s["vocab"] * b + 8 + 12),
                                   s["tokens"] * (2 * s["vocab"] * b + 8 + 8)),
    # fwd: permute x (N, h) -> (N*k, h), then unpermute (N*k, h), w -> (N, h)
    # bwd: the unpermute's dout, y -> dy, dw, then the permute's dxp -> dx
    "moe_permute": lambda s, b: (
        (2 * s["tokens"] * s["hidden"] + 2 * s["tokens"] * s["top_k"] * s["hidden"]) * b,
        (2 * s["tokens"] * s["hidden"] + 3 * s["tokens"] * s["top_k"] * s["hidden"]) * b),
}


@dataclass
class Row:
    kernel: str
    pass_: str  # "fwd" or "bwd"
    shape: str
    bytes: int
    time_s: dict[str, float]  # variant -> seconds (absent where not run)

    def gbps(self, variant: str) -> float | None:
        t = self.time_s.get(variant)
        return self.bytes / t / 1e9 if t else None


# ---------------------------------------------------------------------------- the cases


def _inputs(kernel: str, s: dict[str, int], device, dtype) -> tuple[list[torch.Tensor], dict]:
    """Differentiable inputs, and what the variants close over (targets, routing, cos / sin)."""
    def r(*shape, grad=True):
        return torch.randn(*shape, device=device, dtype=dtype).requires_grad_(grad)

    if kernel in ("rms_norm", "layer_norm"):
        xs = [r(s["tokens"], s["hidden"]), r(s["hidden"])]
        return xs + ([r(s["hidden"])] if kernel == "layer_norm" else []), {}
    if kernel == "silu_mul":
        return [r(s["tokens"], s["ffn"]), r(s["tokens"], s["ffn"])], {}
    if kernel == "bias_gelu":
        return [r(s["tokens"], s["ffn"]), r(s["ffn"])], {}
    if kernel == "rope":
        cos, sin = rope_cos_sin(s["seq"], s["head_dim"], 10000.0, torch.device(device))
        return [r(s["batch"], s["heads"], s["seq"], s["head_dim"])], dict(cos=cos, sin=sin)
    if kernel == "cross_entropy":
        targets = torch.randint(0, s["vocab"], (s["tokens"],), device=device)
        return [r(s["tokens"], s["vocab"])], dict(targets=targets)
    routing = K.moe_routing(torch.randn(s["tokens"], s["experts"], device=device)
                            .topk(s["top_k"], dim=-1).indices, s["experts"])
    weights = torch.rand(s["tokens"], s["top_k"], device=device, dtype=dtype)
    return [r(s["tokens"], s["hidden"]), weights.requires_grad_()], dict(routing=routing)


def _variants(kernel: str, ctx: dict, with_compile: bool) -> dict[str, Callable]:
    """variant -> fn(*inputs) -> output, for the Triton kernel, eager torch and torch.compile."""
    if kernel == "rms_norm":
        fns = {"triton": lambda x, w: K.rms_norm(x, w, backend="triton"),
               "eager": K.norms.rms_norm_torch}
    elif kernel == "layer_norm":
        fns = {"triton": lambda x, w, b: K.layer_norm(x, w, b, backend="triton"),
               "eager": K.norms.layer_norm_torch}
    elif kernel == "silu_mul":
        fns = {"triton": lambda a, b: K.silu_mul(a, b, backend="triton"),
               "eager": K.activations.silu_mul_torch}
    elif kernel == "bias_gelu":
        fns = {"triton": lambda x, b: K.bias_gelu(x, b, backend="triton"),
               "eager": K.activations.bias_gelu_torch}
    elif kernel == "rope":
        cos, sin = ctx["cos"], ctx["sin"]
        fns = {"triton": lambda x: K.apply_rope(x, cos, sin, backend="triton"),
               "eager": lambda x: K.rope.apply_rope_torch(x, cos, sin)}
    elif kernel == "cross_entropy":
        t = ctx["targets"]
        fns = {"triton": lambda z: K.vocab_parallel_cross_entropy(z, t, backend="triton"),
               "eager": lambda z: K.vocab_parallel_cross_entropy(z, t, backend="torch")}
        if with_compile:
            fns["compile"] = torch.compile(lambda z: F.cross_entropy(z.float(), t))
        return fns
    else:
        routing = ctx["routing"]

        def pipeline(backend):
            return lambda x, w: K.moe_unpermute(K.moe_permute(x, routing, backend), w, routing,
                                                backend)

        fns = {"triton": pipeline("triton"), "eager": pipeline("torch")}
        if with_compile:
            fns["compile"] = torch.compile(lambda x, w: moe.unpermute_torch(
                moe.permute_torch(x, routing), w, routing))
        return fns
    if with_compile:
        fns["compile"] = torch.compile(fns["eager"])
    return fns


def _time_s(fn: Callable[[], object], device: torch.device, budget_s: float) -> float:
    if device.type == "cuda":
        from autoplan.profiler.gemm import median_call_s
        return median_call_s(fn, device, budget_s)
    start = time.perf_counter()  # dry run: one call, only to exercise the table
    fn()
    return time.perf_counter() - start


def bench(kernel: str, s: dict[str, int], device, dtype, variants: list[str],
          budget_s: float) -> list[Row]:
    inputs, ctx = _inputs(kernel, s, device, dtype)
    fns = _variants(kernel, ctx, with_compile="compile" in variants)
    fwd_bytes, bwd_bytes = BYTES[kernel](s, torch.finfo(dtype).bits // 8)
    label = " ".join(f"{k}={v}" for k, v in s.items())
    fwd, bwd = Row(kernel, "fwd", label, fwd_bytes, {}), Row(kernel, "bwd", label, bwd_bytes, {})
    for name in variants:
        fn = fns[name]
        with torch.no_grad():
            fwd.time_s[name] = _time_s(lambda: fn(*inputs), device, budget_s)
        out = fn(*inputs)
        grad = torch.randn_like(out)
        bwd.time_s[name] = _time_s(
            lambda: torch.autograd.grad(out, inputs, grad, retain_graph=True), device, budget_s)
        del out, grad
    return [fwd, bwd]


# ---------------------------------------------------------------------------- output


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def table(rows: list[Row], variants: list[str], copy_gbps: float, markdown: bool) -> str:
    head = ["kernel", "pass", "shape", "MB"]
    for v in variants:
        head += [f"{v} us", f"{v} GB/s", f"{v} %copy"]
    head += [f"x{v}" for v in variants if v != "triton"]  # speedup of triton over v
    lines = []
    for r in rows:
        cells = [r.kernel, r.pass_, r.shape, f"{r.bytes / 1e6:,.0f}"]
        for v in variants:
            t, g = r.time_s.get(v), r.gbps(v)
            cells += [_fmt(t and t * 1e6, ",.0f"), _fmt(g, ",.0f"),
                      _fmt(g and 100 * g / copy_gbps, ".0f")]
        base = r.time_s.get("triton")
        cells += [_fmt(base and r.time_s.get(v) and r.time_s[v] / base, ".2f")
                  for v in variants if v != "triton"]
        lines.append(cells)
    if markdown:
        out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        return "\n".join(out + ["| " + " | ".join(c) + " |" for c in lines])
    widths = [max(len(x) for x in col) for col in zip(head, *lines)]
    fmt = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))  # noqa: E731
    return "\n".join([fmt(head), fmt(["-" * w for w in widths])] + [fmt(c) for c in lines])


def _device_line(device: torch.device) -> str:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
    triton = K.dispatch.load_triton()
    return (f"{datetime.date.today()}  {name or device.type}  torch {torch.__version__}  "
            f"triton {triton[0].__version__ if triton else 'absent'}")


def copy_bandwidth_gbps(device: torch.device, dry_run: bool) -> float:
    from autoplan.profiler.memory import measure_memory_bandwidth
    sample = (measure_memory_bandwidth(device, buffer_bytes=1 << 20, budget_s=0.02) if dry_run
              else measure_memory_bandwidth(device))
    return 2 * sample.buffer_bytes / sample.time_s / 1e9


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernels", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    parser.add_argument("--budget-s", type=float, default=0.2, help="timed seconds per variant")
    parser.add_argument("--markdown", action="store_true", help="a table for the README")
    parser.add_argument("--json", type=Path, help="write the rows here")
    parser.add_argument("--dry-run", action="store_true",
                        help=f"CPU, shapes / {DRY_RUN_DIVISOR}, torch eager only: checks the "
                             f"script, measures nothing")
    args = parser.parse_args(argv)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    if args.dry_run:
        device, variants, dtype = torch.device("cpu"), ["eager"], torch.float32
    else:
        if not torch.cuda.is_available():
            print("benchmarks/kernels.py measures Triton kernels on a CUDA GPU, and "
                  "torch.cuda.is_available() is False here. Run it on the GPU machine, or use "
                  "--dry-run to check the script on CPU.", file=sys.stderr)
            return 2
        if K.dispatch.load_triton() is None:
            print("triton is not installed: pip install 'autoplan[triton]'", file=sys.stderr)
            return 2
        device = torch.device("cuda")
        variants = ["triton", "eager"] + ([] if args.no_compile else ["compile"])
    copy_gbps = copy_bandwidth_gbps(device, args.dry_run)
    rows = []
    for kernel in args.kernels:
        for s in SHAPES[kernel]:
            if args.dry_run:
                s = {k: v if k in ("head_dim", "experts", "top_k") else max(2, v // DRY_RUN_DIVISOR)
                     for k, v in s.items()}
            rows += bench(kernel, s, device, dtype, variants, args.budget_s)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    print(f"{_device_line(device)}  {args.dtype if not args.dry_run else 'fp32'}  copy "
          f"{copy_gbps:,.1f} GB/s{'  (dry run: timings mean nothing)' if args.dry_run else ''}")
    print(table(rows, variants, copy_gbps, args.markdown))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"device": _device_line(device), "copy_gbps": copy_gbps,
                                         "rows": [asdict(r) for r in rows]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
