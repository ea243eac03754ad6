"""Fixtures shared by the test files.

    free_port        a TCP port free on this machine, for a process group or torchrun
    reference_run    the one-process reference of a parity test (tests/_dist.reference: seeded init, plain
                     AdamW), computed once per session for each (model, batches, seed, lr, eps)

Spawning gloo ranks, building plans and comparing runs are in tests/_dist.py.
"""

from __future__ import annotations

import hashlib

import pytest
import torch

from _dist import _free_port, reference


@pytest.fixture
def free_port():
    """A callable: a port nothing listens on now (the OS picks it)."""
    return _free_port


@pytest.fixture(scope="session")
def reference_run():
    """A callable (config, tokens, targets, seed, lr, eps) -> the one-process reference, cached for the
    session: several test files compare against the same runs."""
    cache: dict[tuple, dict] = {}

    def run(config, tokens: torch.Tensor, targets: torch.Tensor, seed: int, lr: float, eps: float) -> dict:
        data = hashlib.blake2b(tokens.numpy().tobytes() + targets.numpy().tobytes(), digest_size=16).hexdigest()
        key = (config.fingerprint(), tuple(tokens.shape), data, seed, lr, eps)
        if key not in cache:
            cache[key] = reference(config, seed, tokens, targets, lr, eps)
        return cache[key]

    return run
