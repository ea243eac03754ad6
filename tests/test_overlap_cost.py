"""A collective overlapped with compute on a CPU (issue 20): gloo's threads copy and reduce on the cores the
ranks compute on, so the traffic that hides behind backward still costs the backward a share of its time.
The profile measures the share (`profiler.collectives.overlap_cost`), the cost model prices it on the
hidden traffic (`Efficiency.overlap_cost`, `cost_model.dp_sync`)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from autoplan.cluster import parse_cluster
from autoplan.cost_model.compute import Efficiency, calibrate
from autoplan.cost_model.dp_sync import CORES_PART
from autoplan.errors import ConfigError
from autoplan.profiler.profile import GemmSample, HardwareProfile, MemorySample, ProfileError

from _dist import spawn

SUMS = dict(dense=10e6, expert=0.0, buckets=5, forward=0.02, backward=0.04)


def _parts(zero_stage: int, **efficiency) -> dict[str, float]:
    """dp 2 over 2 CPU ranks, tiny-llama's step model, 10 M dense parameters, 2 microbatches."""
    from autoplan.cost_model.step import StepEnv, StepModel
    from autoplan.cost_model.step_config import Config
    from autoplan.models import get_model_config

    steps = StepModel(StepEnv(get_model_config("tiny-llama"), parse_cluster("1x2xcpu"), 64, "float32",
                              Efficiency(**efficiency)), partition=None)
    cfg = Config.of(tp=1, cp=1, pp=1, ep=1, dp=2, microbatch_size=1, num_microbatches=2, zero_stage=zero_stage,
                    recompute="none")
    return steps.dp_sync_parts(cfg, SUMS)


@pytest.mark.parametrize("zero_stage", [0, 1, 3])
def test_hidden_traffic_costs_its_share_of_the_cores(zero_stage):
    """f = 0 prices what hides as free (no part); f = 1 as if the traffic ran after the compute, which is what
    `overlap_grad_reduce=False` prices; in between, linearly."""
    free = _parts(zero_stage)
    assert CORES_PART not in free
    serial = sum(_parts(zero_stage, overlap_grad_reduce=False).values())
    shares = [sum(_parts(zero_stage, overlap_cost=f).values()) for f in (0.25, 0.5, 1.0)]
    assert sum(free.values()) < shares[0] < shares[1] < shares[2]
    assert shares[2] == pytest.approx(serial)
    assert shares[1] - shares[0] == pytest.approx(shares[0] - sum(free.values()))
    assert _parts(zero_stage, overlap_cost=0.5)[CORES_PART] > 0


def test_efficiency_refuses_a_share_beyond_one():
    with pytest.raises(ConfigError, match=r"overlap_cost=1.5 must be in \[0, 1\]"):
        Efficiency(overlap_cost=1.5)


def _cpu_profile(**fields) -> HardwareProfile:
    gemm = (GemmSample(64, 64, 64, "float32", 1e-5),)
    return HardwareProfile("AMD EPYC", "cpu", 2**30, 1, "2.13.0", "now", gemm, MemorySample(2**20, 1e-4), "gloo",
                           **fields)


def test_profile_carries_the_share_to_the_cost_model():
    cpu = _cpu_profile(overlap_cost=0.6)
    assert HardwareProfile.from_json(cpu.to_json()) == cpu
    older = {k: v for k, v in cpu.to_json().items() if k != "overlap_cost"}
    assert HardwareProfile.from_json(older).overlap_cost is None  # files written before the field
    _, eff = calibrate(parse_cluster("1x2xcpu"), None, cpu, dtype="float32")
    assert eff.overlap_cost == 0.6
    _, eff = calibrate(parse_cluster("1x2xcpu"), None, replace(cpu, overlap_cost=None), dtype="float32")
    assert eff.overlap_cost == 0.0
    with pytest.raises(ProfileError, match="overlap_cost must be a fraction in"):
        _cpu_profile(overlap_cost=2.0)


def _measure(rank: int, world: int) -> tuple[float, tuple[float, float, float]]:
    import torch

    from autoplan.profiler.collectives import overlap_cost

    return overlap_cost(torch.device("cpu"), quick=True, message_bytes=4 * 2**20)


def test_measured_share_is_the_ranks_common_reading():
    """Two gloo ranks measure one share, from the slowest rank's medians, clamped to [0, 1]."""
    (share, (alone, reduced, paired)), other = spawn(_measure, 2)
    assert (share, (alone, reduced, paired)) == other
    assert alone > 0 and reduced > 0 and paired > 0
    assert share == pytest.approx(min(1.0, max(0.0, (paired - alone) / reduced)))
