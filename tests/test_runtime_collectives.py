"""Each autograd-aware collective against its definition, forward and backward, on 2 and 4 gloo ranks.

One spawn per world size runs every check; each rank returns {check name: max relative error}, and the
tests below assert on them one by one. Rank r's input is derived from tensors X and G that every
rank builds from the same seed (x_r = X * (r + 1) where a collective sums over ranks).
"""

from __future__ import annotations

import pytest
import torch

from _dist import spawn

pytestmark = pytest.mark.gloo

WORLDS = (2, 4)
SHAPE = (4, 8, 12)  # every dim divisible by 4
TOL = 1e-6  # max |error| / max(1, max |wanted|): fp32 sums in another order differ by ~1e-7


def _checks(rank: int, world: int) -> dict[str, float]:
    import torch.nn.functional as F

    from autoplan.runtime import collectives as C
    from autoplan.runtime.losses import (sequence_parallel_cross_entropy,
                                         vocab_parallel_cross_entropy)

    gen = torch.Generator().manual_seed(0)
    X, G = torch.randn(SHAPE, generator=gen), torch.randn(SHAPE, generator=gen)
    n, r, total = world, rank, world * (world + 1) / 2  # total = sum_r (r + 1)
    errors: dict[str, float] = {}

    def run(name, fn, x, dy, want_y, want_dx):
        x = x.clone().requires_grad_()
        y = fn(x)
        y.backward(dy)
        errors[name] = max(_rel(y, want_y), _rel(x.grad, want_dx))

    def part(t, d):
        return t.chunk(n, dim=d)[r]

    run("copy_to_region", lambda x: C.copy_to_region(x, None), X, G * (r + 1), X, G * total)
    run("reduce_from_region", lambda x: C.reduce_from_region(x, None), X * (r + 1), G, X * total, G)
    for d in (0, 1, 2, -1):
        run(f"split_along[{d}]", lambda x: C.split_along(x, d, None), X, part(G, d), part(X, d), G)
        run(f"gather_along[{d}]", lambda x: C.gather_along(x, d, None), part(X, d), G, X,
            part(G, d))
        run(f"reduce_scatter_along[{d}]", lambda x: C.reduce_scatter_along(x, d, None),
            X * (r + 1), part(G, d), part(X * total, d), G)
        run(f"gather_fwd_reduce_scatter_bwd[{d}]",
            lambda x: C.gather_fwd_reduce_scatter_bwd(x, d, None), part(X, d), G * (r + 1), X,
            part(G * total, d))
    for a, b in ((1, 2), (2, 1), (0, 2), (2, 0)):
        run(f"all_to_all_dims[{a}->{b}]", lambda x: C.all_to_all_dims(x, a, b, None), part(X, a),
            part(G, b), part(X, b), part(G, a))
    errors.update(_loss_checks(rank, world, F, vocab_parallel_cross_entropy,
                               sequence_parallel_cross_entropy))
    return errors


def _loss_checks(rank, world, F, vocab_ce, seq_ce) -> dict[str, float]:
    gen = torch.Generator().manual_seed(1)
    B, T, V = 2, 8, 16
    logits = torch.randn(B, T, V, generator=gen) * 3
    targets = torch.randint(0, V, (B, T), generator=gen)
    targets[0, 3] = -100  # ignored, as F.cross_entropy ignores it
    ref_logits = logits.clone().requires_grad_()
    ref = F.cross_entropy(ref_logits.reshape(-1, V), targets.reshape(-1))
    ref.backward(torch.tensor(2.0))
    out = {}
    for name, dim in (("vocab_parallel_cross_entropy", 2), ("sequence_parallel_cross_entropy", 1)):
        local = logits.chunk(world, dim=dim)[rank].clone().requires_grad_()
        if dim == 2:
            loss = vocab_ce(local, targets, rank * V // world, None)
        else:
            loss = seq_ce(local, targets.chunk(world, dim=1)[rank], None)
        loss.backward(torch.tensor(2.0))
        want_grad = ref_logits.grad.chunk(world, dim=dim)[rank]
        out[name] = max(_rel(loss, ref), _rel(local.grad, want_grad))
    return out


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """Max abs error relative to the largest wanted magnitude (at least 1)."""
    return ((got - want).abs().max() / want.abs().max().clamp(min=1)).item()


@pytest.fixture(scope="module")
def errors_by_world() -> dict[int, list[dict[str, float]]]:
    return {world: spawn(_checks, world) for world in WORLDS}


CHECK_NAMES = (["copy_to_region", "reduce_from_region", "vocab_parallel_cross_entropy",
                "sequence_parallel_cross_entropy"]
               + [f"{c}[{d}]" for c in ("split_along", "gather_along", "reduce_scatter_along",
                                        "gather_fwd_reduce_scatter_bwd") for d in (0, 1, 2, -1)]
               + [f"all_to_all_dims[{a}->{b}]" for a, b in ((1, 2), (2, 1), (0, 2), (2, 0))])


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("check", CHECK_NAMES)
def test_collective_matches_definition(errors_by_world, world, check):
    for rank, errors in enumerate(errors_by_world[world]):
        assert errors[check] <= TOL, f"{check} on rank {rank}/{world}: max error {errors[check]:.3g}"


def test_every_check_ran(errors_by_world):
    for world, per_rank in errors_by_world.items():
        assert set(per_rank[0]) == set(CHECK_NAMES), world


def test_one_rank_group_is_identity():
    from autoplan.runtime import collectives as C

    x = torch.randn(2, 4)
    assert C.group_size(None) == 1  # no process group in the test process
    for y in (C.copy_to_region(x, None), C.reduce_from_region(x, None), C.split_along(x, 1, None),
              C.gather_along(x, 1, None), C.all_to_all_dims(x, 0, 1, None)):
        assert y is x
