"""Compute time: a roofline per kernel, with shape-dependent GEMM efficiency.

    kernel_time_s = max(flops / (peak_flops[dtype] * e_gemm(m, n, k)),  bytes / (hbm_bandwidth * e_memory),
                        floor)

and an op's time is the sum over the kernels it launches (they run one after another on the device):

    linear (m tokens, k in, n out)   fwd: one GEMM (m, n, k); bwd: dX (m, k, n) and dW (n, k, m)
    attention, flash                 one fused kernel each way; no T x T tensor reaches HBM
    attention, materialized          Megatron-LM <= 2021 / eager PyTorch: QK^T and PV batched GEMMs with
                                     the T x T scores in HBM, a fused scale-mask-softmax, an optional
                                     dropout (`cost_model.attention_cost`)
    norm, pointwise, cross-entropy,  memory-bound: their bytes (`memory_op_bytes`) at the HBM roofline
    embedding

GEMM bytes are A + B + C once each. e_gemm is `calibration.GemmEfficiency`: a hardware profile's
measurements when one is loaded, else the default curve of the device (sustained ceiling, lower for
small GEMMs); small and skinny GEMMs are not at peak. e_memory = 0.80: device-to-device copies reach
~4.07 of 4.8 TB/s on the H200 (0.85, ENVIRONMENT.md) and elementwise kernels a little less. A node that
the runtime runs with a fused Triton kernel takes that kernel's measured efficiency instead, when the
plan's kernels are Triton and a profile measured it; on a CPU, where the runtime runs the kernels' torch
fallbacks, their measured efficiency, per pass and by size (`cost_model.kernels`, `Efficiency.for_node`).

Memory-bound bytes per element of a tensor of the op (i = its itemsize), forward / backward:

    norm            read x, write y / read x and dy, write dx (1.5x forward; the weight-gradient sums are
                    per-block partials)
    add, sub        read both, write one / the same: the gradient passes through, but where the residual
                    stream forks (x feeds the norm and the add) autograd sums two gradients
    mul, div        read 2, write 1 / read dy and both inputs, write 2 gradients
    neg, casts      read 1, write 1 / the same
    other unary     (gelu, silu, tanh, ...) read 1, write 1 / read x and dy, write dx
    cross-entropy   logits (N of them, itemsize i): cast to fp32 (i + 4), log-softmax (4 + 4) / the
                    one-hot gradient (4), log-softmax backward (4 + 4 + 4), the cast back (4 + i)
    embedding       read the ids and the gathered rows, write the output / read dy, write the rows into
                    a zero-filled dense (V, h) gradient (the zero fill is bytes of the whole local table)

The optimizer step: `cost_model.optimizer` (AdamW as it runs, pass by pass).

Every op with parameters also pays, in backward, autograd's accumulation of the microbatch's weight
gradient into .grad (read both, write one: 3 x the gradient bytes per parameter; the first microbatch
of a step could skip it, which is ignored).

FLOPs of memory-bound ops are priced at the tensor-core rate, which keeps every op at least as long as
its FLOPs at the best GEMM rate (the search's time bound relies on it); they are memory-bound anyway.

The floor (`Efficiency.kernel_floor_s`): no kernel takes less than a fixed time, whatever its size:
its launch, and the gap an eager framework leaves between small kernels. 7 us by default, the
`kernel_launch_overhead` floor of meta-pytorch/autoparallel's compute model
(autoparallel/cost_models/compute_estimation.py); `autoplan profile` measures it on the device
(`profiler.launch`), and a loaded profile replaces the default. Kernels per op, forward / backward:

    linear          1 GEMM / 2 GEMMs (dX, dW)
    attention       flash: 1 / 2 (FlashAttention-2's backward: a row-sum pre-pass, then the main kernel);
                    materialized: one per kernel of `attention_cost.attention_kernels`; with RoPE inside the core, its
                    passes over q and k (`attention_cost`: Triton 1 / 1 a tensor, torch 5 / 5), not counted
                    for the host (its measured cost per kernel holds them)
    moe             3 / 6: the expert projections' grouped GEMMs (routing and permutation not counted)
    norm            1 / 2 (dx, then the weight gradient's partial sums reduced)
    elementwise     1 / 1;   embedding 1 / 2 (the zero fill, then the scatter-add);
    cross-entropy   2 / 3 (cast and log-softmax / one-hot gradient, log-softmax backward, cast back)
    accumulation    one per parameter tensor of the op, in backward (into .grad)

Where the model prices several kernels as one roofline (a memory-bound op), the op takes at least
its kernels x the floor. A fused pair under Triton (silu * mul) still pays a floor per node, as it
pays the bytes of both (conservative). With the default GEMM curve a tiny GEMM already takes about
TAU0_S / ceiling (`calibration`), above the floor; the floor binds on memory-bound kernels, on
GEMMs under a flat or measured efficiency, and on the optimizer's step.

Host dispatch (`Efficiency.host_kernel_s`, `host_recompute_s`, `host_serial`): the host's share of a step, eager
PyTorch's dispatch of every kernel and recomputation's bookkeeping, in `cost_model.host`.

Eager PyTorch on a CPU (`cost_model.eager`, where a profile measured them): a memory-bound op's bytes at
the bandwidth of a fresh-allocation copy of the buffer one of its kernels moves where that is below the
device's copy (above glibc's mmap threshold every output is faulted in page by page; `memory_time_s`), and the attention core at causal SDPA's measured
rates, no faster than the best GEMM rate (the search's time bound relies on it).

Ignored: overlap between kernels, L2 cache reuse between kernels, hidden dropout (the built-in models
have none), the bias adds of linear layers (fused in GEMM epilogues) and their bias gradients.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from autoplan.cluster import ClusterSpec, DeviceSpec
from autoplan.cost_model.comm import AxisGroup, group_collective_time_s
from autoplan.cost_model.eager import AttentionRates, FreshCopyCurve
from autoplan.cost_model.host import CPU_RECOMPUTE_S, GPU_OPTIMIZER_HOST_S, GPU_RECOMPUTE_S, HOST_KERNEL_S
from autoplan.cost_model.calibration import CollectiveCalibration, GemmEfficiency, device_spec_from_profile
from autoplan.cost_model.kernels import FusedKernels, fused_kernels, node_kernel
from autoplan.errors import ConfigError
from autoplan.grad_buckets import BUCKET_RULES
from autoplan.profiler.profile import ProfileError, same_device

if TYPE_CHECKING:
    from autoplan.capture import NodeInfo
    from autoplan.profiler.profile import HardwareProfile

ATTENTION_KINDS = ("flash", "materialized")
FP32_BYTES = 4
PASS_THROUGH = frozenset({"add", "iadd", "add_", "sub", "isub", "sub_"})
COPY_LIKE = frozenset({"neg", "float", "to"})
BINARY_PRODUCT = frozenset({"mul", "imul", "mul_", "truediv", "div"})
# no kernel runs in less (module docstring): meta-pytorch/autoparallel's kernel_launch_overhead
KERNEL_FLOOR_S = 7e-6
# fixed cost of one collective call: NCCL's base latency of a ring, LL protocol (the one small messages
# use), NVIDIA/nccl src/graph/tuning.cc baseLat {Ring, LL} = 6.6 us (`cost_model.comm`)
COLLECTIVE_CALL_S = 6.6e-6
# memory-bound ops: kernels (forward, backward) each launches (module docstring)
OP_KERNELS = {"norm": (1, 2), "elementwise": (1, 1), "embedding": (1, 2), "cross_entropy": (2, 3)}
MOE_KERNELS = (3, 6)


@dataclass(frozen=True)
class AttentionKernel:
    """How the attention core runs (module docstring): "flash" keeps the T x T scores on chip;
    "materialized" writes them to HBM (Megatron-LM before FlashAttention, eager PyTorch), with the
    attention-probability `dropout` of GPT-2/3 training when set."""

    kind: str = "flash"
    dropout: bool = False

    def __post_init__(self) -> None:
        if self.kind not in ATTENTION_KINDS:
            raise ConfigError(f"attention kernel {self.kind!r} must be one of {ATTENTION_KINDS}")
        if self.dropout and self.kind == "flash":
            raise ConfigError("attention dropout is priced only for the materialized kernel; use kind='materialized'")


@dataclass(frozen=True)
class Efficiency:
    """What turns FLOPs and bytes into seconds (module docstring).

    matmul: a flat GEMM efficiency, or None for the shape-dependent curve `gemm` (a profile's,
    `GemmEfficiency.from_profile`; None: the device's default curve, filled in by `resolved`).
    memory: achievable fraction of HBM bandwidth. attention: the attention kernel. collectives:
    measured collective fits (a profile's) that replace the datasheet links inside a node.
    overlap_grad_reduce: data-parallel gradient buckets are reduced while the backward runs (PyTorch
    DDP / FSDP2, Megatron-Core's --overlap-grad-reduce; `autoplan.cost_model.step`), or, when False, after the
    whole backward (Megatron-LM of 2021). kernels: the plan's fused kernels and their measured HBM
    efficiencies (`cost_model.kernels`), which replace `memory` for the nodes they run (`for_node`).
    fsdp_unit_s: FSDP2's fixed cost per unit and microbatch beyond its calls' latencies (ZeRO 3), as a
    profile measured it (`profiler.fsdp`); 0 without one (not priced). grad_buckets: the size rule of the
    data-parallel gradient buckets (`autoplan.grad_buckets.BUCKET_RULES`): "ddp", this runtime's; another
    stack's for pricing runs made on it (benchmarks). collective_sync_s, collective_skew: what a blocking
    collective costs inside a step beyond its own time, s + c sqrt(compute before it) (`comm`'s "Inside a
    step"), a CPU profile's; 0 else. overlap_cost: the fraction of an overlapped collective's time that the
    compute it overlaps loses (`dp_sync`): a CPU profile's, where gloo's threads share the ranks' cores; 0 else."""

    matmul: float | None = None
    memory: float = 0.80
    source: str = "GEMMs: calibration.GemmEfficiency; HBM: H200 copy ~4.07/4.8 TB/s, rounded down (ENVIRONMENT.md)"
    gemm: GemmEfficiency | None = None
    attention: AttentionKernel = AttentionKernel()
    collectives: CollectiveCalibration | None = None
    overlap_grad_reduce: bool = True
    kernels: FusedKernels = FusedKernels()
    kernel_floor_s: float = KERNEL_FLOOR_S
    collective_call_s: float = COLLECTIVE_CALL_S
    fsdp_unit_s: float = 0.0
    grad_buckets: str = "ddp"
    collective_sync_s: float = 0.0
    collective_skew: float = 0.0  # s^0.5: the ranks' skew at a blocking call, c sqrt(compute before it) (`skew_s`)
    overlap_cost: float = 0.0  # of an overlapped collective's time, the share its compute loses
    floor_source: str = ("kernel floor: meta-pytorch/autoparallel's 7 us; collective call: NCCL's ring LL base "
                         "latency, 6.6 us (cost_model.compute)")
    host_kernel_s: float | None = None  # None: the device's default (`resolved`: HOST_KERNEL_S on a GPU, 0 on a CPU)
    # ((recompute kind, forward, re-run host s per forward kernel of a recomputed layer), ...); None: the device's
    # default (`resolved`)
    host_recompute_s: tuple[tuple[str, float, float], ...] | None = None
    host_serial: bool | None = None  # the host's dispatch adds to the kernels (None: `resolved`, True on a CPU)
    # (forward, backward) host s per priced kernel of each pass (a CUDA profile's); None: host_kernel_s for both
    host_phase_kernel_s: tuple[float, float] | None = None
    adamw_bytes_per_s: float | None = None  # a CUDA profile's AdamW rate (`optimizer.adamw_time_s`); None: from the copy
    # (per step, per tensor stepped) host seconds the optimizer exposes (`optimizer.optimizer_host_time_s`); None:
    # the device's default (`resolved`)
    optimizer_host_s: tuple[float, float] | None = None
    fresh_copies: FreshCopyCurve | None = None  # a CPU profile's (`cost_model.eager`); None: the flat copy
    attention_rates: AttentionRates | None = None  # a CPU profile's causal SDPA (`cost_model.eager`)
    _by_kernel: dict = field(default_factory=dict, init=False, repr=False, compare=False, hash=False)
    _default_curve: dict = field(default_factory=dict, init=False, repr=False, compare=False, hash=False)  # by device

    def __post_init__(self) -> None:
        for name in ("matmul", "memory"):
            value = getattr(self, name)
            if value is not None and not 0 < value <= 1:
                raise ConfigError(f"efficiency {name}={value!r} must be in (0, 1]")
        if self.grad_buckets not in BUCKET_RULES:
            raise ConfigError(f"efficiency grad_buckets={self.grad_buckets!r} must be one of {BUCKET_RULES}")
        if not 0 <= self.fsdp_unit_s < 1:
            raise ConfigError(f"efficiency fsdp_unit_s={self.fsdp_unit_s!r} must be in [0, 1) seconds (FSDP2's fixed "
                              f"cost per unit and microbatch; 0 turns it off)")
        for name in ("kernel_floor_s", "collective_call_s", "host_kernel_s", "collective_sync_s"):
            if getattr(self, name) is not None and not 0 <= getattr(self, name) < 1e-2:
                raise ConfigError(f"efficiency {name}={getattr(self, name)!r} must be in [0, 0.01) seconds "
                                  f"(a fixed cost per kernel or call, microseconds; 0 turns it off)")
        if self.host_phase_kernel_s is not None and (len(self.host_phase_kernel_s) != 2
                                                     or not all(0 <= h < 1e-2 for h in self.host_phase_kernel_s)):
            raise ConfigError(f"efficiency host_phase_kernel_s={self.host_phase_kernel_s!r} must be (forward, backward) "
                              f"in [0, 0.01) seconds (the host's cost per priced kernel of each pass)")
        if self.optimizer_host_s is not None and (len(self.optimizer_host_s) != 2
                                                  or not all(0 <= h < 1 for h in self.optimizer_host_s)):
            raise ConfigError(f"efficiency optimizer_host_s={self.optimizer_host_s!r} must be (per step, per tensor) in "
                              f"[0, 1) seconds (the optimizer's exposed host work; (0, 0) turns it off)")
        if self.adamw_bytes_per_s is not None and not self.adamw_bytes_per_s > 0:
            raise ConfigError(f"efficiency adamw_bytes_per_s={self.adamw_bytes_per_s!r} must be > 0 (bytes per second "
                              f"of AdamW's passes; None prices them from the copy)")
        if not 0 <= self.collective_skew < 0.1:
            raise ConfigError(f"efficiency collective_skew={self.collective_skew!r} must be in [0, 0.1) s^0.5 (the ranks' "
                              f"skew at a blocking call per square root of the compute before it; 0 turns it off)")
        if not 0 <= self.overlap_cost <= 1:
            raise ConfigError(f"efficiency overlap_cost={self.overlap_cost!r} must be in [0, 1] (the share of an overlapped "
                              f"collective's time its compute loses; 0: it hides whole)")
        for kind, *seconds in self.host_recompute_s or ():
            if len(seconds) != 2 or not all(0 <= s < 1e-2 for s in seconds):
                raise ConfigError(f"efficiency host_recompute_s[{kind!r}]={tuple(seconds)!r} must be (forward, re-run) "
                                  f"in [0, 0.01) seconds (the host's cost per forward kernel of a recomputed layer; 0 "
                                  f"turns it off)")

    def collective_s(self, kind: str, nbytes: float, cluster: ClusterSpec, group: AxisGroup) -> float:
        """One collective over `group` (`comm.group_collective_time_s`): a profile's fit inside a node where
        there is one, else the ring formula plus the fixed cost of a call; + `collective_sync_s` (`comm`)"""
        sync_s = self.collective_sync_s if group.size > 1 else 0.0
        return sync_s + group_collective_time_s(kind, nbytes, cluster, group, self.collectives, self.collective_call_s)

    def skew_s(self, compute_s: float) -> float:
        """What the ranks' skew adds to a blocking call after `compute_s` of compute since the last one
        (`comm`, "Inside a step"): collective_skew x sqrt(compute_s)."""
        return self.collective_skew * math.sqrt(max(0.0, compute_s)) if self.collective_skew else 0.0

    def floor_note(self) -> str:
        """The fixed costs this efficiency prices, and where they come from (for a plan's notes)."""
        host = (f"; the host's dispatch {self.host_kernel_s * 1e6:.1f} us per kernel, which paces ops too small to "
                f"hide it ({'measured by `autoplan profile`' if self.host_kernel_s != HOST_KERNEL_S else 'measured on a lent H200'})"
                if self.host_kernel_s else "")
        per_step, per_tensor = self.optimizer_host_s or (0.0, 0.0)
        optimizer = (f"; the optimizer's host work {per_step * 1e3:.2f} ms + {per_tensor * 1e6:.2f} us per tensor it "
                     f"steps ({'measured by `autoplan profile`' if self.optimizer_host_s != GPU_OPTIMIZER_HOST_S else 'measured on a lent H100'})"
                     if per_step or per_tensor else "")
        return (f"fixed costs: {self.kernel_floor_s * 1e6:.1f} us per kernel, {self.collective_call_s * 1e6:.1f} us "
                f"per collective call outside a profile's fits ({self.floor_source}){host}{optimizer}")

    def kernels_s(self, roofline_s: float, kernels: int = 1) -> float:
        """An op's time: its roofline, and at least `kernels` launches at the floor (module docstring)."""
        return max(roofline_s, kernels * self.kernel_floor_s) if kernels else roofline_s

    def resolved(self, device: DeviceSpec) -> "Efficiency":
        """This efficiency with the default GEMM curve of `device` where none was given (do it once per
        search: the curve remembers its answers), its kernels option resolved for `device`, and the host's
        cost per kernel `device`'s default where none was given (a CPU runs its ops where it issues them:
        their times hold the dispatch already)."""
        out = self
        if out.kernels.triton is None:
            out = replace(out, kernels=fused_kernels(out.kernels.option, device))
        cpu = same_device(device.name, "cpu")
        if out.host_kernel_s is None:
            out = replace(out, host_kernel_s=0.0 if cpu else HOST_KERNEL_S)
        if out.host_recompute_s is None:
            out = replace(out, host_recompute_s=CPU_RECOMPUTE_S if cpu else GPU_RECOMPUTE_S)
        if out.host_serial is None:
            out = replace(out, host_serial=cpu)
        if out.optimizer_host_s is None:
            out = replace(out, optimizer_host_s=(0.0, 0.0) if cpu else GPU_OPTIMIZER_HOST_S)
        if out.matmul is not None or out.gemm is not None:
            return out
        return replace(out, gemm=GemmEfficiency.from_device_default(device))

    def for_node(self, node: "NodeInfo", strategy: str, direction: str | None = None, nbytes: float | None = None
                 ) -> "Efficiency":
        """This efficiency with `memory` = the measured efficiency of the kernel that runs `node` under
        `strategy` (Triton, or on a CPU its torch fallback) in pass `direction` ("fwd" | "bwd") at the pass's
        `nbytes` (None: both passes pooled), where a profile measured it (`cost_model.kernels`); else itself."""
        if not self.kernels.measured:
            return self
        e = self.kernels.efficiency(node_kernel(node, strategy, eager=not self.kernels.triton), direction, nbytes)
        if e is None:
            return self
        if e not in self._by_kernel:  # one copy per distinct efficiency, not one per node priced
            self._by_kernel[e] = replace(self, memory=e)
        return self._by_kernel[e]

    def gemm_efficiency(self, m: float, n: float, k: float, device: DeviceSpec, dtype: str) -> float:
        if self.matmul is not None:
            return self.matmul
        return (self.gemm or GemmEfficiency.from_device_default(device)).efficiency(m, n, k, dtype)

    def attention_efficiency(self, m: float, n: float, k: float, device: DeviceSpec, dtype: str) -> float:
        """The flash kernel's efficiency, as a GEMM (m, n, k) of the device's default curve: a profile's GEMM
        sweep (k >= 256) does not measure it (on the H200, cuDNN's causal flash kernels ran at 600-1,040
        TFLOP/s forward, counted at full FLOPs, where a profile's k = 256 GEMMs of the same m, n priced them
        up to 20% slow: benchmarks/README.md)."""
        if self.matmul is not None:
            return self.matmul
        if self.gemm is not None and not self.gemm.measured_dtypes:
            return self.gemm.efficiency(m, n, k, dtype)
        if device.name not in self._default_curve:  # one curve per device: it remembers its answers
            self._default_curve[device.name] = GemmEfficiency.from_device_default(device)
        return self._default_curve[device.name].efficiency(m, n, k, dtype)

    def max_matmul(self, device: DeviceSpec, dtype: str) -> float:
        """The best GEMM efficiency of any shape: every op takes at least its FLOPs at this rate."""
        if self.matmul is not None:
            return self.matmul
        return (self.gemm or GemmEfficiency.from_device_default(device)).max_efficiency(dtype)


def calibrate(cluster: ClusterSpec, efficiency: Efficiency | None, profile: "HardwareProfile | None",
              kernels: str | None = None, dtype: str | None = None) -> tuple[ClusterSpec, Efficiency]:
    """The cluster and efficiency the cost model prices with. Without a profile: the datasheet device
    and the device's default GEMM curve. With one (it must be of the cluster's kind of device, else
    ProfileError): the measured HBM bandwidth (`device_spec_from_profile`), the measured GEMM
    efficiencies (`GemmEfficiency.from_profile`; they replace a flat `matmul`), and the measured
    collective fits for groups inside a node, its measured launch floor and FSDP2 unit cost where it has
    them; the attention kernel and memory fraction stay as given.
    `kernels` (plan.kernels; None keeps `efficiency.kernels`): the fused kernels on this cluster, with
    the profile's measured kernel efficiencies where they are Triton (`cost_model.kernels`). `dtype`: the
    plan's; a profile without GEMMs of that dtype is refused (ProfileError) rather than priced from the
    datasheet in silence."""
    efficiency = efficiency or Efficiency()
    if kernels is not None:
        efficiency = replace(efficiency, kernels=fused_kernels(kernels, cluster.device, profile))
    if profile is None:
        return cluster, efficiency.resolved(cluster.device)
    _check_profile_dtype(profile, dtype)
    device = device_spec_from_profile(profile, cluster.device)
    collectives = CollectiveCalibration(profile) if profile.fits else None
    calibrated = replace(efficiency, matmul=None, gemm=GemmEfficiency.from_profile(profile, device),
                         collectives=collectives, source=f"{efficiency.source}; calibrated by the profile of "
                                                         f"{profile.device_name!r} ({profile.created})")
    if profile.host_kernel_s is not None:
        calibrated = replace(calibrated, host_kernel_s=profile.host_kernel_s)
    if profile.host_phase_kernel_s:
        calibrated = replace(calibrated, host_phase_kernel_s=tuple(profile.host_phase_kernel_s))
    if profile.adamw_bytes_per_s is not None:
        calibrated = replace(calibrated, adamw_bytes_per_s=profile.adamw_bytes_per_s)
    if profile.optimizer_host_s is not None:
        calibrated = replace(calibrated, optimizer_host_s=tuple(profile.optimizer_host_s))
    calibrated = replace(calibrated, fresh_copies=FreshCopyCurve.from_profile(profile),
                         attention_rates=AttentionRates.from_profile(profile))
    if profile.fsdp_unit_s is not None:
        calibrated = replace(calibrated, fsdp_unit_s=profile.fsdp_unit_s)
    if profile.collective_sync_s is not None:
        calibrated = replace(calibrated, collective_sync_s=profile.collective_sync_s)
    if profile.collective_skew is not None:
        calibrated = replace(calibrated, collective_skew=profile.collective_skew)
    if profile.overlap_cost is not None:
        calibrated = replace(calibrated, overlap_cost=profile.overlap_cost)
    if profile.host_recompute_s and profile.device_kind == "cpu":  # a GPU's: `host.GPU_RECOMPUTE_S`, from steps
        calibrated = replace(calibrated, host_recompute_s=tuple(sorted((kind, *pair) for kind, pair in
                                                                       profile.host_recompute_s.items())))
    if profile.kernel_floor_s is not None:
        calibrated = replace(calibrated, kernel_floor_s=profile.kernel_floor_s,
                             floor_source=f"kernel floor measured by `autoplan profile` on {profile.device_name!r}; "
                                          f"collective call: NCCL's ring LL base latency (cost_model.compute)")
    return replace(cluster, device=device), calibrated


def _check_profile_dtype(profile: "HardwareProfile", dtype: str | None) -> None:
    measured = sorted({s.dtype for s in profile.gemm})
    if dtype is not None and measured and dtype not in measured:
        raise ProfileError(f"the profile of {profile.device_name!r} measured GEMMs in {', '.join(measured)}, not "
                           f"{dtype}: plan in {measured[0]} (--dtype {measured[0]}), or profile again with "
                           f"`autoplan profile --dtype {dtype}`")


def op_time_s(flops: float, nbytes: float, device: DeviceSpec, dtype: str, efficiency: Efficiency,
              kernels: int = 1, allocates: bool = False) -> float:
    """Roofline time of an op doing `flops` FLOPs at the best GEMM rate and moving `nbytes` bytes of HBM
    traffic, in `kernels` launches of at least the floor each; `allocates`: each kernel writes a fresh
    output (`memory_time_s`), not in place."""
    if flops < 0 or nbytes < 0:
        raise ConfigError(f"op_time_s needs flops >= 0 and bytes >= 0, got flops={flops}, bytes={nbytes}")
    compute_s = flops / (device.peak_flops_for(dtype) * efficiency.max_matmul(device, dtype))
    memory_s = memory_time_s(nbytes, device, efficiency, kernels if allocates else 0)
    return efficiency.kernels_s(max(compute_s, memory_s), kernels)


def memory_time_s(nbytes: float, device: DeviceSpec, efficiency: Efficiency, kernels: int = 0) -> float:
    """Seconds to move `nbytes` bytes of HBM traffic; `kernels` > 0: in that many kernels that each write
    a fresh output, at the profile's fresh-allocation copy of the buffer one of them moves where it has
    that curve (`cost_model.eager`: bytes / (2 kernels)) and it is slower than the device's copy, else at
    the device's copy bandwidth. Never faster than that copy (as `cost_model.kernels` caps a kernel's
    measured efficiency at 1): a cold source's small copy outruns the 256 MiB one (50 against 22 GB/s on
    the development machine), but eager's memory-bound ops on a CPU thread do not (silu 38, RMSNorm 27,
    log-softmax 20 GB/s on cached 4 MiB tensors, and slower than that in the steps of
    benchmarks/step_fidelity.py), so the curve prices the fall-off above the mmap threshold only."""
    bandwidth = device.memory_bandwidth_bytes_per_s
    if kernels and efficiency.fresh_copies is not None:
        bandwidth = min(bandwidth, efficiency.fresh_copies.bandwidth(nbytes / (2 * kernels)))
    return nbytes / (bandwidth * efficiency.memory)


def gemm_time_s(m: float, n: float, k: float, itemsize: float, device: DeviceSpec, dtype: str, efficiency: Efficiency,
                batch: float = 1.0) -> float:
    """A batch of `batch` GEMMs C (m, n) = A (m, k) @ B (k, n): the roofline of their FLOPs at the
    efficiency of one (batch * m, n, k) GEMM and of their bytes (A, B, C once each)."""
    if min(m, n, k) <= 0:
        return 0.0
    flops = 2.0 * batch * m * n * k
    nbytes = batch * (m * k + k * n + m * n) * itemsize
    rate = device.peak_flops_for(dtype) * efficiency.gemm_efficiency(batch * m, n, k, device, dtype)
    return efficiency.kernels_s(max(flops / rate, memory_time_s(nbytes, device, efficiency)))


def linear_time_s(m: float, n: float, k: float, itemsize: float, device: DeviceSpec, dtype: str,
                  efficiency: Efficiency) -> tuple[float, float]:
    """(forward, backward) seconds of y (m, n) = x (m, k) @ W^T: forward one GEMM; backward dX and dW."""
    fwd = gemm_time_s(m, n, k, itemsize, device, dtype, efficiency)
    bwd = (gemm_time_s(m, k, n, itemsize, device, dtype, efficiency)
           + gemm_time_s(n, k, m, itemsize, device, dtype, efficiency))
    return fwd, bwd


def _tensor_bytes(metas) -> float:
    return float(sum(m.nbytes for m in metas))


def memory_op_bytes(node: "NodeInfo", local_param_bytes: float = 0.0) -> tuple[float, float]:
    """(forward, backward) HBM bytes of a memory-bound op at the capture batch, unsharded, without the
    weight-gradient accumulation (module docstring); `local_param_bytes`: the parameter bytes one rank
    holds (an embedding's zero-filled gradient)."""
    kind, out = node.op_kind, node.output
    if kind == "norm":
        moved = node.input_metas[0].nbytes + out.nbytes
        return moved, 1.5 * moved
    if kind == "elementwise":
        moved = _tensor_bytes(node.input_metas) + out.nbytes
        if node.target in PASS_THROUGH or node.target in COPY_LIKE:
            return moved, moved
        if node.target in BINARY_PRODUCT:
            return moved, moved * 5 / 3
        return moved, 1.5 * moved
    if kind == "cross_entropy":
        logits = node.input_metas[0]
        i = logits.nbytes / logits.numel
        return logits.numel * (i + 2 * FP32_BYTES + FP32_BYTES), logits.numel * (5 * FP32_BYTES + i)
    if kind == "embedding":
        ids = node.input_metas[0].nbytes
        return ids + 2 * out.nbytes, ids + 2 * out.nbytes + local_param_bytes
    return float(node.fwd_bytes), float(node.bwd_bytes)


def grad_accumulation_bytes(local_param_bytes: float) -> float:
    """Backward bytes of adding one microbatch's weight gradients into .grad (read both, write one)."""
    return 3.0 * local_param_bytes
