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
