"""Memory bandwidth: a device-to-device copy of one large buffer.

    bandwidth_bytes_per_s = 2 * buffer_bytes / time_s

since `dst.copy_(src)` reads every byte of src once and writes every byte of dst once (the
convention of the STREAM "copy" kernel; on the H200 it gives about 4.07 TB/s of a 4.8 TB/s
datasheet figure). The buffer must dwarf the last-level cache, or the copy measures the cache:
1 GiB on CUDA (H100/H200 L2 is 50-60 MB), 256 MiB on CPU (server L3 is 32-256 MB per socket,
shared by the cores). `--quick` uses 256 MiB and 32 MiB, which still clears L2 but may sit
partly in a large CPU L3: a quick profile's CPU bandwidth is an upper bound.

Fresh-allocation copies (CPU only, `measure_fresh_copies`): eager ops allocate their outputs, and on a CPU
an allocation above glibc's mmap threshold (at most 32 MiB) gets fresh pages from the kernel each call,
which the copy then faults in one page at a time. So the profile also times `src.clone()` (a fresh output
per call, freed before the next) over buffer sizes `FRESH_SIZES_MIB`, each from one of enough sources that
together outsize the cache (the step's ops read tensors written long before, not a cached source):

    bandwidth(size) = 2 * size / time_s

On the 2-core development machine (one thread a rank, both ranks at once, 2026-11-26) that gave 50-54 GB/s
up to 24 MiB and 4.5-4.9 GB/s from 32 MiB up, where the preallocated 256 MiB copy read 22-36 GB/s: the
cross-entropy over 32 MiB of logits took 215-225 ms where the preallocated copy priced it at 31.5 ms
(issue 20). The cost model prices a memory-bound op's bytes at this curve, read at the bytes one of its
kernels moves, where it is slower than the preallocated copy (`cost_model.compute.memory_time_s`). On CUDA the caching allocator hands back blocks it holds, so the
curve is not measured there.

AdamW (CUDA, `measure_adamw_rate`): torch's foreach AdamW step over fp32 parameters, timed whole, as the bytes
per second of the passes the cost model counts for it (`cost_model.optimizer.adamw_pass_bytes`): its
multi-tensor kernels read and write the weights, gradients and both moments in a few passes each, and run
at their own fraction of the copy above (on the lent H200: 3.6-3.8 TB/s in steps, against the copy's 4.2).
`cost_model.optimizer.adamw_time_s` prices the optimizer step at this rate where a profile measured it.

The optimizer's host work per tensor (`measure_optimizer_host_s`): a step's gradients are cleared
(`zero_grad`) right after the batch's blocking copy to the device, and AdamW's step starts right after the
loss and gradient norm are read on the host; both times the device has nothing queued, so the Python the host
runs per parameter tensor before the first kernel (AdamW's per-parameter bookkeeping, the tensor lists of its
foreach kernels, zero_grad's loop) is exposed. The profile times one window of [zero_grad, the gradients
attached again, AdamW's step] from an idle device, against the marginal window when such steps run back to back
(the host then runs ahead), at two tensor counts over the same parameters, and fits

    exposed(n) = U_n - (k U'_n - U_n) / (k - 1) = a + b n          (U: one window, U': k windows, per step)

On a CPU the host is the device: the same window over `n` one-element tensors, whose kernels take next to nothing,
is the host's work, a + b n. `cost_model.optimizer.optimizer_host_time_s` adds a + b (tensors stepped) to the
optimizer step.
"""

from __future__ import annotations

import statistics
from typing import Callable

import torch

from autoplan.profiler.gemm import fastest_call_s, in_turn
from autoplan.profiler.profile import MemorySample

MiB = 2**20
FRESH_SIZES_MIB = (1, 4, 16, 24, 32, 48, 64, 128, 256)
FRESH_QUICK_SIZES_MIB = (4, 64)
COLD_SOURCE_BYTES = 256 * MiB  # the sources of one size together: beyond a server's last-level cache


def default_buffer_bytes(kind: str, quick: bool = False) -> int:
    """Buffer size per device kind and mode, as in the module docstring."""
    if kind == "cuda":
        return (256 if quick else 1024) * MiB
    return (32 if quick else 256) * MiB


def measure_memory_bandwidth(device: torch.device, buffer_bytes: int | None = None, quick: bool = False,
                             budget_s: float | None = None) -> MemorySample:
    """Time of `dst.copy_(src)` for two uint8 buffers of `buffer_bytes` on `device`, its fastest window.

    uint8 makes the byte count exact; a same-dtype contiguous copy is a plain memcpy (cudaMemcpyAsync
    device-to-device on CUDA, a parallel memcpy over torch's threads on CPU)."""
    buffer_bytes = buffer_bytes or default_buffer_bytes(device.type, quick)
    budget_s = budget_s if budget_s is not None else (0.1 if quick else 0.5)
    src = torch.ones(buffer_bytes, dtype=torch.uint8, device=device)  # touched: pages are resident
    dst = torch.zeros(buffer_bytes, dtype=torch.uint8, device=device)
    time_s = fastest_call_s(lambda: dst.copy_(src), device, budget_s)
    return MemorySample(buffer_bytes=buffer_bytes, time_s=time_s)


ADAMW_TENSORS = (32, 1 << 22)  # (tensors, parameters each): 128 M fp32 parameters, 2 GiB of state on CUDA


def measure_adamw_rate(device: torch.device, quick: bool = False, shape: tuple[int, int] = ADAMW_TENSORS
                       ) -> tuple[float, int, float]:
    """(bytes per second, parameters, seconds per step) of `torch.optim.AdamW`'s step (foreach, its defaults
    otherwise, as the runtime makes it) over `shape[0]` fp32 tensors of `shape[1]` parameters with gradients,
    its median window after three steps made its states (module docstring)."""
    from autoplan.cost_model.optimizer import adamw_pass_bytes
    from autoplan.profiler.gemm import timed_windows_s

    count, size = shape
    params = [torch.zeros(size, device=device, requires_grad=True) for _ in range(count)]
    for p in params:
        p.grad = torch.randn(size, device=device)
    optimizer = torch.optim.AdamW(params, lr=1e-5, foreach=True)
    for _ in range(3):
        optimizer.step()
    seconds = statistics.median(timed_windows_s(optimizer.step, device, repeats=3 if quick else 7, inner=3))
    total = count * size
    return adamw_pass_bytes(4.0) * total / seconds, total, seconds


OPTIMIZER_HOST_COUNTS = (16, 128)  # tensors of the two windows (`measure_optimizer_host_s`)
OPTIMIZER_HOST_PARAMS = 1 << 28  # CUDA: parameters over those tensors (4 GiB of fp32 state): the device's step outlasts
# the host's work on them, so back-to-back steps are device-bound


def optimizer_host_window(count: int, size: int, device: torch.device) -> Callable[[], None]:
    """A step as the runtime's boundaries see it, over `count` fp32 tensors of `size` parameters with
    gradients: `zero_grad`, the gradients attached again (as backward does), AdamW's step (torch's default
    implementation for the device, foreach on CUDA, as `RankProgram.make_optimizer` makes it); its states made."""
    params = [torch.zeros(size, device=device, requires_grad=True) for _ in range(count)]
    grads = [torch.full((size,), 1e-3, device=device) for _ in range(count)]
    optimizer = torch.optim.AdamW(params, lr=1e-5)

    def window() -> None:
        optimizer.zero_grad(set_to_none=True)
        for p, g in zip(params, grads):
            p.grad = g
        optimizer.step()

    for _ in range(3):
        window()
    return window


def measure_optimizer_host_s(device: torch.device, quick: bool = False, counts: tuple[int, int] = OPTIMIZER_HOST_COUNTS,
                             total_params: int = OPTIMIZER_HOST_PARAMS) -> tuple[float, float]:
    """(a, b): seconds the optimizer's host work per step exposes, a + b per tensor stepped (module docstring),
    from the median windows at `counts` tensors; each >= 0."""
    from autoplan.profiler.gemm import timed_windows_s

    repeats, burst = (3, 3) if quick else (7, 5)
    exposed = []
    for count in counts:
        size = max(1, total_params // count) if device.type == "cuda" else 1
        window = optimizer_host_window(count, size, device)
        one = statistics.median(timed_windows_s(window, device, repeats=repeats, inner=1))
        if device.type == "cuda":
            back_to_back = statistics.median(timed_windows_s(window, device, repeats=repeats, inner=burst))
            one -= (burst * back_to_back - one) / (burst - 1)  # less the device's own time per step
        exposed.append(max(0.0, one))
        del window
    per_tensor = max(0.0, (exposed[1] - exposed[0]) / (counts[1] - counts[0]))
    return max(0.0, exposed[0] - per_tensor * counts[0]), per_tensor


def measure_fresh_copies(device: torch.device, quick: bool = False, budget_s: float | None = None
                         ) -> tuple[MemorySample, ...]:
    """Per size of `FRESH_SIZES_MIB` (`FRESH_QUICK_SIZES_MIB` with quick), the fastest window's seconds of
    `src.clone()` on a CPU, the sources rotated so none is cached (module docstring); () on CUDA."""
    if device.type != "cpu":
        return ()
    budget_s = budget_s if budget_s is not None else (0.05 if quick else 0.2)
    samples = []
    for mib in (FRESH_QUICK_SIZES_MIB if quick else FRESH_SIZES_MIB):
        size = mib * MiB
        sources = [torch.ones(size, dtype=torch.uint8) for _ in range(max(2, COLD_SOURCE_BYTES // size))]
        samples.append(MemorySample(size, fastest_call_s(in_turn(sources, torch.Tensor.clone), device, budget_s)))
        del sources
    return tuple(samples)
