"""The training run's timing report (autoplan.step_meter): tokens/s and MFU from a step time, the
summary against the plan's prediction, and the warning past 10%."""

from __future__ import annotations

import pytest

from autoplan.api import estimate
from autoplan.mesh import MeshShape
from autoplan.step_meter import StepMeter


@pytest.fixture(scope="module")
def plan():
    return estimate("tiny-gpt", "1x2xcpu", 8, 32, mesh=MeshShape(dp=2), microbatch_size=4, zero_stage=0,
                    recompute="none", dtype="float32")


def test_at_the_predicted_step_time_the_meter_reads_the_plan(plan):
    meter = StepMeter(plan)
    for _ in range(3):
        meter.add(plan.predicted.step_time_s)
    s = plan.predicted.step_time_s
    assert meter.tokens_per_s(s) == pytest.approx(plan.predicted.tokens_per_s)
    assert meter.mfu(s) == pytest.approx(plan.predicted.mfu)
    text, differs = meter.summary()
    assert not differs and "(+0.0%)" in text


def test_twice_as_slow_halves_mfu_and_warns(plan):
    meter = StepMeter(plan)
    for seconds in (100.0, 2 * plan.predicted.step_time_s, 2 * plan.predicted.step_time_s):
        meter.add(seconds)  # the first step (warm-up) is left out of the median
    assert meter.measured_s() == pytest.approx(2 * plan.predicted.step_time_s)
    assert meter.mfu(meter.measured_s()) == pytest.approx(plan.predicted.mfu / 2)
    text, differs = meter.summary()
    assert differs and "+100.0%" in text
    record = meter.record()
    assert record["step_times_s"][0] == 100.0 and record["mfu"] == pytest.approx(plan.predicted.mfu / 2)
    assert "tokens/s" in meter.line(7, 3.21) and "step     7" in meter.line(7, 3.21)
