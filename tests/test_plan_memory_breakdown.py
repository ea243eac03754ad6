"""The plan's own memory breakdown (`Plan.predicted.memory`, priced by the step model) against the
activation walk the runtime's measured bytes are checked with (`cost_model.memory.plan_activation_bytes`):

- its activations (and ep margin) are what one microbatch's forward leaves, under both precisions: under
  "bf16-master" the parameters are bf16, so no autocast copies and a bf16 residual stream (the step model
  once priced them with autocast's dtypes: 0-22% over on these models);
- its parts are the forward + backward phase's, even where the optimizer step is the peak (a small model's:
  weights, gradients, masters and AdamW's temporary at once), so the activations never read 0;
- the peak is the larger phase, and both survive a plan file's round trip.
"""

from __future__ import annotations

import pytest

from _dist import make_plan
from autoplan.api import capture_model
from autoplan.cost_model.memory import plan_activation_bytes
from autoplan.models import get_model_config
from autoplan.plan import MemoryBreakdown, Plan

SEQ = 64


def _plan(model: str, tp: int, recompute: str, precision: str, **kw):
    return make_plan(model, 1, tp, "megatron-sp" if tp > 1 else "replicate", seq_len=SEQ, microbatch_size=4,
                     dtype="bfloat16", recompute=recompute, precision=precision, **kw)


@pytest.mark.parametrize("precision", ["autocast", "bf16-master"])
@pytest.mark.parametrize("model, tp, recompute", [
    ("tiny-llama", 1, "none"), ("tiny-llama", 2, "selective"), ("tiny-llama", 1, "full"),
    ("tiny-gpt", 2, "none"), ("tiny-gpt", 1, "full"), ("tiny-moe", 1, "selective"), ("tiny-moe", 2, "full")])
def test_plan_activations_are_the_walks(model, tp, recompute, precision):
    plan = _plan(model, tp, recompute, precision)
    config = get_model_config(model)
    walked = sum(plan_activation_bytes(plan, capture_model(config, SEQ, plan.dtype), config.rule_info()))
    memory = plan.predicted.memory
    assert memory.activations_bytes > 0
    assert memory.activations_bytes + memory.ep_imbalance_bytes == pytest.approx(walked, rel=1e-9)


def test_bf16_master_holds_fewer_activation_bytes_than_autocast():
    """The residual stream and norm inputs in bf16, not fp32: a real difference, in the plan itself."""
    autocast, master = (_plan("tiny-llama", 1, "none", p).predicted.memory for p in ("autocast", "bf16-master"))
    assert master.activations_bytes < 0.9 * autocast.activations_bytes


def test_a_step_phase_peak_keeps_the_forward_parts():
    """tiny-moe under full recompute peaks at the optimizer step (its weights and states outweigh its
    activations): the peak is that phase's total, the parts still the forward + backward phase's."""
    plan = _plan("tiny-moe", 1, "full", "autocast")
    memory = plan.predicted.memory
    assert memory.peaks_at_optimizer_step()
    assert memory.activations_bytes > 0 and memory.gradients_bytes == 0.0  # one microbatch: freed at its start
    assert plan.predicted.peak_memory_bytes == pytest.approx(memory.optimizer_step_bytes, rel=1e-12)
    assert memory.total_bytes() == memory.optimizer_step_bytes > memory.forward_backward_bytes()
    again = Plan.from_json(plan.to_json()).predicted.memory
    assert again == memory


def test_a_forward_peak_is_the_parts_sum():
    memory = MemoryBreakdown(1.0, 2.0, 3.0, 10.0, 1.0, 0.0, optimizer_step_bytes=8.0)
    assert not memory.peaks_at_optimizer_step() and memory.total_bytes() == 17.0
    assert MemoryBreakdown(1.0, 2.0, 3.0, 10.0).total_bytes() == 16.0  # a plan file written before the field
