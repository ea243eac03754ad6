"""Calibration: what a hardware profile (or, lacking one, a stated default) tells the cost model.

GEMM time is modelled as

    time_s = 2 * m * n * k / (efficiency(m, n, k, dtype) * peak_flops(dtype)),

with `peak_flops` the DeviceSpec's datasheet peak for the dtype (for a device without one, such as
the CPU, the best rate the profile measured) and efficiency in (0, 1].

**From a profile** (`GemmEfficiency.from_profile`): each sample gives efficiency = achieved FLOP/s /
peak (capped at 1). The samples of a dtype span a grid over the distinct measured log2 m, log2 n,
log2 k; grid points the sweep did not measure are filled by inverse-distance-squared weighting of the
measured samples (distance in log2 space). A query is clamped to the grid's box per axis (no
extrapolation: a GEMM larger than any measured one gets the efficiency of the largest, a smaller one
that of the smallest) and interpolated trilinearly in (log2 m, log2 n, log2 k). Along each axis this
is piecewise linear between neighbouring samples, so efficiencies that rise with size still do.
A dtype the profile did not measure falls back to the default curve below.

**Default** (`GemmEfficiency.from_device_default`): a saturating curve in the ideal time
t_ideal = 2mnk / peak,

    efficiency = ceiling(device) * (1 - exp(-t_ideal / TAU0_S)).

ceiling: the SUSTAINED efficiency of large GEMMs, what a training run sees with every GPU of the node
busy and clocks settled at the power limit, not a short burst (`SUSTAINED_CEILINGS`):
  h100, h200  0.711 = 703 / 989 TFLOP/s: bf16 "maximum sustainable matmul FLOPS" (MSMF) of the H200
              (H100 SXM is the same chip and TDP), ml-engineering `mamf-finder.py` tables (Bekman; 698.6
              to 702.9 TFLOP/s over 5 runs, alone and with all 8 GPUs busy). Its burst peak (MAMF) is
              828; our own sweep reached ~789 (ENVIRONMENT.md), also a burst.
  a100        0.738 = 271.2 / 312 (A100 SXM bf16 MAMF, same tables, torch 2.6 + cu126) x 0.849, the
              H200's measured sustained / burst ratio (703 / 828): no MSMF of an A100 is published, and
              a 400 W A100 drops its clock under sustained tensor-core load as the 700 W H200 does
              (NVIDIA rates A100 HPL at the 1305 MHz it sustains at its power limit, not the 1410 MHz
              boost: 0.93; the H200 ratio is the more conservative of the two).
  others      the H100 / H200 value.
TAU0_S = 18.4 us: the H200 sweep (ENVIRONMENT.md, torch 2.11) reached about 325 TFLOP/s at its smallest
shape (2048 x 1536 x 1536, 9.66 GFLOP, t_ideal 9.77 us) and ~789 at its largest: 1 - exp(-9.77 / tau0)
= 325 / 789. Measuring time rather than FLOPs lets one constant serve devices of any peak. Shapes of
~20 GFLOP and more on an A100 (t_ideal >= 64 us) are within 3% of the ceiling; as t_ideal -> 0 the
modelled time tends to TAU0_S / ceiling, a pessimistic floor for tiny GEMMs: profile to do better.

**Collectives from a profile** (`CollectiveCalibration`): the profile's alpha-beta fits per (kind,
group size) replace the datasheet links for groups inside one node (`effective_link`); a profile
measured on one machine says nothing about the network between nodes, so those keep the ClusterSpec.
"""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass, replace

import numpy as np

from autoplan.cluster import DeviceSpec
from autoplan.errors import ConfigError
from autoplan.profiler.profile import HardwareProfile, ProfileError, same_device

E_MAX = 0.711  # sustained large-GEMM efficiency of the H100 / H200 (module docstring)
TAU0_S = 18.4e-6
SUSTAINED_CEILINGS: dict[str, tuple[float, str]] = {  # GPU family -> (ceiling, source); module docstring
    "h100": (E_MAX, "H200 bf16 MSMF 703 of 989 TFLOP/s (ml-engineering mamf-finder tables)"),
    "h200": (E_MAX, "H200 bf16 MSMF 703 of 989 TFLOP/s (ml-engineering mamf-finder tables)"),
    "a100": (271.2 / 312 * 703 / 828, "A100 SXM bf16 MAMF 271.2 of 312 TFLOP/s x the H200's sustained / burst "
                                      "ratio 703 / 828 (ml-engineering mamf-finder tables)"),
}
DEFAULT_SOURCE = "default curve: sustained ceiling x (1 - exp(-t_ideal / 18.4 us)) (calibration module docstring)"


def default_ceiling(device: DeviceSpec | None) -> float:
    """The sustained large-GEMM efficiency the default curve saturates at, for `device`'s family."""
    family = re.match(r"[a-z]+\d+", device.name.lower()) if device is not None else None
    return SUSTAINED_CEILINGS.get(family.group() if family else "", (E_MAX, ""))[0]


@dataclass(frozen=True, eq=False)
class _Grid:
    """Efficiencies on a full grid over log2 m x log2 n x log2 k (axes ascending)."""

    axes: tuple[np.ndarray, np.ndarray, np.ndarray]
    values: np.ndarray  # (len m, len n, len k)

    def at(self, point: tuple[float, float, float]) -> float:
        """Trilinear interpolation at `point` (log2 m, log2 n, log2 k), clamped to the box."""
        corners = []  # per axis: ((index, weight), (index, weight))
        for axis, q in zip(self.axes, point):
            q = min(max(q, axis[0]), axis[-1])
            if len(axis) == 1:
                corners.append(((0, 1.0),))
                continue
            i = min(int(np.searchsorted(axis, q, side="right")) - 1, len(axis) - 2)
            w = (q - axis[i]) / (axis[i + 1] - axis[i])
            corners.append(((i, 1.0 - w), (i + 1, w)))
        total = 0.0
        for (i, wi), (j, wj), (k, wk) in itertools.product(*corners):
            total += wi * wj * wk * self.values[i, j, k]
        return float(total)


def _build_grid(points: dict[tuple[float, float, float], float]) -> _Grid:
    """A full grid over the distinct coordinates of `points` ((log2 m, log2 n, log2 k) -> efficiency);
    unmeasured grid points get the inverse-distance-squared mean of the measured ones."""
    axes = tuple(np.array(sorted({p[d] for p in points})) for d in range(3))
    coords = np.array(list(points))  # (samples, 3)
    effs = np.array(list(points.values()))  # (samples,)
    values = np.empty(tuple(len(a) for a in axes))
    for index in itertools.product(*(range(len(a)) for a in axes)):
        here = np.array([axes[d][index[d]] for d in range(3)])
        key = tuple(float(c) for c in here)
        if key in points:
            values[index] = points[key]
            continue
        weights = 1.0 / np.sum((coords - here) ** 2, axis=1)
        values[index] = float(np.sum(weights * effs) / np.sum(weights))
    return _Grid(axes, values)


class GemmEfficiency:
    """efficiency(m, n, k, dtype) in (0, 1] and the peak it multiplies; see the module docstring."""

    def __init__(self, device: DeviceSpec | None, grids: dict[str, _Grid], peaks: dict[str, float], source: str) -> None:
        self.device = device
        self._grids = grids
        self._peaks = peaks  # peaks of the measured dtypes, as used to form their efficiencies
        self.source = source
        self._ceiling = default_ceiling(device)
        self._memo: dict[tuple[float, float, float, str], float] = {}  # this object's own answers

    @classmethod
    def from_profile(cls, profile: HardwareProfile, device: DeviceSpec | None = None) -> "GemmEfficiency":
        """Efficiencies from the profile's GEMM samples, against `device`'s datasheet peak per dtype
        where it lists one and the best measured rate of that dtype otherwise. Pass the DeviceSpec the
        cost model multiplies by (e.g. `device_spec_from_profile(profile, base)`)."""
        if device is not None:
            check_profile_device(profile, device)
        peaks, grids = {}, {}
        for dtype in sorted({s.dtype for s in profile.gemm}):
            samples = [s for s in profile.gemm if s.dtype == dtype]
            listed = dict(device.peak_flops) if device is not None else {}
            peaks[dtype] = listed.get(dtype) or max(s.flops_per_s for s in samples)
            sums: dict[tuple[float, float, float], list[float]] = {}
            for s in samples:  # repeated shapes are averaged
                key = (math.log2(s.m), math.log2(s.n), math.log2(s.k))
                sums.setdefault(key, []).append(min(1.0, s.flops_per_s / peaks[dtype]))
            grids[dtype] = _build_grid({key: sum(v) / len(v) for key, v in sums.items()})
        source = f"profile of {profile.device_name!r} ({profile.created}, torch {profile.torch_version})"
        return cls(device, grids, peaks, source)

    @classmethod
    def from_device_default(cls, device: DeviceSpec) -> "GemmEfficiency":
        """The default curve for `device`, with no profile."""
        return cls(device, {}, {}, DEFAULT_SOURCE)

    @property
    def measured_dtypes(self) -> tuple[str, ...]:
        return tuple(sorted(self._grids))

    def peak_flops(self, dtype: str) -> float:
        """The FLOP/s that efficiency() is a fraction of."""
        if dtype in self._peaks:
            return self._peaks[dtype]
        if self.device is None:
            raise ConfigError(f"dtype {dtype!r} was not profiled (profiled: {list(self.measured_dtypes)}) and no DeviceSpec gives its peak")
        return self.device.peak_flops_for(dtype)

    def efficiency(self, m: float, n: float, k: float, dtype: str) -> float:
        """achieved / peak FLOP/s for C (m, n) = A (m, k) @ B (k, n), in (0, 1]."""
        key = (m, n, k, dtype)
        if key in self._memo:
            return self._memo[key]
        if min(m, n, k) < 1:
            raise ConfigError(f"GEMM shape ({m}, {n}, {k}) must have positive m, n, k")
        grid = self._grids.get(dtype)
        if grid is not None:
            value = grid.at((math.log2(m), math.log2(n), math.log2(k)))
        else:
            ideal_s = 2.0 * m * n * k / self.peak_flops(dtype)
            value = self._ceiling * -math.expm1(-ideal_s / TAU0_S)
        self._memo[key] = min(1.0, max(value, 1e-12))
        return self._memo[key]

    def max_efficiency(self, dtype: str) -> float:
        """An upper bound of efficiency() over every shape (what sound time bounds divide by)."""
        grid = self._grids.get(dtype)
        return min(1.0, float(grid.values.max())) if grid is not None else self._ceiling

    def gemm_time_s(self, m: int, n: int, k: int, dtype: str) -> float:
        """2mnk / (efficiency * peak)."""
        return 2.0 * m * n * k / (self.efficiency(m, n, k, dtype) * self.peak_flops(dtype))


def effective_link(profile: HardwareProfile, kind: str, group_size: int) -> tuple[float, float] | None:
    """(bandwidth_bytes_per_s, latency_s) of the fit for (kind, group_size), for
    t = latency_s + message_bytes * ring_factor / bandwidth_bytes_per_s (profiler/collectives.py).

    Without a fit of that exact size, the fit of the same kind whose group size is nearest in log2
    (ties: the larger group) is used; None when the profile has no fit of that kind."""
    fits = [f for f in profile.fits if f.kind == kind]
    if not fits or group_size < 1:
        return None
    best = min(fits, key=lambda f: (abs(math.log2(f.group_size) - math.log2(group_size)), -f.group_size))
    return best.bandwidth_bytes_per_s, best.latency_s


class CollectiveCalibration:
    """Measured collective costs for groups inside one node, from the profile (`time_s`): its samples
    where it measured the kind on a group of that size and the message lies in or above their range
    (`sampled_time_s`), else its fit (`effective_link`); None where it has neither (the caller then
    prices the datasheet link)."""

    def __init__(self, profile: HardwareProfile) -> None:
        self.source = f"collective fits of {profile.device_name!r} ({profile.created}, {profile.collective_backend})"
        self._profile = profile
        self._memo: dict[tuple[str, int], tuple[float, float] | None] = {}
        self._samples: dict[tuple[str, int], tuple[tuple[float, float], ...]] = {}

    def link(self, kind: str, group_size: int) -> tuple[float, float] | None:
        """(bus bandwidth bytes/s, latency s) for t = latency + message bytes * ring factor / bandwidth."""
        key = (kind, group_size)
        if key not in self._memo:
            self._memo[key] = effective_link(self._profile, kind, group_size)
        return self._memo[key]

    def samples(self, kind: str, group_size: int) -> tuple[tuple[float, float], ...]:
        """(message bytes, seconds) of the profile's samples of `kind` on `group_size` ranks, by size,
        each time at least that of every smaller message (a larger message is never cheaper)."""
        key = (kind, group_size)
        if key not in self._samples:
            points = sorted((s.message_bytes, s.time_s) for s in self._profile.collectives
                            if s.kind == kind and s.group_size == group_size)
            slowest, rising = 0.0, []
            for size, t in points:
                slowest = max(slowest, t)
                rising.append((float(size), slowest))
            self._samples[key] = tuple(rising)
        return self._samples[key]

    def time_s(self, kind: str, message_bytes: float, group_size: int) -> float | None:
        """Seconds of one collective of `message_bytes` (nccl-tests' message) on `group_size` ranks:
        `sampled_time_s` where it applies, else the fit; None without either."""
        sampled = sampled_time_s(self.samples(kind, group_size), message_bytes)
        if sampled is not None:
            return sampled
        fit = self.link(kind, group_size)
        if fit is None:
            return None
        factor = 2 * (group_size - 1) / group_size if kind == "all_reduce" else (group_size - 1) / group_size
        return fit[1] + message_bytes * factor / fit[0]


def sampled_time_s(samples: tuple[tuple[float, float], ...], message_bytes: float) -> float | None:
    """A message's time read off measured (bytes, seconds) samples: linear between the two around it,
    and beyond the largest at the slope of the last two (what one more byte cost there); None below
    the smallest or with fewer than two samples (the fit prices latency-bound messages).

    Why not the fit alone: one line through every size, weighed by relative error, follows the many
    small messages and misses the large ones that data-parallel buckets are made of, where a CPU's
    gloo slows down (loopback copies beyond its caches): on the 2-core development machine (2026-11-25,
    load average about 10) 16 / 32 / 64 MiB all-reduces took 44 / 68 / 114 ms, the fit over 4 KiB ..
    64 MiB said 9 / 18 / 35 ms."""
    if len(samples) < 2 or message_bytes < samples[0][0]:
        return None
    for (x0, t0), (x1, t1) in zip(samples, samples[1:]):
        if message_bytes <= x1:
            return t0 + (t1 - t0) * (message_bytes - x0) / (x1 - x0)
    (x0, t0), (x1, t1) = samples[-2:]
    return t1 + (t1 - t0) * (message_bytes - x1) / (x1 - x0)


def check_profile_device(profile: HardwareProfile, device: DeviceSpec) -> None:
    """Refuse a profile of another kind of device (a DeviceSpec named 'cpu' is a CPU, any other a GPU,
    unless it bears the profile's own device name),
    or of another GPU family: the family of a spec name ('h100' of 'h100', 'a100' of 'a100-80g') must
    be a word of the name torch reported ('NVIDIA H100 80GB HBM3'). Names without one are not checked."""
    if same_device(device.name, profile.device_name):  # e.g. made by device_spec_from_profile(profile)
        return
    kind = "cpu" if same_device(device.name, "cpu") else "cuda"
    if kind != profile.device_kind:
        raise ProfileError(f"a {profile.device_kind} profile ({profile.device_name!r}) cannot calibrate the {kind} device {device.name!r}")
    family = re.match(r"[a-z]+\d+", device.name.lower())
    if kind == "cuda" and family and family.group() not in re.split(r"[^a-z0-9]+", profile.device_name.lower()):
        raise ProfileError(f"the profile was measured on {profile.device_name!r}, not on a {device.name!r}; profile a {device.name!r} or drop the profile")


def device_spec_from_profile(profile: HardwareProfile, base: DeviceSpec | None = None) -> DeviceSpec:
    """A DeviceSpec with the measured memory bandwidth; peaks stay the datasheet's (base) where one
    exists, and are the best measured GEMM rates for a CPU profile, for dtypes base lacks, or with no base."""
    measured = {}
    for s in profile.gemm:
        measured[s.dtype] = max(measured.get(s.dtype, 0.0), s.flops_per_s)
    datasheet = dict(base.peak_flops) if base is not None and profile.device_kind == "cuda" else {}
    peaks = {**(dict(base.peak_flops) if base is not None else {}), **measured, **datasheet}
    source = f"memory bandwidth measured on {profile.device_name!r} ({profile.created})"
    if base is None:
        return DeviceSpec(profile.device_name, tuple(peaks.items()), float(profile.memory_bytes),
                          profile.memory.bandwidth_bytes_per_s, source + "; peaks: best measured GEMM rates")
    check_profile_device(profile, base)
    how = "datasheet" if datasheet else "measured where profiled"
    return replace(base, peak_flops=tuple(peaks.items()), memory_bandwidth_bytes_per_s=profile.memory.bandwidth_bytes_per_s,
                   source=f"{source}; peaks {how} ({base.source})")
