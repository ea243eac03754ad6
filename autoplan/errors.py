"""Errors autoplan raises for bad input.

Every message says what was given, what was expected, and what to change. They all derive from
`AutoplanError` (a `ValueError`), so callers can catch one type; except `CollectiveError`, a
`RuntimeError`: a collective that timed out or lost a peer is no fault of the input.
"""

from __future__ import annotations


class AutoplanError(ValueError):
    """Base class: invalid input or an impossible request, explained in the message."""


class ConfigError(AutoplanError):
    """A malformed model config, cluster spec, or command-line value."""


class PlanError(AutoplanError):
    """A plan file that is malformed, of another version, or does not match the model or launch."""


class InfeasibleError(AutoplanError):
    """No configuration fits: the message says by how much and which knob would help."""


class TrainingDivergedError(AutoplanError):
    """A training step whose global loss or gradient norm is not finite (NaN or infinite).

    Raised by `RankProgram.train_step` on every rank together, before the optimizer step, so the
    parameters and optimizer states stay those of the last good step. `step` is the index of the
    step that diverged, `parameter` the first parameter (in the model's order, by its full name)
    whose gradient holds a non-finite value, or None when every gradient is finite."""

    def __init__(self, step: int, loss: float, grad_norm: float | None,
                 parameter: str | None) -> None:
        self.step, self.loss, self.grad_norm, self.parameter = step, loss, grad_norm, parameter
        where = (f"; first parameter with a non-finite gradient: {parameter}" if parameter
                 else "; every gradient is finite")
        super().__init__(
            f"training diverged at step {step}: global loss {loss}, gradient norm {grad_norm}"
            f"{where}. The optimizer step was not taken; lower the learning rate (or resume from "
            f"the last checkpoint with a lower one)")


class CollectiveError(RuntimeError):
    """A collective that failed: it timed out waiting for another rank (the process group's
    timeout) or a peer's connection closed. Not an AutoplanError: the input was not at fault.
    `detail` is the backend's own message; `step` is set when it happened in a training step."""

    def __init__(self, kind: str, group: str, ranks: list[int], rank: int, detail: str) -> None:
        self.kind, self.group, self.ranks, self.rank, self.detail = kind, group, ranks, rank, detail
        self.step: int | None = None
        super().__init__(detail)

    def __str__(self) -> str:
        at = f" at step {self.step}" if self.step is not None else ""
        return (f"rank {self.rank}{at}: {self.kind} over process group {self.group!r} (ranks "
                f"{self.ranks}) failed: {self.detail.strip()}{_collective_hint(self.detail)}")


def _collective_hint(detail: str) -> str:
    """What gloo's wording of a failure means for the job (NCCL's watchdog aborts instead)."""
    if "Timed out" in detail or "timed out" in detail:
        return ("; another rank of that group did not join within the process group's timeout "
                "(it stalled, or is much slower): raise the timeout if it is only slow")
    if "Connection" in detail or "connection" in detail:
        return "; another rank of that group exited or lost its connection"
    return ""
