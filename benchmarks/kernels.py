"""Triton kernels against torch eager and torch.compile: time, achieved bandwidth, % of copy.

    python benchmarks/kernels.py                         # every kernel, bf16, on the local GPU
    python benchmarks/kernels.py --kernels rms_norm cross_entropy --markdown
    python benchmarks/kernels.py --markdown --json benchmarks/out/kernels.json --profile h200.json
    python benchmarks/kernels.py --dry-run               # CPU: tiny shapes, torch path only

For each kernel, pass (fwd, bwd) and shape, three variants of the same maths:

    triton    autoplan.runtime.kernels, backend="triton"
    eager     the module's torch reference (the CPU path), backend="torch"
    compile   torch.compile of that reference (cross_entropy: of F.cross_entropy on fp32 logits)

The shapes, the byte formulas (`BYTES`: the least HBM traffic of each pass) and the timing loop
(median of CUDA-event windows after warm-up) are `autoplan.profiler.kernels`, which
`autoplan profile` also runs to put the Triton kernels' efficiencies into the hardware profile.
Bandwidth is `bytes / time_s`, an effective bandwidth comparable across variants. `%copy` is that
bandwidth over the device-to-device copy bandwidth measured here first (`autoplan.profiler.memory`:
2 * buffer_bytes / time of a 1 GiB copy), the same ratio the cost model uses as a kernel's
efficiency (`autoplan.cost_model.kernels`).

Goal (issue 7): every kernel >= 80% of copy bandwidth, faster than eager everywhere, not slower
than torch.compile. `--json PATH` writes the rows; `--profile PATH` writes the Triton rows into an
existing hardware profile of this device (`autoplan profile -o PATH` made it), so that
`autoplan search --profile PATH` prices the fused kernels at what was measured here.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
from dataclasses import asdict, replace
from pathlib import Path

import torch

from autoplan.profiler.kernels import BYTES, DTYPES, SHAPES, Row, bench, samples
from autoplan.runtime import kernels as K

__all__ = ["BYTES", "SHAPES", "Row", "main", "table"]
DRY_RUN_DIVISOR = 64  # --dry-run divides every size but head_dim / experts / top_k by this


# ---------------------------------------------------------------------------- output


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def table(rows: list[Row], variants: list[str], copy_gbps: float, markdown: bool) -> str:
    head = ["kernel", "pass", "shape", "MB"]
    for v in variants:
        head += [f"{v} us", f"{v} GB/s", f"{v} %copy"]
    head += [f"x{v}" for v in variants if v != "triton"]  # speedup of triton over v
    lines = []
    for r in rows:
        cells = [r.kernel, r.pass_, r.shape, f"{r.bytes / 1e6:,.0f}"]
        for v in variants:
            t, g = r.time_s.get(v), r.gbps(v)
            cells += [_fmt(t and t * 1e6, ",.0f"), _fmt(g, ",.0f"),
                      _fmt(g and 100 * g / copy_gbps, ".0f")]
        base = r.time_s.get("triton")
        cells += [_fmt(base and r.time_s.get(v) and r.time_s[v] / base, ".2f")
                  for v in variants if v != "triton"]
        lines.append(cells)
    if markdown:
        out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        return "\n".join(out + ["| " + " | ".join(c) + " |" for c in lines])
    widths = [max(len(x) for x in col) for col in zip(head, *lines)]
    fmt = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))  # noqa: E731
    return "\n".join([fmt(head), fmt(["-" * w for w in widths])] + [fmt(c) for c in lines])


def _device_line(device: torch.device) -> str:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
    triton = K.dispatch.load_triton()
    return (f"{datetime.date.today()}  {name or device.type}  torch {torch.__version__}  "
            f"triton {triton[0].__version__ if triton else 'absent'}")


def copy_bandwidth_gbps(device: torch.device, dry_run: bool) -> float:
    from autoplan.profiler.memory import measure_memory_bandwidth
    sample = (measure_memory_bandwidth(device, buffer_bytes=1 << 20, budget_s=0.02) if dry_run
              else measure_memory_bandwidth(device))
    return 2 * sample.buffer_bytes / sample.time_s / 1e9


def write_profile(path: Path, rows: list[Row], dtype: str, device: torch.device) -> None:
    """Put the Triton rows into the hardware profile at `path` (measured on this device), in place
    of its samples of the kernels run here."""
    from autoplan.profiler.profile import HardwareProfile, local_device_name

    profile = HardwareProfile.load(path, expect_device=local_device_name("cuda", device.index or 0))
    new = samples(rows, dtype)
    kept = tuple(k for k in profile.kernels if k.kernel not in {s.kernel for s in new})
    replace(profile, kernels=kept + new).save(path)
    print(f"{len(new)} kernel samples written to the profile {path}")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernels", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    parser.add_argument("--budget-s", type=float, default=0.2, help="timed seconds per variant")
    parser.add_argument("--markdown", action="store_true", help="a table for the README")
    parser.add_argument("--json", type=Path, help="write the rows here")
    parser.add_argument("--profile", type=Path, metavar="PROFILE",
                        help="write the Triton rows into this hardware profile (of this GPU)")
    parser.add_argument("--dry-run", action="store_true",
                        help=f"CPU, shapes / {DRY_RUN_DIVISOR}, torch eager only: checks the "
                             f"script, measures nothing")
    return parser


def _cuda_missing() -> str | None:
    if not torch.cuda.is_available():
        return ("benchmarks/kernels.py measures Triton kernels on a CUDA GPU, and "
                "torch.cuda.is_available() is False here. Run it on the GPU machine, or use "
                "--dry-run to check the script on CPU.")
    if K.dispatch.load_triton() is None:
        return "triton is not installed: pip install 'autoplan[triton]'"
    return None


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    dtype = getattr(torch, DTYPES[args.dtype])
    if args.dry_run:
        device, variants, dtype = torch.device("cpu"), ["eager"], torch.float32
    else:
        if (why := _cuda_missing()) is not None:
            print(why, file=sys.stderr)
            return 2
        device = torch.device("cuda")
        variants = ["triton", "eager"] + ([] if args.no_compile else ["compile"])
    copy_gbps = copy_bandwidth_gbps(device, args.dry_run)
    rows = []
    for kernel in args.kernels:
        for s in SHAPES[kernel]:
            if args.dry_run:
                s = {k: v if k in ("head_dim", "experts", "top_k") else max(2, v // DRY_RUN_DIVISOR)
                     for k, v in s.items()}
            rows += bench(kernel, s, device, dtype, variants, args.budget_s)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    print(f"{_device_line(device)}  {args.dtype if not args.dry_run else 'fp32'}  copy "
          f"{copy_gbps:,.1f} GB/s{'  (dry run: timings mean nothing)' if args.dry_run else ''}")
    print(table(rows, variants, copy_gbps, args.markdown))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"device": _device_line(device), "copy_gbps": copy_gbps,
                                         "rows": [asdict(r) for r in rows]}, indent=1))
    if args.profile and not args.dry_run:
        write_profile(args.profile, rows, DTYPES[args.dtype], device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
