"""HBM efficiency of the runtime's fused Triton kernels, for the memory-bound nodes they run.

When `plan.kernels` resolves to Triton ("triton", or "auto" on a CUDA cluster; runtime.kernel_ops)
the runtime runs these captured nodes with one fused kernel each:

    kernel         nodes (NodeInfo op_kind, target)
    rms_norm       norm "RMSNorm"
    layer_norm     norm "LayerNorm"
    silu_mul       elementwise "silu", and the "mul" that reads a silu node (fx names it silu_<i>)
    bias_gelu      elementwise "gelu"
    cross_entropy  cross_entropy, except under the "sequence" strategy (runtime.losses, torch)
    moe_permute    moe: its memory-bound term (the expert GEMMs keep the GEMM efficiency)
    rope           no node: RoPE runs inside the attention core, which is priced as one flash kernel

A kernel's efficiency, measured (`autoplan profile` on CUDA, `profiler.kernels`):

    e_k = (sum of bytes / sum of time_s over the kernel's samples, fwd and bwd) / copy bandwidth

with bytes the least HBM traffic of each pass (`profiler.kernels.BYTES`) and the copy bandwidth
the same profile's device-to-device copy. With a profile loaded the cost model prices HBM at that
copy bandwidth (`calibration.device_spec_from_profile`), so a node of B bytes takes
B / (copy * e_k) = B / (the kernel's achieved bytes/s). e_k is capped at 1: no node is priced
faster than a copy of its bytes. A kernel without a measurement (no profile, a profile made
without CUDA, or one that lacks it) takes `Efficiency.memory`, the same fraction as torch eager,
and the plan's notes say "assumed"; eager torch ("torch", or "auto" on a CPU cluster) always
takes `Efficiency.memory`.

Not modelled: a fused kernel also moves fewer bytes than the eager ops whose byte counts the nodes
carry (silu * mul: one pass instead of two; cross-entropy: no fp32 copy of the logits), so a
fused node is priced conservatively.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING

from autoplan.errors import ConfigError
from autoplan.plan import KERNELS
from autoplan.profiler.profile import KERNEL_NAMES, same_device

if TYPE_CHECKING:
    from autoplan.capture import NodeInfo
    from autoplan.cluster import DeviceSpec
    from autoplan.profiler.profile import HardwareProfile

_NORMS = {"RMSNorm": "rms_norm", "LayerNorm": "layer_norm"}
_SILU_NODE = re.compile(r"silu(_\d+)?")


def node_kernel(node: "NodeInfo", strategy: str) -> str | None:
    """The fused kernel that runs `node` under `strategy` when the kernels are Triton (module
    docstring), or None."""
    kind, target = node.op_kind, node.target
    if kind == "norm":
        return _NORMS.get(target)
    if kind == "elementwise":
        if target == "gelu":
            return "bias_gelu"
        if target == "silu" or (target == "mul" and any(_SILU_NODE.fullmatch(i) for i in node.inputs)):
            return "silu_mul"
        return None
    if kind == "cross_entropy":
        return None if strategy == "sequence" else "cross_entropy"
    return "moe_permute" if kind == "moe" else None


@dataclass(frozen=True)
class FusedKernels:
    """How the runtime's fused memory-bound ops run, as the cost model sees it.

    option: `plan.kernels` ("auto" | "triton" | "torch"); triton: whether it resolves to the Triton
    kernels on the device priced (None: not resolved yet, `Efficiency.resolved` does it); measured:
    (kernel, e_k) pairs (module docstring); source: where they were measured ("" when nothing was)."""

    option: str = "auto"
    triton: bool | None = None
    measured: tuple[tuple[str, float], ...] = ()
    source: str = ""

    def __post_init__(self) -> None:
        if self.option not in KERNELS:
            raise ConfigError(f"kernels {self.option!r} must be one of {KERNELS}")
        for name, value in self.measured:
            if name not in KERNEL_NAMES:
                raise ConfigError(f"measured kernel {name!r} is not one of {KERNEL_NAMES}")
            if not (isinstance(value, float) and math.isfinite(value) and value > 0):
                raise ConfigError(f"measured efficiency of {name!r} must be a finite float > 0, "
                                  f"got {value!r}")

    def efficiency(self, kernel: str | None) -> float | None:
        """e_k of `kernel` (capped at 1) when the kernels are Triton and it was measured, else None."""
        if not self.triton or kernel is None:
            return None
        value = dict(self.measured).get(kernel)
        return None if value is None else min(value, 1.0)

    def note(self, memory: float) -> str:
        """One line for a plan's provenance: which kernels, and whose efficiencies."""
        how = {"auto": "'auto' on this cluster", "triton": "'triton'", "torch": "'torch'"}[self.option]
        if not self.triton:
            return (f"fused kernels: torch eager (kernels {how}); memory-bound ops at an assumed "
                    f"{memory:.2f} of HBM bandwidth")
        if not self.measured:
            return (f"fused kernels: Triton (kernels {how}); HBM efficiency assumed {memory:.2f} "
                    f"(not measured: `autoplan profile` on a CUDA device measures it)")
        values = ", ".join(f"{k} {min(v, 1.0):.2f}" for k, v in self.measured)
        return (f"fused kernels: Triton (kernels {how}); HBM efficiency measured on {self.source}: "
                f"{values} (of copy bandwidth); others assumed {memory:.2f}")


def measured_efficiencies(profile: "HardwareProfile") -> tuple[tuple[str, float], ...]:
    """(kernel, e_k) for every kernel with samples in `profile`, in KERNEL_NAMES order."""
    moved, taken = defaultdict(float), defaultdict(float)
    for s in profile.kernels:
        moved[s.kernel] += s.bytes
        taken[s.kernel] += s.time_s
    copy = profile.memory.bandwidth_bytes_per_s
    return tuple((k, float(moved[k] / taken[k] / copy)) for k in KERNEL_NAMES if taken.get(k))


def fused_kernels(option: str, device: "DeviceSpec", profile: "HardwareProfile | None" = None
                  ) -> FusedKernels:
    """What `option` means on `device`: Triton for "triton", and for "auto" where the device is a
    GPU (a CUDA profile, or any device but one named "cpu"); with a profile's measured efficiencies."""
    if option not in KERNELS:
        raise ConfigError(f"kernels {option!r} must be one of {KERNELS}")
    # as calibration.check_profile_device: a device named "cpu" is a CPU, any other a GPU
    gpu = profile.device_kind == "cuda" if profile is not None else not same_device(device.name, "cpu")
    triton = option == "triton" or (option == "auto" and gpu)
    if not triton or profile is None or not profile.kernels:
        return FusedKernels(option, triton)
    return FusedKernels(option, True, measured_efficiencies(profile),
                        f"{profile.device_name!r} ({profile.created})")
