"""Memory bandwidth: a device-to-device copy of one large buffer.

    bandwidth_bytes_per_s = 2 * buffer_bytes / time_s

since `dst.copy_(src)` reads every byte of src once and writes every byte of dst once (the
convention of the STREAM "copy" kernel; on the H200 it gives about 4.07 TB/s of a 4.8 TB/s
datasheet figure). The buffer must dwarf the last-level cache, or the copy measures the cache:
1 GiB on CUDA (H100/H200 L2 is 50-60 MB), 256 MiB on CPU (server L3 is 32-256 MB per socket,
shared by the cores). `--quick` uses 256 MiB and 32 MiB, which still clears L2 but may sit
partly in a large CPU L3: a quick profile's CPU bandwidth is an upper bound.
"""

from __future__ import annotations

import torch

from autoplan.profiler.gemm import fastest_call_s
from autoplan.profiler.profile import MemorySample

MiB = 2**20


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
