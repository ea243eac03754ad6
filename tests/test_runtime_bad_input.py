"""Launches the runtime refuses before it creates a process group or allocates a parameter, each with
a message that says what was expected and what was found (no processes are started here; a
checkpoint of another model is refused in test_runtime_checkpoint, a wrong world size inside a
real group in test_runtime_parity)."""

from __future__ import annotations

import dataclasses

import pytest
import torch.distributed as dist

from _dist import make_plan


@pytest.fixture
def launched(monkeypatch):
    """The environment torchrun gives rank 0 of 2 (nothing is initialised)."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.delenv("MASTER_ADDR", raising=False)


def _parallelize(plan, **kwargs):
    from autoplan.models import build_model, get_model_config
    from autoplan.runtime.launch import parallelize

    config = get_model_config(plan.model.name)
    return parallelize(build_model(config), None, plan, config=config, **kwargs)


def test_world_size_differs_from_the_plan(launched):
    from autoplan.errors import PlanError

    with pytest.raises(PlanError, match=r"launched world size 2 != plan mesh world size 4 "
                                        r"\(dp2 x tp2\); launch 4 processes or plan for 2"):
        _parallelize(make_plan("tiny-gpt", 2, 2, "megatron"))
    assert not dist.is_initialized()


@pytest.mark.parametrize("backend", ["nccl", "no-such-backend"])
def test_a_missing_backend_names_what_is_available(launched, backend):
    from autoplan.errors import ConfigError

    if backend == "nccl" and dist.is_backend_available("nccl"):
        match = "backend 'nccl' needs CUDA devices"  # a CUDA build on a machine without GPUs
    else:
        match = rf"backend '{backend}' is not available in this torch build .*available: \[.*gloo"
    with pytest.raises(ConfigError, match=match):
        _parallelize(make_plan("tiny-gpt", 2, 1), backend=backend)
    assert not dist.is_initialized()


@pytest.mark.parametrize("ep_margin", [0.0, 5e14])
def test_a_plan_that_does_not_fit_is_refused_before_any_allocation(launched, monkeypatch, ep_margin):
    from autoplan.errors import PlanError
    from autoplan.plan import MemoryBreakdown
    from autoplan.runtime import launch

    plan = make_plan("tiny-gpt", 2, 1)
    memory = MemoryBreakdown(3e15, 1e15, 2e15, 4e15, 0.0, ep_margin)
    plan = dataclasses.replace(plan, predicted=dataclasses.replace(
        plan.predicted, peak_memory_bytes=memory.total_bytes(), memory=memory))
    monkeypatch.setattr(launch, "rewrite", lambda *a, **k: pytest.fail("rewrote the model"))
    have, _ = launch.device_memory_bytes(launch._device_for("gloo"))
    with pytest.raises(PlanError) as info:
        _parallelize(plan)
    message = str(info.value)
    assert f"plan predicts a peak of {(1e16 + ep_margin) / 2**30:.2f} GiB per rank" in message
    assert f"parameters {3e15 / 2**30:.2f}" in message and "activations" in message
    # the busiest ep rank's margin as its own line, as `autoplan explain` shows it; none without ep
    assert (f"ep routing imbalance margin {ep_margin / 2**30:.2f}" in message) == bool(ep_margin)
    assert f"has {have / 2**30:.2f} GiB: it would not fit" in message
    assert not dist.is_initialized()


@pytest.mark.parametrize("timeout_s", [0, -5.0, float("nan")])
def test_a_timeout_that_is_not_a_positive_number_is_refused(launched, timeout_s):
    from autoplan.errors import ConfigError

    with pytest.raises(ConfigError, match=rf"timeout_s={timeout_s!r}: a collective's timeout must "
                                          r"be a positive number of seconds \(default 300\)"):
        _parallelize(make_plan("tiny-gpt", 2, 1), timeout_s=timeout_s)
    assert not dist.is_initialized()
