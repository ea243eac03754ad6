"""Timers around the runtime's blocking collectives in real training steps (issue 20): how long a step's
collectives take inside the step against what the profile's fits price for them.

    python benchmarks/step_collectives.py PROFILE.json                 # the Llama of step_fidelity.py
    python benchmarks/step_collectives.py PROFILE.json --family gpt
    python benchmarks/step_collectives.py PROFILE.json --plans cp2 "dp2 zero0"

On 2 gloo ranks (one CPU thread each), the step_fidelity.py plans dp2 ZeRO 0, tp2 Megatron, dp2 ZeRO 3 and
tp2 Megatron with sequence parallelism are compiled by `autoplan.parallelize` and run for 6 steps (the first
discarded), with torch.distributed's collectives wrapped by a wall-clock timer (blocking calls only: an
`async_op` call returns at once and is waited on elsewhere). Per plan, the medians over steps of rank 0's: step
wall time, main-thread CPU time, blocking calls, seconds inside them, and the profile's fitted seconds of the
same calls (`CollectiveCalibration`, the message as `profiler.collectives` counts it: the full buffer). The
difference per call is what a call costs inside a step beyond its back-to-back time, against which the
profile's `collective_sync_s` (a GEMM then an all-reduce, `profiler.collectives`) can be checked.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).parent))
import step_fidelity as sf  # noqa: E402

PLANS = ("dp2 zero0", "tp2 megatron", "dp2 zero3", "tp2 megatron sp")
# torch.distributed's names -> (the profile's kind, whether the first argument is a shard of the full message)
WRAPPED = {"all_reduce": ("all_reduce", False), "all_gather": ("all_gather", False), "all_gather_single": ("all_gather", False),
           "all_gather_into_tensor": ("all_gather", False), "reduce_scatter_single": ("reduce_scatter", True),
           "reduce_scatter_tensor": ("reduce_scatter", True), "all_to_all_single": ("all_to_all", False)}


def wrap_collectives(log: list) -> None:
    """Replace torch.distributed's collectives with timed ones that append (kind, seconds, full bytes)."""
    for name, (kind, shard) in WRAPPED.items():
        inner = getattr(dist, name, None)
        if inner is None:
            continue

        def timed(*args, _inner=inner, _kind=kind, _shard=shard, **kwargs):
            start = time.perf_counter()
            out = _inner(*args, **kwargs)
            if not kwargs.get("async_op"):
                first = args[0] if args else kwargs.get("tensor", kwargs.get("output", kwargs.get("tensor_list")))
                parts = first if isinstance(first, (list, tuple)) else [first]  # gloo's list form: the full output
                nbytes = sum(t.numel() * t.element_size() for t in parts if isinstance(t, torch.Tensor))
                log.append((_kind, time.perf_counter() - start, nbytes * (dist.get_world_size() if _shard else 1)))
            return out
        setattr(dist, name, timed)


def _rank(rank: int, port: int, config, plans: dict, out: str) -> None:
    sf.join_gloo(rank, sf.WORLD, port)
    import autoplan
    from autoplan.models import build_model

    log: list = []
    wrap_collectives(log)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(config.vocab, (sf.BATCH, sf.SEQ), generator=gen)
    targets = torch.randint(config.vocab, (sf.BATCH, sf.SEQ), generator=gen)
    results = {}
    for name, plan in plans.items():
        program = autoplan.parallelize(build_model(config), plan.cluster, plan, config=config, seed=sf.SEED)
        optimizer = program.make_optimizer(torch.optim.AdamW, lr=sf.LR)
        steps = []
        for i in range(6):
            dist.barrier()
            log.clear()
            start, start_cpu = time.perf_counter(), time.thread_time()
            program.train_step(tokens, targets, optimizer)
            if i:
                steps.append({"wall_s": time.perf_counter() - start, "main_s": time.thread_time() - start_cpu,
                              "calls": list(log)})
        results[name] = steps
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    from autoplan.api import capture_model
    from autoplan.cost_model.calibration import CollectiveCalibration
    from autoplan.profiler.profile import HardwareProfile

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("profile", type=Path)
    parser.add_argument("--family", choices=("llama", "gpt"), default="llama")
    parser.add_argument("--plans", nargs="+", default=PLANS, metavar="PLAN",
                        help=f"step_fidelity.py plans by name (default: {', '.join(PLANS)})")
    args = parser.parse_args(argv)
    profile, config = HardwareProfile.load(args.profile), sf.families()[args.family]
    graph, specs = capture_model(config, sf.SEQ, sf.DTYPE), {s.name: s for s in sf.plan_specs(False)}
    unknown = sorted(set(args.plans) - set(specs))
    if unknown:
        parser.error(f"unknown plans {unknown}; step_fidelity.py's are: {', '.join(specs)}")
    plans = {name: sf.price(config, specs[name], profile, graph) for name in args.plans}
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "steps.json")
        mp.start_processes(_rank, args=(sf._free_port(), config, plans, out), nprocs=sf.WORLD, start_method="spawn")
        results = json.loads(Path(out).read_text())
    fits = CollectiveCalibration(profile)
    print(f"{args.family}: profile {args.profile} (collective_sync_s {profile.collective_sync_s})")
    for name, steps in results.items():
        def median(fn):
            return statistics.median(fn(s) for s in steps)
        calls = median(lambda s: len(s["calls"]))
        inside = median(lambda s: sum(t for _, t, _ in s["calls"]))
        fitted = median(lambda s: sum(fits.time_s(k, b, sf.WORLD) or 0.0 for k, _, b in s["calls"]))
        print(f"{name:18s} wall {median(lambda s: s['wall_s']):.3f} s, main thread {median(lambda s: s['main_s']):.3f} s, "
              f"{calls:.0f} blocking calls, {inside:.3f} s inside them against {fitted:.3f} s fitted: "
              f"{(inside - fitted) / max(calls, 1) * 1e3:.2f} ms per call beyond the fits")


if __name__ == "__main__":
    main()
