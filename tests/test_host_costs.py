"""Cost model: the host's share of a step (tier 1): eager PyTorch's dispatch of every kernel paced against the
device's work (`cost_model.host`), recomputation's host cost per forward kernel, and the optimizer step of
bf16 parameters with fp32 masters."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch

from autoplan.api import estimate
from autoplan.capture import capture
from autoplan.cluster import parse_cluster
from autoplan.cost_model.compute import Efficiency, calibrate
from autoplan.cost_model.host import HOST_KERNEL_S
from autoplan.cost_model.intra_op import make_context, node_kernels, price_assignment
from autoplan.cost_model.intra_op_problem import resolve_strategies
from autoplan.errors import ConfigError
from autoplan.mesh import MeshShape
from autoplan.models import build_model, get_model_config
from autoplan.models.config import ModelConfig
from autoplan.solver.intra_op import megatron_assignment
from autoplan.strategies import default_registry

from test_cost_model import _h100_profile


def _small_tp8_layer():
    """(graph, its layer 0, Megatron's tp 8 strategies, an H100 context): a layer whose kernels take microseconds."""
    config = ModelConfig("small-llama", "llama", 2, 512, 8, 8, 1024, 512, 128)
    graph = capture(build_model(config, "meta", torch.bfloat16), config, 1, 128)
    registry, info = default_registry(), config.rule_info()
    strategies = resolve_strategies(graph, registry, info, 8, megatron_assignment(graph, registry, 8, info))
    layer = dataclasses.replace(graph, nodes=tuple(n for n in graph.nodes if n.layer == 0))
    return graph, layer, strategies, make_context(graph, parse_cluster("1x8xh100"), MeshShape(tp=8), 1, "bfloat16",
                                                  Efficiency(matmul=0.7))


def test_a_layer_takes_at_least_the_hosts_dispatch_of_its_kernels_forward_and_backward_apart():
    """The same small tp 8 layer: its kernels' own times are microseconds, so on a GPU the host's dispatch
    (kernels x host_kernel_s, `host.host_paced_s`) sets its forward and its backward; a wide layer's GEMMs
    hide it but for the first kernel's issue; a CPU's ops hold their dispatch already (0); a profile's
    measurement replaces the default."""
    graph, layer, strategies, ctx = _small_tp8_layer()
    assert ctx.efficiency.host_kernel_s == HOST_KERNEL_S
    fwd, bwd = (sum(node_kernels(n, ctx)[k] for n in layer.nodes) for k in (0, 1))
    assert (fwd, bwd) == (14, 33)  # as the floor counts them
    hosted, device = price_assignment(layer, strategies, ctx), price_assignment(layer, strategies, ctx, host=False)
    assert device.fwd_compute_s < 0.5 * fwd * HOST_KERNEL_S and device.bwd_compute_s < 0.5 * bwd * HOST_KERNEL_S
    for paced, own, kernels in ((hosted.fwd_compute_s, device.fwd_compute_s, fwd), (hosted.bwd_compute_s, device.bwd_compute_s, bwd)):
        assert kernels * HOST_KERNEL_S <= paced <= kernels * HOST_KERNEL_S + own
    wide = ModelConfig("wide-llama", "llama", 2, 8192, 64, 8, 28672, 512, 4096)
    wide_graph = capture(build_model(wide, "meta", torch.bfloat16), wide, 1, 4096)
    wide_layer = dataclasses.replace(wide_graph, nodes=tuple(n for n in wide_graph.nodes if n.layer == 0))
    registry = default_registry()
    wide_strategies = resolve_strategies(wide_graph, registry, wide.rule_info(), 1,
                                         megatron_assignment(wide_graph, registry, 1, wide.rule_info()))
    wide_ctx = make_context(wide_graph, parse_cluster("1x8xh100"), MeshShape(dp=8), 1, "bfloat16")
    paced, own = (price_assignment(wide_layer, wide_strategies, wide_ctx, host=h) for h in (True, False))
    for a, b in ((paced.fwd_compute_s, own.fwd_compute_s), (paced.bwd_compute_s, own.bwd_compute_s)):
        assert b < a <= 1.01 * b  # 30 ms of GEMMs hide 4 ms of dispatch, but for the first small ops' issue
    cpu_ctx = make_context(graph, parse_cluster("1x8xcpu"), MeshShape(tp=8), 1, "float32", Efficiency(matmul=0.7))
    assert cpu_ctx.efficiency.host_kernel_s == 0.0
    _, measured = calibrate(parse_cluster("1x8xh100"), None, dataclasses.replace(_h100_profile(0.5), host_kernel_s=5e-5))
    assert measured.host_kernel_s == 5e-5
    with pytest.raises(ConfigError, match="host_kernel_s=0.5 must be in"):
        Efficiency(host_kernel_s=0.5)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(0.0, 1e-2), st.integers(0, 6)), max_size=30), st.floats(0.0, 2e-4))
def test_host_paced_time_lies_between_the_busier_resource_and_both_in_turn(ops, host_s):
    """`host_paced_s`: no less than the device's work or the host's issue alone, no more than the two one after
    the other; with no host cost, the device's sum."""
    from autoplan.cost_model.host import host_paced_s

    device, issued = sum(d for d, _ in ops), host_s * sum(k for _, k in ops)
    paced = host_paced_s(ops, host_s)
    assert max(device, issued) * (1 - 1e-12) <= paced <= (device + issued) * (1 + 1e-12) + 1e-15
    assert host_paced_s(ops, 0.0) == pytest.approx(device, rel=1e-12, abs=1e-15)


def test_a_recomputed_layer_pays_the_hosts_rerun_as_the_device_runs_it():
    """`Efficiency.host_recompute_s`: the host's cost per forward kernel of a recomputed layer, forward and re-run
    (`profiler.dispatch.measure_recompute_host_s`). On a GPU the small tp 8 layer is host-bound, so each kind's
    recompute is at least its forward kernels x (forward + re-run host cost), and saving the GEMMs' outputs
    (selective) re-runs no GEMM on the device; on a CPU the host's seconds add to the re-run ops' own."""
    from autoplan.cost_model.host import CPU_RECOMPUTE_S, GPU_RECOMPUTE_S

    graph, layer, strategies, ctx = _small_tp8_layer()
    assert ctx.efficiency.host_recompute_s == GPU_RECOMPUTE_S
    kernels = sum(node_kernels(n, ctx)[0] for n in layer.nodes)
    cost = price_assignment(layer, strategies, ctx)
    rerun = dict(cost.layer_recompute_s)
    for kind, forward_s, rerun_s in GPU_RECOMPUTE_S:
        assert kernels * (forward_s + rerun_s) <= rerun[kind] <= kernels * (forward_s + rerun_s) + cost.layer_fwd_compute_s
    assert rerun["selective"] > rerun["full"]  # selective checkpointing's modes cost more than the GEMMs it saves
    assert price_assignment(layer, strategies, ctx, host=False).layer_recompute_s == ()  # the ILP: kernels' own times
    cpu = make_context(graph, parse_cluster("1x8xcpu"), MeshShape(tp=8), 1, "float32", Efficiency(matmul=0.7))
    cost = price_assignment(layer, strategies, cpu)
    own, saved = cost.layer_fwd_compute_s, dict(cost.layer_saved_fwd_s)
    for kind, forward_s, rerun_s in CPU_RECOMPUTE_S:
        reran = own - sum(saved.get(f, 0.0) for f in ("matmul", "attention") if kind == "selective" or
                          (kind == "matmul-only" and f == "matmul"))
        assert dict(cost.layer_recompute_s)[kind] == pytest.approx(reran + kernels * (forward_s + rerun_s), rel=1e-9)
    # a CPU profile's figures price its steps; a GPU's are not used (`host.GPU_RECOMPUTE_S`, fitted to steps)
    measured = {"full": [1e-5, 1e-4], "selective": [2e-5, 3e-4]}
    gpu = dataclasses.replace(_h100_profile(0.5), host_recompute_s=measured)
    cluster, calibrated = calibrate(parse_cluster("1x8xh100"), None, gpu)
    assert calibrated.resolved(cluster.device).host_recompute_s == GPU_RECOMPUTE_S
    cpu_profile = dataclasses.replace(gpu, device_kind="cpu", device_name="a CPU")
    _, calibrated = calibrate(parse_cluster("1x8xcpu"), None, cpu_profile)
    assert calibrated.host_recompute_s == (("full", 1e-5, 1e-4), ("selective", 2e-5, 3e-4))
    with pytest.raises(ConfigError, match=r"host_recompute_s\['full'\]=\(0.0, 0.5\) must be"):
        Efficiency(host_recompute_s=(("full", 0.0, 0.5),))


@pytest.mark.parametrize("dp, zero_stage", [(1, 0), (2, 1), (2, 3)])
def test_bf16_master_optimizer_is_adamw_on_the_masters_and_their_cast(dp, zero_stage):
    """Under bf16-master (ZeRO 0-2) the optimizer part is AdamW on the fp32 masters and their cast into the bf16
    weights (`adamw_step_bytes`: 90 bytes per parameter against autocast's 84), on a GPU as on a CPU: the
    runtime keeps no host op per parameter tensor (one foreach copy per bucket, the gradient norm on the
    device). Under ZeRO 3 FSDP2's policy keeps the masters: autocast's step. The host's work per tensor stepped
    is off here (its own test below: the masters are fewer tensors). Where the step is on master slices (bf16-master,
    ZeRO 1/2), each bucket's values are then copied into the parameters: read and write w bytes per local parameter,
    taken off both sides here (`test_precision_pricing`)."""
    from autoplan.cost_model.compute import memory_time_s
    from autoplan.cost_model.optimizer import adamw_step_bytes

    config = dataclasses.replace(get_model_config("tiny-llama"), hidden=1024, ffn_hidden=4096)  # AdamW above the kernel floor

    def optimizer_s(cluster: str, precision: str) -> float:
        plan = estimate(config, cluster, 8, 64, mesh=MeshShape(dp=dp), microbatch_size=4 // dp, zero_stage=zero_stage,
                        recompute="none", precision=precision, efficiency=Efficiency(optimizer_host_s=(0.0, 0.0)))
        masters = zero_stage in (1, 2) or (precision == "bf16-master" and zero_stage == 0)
        weight = 2 if precision == "bf16-master" else 4
        copied = memory_time_s(2 * weight * config.num_parameters(), plan.cluster.device, Efficiency()) if masters else 0.0
        return plan.predicted.time.optimizer_s - copied

    cast = adamw_step_bytes(4, 2) / adamw_step_bytes(4, 4) if zero_stage < 3 else 1.0
    for device in ("h100", "cpu"):
        assert optimizer_s(f"1x{dp}x{device}", "bf16-master") == pytest.approx(
            cast * optimizer_s(f"1x{dp}x{device}", "autocast"), rel=0.01), device


def test_each_parameter_tensor_is_counted_once_in_the_part_that_holds_it():
    """`Tally.tensors`: the layers', the embedding's and the head's parameter tensors sum to the model's own
    (a tied embedding and head count once), whatever tp splits them, and a layer holds its module's."""
    from autoplan.cost_model.parts import solution_parts
    from autoplan.api import search_context

    for name in ("tiny-llama", "tiny-gpt"):
        config = get_model_config(name)
        model = build_model(config, "meta", torch.bfloat16)
        ctx = search_context(config, parse_cluster("1x8xh100"), 8, 64)
        for tp in (1, 2):
            parts = solution_parts(ctx.graph, ctx.solution(tp, 1).solution)
            layers = [parts.groups[g][1].tensors for g in parts.index]
            assert sum(layers) + parts.pre_tally.tensors + parts.post_tally.tensors == len(list(model.parameters()))
            assert layers[0] == len(list(model.layers[0].parameters())), (name, tp)


@pytest.mark.parametrize("precision, zero_stage", [("autocast", 0), ("bf16-master", 0), ("autocast", 1)])
def test_the_optimizer_pays_the_hosts_work_per_tensor_it_steps(precision, zero_stage):
    """`optimizer.optimizer_host_time_s`: a + b n added to the optimizer part, n the parameter tensors, or the fp32
    master buckets where the optimizer steps on those (bf16-master, ZeRO 1/2: one per 25 MiB, at most one per
    tensor); (0, 0) turns it off."""
    from autoplan.cost_model.optimizer import stepped_tensors

    config = get_model_config("tiny-llama")
    tensors = len(list(build_model(config, "meta").parameters()))
    dp = 2 if zero_stage else 1

    def optimizer_s(host: tuple[float, float]) -> float:
        plan = estimate(config, f"1x{dp}xh100", 8, 64, mesh=MeshShape(dp=dp), microbatch_size=4 // dp,
                        zero_stage=zero_stage, recompute="none", precision=precision,
                        efficiency=Efficiency(optimizer_host_s=host))
        return plan.predicted.time.optimizer_s

    masters = precision == "bf16-master" or zero_stage == 1
    stepped = stepped_tensors(tensors, config.num_parameters() / dp, masters)
    assert stepped == (1 if masters else tensors)  # a tiny model's fp32 masters fill one bucket
    assert optimizer_s((2e-3, 1e-4)) - optimizer_s((0.0, 0.0)) == pytest.approx(2e-3 + 1e-4 * stepped, rel=1e-6)
    with pytest.raises(ConfigError, match=r"optimizer_host_s=\(0.0, 2.0\) must be"):
        Efficiency(optimizer_host_s=(0.0, 2.0))


def test_a_profiles_optimizer_host_cost_is_what_the_model_prices_and_a_bad_one_is_refused():
    from autoplan.profiler.profile import HardwareProfile, ProfileError

    profile = dataclasses.replace(_h100_profile(0.5), optimizer_host_s=[1e-3, 2e-5])
    cluster, calibrated = calibrate(parse_cluster("1x8xh100"), None, profile)
    assert calibrated.resolved(cluster.device).optimizer_host_s == (1e-3, 2e-5)
    assert "the optimizer's host work 1.00 ms + 20.00 us per tensor it steps (measured by `autoplan profile`)" in \
        calibrated.floor_note()  # a plan's notes say what it priced
    assert HardwareProfile.from_json(profile.to_json()).optimizer_host_s == [1e-3, 2e-5]
    _, bare = calibrate(parse_cluster("1x8xcpu"), None, None)
    assert bare.optimizer_host_s == (0.0, 0.0)  # a CPU without a profile: its ops' times hold no such figure
    with pytest.raises(ProfileError, match="optimizer_host_s must be"):
        dataclasses.replace(profile, optimizer_host_s=[1e-3])


def test_the_profiler_measures_the_optimizers_host_work_per_tensor():
    """`profiler.memory.measure_optimizer_host_s` on this CPU: a step over one-element tensors is the host's work,
    which grows with the tensors (tens of microseconds each on the development machine)."""
    from autoplan.profiler.memory import measure_optimizer_host_s

    per_step, per_tensor = measure_optimizer_host_s(torch.device("cpu"), quick=True)
    assert per_step >= 0.0
    assert 1e-7 < per_tensor < 1e-3
