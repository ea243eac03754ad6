"""Test helpers for the runtime: spawn N gloo processes once and collect what each returns, and
build Plans for the preset models from a strategy assignment (through the planner).

`spawn(fn, world, *args)` runs `fn(rank, world, *args)` in `world` fresh processes (start method
"forkserver", one CPU thread each) with the default gloo group initialised, and returns the list of
their return values (saved with torch.save, so tensors, numbers, strings, lists and dicts). An
exception in any rank fails the call with that rank's traceback.
"""

from __future__ import annotations

import dataclasses
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
           "autoplan.api", "autoplan.runtime.launch"]


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
            data = torch.load(path, weights_only=True)  # tensors, numbers, strings, lists, dicts: no pickle
            if "error" in data:
                errors.append(f"rank {r}:\n{data['error']}")
            results.append(data.get("ok"))
        if errors:
            raise AssertionError("distributed run failed:\n" + "\n".join(errors))
        return results


# ------------------------------------------------------------------------------- runs


def batches(global_batch: int, seq_len: int, steps: int, vocab: int = 128
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded (steps, global_batch, seq_len) tokens and targets."""
    gen = torch.Generator().manual_seed(global_batch * 1000 + seq_len)
    shape = (steps, global_batch, seq_len)
    return torch.randint(0, vocab, shape, generator=gen), torch.randint(0, vocab, shape,
                                                                        generator=gen)


def reference(config, seed: int, tokens: torch.Tensor, targets: torch.Tensor, lr: float,
              eps: float) -> dict:
    """One process, plain AdamW, the same seeded init: losses per step, the first step's
    gradients, the parameters after the last step."""
    from autoplan.models import build_model
    from autoplan.runtime.init import init_parameters

    model = init_parameters(build_model(config, device="cpu"), seed, config.num_layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, eps=eps)
    losses, grads = [], None
    for step in range(tokens.shape[0]):
        optimizer.zero_grad()
        loss = model(tokens[step], targets[step])
        loss.backward()
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        optimizer.step()
        losses.append(loss.item())
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "grads": grads, "params": params}


def train_program(program, optimizer, tokens: torch.Tensor, targets: torch.Tensor,
                  keep: bool = True) -> dict:
    """Steps of a RankProgram: losses, the first step's full gradients and the final full
    parameters of this rank's stages (only when `keep`; gathering is collective either way), the
    collectives of the first step ("counts") and its global gradient norm ("grad_norm")."""
    losses, grads, counts, grad_norm = [], None, None, None
    for step in range(tokens.shape[0]):
        if step == 0:
            with program.count_collectives() as counted:
                losses.append(program.train_step(tokens[step], targets[step], optimizer))
            counts, grad_norm = dict(counted), program.grad_norm
            grads = program.full_gradients()
        else:
            losses.append(program.train_step(tokens[step], targets[step], optimizer))
    params = program.full_parameters()
    return {"losses": losses, "grads": grads if keep else None, "params": params if keep else None,
            "counts": counts, "grad_norm": grad_norm}


def assert_matches(got: dict, ref: dict, what: str, loss_rtol: float = 1e-5,
                   grad_tol: dict | None = None, param_tol: dict | None = None,
                   grads: bool = True) -> None:
    """Losses, gradients and parameters of one rank against a reference (names this rank holds),
    and the first step's global gradient norm where `got` has one (every rank holds all of it)."""
    grad_tol = grad_tol or dict(rtol=1e-4, atol=1e-6)
    param_tol = param_tol or dict(rtol=1e-4, atol=2e-5)
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]),
                               rtol=loss_rtol, atol=0, msg=f"{what}: losses")
    if got.get("grad_norm") is not None and grads:
        norm = torch.stack([g.double().norm() for g in ref["grads"].values()]).norm().item()
        torch.testing.assert_close(got["grad_norm"], norm, rtol=10 * loss_rtol, atol=0,
                                   msg=f"{what}: gradient norm")
    if got.get("params") is None:
        return
    assert set(got["params"]) <= set(ref["params"]) and got["params"], what
    for name in got["params"]:
        if grads and got.get("grads") is not None:
            torch.testing.assert_close(got["grads"][name], ref["grads"][name], **grad_tol,
                                       msg=lambda m: f"{what} grad {name}: {m}")
        torch.testing.assert_close(got["params"][name], ref["params"][name], **param_tol,
                                   msg=lambda m: f"{what} param {name}: {m}")


# ------------------------------------------------------------------------------- plans


def make_plan(model_name, dp: int, tp: int, assignment="replicate", *, seq_len: int = 16,
              microbatch_size: int = 1, num_microbatches: int = 1, zero_stage: int = 0,
              dtype: str = "float32", recompute: str = "none",
              cp: int = 1, ep: int = 1, pp: int = 1, virtual_stages: int = 1,
              schedule: str | None = None, etp: int | None = None,
              order: tuple[str, ...] | None = None, ep_as: str = "dp",
              stage_layers: tuple[int, ...] | None = None, precision: str = "autocast"):
    """A Plan for a preset model (a name, or a ModelConfig) from the planner's
    `plan_from_assignment`.

    `assignment`: "replicate", "megatron" / "megatron-sp" (the planner's `megatron_assignment`,
    without / with sequence parallelism), "random:<seed>" (a seeded random valid strategy per
    node), or a dict node -> strategy name. The planner's own rules (`autoplan.validity`, shared with
    the runtime) decide what is valid; stages come from its stage search (layers per pipeline rank,
    split into v chunks when interleaved), or `stage_layers` (layers per chunk in flow order) when given.
    `etp`: the experts' tensor-parallel degree (None: tp; 1: MoE layers take the "expert" strategy);
    `order`: the mesh's order of axes over ranks (None: the default); `ep_as`: what the ep ranks are
    to the non-expert layers ("dp": the batch split over dp x ep; "cp": the sequence over ep x cp)."""
    from autoplan.cluster import parse_cluster
    from autoplan.mesh import MeshShape
    from autoplan.models import get_model_config
    from autoplan.models.config import ModelConfig
    from autoplan.api import capture_model, plan_from_assignment
    from autoplan.solver.intra_op import megatron_assignment
    from autoplan.strategies import default_registry, strategy_info

    config = model_name if isinstance(model_name, ModelConfig) else get_model_config(model_name)
    graph = capture_model(config, seq_len, dtype)
    mesh = MeshShape(dp=dp, tp=tp, cp=cp, ep=ep, pp=pp, etp=etp, ep_as=ep_as,
                     **({"order": tuple(order)} if order else {}))
    registry, info = default_registry(), strategy_info(config.rule_info(), tp, mesh.etp)
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
    cluster = parse_cluster(f"{mesh.world_size}xcpu")
    schedule = schedule or ("interleaved-1f1b" if virtual_stages > 1 else "1f1b")
    return plan_from_assignment(graph, config, cluster, mesh, chosen, microbatch_size,
                                num_microbatches, zero_stage, recompute, registry=registry,
                                dtype=dtype, schedule=schedule, virtual_stages=virtual_stages,
                                stage_layers=stage_layers, precision=precision)



def rewritten_one_rank(model_name: str, kernels: str, seq_len: int, recompute: str = "none"):
    """The 1-rank rewritten graph module of `model_name` under `kernels`, with seeded CPU parameters,
    a batch of tokens and their next-token targets."""
    from autoplan.models import build_model, get_model_config
    from autoplan.runtime.groups import RankGroup
    from autoplan.runtime.rewrite import rewrite

    config = get_model_config(model_name)
    plan = dataclasses.replace(make_plan(model_name, 1, 1, seq_len=seq_len, recompute=recompute), kernels=kernels)
    gm = rewrite(build_model(config, device="meta"), config, plan,
                 RankGroup("tp", (0,), 0, None)).graph_module.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in gm.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1 + (1.0 if p.dim() == 1 else 0.0))
    tokens = torch.randint(0, config.vocab, (plan.global_batch, seq_len), generator=gen)
    return gm, tokens, tokens.roll(-1, dims=1)
