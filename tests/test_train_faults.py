"""`autoplan.train` under torchrun (2 gloo ranks, tiny-gpt, dp2) when things go wrong:

    diverged  a run resumed with lr 1e30 blows its parameters up in one step; the next step's loss
              is NaN: exit status 3, the message names that step, the log is strict JSON, and the
              checkpoint stays the last good one (that step would have saved one)
    stalled   rank 1 hangs at step 2 under --timeout 5: the job ends within seconds of the
              timeout, rank 0 naming the all-reduce over dp, the step and its rank (status 4)
    killed    rank 1 dies at step 5 under `torchrun --max-restarts 1`: the restarted job resumes
              from the step-4 checkpoint and ends with the uninterrupted run's losses

One uninterrupted run (6 steps, a checkpoint every 2) serves as the reference of all three.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from _dist import _free_port

pytestmark = pytest.mark.gloo

STEPS = 6


def _torchrun(cwd, *args: str, restarts: int = 0, **env: str) -> subprocess.CompletedProcess:
    environ = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **env)
    environ.pop("WORLD_SIZE", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(_free_port()), "--max-restarts", str(restarts),
           "-m", "autoplan.train", "--model", "tiny-gpt", "--plan", "plan.json", "--lr", "3e-3",
           *args]
    # a session of its own, so that a hung job's ranks die with torchrun instead of outliving it
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=environ, cwd=cwd, start_new_session=True) as proc:
        try:
            out, err = proc.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _strict_json(path) -> dict:
    """The file parsed as strict JSON: NaN and Infinity are refused."""
    def refuse(constant):
        raise ValueError(f"{path} holds {constant}, which strict JSON has not")

    return json.loads(path.read_text(), parse_constant=refuse)


def _saved_step(directory) -> int:
    """The step of the checkpoint a resume from `directory` loads (the newest numbered one)."""
    from autoplan.runtime.checkpoint import read_metadata

    return read_metadata(directory)["step"]


def _tree(directory) -> dict[str, int]:
    return {str(p.relative_to(directory)): p.stat().st_mtime_ns for p in directory.rglob("*")}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    from _dist import make_plan

    root = tmp_path_factory.mktemp("train_faults")
    make_plan("tiny-gpt", 2, 1, seq_len=16, microbatch_size=2).save(str(root / "plan.json"))
    return root


@pytest.fixture(scope="module")
def uninterrupted(workdir):
    result = _torchrun(workdir, "--steps", str(STEPS), "--save", "ck-ref", "--save-every", "2",
                       "--log-json", "ref.json")
    assert result.returncode == 0, result.stderr[-3000:]
    log = _strict_json(workdir / "ref.json")
    assert log["first_step"] == 0 and len(log["losses"]) == STEPS
    return log["losses"]


def test_a_diverging_run_stops_at_its_step_and_keeps_the_last_good_checkpoint(workdir,
                                                                                uninterrupted):
    ckpt = workdir / "ck-ref"
    assert _saved_step(ckpt) == STEPS
    files = _tree(ckpt)
    result = _torchrun(workdir, "--steps", "12", "--resume", "ck-ref", "--save", "ck-ref",
                       "--save-every", "2", "--lr", "1e30", "--log-json", "diverged.json")
    assert result.returncode != 0, result.stdout[-2000:]
    lines = [line for line in result.stderr.splitlines() if "autoplan.train: error:" in line]
    assert lines and f"training diverged at step {STEPS + 1}:" in lines[0], result.stderr[-3000:]
    assert "first parameter with a non-finite gradient: " in lines[0]
    assert "exitcode  : 3" in result.stderr  # torchrun's report of rank 0's status
    # step STEPS + 1 would have saved (every 2): the checkpoint is still the one of step STEPS
    assert _saved_step(ckpt) == STEPS
    assert _tree(ckpt) == files  # no numbered checkpoint added, none changed
    assert not list(workdir.glob("ck-ref.*"))  # no half-written save beside it
    log = _strict_json(workdir / "diverged.json")
    assert log["first_step"] == STEPS and len(log["losses"]) == 1  # the step with lr 1e30
    assert f"training diverged at step {STEPS + 1}" in log["stopped"]


def test_a_stalled_rank_ends_the_job_within_the_timeout(workdir):
    start = time.monotonic()
    result = _torchrun(workdir, "--steps", str(STEPS), "--timeout", "5",
                       AUTOPLAN_TEST_STALL_AT_STEP="2")
    elapsed = time.monotonic() - start
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if "autoplan.train: error:" in line]
    assert len(lines) == 1, result.stderr[-3000:]  # rank 0's; rank 1 hangs until torchrun ends it
    assert "rank 0 at step 2: all_reduce over process group 'dp' (ranks [0, 1]) failed:" in lines[0]
    assert "did not join within the process group's timeout" in lines[0]
    assert elapsed < 40, f"the job took {elapsed:.1f} s to end"
    print(f"stalled rank: the job ended after {elapsed:.1f} s (timeout 5 s)")


def test_a_killed_rank_restarts_and_finishes_with_the_uninterrupted_loss(workdir, uninterrupted):
    result = _torchrun(workdir, "--steps", str(STEPS), "--save", "ck-kill", "--save-every", "2",
                       "--log-json", "killed.json", restarts=1, AUTOPLAN_TEST_KILL_AT_STEP="5")
    assert result.returncode == 0, result.stderr[-3000:]
    # printed by the restarted attempt only (no --auto-resume here): the restart happened
    assert "resuming from ck-kill at step 4" in result.stdout, result.stdout[-2000:]
    log = _strict_json(workdir / "killed.json")
    assert log["first_step"] == 4
    assert log["losses"] == pytest.approx(uninterrupted[4:], rel=1e-6, abs=0)
    assert _saved_step(workdir / "ck-kill") == STEPS


def test_log_json_is_strict_and_says_which_losses_were_not_finite(tmp_path):
    from autoplan.train import Run, build_parser, write_outputs

    args = build_parser().parse_args(["--model", "tiny-gpt", "--log-json",
                                      str(tmp_path / "log.json")])
    write_outputs(args, Run([2.5, float("nan"), float("inf")], first_step=3), stopped="why")
    log = _strict_json(tmp_path / "log.json")
    assert log == {"model": "tiny-gpt", "first_step": 3, "losses": [2.5, None, None],
                   "note": "null: a loss that was not finite (NaN or infinite)", "stopped": "why"}
