"""End to end under torchrun: search a plan for the launched world, parallelize, train, log."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gloo


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("WORLD_SIZE", None)
    return env


def test_torchrun_two_ranks_trains_and_the_loss_falls(tmp_path, free_port):
    log = tmp_path / "losses.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           "-m", "autoplan.train", "--model", "tiny-gpt", "--global-batch", "8", "--seq", "32", "--steps", "12",
           "--lr", "3e-3", "--log-json", str(log)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=_env(), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    record = json.loads(log.read_text())
    losses = record["losses"]
    assert len(losses) == 12 and all(l == l for l in losses)
    # the timing report: every step timed, the median against the plan's prediction
    assert len(record["step_times_s"]) == 12 and record["measured_step_time_s"] > 0
    assert record["mfu"] > 0 and record["predicted_step_time_s"] > 0
    assert "predicted for" in result.stdout and "tokens/s" in result.stdout
    # after the first step: the activations one microbatch leaves, measured against the plan (issue 19)
    found = re.search(r"activations of one microbatch: measured [\d.]+ MB \(largest rank\) against [\d.]+ MB "
                      r"predicted \(([+-][\d.]+)%\)", result.stdout)
    assert found and abs(float(found.group(1))) <= 5.0, result.stdout[-2000:]
    assert losses[-1] < losses[0] - 0.5, losses


def test_without_torchrun_the_error_says_how_to_launch(tmp_path):
    cmd = [sys.executable, "-m", "autoplan.train", "--model", "tiny-gpt", "--steps", "1"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=_env(), cwd=tmp_path)
    assert result.returncode == 2
    assert "torchrun" in result.stderr
