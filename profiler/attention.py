"""Causal attention on a CPU: `torch.nn.functional.scaled_dot_product_attention` as eager PyTorch runs it.

    forward rate  = 4 * batch_heads * seq^2 * head_dim / fwd_s
    backward rate = 8 * batch_heads * seq^2 * head_dim / bwd_s

FLOPs counted in full (as `cost_model.attention_cost.attention_time_s` counts them), the causal mask's skipped
half included, so a rate prices a shape of its own kind directly. Each shape's forward is timed alone
(no autograd), and forward + backward together, backward their difference; each the fastest window
(`profiler.gemm.fastest_call_s`, one thread's CPU time under torchrun).

Why: the cost model priced the CPU's SDPA from the GEMM curve, as a GPU's flash kernel; on the 2-core
development machine it ran 63 ms where 42 ms was priced (benchmarks/step_fidelity.py's Llama, a microbatch
of 4, issue 20): torch's CPU flash kernel blocks queries and keys, and its backward recomputes the
probabilities. CPU only: on CUDA the flash kernels keep the default curve (`Efficiency.attention_efficiency`).

Shapes (batch x heads, sequence, head dim): `CPU_SHAPES`, the per-rank shapes of small models at a
few hundred to a thousand tokens; `--quick`: two of them.
"""

from __future__ import annotations

import torch

from autoplan.profiler.gemm import TORCH_DTYPES, fastest_call_s
from autoplan.profiler.profile import AttentionSample

CPU_SHAPES = ((6, 256, 64), (24, 256, 64), (12, 512, 64), (8, 1024, 64), (16, 256, 128))
CPU_QUICK_SHAPES = ((6, 256, 64), (24, 256, 64))


def time_attention_s(batch_heads: int, seq: int, head_dim: int, dtype: str, device: torch.device,
                     budget_s: float) -> tuple[float, float]:
    """(forward, backward) seconds of causal SDPA over q, k, v of (batch_heads, seq, head_dim)."""
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    q, k, v = (torch.randn(1, batch_heads, seq, head_dim, dtype=TORCH_DTYPES[dtype], device=device,
                           requires_grad=True) for _ in range(3))
    dout = torch.randn_like(q)

    def forward() -> None:
        with torch.no_grad():
            sdpa(q, k, v, is_causal=True)

    def both() -> None:
        torch.autograd.grad(sdpa(q, k, v, is_causal=True), (q, k, v), dout)  # no .grad accumulated

    fwd_s = fastest_call_s(forward, device, budget_s)
    return fwd_s, max(fastest_call_s(both, device, budget_s) - fwd_s, fwd_s * 1e-3)


def measure_attention(device: torch.device, dtype: str = "float32", quick: bool = False,
                      budget_s: float | None = None) -> tuple[AttentionSample, ...]:
    """Causal SDPA over `CPU_SHAPES` (`CPU_QUICK_SHAPES`) on a CPU (module docstring); () elsewhere."""
    if device.type != "cpu":
        return ()
    budget_s = budget_s if budget_s is not None else (0.05 if quick else 0.2)
    samples = []
    for batch_heads, seq, head_dim in (CPU_QUICK_SHAPES if quick else CPU_SHAPES):
        fwd_s, bwd_s = time_attention_s(batch_heads, seq, head_dim, dtype, device, budget_s)
        samples.append(AttentionSample(batch_heads, seq, head_dim, dtype, fwd_s, bwd_s))
    return tuple(samples)
