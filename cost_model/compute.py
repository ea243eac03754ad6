"""Compute time: a roofline with achievable-efficiency factors.

    op_time_s = max(flops / (peak_flops[dtype] * efficiency.matmul),
                    bytes / (hbm_bandwidth * efficiency.memory))

Matmul-heavy ops (linear, attention, MoE experts) land on the FLOP side; norms, pointwise ops,
embeddings and cross-entropy move many bytes per FLOP and land on the bandwidth side, so one formula
serves both. Peak FLOP/s is the dense Tensor Core figure of the DeviceSpec, which is why the matmul
efficiency is below 1 even for large GEMMs.

Ignored: kernel launch overheads, tile quantisation of small or skinny GEMMs (they reach far less
than the default efficiency: down to ~0.33 of peak on the H200 sweep), overlap between kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

from autoplan.cluster import DeviceSpec
from autoplan.errors import ConfigError


@dataclass(frozen=True)
class Efficiency:
    """Achievable fraction of peak: dense matmul FLOP/s and HBM bandwidth.

    Defaults: large bf16 GEMMs on the H200 reach ~789 of 989 TFLOP/s (0.80) and device copies
    ~4.07 of 4.8 TB/s (0.85), measured with torch 2.11 (/work/shared/ENVIRONMENT.md). A model's GEMMs
    are not all large, so matmul takes 0.75 and memory 0.80 until the profiler calibrates them.
    """

    matmul: float = 0.75
    memory: float = 0.80
    source: str = "H200 bf16 GEMM ~789/989 TFLOP/s and copy ~4.07/4.8 TB/s, rounded down (ENVIRONMENT.md)"

    def __post_init__(self) -> None:
        for name in ("matmul", "memory"):
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise ConfigError(f"efficiency {name}={value!r} must be in (0, 1]")


def op_time_s(flops: float, nbytes: float, device: DeviceSpec, dtype: str, efficiency: Efficiency) -> float:
    """Roofline time of an op doing `flops` FLOPs and moving `nbytes` bytes of HBM traffic."""
    if flops < 0 or nbytes < 0:
        raise ConfigError(f"op_time_s needs flops >= 0 and bytes >= 0, got flops={flops}, bytes={nbytes}")
    compute_s = flops / (device.peak_flops_for(dtype) * efficiency.matmul)
    memory_s = nbytes / (device.memory_bandwidth_bytes_per_s * efficiency.memory)
    return max(compute_s, memory_s)
