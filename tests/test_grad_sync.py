"""runtime.grad_sync on 2 gloo ranks: buckets launched during backward, and the distributed optimizer.

A stack of Linear layers (one of odd size, so buckets need padding to split over 2 ranks, and one
never used, which gets no gradient) with buckets of about two layers:

    overlap     on the last of 2 microbatches, the first bucket's all-reduce is issued before the
                last gradient hook fires (while backward still runs), one collective per bucket
                per step (none on the first microbatch), and the gradients equal the mean over the
                ranks of each rank's own (a plain all-reduce of plain autograd's)
    ZeRO 1/2    ShardedOptimizer over the reduce-scattered buckets: after 3 AdamW steps the
                parameters equal one process's AdamW on the averaged gradients (rtol 1e-5), each
                rank holding optimizer states for half of the elements
The runtimes' own parity suites (test_runtime_parity, test_runtime_modules, test_runtime_dims) run
the same mechanism under dp, tp, pp, ep and cp against one process.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from _dist import spawn

pytestmark = pytest.mark.gloo

WIDTH, MICROBATCHES, STEPS, LR = 32, 2, 3, 1e-3
BUCKET_BYTES = 2 * (WIDTH * WIDTH + WIDTH) * 4 + 1  # about two layers per bucket


def _model() -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.Linear(WIDTH, WIDTH) for _ in range(5)] + [nn.Linear(WIDTH, 7), nn.Linear(7, 3)]
    # registered first, so in the last bucket: a parameter without gradient holds its bucket (and
    # those after it) until backward ends
    return nn.ModuleDict({"unused": nn.Linear(3, 3), "stack": nn.Sequential(*layers)})


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model["stack"](x).tanh().square().sum()


def _inputs(rank: int, step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return list(torch.randn(MICROBATCHES * 4, WIDTH, generator=g).chunk(MICROBATCHES))


def _sync(model: nn.Module, group, shard: bool):
    from autoplan.runtime.grad_sync import GradSync, Replica

    return GradSync([Replica(p, group, 2) for p in model.parameters()], 0.5, shard=shard,
                    bucket_bytes=BUCKET_BYTES)


def _averaged_grads(model: nn.Module, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Plain autograd, then a plain all-reduce: the gradients data parallelism must give."""
    import torch.distributed as dist

    model.zero_grad(set_to_none=False)
    for x in inputs:
        _loss(model, x).backward()
    grads = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
    for g in grads:
        dist.all_reduce(g)
        g /= 2
    return grads


def _overlap(rank: int, world: int) -> dict:
    import torch.distributed as dist
    from autoplan.runtime import collectives as C

    model, plain = _model(), _model()
    group = dist.new_group([0, 1])
    sync = _sync(model, group, shard=False)
    sync.begin_step(MICROBATCHES)
    with C.count_collectives({group: "dp"}) as counts:
        for x in _inputs(rank, 0):
            _loss(model, x).backward()
        sync.finish()
    expected = _averaged_grads(plain, _inputs(rank, 0))
    error = max(float((p.grad - e).abs().max()) for p, e in zip(model.parameters(), expected))
    return {"events": [(kind, index) for kind, index, _ in sync.trace.events],
            "buckets": len(sync.buckets), "counts": dict(counts), "error": error,
            "unused": model["unused"].weight.grad.abs().sum().item()}


def test_buckets_are_reduced_while_backward_runs():
    for out in spawn(_overlap, 2):
        events, buckets = out["events"], out["buckets"]
        kinds = [kind for kind, _ in events]
        assert buckets >= 3, out
        during = kinds[:kinds.index("backward_end")]  # then finish marks the unused parameter
        last_hook = len(during) - 1 - during[::-1].index("hook")
        assert kinds.index("launch") < last_hook, events
        assert during.count("launch") == buckets - 1  # all but the unused parameter's bucket
        assert [i for kind, i in events if kind == "launch"] == list(range(buckets))  # in order
        assert out["counts"] == {("all_reduce", "dp"): buckets}  # none on the first microbatch
        assert out["error"] < 1e-6 and out["unused"] == 0.0


def _sharded(rank: int, world: int) -> dict:
    import torch.distributed as dist
    from autoplan.runtime.sharded_optimizer import ShardedOptimizer

    model, reference = _model(), _model()
    sync = _sync(model, dist.group.WORLD, shard=True)
    optimizer = ShardedOptimizer(sync, torch.optim.AdamW, lr=LR)
    plain = torch.optim.AdamW(reference.parameters(), lr=LR)
    for step in range(STEPS):
        optimizer.zero_grad()
        sync.begin_step(MICROBATCHES)
        for x in _inputs(rank, step):
            _loss(model, x).backward()
        sync.finish()
        optimizer.step()
        for p, g in zip(reference.parameters(), _averaged_grads(copy.deepcopy(reference), _inputs(rank, step))):
            p.grad = g
        plain.step()
    held = sum(s["exp_avg"].numel() for s in optimizer.state.values())
    return {"params": [p.detach().clone() for p in model.parameters()],
            "reference": [p.detach().clone() for p in reference.parameters()], "held": held,
            "total": sum(p.numel() for p in model.parameters())}


def test_distributed_optimizer_matches_one_process():
    for out in spawn(_sharded, 2):
        for got, want in zip(out["params"], out["reference"]):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        assert out["held"] <= out["total"] // 2 + len(out["params"])  # half, plus padding


def test_zero_1_2_refuse_an_optimizer_over_the_whole_parameters():
    """Both runtimes' train_step run this check before a step (runtime.grad_sync.check_optimizer)."""
    from types import SimpleNamespace

    from autoplan.errors import ConfigError
    from autoplan.runtime.sharded_optimizer import check_optimizer

    plain = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    check_optimizer(None, plain, 0)  # ZeRO 3 (FSDP2): no GradSync
    check_optimizer(SimpleNamespace(shard=False, masters=False), plain, 0)
    with pytest.raises(ConfigError, match=r"ZeRO 2 with master weights steps on this rank's fp32 master slices"
                                          r".* not SGD over the parameters"):
        check_optimizer(SimpleNamespace(shard=True, masters=True), plain, 2)
    with pytest.raises(ConfigError, match=r"ZeRO 0 under master weights steps"):  # precision bf16-master
        check_optimizer(SimpleNamespace(shard=False, masters=True), plain, 0)
