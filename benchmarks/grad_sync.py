"""Gradient sync: buckets overlapped with backward against the sync after backward that the runtime
used to run, and ZeRO 1 as the distributed optimizer against all-reduce + ZeroRedundancyOptimizer.

    python benchmarks/grad_sync.py                  # 2 gloo ranks, small-llama, dp=2
    python benchmarks/grad_sync.py --rounds 6 --steps 3

Model "small-llama" (benchmarks/runtime_overhead.py: 4 layers, hidden 512, vocabulary 8192, 21M
parameters, 84 MB of fp32 gradients), sequences of 256 tokens, global batch 4, dp = 2, fp32, AdamW,
through the zoo's runtime (`autoplan.runtime.launch.parallelize`, plans from the planner). Methods:

    zero0-after     ZeRO 0, one bucket per dtype all-reduced after the whole backward (what
                    runtime/program.py's sync_gradients did): GradSync(overlap=False, one bucket)
    zero0-buckets   ZeRO 0 as it runs now: 25 MiB buckets launched from the gradient hooks
    zero1-zro       ZeRO 1 as it ran: the all-reduce after backward, then torch's
                    ZeroRedundancyOptimizer (steps its share, broadcasts the parameters)
    zero1-sharded   ZeRO 1 as it runs now: buckets reduce-scattered during backward, AdamW on this
                    rank's fp32 slices, parameters all-gathered (grad_sync.ShardedOptimizer)

Steps are timed in rounds that rotate the methods (runtime_overhead.time_alternating: a barrier
before every step, one warm-up step each), so load from other processes hits all alike; the table
gives rank 0's median and quartiles of the wall time per step, and the median time the step waited
for its gradient sync after backward ended (`GradSync.exposed_s`: the part of the sync that did not
hide behind backward), the steadier figure on a loaded machine. Writes benchmarks/out/grad_sync.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).parent))
from runtime_overhead import _free_port, _summary, join_gloo, small_llama, time_alternating  # noqa: E402

OUT = Path(__file__).parent / "out"
WORLD, SEQ, BATCH, SEED, LR = 2, 256, 4, 0, 1e-4


def plans(config) -> dict:
    """dp=2 plans, ZeRO 0 and ZeRO 1, priced by the planner (`estimate`)."""
    from autoplan.api import estimate
    from autoplan.mesh import MeshShape

    return {zero: estimate(config, f"1x{WORLD}xcpu", BATCH, SEQ, mesh=MeshShape(dp=WORLD), microbatch_size=BATCH // WORLD,
                           zero_stage=zero, recompute="none", dtype="float32") for zero in (0, 1)}


def _after_backward(program):
    """A GradSync of the program's parameters that syncs after backward, one bucket per dtype."""
    from autoplan.runtime.grad_sync import GradSync, Replica

    data = program.data
    return GradSync([Replica(p, data.group, data.size) for _, p in program.named_local_parameters()],
                    1.0 / data.size, bucket_bytes=2**62, overlap=False)


def _rank(rank: int, port: int, plans_: dict, rounds: int, steps: int, out: str) -> None:
    join_gloo(rank, WORLD, port)
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from autoplan.models import build_model
    from autoplan.runtime.launch import parallelize

    config = small_llama()
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(config.vocab, (BATCH, SEQ), generator=gen)
    targets = torch.randint(config.vocab, (BATCH, SEQ), generator=gen)
    zero0, old1, zero1 = (parallelize(build_model(config), None, plans_[z], seed=SEED, config=config) for z in (0, 0, 1))
    buckets, after = zero0.grad_sync, _after_backward(zero0)
    old1.grad_sync = _after_backward(old1)
    optimizers = {"zero0": zero0.make_optimizer(torch.optim.AdamW, lr=LR),
                  "zro": ZeroRedundancyOptimizer([p for _, p in old1.named_local_parameters()],
                                                 optimizer_class=torch.optim.AdamW, lr=LR),
                  "sharded": zero1.make_optimizer(torch.optim.AdamW, lr=LR)}

    parts: dict[str, dict[str, list[float]]] = {}

    def timed(name: str, program, sync, optimizer):
        """One step of `program` with `sync`, recording how long it waited for the sync after
        backward."""
        def step() -> float:
            program.grad_sync = sync
            loss = program.train_step(tokens, targets, optimizer)
            parts.setdefault(name, {"sync_wait_s": []})["sync_wait_s"].append(sync.exposed_s())
            return loss
        return step

    methods = {"zero0-after": timed("zero0-after", zero0, after, optimizers["zero0"]),
               "zero0-buckets": timed("zero0-buckets", zero0, buckets, optimizers["zero0"]),
               "zero1-zro": timed("zero1-zro", old1, old1.grad_sync, optimizers["zro"]),
               "zero1-sharded": timed("zero1-sharded", zero1, zero1.grad_sync, optimizers["sharded"])}
    first, times, _ = time_alternating(methods, rounds, steps)
    if rank == 0:
        Path(out).write_text(json.dumps({"first_loss": first, "times": times, "parts": parts,
                                         "buckets": len(buckets.buckets)}))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per round and method")
    args = parser.parse_args(argv)
    config = small_llama()
    plans_ = plans(config)
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "rank0.json")
        mp.start_processes(_rank, args=(_free_port(), plans_, args.rounds, args.steps, out),
                           nprocs=WORLD, start_method="spawn")
        data = json.loads(Path(out).read_text())
    result = {name: {**_summary(t), "sync_wait_median_ms": 1e3 * statistics.median(data["parts"][name]["sync_wait_s"])}
              for name, t in data["times"].items()}
    result["first_loss"] = data["first_loss"]
    result["predicted_step_s"] = {f"zero{z}": p.predicted.step_time_s for z, p in plans_.items()}
    result["config"] = {"model": config.name, "params": config.num_parameters(), "dp": WORLD, "seq": SEQ,
                        "batch": BATCH, "buckets": data["buckets"], "torch": torch.__version__,
                        "cpus": os.cpu_count(), "load_avg": os.getloadavg()}
    for name in data["times"]:
        print(f"{name:14s} median {result[name]['median_ms']:8.1f} ms   "
              f"p25 {result[name]['p25_ms']:8.1f}   p75 {result[name]['p75_ms']:8.1f}   "
              f"sync wait after backward {result[name]['sync_wait_median_ms']:7.1f} ms   ({result[name]['steps']} steps)")
    print(json.dumps({k: result[k] for k in ("first_loss", "predicted_step_s", "config")}, indent=1))
    OUT.mkdir(exist_ok=True)
    (OUT / "grad_sync.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
