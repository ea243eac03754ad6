"""Cost model: communication formulas and links, roofline, memory, resharding and folding (tier 1)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from autoplan.capture import capture
from autoplan.cluster import ClusterSpec, LinkSpec, parse_cluster, preset
from autoplan.cost_model import comm
from autoplan.cost_model.compute import Efficiency, calibrate, linear_time_s, memory_time_s, op_time_s
from autoplan.cost_model.intra_op import InputSpec, make_context, price_assignment, reshard_collectives
from autoplan.cost_model.intra_op_problem import assignment_from_choice, build_intra_op_problem, resolve_strategies
from autoplan.cost_model.activations import RunShape, activations
from autoplan.cost_model.storages import activation_bytes
from autoplan.cost_model.memory import memory_breakdown, model_state_bytes, state_bytes_for
from autoplan.recompute_policy import recompute_policy
from autoplan.errors import ConfigError, PlanError
from autoplan.mesh import MeshShape
from autoplan.models import build_model, get_model_config
from autoplan.models.config import ModelConfig
from autoplan.placement import Partial, Replicate, Shard
from autoplan.profiler.profile import CollectiveFit, GemmSample, HardwareProfile, MemorySample, ProfileError
from autoplan.api import estimate, search
from autoplan.solver.intra_op import megatron_assignment
from autoplan.solver.ilp import solve_ilp
from autoplan.strategies import default_registry


def tiny_graph(name: str, layers: int | None = None, seq: int = 16):
    cfg = get_model_config(name)
    cfg = dataclasses.replace(cfg, num_layers=layers) if layers else cfg
    return cfg, capture(build_model(cfg, "meta", torch.bfloat16), cfg, 1, seq)


def zero_latency(nodes: int = 1) -> ClusterSpec:
    """H100s with latency-free links, so that tiny models have something to shard."""
    h100 = preset("h100")
    return ClusterSpec(nodes, 8, h100.device, LinkSpec(450e9, 0.0), LinkSpec(50e9, 0.0), "zero-latency")


# ------------------------------------------------------------------------------ communication


def test_ring_formulas_on_hand_computed_numbers():
    gb, bw, alpha = 1e9, 100e9, 1e-6
    assert comm.all_reduce_time_s(gb, 8, bw, alpha) == pytest.approx(2 * 7 / 8 * 0.01 + 14e-6)  # 17.514 ms
    assert comm.all_gather_time_s(gb, 8, bw, alpha) == pytest.approx(0.00875 + 7e-6)
    assert comm.reduce_scatter_time_s(gb, 8, bw, alpha) == pytest.approx(0.00875 + 7e-6)
    assert comm.all_to_all_time_s(gb, 8, bw, alpha) == pytest.approx(7 / 8 * 0.00125 + 7e-6)
    assert comm.p2p_time_s(gb, bw, alpha) == pytest.approx(0.01 + 1e-6)
    for kind in comm.COLLECTIVE_KINDS:
        assert comm.collective_formula(kind)(gb, 1, bw, alpha) == 0.0
    with pytest.raises(ConfigError, match="unknown"):
        comm.collective_formula("broadcast")
    with pytest.raises(ConfigError):
        comm.all_reduce_time_s(-1, 2, bw, alpha)


def test_link_choice_inside_and_across_nodes():
    cluster = parse_cluster("2x8xh100")  # NVLink 450 GB/s, 5 us; NDR 50 GB/s per GPU, 10 us
    nbytes = 1e9
    mesh = MeshShape(dp=2, tp=8)
    assert comm.link_for_axis(cluster, mesh, "tp") == cluster.intra_node
    assert comm.link_for_axis(cluster, mesh, "dp") == cluster.inter_node
    assert comm.collective_time_s("all_reduce", nbytes, cluster, mesh, "tp") == pytest.approx(
        comm.all_reduce_time_s(nbytes, 8, 450e9, 5e-6))
    # one rank per node: a flat ring over the NICs
    assert comm.collective_time_s("all_reduce", nbytes, cluster, mesh, "dp") == pytest.approx(
        comm.all_reduce_time_s(nbytes, 2, 50e9, 10e-6))
    # 8 ranks per node drive 8 NICs: min(450, 8 * 50) = 400 GB/s; latency 1 inter + 7 intra hops per pass
    wide = MeshShape(dp=16, tp=1)
    expected = 2 * 15 / 16 * nbytes / 400e9 + 2 * (10e-6 + 7 * 5e-6)
    assert comm.collective_time_s("all_reduce", nbytes, cluster, wide, "dp") == pytest.approx(expected)
    assert comm.collective_time_s("all_gather", nbytes, cluster, wide, "dp") == pytest.approx(
        15 / 16 * nbytes / 400e9 + 10e-6 + 7 * 5e-6)
    assert comm.collective_time_s("all_reduce", nbytes, cluster, wide, "tp") == 0.0


# ------------------------------------------------------------------------------ compute


def test_roofline_picks_the_binding_side():
    device = preset("h100").device  # 989.4 TFLOP/s bf16, 3.35 TB/s
    eff = Efficiency(matmul=0.75, memory=0.8)
    assert op_time_s(1e12, 1e6, device, "bfloat16", eff) == pytest.approx(1e12 / (989.4e12 * 0.75))
    assert op_time_s(1e6, 1e9, device, "bfloat16", eff) == pytest.approx(1e9 / (3.35e12 * 0.8))
    with pytest.raises(ConfigError):
        Efficiency(matmul=1.5)


# ------------------------------------------------------------------------------ fixed costs

# kernels (forward, backward) per op of a Llama layer, as cost_model.compute's docstring counts them;
# a linear also accumulates its one weight into .grad and a norm its one scale (one kernel each, backward)
LAUNCHES = {"linear": (1, 2 + 1), "attention": (1, 2), "norm": (1, 2 + 1), "elementwise": (1, 1)}


def test_a_small_tp8_layer_pays_a_floor_per_kernel_and_a_fixed_cost_per_collective():
    """Hidden 512 over tp 8 and 128 tokens: every kernel runs for well under 7 us, so the layer costs its
    launches x the floor, not its roofline (RoPE's kernels included, which the host's count leaves out); every
    collective call costs 6.6 us more than the ring alone."""
    config = ModelConfig("small-llama", "llama", 2, 512, 8, 8, 1024, 512, 128)
    graph = capture(build_model(config, "meta", torch.bfloat16), config, 1, 128)
    registry, info = default_registry(), config.rule_info()
    strategies = resolve_strategies(graph, registry, info, 8,
                                    megatron_assignment(graph, registry, 8, info, sequence_parallel=True))
    layer = dataclasses.replace(graph, nodes=tuple(n for n in graph.nodes if n.layer == 0))
    fwd, bwd = (sum(LAUNCHES[n.op_kind][k] for n in layer.nodes) for k in (0, 1))
    assert (fwd, bwd) == (14, 33)  # 7 linears, attention, 2 norms, silu, mul, 2 adds
    priced = {}
    for floor, call in ((7e-6, 6.6e-6), (0.0, 0.0)):  # a flat GEMM efficiency: no curve floors the GEMMs
        ctx = make_context(graph, parse_cluster("1x8xh100"), MeshShape(tp=8), 1, "bfloat16",
                           Efficiency(matmul=0.7, kernel_floor_s=floor, collective_call_s=call, host_kernel_s=0.0))
        priced[floor] = price_assignment(layer, strategies, ctx)
    floored, roofline = priced[7e-6], priced[0.0]
    rope = 2  # the attention core's RoPE, a Triton kernel for q and one for k each way (`attention_cost.ROPE_PASSES`)
    assert floored.fwd_compute_s == pytest.approx((fwd + rope) * 7e-6)
    assert floored.bwd_compute_s == pytest.approx((bwd + rope) * 7e-6)
    assert roofline.fwd_compute_s + roofline.bwd_compute_s < 0.02 * (fwd + bwd) * 7e-6
    calls = ((floored.fwd_comm_s - roofline.fwd_comm_s) / 6.6e-6, (floored.bwd_comm_s - roofline.bwd_comm_s) / 6.6e-6)
    # sequence parallel: 2 all-gathers and 2 reduce-scatters each way, and backward the two norms' scales'
    # gradients all-reduced (each rank saw its slice of the sequence)
    assert calls == pytest.approx((4, 6))


def test_a_collective_call_costs_its_fixed_cost_unless_a_profile_measured_it():
    cluster, group = parse_cluster("2x8xh100"), comm.AxisGroup(8, 1, 8)
    for kind in comm.COLLECTIVE_KINDS:
        for where in (group, comm.AxisGroup(16, 2, 8)):
            ring = comm.group_collective_time_s(kind, 1e6, cluster, where)
            called = comm.group_collective_time_s(kind, 1e6, cluster, where, call_s=6.6e-6)
            assert called == pytest.approx(ring + 6.6e-6)
    fit = CollectiveFit("all_reduce", 8, 20e-6, 100e9, 12, 0.05)
    _, eff = calibrate(cluster, None, _h100_profile(0.5, [fit]))
    assert eff.collective_s("all_reduce", 0.0, cluster, group) == pytest.approx(20e-6)  # the fit holds the call cost
    assert eff.collective_s("all_gather", 0.0, cluster, group) == pytest.approx(7 * 5e-6 + 6.6e-6)  # no fit: the ring


def test_a_profile_brings_its_measured_launch_floor():
    profile = dataclasses.replace(_h100_profile(0.5), kernel_floor_s=4.5e-6)
    assert HardwareProfile.from_json(profile.to_json()) == profile
    _, eff = calibrate(parse_cluster("1x8xh100"), None, profile)
    assert eff.kernel_floor_s == 4.5e-6 and "measured by `autoplan profile`" in eff.floor_note()
    _, default = calibrate(parse_cluster("1x8xh100"), None, _h100_profile(0.5))  # not measured: the default
    assert default.kernel_floor_s == 7e-6 and "autoparallel" in default.floor_note()
    with pytest.raises(ConfigError, match="kernel_floor_s=0.5 must be in"):
        Efficiency(kernel_floor_s=0.5)
    with pytest.raises(ProfileError, match="kernel_floor_s must be a finite number > 0"):
        dataclasses.replace(profile, kernel_floor_s=-1.0)


# ------------------------------------------------------------------------------ memory


@pytest.mark.parametrize("dtype, precision, stage, expected", [
    ("float32", "autocast", 0, (4e9, 4e9, 8e9)), ("float32", "autocast", 1, (4e9, 4.5e9, 1.5e9)),
    ("float32", "autocast", 3, (0.5e9, 0.5e9, 1e9)),
    ("bfloat16", "autocast", 0, (5.8e9, 4e9, 8e9)), ("bfloat16", "autocast", 1, (5.8e9, 4.5e9, 1.5e9)),
    ("bfloat16", "autocast", 2, (5.8e9, 4.5e9, 1.5e9)), ("bfloat16", "autocast", 3, (2.3e9, 0.5e9, 1e9)),
    ("bfloat16", "bf16-master", 0, (2e9, 4e9, 12e9)), ("bfloat16", "bf16-master", 1, (2e9, 4.5e9, 1.5e9)),
    ("bfloat16", "bf16-master", 3, (0.5e9, 0.5e9, 1e9))])
def test_model_states_under_each_zero_stage(dtype, precision, stage, expected):
    """1e9 local parameters (0.9e9 of them GEMM weights) over 8 data ranks, as the runtime holds them
    (cost_model.memory's table; benchmarks/state_memory.py measures it): autocast keeps fp32 parameters
    and a bf16 copy of each GEMM weight, bf16-master bf16 parameters and fp32 masters; ZeRO 1/2 (ZeRO 2
    runs as 1) the flat buckets and the reduced slices, and fp32 master slices under every precision."""
    state = state_bytes_for(dtype, precision)
    assert model_state_bytes(1e9, 8, stage, state, cast_params=0.9e9) == pytest.approx(expected)


def test_parameter_bytes_match_the_config_count():
    cfg, graph = tiny_graph("tiny-gpt")
    registry = default_registry()
    replicated = resolve_strategies(graph, registry, cfg.rule_info(), 1, {})
    mem = memory_breakdown(graph, replicated, 1, 1, 1, 0, "none", precision="bf16-master")
    assert mem.parameters_bytes == 2 * cfg.num_parameters()
    assert mem.gradients_bytes == 4 * cfg.num_parameters()  # fp32 main gradients
    assert mem.optimizer_bytes == 12 * cfg.num_parameters()
    autocast = memory_breakdown(graph, replicated, 1, 1, 1, 0, "none")  # fp32 weights and bf16 GEMM copies
    linear = sum(p.numel for n in graph.nodes if n.op_kind == "linear" for _, p in n.params)
    assert autocast.parameters_bytes == 4 * cfg.num_parameters() + 2 * linear


MIXED = RunShape(mixed=True)  # bf16 under autocast over fp32 parameters, as the runtime trains


def test_saved_activations_of_one_layer_by_hand():
    """tiny-gpt, B=1, T=16, h=64, f=256, 4 heads, bf16 under autocast (the residual stream and norms in fp32,
    4 B; GEMM outputs 2 B); layer 1 of 3 at tp 1, everything replicated, nothing recomputed: ln_1 in 4096
    + stats (mean, 1/std) 128, one bf16 copy of ln_1 out for q, k, v 2048, q k v 6144, attention out
    (also o_proj's input) 2048 and log-sum-exp 4*16*4 = 256, ln_2 in 4096 + 128, ln_2 out copy 2048, fc
    out 8192, gelu out 8192 = 37376 B. Recomputed under "selective" the layer keeps its input 4096, its
    GEMM outputs (q k v 6144, o_proj 2048, fc 8192, proj 2048) and attention's out and lse 2304: 24832 B;
    re-running it holds the rest, 37376 - (4096 + 6144 + 2304 + 8192) = 16640 B."""
    cfg, graph = tiny_graph("tiny-gpt", layers=3)
    registry, info = default_registry(), cfg.rule_info()
    replicated = resolve_strategies(graph, registry, info, 1, {})
    acts = activations(graph, replicated, 1, info, MIXED)
    assert acts.held("none")[0][1] == [37376, 0]
    kept, transient = acts.held("selective")
    assert (kept[1], transient[1]) == ([24832, 0], [16640, 0])
    # Megatron tp=2: q k v, attention's out and lse, fc out, gelu out halved; o_proj (row, with a bias
    # added after the all-reduce) gives an fp32 residual branch: 4096 + 128 + 2048 + 3072 + 1152 + 4096
    # + 128 + 2048 + 4096 + 4096 = 24960 B
    megatron = resolve_strategies(graph, registry, info, 2, megatron_assignment(graph, registry, 2, info))
    assert activations(graph, megatron, 2, info, MIXED).held("none")[0][1] == [24960, 0]


def test_activation_policies_order_and_scale_with_the_microbatch():
    cfg, graph = tiny_graph("tiny-gpt", layers=4, seq=64)
    strategies = resolve_strategies(graph, default_registry(), cfg.rule_info(), 1, {})
    acts = activations(graph, strategies, 1, cfg.rule_info(), MIXED)
    sizes = {r: activation_bytes(acts, recompute_policy(r)) for r in ("none", "selective", "matmul-only", "full")}
    held = [sizes[r][0] for r in ("none", "selective", "matmul-only", "full")]
    assert held == sorted(held, reverse=True) and len(set(held)) == 4 and held[-1] > 0
    assert sizes["none"][1] == 0 < sizes["selective"][1] < sizes["matmul-only"][1] < sizes["full"][1]
    positions = 64 * 8  # GPT's position ids (int64, one sequence's worth), kept by pos_emb: they do not scale
    for policy, (kept, transient) in sizes.items():
        assert activation_bytes(acts, recompute_policy(policy), 4) == (4 * kept - 3 * positions, 4 * transient)
    with pytest.raises(PlanError, match="recompute 'some'"):
        recompute_policy("some")


# ------------------------------------------------------------------------------ resharding


@pytest.mark.parametrize("src, dst, fwd, bwd", [
    (Replicate(), InputSpec(Replicate()), (), ()),
    (Replicate(), InputSpec(Shard(2)), (), (("all_gather", False),)),
    (Shard(2), InputSpec(Replicate()), (("all_gather", False),), ()),
    (Shard(1), InputSpec(Shard(2)), (("all_to_all", False),), (("all_to_all", False),)),
    (Replicate(), InputSpec(Replicate(), grad_partial=True), (), (("all_reduce", False),)),
    (Shard(1), InputSpec(Replicate(), grad_partial=True), (("all_gather", False),), (("reduce_scatter", False),)),
    (Partial(), InputSpec(Replicate()), (("all_reduce", False),), ()),
])
def test_reshard_rules(src, dst, fwd, bwd):
    assert reshard_collectives(src, dst) == (fwd, bwd)


def test_integer_tensors_have_no_backward_resharding():
    assert reshard_collectives(Replicate(), InputSpec(Shard(1)), differentiable=False) == ((), ())


def test_column_linear_reads_its_whole_input():
    """A column shard does 1/tp of the FLOPs and holds 1/tp of the weight, but reads the whole input:
    for this memory-bound tiny GEMM it costs more than a tp-th of replicate, and less than half."""
    cfg, graph = tiny_graph("tiny-gpt")
    cluster, mesh = zero_latency(), MeshShape(dp=2, tp=4)
    built = build_intra_op_problem(graph, default_registry(), cfg.rule_info(), 4, cluster, mesh, 64,
                                   efficiency=Efficiency(matmul=0.75, kernel_floor_s=0.0))  # rooflines alone
    fc = built.mapping["layers_0_mlp_fc"]
    names = [s.name for s in built.strategies[fc]]
    costs = built.problem.node_costs_s[fc]
    assert costs[names.index("replicate")] / 4 < costs[names.index("column")] < costs[names.index("replicate")] / 2


def test_small_gemms_gain_little_from_sharding_large_ones_a_tp_th():
    """The default GEMM curve: a GEMM far below the ~18 us time constant is near its floor, so splitting it
    saves little; one far above it runs at the sustained ceiling, so a 1/tp shard takes ~1/tp of the time."""
    h100 = preset("h100").device
    eff = Efficiency().resolved(h100)
    tiny = [linear_time_s(64 * 16, n, 64, 2, h100, "bfloat16", eff)[0] for n in (256, 64)]
    large = [linear_time_s(8192, n, 8192, 2, h100, "bfloat16", eff)[0] for n in (32768, 8192)]
    assert tiny[1] > 0.7 * tiny[0]
    assert large[1] == pytest.approx(large[0] / 4, rel=0.02)
    assert 2 * 8192 * 32768 * 8192 / large[0] == pytest.approx(0.711 * 989.4e12, rel=0.01)


# ------------------------------------------------------------------------------ folding


@pytest.mark.parametrize("name", ["tiny-gpt", "tiny-llama"])
@pytest.mark.parametrize("tp", [2, 4])
def test_pricing_an_assignment_agrees_with_the_ilp_objective(name, tp):
    """Pricing the ILP's choice op by op gives the ILP's objective, once the conversions that several
    consumers share (counted once by the pricing, per consumer by the pairwise ILP) are added."""
    cfg, graph = tiny_graph(name, layers=2, seq=32)
    registry, info, cluster, mesh = default_registry(), cfg.rule_info(), zero_latency(), MeshShape(dp=8 // tp, tp=tp)
    for microbatch in (1, 64):
        built = build_intra_op_problem(graph, registry, info, tp, cluster, mesh, microbatch)
        assert built.problem.num_nodes == len(graph.nodes)
        solution = solve_ilp(built.problem)
        assignment = assignment_from_choice(built, solution.choice)
        ctx = make_context(graph, cluster, mesh, microbatch)
        # the ILP prices each op alone: the kernels' own times, without the host's dispatch of a whole layer
        cost = price_assignment(graph, resolve_strategies(graph, registry, info, tp, assignment), ctx, host=False)
        assert cost.total_s + cost.shared_comm_s == pytest.approx(solution.objective, rel=1e-9)


# ------------------------------------------------------------------------------ a hardware profile


def _h100_profile(efficiency: float, fits=()) -> HardwareProfile:
    """A synthetic H100 profile: every GEMM at `efficiency` of the datasheet peak, copies at 2 TB/s."""
    peak = preset("h100").device.peak_flops_for("bfloat16")
    gemm = tuple(GemmSample(m, n, k, "bfloat16", 2.0 * m * n * k / (efficiency * peak))
                 for m in (256, 4096) for n in (256, 4096) for k in (256, 4096))
    return HardwareProfile("NVIDIA H100 80GB HBM3", "cuda", 80_000_000_000, 8, "2.13.0", "2026-11-20T00:00:00+00:00",
                           gemm, MemorySample(2**30, 2**31 / 2.0e12), "nccl" if fits else "", (), tuple(fits))


def test_a_profile_replaces_gemm_efficiency_bandwidth_and_links_inside_a_node():
    fit = CollectiveFit("all_reduce", 8, 20e-6, 100e9, 12, 0.05)
    cluster, eff = calibrate(parse_cluster("2x8xh100"), None, _h100_profile(0.5, [fit]))
    assert cluster.device.memory_bandwidth_bytes_per_s == pytest.approx(2.0e12)
    assert eff.gemm_efficiency(8192, 8192, 8192, cluster.device, "bfloat16") == pytest.approx(0.5)
    assert eff.max_matmul(cluster.device, "bfloat16") == pytest.approx(0.5)
    nbytes = 1e9
    inside = comm.collective_time_s("all_reduce", nbytes, cluster, MeshShape(dp=2, tp=8), "tp", eff.collectives)
    assert inside == pytest.approx(20e-6 + 2 * 7 / 8 * nbytes / 100e9)  # the fit, not NVLink's 450 GB/s
    across = comm.collective_time_s("all_reduce", nbytes, cluster, MeshShape(dp=2, tp=8), "dp", eff.collectives)
    assert across == pytest.approx(comm.all_reduce_time_s(nbytes, 2, 50e9, 10e-6))  # the network keeps its spec
    assert comm.collective_time_s("all_gather", nbytes, cluster, MeshShape(dp=2, tp=8), "tp", eff.collectives) == (
        pytest.approx(comm.all_gather_time_s(nbytes, 8, 450e9, 5e-6)))  # no all_gather fit: the datasheet link


def test_estimate_and_search_take_a_profile_and_refuse_another_device():
    # the GEMMs' efficiency is what differs here, not the host's dispatch that paces gpt2-small's small kernels
    kwargs = dict(mesh=MeshShape(dp=2, tp=4), microbatch_size=1, zero_stage=1, recompute="none",
                  efficiency=Efficiency(host_kernel_s=0.0))
    default = estimate("gpt2-small", "1x8xh100", 16, 1024, **kwargs)
    slow = estimate("gpt2-small", "1x8xh100", 16, 1024, profile=_h100_profile(0.2), **kwargs)
    fast = estimate("gpt2-small", "1x8xh100", 16, 1024, profile=_h100_profile(0.9), **kwargs)
    # gpt2-small's GEMMs (~1 GFLOP) sit near the default curve's floor, below even a flat 0.2
    assert fast.predicted.step_time_s < slow.predicted.step_time_s < default.predicted.step_time_s
    assert slow.cluster.device.memory_bandwidth_bytes_per_s == pytest.approx(2.0e12)
    assert search("gpt2-small", "1x8xh100", 16, 1024, profile=_h100_profile(0.9),
                  efficiency=kwargs["efficiency"]).predicted.step_time_s <= (
        fast.predicted.step_time_s * (1 + 1e-9))
    with pytest.raises(ProfileError, match="not on a 'a100-80g'"):
        estimate("gpt2-small", "1x8xa100", 16, 1024, profile=_h100_profile(0.5), **kwargs)


def test_a_plan_in_a_dtype_the_profile_did_not_measure_is_refused():
    """A bfloat16 profile prices bfloat16 plans; a float32 plan would fall back to the datasheet in
    silence, so it is refused with what to do instead (issue 20)."""
    from autoplan.api import estimate
    from autoplan.profiler.profile import ProfileError

    profile = _h100_profile(0.5)
    kwargs = dict(mesh=MeshShape(dp=8), microbatch_size=1, zero_stage=1, recompute="none", profile=profile)
    assert estimate("gpt3-1.3b", "1x8xh100", 8, 2048, dtype="bfloat16", **kwargs).predicted.step_time_s > 0
    with pytest.raises(ProfileError, match=r"measured GEMMs in bfloat16, not float32: plan in bfloat16 .*"
                                           r"autoplan profile --dtype float32"):
        estimate("gpt3-1.3b", "1x8xh100", 8, 2048, dtype="float32", **kwargs)


def test_dp_sync_is_priced_per_bucket_as_the_runtime_runs_it():
    """runtime.grad_sync's buckets: ceil(bytes / 25 MiB) collectives; with a long enough last
    backward only the last bucket is exposed, with none all of them; ZeRO 1 and 2: the
    reduce-scatter hidden alike, the all-gather after the step exposed whole."""
    from autoplan.cost_model.step import StepEnv, StepModel
    from autoplan.cost_model.step_config import Config
    from autoplan.grad_buckets import GRAD_BUCKET_BYTES, bucket_count

    cluster, eff, params = parse_cluster("2x8xh100"), Efficiency(), 100e6  # autocast: 400 MB of fp32 gradients
    steps = StepModel(StepEnv(get_model_config("gpt2-small"), cluster, 1024, "bfloat16", eff), partition=None)
    n = bucket_count(4 * params)
    assert n == 16 == -(-4 * params // GRAD_BUCKET_BYTES)

    def parts(zero: int, backward_s: float) -> dict[str, float]:
        cfg = Config.of(tp=1, cp=1, pp=1, ep=1, dp=16, microbatch_size=1, num_microbatches=4, zero_stage=zero,
                        recompute="none")
        sums = dict(dense=params, expert=0.0, buckets=13, forward=0.0, backward=backward_s)
        return steps.dp_sync_parts(cfg, sums), steps.group(cfg, ("dp", "ep", "cp"))

    (after, group), (hidden, _) = parts(0, 0.0), parts(0, 10.0)
    one = eff.collective_s("all_reduce", 4 * params / n, cluster, group)
    copies = {"gradient bucket copies (flatten, scale)": pytest.approx(  # flattened and scaled: 8 + 8 B each
        memory_time_s(16 * params, cluster.device, eff))}
    assert after == {"gradient all-reduce after backward": pytest.approx(n * one), **copies}
    assert hidden == {"gradient all-reduce after backward": pytest.approx(one), **copies}  # the last bucket
    zero1, zero2 = parts(1, 10.0)[0], parts(2, 10.0)[0]
    assert zero1 == zero2
    assert zero1["gradient reduce-scatter after backward"] == pytest.approx(
        eff.collective_s("reduce_scatter", 4 * params / n, cluster, group))
    assert zero1["parameter all-gather after the step"] == pytest.approx(  # autocast's fp32 parameters
        n * eff.collective_s("all_gather", 4 * params / n, cluster, group))
    assert zero1["gradient bucket copies (flatten, scale)"] == pytest.approx(  # the 1 / 16 slice received is scaled
        memory_time_s((8 + 8 / 16) * params, cluster.device, eff))


def test_one_data_shard_under_bf16_master_pays_the_flatten_into_its_masters_gradient():
    """`runtime.grad_sync`: a bucket without replicas under bf16-master is flattened into its fp32 master's
    gradient (read and write 4 B per parameter), not scaled (one data shard); autocast's gradients stay as they
    are."""
    from autoplan.cost_model.step import StepEnv, StepModel
    from autoplan.cost_model.step_config import Config

    cluster, eff, params = parse_cluster("1xh100"), Efficiency(), 100e6
    steps = StepModel(StepEnv(get_model_config("gpt2-small"), cluster, 1024, "bfloat16", eff), partition=None)
    sums = dict(dense=params, expert=0.0, buckets=13, forward=0.0, backward=1.0)

    def parts(precision: str) -> dict[str, float]:
        cfg = Config.of(tp=1, cp=1, pp=1, ep=1, dp=1, microbatch_size=1, num_microbatches=1, zero_stage=0,
                        recompute="none").replace(precision=precision)
        return steps.dp_sync_parts(cfg, sums)

    assert parts("bf16-master")["gradient bucket copies (flatten, scale)"] == pytest.approx(
        memory_time_s(8 * params, cluster.device, eff))
    assert "gradient bucket copies (flatten, scale)" not in parts("autocast")


def test_megatron_core_buckets_are_priced_when_asked():
    """`Efficiency(grad_buckets="megatron-core")` prices Megatron-Core DDP's default buckets, max(40M, 1M x dp)
    gradient elements (`autoplan.grad_buckets`): 400 MB of fp32 gradients over 16 ranks in 3 buckets of
    160 MB, not the runtime's 16 of 25 MiB; any other rule is refused."""
    from autoplan.cost_model.step import StepEnv, StepModel
    from autoplan.cost_model.step_config import Config

    cluster, params = parse_cluster("2x8xh100"), 100e6
    eff = Efficiency(grad_buckets="megatron-core")
    steps = StepModel(StepEnv(get_model_config("gpt2-small"), cluster, 1024, "bfloat16", eff), partition=None)
    cfg = Config.of(tp=1, cp=1, pp=1, ep=1, dp=16, microbatch_size=1, num_microbatches=4, zero_stage=0,
                    recompute="none")
    parts = steps.dp_sync_parts(cfg, dict(dense=params, expert=0.0, buckets=13, forward=0.0, backward=0.0))
    group = steps.group(cfg, ("dp", "ep", "cp"))
    assert parts["gradient all-reduce after backward"] == pytest.approx(
        3 * eff.collective_s("all_reduce", 4 * params / 3, cluster, group))
    with pytest.raises(ConfigError, match=r"grad_buckets='fsdp' must be one of \('ddp', 'megatron-core'\)"):
        Efficiency(grad_buckets="fsdp")
