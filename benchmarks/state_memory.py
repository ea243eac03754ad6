"""Model-state memory: the parameter, gradient and optimizer bytes a plan predicts per rank against what
the run holds, on CPU gloo ranks, under each precision (`autoplan.plan.PRECISIONS`) and ZeRO stage.

    python benchmarks/state_memory.py                    # the grid (about a minute)
    python benchmarks/state_memory.py --cases zero1      # rows whose id holds every word

Grid: memory_fidelity's Llama (4 layers, hidden 256, 4 kv heads) on 2 data-parallel ranks x ZeRO 0, 1, 3
x float32, bfloat16 under autocast (fp32 parameters) and bf16-master (bf16 parameters, fp32 masters).
Each rank builds its program (`parallelize`), makes AdamW (`make_optimizer`) and takes two steps of 2
microbatches; it measures, summing distinct storages (a DTensor's local ones):

    weights    its parameters, plus the weight copies one forward saves for backward
               (`memory_probe.measure_saved_bytes`' copied_bytes: autocast's bf16 copies)
    gradients  at the end of the second step's backward (when `GradSync.finish` begins: the
               parameters' .grad, the fp32 main gradients, the buckets' flat and reduced buffers;
               FSDP2: the sharded .grad after the step)
    optimizer  after the step: the optimizer's state tensors and the fp32 master slices

against `plan.predicted.memory` (`cost_model.memory.model_state_bytes`). Writes
benchmarks/out/state_memory.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).parent))
from memory_fidelity import _free_port, bench_models  # noqa: E402 - the same models, run the same way

OUT = Path(__file__).parent / "out"
TOLERANCE = 0.05
PRECISIONS = {"float32": ("float32", "autocast"), "autocast": ("bfloat16", "autocast"),
              "bf16-master": ("bfloat16", "bf16-master")}
SEQ, MICROBATCHES = 256, 2


def cases(words: list[str]) -> list[tuple[str, int, str]]:
    found = [(f"llama dp2 zero{z} {p}", z, p) for z in (0, 1, 3) for p in PRECISIONS]
    return [c for c in found if all(w in c[0].split() for w in words)]


def make_plan(zero: int, precision: str):
    from autoplan.api import capture_model, plan_from_assignment
    from autoplan.cluster import parse_cluster
    from autoplan.mesh import MeshShape

    dtype, scheme = PRECISIONS[precision]
    config = bench_models()["llama"]
    graph = capture_model(config, SEQ, dtype)
    return config, plan_from_assignment(graph, config, parse_cluster("2xcpu"), MeshShape(dp=2), {}, 1, MICROBATCHES,
                                        zero, "none", dtype=dtype, precision=scheme)


def _bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (a DTensor's local tensor's)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        while hasattr(t, "_local_tensor"):
            t = t._local_tensor
        storage = t.untyped_storage()
        seen[storage._cdata] = storage.nbytes()
    return sum(seen.values())


def _gradient_bytes(program) -> int:
    sync = program.grad_sync
    held = [p.grad for _, p in program.named_local_parameters()]
    if sync is not None:
        held += list((sync.main or {}).values())
        held += [t for b in sync.buckets for t in (b.flat, b.received)]
    return _bytes(held)


def _rank(rank: int, world: int, port: int, zero: int, precision: str, out: str) -> None:
    from autoplan.models import build_model
    from autoplan.runtime.launch import parallelize
    from autoplan.runtime.memory_probe import measure_saved_bytes

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        config, plan = make_plan(zero, precision)
        program = parallelize(build_model(config, device="meta"), None, plan, config=config)
        optimizer = program.make_optimizer(torch.optim.AdamW, lr=1e-4)
        tokens = torch.randint(0, config.vocab, (plan.global_batch, SEQ), generator=torch.Generator().manual_seed(0))
        targets = tokens.roll(-1, dims=1)
        mine = program.shard_batch(tokens, targets)
        rows = [t[:plan.microbatch_size] for t in mine]
        with program._autocast():
            _, measured = measure_saved_bytes(lambda: program(*rows), program, backward=False)
        grads = []
        if program.grad_sync is not None:
            finish = program.grad_sync.finish
            program.grad_sync.finish = lambda: (grads.append(_gradient_bytes(program)), finish())[1]
        for _ in range(2):
            program.train_step(tokens, targets, optimizer)
        if program.grad_sync is None:  # FSDP2: the sharded gradients the step left
            grads.append(_gradient_bytes(program))
        inner = getattr(optimizer, "optim", optimizer)
        states = [v for state in inner.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
        masters = [b.master for b in program.grad_sync.buckets] if program.grad_sync is not None else []
        found = {"weights": _bytes(p for _, p in program.named_local_parameters()) + measured.copied_bytes,
                 "copies": measured.copied_bytes, "gradients": grads[-1], "optimizer": _bytes(states + masters)}
        memory = plan.predicted.memory
        found["predicted"] = {"weights": memory.parameters_bytes, "gradients": memory.gradients_bytes,
                              "optimizer": memory.optimizer_bytes}
        torch.save(found, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def run_case(case: tuple) -> dict:
    cid, zero, precision = case
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_rank, args=(2, _free_port(), zero, precision, out), nprocs=2, join=True,
                           start_method="spawn")
        ranks = [torch.load(Path(out) / f"rank{r}.pt") for r in range(2)]
    row = {"id": cid, "zero": zero, "precision": precision, "ranks": ranks}
    row["errors"] = {k: max(abs(r["predicted"][k] / r[k] - 1) for r in ranks) for k in ("weights", "gradients", "optimizer")}
    return row


def table(rows: list[dict]) -> str:
    lines = [f"{'case':34} " + "  ".join(f"{k + ' MB (pred/meas)':>28}" for k in ("weights", "gradients", "optimizer"))]
    for row in rows:
        r = row["ranks"][0]
        cells = [f"{r['predicted'][k] / 1e6:8.3f} {r[k] / 1e6:8.3f} {row['errors'][k]:+7.2%}" for k in
                 ("weights", "gradients", "optimizer")]
        lines.append(f"{row['id']:34} " + "  ".join(f"{c:>28}" for c in cells))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="*", default=[], help="run the cases whose id holds every word")
    args = parser.parse_args(argv)
    rows = [run_case(case) for case in cases(args.cases)]
    if not rows:
        sys.exit(f"no case id holds every word of {args.cases}")
    worst = max(e for row in rows for e in row["errors"].values())
    within = sum(e <= TOLERANCE for row in rows for e in row["errors"].values())
    summary = {"cases": len(rows), "checks": 3 * len(rows), "within_5pct": within, "largest_error": worst}
    OUT.mkdir(exist_ok=True)
    command = " ".join(["python benchmarks/state_memory.py", *(["--cases", *args.cases] if args.cases else [])])
    (OUT / "state_memory.json").write_text(json.dumps({"summary": summary, "rows": rows, "command": command},
                                                      indent=1) + "\n")
    print(table(rows))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
