"""What eager PyTorch on a CPU costs beyond a kernel's roofline, as a hardware profile measured it.

Two curves, each read from a profile's samples (`calibrate` puts them in `compute.Efficiency`):

- `FreshCopyCurve`: the bandwidth of a copy into a freshly allocated output, by buffer size
  (`profiler.memory.measure_fresh_copies`). Eager ops allocate their outputs, and on a CPU an allocation
  above glibc's mmap threshold (at most 32 MiB) is faulted in page by page on every call: 4.5-4.9 GB/s
  against 50-54 GB/s below it on the development machine. A memory-bound op's bytes are priced at the
  curve read at the buffer one of its kernels copies, where it is slower than the flat copy
  (`compute.memory_time_s`):

      buffer = bytes / (2 * kernels)     (a copy of b bytes moves 2 b)

  interpolated piecewise linearly in (log size, log bandwidth) between the samples, clamped to the
  smallest and largest.

- `AttentionRates`: causal SDPA's achieved FLOP rates, forward and backward apart, by the forward's full
  FLOP count 4 * batch_heads * seq * keys * head_dim (`profiler.attention`): interpolated piecewise
  linearly in (log FLOPs, log rate) between the samples of the dtype, clamped likewise.

No torch here (`cost_model` never imports it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from autoplan.profiler.profile import HardwareProfile


def log_interpolate(points: tuple[tuple[float, float], ...], x: float) -> float:
    """y at x on the piecewise-linear curve through `points` (x ascending) in (log x, log y), clamped."""
    if x <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x <= x1:
            t = math.log(x / x0) / math.log(x1 / x0)
            return math.exp(math.log(y0) + t * (math.log(y1) - math.log(y0)))
    return points[-1][1]


def merged_points(points: list[tuple[float, float]]) -> tuple[tuple[float, float], ...]:
    """`points` sorted by x, those of equal x merged into their geometric mean."""
    by_x: dict[float, list[float]] = {}
    for x, y in points:
        by_x.setdefault(x, []).append(y)
    return tuple((x, math.exp(sum(map(math.log, ys)) / len(ys))) for x, ys in sorted(by_x.items()))


@dataclass(frozen=True)
class FreshCopyCurve:
    """(buffer bytes, bytes per second) of fresh-allocation copies, ascending (module docstring)."""

    points: tuple[tuple[float, float], ...]

    @classmethod
    def from_profile(cls, profile: "HardwareProfile") -> "FreshCopyCurve | None":
        samples = [(float(m.buffer_bytes), m.bandwidth_bytes_per_s) for m in profile.fresh_copies]
        return cls(merged_points(samples)) if samples else None

    def bandwidth(self, buffer_bytes: float) -> float:
        """Bytes per second of a fresh-allocation copy of `buffer_bytes`."""
        return log_interpolate(self.points, max(buffer_bytes, 1.0))


@dataclass(frozen=True)
class AttentionRates:
    """Per dtype, (forward FLOPs, forward FLOP/s, backward FLOP/s) of causal SDPA, ascending (module
    docstring); FLOPs counted in full, the backward's twice the forward's."""

    by_dtype: tuple[tuple[str, tuple[tuple[float, float, float], ...]], ...]

    @classmethod
    def from_profile(cls, profile: "HardwareProfile") -> "AttentionRates | None":
        rows: dict[str, list] = {}
        for a in profile.attention:
            rows.setdefault(a.dtype, []).append((a.flops, a.flops / a.fwd_s, 2 * a.flops / a.bwd_s))
        return cls(tuple((d, tuple(sorted(r))) for d, r in sorted(rows.items()))) if rows else None

    def rates(self, forward_flops: float, dtype: str) -> tuple[float, float] | None:
        """(forward, backward) FLOP/s of an attention core of `forward_flops`, or None: `dtype` unmeasured."""
        rows = dict(self.by_dtype).get(dtype)
        if rows is None:
            return None
        x = max(forward_flops, 1.0)
        fwd = log_interpolate(merged_points([(f, r) for f, r, _ in rows]), x)
        return fwd, log_interpolate(merged_points([(f, r) for f, _, r in rows]), x)
