"""The runtime's fused Triton kernels, timed: shapes, least-traffic byte counts, and the timing loop
shared by `autoplan profile` (`measure_kernels`, into the hardware profile) and
benchmarks/kernels.py (which adds torch eager and torch.compile beside them and prints a table).

For each kernel, pass (fwd, bwd) and shape:

    time_s   the fastest CUDA-event window after warm-up (`profiler.gemm.fastest_call_s`); bwd is
             `torch.autograd.grad` of one forward's output, repeated
    bytes    the least HBM traffic the pass needs: every input read once and every output written
             once, per-row statistics included (`BYTES`); not what a variant does beyond that
             (eager's fp32 temporaries, the norms' (P, D) fp32 partial weight grads), so
             bytes / time_s is an effective bandwidth, comparable across variants

Tensors are at least 64 MiB, larger than the 50-60 MB L2 of an H100 / H200, so no flush between
calls is needed. The kernels run only on CUDA (`skip_reason` says why not elsewhere); triton is
imported by the kernels themselves, on first use.

On a CPU the runtime runs the same op kinds as their torch fallbacks (`runtime.kernels`, backend
"torch", as `runtime.kernel_ops` calls them), and `measure_eager_kernels` times those instead, at
`CPU_SHAPES` (the per-rank tensors of small models, 0.4-16 MiB: below glibc's mmap threshold, where
`cost_model.eager`'s fresh-copy curve prices the fall-off above it), one thread's CPU time per median
window (`profiler.gemm.fastest_call_s`), each call on the next of copies of the inputs that together
exceed the last-level cache (`eager_copies`), forward with autograd recording as in training: a step's
ops read activations made a layer or a pass ago and pay the typical window (in steps of
benchmarks/step_fidelity.py's Llama, 2026-11-26, its 9 RMSNorms' forwards took 3.6 ms against 1.2 ms
priced from the fastest window on one hot input; thread time between forward hooks). Their bytes
are not the least traffic but what the cost model counts for the nodes each runs (`EAGER_BYTES`,
`cost_model.compute.memory_op_bytes`; tests/test_kernel_costs.py checks the two agree on captured
models), so that bytes / (copy * e_k) gives back the measured time (`cost_model.kernels`):

    kernel         nodes                              fwd bytes             bwd bytes
    rms_norm       norm (x -> y, weight w)            2 N b + w             3 N b + w
    layer_norm     norm (weight and bias)             2 N b + 2 w           3 N b + 2 w
    silu_mul       silu (2 N b / 3 N b) + mul         5 N b                 8 N b
                   (3 N b / 5 N b)
    bias_gelu      gelu, no bias (the linear has it)  2 N b                 3 N b
    add            the residual add                   3 N b                 3 N b
    cross_entropy  N logits                           N (b + 12)            N (20 + b)

with N the elements of the op's activation (tokens x width), b its itemsize. RoPE has no node of its
own: it runs inside the attention core, and a CPU prices torch's five passes over q and k at the copy's
bandwidth (`cost_model.attention_cost.rope_time_s`); it is not timed here.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from autoplan.errors import ConfigError
from autoplan.profiler.profile import KernelSample

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
# CPU: the runtime's torch fallbacks at per-rank sizes of small models (module docstring)
CPU_SHAPES: dict[str, list[dict[str, int]]] = {
    "rms_norm": [dict(tokens=1024, hidden=384), dict(tokens=256, hidden=384), dict(tokens=2048, hidden=768),
                 dict(tokens=4096, hidden=1024)],
    "layer_norm": [dict(tokens=1024, hidden=384), dict(tokens=256, hidden=384), dict(tokens=2048, hidden=768),
                   dict(tokens=4096, hidden=1024)],
    "silu_mul": [dict(tokens=1024, ffn=1024), dict(tokens=256, ffn=512), dict(tokens=2048, ffn=2048)],
    "bias_gelu": [dict(tokens=1024, ffn=1536), dict(tokens=256, ffn=768), dict(tokens=2048, ffn=2048)],
    "add": [dict(tokens=1024, hidden=384), dict(tokens=256, hidden=384), dict(tokens=4096, hidden=1024)],
    "cross_entropy": [dict(tokens=1024, vocab=4096), dict(tokens=256, vocab=2048), dict(tokens=2048, vocab=2048)],
}
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}  # short name -> torch's


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


def _eager_norm_bytes(weights: int):
    def count(s, b):
        n, d = s["tokens"] * s["hidden"], s["hidden"]
        return 2 * n * b + weights * d * b, 3 * n * b + weights * d * b
    return count


# (fwd_bytes, bwd_bytes) the cost model counts for the nodes a torch fallback runs (module docstring)
EAGER_BYTES: dict[str, Callable[[dict[str, int], int], tuple[int, int]]] = {
    "rms_norm": _eager_norm_bytes(1),
    "layer_norm": _eager_norm_bytes(2),
    "silu_mul": lambda s, b: (5 * s["tokens"] * s["ffn"] * b, 8 * s["tokens"] * s["ffn"] * b),
    "bias_gelu": lambda s, b: (2 * s["tokens"] * s["ffn"] * b, 3 * s["tokens"] * s["ffn"] * b),
    "add": lambda s, b: (3 * s["tokens"] * s["hidden"] * b,) * 2,
    "cross_entropy": lambda s, b: (s["tokens"] * s["vocab"] * (b + 12), s["tokens"] * s["vocab"] * (20 + b)),
}


@dataclass
class Row:
    """One (kernel, pass, shape): its least bytes and each variant's seconds (its fastest window)."""

    kernel: str
    pass_: str  # "fwd" or "bwd"
    shape: str
    bytes: int
    time_s: dict[str, float]  # variant -> seconds (absent where not run)

    def gbps(self, variant: str) -> float | None:
        t = self.time_s.get(variant)
        return self.bytes / t / 1e9 if t else None


# ---------------------------------------------------------------------------- the cases


def kernel_inputs(kernel: str, s: dict[str, int], device, dtype) -> tuple[list[torch.Tensor], dict]:
    """Differentiable inputs, and what the variants close over (targets, routing, cos / sin)."""
    from autoplan.models.layers import rope_cos_sin
    from autoplan.runtime import kernels as K

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


def variants(kernel: str, ctx: dict, with_compile: bool) -> dict[str, Callable]:
    """variant -> fn(*inputs) -> output: "triton" (runtime.kernels, backend="triton"), "eager" (the
    module's torch reference) and, with `with_compile`, "compile" (torch.compile of the reference;
    cross_entropy: of F.cross_entropy on fp32 logits)."""
    from autoplan.runtime import kernels as K

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
        return _moe_variants(ctx["routing"], with_compile)
    if with_compile:
        fns["compile"] = torch.compile(fns["eager"])
    return fns


def _moe_variants(routing, with_compile: bool) -> dict[str, Callable]:
    from autoplan.runtime import kernels as K
    from autoplan.runtime.kernels import moe_permute as moe

    def pipeline(backend):
        return lambda x, w: K.moe_unpermute(K.moe_permute(x, routing, backend), w, routing, backend)

    fns = {"triton": pipeline("triton"), "eager": pipeline("torch")}
    if with_compile:
        fns["compile"] = torch.compile(lambda x, w: moe.unpermute_torch(
            moe.permute_torch(x, routing), w, routing))
    return fns


# ---------------------------------------------------------------------------- timing


def time_s(fn: Callable[[], object], device: torch.device, budget_s: float) -> float:
    """Seconds of fn() on CUDA (`fastest_call_s`); on CPU one call, only to exercise a dry run."""
    if device.type == "cuda":
        from autoplan.profiler.gemm import fastest_call_s
        return fastest_call_s(fn, device, budget_s)
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench(kernel: str, s: dict[str, int], device, dtype, names: list[str],
          budget_s: float) -> list[Row]:
    """The fwd and bwd Rows of `kernel` at shape `s`, each variant of `names` timed."""
    inputs, ctx = kernel_inputs(kernel, s, device, dtype)
    fns = variants(kernel, ctx, with_compile="compile" in names)
    fwd_bytes, bwd_bytes = BYTES[kernel](s, torch.finfo(dtype).bits // 8)
    label = " ".join(f"{k}={v}" for k, v in s.items())
    fwd, bwd = Row(kernel, "fwd", label, fwd_bytes, {}), Row(kernel, "bwd", label, bwd_bytes, {})
    for name in names:
        fn = fns[name]
        with torch.no_grad():
            fwd.time_s[name] = time_s(lambda: fn(*inputs), device, budget_s)
        out = fn(*inputs)
        grad = torch.randn_like(out)
        bwd.time_s[name] = time_s(
            lambda: torch.autograd.grad(out, inputs, grad, retain_graph=True), device, budget_s)
        del out, grad
    return [fwd, bwd]


# ---------------------------------------------------------------------------- into a profile


def skip_reason(device: torch.device) -> str | None:
    """Why the Triton kernels cannot be timed on `device`, or None when they can."""
    from autoplan.runtime.kernels.dispatch import interpreting, load_triton

    if device.type != "cuda":
        return f"the Triton kernels are timed on CUDA only, and this profile is of {device.type}"
    if interpreting():
        return "TRITON_INTERPRET=1 is set: the kernels would run in Triton's interpreter"
    if load_triton() is None:
        return "triton is not installed (pip install 'autoplan[triton]')"
    return None


def samples(rows: list[Row], dtype: str, variant: str = "triton") -> tuple[KernelSample, ...]:
    """The profile samples of `variant` in `rows` (rows it did not run are left out)."""
    return tuple(KernelSample(r.kernel, r.pass_, r.shape, dtype, r.bytes, r.time_s[variant])
                 for r in rows if r.time_s.get(variant))


def measure_kernels(device: torch.device, dtype: str = "bfloat16", quick: bool = False,
                    budget_s: float | None = None) -> tuple[KernelSample, ...]:
    """Every kernel's Triton fwd and bwd at SHAPES (quick: the first shape of each) in `dtype` (a
    torch dtype name) on `device`, which must be CUDA (`skip_reason`)."""
    why = skip_reason(device)
    if why is not None:
        raise ConfigError(f"cannot measure the Triton kernels: {why}")
    if dtype not in DTYPES.values():
        raise ConfigError(f"kernel dtype {dtype!r} is not one of {sorted(DTYPES.values())}")
    budget_s = budget_s if budget_s is not None else (0.05 if quick else 0.2)
    rows = []
    for kernel, shapes in SHAPES.items():
        for s in shapes[:1] if quick else shapes:
            rows += bench(kernel, s, device, getattr(torch, dtype), ["triton"], budget_s)
            torch.cuda.empty_cache()
    return samples(rows, dtype)


# ---------------------------------------------------------------------------- a CPU's torch fallbacks


def eager_call(kernel: str, s: dict[str, int], device, dtype) -> tuple[list[torch.Tensor], Callable]:
    """Differentiable inputs of `kernel` at shape `s`, and the call the runtime makes of it on a CPU
    (`runtime.kernel_ops`: backend "torch"; gelu without a bias; the residual add as `x + y`)."""
    from autoplan.runtime import kernels as K

    if kernel == "add":
        return [torch.randn(s["tokens"], s["hidden"], device=device, dtype=dtype).requires_grad_()
                for _ in range(2)], lambda x, y: x + y
    if kernel == "bias_gelu":
        x = torch.randn(s["tokens"], s["ffn"], device=device, dtype=dtype).requires_grad_()
        return [x], lambda x: K.bias_gelu(x, None, backend="torch")
    inputs, ctx = kernel_inputs(kernel, s, device, dtype)
    calls = {"rms_norm": lambda x, w: K.rms_norm(x, w, backend="torch"),
             "layer_norm": lambda x, w, b: K.layer_norm(x, w, b, backend="torch"),
             "silu_mul": lambda a, b: K.silu_mul(a, b, backend="torch"),
             "cross_entropy": lambda z: K.vocab_parallel_cross_entropy(z, ctx["targets"], backend="torch")}
    return inputs, calls[kernel]


def time_eager_s(kernel: str, s: dict[str, int], device, dtype, budget_s: float) -> tuple[float, float]:
    """(forward, backward) seconds of `kernel`'s torch fallback at `s`: forward with autograd recording
    (as training runs it), backward `torch.autograd.grad` of one forward's output (the add: the sum of two
    gradients where the residual stream forks), each the median window, each call on the next of
    `eager_copies` (module docstring)."""
    from autoplan.profiler.gemm import fastest_call_s, in_turn

    copies = eager_copies(kernel, s, device, dtype)
    fwd_s = fastest_call_s(in_turn(copies, lambda copy: copy[1](*copy[0])), device, budget_s, statistics.median)
    passes = [_backward_call(kernel, inputs, fn) for inputs, fn in copies]
    return fwd_s, fastest_call_s(in_turn(passes, lambda backward: backward()), device, budget_s, statistics.median)


def _backward_call(kernel: str, inputs: list[torch.Tensor], fn: Callable) -> Callable[[], object]:
    """One copy's backward as `time_eager_s` times it: `torch.autograd.grad` of one forward's output; the add's,
    the sum of the residual fork's two gradients (its backward passes dy through; that sum is what the cost
    model counts on it, `compute.memory_op_bytes`)."""
    out = fn(*inputs)
    dy = torch.randn_like(out)
    if kernel == "add":
        other = torch.randn_like(out)
        return lambda: dy + other
    return lambda: torch.autograd.grad(out, inputs, dy, retain_graph=True)


def eager_copies(kernel: str, s: dict[str, int], device, dtype) -> list[tuple[list[torch.Tensor], Callable]]:
    """`eager_call`'s inputs and call, in as many copies as fill `profiler.gemm.COLD_POOL_BYTES` (2 to 64): taken
    in turn, each call reads inputs the call before did not leave in the cache, as a step's ops read
    activations made a layer or a pass ago (module docstring)."""
    from autoplan.profiler.gemm import pool_size

    first = eager_call(kernel, s, device, dtype)
    count = pool_size(sum(t.numel() * t.element_size() for t in first[0]), 64)
    return [first] + [eager_call(kernel, s, device, dtype) for _ in range(count - 1)]


def measure_eager_kernels(device: torch.device, dtype: str = "float32", quick: bool = False,
                          budget_s: float | None = None) -> tuple[KernelSample, ...]:
    """The torch fallbacks' fwd and bwd samples at `CPU_SHAPES` (quick: the first shape of each), bytes
    as the cost model counts their nodes (`EAGER_BYTES`), on a CPU; () elsewhere (module docstring)."""
    if device.type != "cpu":
        return ()
    if dtype not in DTYPES.values():
        raise ConfigError(f"kernel dtype {dtype!r} is not one of {sorted(DTYPES.values())}")
    budget_s = budget_s if budget_s is not None else (0.01 if quick else 0.03)
    torch_dtype, out = getattr(torch, dtype), []
    for kernel, shapes in CPU_SHAPES.items():
        for s in shapes[:1] if quick else shapes:
            times = time_eager_s(kernel, s, device, torch_dtype, budget_s)
            label = " ".join(f"{k}={v}" for k, v in s.items())
            for direction, nbytes, t in zip(("fwd", "bwd"), EAGER_BYTES[kernel](s, torch.finfo(torch_dtype).bits // 8),
                                            times):
                out.append(KernelSample(kernel, direction, label, dtype, nbytes, t))
    return tuple(out)
