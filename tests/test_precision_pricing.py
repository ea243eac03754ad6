"""The data-parallel sync and the optimizer step priced in the bytes the runtime moves under each precision
(`cost_model.memory.dp_sync_bytes`): gradients reduced in fp32 whatever the precision (autocast's fp32
parameters, bf16-master's fp32 main gradients, FSDP2's reduce_dtype), weights all-gathered in the dtype the
ranks compute with. What the gloo runtime really issues is checked in tests/test_mixed_precision.py."""

from __future__ import annotations

import pytest

from autoplan.cluster import parse_cluster
from autoplan.cost_model.compute import Efficiency, memory_time_s
from autoplan.cost_model.memory import dp_sync_bytes
from autoplan.grad_buckets import bucket_count
from autoplan.models import get_model_config

PARAMS = 100e6


@pytest.mark.parametrize("dtype, precision, zero, expected", [
    ("float32", "autocast", 0, (4, 0)), ("float32", "autocast", 1, (4, 4)), ("float32", "autocast", 3, (4, 4)),
    ("bfloat16", "autocast", 0, (4, 0)), ("bfloat16", "autocast", 2, (4, 4)), ("bfloat16", "autocast", 3, (4, 4)),
    ("bfloat16", "bf16-master", 0, (4, 0)), ("bfloat16", "bf16-master", 1, (4, 2)),
    ("bfloat16", "bf16-master", 2, (4, 2)), ("bfloat16", "bf16-master", 3, (4, 2)),
    ("float16", "autocast", 1, (4, 4)),
])
def test_sync_bytes_are_fp32_gradients_and_weights_as_computed(dtype, precision, zero, expected):
    assert dp_sync_bytes(dtype, precision, zero) == expected


def test_fsdp2_policy_moves_what_zero3_is_priced_at():
    """ZeRO 3 runs under `runtime.zero.fsdp_precision`: its reduce_dtype and param_dtype (None: the fp32
    parameters' own) are the bytes the time model prices."""
    torch = pytest.importorskip("torch")
    from autoplan.runtime.zero import fsdp_precision

    for precision in ("autocast", "bf16-master"):
        policy = fsdp_precision(precision)
        moved = tuple((d or torch.float32).itemsize for d in (policy.reduce_dtype, policy.param_dtype))
        assert moved == dp_sync_bytes("bfloat16", precision, 3), precision


def _steps(dtype: str = "bfloat16"):
    from autoplan.cost_model.step import StepEnv, StepModel

    return StepModel(StepEnv(get_model_config("gpt2-small"), parse_cluster("2x8xh100"), 1024, dtype, Efficiency()),
                     partition=None)


def _parts(steps, zero: int, precision: str) -> dict[str, float]:
    from autoplan.cost_model.step_config import Config

    cfg = Config.of(tp=1, cp=1, pp=1, ep=1, dp=16, microbatch_size=1, num_microbatches=4, zero_stage=zero,
                    recompute="none").replace(precision=precision)
    return steps.dp_sync_parts(cfg, dict(dense=PARAMS, expert=0.0, buckets=13, forward=0.0, backward=0.0))


def test_bf16_plans_reduce_what_float32_plans_reduce():
    """A bfloat16 plan's gradients cost what a float32 plan's do (fp32 either way), under both precisions;
    before, they were priced at 2 bytes, half the traffic the runtime moves."""
    fp32, bf16 = _steps("float32"), _steps("bfloat16")
    for zero in (0, 1):
        reduced = "gradient all-reduce after backward" if zero == 0 else "gradient reduce-scatter after backward"
        want = _parts(fp32, zero, "autocast")[reduced]
        assert _parts(bf16, zero, "autocast")[reduced] == pytest.approx(want)
        assert _parts(bf16, zero, "bf16-master")[reduced] == pytest.approx(want)


def test_bf16_master_all_gathers_half_the_bytes_of_autocast():
    """ZeRO 1: the updated slices are all-gathered into bf16 parameters under bf16-master, into fp32 ones
    under autocast, in the same buckets (counted from the fp32 gradients); 16 of them for 400 MB."""
    steps, eff, cluster = _steps(), Efficiency(), parse_cluster("2x8xh100")
    group = steps.group(_config(), ("dp", "ep", "cp"))
    n = bucket_count(4 * PARAMS)
    assert n == 16
    gathered = {p: _parts(steps, 1, p)["parameter all-gather after the step"] for p in ("autocast", "bf16-master")}
    assert gathered["autocast"] == pytest.approx(n * eff.collective_s("all_gather", 4 * PARAMS / n, cluster, group))
    assert gathered["bf16-master"] == pytest.approx(n * eff.collective_s("all_gather", 2 * PARAMS / n, cluster, group))
    assert gathered["bf16-master"] < 0.75 * gathered["autocast"]  # half the bytes; the latencies stay


def _config():
    from autoplan.cost_model.step_config import Config

    return Config.of(tp=1, cp=1, pp=1, ep=1, dp=16, microbatch_size=1, num_microbatches=4, zero_stage=1,
                     recompute="none")


@pytest.mark.parametrize("precision, zero, per_param, copied", [
    ("autocast", 0, 84, 0),     # fp32 weights and gradients: no cast, the step is on the parameters themselves
    ("autocast", 1, 84, 8),     # the updated slices all-gathered, then copied into the fp32 parameters
    ("bf16-master", 0, 90, 4),  # fp32 main gradients (84), the masters cast into bf16 (4 + 2), then copied in (2 + 2)
    ("bf16-master", 1, 90, 4),
    ("bf16-master", 3, 84, 0),  # FSDP2's fp32 shards are the masters: nothing to cast or copy
])
def test_optimizer_step_reads_fp32_gradients(precision, zero, per_param, copied):
    """The step on this rank's share, and the copy of every local parameter out of the buckets
    (`GradSync.gather_parameters`) where it steps on master slices."""
    steps = _steps()
    cfg = _config().replace(zero_stage=zero, precision=precision)
    shard = 16 if zero else 1
    assert steps.optimizer_s(cfg, PARAMS) == pytest.approx(
        memory_time_s((per_param / shard + copied) * PARAMS, steps.env.cluster.device, Efficiency()))


def test_autocast_prices_its_weight_casts_as_the_runtime_enters_autocast():
    """`StepModel.cast_s`: autocast casts each GEMM weight read 4 + written 2 bytes in every microbatch's forward
    and its gradient read 2 + written 4 in backward; bf16-master's bf16 weights and float32 plans cast nothing.
    Without pp the forward's autocast region is one microbatch's, so a fully recomputed layer casts again in
    backward; under pp one region spans the pipelined step, whose cache casts each weight once per step (1 / m
    per microbatch) and the re-run reuses."""
    from fractions import Fraction

    import numpy as np

    from autoplan.api import search_context
    from autoplan.cost_model.step_config import Config
    from autoplan.solver.context import VARIANT_MEGATRON

    ctx = search_context(get_model_config("gpt2-small"), parse_cluster("1x8xh100"), 16, 1024)
    block = ctx.block(1, Fraction(1), VARIANT_MEGATRON)
    weights = block.arrays("none")["cast"]
    assert weights.min() > 0  # every layer's linears

    def added(cfg):  # the layers' compute beyond the kernels' own
        t = ctx.steps.times(block, cfg)
        return np.diff(t.prefix["compute"]) - block.arrays(cfg.recompute)["compute"]

    base = Config.of(tp=1, cp=1, pp=1, ep=1, dp=8, microbatch_size=1, num_microbatches=2, zero_stage=0,
                     recompute="none")
    one_way = memory_time_s(6 * weights, ctx.cluster.device, Efficiency())
    assert added(base) == pytest.approx(2 * one_way)
    assert added(base.replace(recompute="full")) == pytest.approx(3 * one_way)
    assert added(base.replace(recompute="selective")) == pytest.approx(2 * one_way)  # no GEMM re-run
    piped = base.replace(pp=2, dp=4, num_microbatches=8)
    assert added(piped) == pytest.approx((1 + 1 / 8) * one_way)
    assert added(piped.replace(recompute="full")) == pytest.approx((1 + 1 / 8) * one_way)
    assert added(base.replace(precision="bf16-master")) == pytest.approx(0 * one_way)
    fp32 = search_context(get_model_config("gpt2-small"), parse_cluster("1x8xh100"), 16, 1024, dtype="float32")
    t = fp32.steps.times(fp32.block(1, Fraction(1), VARIANT_MEGATRON), base)
    assert np.diff(t.prefix["compute"]) == pytest.approx(fp32.block(1, Fraction(1), VARIANT_MEGATRON).arrays("none")["compute"])
