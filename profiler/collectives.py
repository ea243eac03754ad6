"""Collective timings on an initialised process group, and their alpha-beta fits.

Every rank of the world calls `measure_collectives` (under torchrun, or after
`init_process_group`). For each group size g (the world, and where the world is > 2 also 2, 4, ...
that divide it), the world is cut into consecutive groups of g ranks that run at the same time (as
tensor-parallel groups do in training). For each kind and message size: warm-up, then timed windows
separated by a world barrier (see gemm.timed_windows_s); the sample is the fastest window's per-call
time on each rank, then the slowest rank's (a collective finishes when its last rank does). The fastest
window, not the median: the noise of a collective's windows is one-sided (a rank descheduled, a peer
late out of the barrier), and on CPU gloo it swamps small messages (4 KiB all-reduce windows of 0.3 to
4.9 ms medians on the 2-core development machine, against 0.13 to 0.31 ms fastest), which left the
quick profile without an all-reduce fit in 3 of 5 test runs of 2026-11-25.

message_bytes is each rank's full buffer, as nccl-tests counts it (all_reduce: the tensor;
all_gather: the gathered output; reduce_scatter: the input; all_to_all: the input). The fit per
(kind, g) is the ring model

    t = latency_s + message_bytes * ring_factor / bandwidth_bytes_per_s,
    ring_factor = 2 (g - 1) / g for all_reduce, (g - 1) / g for all_gather, reduce_scatter, all_to_all,

so bandwidth_bytes_per_s is nccl-tests' "bus bandwidth": the per-rank link rate the cost model
plugs into the same formula. Least squares on relative residuals, sum_i ((a + b x_i - t_i) / t_i)^2
with x_i = message_bytes_i * ring_factor, so 4 KB and 64 MB samples weigh alike; a negative
intercept is refitted as a = 0. Synthetic samples on the model are recovered exactly.

Sizes: 4 KiB .. 64 MiB by powers of 2, on CUDA and on CPU (gloo over loopback) alike: the sizes
plans use, whose data-parallel buckets are 25 MiB (`autoplan.grad_buckets`) and whose FSDP2 units
and tp activations can be larger (a CPU fit over 4 KiB .. 8 MiB priced an 84 MiB gloo all-reduce at
49 ms that took 80 ms, issue 20); {4 KiB, 256 KiB, 4 MiB} with `quick`. Tensors are float32 (gloo has no bf16 reductions on every
version); the element count is rounded down to a multiple of g.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist

from autoplan.profiler.gemm import WARMUP_CALLS, plan_windows, synchronize, timed_windows_s
from autoplan.profiler.profile import COLLECTIVE_KINDS, CollectiveFit, CollectiveSample, ProfileError

KiB, MiB = 2**10, 2**20
ELEMENT_BYTES = 4  # float32


def ring_byte_factor(kind: str, group_size: int) -> float:
    """Bytes each rank sends per byte of message in a ring: 2(g-1)/g for all_reduce, (g-1)/g otherwise."""
    if kind not in COLLECTIVE_KINDS:
        raise ProfileError(f"collective kind {kind!r} is not one of {COLLECTIVE_KINDS}")
    steps = (group_size - 1) / group_size
    return 2 * steps if kind == "all_reduce" else steps


def default_message_sizes(quick: bool = False) -> list[int]:
    """Message sizes in bytes, per the module docstring."""
    if quick:  # wide apart, so the byte term stands out of a noisy latency
        return [4 * KiB, 256 * KiB, 4 * MiB]
    sizes, size = [], 4 * KiB
    while size <= 64 * MiB:
        sizes.append(size)
        size *= 2
    return sizes


def group_sizes(world_size: int) -> list[int]:
    """The world, and where it is > 2, also 2, 4, ... (powers of 2 below it that divide it)."""
    sizes, g = [], 2
    while world_size > 2 and g < world_size:
        if world_size % g == 0:
            sizes.append(g)
        g *= 2
    return sizes + [world_size] if world_size > 1 else []


def fit_alpha_beta(samples: Sequence[CollectiveSample]) -> CollectiveFit:
    """Least-squares fit of t = a + x / bandwidth, x = message_bytes * ring_factor (module docstring)."""
    kinds = {(s.kind, s.group_size) for s in samples}
    if len(kinds) != 1:
        raise ProfileError(f"fit_alpha_beta needs samples of one (kind, group_size), got {sorted(kinds)}")
    (kind, group_size), = kinds
    x = np.array([s.message_bytes * ring_byte_factor(kind, group_size) for s in samples])
    t = np.array([s.time_s for s in samples])
    if len(set(x.tolist())) < 2:
        raise ProfileError(f"{kind} over {group_size} ranks: a fit needs at least 2 distinct message sizes")
    (a, b), *_ = np.linalg.lstsq(np.stack([1 / t, x / t], axis=1), np.ones_like(t), rcond=None)
    if a < 0:  # the intercept is a latency: refit through the origin, sum(x/t)/sum((x/t)^2)
        a, b = 0.0, float(np.sum(x / t) / np.sum((x / t) ** 2))
    if not (np.isfinite(b) and b > 0):
        raise ProfileError(f"{kind} over {group_size} ranks: times do not grow with message size, no bandwidth to fit")
    max_rel_error = float(np.max(np.abs(a + b * x - t) / t))
    return CollectiveFit(kind, group_size, float(a), float(1 / b), len(samples), max_rel_error)


def fit_all(samples: Sequence[CollectiveSample]) -> tuple[CollectiveFit, ...]:
    """One fit per (kind, group_size); pairs that cannot be fitted are skipped with a warning."""
    keys = sorted({(s.kind, s.group_size) for s in samples}, key=lambda kg: (COLLECTIVE_KINDS.index(kg[0]), kg[1]))
    fits = []
    for kind, g in keys:
        try:
            fits.append(fit_alpha_beta([s for s in samples if (s.kind, s.group_size) == (kind, g)]))
        except ProfileError as exc:
            warnings.warn(f"no alpha-beta fit: {exc}", stacklevel=2)
    return tuple(fits)


def _collective_fn(kind: str, numel: int, group_size: int, group, device: torch.device) -> Callable[[], object]:
    """A zero-argument call of one collective on preallocated float32 buffers of `numel` (full) elements.

    all_gather / reduce_scatter use the *_single names of torch 2.13 where present and the
    *_into_tensor names of torch 2.11 otherwise (2.13 deprecates the latter)."""
    full = torch.ones(numel, dtype=torch.float32, device=device)
    if kind == "all_reduce":
        return lambda: dist.all_reduce(full, group=group)
    if kind == "all_to_all":
        out = torch.empty_like(full)
        return lambda: dist.all_to_all_single(out, full, group=group)
    shard = torch.ones(numel // group_size, dtype=torch.float32, device=device)
    if kind == "all_gather":
        all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return lambda: all_gather(full, shard, group=group)
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return lambda: reduce_scatter(shard, full, group=group)


class _World:
    """Barrier and max-over-ranks on the world group, on tensors of the measuring device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._flag = torch.zeros(1, device=device)

    def barrier(self) -> None:
        dist.all_reduce(self._flag)  # a tiny all_reduce: works alike under gloo and NCCL
        synchronize(self.device)

    def max(self, value: float) -> float:
        box = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(box, op=dist.ReduceOp.MAX)
        return float(box.item())


def _subgroup(group_size: int):
    """This rank's group of `group_size` consecutive ranks (None: the world). Every rank creates every
    group, in the same order, as new_group requires."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if group_size == world:
        return None
    mine = None
    for first in range(0, world, group_size):
        group = dist.new_group(list(range(first, first + group_size)))
        if first <= rank < first + group_size:
            mine = group
    return mine


def time_collective_s(kind: str, message_bytes: int, group_size: int, group, world: _World, budget_s: float) -> tuple[int, float]:
    """(message_bytes rounded to whole elements per rank, slowest rank's fastest-window seconds per call)."""
    numel = max(group_size, message_bytes // ELEMENT_BYTES // group_size * group_size)
    fn = _collective_fn(kind, numel, group_size, group, world.device)
    for _ in range(WARMUP_CALLS):
        fn()
    synchronize(world.device)
    one_call_s = world.max(timed_windows_s(fn, world.device, 1, 1, before=world.barrier)[0])
    repeats, inner = plan_windows(one_call_s, budget_s)  # the same on every rank: no rank waits forever
    local_s = min(timed_windows_s(fn, world.device, repeats, inner, before=world.barrier))
    return numel * ELEMENT_BYTES, world.max(local_s)


def measure_collectives(device: torch.device, kinds: Sequence[str] = COLLECTIVE_KINDS, sizes: Sequence[int] | None = None,
                        quick: bool = False, budget_s: float | None = None) -> tuple[tuple[CollectiveSample, ...], tuple[CollectiveFit, ...]]:
    """Samples and fits for every kind, group size and message size; every rank gets the same answer."""
    if not dist.is_available() or not dist.is_initialized():
        raise ProfileError("measure_collectives needs an initialised process group: run under torchrun or call init_process_group first")
    sizes = list(sizes) if sizes is not None else default_message_sizes(quick)
    budget_s = budget_s if budget_s is not None else (0.01 if quick else 0.05)
    world, samples = _World(device), []
    for g in group_sizes(dist.get_world_size()):
        group = _subgroup(g)
        for kind in kinds:
            for size in sizes:
                message_bytes, time_s = time_collective_s(kind, size, g, group, world, budget_s)
                samples.append(CollectiveSample(kind, g, message_bytes, time_s))
    return tuple(samples), fit_all(samples)


# ------------------------------------------------------------------------- a collective inside a step
# GEMM sizes (n x n x n, float32) of the compute between two collectives, about 0.6 and 2.5 ms on one thread of
# the development machine: the span of a small model's layer segment between tensor-parallel collectives
SYNC_GEMMS = (320, 512, 768, 1024)  # about 0.3, 2.6, 9 and 20 ms of fp32 compute on one core
SYNC_MESSAGES = (4 * KiB, 1 * MiB)  # an FSDP2 unit's or a tp activation's scale; the byte term is the fit's
SYNC_WINDOW_S = 0.01  # a window runs at least this long: several calls in a row, as a step's layers run them
# seconds of timed windows over the grid (`collective_sync_s`): each extra is the difference of two medians of windows
# tens of ms long, so the long computes need tens of windows. On the 2-core development machine (2026-11-26, 2 gloo
# ranks) four fits within a minute read c = 0.0074-0.0165 s^0.5 with 1.5 s (5 windows at 20 ms), 0.0112-0.0152
# with 12 s (about 17 s a fit), 0.0081-0.0109 with 24 s; a step's tp calls meet 10-30 ms of compute, where c decides.
SYNC_BUDGET_S = 12.0


def gemm_compute(n: int, device: torch.device) -> Callable[[], object]:
    """One (n, n) x (n, n) float32 GEMM into a preallocated output: compute whose duration each rank's
    share of the cores decides."""
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    out = torch.empty(n, n, device=device)
    return lambda: torch.mm(a, b, out=out)


def in_step_windows_s(compute: Callable[[], object], message_bytes: int, world: _World, repeats: int, inner: int
                      ) -> tuple[float, float]:
    """(compute alone, compute then a blocking all-reduce of `message_bytes`) per call: each the median over
    `repeats` windows of `inner` calls (the two kinds of window alternate, each after a world barrier), then
    the slowest rank's."""
    buffer = torch.ones(max(1, message_bytes // ELEMENT_BYTES), device=world.device)

    def both() -> None:
        compute()
        dist.all_reduce(buffer)

    for _ in range(WARMUP_CALLS):
        both()
    alone, paired = [], []
    for _ in range(repeats):
        alone += timed_windows_s(compute, world.device, 1, inner, before=world.barrier)
        paired += timed_windows_s(both, world.device, 1, inner, before=world.barrier)
    return world.max(float(np.median(alone))), world.max(float(np.median(paired)))


def collective_sync_s(fits: Sequence[CollectiveFit], device: torch.device, quick: bool = False,
                      computes: Sequence[Callable[[], object]] | None = None,
                      budget_s: float | None = None) -> tuple[float, float, list[tuple[float, int, float]]]:
    """(s, c, the samples (compute s, message bytes, extra s)): what a blocking collective costs inside a step
    beyond its fitted time, s + c sqrt(the compute before it) (`cost_model.comm`, "Inside a step"); every rank
    of the world calls it. Per compute (`computes`, default GEMMs of `SYNC_GEMMS`, 0.3-20 ms on one core of
    the development machine) and message of `SYNC_MESSAGES`:

        extra = median(compute; all-reduce) - median(compute alone) - fit(all-reduce, message)

    and (s, c) the least-squares fit of extra against sqrt(compute), both floored at 0 (`fit_skew`; computes of
    one duration: c = 0 and s their median). Medians, not the fastest window: a step pays the typical call.
    Both ranks run the same loop at once, so what the extra holds is what a step's collective meets and the
    lockstep sweep above does not: the ranks arrive out of step (each rank's compute ran on a core it shares
    with its peer's gloo threads and the OS), and the waiting rank's threads must be woken and scheduled again.
    On the 2-core development machine (2026-11-26, 2 gloo ranks, one thread each) the extra was 0.9-1.7 ms per
    call at 0.3 ms of compute whatever the message (4 KiB or 1 MiB), 1.0-1.3 ms at 2.6 ms, 1.5-2.2 ms at 9 ms,
    2.9 ms at 20 ms and 2.6-4.1 ms at 40 ms: a fixed cost per call and a skew that grows as the square root of
    the compute before it, not in proportion to it. Not measured on CUDA, where NCCL's kernels wait on the
    device and the host runs ahead."""
    fit = next((f for f in fits if f.kind == "all_reduce" and f.group_size == dist.get_world_size()), None)
    if fit is None:
        raise ProfileError("collective_sync_s needs the all-reduce fit over the world (measure_collectives first)")
    computes = computes if computes is not None else [gemm_compute(n, device) for n in SYNC_GEMMS]
    budget_s = budget_s if budget_s is not None else (0.3 if quick else SYNC_BUDGET_S)
    world, samples = _World(device), []
    for compute in computes:
        for message in SYNC_MESSAGES:
            one_call_s = world.max(timed_windows_s(compute, device, 1, 1)[0])
            inner = max(3, math.ceil(SYNC_WINDOW_S / (one_call_s + fit.latency_s)))  # a run of calls, as a step
            repeats = max(5, min(100, int(budget_s / len(computes) / len(SYNC_MESSAGES) / (2 * inner * one_call_s))))
            alone_s, paired_s = in_step_windows_s(compute, message, world, repeats, inner)
            fitted = fit.latency_s + message * ring_byte_factor("all_reduce", fit.group_size) / fit.bandwidth_bytes_per_s
            samples.append((alone_s, message, paired_s - alone_s - fitted))
    return (*fit_skew(samples), samples)


def fit_skew(samples: Sequence[tuple[float, int, float]]) -> tuple[float, float]:
    """(s, c) >= 0 of extra = s + c sqrt(compute) over `samples` (compute s, message bytes, extra s), least
    squares; c = 0 and s the median extra where the computes span less than a factor of 2."""
    x = np.sqrt([max(0.0, d) for d, _, _ in samples])
    y = np.array([extra for *_, extra in samples])
    if x.max() < np.sqrt(2.0) * max(x.min(), 1e-12):
        return max(0.0, float(np.median(y))), 0.0
    c, s = np.polyfit(x, y, 1)
    if c < 0:
        return max(0.0, float(np.median(y))), 0.0
    if s < 0:
        return 0.0, float(np.dot(x, y) / np.dot(x, x))
    return float(s), float(c)


# ------------------------------------------------------------------- a collective overlapped with compute
OVERLAP_MESSAGE = 16 * MiB  # a data-parallel bucket's scale (25 MiB buckets, `autoplan.grad_buckets`)
OVERLAP_GEMM = 512  # the compute beside it: (512, 512) x (512, 512) GEMMs, about 2.6 ms each on one core


def overlap_cost(device: torch.device, quick: bool = False, message_bytes: int = OVERLAP_MESSAGE
                 ) -> tuple[float, tuple[float, float, float]]:
    """(f, (compute s, all-reduce s, both s)): the share of an all-reduce's time that the compute it overlaps
    loses, every rank of the world at once (`Efficiency.overlap_cost`, `cost_model.dp_sync`):

        f = clamp((both - compute) / all-reduce, 0, 1)

    compute: GEMMs lasting about 3 all-reduces; all-reduce: `message_bytes` alone; both: the all-reduce
    started asynchronously (as the runtime's gradient buckets are), the same compute, then its wait. Each
    the median of alternating windows after a world barrier, by wall time, then the slowest rank's. f = 0:
    the collective hides whole behind compute (its own cores, or a GPU's copy engines and spare SMs); f =
    1: it runs as if after the compute. On the 2-core development machine (2026-11-26, 2 gloo ranks, one
    thread each, 12 GEMMs of 1024^3, about 240 ms, beside all-reduces of 8-100 MiB) f read 0.42-0.80:
    gloo's threads copy and reduce on the cores the ranks compute on. Not measured on CUDA."""
    world = _World(device)
    buffer = torch.ones(max(1, message_bytes // ELEMENT_BYTES), device=device)
    gemm = gemm_compute(OVERLAP_GEMM, device)
    for _ in range(WARMUP_CALLS):
        gemm()
        dist.all_reduce(buffer)
    one_gemm_s = world.max(timed_windows_s(gemm, device, 1, 3)[0])
    reduce_s = world.max(timed_windows_s(lambda: dist.all_reduce(buffer), device, 1, 1)[0])
    calls = max(1, math.ceil(3 * reduce_s / one_gemm_s))

    def compute() -> None:
        for _ in range(calls):
            gemm()

    def both() -> None:
        work = dist.all_reduce(buffer, async_op=True)
        compute()
        work.wait()

    kinds = {"compute": compute, "reduce": lambda: dist.all_reduce(buffer), "both": both}
    times: dict[str, list[float]] = {name: [] for name in kinds}
    for _ in range(3 if quick else 7):
        for name, fn in kinds.items():
            times[name] += timed_windows_s(fn, device, 1, 1, before=world.barrier)
    alone, reduced, paired = (world.max(float(np.median(times[name]))) for name in kinds)
    return min(1.0, max(0.0, (paired - alone) / reduced)), (alone, reduced, paired)
