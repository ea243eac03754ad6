"""Errors autoplan raises for bad input.

Every message says what was given, what was expected, and what to change. They all derive from
`AutoplanError` (a `ValueError`), so callers can catch one type.
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
