"""`autoplan profile`: measure the local device and write a hardware-profile file.

    autoplan profile -o profile.json                    # GEMMs + memory bandwidth of this device
    autoplan profile --quick --device cpu -o cpu.json   # a small sweep, in seconds
    torchrun --nproc-per-node 8 -m autoplan.profiler.cli -o h200.json   # + collectives over 8 ranks

On CUDA, rank 0 also times the runtime's fused Triton kernels (`profiler.kernels`); on a CPU every rank
times their torch fallbacks, which the runtime runs there; the cost model then prices the nodes they run
at their measured efficiency (`cost_model.kernels`). Where neither runs, that step is skipped, saying
why, and the cost model keeps its assumed efficiencies.

Under torchrun every rank runs the GEMM sweep, the copy and the launch floor at the same time, as
training keeps every device busy, and the profile keeps the slowest rank's time of each (a step ends
when its last rank does; `slowest_rank`); every rank takes part in the collectives; rank 0 prints the
table and writes the file. Why all at once: devices that share a package share its caches, memory
bandwidth and power. On the 2-core development machine (2026-11-26) the GEMM shapes of
benchmarks/step_fidelity.py's plans ran 3-16% slower per second of thread time with the other core
busy than a profile measured by rank 0 alone predicted (the sum over one microbatch's GEMMs: 11% and
11%, dp and tp shapes), and so every plan ran slower than priced. GPUs of one node run at the sustained
clocks of a busy node, which the default curve assumes too (`cost_model.calibration`). The process group is made here (NCCL on CUDA, gloo on CPU) unless the caller has
already initialised one, and destroyed here only if made here.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from datetime import datetime, timezone
from typing import TYPE_CHECKING

from autoplan.errors import AutoplanError, ConfigError
from autoplan.profiler.profile import HardwareProfile, local_device_name
from autoplan.validate import check_output_file

if TYPE_CHECKING:
    import torch

# torch is imported inside the functions that measure: building the `autoplan` parser stays fast
# (importing torch takes seconds), and `autoplan search` never pays for it through this module.
GEMM_DTYPES = ("bfloat16", "float16", "float32")


def add_profile_parser(subparsers) -> argparse.ArgumentParser:
    """Add the `profile` subcommand to an argparse subparsers object; returns its parser."""
    p = subparsers.add_parser("profile", help="measure GEMMs, memory bandwidth and collectives here; write a hardware profile")
    p.add_argument("-o", "--output", metavar="FILE", default="profile.json", help="where to write the profile (default profile.json)")
    p.add_argument("--quick", action="store_true", help="a small sweep that finishes in seconds (for tests and smoke runs)")
    p.add_argument("--device", choices=("cpu", "cuda"), help="device to measure (default: cuda when available, else cpu)")
    p.add_argument("--dtype", choices=GEMM_DTYPES, help="GEMM dtype (default: bfloat16 on cuda, float32 on cpu)")
    p.add_argument("--no-collectives", action="store_true", help="skip collectives even under torchrun")
    p.add_argument("--fsdp-units", action="store_true", help="also measure FSDP2's fixed cost per unit (ZeRO 3; under "
                   "torchrun); off by default: on gloo it aborts about 1 run in 8 at exit (profiler/fsdp.py)")
    p.add_argument("--no-kernels", action="store_true",
                   help="skip timing the runtime's kernels (Triton on CUDA, their torch fallbacks on a CPU)")
    p.add_argument("--threads", type=int, metavar="N", help="torch CPU threads (default: torch's; 1 under torchrun); "
                   "on a shared CPU, 1 avoids stalls of threads waiting for a descheduled sibling")
    return p


def _device(kind: str | None) -> "torch.device":
    import torch

    kind = kind or ("cuda" if torch.cuda.is_available() else "cpu")
    if kind == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError("--device cuda was asked for but torch sees no CUDA device; use --device cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))


def _init_distributed(device: "torch.device") -> bool:
    """Join torchrun's process group if WORLD_SIZE > 1 and none exists; True if made here."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized() or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return True


def _memory_bytes(device: "torch.device") -> int:
    """Device memory (CUDA) or physical RAM (CPU, from sysconf), in bytes."""
    import torch

    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def _measure_device(device: "torch.device", quick: bool, dtype: str | None, kernels: bool = True) -> dict:
    """What this process measures of its own device, by name: the GEMM samples, the copy, the launch floor,
    and on a CPU the fresh-allocation copies, causal attention, eager dispatch per kernel (`host`;
    on CUDA rank 0 measures it alone, `host_dispatch_s`) and, with `kernels`, the runtime's kernels as
    their torch fallbacks (`eager_kernels`, `profiler.kernels.measure_eager_kernels`)."""
    from autoplan.profiler.attention import measure_attention
    from autoplan.profiler.gemm import default_dtype, sweep_gemms
    from autoplan.profiler.kernels import measure_eager_kernels
    from autoplan.profiler.launch import measure_kernel_floor
    from autoplan.profiler.memory import measure_fresh_copies, measure_memory_bandwidth

    out = {"gemm": sweep_gemms(device, dtype=dtype, quick=quick), "memory": measure_memory_bandwidth(device, quick=quick),
           "floor": measure_kernel_floor(device, quick), "fresh_copies": measure_fresh_copies(device, quick),
           "attention": measure_attention(device, dtype or default_dtype(device.type), quick), "host": None,
           "eager_kernels": measure_eager_kernels(device, dtype or default_dtype(device.type), quick) if kernels else ()}
    if device.type == "cpu":
        from autoplan.profiler.dispatch import measure_cpu_dispatch_s

        out["host"], per_block, kernels = measure_cpu_dispatch_s(device, out["floor"], quick)
        print(f"eager dispatch: {per_block * 1e3:.3f} ms per block forward + backward, {kernels} kernels")
    return out


def kernel_samples(device: "torch.device", quick: bool, dtype: str | None) -> tuple[tuple, str | None]:
    """(the Triton kernels' samples, None), or ((), why they were not measured) where they cannot run."""
    from autoplan.profiler.kernels import DTYPES, measure_kernels, skip_reason

    why = skip_reason(device)
    if why is not None:
        return (), why
    return measure_kernels(device, dtype if dtype in DTYPES.values() else "bfloat16", quick), None


def host_dispatch_s(device: "torch.device", quick: bool) -> tuple[float | None, list[float] | None]:
    """(the host's seconds per priced kernel, [forward, backward] apart) (`profiler.dispatch`) on CUDA; Nones
    elsewhere, or, saying why, where the timed block cannot run (the profile is still written: the cost
    model then keeps its default)."""
    if device.type != "cuda":
        return None, None  # a CPU's: `_measure_device`, on every rank
    from autoplan.profiler.dispatch import measure_host_kernel_s

    try:
        per_kernel, per_block, kernels, (forward, backward) = measure_host_kernel_s(device, quick)
    except Exception as exc:  # an optional measurement: report it, keep the rest of the profile
        print(f"host dispatch skipped: {type(exc).__name__}: {exc}; the cost model keeps its default")
        return None, None
    print(f"host dispatch: {per_block * 1e3:.3f} ms per block forward + backward, {kernels} kernels; "
          f"{forward * 1e6:.1f} us per forward kernel, {backward * 1e6:.1f} us per backward kernel")
    return per_kernel, [forward, backward]


def optimizer_rate(device: "torch.device", quick: bool) -> float | None:
    """The bytes per second torch's AdamW step moves on CUDA (`profiler.memory.measure_adamw_rate`); None on a
    CPU (priced there from its copies) or, saying why, where it cannot run."""
    if device.type != "cuda":
        return None
    from autoplan.profiler.memory import measure_adamw_rate

    try:
        rate, params, seconds = measure_adamw_rate(device, quick)
    except Exception as exc:  # an optional measurement: report it, keep the rest of the profile
        print(f"AdamW rate skipped: {type(exc).__name__}: {exc}; the cost model prices it from the copy")
        return None
    print(f"AdamW: {seconds * 1e3:.3f} ms per step over {params / 1e6:.0f} M parameters, {rate / 1e9:,.1f} GB/s")
    return rate


def optimizer_host_s(device: "torch.device", quick: bool) -> list[float] | None:
    """[a, b]: the optimizer's exposed host seconds per step, a + b per tensor stepped
    (`profiler.memory.measure_optimizer_host_s`); None, saying why, where it cannot run."""
    from autoplan.profiler.memory import measure_optimizer_host_s

    try:
        per_step, per_tensor = measure_optimizer_host_s(device, quick)
    except Exception as exc:  # an optional measurement: report it, keep the rest of the profile
        print(f"optimizer host cost skipped: {type(exc).__name__}: {exc}; the cost model keeps its default")
        return None
    print(f"optimizer host cost exposed per step: {per_step * 1e3:.3f} ms + {per_tensor * 1e6:.2f} us per tensor")
    return [per_step, per_tensor]


def recompute_host_s(device: "torch.device", quick: bool) -> dict[str, list[float]] | None:
    """The host's [forward, re-run] seconds per forward kernel of a recomputed layer, per recompute kind
    (`profiler.dispatch`), on a CPU; None on a GPU (priced from `cost_model.host.GPU_RECOMPUTE_S`) or, saying
    why, where the timed block cannot run."""
    from autoplan.profiler.dispatch import measure_recompute_host_s

    if device.type != "cpu":  # an isolated block reads several times what steps pay there (`cost_model.host`)
        return None
    try:
        measured = measure_recompute_host_s(device, quick)
    except Exception as exc:  # an optional measurement: report it, keep the rest of the profile
        print(f"recompute host cost skipped: {type(exc).__name__}: {exc}; the cost model keeps its default")
        return None
    print("recompute host cost per forward kernel, forward + re-run: "
          + ", ".join(f"{k} {f * 1e6:.1f} + {r * 1e6:.1f} us" for k, (f, r) in measured.items()))
    return {kind: list(pair) for kind, pair in measured.items()}


def run_profile(device: "torch.device", quick: bool = False, dtype: str | None = None, collectives: bool = True,
                kernels: bool = True, fsdp_units: bool = False) -> HardwareProfile | None:
    """Measure and return the profile on rank 0 (None on the other ranks); needs every rank to call it
    when a process group is initialised. `kernels`: time the fused Triton kernels too, where they run
    (`kernel_samples`; printed when skipped)."""
    import torch
    import torch.distributed as dist

    from autoplan.profiler.collectives import measure_collectives
    from autoplan.profiler.fsdp import measure_fsdp_unit_s

    distributed = dist.is_initialized() and dist.get_world_size() > 1
    rank = dist.get_rank() if distributed else 0
    own = _measure_device(device, quick, dtype, kernels)
    if distributed:
        own = slowest_rank(own)
    host, host_phases = (host_dispatch_s(device, quick) if rank == 0 else (None, None)) if own["host"] is None \
        else (own["host"], None)
    adamw = optimizer_rate(device, quick) if rank == 0 else None
    optimizer_host = optimizer_host_s(device, quick) if rank == 0 else None
    rerun = recompute_host_s(device, quick) if rank == 0 else None
    fused, why = kernel_samples(device, quick, dtype) if rank == 0 and kernels else ((), None)
    if own["eager_kernels"]:  # a CPU: the torch fallbacks, timed on every rank at once
        fused, why = own["eager_kernels"], None
    if why is not None:
        print(f"fused-kernel efficiencies skipped: {why}; the cost model keeps its assumed efficiencies")
    samples, fits, fsdp_unit_s, (sync_s, skew), overlap = (), (), None, (None, None), None
    if distributed and collectives:
        dist.barrier()  # the other ranks wait here while rank 0 times the fused kernels
        samples, fits = measure_collectives(device, quick=quick)
        sync_s, skew = in_step_sync_s(device, fits, quick, rank)
        overlap = overlapped_cost(device, quick, rank)
        fsdp_unit_s = measure_fsdp_unit_s(device, fits, quick=quick) if fsdp_units else None
    if rank != 0:
        return None
    return HardwareProfile(
        device_name=local_device_name(device.type, device.index or 0),
        device_kind=device.type,
        memory_bytes=_memory_bytes(device),
        threads=torch.get_num_threads(),
        torch_version=torch.__version__,
        created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        gemm=own["gemm"],
        memory=own["memory"],
        collective_backend=str(dist.get_backend()) if samples else "",
        collectives=samples,
        fits=fits,
        kernels=fused,
        kernel_floor_s=own["floor"],
        host_kernel_s=host,
        host_phase_kernel_s=host_phases,
        adamw_bytes_per_s=adamw,
        optimizer_host_s=optimizer_host,
        host_recompute_s=rerun,
        fsdp_unit_s=fsdp_unit_s,
        collective_sync_s=sync_s,
        collective_skew=skew,
        overlap_cost=overlap,
        fresh_copies=own["fresh_copies"],
        attention=own["attention"],
    )


def in_step_sync_s(device: "torch.device", fits: tuple, quick: bool, rank: int) -> tuple[float | None, float | None]:
    """(s, c): what a blocking collective costs inside a step beyond its fit, s + c sqrt(compute before it)
    (`profiler.collectives.collective_sync_s`), on a CPU, every rank at once; Nones on CUDA (not measured
    there) or without an all-reduce fit."""
    from autoplan.profiler.collectives import collective_sync_s

    if device.type != "cpu" or not any(f.kind == "all_reduce" for f in fits):
        return None, None
    sync_s, skew, samples = collective_sync_s(fits, device, quick)
    if rank == 0:
        print("collective inside a step, beyond its fit (compute ms, message bytes: extra ms): "
              + ", ".join(f"{c * 1e3:.2f}, {b}: {e * 1e3:.3f}" for c, b, e in samples)
              + f"; fit {sync_s * 1e3:.3f} ms + {skew * 1e3 / 1e3 ** 0.5:.3f} ms x sqrt(compute ms)")
    return sync_s, skew


def overlapped_cost(device: "torch.device", quick: bool, rank: int) -> float | None:
    """The share of an overlapped all-reduce's time its compute loses (`profiler.collectives.overlap_cost`),
    on a CPU, every rank at once; None on CUDA (not measured there)."""
    from autoplan.profiler.collectives import overlap_cost

    if device.type != "cpu":
        return None
    share, (alone, reduced, paired) = overlap_cost(device, quick)
    if rank == 0:
        print(f"all-reduce overlapped with compute: compute {alone * 1e3:.1f} ms, all-reduce {reduced * 1e3:.1f} ms, "
              f"both {paired * 1e3:.1f} ms: the compute loses {share:.0%} of the all-reduce's time")
    return share


def slowest_rank(measured: dict) -> dict:
    """`_measure_device`'s figures with each time the largest over the ranks (every rank measured the same
    shapes in the same order): per sample of a tuple, the sample; a number, the number."""
    import torch.distributed as dist

    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, measured)

    def slowest(values):
        if values[0] is None or isinstance(values[0], float):
            return None if values[0] is None else max(values)
        if isinstance(values[0], tuple):
            return tuple(slowest(same) for same in zip(*values))
        return max(values, key=lambda s: getattr(s, "time_s", None) or s.fwd_s + s.bwd_s)

    return {key: slowest([ranks[key] for ranks in everyone]) for key in measured}


def render_profile(profile: HardwareProfile, console=None) -> None:
    """Print what was measured: GEMM range, memory bandwidth, one row per collective fit."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    table = Table(title=f"autoplan profile: {profile.device_name} ({profile.device_kind})", show_header=False, title_justify="left")
    table.add_column("what", style="bold")
    table.add_column("value")
    table.add_row("torch", f"{profile.torch_version}, {profile.threads} CPU threads, {profile.created}")
    for dtype in sorted({s.dtype for s in profile.gemm}):
        samples = sorted((s for s in profile.gemm if s.dtype == dtype), key=lambda s: s.flops_per_s)
        low, high = samples[0], samples[-1]
        median = statistics.median(s.flops_per_s for s in samples)
        table.add_row(f"GEMM {dtype} ({len(samples)} shapes)",
                      f"{_tflops(low.flops_per_s)} at {_shape(low)} .. median {_tflops(median)} .. {_tflops(high.flops_per_s)} at {_shape(high)}")
    table.add_row("memory bandwidth", f"{profile.memory.bandwidth_bytes_per_s / 1e9:,.1f} GB/s (copy of {profile.memory.buffer_bytes / 2**20:,.0f} MiB)")
    if profile.kernel_floor_s is not None:
        table.add_row("launch floor", f"{profile.kernel_floor_s * 1e6:,.1f} us per back-to-back kernel (the least any "
                      f"kernel is priced at)")
    if profile.host_kernel_s is not None:
        table.add_row("host dispatch", f"{profile.host_kernel_s * 1e6:,.1f} us per priced kernel (a small layer's forward + "
                      f"backward, `profiler.dispatch`)")
    if profile.host_phase_kernel_s:
        forward, backward = profile.host_phase_kernel_s
        table.add_row("host dispatch by pass", f"forward {forward * 1e6:,.1f} us, backward {backward * 1e6:,.1f} us per "
                      f"priced kernel")
    if profile.adamw_bytes_per_s is not None:
        table.add_row("AdamW step", f"{profile.adamw_bytes_per_s / 1e9:,.1f} GB/s of the bytes it moves "
                      f"(`profiler.memory.measure_adamw_rate`)")
    if profile.optimizer_host_s is not None:
        per_step, per_tensor = profile.optimizer_host_s
        table.add_row("optimizer host", f"{per_step * 1e3:,.3f} ms + {per_tensor * 1e6:,.2f} us per tensor exposed per "
                      f"step (`profiler.memory.measure_optimizer_host_s`)")
    if profile.host_recompute_s:
        table.add_row("recompute host", ", ".join(f"{k} {f * 1e6:,.1f} + {r * 1e6:,.1f} us"
                                                  for k, (f, r) in profile.host_recompute_s.items())
                      + " per forward kernel of a recomputed layer, forward + re-run (`profiler.dispatch`)")
    if profile.fresh_copies:
        curve = ", ".join(f"{m.buffer_bytes / 2**20:,.0f} MiB {m.bandwidth_bytes_per_s / 1e9:,.1f}"
                          for m in profile.fresh_copies)
        table.add_row("fresh-allocation copy", f"GB/s by size: {curve}")
    for a in profile.attention:
        table.add_row(f"causal SDPA ({a.batch_heads}, {a.seq}, {a.head_dim}) {a.dtype}",
                      f"forward {_tflops(a.flops / a.fwd_s)}, backward {_tflops(2 * a.flops / a.bwd_s)} (full FLOPs)")
    if profile.kernels:
        from autoplan.cost_model.kernels import pass_efficiencies

        effs = ", ".join(f"{k} {d} " + "/".join(f"{e:.0%}" for _, e in points)
                         for k, d, points in pass_efficiencies(profile))
        which = "fused kernels" if profile.device_kind == "cuda" else "kernels as torch runs them"
        table.add_row(f"{which} ({len(profile.kernels)} samples)", f"of copy bandwidth: {effs}")
    if profile.fsdp_unit_s is not None:
        table.add_row("FSDP2 unit", f"{profile.fsdp_unit_s * 1e6:,.1f} us per unit and microbatch beyond its calls' "
                      f"fitted latencies (hooks, fixed copies)")
    if profile.collective_sync_s is not None:
        skew = (f" + {profile.collective_skew * 1e3 / 1e3 ** 0.5:,.3f} ms x sqrt(the compute before it, ms)"
                if profile.collective_skew else "")
        table.add_row("collective in a step", f"{profile.collective_sync_s * 1e6:,.1f} us{skew} per blocking call beyond "
                      f"its fit, between compute (ranks out of step; `profiler.collectives`)")
    if profile.overlap_cost is not None:
        table.add_row("collective beside compute", f"the compute loses {profile.overlap_cost:.0%} of an overlapped "
                      f"all-reduce's time (`profiler.collectives.overlap_cost`)")
    for fit in profile.fits:
        table.add_row(f"{fit.kind} x{fit.group_size} ({profile.collective_backend})",
                      f"bus bandwidth {fit.bandwidth_bytes_per_s / 1e9:,.3f} GB/s, latency {fit.latency_s * 1e6:,.1f} us, "
                      f"max error {fit.max_rel_error * 100:.0f}% over {fit.num_samples} sizes")
    console.print(table)


def _tflops(flops_per_s: float) -> str:
    return f"{flops_per_s / 1e12:,.1f} TFLOP/s" if flops_per_s >= 1e12 else f"{flops_per_s / 1e9:,.1f} GFLOP/s"


def _shape(sample) -> str:
    return f"({sample.m}, {sample.n}, {sample.k})"


def cmd_profile(args) -> int:
    """Run `autoplan profile` with parsed `args`; rank 0 prints and writes. Returns the exit status."""
    import torch
    import torch.distributed as dist

    check_output_file(args.output, "profile output -o")  # before minutes of measuring, not after
    device = _device(args.device)
    if args.threads is not None:
        if args.threads < 1:
            raise ConfigError(f"--threads must be a positive integer, got {args.threads}")
        torch.set_num_threads(args.threads)
    made_group = _init_distributed(device)
    try:
        profile = run_profile(device, quick=args.quick, dtype=args.dtype, collectives=not args.no_collectives,
                              kernels=not args.no_kernels, fsdp_units=args.fsdp_units)
        if profile is not None:
            if not profile.collectives and not args.no_collectives:
                print("collectives skipped: one process (run under torchrun --nproc-per-node N to measure them)")
            render_profile(profile)
            profile.save(args.output)
            print(f"profile written to {args.output}")
        if dist.is_initialized():
            dist.barrier()  # no rank tears the group down while a peer's last collective is in flight
    finally:
        if made_group:
            dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m autoplan.profiler.cli [options]` (also under torchrun), before the main CLI wires it."""
    parser = argparse.ArgumentParser(prog="autoplan")
    sub = parser.add_subparsers(dest="command")
    add_profile_parser(sub)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv if argv[:1] == ["profile"] else ["profile", *argv])
    try:
        return cmd_profile(args)
    except AutoplanError as exc:
        print(f"autoplan profile: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
