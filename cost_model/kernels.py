"""Measured efficiency of the runtime's kernels for the memory-bound nodes they run: the fused Triton
kernels on CUDA, their torch fallbacks on a CPU.

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

and, where a pass was measured, that pass's own by size (`FusedKernels.passes`): each sample's
bytes / time_s / copy, interpolated piecewise linearly in (log bytes, log e_k) at the node's bytes of
that pass and clamped to the smallest and largest sample (`cost_model.eager`'s curves' rule). Forward
and backward apart: eager RMSNorm's backward on a CPU ran 3-15 times slower per byte than its forward;
by size: it ran at 14 GB/s over a 1.5 MiB activation and 1.2 GB/s over 16 MiB, so a figure pooled over
sizes prices a small model's norms by its largest sample. A node looks its kernel up at its own bytes:
for silu_mul's two nodes 2/5 and 3/5 of the kernel's (forward), which the curve reads a little off.

with bytes the least HBM traffic of each pass (`profiler.kernels.BYTES`) and the copy bandwidth
the same profile's device-to-device copy. With a profile loaded the cost model prices HBM at that
copy bandwidth (`calibration.device_spec_from_profile`), so a node of B bytes takes
B / (copy * e_k) = B / (the kernel's achieved bytes/s). e_k is capped at 1: no node is priced
faster than a copy of its bytes. A kernel without a measurement (no profile, a profile made
without CUDA, or one that lacks it) takes `Efficiency.memory`, the same fraction as torch eager,
and the plan's notes say "assumed"; eager torch ("torch", or "auto" on a CPU cluster) takes
`Efficiency.memory` unless a CPU profile measured the torch fallbacks (below).

On a CPU (eager torch: "torch", or "auto" on a CPU cluster) the runtime runs the same op kinds as
the kernels' torch fallbacks, and the residual add as torch's; a CPU profile times those
(`profiler.kernels.measure_eager_kernels`) with bytes as the cost model counts their nodes
(`compute.memory_op_bytes`), so e_k above turns a node's bytes back into the measured time:

    kernel (eager)  nodes: those above, and elementwise "add" / "iadd" (the residual add)

Eager's memory-bound ops on a CPU thread run at their own rates (RMSNorm's forward + backward well
below a copy, silu near it), which one flat `Efficiency.memory` misprices both ways; e_k is capped at 1
there too (`memory_time_s` keeps the fresh-copy curve's fall-off above glibc's mmap threshold, which the
samples, all below it, leave out). The measurements price nodes only where the variant that runs was
measured: Triton samples (a CUDA profile) when the kernels are Triton, torch samples (a CPU profile)
when they are torch.

Not modelled: a fused kernel also moves fewer bytes than the eager ops whose byte counts the nodes
carry (silu * mul: one pass instead of two; cross-entropy: no fp32 copy of the logits), so a
fused node is priced conservatively.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from autoplan.cost_model.eager import log_interpolate, merged_points
from autoplan.errors import ConfigError
from autoplan.plan import KERNELS
from autoplan.profiler.profile import KERNEL_NAMES, same_device

if TYPE_CHECKING:
    from autoplan.capture import NodeInfo
    from autoplan.cluster import DeviceSpec
    from autoplan.profiler.profile import HardwareProfile

_NORMS = {"RMSNorm": "rms_norm", "LayerNorm": "layer_norm"}
_SILU_NODE = re.compile(r"silu(_\d+)?")


def node_kernel(node: "NodeInfo", strategy: str, eager: bool = False) -> str | None:
    """The fused kernel that runs `node` under `strategy` when the kernels are Triton, or with `eager`
    the kernel whose torch fallback runs it on a CPU, "add" included (module docstring); else None."""
    kind, target = node.op_kind, node.target
    if eager and kind == "elementwise" and target in ("add", "iadd"):
        return "add"
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
    (kernel, e_k) pairs of the variant that runs, Triton or torch (module docstring); source: where
    they were measured ("" when nothing was)."""

    option: str = "auto"
    triton: bool | None = None
    measured: tuple[tuple[str, float], ...] = ()
    source: str = ""
    # (kernel, "fwd" | "bwd", ((bytes, e_k), ...) of that pass's samples, ascending in bytes)
    passes: tuple[tuple[str, str, tuple[tuple[float, float], ...]], ...] = ()
    _by_pass: dict = field(default_factory=dict, init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        if self.option not in KERNELS:
            raise ConfigError(f"kernels {self.option!r} must be one of {KERNELS}")
        for name, value in self.measured + tuple((k, e) for k, _, points in self.passes for _, e in points):
            if name not in KERNEL_NAMES:
                raise ConfigError(f"measured kernel {name!r} is not one of {KERNEL_NAMES}")
            if not (isinstance(value, float) and math.isfinite(value) and value > 0):
                raise ConfigError(f"measured efficiency of {name!r} must be a finite float > 0, "
                                  f"got {value!r}")
        self._by_pass.update(((k, d), points) for k, d, points in self.passes)  # looked up per node priced

    def efficiency(self, kernel: str | None, direction: str | None = None, nbytes: float | None = None
                   ) -> float | None:
        """e_k of `kernel` (capped at 1) where the variant that runs measured it, else None: of the pass
        `direction` ("fwd" | "bwd") at `nbytes` where that pass was measured, else both pooled."""
        if kernel is None:
            return None
        points = self._by_pass.get((kernel, direction))
        if points and nbytes is not None:
            return min(log_interpolate(points, max(nbytes, 1.0)), 1.0)
        value = dict(self.measured).get(kernel)
        return None if value is None else min(value, 1.0)

    def note(self, memory: float) -> str:
        """One line for a plan's provenance: which kernels, and whose efficiencies."""
        how = {"auto": "'auto' on this cluster", "triton": "'triton'", "torch": "'torch'"}[self.option]
        values = ", ".join(f"{k} {min(v, 1.0):.2f}" for k, v in self.measured)
        if not self.triton:
            if self.measured:
                return (f"fused kernels: torch eager (kernels {how}); efficiency measured on {self.source}: "
                        f"{values} (of copy bandwidth); other memory-bound ops assumed {memory:.2f}")
            return (f"fused kernels: torch eager (kernels {how}); memory-bound ops at an assumed "
                    f"{memory:.2f} of HBM bandwidth")
        if not self.measured:
            return (f"fused kernels: Triton (kernels {how}); HBM efficiency assumed {memory:.2f} "
                    f"(not measured: `autoplan profile` on a CUDA device measures it)")
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


def pass_efficiencies(profile: "HardwareProfile") -> tuple[tuple[str, str, tuple[tuple[float, float], ...]], ...]:
    """(kernel, direction, ((bytes, e_k), ...)) for every pass with samples in `profile`: each sample's bytes
    over its time, over the copy bandwidth, ascending in bytes (equal sizes merged; module docstring)."""
    points = defaultdict(list)
    copy = profile.memory.bandwidth_bytes_per_s
    for s in profile.kernels:
        points[s.kernel, s.direction].append((float(s.bytes), s.bytes / s.time_s / copy))
    return tuple((k, d, merged_points(points[k, d])) for k in KERNEL_NAMES for d in ("fwd", "bwd") if points.get((k, d)))


def fused_kernels(option: str, device: "DeviceSpec", profile: "HardwareProfile | None" = None
                  ) -> FusedKernels:
    """What `option` means on `device`: Triton for "triton", and for "auto" where the device is a
    GPU (a CUDA profile, or any device but one named "cpu"); with a profile's measured efficiencies
    where it measured the variant that runs (Triton on CUDA, torch on a CPU)."""
    if option not in KERNELS:
        raise ConfigError(f"kernels {option!r} must be one of {KERNELS}")
    # as calibration.check_profile_device: a device named "cpu" is a CPU, any other a GPU
    gpu = profile.device_kind == "cuda" if profile is not None else not same_device(device.name, "cpu")
    triton = option == "triton" or (option == "auto" and gpu)
    if profile is None or not profile.kernels or triton != (profile.device_kind == "cuda"):
        return FusedKernels(option, triton)
    return FusedKernels(option, triton, measured_efficiencies(profile),
                        f"{profile.device_name!r} ({profile.created})", pass_efficiencies(profile))
