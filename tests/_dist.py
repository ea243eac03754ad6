"""Test helpers for the runtime: spawn N gloo processes once and collect what each returns, and
build Plans for the preset models from a strategy assignment (through the planner).

`spawn(fn, world, *args)` runs `fn(rank, world, *args)` in `world` fresh processes (start method
"forkserver", one CPU thread each) with the default gloo group initialised, and returns the list of
their return values (saved with torch.save, so tensors, numbers, strings, lists and dicts). An
exception in any rank fails the call with that rank's traceback.
"""

from __future__ import annotations

import os
import random
import socket
import tempfile
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TIMEOUT_S = 240.0
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "torch.fx", "autoplan.capture",
           "autoplan.planner", "autoplan.runtime.launch"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, out_dir: str, fn, args: tuple) -> None:
    torch.set_num_threads(1)
    path = Path(out_dir) / f"rank{rank}.pt"
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                          WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
        dist.init_process_group("gloo", rank=rank, world_size=world)
        result = fn(rank, world, *args)
        torch.save({"ok": result}, path)
    except BaseException:  # noqa: BLE001 - reported to the parent with the traceback
        torch.save({"error": traceback.format_exc()}, path)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _context():
    """A forkserver that has imported torch and autoplan once: each rank then starts in ~0.1 s
    instead of re-importing (~2-3 s of CPU per process, which 2 cores feel with 4 ranks). The server
    never runs a torch op, so no OpenMP pool is forked."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def spawn(fn, world: int, *args, timeout_s: float = TIMEOUT_S) -> list:
    """Run fn(rank, world, *args) on `world` gloo ranks; return their results in rank order."""
    ctx = _context()
    with tempfile.TemporaryDirectory() as out_dir:
        port = _free_port()
        procs = [ctx.Process(target=_worker, args=(r, world, port, out_dir, fn, args))
                 for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout_s)
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        results, errors = [], []
        for r in range(world):
            path = Path(out_dir) / f"rank{r}.pt"
            if not path.exists():
                errors.append(f"rank {r}: no result (exit code {procs[r].exitcode}"
                              f"{', timed out' if r in hung else ''})")
                continue
            data = torch.load(path, weights_only=False)
            if "error" in data:
                errors.append(f"rank {r}:\n{data['error']}")
            results.append(data.get("ok"))
        if errors:
            raise AssertionError("distributed run failed:\n" + "\n".join(errors))
        return results


# ------------------------------------------------------------------------------- plans


def make_plan(model_name: str, dp: int, tp: int, assignment="replicate", *, seq_len: int = 16,
              microbatch_size: int = 1, num_microbatches: int = 1, zero_stage: int = 0,
              dtype: str = "float32", recompute: str = "none", direct: bool = False):
    """A Plan for a preset model from the planner's `plan_from_assignment`.

    `assignment`: "replicate", "megatron" / "megatron-sp" (the planner's `megatron_assignment`,
    without / with sequence parallelism), "random:<seed>" (a seeded random valid strategy per
    node), or a dict node -> strategy name. `direct=True` builds the Plan from autoplan.plan types
    with zero predictions instead, for meshes the planner refuses but the runtime runs (tp=4 with
    2 kv heads: attention stays replicated)."""
    from autoplan.cluster import parse_cluster
    from autoplan.mesh import MeshShape
    from autoplan.models import get_model_config
    from autoplan.planner import (capture_model, megatron_assignment, model_info,
                                  plan_from_assignment)
    from autoplan.strategies import default_registry

    config = get_model_config(model_name)
    graph = capture_model(config, seq_len, dtype)
    registry, info = default_registry(), model_info(config)
    if isinstance(assignment, dict):
        chosen = assignment
    elif assignment == "replicate":
        chosen = {}
    elif assignment in ("megatron", "megatron-sp"):
        chosen = megatron_assignment(graph, registry, tp, info, assignment == "megatron-sp")
    elif assignment.startswith("random:"):
        rng = random.Random(int(assignment.split(":", 1)[1]))
        chosen = {n.name: rng.choice(registry.strategies(n, tp, info)).name for n in graph.nodes}
    else:
        raise ValueError(f"unknown assignment {assignment!r}")
    cluster, mesh = parse_cluster(f"{dp * tp}xcpu"), MeshShape(dp=dp, tp=tp)
    if direct:
        return _direct_plan(graph, config, cluster, mesh, chosen, registry, info, microbatch_size,
                            num_microbatches, zero_stage, recompute, dtype)
    return plan_from_assignment(graph, config, cluster, mesh, chosen, microbatch_size,
                                num_microbatches, zero_stage, recompute, registry=registry,
                                dtype=dtype)


def _direct_plan(graph, config, cluster, mesh, chosen, registry, info, microbatch_size,
                 num_microbatches, zero_stage, recompute, dtype):
    from autoplan.plan import (MemoryBreakdown, ModelRef, OpPlacement, ParamPlacement, Plan,
                               Predicted, Provenance, StageSpec, TimeBreakdown)

    ops, params = [], []
    for node in graph.nodes:
        strategy = registry.strategy(node, mesh.tp, chosen.get(node.name, "replicate"), info)
        output = (("tp", strategy.output),) if node.output is not None else ()
        ops.append(OpPlacement(node.name, strategy.name, output))
        prefix = node.module_path + "."
        params += [ParamPlacement(n, (("tp", strategy.param_placement(n[len(prefix):])),))
                   for n, _ in node.params]
    zero = Predicted(0.0, 0.0, 0.0, 0.0, MemoryBreakdown(0, 0, 0, 0), TimeBreakdown(0, 0, 0, 0))
    return Plan(ModelRef(config.name, config.fingerprint(), config.num_layers,
                         config.num_parameters()),
                cluster, mesh, microbatch_size, num_microbatches,
                microbatch_size * num_microbatches * mesh.dp, graph.seq_len, zero_stage, recompute,
                "1f1b", (StageSpec(0, 0, config.num_layers),), tuple(params), tuple(ops), zero,
                Provenance("0.1.0", 0.0, "tests/_dist.py"), dtype=dtype)
