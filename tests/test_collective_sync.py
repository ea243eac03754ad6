"""A blocking collective inside a step (issue 20): what it costs beyond its back-to-back time, measured
by the profile on gloo ranks (`profiler.collectives.collective_sync_s`) and priced on every blocking
call (`Efficiency.collective_sync_s`, `cost_model.comm`'s "Inside a step")."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from autoplan.cluster import parse_cluster
from autoplan.cost_model.comm import AxisGroup
from autoplan.cost_model.compute import Efficiency, calibrate
from autoplan.errors import ConfigError
from autoplan.profiler.profile import GemmSample, HardwareProfile, MemorySample

from _dist import spawn


def _cpu_profile(**fields) -> HardwareProfile:
    gemm = (GemmSample(64, 64, 64, "float32", 1e-5),)
    return HardwareProfile("AMD EPYC", "cpu", 2**30, 1, "2.13.0", "now", gemm, MemorySample(2**20, 1e-4), "gloo",
                           **fields)


def test_sync_cost_adds_to_every_call_over_more_than_one_rank():
    cluster = parse_cluster("1x2xcpu")
    pair, alone = AxisGroup(2, 1, 2), AxisGroup(1, 1, 1)
    plain, synced = Efficiency(), Efficiency(collective_sync_s=1e-3)
    for kind in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
        assert synced.collective_s(kind, 2**20, cluster, pair) == pytest.approx(
            plain.collective_s(kind, 2**20, cluster, pair) + 1e-3)
        assert synced.collective_s(kind, 2**20, cluster, alone) == 0.0  # one rank: no call, nothing to wait for
    with pytest.raises(ConfigError, match=r"collective_sync_s=0.5 must be in \[0, 0.01\) seconds"):
        Efficiency(collective_sync_s=0.5)


def test_profile_carries_sync_cost_and_gpu_profiles_price_none():
    cpu = _cpu_profile(collective_sync_s=1.2e-3)
    assert HardwareProfile.from_json(cpu.to_json()) == cpu
    older = {k: v for k, v in cpu.to_json().items() if k != "collective_sync_s"}
    assert HardwareProfile.from_json(older).collective_sync_s is None  # files written before the field
    _, eff = calibrate(parse_cluster("1x2xcpu"), None, cpu, dtype="float32")
    assert eff.collective_sync_s == 1.2e-3
    gpu = replace(cpu, device_name="NVIDIA H100 80GB HBM3", device_kind="cuda", collective_sync_s=None)
    _, eff = calibrate(parse_cluster("1x2xh100"), None, gpu, dtype="float32")
    assert eff.collective_sync_s == 0.0


def _plan_times(mesh, sync_s: float, microbatch_size: int, skew: float = 0.0, zero_stage: int = 0):
    """tiny-llama, 4 sequences of 64 on 2 CPU ranks, ZeRO 0: tp in Megatron's layout, as the runtime runs it."""
    from autoplan.api import capture_model, plan_from_assignment
    from autoplan.models import get_model_config
    from autoplan.solver.intra_op import megatron_assignment
    from autoplan.strategies import default_registry

    config, registry = get_model_config("tiny-llama"), default_registry()
    graph = capture_model(config, 64, "float32")
    chosen = megatron_assignment(graph, registry, mesh.tp, config.rule_info(), False)
    plan = plan_from_assignment(graph, config, parse_cluster("1x2xcpu"), mesh, chosen, microbatch_size,
                                4 // (microbatch_size * mesh.batch_shards), zero_stage, "none", registry=registry,
                                dtype="float32", efficiency=Efficiency(collective_sync_s=sync_s, collective_skew=skew))
    return plan.predicted.time


def test_plan_pays_sync_per_blocking_call():
    """tp 2 pays it on each of its collectives (Megatron's 2 forward + 2 backward all-reduces per layer at
    least), linearly; dp 2 ZeRO 0 on its last gradient bucket only, the rest hidden behind backward."""
    from autoplan.mesh import MeshShape
    from autoplan.models import get_model_config

    layers = get_model_config("tiny-llama").num_layers
    tp = [_plan_times(MeshShape(tp=2), s, 4).communication_s for s in (0.0, 1e-3, 2e-3)]
    assert tp[1] - tp[0] >= 4 * layers * 1e-3 - 1e-9
    assert tp[2] - tp[0] == pytest.approx(2 * (tp[1] - tp[0]))
    dp = [_plan_times(MeshShape(dp=2), s, 2).communication_s for s in (0.0, 1e-3)]
    assert dp[1] - dp[0] == pytest.approx(1e-3, abs=2e-4)


def _sleep_compute(rank: int, base_s: float, skew_s: float):
    """Compute of `base_s`, and `skew_s` more on every other call, on alternate ranks: ranks out of step."""
    calls = [0]

    def compute() -> None:
        calls[0] += 1
        time.sleep(base_s + (skew_s if calls[0] % 2 == rank else 0.0))
    return compute


def _measure_sync(rank: int, world: int, skew_s: float) -> tuple[float, float]:
    import torch

    from autoplan.profiler.collectives import collective_sync_s, measure_collectives

    _, fits = measure_collectives(torch.device("cpu"), kinds=("all_reduce",), sizes=(4096, 2**20))
    computes = [_sleep_compute(rank, 1e-3, 0.0), _sleep_compute(rank, 1e-3, skew_s)]
    base, no_skew, _ = collective_sync_s(fits, torch.device("cpu"), quick=True, computes=computes[:1])
    skewed, _, _ = collective_sync_s(fits, torch.device("cpu"), quick=True, computes=computes[1:])
    assert no_skew == 0.0  # one compute duration: no skew term is fitted
    return base, skewed


def test_measured_sync_cost_sees_ranks_out_of_step():
    """With one rank or the other 20 ms late on alternate calls, every call waits for a late rank, while the
    slower rank's compute alone is late on two calls of three (windows of 3 calls, which keep their parity):
    the cost per call reads 20 - 13.3 = 6.7 ms and more. The base reading (no deliberate skew, 1-3.5 ms on the
    development machine at load 1-6) is partly covered by the deliberate wait, so only a part of it adds."""
    (base, skewed), other = spawn(_measure_sync, 2, 20e-3)
    assert (base, skewed) == other  # every rank gets the same answer
    assert 0.0 <= base < 10e-3
    assert 5e-3 < skewed < 16e-3
    assert skewed > base + 2e-3


def test_zero3_units_wait_out_of_step_twice_per_microbatch():
    """FSDP2's all-gathers hide their bytes behind compute, but each unit waits for two of them (before its
    forward and its backward), each at the sync cost; ZeRO 0's buckets are waited on once, after backward."""
    from autoplan.cost_model.step import StepEnv, StepModel
    from autoplan.cost_model.step_config import Config
    from autoplan.models import get_model_config

    cluster, sums = parse_cluster("1x2xcpu"), dict(dense=10e6, expert=0.0, buckets=5, forward=1.0, backward=2.0)
    parts = {}
    for sync_s in (0.0, 1e-3):
        steps = StepModel(StepEnv(get_model_config("tiny-llama"), cluster, 64, "float32",
                                  Efficiency(collective_sync_s=sync_s)), partition=None)
        for zero in (0, 3):
            cfg = Config.of(tp=1, cp=1, pp=1, ep=1, dp=2, microbatch_size=1, num_microbatches=4, zero_stage=zero,
                            recompute="none")
            parts[sync_s, zero] = steps.dp_sync_parts(cfg, sums)
    fixed = "fixed cost per unit (FSDP2)"
    assert parts[1e-3, 3][fixed] - parts[0.0, 3][fixed] == pytest.approx(4 * 5 * 2e-3)  # m x units x 2 waits
    exposed = [sum(parts[s, 0].values()) for s in (0.0, 1e-3)]
    assert exposed[1] - exposed[0] == pytest.approx(1e-3)  # the last bucket's wait; the others hide


def test_skew_sums_the_square_root_of_the_compute_between_calls():
    """`intra_op.skew_s`: c sqrt(compute since the last call) per call; a layer's compute after its last call
    runs before its first call of the next layer (cyclic); a part without calls pays none."""
    from autoplan.cost_model.intra_op import skew_s

    e = Efficiency(collective_skew=0.02)
    ops = [(0.004, False), (0.005, True), (0.009, True), (0.007, False)]
    assert skew_s(ops, e, cyclic=False) == pytest.approx(0.02 * (0.009 ** 0.5 + 0.009 ** 0.5))
    assert skew_s(ops, e, cyclic=True) == pytest.approx(0.02 * (0.016 ** 0.5 + 0.009 ** 0.5))
    assert skew_s([(0.01, False)], e, cyclic=True) == 0.0
    assert skew_s(ops, Efficiency(), cyclic=True) == 0.0
    with pytest.raises(ConfigError, match=r"collective_skew=0.5 must be in \[0, 0.1\)"):
        Efficiency(collective_skew=0.5)


def test_plan_pays_the_skew_where_ranks_meet():
    """tp 2 pays c sqrt(compute between calls) on its calls, more per step than one skew of the whole step;
    dp 2 pays c sqrt(the step's forward + backward) once, at the sync after backward (ZeRO 0), and ZeRO 3 on
    each FSDP2 unit's gathers; the skew grows as c."""
    from autoplan.mesh import MeshShape

    tp = [_plan_times(MeshShape(tp=2), 1e-3, 4, c).communication_s for c in (0.0, 0.02, 0.04)]
    assert tp[1] > tp[0] and tp[2] - tp[0] == pytest.approx(2 * (tp[1] - tp[0]))
    base, skewed = (_plan_times(MeshShape(dp=2), 1e-3, 2, c) for c in (0.0, 0.02))
    step_compute = base.compute_s  # forward + backward of the step's microbatches
    assert skewed.communication_s - base.communication_s == pytest.approx(0.02 * step_compute ** 0.5, rel=0.05)
    fsdp = [_plan_times(MeshShape(dp=2), 1e-3, 2, c, zero_stage=3).communication_s for c in (0.0, 0.02)]
    assert fsdp[1] > fsdp[0]


def test_profile_carries_the_skew():
    cpu = _cpu_profile(collective_sync_s=1.0e-3, collective_skew=0.02)
    assert HardwareProfile.from_json(cpu.to_json()) == cpu
    older = {k: v for k, v in cpu.to_json().items() if k != "collective_skew"}
    assert HardwareProfile.from_json(older).collective_skew is None
    _, eff = calibrate(parse_cluster("1x2xcpu"), None, cpu, dtype="float32")
    assert (eff.collective_sync_s, eff.collective_skew) == (1.0e-3, 0.02)


def test_skew_fit_recovers_its_terms_and_floors_them():
    from autoplan.profiler.collectives import fit_skew

    computes = (0.0003, 0.0026, 0.009, 0.02, 0.04)
    exact = [(d, 4096, 0.9e-3 + 0.02 * d ** 0.5) for d in computes]
    assert fit_skew(exact) == (pytest.approx(0.9e-3), pytest.approx(0.02))
    assert fit_skew([(0.001, 4096, 1e-3), (0.0011, 4096, 2e-3)]) == (pytest.approx(1.5e-3), 0.0)  # one duration
    falling = [(d, 4096, 3e-3 - 0.01 * d ** 0.5) for d in computes]
    assert fit_skew(falling)[1] == 0.0


def test_ulysses_calls_wait_before_and_after_each_attention_core():
    """`parallel_dims.ulysses_skew_s`: per pass, one wait after the attention core's compute (the output's call)
    and one after the rest of the layer's (q, k and v's calls in a row wait once); none without a fitted skew.
    A cp 2 plan pays it, linearly in c."""
    from autoplan.cost_model.parallel_dims import ulysses_skew_s
    from autoplan.mesh import MeshShape

    e = Efficiency(collective_skew=0.02)
    expected = 0.02 * (0.01 ** 0.5 + 0.03 ** 0.5 + 0.02 ** 0.5 + 0.06 ** 0.5)
    assert ulysses_skew_s(0.04, 0.08, (0.01, 0.02), e) == pytest.approx(expected)
    assert ulysses_skew_s(0.04, 0.08, (0.01, 0.02), Efficiency()) == 0.0
    cp = [_plan_times(MeshShape(cp=2), 1e-3, 4, c).communication_s for c in (0.0, 0.02, 0.04)]
    assert cp[1] > cp[0] and cp[2] - cp[0] == pytest.approx(2 * (cp[1] - cp[0]))


def test_ulysses_all_to_alls_are_priced_with_their_pack_and_unpack_copies():
    """Each of a layer's 8 all-to-alls per microbatch (q, k, v, output; forward and backward) copies the rank's
    share twice around the call (`runtime.collectives.all_to_all_dim`): read + write of tokens / cp x width."""
    from autoplan.cost_model.parallel_dims import ulysses_all_to_all_s

    cluster, pair = parse_cluster("1x2xcpu"), AxisGroup(2, 1, 2)
    e = Efficiency(kernel_floor_s=0.0)
    tokens, q, kv, itemsize = 4096, 384, 128, 4
    calls = 4 * (e.collective_s("all_to_all", tokens * q * itemsize, cluster, pair)
                 + e.collective_s("all_to_all", tokens * kv * itemsize, cluster, pair))
    moved = 4 * 2 * 2 * tokens / 2 * itemsize * (q + kv)  # 4 calls of each width x 2 copies x (read + write)
    copies = moved / (cluster.device.memory_bandwidth_bytes_per_s * e.memory)
    assert ulysses_all_to_all_s(tokens, q, kv, itemsize, cluster, pair, e) == pytest.approx(calls + copies)
    assert ulysses_all_to_all_s(tokens, q, kv, itemsize, cluster, AxisGroup(1, 1, 1), e) == 0.0
