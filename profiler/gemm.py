"""GEMM sweep: achieved FLOP/s of C = A @ B over shapes (m, n, k), and the timers the profiler shares.

For each shape: two warm-up calls (cuBLAS / oneDNN pick their kernels and allocate workspaces), one
call timed alone to size the run, then `repeats` timed windows of `inner` back-to-back calls each.
The sample is the fastest window's per-call time, and

    achieved FLOP/s = 2 * m * n * k / time_s.

The fastest window, not the median (as for collectives, `profiler.collectives`): the noise of a
window is one-sided (the thread descheduled, a cache shared with another job), and on a loaded CPU it
swamps the shape's own cost: three sweeps of the CPU grid at a load average of 9 on the 2-core
development machine (2026-11-25) spread 19.8% per shape in the median (half the shapes; a tenth
beyond 65%) and 6.6% in the fastest window (a tenth beyond 44%), and a plan's predicted step follows
its GEMMs' samples, so the planner ranked plans by that noise. Every timer of the profiler shares
this one (`fastest_call_s`: GEMMs, the copy bandwidth, the launch floor, the fused kernels), except a
CPU's GEMMs, which take the median window by the thread's CPU time (`time_gemm_s`): descheduling does
not stretch that clock, and the fastest window is the best of many, where a step pays the typical
one: on the development machine a step's GEMMs ran 3-6% slower than the fastest windows of the same
shapes and 0-3% slower than their medians (2026-11-26, one rank, `torch.profiler`), and the
fastest-window profile priced every plan of `benchmarks/step_fidelity.py` under. And a CPU's GEMMs take
their operands in turn from a pool of copies larger than the last-level cache (`operand_pool`), as a
step's GEMMs meet their weights and activations, last touched a layer or a pass ago: over 8 shapes of
the grid, 2 ranks at once (2026-11-26), calls on the same operands ran 5% faster on average than calls
on rotated ones (-21% .. +5% per shape); in one process, a step's GEMMs ran 2.4-3.5% slower than the same
shapes on the same operands in a loop.

Timers: on CUDA, `torch.cuda.Event(enable_timing=True)` pairs recorded on the current stream around
each window, read after one final synchronize (no host round trip inside the timed region); on CPU,
the thread's CPU time (`time.thread_time`) around each window where torch runs on one thread, as each
rank does under torchrun (`cpu_clock`: what the work costs the core, which other jobs on a shared
machine do not stretch), else `time.perf_counter`. `inner` makes a window last at least `MIN_WINDOW_S`, so tiny
GEMMs are not timed at the resolution of the clock or of a single launch.

Default sweeps (sized to the device):
- CUDA, bf16: m, n, k each in {256, 512, 1k, 2k, 4k, 8k, 16k}: 343 shapes, covering the (tokens x
  hidden) x (hidden x 3h / 4h) products of transformer layers up to GPT-3 width, and the narrow ones a
  rank of tp 8 runs (a 2048-wide model's k and v projections: 256 outputs per rank). `--quick`: {1k, 4k}^3.
- CPU, fp32: m, n, k each in {64, 256, 1024, 2048}: 64 shapes in 3 passes, 12-17 s on one thread (the
  largest is ~0.16 s at ~110 GFLOP/s). `--quick`: {64, 256}^3, one pass.
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

import torch

from autoplan.errors import ConfigError
from autoplan.profiler.profile import GemmSample

TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
CUDA_SIZES = (256, 512, 1024, 2048, 4096, 8192, 16384)
CUDA_QUICK_SIZES = (1024, 4096)
CPU_SIZES = (64, 256, 1024, 2048)
CPU_QUICK_SIZES = (64, 256)
MIN_WINDOW_S = 1e-3  # a timed window of back-to-back calls lasts at least this long
COLD_POOL_BYTES = 64 * 2**20  # a CPU's GEMM operands in turn: twice the development machine's 32 MiB L3
MAX_POOL_PAIRS = 256
CPU_PASSES = 3  # a CPU's grid is swept this many times, each shape its median pass (`sweep_gemms`)
WARMUP_CALLS = 2
T = TypeVar("T")


def default_dtype(kind: str) -> str:
    """bf16 on CUDA (what training runs in); fp32 on CPU (bf16 GEMMs there are slow emulations)."""
    return "bfloat16" if kind == "cuda" else "float32"


def default_shapes(kind: str, quick: bool = False) -> list[tuple[int, int, int]]:
    """The full grid sizes^3 over (m, n, k); sizes per device kind and mode as in the module docstring."""
    if kind == "cuda":
        sizes = CUDA_QUICK_SIZES if quick else CUDA_SIZES
    else:
        sizes = CPU_QUICK_SIZES if quick else CPU_SIZES
    return [(m, n, k) for m in sizes for n in sizes for k in sizes]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_windows_s(fn: Callable[[], object], device: torch.device, repeats: int, inner: int,
                    before: Callable[[], None] | None = None, clock: Callable[[], float] = time.perf_counter
                    ) -> list[float]:
    """Per-call seconds of `repeats` windows of `inner` calls: window time / inner.

    `before` (e.g. a barrier) runs before each window, outside it; the device is idle when a window
    starts. CUDA windows are timed by events and read after one synchronize at the end; others by
    `clock` (wall time unless the caller says otherwise: `cpu_clock`)."""
    if device.type != "cuda":
        times = []
        for _ in range(repeats):
            if before is not None:
                before()
            start = clock()
            for _ in range(inner):
                fn()
            times.append((clock() - start) / inner)
        return times
    pairs = []
    for _ in range(repeats):
        if before is not None:
            before()
        synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        pairs.append((start, end))
    synchronize(device)
    return [start.elapsed_time(end) * 1e-3 / inner for start, end in pairs]  # elapsed_time is in ms


def plan_windows(one_call_s: float, budget_s: float, min_repeats: int = 3, max_repeats: int = 50) -> tuple[int, int]:
    """(repeats, inner): inner = ceil(MIN_WINDOW_S / one_call_s) calls per window, and as many
    windows as fit in budget_s, clamped to [min_repeats, max_repeats]."""
    one_call_s = max(one_call_s, 1e-9)
    inner = max(1, int(-(-MIN_WINDOW_S // one_call_s)))
    repeats = int(budget_s / (one_call_s * inner))
    return max(min_repeats, min(max_repeats, repeats)), inner


def cpu_clock(device: torch.device) -> Callable[[], float]:
    """The clock a device's own work is timed by: on a CPU running torch on one thread (as each rank
    under torchrun), that thread's CPU time, which a shared machine's other jobs do not stretch (on a
    loaded machine a wall-clock window of many milliseconds is all but sure to be descheduled, one of
    a millisecond often is not: under a load average of 13 on 2 cores, sweeps timed by wall clock
    priced the 4-sequence microbatches of benchmarks/step_fidelity.py's models 1.4 to 3.9 times
    slower than 1-sequence ones, sweeps by thread time 0.99 to 1.00 times, and the steps' CPU seconds
    differed by 6% (0.72 against 0.68 s, 0.75 against 0.71 s)); else wall time."""
    if device.type == "cpu" and torch.get_num_threads() == 1:
        return time.thread_time
    return time.perf_counter


def fastest_call_s(fn: Callable[[], object], device: torch.device, budget_s: float,
                   pick: Callable[[list[float]], float] = min) -> float:
    """The fastest window's per-call seconds of `fn` after warm-up (module docstring), spending about
    `budget_s` on the timed windows, by the device's `cpu_clock`; `pick`: another statistic of the windows
    (the median for a CPU's GEMMs, `time_gemm_s`)."""
    clock = cpu_clock(device)
    for _ in range(WARMUP_CALLS):
        fn()
    (one_call_s,) = timed_windows_s(fn, device, repeats=1, inner=1, clock=clock)
    repeats, inner = plan_windows(one_call_s, budget_s)
    return pick(timed_windows_s(fn, device, repeats, inner, clock=clock))


def time_gemm_s(m: int, n: int, k: int, dtype: str, device: torch.device, budget_s: float) -> float:
    """Seconds of C (m, n) = torch.mm(A (m, k), B (k, n)) in `dtype` on `device` (`fastest_call_s`), C
    a fresh tensor each call as eager linear layers allocate theirs (on a CPU, pages the allocator may
    have to fault in; on CUDA, the caching allocator's block). On a CPU each call takes the next pair of
    operands from a pool larger than the last-level cache (`operand_pool`), the median window."""
    torch_dtype = TORCH_DTYPES[dtype]
    a = torch.randn(m, k, device=device, dtype=torch_dtype)  # (m, k)
    b = torch.randn(k, n, device=device, dtype=torch_dtype)  # (k, n)
    if device.type != "cpu":
        return fastest_call_s(lambda: torch.mm(a, b), device, budget_s)
    # the median window, by the thread's CPU time: what a step's GEMMs take (module docstring)
    return fastest_call_s(in_turn(operand_pool(a, b), lambda pair: torch.mm(*pair)), device, budget_s,
                          statistics.median)


def operand_pool(a: torch.Tensor, b: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Copies of (a, b) filling at least `COLD_POOL_BYTES` (2 to `MAX_POOL_PAIRS` pairs): taken in turn, each
    call reads its operands from memory, as a step's GEMMs do (their weights and activations last touched a
    layer or a pass ago), not from the cache the previous call filled (module docstring)."""
    count = pool_size((a.numel() + b.numel()) * a.element_size(), MAX_POOL_PAIRS)
    return [(a.clone(), b.clone()) for _ in range(count)]


def pool_size(nbytes: int, most: int) -> int:
    """How many copies of `nbytes` each fill `COLD_POOL_BYTES`: 2 at least, `most` at most."""
    return max(2, min(most, -(-COLD_POOL_BYTES // max(1, nbytes))))


def in_turn(items: Sequence[T], call: Callable[[T], object]) -> Callable[[], object]:
    """A timed call that runs `call` on the next of `items` each time, round robin: each call meets inputs
    the calls just before it did not leave in the cache (`operand_pool`; `profiler.kernels.eager_copies`;
    `profiler.memory.measure_fresh_copies`)."""
    turn = itertools.cycle(items)
    return lambda: call(next(turn))


def sweep_gemms(device: torch.device, dtype: str | None = None, shapes: Iterable[tuple[int, int, int]] | None = None,
                quick: bool = False, budget_s: float | None = None, passes: int | None = None) -> tuple[GemmSample, ...]:
    """One GemmSample per shape; defaults: the device's dtype and grid, and a per-shape budget of
    0.03 s on CUDA and 0.02 s on CPU (halved by `quick`). On a CPU the grid is swept `passes` times (default
    `CPU_PASSES`, 1 with `quick`) one after the other, and each shape keeps its median pass: a shared machine's
    speed drifts from second to second, and one pass of a few seconds catches one moment of it (two fresh
    profiles six minutes apart on the development machine, 2026-11-26, read the whole grid 7% apart, the
    median over shapes, and single shapes up to 41%)."""
    dtype = dtype or default_dtype(device.type)
    if dtype not in TORCH_DTYPES:
        raise ConfigError(f"GEMM dtype {dtype!r} is not one of {sorted(TORCH_DTYPES)}")
    shapes = list(shapes) if shapes is not None else default_shapes(device.type, quick)
    if budget_s is None:
        budget_s = (0.03 if device.type == "cuda" else 0.02) * (0.5 if quick else 1.0)
    if passes is None:
        passes = CPU_PASSES if device.type == "cpu" and not quick else 1
    times: dict[tuple[int, int, int], list[float]] = {shape: [] for shape in shapes}
    with torch.no_grad():
        for _ in range(passes):
            for m, n, k in shapes:
                times[(m, n, k)].append(time_gemm_s(m, n, k, dtype, device, budget_s))
    return tuple(GemmSample(m, n, k, dtype, statistics.median(times[(m, n, k)])) for m, n, k in shapes)
