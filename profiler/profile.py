"""The hardware profile: what `autoplan profile` measured on one device, as a versioned JSON file.

A profile holds three kinds of measurement, each kept as raw samples so a reader can re-derive
anything the cost model uses from them:

- GEMMs: (m, n, k, dtype, time_s of the fastest window); achieved FLOP/s = 2 * m * n * k / time_s.
- memory: one device-to-device copy of `buffer_bytes`; bandwidth = 2 * buffer_bytes / time_s
  (every byte is read once and written once).
- collectives: (kind, group_size, message_bytes, time_s), and per (kind, group_size) the alpha-beta
  fit t = latency_s + message_bytes * ring_factor / bandwidth_bytes_per_s (see collectives.py).
- kernels (`profiler.kernels`): (kernel, fwd | bwd, shape, dtype, bytes, time_s) of the runtime's fused
  Triton kernels on CUDA, bytes the least HBM traffic of the pass; on a CPU of their torch fallbacks
  (and the residual add), bytes as the cost model counts the nodes they run; achieved bandwidth =
  bytes / time_s. `cost_model.kernels` turns them into per-kernel efficiencies. Files written before
  this field load with none.
- the launch floor (`profiler.launch`): seconds per back-to-back launch of a kernel that does nothing
  measurable, the least any kernel takes as the runtime issues them. Older files load with none.
- host dispatch (`profiler.dispatch`): on CUDA the host's seconds per priced kernel of a few-token
  layer's forward + backward as the runtime runs it; on a CPU eager PyTorch's seconds per kernel beyond
  the launch floor (module call, autograd), which add to the kernels' own. Older files load with none.
- fresh-allocation copies (`profiler.memory.measure_fresh_copies`, CPU): `src.clone()` over a size sweep,
  the bandwidth eager ops get where each output is a new allocation. Older files load with none.
- causal attention (`profiler.attention`, CPU): SDPA's forward and backward seconds over a few shapes.
  Older files load with none.
- FSDP2's fixed cost per unit and microbatch beyond its calls' fitted latencies (`profiler.fsdp`),
  measured over the world under torchrun. Older files, and profiles of one process, have none.
- a blocking collective inside a step (`profiler.collectives.collective_sync_s`, CPU under torchrun): the
  seconds one costs between compute beyond its fitted time. Older files, GPU profiles and profiles of one
  process have none (the cost model then prices none).

`HardwareProfile.load` refuses, naming the problem, a file that is not JSON, lacks or adds keys,
has another version, holds a non-positive or non-finite number, or was measured on another device
than the caller expects. JSON floats are written with `repr`, so the round trip is exact. No pickle.
"""

from __future__ import annotations

import json
import math
import platform
from dataclasses import dataclass, fields
from pathlib import Path

from autoplan.errors import ConfigError
from autoplan.validate import path_kind, write_text_atomic

PROFILE_VERSION = 1
DEVICE_KINDS = ("cpu", "cuda")
COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
# the fused kernels of runtime.kernels, as benchmarks/kernels.py and profiler.kernels name them; "add": the
# residual add, timed as eager torch on a CPU only
KERNEL_NAMES = ("rms_norm", "layer_norm", "silu_mul", "bias_gelu", "rope", "cross_entropy", "moe_permute", "add")


class ProfileError(ConfigError):
    """A hardware-profile file that is corrupt, of another version, or of another device."""


def _positive(what: str, value, allow_zero: bool = False) -> float:
    """`value` as a finite number > 0 (>= 0 with allow_zero), else a ProfileError naming `what`."""
    ok_type = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok_type or not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ProfileError(f"{what} must be a finite number {bound}, got {value!r}")
    return value


def _seconds_pair(what: str, value, meaning: str) -> None:
    """`value` as two finite seconds >= 0 (`meaning` says which), else a ProfileError naming `what`."""
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise ProfileError(f"{what} must be {meaning}, got {value!r}; re-run `autoplan profile`")
    for seconds in value:
        _positive(what, seconds, allow_zero=True)


def _count(what: str, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ProfileError(f"{what} must be a positive integer, got {value!r}")
    return value


def _fields_from_json(cls, what: str, data) -> dict:
    """The keys of `data`, checked to be exactly the dataclass fields of `cls` (nothing missing or extra)."""
    if not isinstance(data, dict):
        raise ProfileError(f"{what} must be a JSON object, got {type(data).__name__}")
    expected = {f.name for f in fields(cls)}
    missing, unknown = expected - set(data), set(data) - expected
    if missing or unknown:
        raise ProfileError(f"{what} has missing keys {sorted(missing)} and unknown keys {sorted(unknown)}; expected {sorted(expected)}")
    return dict(data)


@dataclass(frozen=True)
class GemmSample:
    """Median time of C = A @ B with A (m, k), B (k, n), in `dtype`."""

    m: int
    n: int
    k: int
    dtype: str
    time_s: float

    def __post_init__(self) -> None:
        for name in ("m", "n", "k"):
            _count(f"gemm {name}", getattr(self, name))
        if not isinstance(self.dtype, str) or not self.dtype:
            raise ProfileError(f"gemm dtype must be a dtype name such as 'bfloat16', got {self.dtype!r}")
        _positive(f"gemm ({self.m}, {self.n}, {self.k}) time_s", self.time_s)

    @property
    def flops(self) -> float:
        """2 * m * n * k: one multiply and one add per inner-product term."""
        return 2.0 * self.m * self.n * self.k

    @property
    def flops_per_s(self) -> float:
        return self.flops / self.time_s

    @classmethod
    def from_json(cls, data) -> "GemmSample":
        return cls(**_fields_from_json(cls, "gemm sample", data))


@dataclass(frozen=True)
class MemorySample:
    """Median time of one device-to-device copy of `buffer_bytes` bytes."""

    buffer_bytes: int
    time_s: float

    def __post_init__(self) -> None:
        _count("memory buffer_bytes", self.buffer_bytes)
        _positive("memory time_s", self.time_s)

    @property
    def bandwidth_bytes_per_s(self) -> float:
        """2 * buffer_bytes / time_s: the copy reads and writes every byte."""
        return 2.0 * self.buffer_bytes / self.time_s

    @classmethod
    def from_json(cls, data) -> "MemorySample":
        return cls(**_fields_from_json(cls, "memory sample", data))


@dataclass(frozen=True)
class CollectiveSample:
    """Median time (slowest rank) of one collective; message_bytes is each rank's full buffer
    (all_reduce: the tensor; all_gather: the gathered output; reduce_scatter: the input;
    all_to_all: the input), as nccl-tests counts it."""

    kind: str
    group_size: int
    message_bytes: int
    time_s: float

    def __post_init__(self) -> None:
        _check_kind(self.kind)
        _count("collective group_size", self.group_size)
        _count("collective message_bytes", self.message_bytes)
        _positive(f"{self.kind} time_s", self.time_s)

    @classmethod
    def from_json(cls, data) -> "CollectiveSample":
        return cls(**_fields_from_json(cls, "collective sample", data))


@dataclass(frozen=True)
class CollectiveFit:
    """t = latency_s + message_bytes * ring_factor(kind, group_size) / bandwidth_bytes_per_s,
    fitted over `num_samples` sizes; max_rel_error = max |fit - measured| / measured."""

    kind: str
    group_size: int
    latency_s: float
    bandwidth_bytes_per_s: float
    num_samples: int
    max_rel_error: float

    def __post_init__(self) -> None:
        _check_kind(self.kind)
        _count("fit group_size", self.group_size)
        _positive(f"{self.kind} fit latency_s", self.latency_s, allow_zero=True)
        _positive(f"{self.kind} fit bandwidth_bytes_per_s", self.bandwidth_bytes_per_s)
        _count("fit num_samples", self.num_samples)
        _positive(f"{self.kind} fit max_rel_error", self.max_rel_error, allow_zero=True)

    @classmethod
    def from_json(cls, data) -> "CollectiveFit":
        return cls(**_fields_from_json(cls, "collective fit", data))


@dataclass(frozen=True)
class KernelSample:
    """Time of one pass ("fwd" or "bwd") of a fused Triton kernel of runtime.kernels (on a CPU: its torch
    fallback) on one shape ("tokens=8192 hidden=4096"), moving `bytes` bytes (module docstring)."""

    kernel: str
    direction: str
    shape: str
    dtype: str
    bytes: int
    time_s: float

    def __post_init__(self) -> None:
        if self.kernel not in KERNEL_NAMES:
            raise ProfileError(f"kernel {self.kernel!r} is not one of {KERNEL_NAMES}")
        if self.direction not in ("fwd", "bwd"):
            raise ProfileError(f"kernel {self.kernel} direction must be 'fwd' or 'bwd', got {self.direction!r}")
        for name in ("shape", "dtype"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ProfileError(f"kernel {self.kernel} {name} must be a non-empty string, got {getattr(self, name)!r}")
        _count(f"kernel {self.kernel} bytes", self.bytes)
        _positive(f"kernel {self.kernel} {self.direction} time_s", self.time_s)

    @property
    def bandwidth_bytes_per_s(self) -> float:
        return self.bytes / self.time_s

    @classmethod
    def from_json(cls, data) -> "KernelSample":
        return cls(**_fields_from_json(cls, "kernel sample", data))


@dataclass(frozen=True)
class AttentionSample:
    """Fastest-window seconds of causal SDPA over q, k, v of (batch_heads, seq, head_dim) in `dtype`:
    forward alone, and backward (forward + backward less forward)."""

    batch_heads: int
    seq: int
    head_dim: int
    dtype: str
    fwd_s: float
    bwd_s: float

    def __post_init__(self) -> None:
        for name in ("batch_heads", "seq", "head_dim"):
            _count(f"attention {name}", getattr(self, name))
        if not isinstance(self.dtype, str) or not self.dtype:
            raise ProfileError(f"attention dtype must be a dtype name such as 'float32', got {self.dtype!r}")
        for name in ("fwd_s", "bwd_s"):
            _positive(f"attention ({self.batch_heads}, {self.seq}, {self.head_dim}) {name}", getattr(self, name))

    @property
    def flops(self) -> float:
        """Forward FLOPs counted in full, causal mask or not: 4 * batch_heads * seq^2 * head_dim."""
        return 4.0 * self.batch_heads * self.seq * self.seq * self.head_dim

    @classmethod
    def from_json(cls, data) -> "AttentionSample":
        return cls(**_fields_from_json(cls, "attention sample", data))


def _check_kind(kind: str) -> None:
    if kind not in COLLECTIVE_KINDS:
        raise ProfileError(f"collective kind {kind!r} is not one of {COLLECTIVE_KINDS}")


@dataclass(frozen=True)
class HardwareProfile:
    """Everything measured on one device (and, for collectives, its process group)."""

    device_name: str  # as torch reports it: torch.cuda.get_device_name(), or the CPU model
    device_kind: str  # "cpu" | "cuda"
    memory_bytes: int  # device memory (CUDA) or physical RAM (CPU)
    threads: int  # torch.get_num_threads() during the run (what CPU GEMM rates depend on)
    torch_version: str
    created: str  # ISO 8601, UTC
    gemm: tuple[GemmSample, ...]
    memory: MemorySample
    collective_backend: str  # "gloo", "nccl", or "" when no collectives were measured
    collectives: tuple[CollectiveSample, ...] = ()
    fits: tuple[CollectiveFit, ...] = ()
    kernels: tuple[KernelSample, ...] = ()
    kernel_floor_s: float | None = None  # `profiler.launch`; None: not measured
    host_kernel_s: float | None = None  # `profiler.dispatch`; None: not measured
    host_phase_kernel_s: list[float] | None = None  # [forward, backward] (`profiler.dispatch`, CUDA); None: not measured
    adamw_bytes_per_s: float | None = None  # `profiler.memory.measure_adamw_rate` (CUDA); None: not measured
    # [a, b]: the optimizer's exposed host seconds per step, a + b per tensor (`profiler.memory.measure_optimizer_host_s`)
    optimizer_host_s: list[float] | None = None
    fsdp_unit_s: float | None = None  # `profiler.fsdp`; None: not measured
    collective_sync_s: float | None = None  # `profiler.collectives.collective_sync_s` (CPU); None: not measured
    collective_skew: float | None = None  # s^0.5, the same fit's skew term (CPU); None: not measured
    overlap_cost: float | None = None  # `profiler.collectives.overlap_cost` (CPU); None: not measured
    # {kind: [forward, re-run]} (`profiler.dispatch.measure_recompute_host_s`); None: not measured
    host_recompute_s: dict[str, list[float]] | None = None
    fresh_copies: tuple[MemorySample, ...] = ()  # `profiler.memory.measure_fresh_copies` (CPU)
    attention: tuple[AttentionSample, ...] = ()  # `profiler.attention` (CPU)
    version: int = PROFILE_VERSION

    def __post_init__(self) -> None:
        if self.version != PROFILE_VERSION:
            raise ProfileError(f"profile version {self.version!r} is not supported; this autoplan reads version {PROFILE_VERSION}. Re-run `autoplan profile`.")
        if self.device_kind not in DEVICE_KINDS:
            raise ProfileError(f"device_kind {self.device_kind!r} must be one of {DEVICE_KINDS}")
        if not self.device_name.strip():
            raise ProfileError("device_name is empty; it must name the device the profile was measured on")
        _count("memory_bytes", self.memory_bytes)
        _count("threads", self.threads)
        if not self.gemm:
            raise ProfileError("a profile needs at least one GEMM sample")
        for name in ("kernel_floor_s", "host_kernel_s"):
            if getattr(self, name) is not None:
                _positive(name, getattr(self, name))
        for name in ("fsdp_unit_s", "collective_sync_s", "collective_skew"):
            if getattr(self, name) is not None:
                _positive(name, getattr(self, name), allow_zero=True)
        if self.adamw_bytes_per_s is not None:
            _positive("adamw_bytes_per_s", self.adamw_bytes_per_s)
        if self.overlap_cost is not None and _positive("overlap_cost", self.overlap_cost, allow_zero=True) > 1:
            raise ProfileError(f"overlap_cost must be a fraction in [0, 1], got {self.overlap_cost!r}; re-run `autoplan profile`")
        if self.host_phase_kernel_s is not None:
            _seconds_pair("host_phase_kernel_s", self.host_phase_kernel_s, "[forward, backward] seconds per priced kernel")
        if self.optimizer_host_s is not None:
            _seconds_pair("optimizer_host_s", self.optimizer_host_s, "[seconds per step, seconds per tensor]")
        if self.host_recompute_s is not None:
            if not isinstance(self.host_recompute_s, dict):
                raise ProfileError(f"host_recompute_s must be a JSON object of recompute kind -> [forward, re-run] "
                                   f"seconds, got {self.host_recompute_s!r}")
            for kind, pair in self.host_recompute_s.items():
                if not isinstance(pair, (list, tuple)) or len(pair) != 2:
                    raise ProfileError(f"host_recompute_s[{kind!r}] must be [forward, re-run] seconds per forward "
                                       f"kernel, got {pair!r}; re-run `autoplan profile`")
                for seconds in pair:
                    _positive(f"host_recompute_s[{kind!r}]", seconds, allow_zero=True)

    def to_json(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["gemm"] = [dict(vars(s)) for s in self.gemm]
        out["memory"] = dict(vars(self.memory))
        out["collectives"] = [dict(vars(s)) for s in self.collectives]
        out["fits"] = [dict(vars(f)) for f in self.fits]
        out["kernels"] = [dict(vars(k)) for k in self.kernels]
        out["fresh_copies"] = [dict(vars(m)) for m in self.fresh_copies]
        out["attention"] = [dict(vars(a)) for a in self.attention]
        return {"version": out.pop("version"), **out}

    @classmethod
    def from_json(cls, data) -> "HardwareProfile":
        version = data.get("version") if isinstance(data, dict) else None
        if isinstance(data, dict) and version != PROFILE_VERSION:  # first: other versions have other keys
            raise ProfileError(f"profile version {version!r} is not supported; this autoplan reads version {PROFILE_VERSION}. Re-run `autoplan profile`.")
        older = {"kernels": [], "kernel_floor_s": None, "host_kernel_s": None, "fsdp_unit_s": None,
                 "collective_sync_s": None, "collective_skew": None, "overlap_cost": None, "host_recompute_s": None, "host_phase_kernel_s": None, "adamw_bytes_per_s": None, "optimizer_host_s": None, "fresh_copies": [], "attention": []}  # fields that older files lack
        data = _fields_from_json(cls, "profile", {**older, **data} if isinstance(data, dict) else data)
        for key in ("gemm", "collectives", "fits", "kernels", "fresh_copies", "attention"):
            if not isinstance(data[key], list):
                raise ProfileError(f"profile {key} must be a JSON list, got {type(data[key]).__name__}")
        data["gemm"] = tuple(GemmSample.from_json(s) for s in data["gemm"])
        data["memory"] = MemorySample.from_json(data["memory"])
        data["collectives"] = tuple(CollectiveSample.from_json(s) for s in data["collectives"])
        data["fits"] = tuple(CollectiveFit.from_json(f) for f in data["fits"])
        data["kernels"] = tuple(KernelSample.from_json(k) for k in data["kernels"])
        data["fresh_copies"] = tuple(MemorySample.from_json(m) for m in data["fresh_copies"])
        data["attention"] = tuple(AttentionSample.from_json(a) for a in data["attention"])
        for key in ("device_name", "device_kind", "torch_version", "created", "collective_backend"):
            if not isinstance(data[key], str):
                raise ProfileError(f"profile {key} must be a string, got {data[key]!r}")
        return cls(**data)

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=1, allow_nan=False)

    def save(self, path: str | Path) -> None:
        """Write atomically (temp file in the same folder, then os.replace): never a truncated file."""
        write_text_atomic(Path(path), self.dumps() + "\n")

    @classmethod
    def load(cls, path: str | Path, expect_device: str | None = None) -> "HardwareProfile":
        """Read and validate `path`, or the profile shipped with autoplan of that name (`shipped_profiles`:
        "h200") where no such file exists; with `expect_device`, refuse a profile of another device."""
        path = shipped_profiles().get(str(path), Path(path)) if path_kind(Path(path)) == "missing" else Path(path)
        kind = path_kind(path)
        if kind != "file":
            state = "does not exist" if kind == "missing" else f"is not a file ({kind})"
            names = ", ".join(sorted(shipped_profiles())) or "none"
            raise ProfileError(f"profile file {str(path)!r} {state}; make one with `autoplan profile -o FILE`, or name a "
                               f"profile shipped with autoplan ({names})")
        try:
            data = json.loads(path.read_text())  # NaN / Infinity parse, then fail validation by name
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ProfileError(f"profile file {str(path)!r} is not valid JSON: {exc}") from exc
        try:
            profile = cls.from_json(data)
        except (ProfileError, TypeError) as exc:
            raise ProfileError(f"profile file {str(path)!r} is invalid: {exc}") from exc
        if expect_device is not None and not same_device(profile.device_name, expect_device):
            raise ProfileError(
                f"profile file {str(path)!r} was measured on {profile.device_name!r}, but this run expects {expect_device!r}; "
                f"re-run `autoplan profile` on {expect_device!r} or pass that device's profile"
            )
        return profile


def shipped_profiles() -> dict[str, Path]:
    """The profiles measured by the project and shipped in the package (autoplan/profiles/NAME.json), by
    NAME: `--profile h200` loads the H200's (benchmarks/README.md says how and when it was measured)."""
    from importlib.resources import files

    folder = files("autoplan") / "profiles"
    if not folder.is_dir():
        return {}
    return {entry.name[:-len(".json")]: Path(str(entry)) for entry in folder.iterdir() if entry.name.endswith(".json")}


def same_device(a: str, b: str) -> bool:
    """Device names match ignoring case and runs of whitespace ('NVIDIA H200' == 'nvidia  h200')."""
    return " ".join(a.split()).casefold() == " ".join(b.split()).casefold()


def local_device_name(kind: str, index: int = 0) -> str:
    """The device's name as torch reports it (CUDA), or the CPU model from /proc/cpuinfo or platform."""
    if kind == "cuda":
        import torch

        return torch.cuda.get_device_name(index)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name") and ":" in line:
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"
