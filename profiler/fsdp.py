"""FSDP2's fixed cost per unit: what `fully_shard` adds to a step beyond its collectives' bytes.

ZeRO 3 runs on FSDP2 (`runtime.zero`): per unit and microbatch, one all-gather before its forward, one
all-gather and one reduce-scatter in its backward, each wrapped in FSDP2's hooks (pre/post forward and
backward, the copy-in of the shard, the copy-out into the unsharded parameters, the reduce-scatter's
input and output copies, the resharding). The cost model prices the collectives' bytes and copies from
the profile's fits and copy bandwidth (`cost_model.step`); this measures the rest, which a unit pays
whatever its size:

    fsdp_unit_s = (step_s(fsdp) - step_s(plain)) / UNITS - (latency_s(all_gather) * 2 + latency_s(reduce_scatter))

with step_s the slowest rank's fastest window of one forward + backward of UNITS tiny linear layers
(64 x 64: their bytes are nil), plain or each `fully_shard`ed over the world (reshard_after_forward,
as ZeRO 3), and latency_s the profile's alpha-beta fits of those collectives over the world (what the
cost model already prices per call), floored at 0. Windows start after a world barrier. On a CPU they
are timed by the process's CPU time (every thread: the hooks and copies on the compute thread, gloo's
on its own), which other jobs on a shared machine do not stretch: by wall clock, one profile at a load
average of 16 on the 2-core development machine read 22 ms per unit. On CUDA: events, as the
collectives (`profiler.collectives`).

On that machine (2 gloo ranks, 2026-11-26, load average about 11): 1.6 ms of CPU per unit and step
(16 units: 27 ms against 0.5 ms plain), about four times the three calls' fitted latencies (0.4 ms);
profiles there read 1.2 ms (load 3 to 7) and 1.9 ms (load 13 to 23) per unit beyond those latencies.
"""

from __future__ import annotations

import gc
import time

import torch
import torch.distributed as dist
from torch import nn

from autoplan.profiler.collectives import _World
from autoplan.profiler.gemm import WARMUP_CALLS, plan_windows, timed_windows_s
from autoplan.profiler.profile import CollectiveFit

UNITS = 8
WIDTH = 64


def _step_fn(device: torch.device, group=None):
    """One forward + backward of UNITS linear layers, each its own FSDP2 unit over `group` when given."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH, device=device) for _ in range(UNITS)])
    if group is not None:
        mesh = DeviceMesh.from_group(group, device.type)
        for layer in model:
            fully_shard(layer, mesh=mesh, reshard_after_forward=True)
        fully_shard(model, mesh=mesh, reshard_after_forward=True)
    x = torch.randn(8, WIDTH, device=device)
    return lambda: model(x).sum().backward()


def _step_s(fn, world: _World, budget_s: float) -> float:
    """The slowest rank's fastest window per step (the process's CPU time on a CPU); every rank runs
    the same windows."""
    clock = time.process_time if world.device.type == "cpu" else time.perf_counter
    for _ in range(WARMUP_CALLS):
        fn()
    one_call_s = world.max(timed_windows_s(fn, world.device, 1, 1, before=world.barrier, clock=clock)[0])
    repeats, inner = plan_windows(one_call_s, budget_s)
    return world.max(min(timed_windows_s(fn, world.device, repeats, inner, before=world.barrier, clock=clock)))


def fitted_latency_s(fits: tuple[CollectiveFit, ...], group_size: int) -> float:
    """Fitted latency of one unit's three calls on `group_size` ranks (2 all-gathers, 1 reduce-scatter);
    a kind without a fit of that size counts 0."""
    latency = {f.kind: f.latency_s for f in fits if f.group_size == group_size}
    return 2 * latency.get("all_gather", 0.0) + latency.get("reduce_scatter", 0.0)


def measure_fsdp_unit_s(device: torch.device, fits: tuple[CollectiveFit, ...], quick: bool = False,
                        budget_s: float | None = None) -> float:
    """Seconds FSDP2 adds per unit and microbatch beyond the fitted latencies of its calls (module
    docstring); every rank of the world calls it and gets the same answer."""
    budget_s = budget_s if budget_s is not None else (0.05 if quick else 0.2)
    world = _World(device)
    plain_s = _step_s(_step_fn(device), world, budget_s)
    # FSDP2 on a group of its own, destroyed once its modules are freed (they form reference cycles).
    # Known problem: a 2-rank gloo run of `autoplan profile --fsdp-units` still aborts at exit about 1
    # time in 8 ("terminate called without an active exception"; 1 in 4 on the world group), which is
    # why the CLI measures this only when asked
    group = dist.new_group(list(range(dist.get_world_size())))
    sharded_s = _step_s(_step_fn(device, group), world, budget_s)
    gc.collect()
    world.barrier()
    dist.destroy_process_group(group)
    per_unit = (sharded_s - plain_s) / UNITS
    return max(0.0, per_unit - fitted_latency_s(fits, dist.get_world_size()))
