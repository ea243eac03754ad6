"""Eager PyTorch on a CPU as the profile measures it and the cost model prices it (issue 20): the
dispatch each kernel adds, fresh-allocation copies by size, causal SDPA's rates.

Each measurement: taken by `autoplan profile` on this CPU, kept in the profile JSON (old files load
without it), read by `calibrate`, and the price moves as the measurement says."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from autoplan.capture import capture
from autoplan.cluster import parse_cluster
from autoplan.cost_model.compute import Efficiency, calibrate, host_paced_s, memory_time_s
from autoplan.cost_model.eager import AttentionRates, FreshCopyCurve
from autoplan.cost_model.intra_op import make_context, node_compute_s, node_kernels, price_assignment
from autoplan.mesh import MeshShape
from autoplan.models import build_model
from autoplan.models.config import ModelConfig
from autoplan.profiler.attention import measure_attention
from autoplan.profiler.dispatch import measure_cpu_dispatch_s
from autoplan.profiler.memory import measure_fresh_copies
from autoplan.profiler.profile import AttentionSample, GemmSample, HardwareProfile, MemorySample
from autoplan.cost_model.intra_op_problem import resolve_strategies
from autoplan.strategies import default_registry

MiB = 2**20
CPU = torch.device("cpu")


def _cpu_profile(**fields) -> HardwareProfile:
    """A float32 CPU profile: 100 GFLOP/s GEMMs, a 10 GB/s preallocated copy, and `fields`."""
    gemm = tuple(GemmSample(s, s, s, "float32", 2.0 * s ** 3 / 1e11) for s in (64, 256, 1024))
    base = HardwareProfile("cpu", "cpu", 2**34, 1, "2.13.0", "2026-11-26T00:00:00+00:00", gemm,
                           MemorySample(256 * MiB, 2 * 256 * MiB / 1e10), "")
    return dataclasses.replace(base, **fields)


def _small_llama(vocab: int = 4096):
    """One Llama layer of benchmarks/step_fidelity.py's width, captured at one sequence of 256 tokens."""
    config = ModelConfig("eager-llama", "llama", 1, 384, 6, 2, 1024, vocab, 256)
    graph = capture(build_model(config, "meta", torch.float32), config, 1, 256, torch.float32)
    registry = default_registry()
    strategies = resolve_strategies(graph, registry, config.rule_info(), 1, {})
    return graph, strategies


def _ctx(graph, profile):
    """The cost context of a microbatch of 8 sequences, priced with `profile`."""
    cluster, eff = calibrate(parse_cluster("1x2xcpu"), None, profile, dtype="float32")
    return make_context(graph, cluster, MeshShape(), 8, "float32", eff)


def _node(graph, kind):
    return next(n for n in graph.nodes if n.op_kind == kind)


def test_the_new_measurements_round_trip_and_old_files_load_without_them():
    profile = _cpu_profile(host_kernel_s=1.5e-5, fresh_copies=(MemorySample(MiB, 1e-4), MemorySample(64 * MiB, 0.06)),
                           attention=(AttentionSample(6, 256, 64, "float32", 2e-3, 5e-3),))
    assert HardwareProfile.from_json(profile.to_json()) == profile
    old = profile.to_json()
    for key in ("fresh_copies", "attention", "host_kernel_s"):
        del old[key]
    loaded = HardwareProfile.from_json(old)
    assert loaded.fresh_copies == () and loaded.attention == () and loaded.host_kernel_s is None
    with pytest.raises(Exception, match="attention .* fwd_s must be a finite number > 0"):
        AttentionSample(6, 256, 64, "float32", 0.0, 1e-3)


def test_cpu_measurements_are_taken_as_eager_pytorch_runs():
    fresh = measure_fresh_copies(CPU, quick=True, budget_s=0.01)
    assert [m.buffer_bytes for m in fresh] == [4 * MiB, 64 * MiB] and all(m.time_s > 0 for m in fresh)
    attention = measure_attention(CPU, quick=True, budget_s=0.01)
    assert [(a.batch_heads, a.seq) for a in attention] == [(6, 256), (24, 256)]
    assert all(a.fwd_s > 0 and a.bwd_s > 0 for a in attention)
    per_kernel, per_block, kernels = measure_cpu_dispatch_s(CPU, 1e-6, quick=True)
    assert kernels > 20 and per_block > kernels * 1e-6 and per_kernel == pytest.approx(per_block / kernels - 1e-6)
    assert measure_fresh_copies(torch.device("meta")) == () and measure_attention(torch.device("meta")) == ()


def test_the_fresh_copy_curve_interpolates_in_log_space_and_clamps():
    curve = FreshCopyCurve(((MiB, 20e9), (16 * MiB, 20e9), (64 * MiB, 2e9)))
    assert curve.bandwidth(1.0) == 20e9 and curve.bandwidth(8 * MiB) == pytest.approx(20e9)
    assert curve.bandwidth(32 * MiB) == pytest.approx((20e9 * 2e9) ** 0.5)  # halfway in log size
    assert curve.bandwidth(2**40) == 2e9


def test_memory_bound_ops_are_priced_at_the_fresh_copy_bandwidth_of_their_buffers():
    """The cross-entropy over 8 x 256 x 32768 fp32 logits (a 256 MiB buffer per kernel) pays the slow end of
    the curve; a norm over 3 MiB, where the curve is faster than the flat copy, keeps the flat copy."""
    graph, strategies = _small_llama(vocab=32768)
    slow_above_32 = (MemorySample(MiB, 2 * MiB / 20e9), MemorySample(16 * MiB, 32 * MiB / 20e9),
                     MemorySample(64 * MiB, 128 * MiB / 2e9), MemorySample(256 * MiB, 512 * MiB / 2e9))
    flat, curved = _ctx(graph, _cpu_profile()), _ctx(graph, _cpu_profile(fresh_copies=slow_above_32))
    ce, norm = _node(graph, "cross_entropy"), _node(graph, "norm")
    ce_flat, ce_curved = (node_compute_s(ce, strategies[ce.name], c) for c in (flat, curved))
    assert ce_curved[0] == pytest.approx(5 * ce_flat[0], rel=1e-6)  # 2 GB/s against the flat 10 GB/s
    norm_flat, norm_curved = (node_compute_s(norm, strategies[norm.name], c)[0] for c in (flat, curved))
    assert norm_curved == pytest.approx(norm_flat, rel=1e-6)  # 20 GB/s: never faster than the flat copy's 10
    in_place = [memory_time_s(1e9, c.cluster.device, c.efficiency) for c in (flat, curved)]
    assert in_place[0] == in_place[1]  # in-place traffic (the optimizer, .grad accumulation): the flat copy


def test_attention_is_priced_at_the_measured_sdpa_rates():
    graph, strategies = _small_llama()
    attn = _node(graph, "attention")
    batch_heads = 8 * 6  # 8 sequences x 6 heads, 256 tokens, head dim 64
    slow = (AttentionSample(batch_heads, 256, 64, "float32", 0.04, 0.12),)
    fast = (AttentionSample(batch_heads, 256, 64, "float32", 0.02, 0.06),)
    times = {name: node_compute_s(attn, strategies[attn.name], _ctx(graph, _cpu_profile(attention=a)))
             for name, a in (("slow", slow), ("fast", fast))}
    assert times["slow"] == pytest.approx((0.04, 0.12), rel=1e-6)
    assert times["fast"] == pytest.approx((0.02, 0.06), rel=1e-6)
    rates = AttentionRates.from_profile(_cpu_profile(attention=slow + (AttentionSample(8, 1024, 64, "float32", 1.0, 2.0),)))
    assert rates.rates(1.0, "bfloat16") is None and rates.rates(1.0, "float32") == rates.rates(2.0, "float32")


def test_a_cpus_dispatch_adds_to_every_kernel_serially():
    """On a CPU each kernel's dispatch runs on the core that runs it: a layer's time is its kernels' own
    plus kernels x host_kernel_s, forward and backward apart; on a GPU the same figure overlaps."""
    assert host_paced_s([(1.0, 2), (0.5, 1)], 0.1, serial=True) == pytest.approx(1.8)
    assert host_paced_s([(1.0, 2), (0.5, 1)], 0.1) < 1.8
    graph, strategies = _small_llama()
    layer = dataclasses.replace(graph, nodes=tuple(n for n in graph.nodes if n.layer == 0))
    without, with_host = _ctx(graph, _cpu_profile()), _ctx(graph, _cpu_profile(host_kernel_s=2e-5))
    assert without.efficiency.host_kernel_s == 0.0 and with_host.efficiency.host_serial is True
    fwd, bwd = (sum(node_kernels(n, with_host)[k] for n in layer.nodes) for k in (0, 1))
    own, hosted = price_assignment(layer, strategies, without), price_assignment(layer, strategies, with_host)
    assert hosted.fwd_compute_s == pytest.approx(own.fwd_compute_s + fwd * 2e-5)
    assert hosted.bwd_compute_s == pytest.approx(own.bwd_compute_s + bwd * 2e-5)
    assert Efficiency().resolved(parse_cluster("1x8xh100").device).host_serial is False
