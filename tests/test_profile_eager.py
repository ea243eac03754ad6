"""Eager PyTorch on a CPU as the profile measures it and the cost model prices it (issue 20): the
dispatch each kernel adds, fresh-allocation copies by size, causal SDPA's rates, the runtime's kernels
as their torch fallbacks run (norms, silu * mul, gelu, the residual add, cross-entropy).

Each measurement: taken by `autoplan profile` on this CPU, kept in the profile JSON (old files load
without it), read by `calibrate`, and the price moves as the measurement says."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from autoplan.capture import capture
from autoplan.cluster import parse_cluster
from autoplan.cost_model.compute import Efficiency, calibrate, memory_op_bytes, memory_time_s
from autoplan.cost_model.host import host_paced_s
from autoplan.cost_model.eager import AttentionRates, FreshCopyCurve
from autoplan.cost_model.intra_op import make_context, node_compute_s, node_kernels, price_assignment
from autoplan.mesh import MeshShape
from autoplan.models import build_model
from autoplan.models.config import ModelConfig
from autoplan.profiler.attention import measure_attention
from autoplan.profiler.dispatch import measure_cpu_dispatch_s
from autoplan.profiler.memory import measure_fresh_copies
from autoplan.cost_model.kernels import node_kernel
from autoplan.profiler.kernels import CPU_SHAPES, EAGER_BYTES, measure_eager_kernels
from autoplan.profiler.profile import AttentionSample, GemmSample, HardwareProfile, KernelSample, MemorySample
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


def _small_llama(vocab: int = 4096, family: str = "llama"):
    """One Llama (or GPT) layer of benchmarks/step_fidelity.py's width, captured at one sequence of 256 tokens."""
    config = (ModelConfig("eager-llama", "llama", 1, 384, 6, 2, 1024, vocab, 256) if family == "llama"
              else ModelConfig("eager-gpt", "gpt", 1, 384, 6, 6, 1536, vocab, 256))
    graph = capture(build_model(config, "meta", torch.float32), config, 1, 256, torch.float32)
    registry = default_registry()
    strategies = resolve_strategies(graph, registry, config.rule_info(), 1, {})
    return graph, strategies


def _ctx(graph, profile, kernels: str | None = None):
    """The cost context of a microbatch of 8 sequences, priced with `profile` (and the plan's `kernels`)."""
    cluster, eff = calibrate(parse_cluster("1x2xcpu"), None, profile, kernels, dtype="float32")
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
    # the core alone: the zoo's Llama rotates q and k inside it too (`attention_cost.rope_time_s`, tests/test_kernel_costs.py)
    times = {name: node_compute_s(attn, strategies[attn.name],
                                  dataclasses.replace(_ctx(graph, _cpu_profile(attention=a)), rope=False))
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


# ------------------------------------------------------------------------------ the runtime's kernels, eager


def _shape(kernel: str, node) -> dict[str, int]:
    """The `profiler.kernels.CPU_SHAPES`-style shape of the tensor `node`'s kernel runs over."""
    t = node.input_metas[0] if kernel == "cross_entropy" else node.output
    width = {"cross_entropy": "vocab", "silu_mul": "ffn", "bias_gelu": "ffn"}.get(kernel, "hidden")
    return {"tokens": t.numel // t.shape[-1], width: t.shape[-1]}


def _model_bytes(node) -> tuple[float, float]:
    """(fwd, bwd) bytes the cost model prices the node at (`intra_op.node_compute_s`: a norm reads its weights)."""
    params = float(sum(m.nbytes for _, m in node.params))
    fwd, bwd = memory_op_bytes(node, params)
    return fwd + params, bwd + params


@pytest.mark.parametrize("family", ["llama", "gpt"])
def test_eager_kernel_bytes_are_what_the_cost_model_counts_for_their_nodes(family):
    """Each eager kernel's byte count (`EAGER_BYTES`) is the sum of the bytes the cost model counts for the
    nodes it runs (silu and mul: the two nodes of silu_mul), else a measured efficiency misprices them."""
    graph, _ = _small_llama(family=family)
    counted: dict[str, list] = {}
    for node in graph.nodes:
        kernel = node_kernel(node, "replicate", eager=True)
        if kernel is not None:
            fwd, bwd = _model_bytes(node)
            shape = _shape(kernel, node) if node.target != "mul" else None
            counted.setdefault(kernel, []).append((shape, fwd, bwd))
    expected = {"llama": {"rms_norm", "silu_mul", "add", "cross_entropy"},
                "gpt": {"layer_norm", "bias_gelu", "add", "cross_entropy"}}[family]
    assert counted.keys() == expected
    for kernel, rows in counted.items():
        if kernel == "silu_mul":  # one silu and one mul node per layer, the kernel counts both
            rows = [(rows[0][0] or rows[1][0], rows[0][1] + rows[1][1], rows[0][2] + rows[1][2])]
        for shape, fwd, bwd in rows:
            assert EAGER_BYTES[kernel](shape, 4) == (fwd, bwd), (kernel, shape)


def _eager_samples(kernel: str, shape: dict[str, int], fwd_gbps: float, bwd_gbps: float) -> tuple[KernelSample, ...]:
    fwd, bwd = EAGER_BYTES[kernel](shape, 4)
    label = " ".join(f"{k}={v}" for k, v in shape.items())
    return (KernelSample(kernel, "fwd", label, "float32", fwd, fwd / (fwd_gbps * 1e9)),
            KernelSample(kernel, "bwd", label, "float32", bwd, bwd / (bwd_gbps * 1e9)))


def test_eager_kernels_price_their_nodes_at_the_measured_rates_each_pass_apart():
    """RMSNorm measured at 5 GB/s forward and 1 GB/s backward at the node's size (the profile's copy: 10 GB/s),
    and far slower at a larger one: the norm's forward takes its bytes at 5 GB/s and its backward at 1, and
    halving the backward's rate adds its bytes at 1 GB/s;
    the residual add takes its own rate; every other node, and a plan with kernels "triton", prices as
    without the samples."""
    graph, strategies = _small_llama()
    norm_shape, add_shape = {"tokens": 2048, "hidden": 384}, {"tokens": 2048, "hidden": 384}  # 8 x 256 tokens
    larger = _eager_samples("rms_norm", {"tokens": 8192, "hidden": 1024}, 1.0, 0.1)  # priced by size: not read
    measured = _eager_samples("rms_norm", norm_shape, 5.0, 1.0) + _eager_samples("add", add_shape, 2.5, 2.5) + larger
    halved = _eager_samples("rms_norm", norm_shape, 5.0, 0.5) + _eager_samples("add", add_shape, 2.5, 2.5) + larger
    ctxs = {name: _ctx(graph, _cpu_profile(kernels=k), kernels) for name, k, kernels in
            (("plain", (), "auto"), ("measured", measured, "auto"), ("halved", halved, "auto"),
             ("triton", measured, "triton"))}
    times = {name: {n.name: node_compute_s(n, strategies[n.name], c) for n in graph.nodes} for name, c in ctxs.items()}
    norm = _node(graph, "norm")
    add = next(n for n in graph.nodes if n.target == "add")
    norm_fwd, norm_bwd = EAGER_BYTES["rms_norm"](norm_shape, 4)
    assert times["measured"][norm.name][0] == pytest.approx(norm_fwd / 5e9, rel=1e-9)
    assert times["halved"][norm.name][1] - times["measured"][norm.name][1] == pytest.approx(norm_bwd / 1e9, rel=1e-9)
    assert times["measured"][add.name] == pytest.approx(tuple(b / 2.5e9 for b in EAGER_BYTES["add"](add_shape, 4)))
    for name, plain in times["plain"].items():
        if node_kernel(next(n for n in graph.nodes if n.name == name), "replicate", eager=True) in (None, "silu_mul",
                                                                                                  "cross_entropy"):
            assert times["measured"][name] == plain, name
        if "attn_core" not in name:  # the core's RoPE: one Triton kernel a tensor, or torch's five passes
            assert times["triton"][name] == plain, name
    note = ctxs["measured"].efficiency.kernels.note(0.8)
    assert "torch eager" in note and "rms_norm 0.02" in note  # the note gives both passes and sizes pooled


def test_the_runtimes_kernels_are_timed_as_their_torch_fallbacks_on_a_cpu():
    samples = measure_eager_kernels(CPU, quick=True, budget_s=0.005)
    assert [(s.kernel, s.direction) for s in samples] == [(k, d) for k in CPU_SHAPES for d in ("fwd", "bwd")]
    assert all(s.time_s > 0 and s.dtype == "float32" for s in samples)
    assert samples[0].bytes == EAGER_BYTES["rms_norm"](CPU_SHAPES["rms_norm"][0], 4)[0]
    assert measure_eager_kernels(torch.device("meta")) == ()


# ------------------------------------------------------------------------------ the optimizer, tensor by tensor


def test_the_optimizer_is_priced_at_the_bandwidth_of_its_tensors_size():
    """AdamW's passes at the fresh-copy curve read at the tensor's fp32 bytes (in place: no slower than the flat
    copy; the temporaries into d: the curve alone), all at the flat copy without a curve; and in a plan, a curve
    twice as fast at the model's tensor sizes halves the optimizer's price."""
    from autoplan.api import estimate
    from autoplan.cost_model.optimizer import ADAMW_FRESH_BYTES, adamw_step_bytes, adamw_time_s

    curve = (MemorySample(MiB, 2 * MiB / 50e9), MemorySample(16 * MiB, 32 * MiB / 50e9),
             MemorySample(64 * MiB, 128 * MiB / 5e9))
    flat, curved = (_ctx(_small_llama()[0], p).efficiency for p in (_cpu_profile(), _cpu_profile(fresh_copies=curve)))
    device = parse_cluster("1x2xcpu").device
    device = dataclasses.replace(device, memory_bandwidth_bytes_per_s=1e10)  # the profile's flat copy
    per_param = adamw_step_bytes(4, 4)
    assert adamw_time_s(1e6, 4, 4, 2**18, device, flat) == pytest.approx(per_param * 1e6 / 1e10 / 0.8)
    assert adamw_time_s(1e6, 4, 4, 2**18, device, curved) == pytest.approx(per_param * 1e6 / 50e9 / 0.8)
    big = (per_param - ADAMW_FRESH_BYTES) * 64e6 / 1e10 + ADAMW_FRESH_BYTES * 64e6 / 5e9
    assert adamw_time_s(64e6, 4, 4, 2**24, device, curved) == pytest.approx(big / 0.8)

    def optimizer_s(bandwidth: float) -> float:
        fresh = tuple(MemorySample(m.buffer_bytes, m.time_s * 50e9 / bandwidth) for m in curve)
        plan = estimate(ModelConfig("opt-llama", "llama", 2, 384, 6, 2, 1024, 4096, 256), "1x1xcpu", 2, 256,
                        mesh=MeshShape(), microbatch_size=2, zero_stage=0, recompute="none", dtype="float32",
                        profile=_cpu_profile(fresh_copies=fresh))
        return plan.predicted.time.optimizer_s

    assert optimizer_s(100e9) == pytest.approx(optimizer_s(50e9) / 2, rel=1e-6)


def test_eager_kernels_take_their_inputs_in_turn_from_copies_beyond_the_cache():
    """`eager_copies`: separate inputs filling the cold pool (2 to 64 copies), each its own storage, each call
    of the kernel's torch fallback runnable forward and backward (as `time_eager_s` runs them)."""
    from autoplan.profiler.gemm import COLD_POOL_BYTES
    from autoplan.profiler.kernels import eager_copies

    s = dict(tokens=256, hidden=384)
    copies = eager_copies("rms_norm", s, torch.device("cpu"), torch.float32)
    nbytes = sum(t.numel() * t.element_size() for t in copies[0][0])
    assert len(copies) == min(64, -(-COLD_POOL_BYTES // nbytes))
    assert len({inputs[0].data_ptr() for inputs, _ in copies}) == len(copies)
    inputs, fn = copies[-1]
    out = fn(*inputs)
    assert all(g is not None for g in torch.autograd.grad(out, inputs, torch.ones_like(out)))
    big = eager_copies("cross_entropy", dict(tokens=4096, vocab=8192), torch.device("cpu"), torch.float32)
    assert len(big) == 2  # 128 MiB of logits: two copies
