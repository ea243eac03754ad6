"""Measured fused-kernel efficiencies: in the hardware profile, in the cost model, in the plan.

A synthetic H200 profile (copy bandwidth 4.0 TB/s) carries kernel samples whose efficiencies are
known by construction; the cost model must price the nodes each kernel runs at that efficiency when
the plan's kernels resolve to Triton, and at the assumed `Efficiency.memory` otherwise.
"""

from __future__ import annotations

import json

import pytest

from autoplan.cluster import parse_cluster
from autoplan.cost_model.compute import Efficiency, calibrate
from autoplan.cost_model.intra_op import make_context, node_compute_s
from autoplan.cost_model.kernels import FusedKernels, fused_kernels, measured_efficiencies, node_kernel
from autoplan.models import get_model_config
from autoplan.api import capture_model
from autoplan.profiler.profile import GemmSample, HardwareProfile, KernelSample, MemorySample, ProfileError
from autoplan.strategies import default_registry

COPY_BYTES_PER_S = 4.0e12  # the synthetic profile's copy: 2 * 2**30 bytes in 2**31 / 4e12 s
GIB = 2**30


def _kernel_samples(efficiency: dict[str, float]) -> tuple[KernelSample, ...]:
    """fwd and bwd samples per kernel whose total bytes / total time = efficiency * copy."""
    out = []
    for kernel, e in efficiency.items():
        for direction, nbytes in (("fwd", GIB), ("bwd", 3 * GIB)):
            out.append(KernelSample(kernel, direction, "tokens=8192 hidden=4096", "bfloat16", nbytes,
                                    nbytes / (e * COPY_BYTES_PER_S)))
    return tuple(out)


def _profile(efficiency: dict[str, float] | None = None) -> HardwareProfile:
    gemm = tuple(GemmSample(n, n, n, "bfloat16", 2.0 * n**3 / 600e12) for n in (1024, 4096, 8192))
    return HardwareProfile("NVIDIA H200", "cuda", 141_000_000_000, 8, "2.13.0", "2026-11-20T00:00:00+00:00",
                           gemm, MemorySample(GIB, 2 * GIB / COPY_BYTES_PER_S), "",
                           kernels=_kernel_samples(efficiency or {}))


# ------------------------------------------------------------------------------ the profile file


def test_profile_with_kernels_round_trips_and_old_files_load(tmp_path):
    profile = _profile({"rms_norm": 0.5, "cross_entropy": 0.9})
    assert HardwareProfile.from_json(json.loads(profile.dumps())) == profile
    path = tmp_path / "h200.json"
    profile.save(path)
    assert HardwareProfile.load(path) == profile
    old = profile.to_json()
    del old["kernels"]  # written before kernel samples existed
    path.write_text(json.dumps(old))
    assert HardwareProfile.load(path).kernels == ()


@pytest.mark.parametrize(("edit", "message"), [
    (dict(kernel="softmax"), r"kernel 'softmax' is not one of"),
    (dict(direction="both"), r"direction must be 'fwd' or 'bwd'"),
    (dict(time_s=0.0), r"time_s must be a finite number > 0"),
    (dict(bytes=-4), r"bytes must be a positive integer"),
])
def test_bad_kernel_samples_are_refused_by_name(tmp_path, edit, message):
    data = _profile({"rms_norm": 0.5}).to_json()
    data["kernels"][0].update(edit)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match=message):
        HardwareProfile.load(path)


def test_measured_efficiency_is_total_bytes_over_total_time_over_copy():
    effs = dict(measured_efficiencies(_profile({"layer_norm": 0.7, "moe_permute": 1.2})))
    assert effs.keys() == {"layer_norm", "moe_permute"}
    assert effs["layer_norm"] == pytest.approx(0.7, rel=1e-12)
    assert effs["moe_permute"] == pytest.approx(1.2, rel=1e-12)  # faster than copy: kept, capped when used
    assert FusedKernels("auto", True, tuple(effs.items())).efficiency("moe_permute") == 1.0


# ------------------------------------------------------------------------------ which kernels run


def test_kernels_option_resolves_per_cluster():
    h200, cpu = parse_cluster("8xh200").device, parse_cluster("2xcpu").device
    assert fused_kernels("auto", h200).triton and not fused_kernels("auto", cpu).triton
    assert fused_kernels("triton", cpu).triton and not fused_kernels("torch", h200).triton
    measured = fused_kernels("auto", h200, _profile({"rms_norm": 0.5}))
    assert measured.measured == (("rms_norm", pytest.approx(0.5)),) and "NVIDIA H200" in measured.source
    assert fused_kernels("torch", h200, _profile({"rms_norm": 0.5})).measured == ()
    # an Efficiency made without calibrate (explain, plan_from_assignment) resolves with its device
    assert Efficiency().kernels.triton is None
    assert Efficiency().resolved(h200).kernels.triton and not Efficiency().resolved(cpu).kernels.triton


def test_node_kernels_of_the_built_in_models():
    by_target = {}
    for model in ("tiny-gpt", "tiny-llama", "tiny-moe"):
        for node in capture_model(get_model_config(model), 16, "bfloat16").nodes:
            by_target.setdefault((node.op_kind, node.target), set()).add(node_kernel(node, "replicate"))
    assert by_target[("norm", "RMSNorm")] == {"rms_norm"} and by_target[("norm", "LayerNorm")] == {"layer_norm"}
    assert by_target[("elementwise", "silu")] == by_target[("elementwise", "mul")] == {"silu_mul"}
    assert by_target[("elementwise", "gelu")] == {"bias_gelu"}
    assert by_target[("cross_entropy", "LMLoss")] == {"cross_entropy"}
    assert by_target[("moe", "MoEFeedForward")] == {"moe_permute"}
    assert by_target[("elementwise", "add")] == by_target[("linear", "Linear")] == {None}


# ------------------------------------------------------------------------------ node prices


def _node_times(kernels: str, profile: HardwareProfile | None, cluster: str = "1xh200") -> dict[str, tuple]:
    """(fwd, bwd) seconds of every node of tiny-llama under "replicate", calibrated as the planner does."""
    graph = capture_model(get_model_config("tiny-llama"), 16, "bfloat16")
    # rooflines alone: every kernel of tiny-llama is shorter than the launch floor, which would hide them
    calibrated, eff = calibrate(parse_cluster(cluster), Efficiency(kernel_floor_s=0.0), profile, kernels)
    ctx = make_context(graph, calibrated, _mesh(), 1, "bfloat16", eff)
    registry, info = default_registry(), get_model_config("tiny-llama").rule_info()
    return {n.name: node_compute_s(n, registry.strategies(n, 1, info)[0], ctx) for n in graph.nodes}


def _mesh():
    from autoplan.mesh import MeshShape
    return MeshShape(dp=1, tp=1)


def test_a_lower_measured_norm_efficiency_slows_norm_nodes_by_its_ratio():
    """rms_norm measured at 0.4 of copy vs the assumed 0.80: norm forwards take exactly 2x; every
    other node, and every node under kernels="torch", is priced as without the measurement."""
    slow = _profile({"rms_norm": 0.4})
    triton, torch_, plain = (_node_times("auto", slow), _node_times("torch", slow),
                             _node_times("auto", _profile()))
    norms = [n for n in triton if "norm" in n]
    assert norms
    for name, (fwd, bwd) in triton.items():
        if name in norms:
            assert fwd == pytest.approx(2 * plain[name][0], rel=1e-9), name
            assert bwd > plain[name][1], name  # the weight-grad accumulation stays at 0.80
        else:
            assert (fwd, bwd) == plain[name], name
        if "attn_core" not in name:  # the core's RoPE runs in torch's five passes (the RoPE test below)
            assert torch_[name] == plain[name], name


def test_without_measurements_triton_keeps_the_assumed_efficiency():
    """Every node but the attention cores (their RoPE: one Triton kernel or torch's five passes) is priced alike."""
    def but_attention(times):
        return {name: t for name, t in times.items() if "attn_core" not in name}
    assert but_attention(_node_times("auto", None)) == but_attention(_node_times("torch", None))
    assert but_attention(_node_times("auto", _profile())) == but_attention(_node_times("torch", _profile()))


# ------------------------------------------------------------------------------ the plan says which


def _estimate(kernels: str, profile: HardwareProfile | None):
    from autoplan.mesh import MeshShape
    from autoplan.api import estimate

    return estimate("tiny-llama", "1xh200", 8, 64, mesh=MeshShape(dp=1, tp=1), microbatch_size=1, zero_stage=0,
                    recompute="none", profile=profile, kernels=kernels,
                    efficiency=Efficiency(kernel_floor_s=0.0, host_kernel_s=0.0))  # rooflines alone (`_node_times`)


def test_plan_notes_say_measured_or_assumed_and_carry_the_option():
    from autoplan.cli.explain import explain_plan

    slow = _profile({"rms_norm": 0.2, "silu_mul": 0.2, "cross_entropy": 0.2})
    measured, eager, assumed = _estimate("auto", slow), _estimate("torch", slow), _estimate("triton", None)
    assert (measured.kernels, eager.kernels, assumed.kernels) == ("auto", "torch", "triton")
    note = next(n for n in measured.provenance.notes if n.startswith("fused kernels"))
    assert "Triton" in note and "measured on 'NVIDIA H200'" in note and "rms_norm 0.20" in note
    assert any("torch eager" in n for n in eager.provenance.notes)
    assert any("assumed 0.80" in n and "Triton" in n for n in assumed.provenance.notes)
    assert measured.predicted.step_time_s > eager.predicted.step_time_s
    assert "measured on 'NVIDIA H200'" in explain_plan(measured, ops=False)


def test_profile_on_cpu_skips_the_kernels_saying_why(capsys):
    import torch

    from autoplan.profiler.cli import kernel_samples

    found, why = kernel_samples(torch.device("cpu"), quick=True, dtype=None)
    assert found == () and "CUDA" in why


def test_benchmark_rows_become_profile_samples():
    from autoplan.profiler.kernels import BYTES, Row, samples

    fwd_bytes, bwd_bytes = BYTES["rms_norm"](dict(tokens=8192, hidden=4096), 2)
    rows = [Row("rms_norm", "fwd", "tokens=8192 hidden=4096", fwd_bytes, {"triton": 2e-5, "eager": 5e-5}),
            Row("rms_norm", "bwd", "tokens=8192 hidden=4096", bwd_bytes, {"eager": 9e-5})]
    (sample,) = samples(rows, "bfloat16")
    assert (sample.kernel, sample.direction, sample.bytes, sample.time_s) == ("rms_norm", "fwd", fwd_bytes, 2e-5)
    assert sample.bandwidth_bytes_per_s == pytest.approx(fwd_bytes / 2e-5)


@pytest.mark.gpu
def test_gpu_measures_every_kernel_into_the_profile():
    import torch

    from autoplan.profiler.kernels import SHAPES, measure_kernels, skip_reason

    device = torch.device("cuda")
    if not torch.cuda.is_available() or skip_reason(device) is not None:
        pytest.skip(f"needs CUDA and triton: {skip_reason(device) if torch.cuda.is_available() else 'no CUDA'}")
    found = measure_kernels(device, quick=True, budget_s=0.01)
    assert {(s.kernel, s.direction) for s in found} == {(k, d) for k in SHAPES for d in ("fwd", "bwd")}
    profile = HardwareProfile("NVIDIA H200", "cuda", 1, 1, torch.__version__, "now", _profile().gemm,
                              _profile().memory, "", kernels=found)
    effs = dict(measured_efficiencies(profile))
    assert effs.keys() == set(SHAPES) and all(0 < e < 5 for e in effs.values())


# ------------------------------------------------------------------------------ RoPE inside the attention core


def test_rope_is_priced_inside_the_zoo_llamas_attention_core_and_not_the_gpts():
    """The zoo's Llama rotates q and k inside its attention core (`intra_op.attention_rope`), so its attention
    node costs the core plus RoPE's passes over q and k: Triton's kernel 2 bytes per byte in one kernel a tensor
    each way, torch's 10 in 5 (`attention_cost.ROPE_PASSES`); the GPT has no RoPE, and a measured `rope` efficiency
    scales the Triton pass."""
    from dataclasses import replace

    from autoplan.cost_model.attention_cost import attention_time_s, rope_time_s
    from autoplan.cost_model.intra_op import attention_rope

    llama = capture_model(get_model_config("tiny-llama"), 16, "bfloat16")
    assert attention_rope(llama) and not attention_rope(capture_model(get_model_config("tiny-gpt"), 16, "bfloat16"))
    node = next(n for n in llama.nodes if n.op_kind == "attention")
    q, k = node.input_metas[:2]
    for kernels, per_byte, launched in (("auto", 2.0, 2), ("torch", 10.0, 10)):
        calibrated, eff = calibrate(parse_cluster("1xh200"), Efficiency(kernel_floor_s=0.0), None, kernels)
        ctx = make_context(llama, calibrated, _mesh(), 1, "bfloat16", eff)
        core = attention_time_s(q.shape[0] * ctx.batch_scale * q.shape[-1] / ctx.head_dim, q.shape[1], ctx.head_dim, 2,
                                calibrated.device, "bfloat16", ctx.efficiency)
        rope = rope_time_s((q.nbytes + k.nbytes) * ctx.batch_scale, 2, calibrated.device, ctx.efficiency)
        strategy = default_registry().strategies(node, 1, get_model_config("tiny-llama").rule_info())[0]
        priced = node_compute_s(node, strategy, ctx)
        assert priced == pytest.approx((core[0] + rope[0], core[1] + rope[1]))
        moved = per_byte * (q.nbytes + k.nbytes) * ctx.batch_scale
        assert rope[0] == pytest.approx(moved / (calibrated.device.memory_bandwidth_bytes_per_s * ctx.efficiency.memory))
        floored = replace(ctx.efficiency, kernel_floor_s=1e-3)  # above any roofline: the kernels x the floor
        assert rope_time_s(1.0, 2, calibrated.device, floored) == pytest.approx((launched * 1e-3,) * 2)
        no_rope = node_compute_s(node, strategy, replace(ctx, rope=False))
        assert no_rope == pytest.approx(core)
    slow = calibrate(parse_cluster("1xh200"), Efficiency(kernel_floor_s=0.0), _profile({"rope": 0.4}), "auto")[1]
    fast = calibrate(parse_cluster("1xh200"), Efficiency(kernel_floor_s=0.0), _profile({"rope": 0.8}), "auto")[1]
    ratio = rope_time_s(1e9, 2, calibrated.device, slow)[0] / rope_time_s(1e9, 2, calibrated.device, fast)[0]
    assert ratio == pytest.approx(2.0)

