"""What issue 20's step-fidelity benchmark found priced apart from what runs, priced as it runs:
torch's AdamW step pass by pass (`cost_model.optimizer.adamw_step_bytes`), FSDP2's copies around its
collectives under ZeRO 3 (`StepModel.dp_sync_parts`), and the runtime's FSDP2 units, one per layer
(`runtime.zero.layer_units`), which the cost model's unit count assumes."""

from __future__ import annotations

import pytest

from autoplan.cluster import parse_cluster
from autoplan.cost_model.compute import Efficiency, memory_time_s
from autoplan.cost_model.optimizer import adamw_step_bytes
from autoplan.errors import ConfigError
from autoplan.models import get_model_config


def test_adamw_step_bytes_count_its_passes():
    # fp32: decay 8, lerp 12, v 20, denominator 24, addcdiv 16 (= 80), the gradient norm 4
    assert adamw_step_bytes(4, 4) == 84
    # bf16 weights and gradients: the passes over fp32 states, 2 x 2 gradient reads, the norm 2, the cast 4 + 2
    assert adamw_step_bytes(2, 2) == 72 + 4 + 2 + 6


def test_plan_optimizer_time_is_adamw_over_local_parameters():
    from autoplan.api import estimate
    from autoplan.mesh import MeshShape

    config = get_model_config("tiny-llama")
    cluster = parse_cluster("1x2xcpu")
    zero0, zero1 = (estimate(config, cluster, 4, 64, mesh=MeshShape(dp=2), microbatch_size=2, zero_stage=z,
                             recompute="none", dtype="float32") for z in (0, 1))
    params = config.num_parameters()
    expected = memory_time_s(84 * params, cluster.device, Efficiency())
    assert zero0.predicted.time.optimizer_s == pytest.approx(expected, rel=0.02)
    # the step on a 1/dp slice, then the all-gathered values copied into the fp32 parameters (read and write 4 B)
    copied = memory_time_s(8 * params, cluster.device, Efficiency())
    assert zero1.predicted.time.optimizer_s == pytest.approx(expected / 2 + copied, rel=0.02)


def test_zero3_prices_fsdp2_copies_per_microbatch():
    from autoplan.cost_model.step import StepEnv, StepModel
    from autoplan.cost_model.step_config import Config

    cluster, eff, params = parse_cluster("2x8xh100"), Efficiency(), 100e6
    steps = StepModel(StepEnv(get_model_config("gpt2-small"), cluster, 1024, "bfloat16", eff), partition=None)
    cfg = Config.of(tp=1, cp=1, pp=1, ep=1, dp=16, microbatch_size=1, num_microbatches=4, zero_stage=3,
                    recompute="none")
    parts = steps.dp_sync_parts(cfg, dict(dense=params, expert=0.0, buckets=13, forward=1.0, backward=2.0))
    g = 16  # autocast: fp32 w = gr = 4 bytes; two all-gathers' copies in and out, the reduce-scatter's in and out
    per_param = 2 * (2 * 4 / g + 2 * 4) + 2 * 4 + 2 * 4 / g
    assert parts["all-gather and reduce-scatter copies (FSDP2)"] == pytest.approx(
        4 * memory_time_s(per_param * params, cluster.device, eff))


def test_zero3_prices_fsdp2_fixed_cost_per_unit_and_microbatch():
    from autoplan.cost_model.step import StepEnv, StepModel
    from autoplan.cost_model.step_config import Config

    cluster, params = parse_cluster("2x8xh100"), 100e6
    parts = {}
    for unit_s in (0.0, 1e-3):
        steps = StepModel(StepEnv(get_model_config("gpt2-small"), cluster, 1024, "bfloat16", Efficiency(fsdp_unit_s=unit_s)),
                          partition=None)
        for dp, zero in ((16, 3), (16, 0), (1, 3)):
            cfg = Config.of(tp=16 // dp, cp=1, pp=1, ep=1, dp=dp, microbatch_size=1, num_microbatches=4, zero_stage=zero,
                            recompute="none")
            sums = dict(dense=params, expert=0.0, buckets=13, forward=1.0, backward=2.0)
            parts[unit_s, dp, zero] = steps.dp_sync_parts(cfg, sums)
    assert parts[1e-3, 16, 3]["fixed cost per unit (FSDP2)"] == pytest.approx(4 * 13 * 1e-3)  # m x units
    assert parts[0.0, 16, 3]["fixed cost per unit (FSDP2)"] == 0.0
    assert parts[1e-3, 16, 0] == parts[0.0, 16, 0]  # ZeRO 0: no FSDP2
    assert parts[1e-3, 1, 3]["fixed cost per unit (FSDP2)"] == 0.0  # one data rank: nothing sharded


def test_profile_prices_fsdp2_units():
    """A profile's measured FSDP2 unit cost is priced; a profile without one prices none."""
    from dataclasses import replace

    from autoplan.cost_model.compute import calibrate
    from autoplan.profiler.profile import GemmSample, HardwareProfile, MemorySample

    gemm = (GemmSample(64, 64, 64, "float32", 1e-5),)
    cpu = HardwareProfile("AMD EPYC", "cpu", 2**30, 1, "2.13.0", "now", gemm, MemorySample(2**20, 1e-4), "gloo",
                          fsdp_unit_s=1.5e-3)
    _, eff = calibrate(parse_cluster("1x2xcpu"), None, cpu, dtype="float32")
    assert eff.fsdp_unit_s == 1.5e-3
    gpu = replace(cpu, device_name="NVIDIA H100 80GB HBM3", device_kind="cuda", fsdp_unit_s=None)
    _, eff = calibrate(parse_cluster("1x2xh100"), None, gpu, dtype="float32")
    assert eff.fsdp_unit_s == 0.0
    with pytest.raises(ConfigError, match=r"fsdp_unit_s=2.0 must be in \[0, 1\) seconds"):
        Efficiency(fsdp_unit_s=2.0)


def test_fsdp_units_are_layers():
    """`layer_units`: a layer's parameter-owning modules together, shared modules once, modules of no
    layer (embedding, head) and parameter-free ones left to the root."""
    from torch import nn

    from autoplan.runtime.zero import layer_units

    root = nn.Module()
    root.emb, root.a, root.b, root.act, root.c = nn.Embedding(4, 2), nn.Linear(2, 2), nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2)
    units = layer_units(root, ("emb", "a", "act", "b", "a", "c"), (None, 0, 0, 0, 0, 1))
    assert [[id(m) for m in unit] for unit in units] == [[id(root.a), id(root.b)], [id(root.c)]]


def test_collectives_priced_from_the_profiles_samples():
    """Between measured sizes: linear; beyond the largest: its last slope; below the smallest: the fit;
    a larger message never cheaper (the samples' running maximum); another group size: the fit."""
    from autoplan.cost_model.calibration import CollectiveCalibration, sampled_time_s
    from autoplan.profiler.profile import CollectiveFit, CollectiveSample, GemmSample, HardwareProfile, MemorySample

    MiB = 2**20
    samples = (CollectiveSample("all_reduce", 2, 4 * MiB, 0.002), CollectiveSample("all_reduce", 2, 8 * MiB, 0.010),
               CollectiveSample("all_reduce", 2, 16 * MiB, 0.009), CollectiveSample("all_reduce", 2, 32 * MiB, 0.040))
    fit = CollectiveFit("all_reduce", 2, 1e-4, 1e9, 4, 0.5)
    gemm = (GemmSample(64, 64, 64, "float32", 1e-5),)
    profile = HardwareProfile("cpu", "cpu", 1, 1, "2.13.0", "now", gemm, MemorySample(2**20, 1e-4), "gloo", samples, (fit,))
    measured = CollectiveCalibration(profile)
    assert measured.samples("all_reduce", 2)[2] == (16 * MiB, 0.010)  # 0.009 after 0.010: raised to it
    assert measured.time_s("all_reduce", 6 * MiB, 2) == pytest.approx(0.006)
    assert measured.time_s("all_reduce", 64 * MiB, 2) == pytest.approx(0.040 + 0.030 * 2)
    assert measured.time_s("all_reduce", 1 * MiB, 2) == pytest.approx(1e-4 + MiB / 1e9)  # below: the fit
    assert measured.time_s("all_reduce", 1 * MiB, 4) == pytest.approx(1e-4 + 1.5 * MiB / 1e9)  # nearest fit
    assert measured.time_s("all_gather", MiB, 2) is None
    assert sampled_time_s(((1.0, 1.0),), 2.0) is None


def test_cpu_profile_times_the_threads_work():
    """One torch thread on a CPU (each rank under torchrun): its CPU time, which other jobs do not stretch."""
    import time

    import torch

    from autoplan.profiler.gemm import cpu_clock

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert cpu_clock(torch.device("cpu")) is time.thread_time
        torch.set_num_threads(2)
        assert cpu_clock(torch.device("cpu")) is time.perf_counter
    finally:
        torch.set_num_threads(threads)
