"""Activation memory under pipeline parallelism: what each pipeline rank's forwards leave alive at once over
a whole training step (`runtime.memory_probe.measure_step_peak`: the microbatches in flight, and the
pipeline's own receive buffers and sends), against `cost_model.memory.stage_activation_bytes`, and the most
a recomputed layer's re-run holds. 2 gloo ranks, a 4-layer Llama, 4 microbatches; 1F1B and interleaved
1F1B (2 chunks per rank) x float32, bfloat16 x recompute none, selective, full. Each within TOLERANCE per
rank. Also: the step model's plan prices the same buffers (its temporary bytes).
"""

from __future__ import annotations

import pytest

from _dist import batches, make_plan, spawn

pytestmark = pytest.mark.gloo

TOLERANCE = 0.05
SEQ, MICROBATCHES = 64, 4
CASES = [(f"{schedule}-{dtype}-{policy}", v, dtype, policy)
         for schedule, v in (("1f1b", 1), ("interleaved", 2)) for dtype, policy in
         (("float32", "none"), ("bfloat16", "selective"), ("float32", "full"), ("bfloat16", "none"))]


def _config():
    from autoplan.models.config import ModelConfig

    return ModelConfig("tiny-llama-4l", "llama", 4, 64, 4, 2, 128, 128, 64)


def _measure(rank: int, world: int, plans: dict) -> dict:
    from autoplan.models import build_model
    from autoplan.runtime.launch import parallelize
    from autoplan.runtime.memory_probe import measure_step_peak

    out = {}
    for cid, plan in plans.items():
        program = parallelize(build_model(_config(), device="meta"), None, plan, config=_config())
        tokens, targets = batches(plan.global_batch, plan.seq_len, 1)
        local = program.shard_batch(tokens[0], targets[0])

        def step():
            with program._autocast():
                program.pipeline.step(*local)

        measured = measure_step_peak(step, program, program.pipeline.modules)
        out[cid] = (measured.saved_bytes, measured.recompute_bytes)
    return out


@pytest.fixture(scope="module")
def measured() -> tuple[dict, list]:
    plans = {cid: make_plan(_config(), 1, 1, pp=2, virtual_stages=v, num_microbatches=MICROBATCHES,
                            microbatch_size=2, seq_len=SEQ, dtype=dtype, recompute=policy)
             for cid, v, dtype, policy in CASES}
    return plans, spawn(_measure, 2, plans)


@pytest.mark.parametrize("cid", [c[0] for c in CASES])
def test_each_pipeline_rank_holds_what_the_model_says(measured, cid):
    from autoplan.api import capture_model
    from autoplan.cost_model.memory import stage_activation_bytes

    plans, ranks = measured
    plan = plans[cid]
    predicted = stage_activation_bytes(plan, capture_model(_config(), SEQ, plan.dtype), _config().rule_info())
    for rank, got in enumerate(ranks):
        for what, want, bytes_ in zip(("held", "re-run"), predicted[rank], got[cid]):
            assert abs(want - bytes_) <= TOLERANCE * bytes_, f"{cid} rank {rank} {what}: predicted {want:.0f}, measured {bytes_}"


def test_the_plan_prices_the_pipeline_buffers():
    """The step model's stages carry the receive buffers and sends (as temporary bytes): a pp plan's
    temporary bytes grow with the microbatches by b (r + s) per microbatch on its busiest stage."""
    small, large = (make_plan(_config(), 1, 1, pp=2, num_microbatches=m, microbatch_size=2, seq_len=SEQ)
                    for m in (2, 6))
    boundary = 2 * SEQ * 64 * 4  # microbatch x sequence x hidden, float32
    grown = large.predicted.memory.temporary_bytes - small.predicted.memory.temporary_bytes
    assert grown == pytest.approx(4 * boundary, rel=1e-6)  # 4 more microbatches, one buffer each (1F1B)


@pytest.mark.parametrize("pp, m, v", [(2, 4, 1), (4, 8, 1), (4, 3, 1), (2, 4, 2), (4, 8, 2), (4, 16, 4), (8, 16, 2)])
def test_chunk_counts_agree_with_the_in_flight_formula(pp, m, v):
    """The schedule walk's largest count over a rank's chunks is `in_flight_microbatches` x v (Narayanan et al.,
    Korthikanti et al.), every microbatch runs once on each chunk, and the interleaved sends keep at most m per
    sending chunk."""
    from autoplan.cost_model.pipeline import chunk_in_flight, in_flight_microbatches, sends_kept

    for stage in range(pp):
        states = chunk_in_flight(stage, pp, m, v)
        assert len(states) == m * v and all(min(counts) >= 0 for counts, _ in states)
        assert max(sum(counts) for counts, _ in states) == pytest.approx(in_flight_microbatches(stage, pp, m, v) * v)
        assert 0 <= sends_kept(stage, pp, m, v) <= (1 if v == 1 else m) * v
