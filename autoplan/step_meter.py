"""How a training run did against its plan: step time, tokens/s and MFU per step, and measured against
predicted at the end (`autoplan.train` prints both; `--log-json` records them).

    tokens/s       = global_batch * seq_len / step time
    MFU            = plan.predicted.mfu * plan.predicted.step_time_s / step time
                     (the plan's MFU is 3 x forward FLOPs per step over step time x ranks x the plan's
                     device peak, so for the same FLOPs and peak it scales with 1 / step time)
    measured       = the median step time, the first step left out (it warms up allocators, caches and
                     process groups); a warning when it differs from the prediction by more than 10%

The prediction is for the plan's cluster: a plan made for H100s and run on CPU ranks will not match,
and the summary says which device the plan priced.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from autoplan.plan import Plan

MISMATCH = 0.10  # relative difference of measured and predicted step time that earns a warning


@dataclass
class StepMeter:
    """Wall seconds of each step of a run under `plan`."""

    plan: "Plan"
    seconds: list[float] = field(default_factory=list)

    def add(self, seconds: float) -> None:
        self.seconds.append(seconds)

    def tokens_per_s(self, seconds: float) -> float:
        return self.plan.global_batch * self.plan.seq_len / seconds

    def mfu(self, seconds: float) -> float:
        return self.plan.predicted.mfu * self.plan.predicted.step_time_s / seconds

    def line(self, step: int, loss: float) -> str:
        """One step's log line: loss, step time, tokens/s, MFU."""
        s = self.seconds[-1]
        return (f"step {step:5d}  loss {loss:.4f}  {s * 1e3:8.1f} ms  {self.tokens_per_s(s):10,.0f} tokens/s  "
                f"MFU {self.mfu(s):6.1%}")

    def measured_s(self) -> float | None:
        """The median step time, the first step left out when there are others (module docstring)."""
        timed = self.seconds[1:] if len(self.seconds) > 1 else self.seconds
        return statistics.median(timed) if timed else None

    def summary(self) -> tuple[str, bool]:
        """(measured against predicted, whether they differ by more than MISMATCH)."""
        measured, predicted = self.measured_s(), self.plan.predicted.step_time_s
        if measured is None:
            return "no step was timed", False
        error = measured / predicted - 1
        text = (f"step time measured {measured:.4g} s (median of {max(len(self.seconds) - 1, 1)} steps) against "
                f"{predicted:.4g} s predicted for {self.plan.cluster.describe()} ({error:+.1%}); "
                f"{self.tokens_per_s(measured):,.0f} tokens/s, MFU {self.mfu(measured):.1%} "
                f"(predicted {self.plan.predicted.mfu:.1%})")
        return text, abs(error) > MISMATCH

    def record(self) -> dict:
        """What --log-json keeps of the timing."""
        measured = self.measured_s()
        return {"step_times_s": self.seconds, "measured_step_time_s": measured,
                "predicted_step_time_s": self.plan.predicted.step_time_s,
                "tokens_per_s": self.tokens_per_s(measured) if measured else None,
                "mfu": self.mfu(measured) if measured else None}
