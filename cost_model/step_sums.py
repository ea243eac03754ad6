"""What the step model caches per (tp solution, knobs): per-layer seconds and bytes with their prefix sums, so
a stage of layers a..b is priced by differences of them (`cost_model.step`), whatever the depth."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def prefix_sums(values: np.ndarray) -> np.ndarray:
    return np.concatenate(([0.0], np.cumsum(values)))


def flat_value(values: np.ndarray) -> float | None:
    """The value every layer shares (no layer re-run: 0), or None."""
    return float(values[0]) if values.size and values.min() == values.max() else None


def range_peak(values: np.ndarray, ranges: list[tuple[int, int]], flat: float | None) -> float:
    """max(values[a:b]) over the non-empty ranges (values >= 0; 0.0 when none is): `flat` where every layer
    holds the same, without a pass per range (a deep pipeline's stage has up to 8 chunks)."""
    if flat is not None:
        return flat if any(b > a for a, b in ranges) else 0.0
    return max([float(values[a:b].max()) for a, b in ranges if b > a] + [0.0])


@dataclass
class LayerTimes:
    """Per-layer seconds for one (solution, recompute, cp, ep, ep_as), with prefix sums, and the two ends."""

    time: np.ndarray
    prefix: dict[str, np.ndarray]  # time, compute, forward, backward, activation, imbalance (its ep margin)
    pre_s: float
    post_s: float
    total_s: float
    transient: np.ndarray  # per layer: held while backward re-runs it (0 where it is not recomputed)
    ends_bytes: tuple[float, float]  # activations of the parts before and after the layers
    mean_transient: np.ndarray  # `transient` with MoE routed rows at the ep group's mean (no imbalance margin)
    flat: tuple[float | None, float | None] = (None, None)  # the value all of transient / mean_transient share
    ends_forward: tuple[float, float] = (0.0, 0.0)  # the ends' forward compute, autocast's casts included
    ends_backward: tuple[float, float] = (0.0, 0.0)  # and their backward
    _lists: dict | None = None

    def ends_compute(self, first: bool, last: bool) -> list[tuple[float, float]]:
        """(forward, backward) seconds of the ends a stage holds: the embedding's if `first`, the head's if `last`."""
        return [(f, b) for f, b, here in zip(self.ends_forward, self.ends_backward, (first, last)) if here]

    def lists(self) -> dict[str, list[float]]:
        """`prefix` as Python floats, the same doubles: a stage's sums over a few ranges read them faster."""
        if self._lists is None:
            self._lists = {k: v.tolist() for k, v in self.prefix.items()}
        return self._lists


@dataclass
class LayerStates:
    """Per-layer model-state bytes for one (solution, ZeRO, data-parallel ranks, ep, precision, whether a step's
    gradients live through its forward), with prefix sums. `static`: what a layer holds at the peak of forward +
    backward (`grads_held`: a step of one microbatch frees its gradients as it starts and makes them while backward
    frees the activations, so that peak holds none); prefix "cast" and "step_temp": the autocast copies (gone by
    the optimizer step) and AdamW's fp32 temporary (4 B per parameter it steps), for the optimizer step's peak."""

    static: np.ndarray
    prefix: dict[str, np.ndarray]  # dense, expert, weights, grads, optimizer, cast, step_temp, tensors
    pre: tuple[float, float, float, float, float]  # dense, expert, weights, grads, optimizer
    post: tuple[float, float, float, float, float]
    temporary: float
    _lists: dict | None = None
    grads_held: bool = True
    ends_step: tuple[tuple[float, float], tuple[float, float]] = ((0.0, 0.0), (0.0, 0.0))  # (cast, step_temp) per end

    lists = LayerTimes.lists

    def held(self, end: tuple[float, ...]) -> float:
        """The model-state bytes an end (`pre` / `post`) holds at the peak of forward + backward."""
        return end[2] + end[4] + (end[3] if self.grads_held else 0.0)


def peak_phase(sums: dict[str, float], grads_held: bool, activations: float, imbalance: float, temporary: float
               ) -> dict[str, float]:
    """A stage's memory in its two phases: the forward + backward phase by part (MemoryBreakdown's), the
    optimizer step's total ("step_phase"), and the larger of the two ("memory"):

        forward + backward   weights + optimizer states (+ gradients where a later microbatch's forward finds
                             them) + activations + the ep margin + temporary buffers
        optimizer step       weights less autocast's copies + gradients + optimizer states + AdamW's temporary

    The parts stay the forward + backward phase's even where the step is the peak, so that the plan's
    activations are what a forward holds (`LayerStates`; the lent H200's one-GPU steps peaked at the first in
    every case but one, a Llama 3B of two microbatches under bf16-master with small activations, whose
    optimizer step peaked 1.9 GB higher)."""
    forward = {"weights": sums["weights"], "grads": sums["grads"] if grads_held else 0.0,
               "optimizer_states": sums["optimizer"], "activations": activations, "temporary": temporary,
               "imbalance": imbalance}
    step = sums["weights"] - sums["cast"] + sums["grads"] + sums["optimizer"] + sums["step_temp"]
    return {**forward, "step_phase": step, "memory": max(sum(forward.values()), step)}
