"""What a run of `gpu_steps.py` records besides its timed steps: the optimizer's steps by CUDA events, one step's
GPU timeline by phase and its memory by phase, and, with `--diagnose`, one step's kernels under torch.profiler
(by family, the GPU's idle gaps) and one microbatch's saved bytes. Imported on the GPU machine only."""
from __future__ import annotations

import contextlib
import time


@contextlib.contextmanager
def timed_optimizer(optimizer):
    """Time each `optimizer.step` by CUDA events while the block runs; yields a function that returns the
    steps' seconds (read after the block: the events are synchronised there)."""
    import torch

    pairs, inner = [], optimizer.step

    def step(*args, **kwargs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = inner(*args, **kwargs)
        end.record()
        pairs.append((start, end))
        return out

    optimizer.step = step
    try:
        yield lambda: [a.elapsed_time(b) / 1e3 for a, b in pairs]
    finally:
        torch.cuda.synchronize()
        del optimizer.step


KERNEL_FAMILIES = (  # (family, name fragments), first match wins: a coarse map of CUDA kernel names
    ("attention", ("flash", "fmha", "cudnn", "attention", "sdpa")),
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "sm90_", "sm100_")),
    ("optimizer", ("multi_tensor", "foreach", "adam")),
    ("loss", ("nll_loss", "log_softmax", "softmax_backward", "cross_entropy")),
    ("triton", ("triton",)),
    ("copy", ("memcpy", "memset", "copy_kernel", "cat_", "to_copy")),
)


def kernel_family(name: str) -> str:
    low = name.lower()
    return next((family for family, parts in KERNEL_FAMILIES if any(p in low for p in parts)), "elementwise")


def kernel_breakdown(step) -> dict:
    """One `step()` under torch.profiler: its wall time, the GPU's busy time (the union of kernel intervals),
    the kernels' summed time and count per `kernel_family`, and the 25 costliest kernels by name."""
    import torch
    from torch.autograd import DeviceType

    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    kernels = sorted(((e.name, e.time_range.start, e.time_range.end) for e in prof.events()
                      if e.device_type == DeviceType.CUDA and "#" not in e.name),  # "Optimizer.step#AdamW.step":
                     key=lambda k: k[1])  # a user annotation on the GPU's timeline, not a kernel
    families, names = {}, {}
    for name, a, b in kernels:
        fam = families.setdefault(kernel_family(name), [0.0, 0])
        fam[0], fam[1] = fam[0] + (b - a) / 1e6, fam[1] + 1
        names[name[:120]] = names.get(name[:120], 0.0) + (b - a) / 1e6
    top = sorted(names.items(), key=lambda kv: -kv[1])[:25]
    return {"wall_s": wall, "busy_s": _union_s(sorted((a, b) for _, a, b in kernels)), "families": families,
            "top": top, "kernel_count": len(kernels), "gaps": idle_gaps(kernels)}


def idle_gaps(kernels, least_us: float = 20.0) -> dict:
    """Where the GPU waited between kernels (sorted (name, start_us, end_us)): the gaps of more than `least_us`,
    their count and seconds, and the 30 longest as (ms, where in the step as a fraction of its kernels' span,
    the kernel after the gap)."""
    if not kernels:
        return {"count": 0, "s": 0.0, "longest": []}
    first, last = kernels[0][1], max(b for _, _, b in kernels)
    gaps, end = [], kernels[0][2]
    for name, a, b in kernels[1:]:
        if a - end > least_us:
            gaps.append(((a - end) / 1e3, (a - first) / max(last - first, 1.0), name[:80]))
        end = max(end, b)
    return {"count": len(gaps), "s": sum(g[0] for g in gaps) / 1e3, "longest": sorted(gaps, key=lambda g: -g[0])[:30]}


def _union_s(intervals) -> float:
    """Seconds covered by the union of sorted (start_us, end_us) intervals."""
    total, end = 0.0, float("-inf")
    for a, b in intervals:
        if b > end:
            total += b - max(a, end)
            end = b
    return total / 1e6


def saved_bytes_per_microbatch(program, plan, tokens, targets) -> dict:
    """What one microbatch's forward leaves for backward on the GPU (runtime.memory_probe), as on CPU."""
    from autoplan.runtime.memory_probe import measure_saved_bytes

    rows = plan.microbatch_size
    _, measured = measure_saved_bytes(lambda: program(tokens[:rows], targets[:rows]), program)
    program.zero_grad(set_to_none=True)
    return {"saved_bytes": measured.saved_bytes, "recompute_bytes": measured.recompute_bytes}


def step_phases(program, optimizer, tokens, targets) -> dict:
    """One step's GPU timeline by phase, from CUDA events the host records as it reaches each boundary (no
    synchronisation added): each microbatch's forward (from the call of the program to its return) and
    backward (to the next call, or to the gradient sync's `finish`), the sync's finish, what runs between it
    and the optimizer (the loss and gradient norm), and the optimizer's step. An event's time is when the GPU
    reached it: a phase holds the idle gaps where the GPU waited for the host. Seconds, summed over
    microbatches."""
    import torch

    marks = []

    def mark(name):
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        marks.append((name, event))

    hooks = [program.register_forward_pre_hook(lambda *a: mark("forward")),
             program.register_forward_hook(lambda *a: mark("backward"))]
    sync, inner = program.grad_sync, optimizer.step
    finish = sync.finish if sync is not None else None

    def finished():
        mark("sync")
        finish()
        mark("loss_and_norm")

    def step(*args, **kwargs):
        mark("optimizer")
        out = inner(*args, **kwargs)
        mark("end")
        return out

    if sync is not None:
        sync.finish = finished
    optimizer.step = step
    torch.cuda.synchronize()
    mark("start")
    try:
        program.train_step(tokens, targets, optimizer)
        torch.cuda.synchronize()
    finally:
        for hook in hooks:
            hook.remove()
        del optimizer.step
        if sync is not None:
            del sync.finish
    held: dict = {}  # each interval belongs to the phase its first mark opens ("start" opens the setup)
    for (begin, a), (_, b) in zip(marks, marks[1:]):
        phase = "setup" if begin == "start" else begin
        held[phase] = held.get(phase, 0.0) + a.elapsed_time(b) / 1e3
    held["total"] = marks[0][1].elapsed_time(marks[-1][1]) / 1e3
    held["marks"] = [name for name, _ in marks]
    return held


def memory_phases(program, optimizer, tokens, targets) -> dict:
    """One step's memory by phase: allocated before it (weights, optimizer states), the peak of forward +
    backward (up to the optimizer's step), allocated when the step begins (the gradients added), and the
    peak of the optimizer's step (its temporaries)."""
    import torch

    seen = {}
    inner = optimizer.step

    def step(*args, **kwargs):
        torch.cuda.synchronize()
        seen["peak_forward_backward"] = torch.cuda.max_memory_allocated()
        seen["allocated_at_optimizer"] = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = inner(*args, **kwargs)
        torch.cuda.synchronize()
        seen["peak_optimizer"] = torch.cuda.max_memory_allocated()
        return out

    torch.cuda.synchronize()
    seen["allocated_before"] = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    optimizer.step = step
    try:
        program.train_step(tokens, targets, optimizer)
    finally:
        del optimizer.step  # the class's step again
    return seen
