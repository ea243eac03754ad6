"""The search's floor under a configuration's step time (`cost_model.step_bounds`, issue 16; tiers 1-2): each part
is a floor against what pricing pays, exact where one stage holds everything, and the least slowest rank is the
least over every way to split the layers."""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest

from autoplan.api import search_context
from autoplan.cluster import ClusterSpec, parse_cluster
from autoplan.cost_model import step_bounds
from autoplan.cost_model.comm import COLLECTIVE_KINDS, AxisGroup, collective_is_affine
from autoplan.cost_model.step_config import Config
from autoplan.mesh import MeshShape
from autoplan.models.config import ModelConfig
from autoplan.solver.space import SearchOptions, enumerate_configs

MID = ModelConfig("mid-llama", "llama", 8, 1024, 16, 4, 2816, 32000, 8192, rope_theta=500000.0)


def small_gpus(nodes: int, memory_gb: float) -> ClusterSpec:
    h100 = parse_cluster(f"{nodes}x8xh100")
    return dataclasses.replace(h100, device=dataclasses.replace(h100.device, memory_bytes=memory_gb * 1e9))


@pytest.fixture(scope="module")
def mid():
    return search_context(MID, small_gpus(2, 0.6), 64, 4096)


def _least_by_every_split(tau: float, first: float, last: float, least: tuple[int, ...], layers: int) -> float:
    best = float("inf")
    for cuts in itertools.combinations_with_replacement(range(layers + 1), len(least) - 1):
        counts = [b - a for a, b in zip((0, *cuts), (*cuts, layers))]
        if all(n >= lo for n, lo in zip(counts, least)):
            ends = [first] + [0.0] * (len(least) - 2) + [last]
            best = min(best, max(n * tau + e for n, e in zip(counts, ends)))
    return best


def test_the_least_slowest_rank_is_the_least_over_every_split():
    rng = random.Random(3)
    for _ in range(300):
        pp, v = rng.randint(2, 5), rng.randint(1, 3)
        least = tuple(v - (s == 0) - (s == pp - 1) for s in range(pp))
        layers = rng.randint(sum(least), 14)
        tau = rng.choice([1.0, 0.37, rng.uniform(0.01, 2.0)])
        first, last = (rng.choice([0.0, tau, rng.uniform(0.0, 3.0)]) for _ in range(2))
        found = step_bounds.least_slowest_rank_s(tau, first, last, least, layers)
        assert found == pytest.approx(_least_by_every_split(tau, first, last, least, layers), rel=1e-12, abs=1e-15)


def _block(ctx, cfg: Config):
    return ctx.block(cfg.tp, cfg.rank_microbatch, mesh=cfg.mesh, etp=cfg.etp)


def test_the_floor_is_exact_where_one_stage_holds_everything_and_below_the_price_elsewhere(mid):
    """pp = 1: pipeline, optimizer and data-parallel sync are the one stage's, so the floor is the price (every
    ZeRO stage, recompute and microbatch); pp > 1: at most the price, and above the old floor (no sync, no sends)."""
    options = SearchOptions(max_microbatch_size=4, virtual_stages=(2,))
    configs = enumerate_configs(MID, mid.cluster, 64, 4096, options)
    single = [c for c in configs if c.pp == 1]
    piped = [c for c in configs if c.pp > 1]
    assert {c.zero_stage for c in single} == {0, 1, 2, 3} and any(c.virtual_stages > 1 for c in piped)
    rng = random.Random(5)
    for cfg in rng.sample(single, 30):
        floor, priced = mid.steps.lower_bound_s(_block(mid, cfg), cfg), mid.price(cfg)
        assert floor == pytest.approx(priced.step_time_s, rel=1e-12), cfg.describe()
    tighter = 0
    for cfg in rng.sample(piped, 60):
        block, priced = _block(mid, cfg), mid.price(cfg)
        floor = mid.steps.lower_bound_s(block, cfg)
        assert floor <= priced.step_time_s * (1 + 1e-12), cfg.describe()
        t = mid.steps.times(block, cfg)
        mean = (cfg.num_microbatches + (cfg.pp - 1) / cfg.virtual_stages) * t.total_s / cfg.pp
        tighter += floor > mean + priced.time.optimizer_s * 0.5
    assert tighter > 40  # the sends, the sync and the slowest rank add to the floor of most


def test_the_floor_holds_under_every_fewer_recomputed_layers_that_fit():
    """The search bisects from a priced "full" to the fewest recomputed layers that fit: the floor with
    `fewer_recomputed` = j is under every "full:k", k >= j, that fits, and under "full" itself. On 0.8 GB
    GPUs: on `mid`'s 0.6 GB few "full:k" fit once cp ranks are solved for the tokens they hold."""
    mid = search_context(MID, small_gpus(2, 0.8), 64, 4096)
    options = SearchOptions(max_microbatch_size=2, precision="bf16-master")  # the search's, for bfloat16
    configs = [c for c in enumerate_configs(MID, mid.cluster, 64, 4096, options) if c.recompute == "full"]
    bisected = [c for c in random.Random(7).sample(configs, min(120, len(configs)))
                if mid.price(c).fits and not mid.price(c.replace(recompute="none")).fits][:12]
    checked = 0
    for cfg in bisected:
        block = _block(mid, cfg)
        assert mid.steps.lower_bound_s(block, cfg, 1) <= mid.price(cfg).step_time_s * (1 + 1e-12)
        for k in range(1, MID.num_layers):
            partial = mid.price(cfg.replace(recompute=f"full:{k}"))
            if partial.fits:
                checked += 1
                for j in (1, k):
                    assert mid.steps.lower_bound_s(block, cfg, j) <= partial.step_time_s * (1 + 1e-12), (cfg, k, j)
    assert checked > 20


def test_collectives_called_affine_are_affine():
    """The data-parallel sync floor under pp > 1 sums the stages' traffic only where a collective's time is
    a + b * bytes, a >= 0 (`collective_is_affine`): check the claim at three sizes for every kind and shape."""
    cluster = parse_cluster("4x8xh100")
    mesh = MeshShape(dp=4, tp=8)
    groups = [AxisGroup(8, 1, 8), AxisGroup(4, 4, 1), AxisGroup(16, 2, 8), AxisGroup(32, 4, 8), AxisGroup(1, 1, 1)]
    from autoplan.cost_model.compute import Efficiency
    efficiency = Efficiency().resolved(cluster.device)
    for group, kind in itertools.product(groups, [k for k in COLLECTIVE_KINDS if k != "all_to_all"]):
        assert collective_is_affine(group, None)
        t0, t1, t2 = (efficiency.collective_s(kind, b, cluster, group) for b in (0.0, 1e8, 2e8))
        assert t0 >= 0 and t2 - t1 == pytest.approx(t1 - t0, rel=1e-9)
    assert AxisGroup.of(mesh, "tp", 8).nodes == 1
    assert not collective_is_affine(AxisGroup(8, 1, 8), object())  # a profile's samples inside a node
    assert collective_is_affine(AxisGroup(4, 4, 1), object())
