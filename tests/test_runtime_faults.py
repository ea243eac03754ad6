"""Bounded faults in the runtime: a collective that waits for a stalled rank longer than its
group's timeout (`parallelize(timeout_s=...)`, passed to every group runtime.groups creates) fails
with a CollectiveError naming the collective, the group and the rank, instead of hanging. The
end-to-end runs (a stalled rank under `autoplan.train --timeout`, a killed rank under torchrun's
restarts) are in test_train_faults."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch

from _dist import spawn

pytestmark = pytest.mark.gloo

TIMEOUT_S = 2.0


def _stall(rank: int, world: int) -> dict:
    from autoplan.errors import CollectiveError
    from autoplan.mesh import MeshShape
    from autoplan.runtime import collectives as C
    from autoplan.runtime.groups import build_axis_groups

    groups = build_axis_groups(MeshShape(dp=1, tp=2), rank, timeout=timedelta(seconds=TIMEOUT_S))
    if rank == 1:  # stalls past the timeout, then leaves without joining
        time.sleep(TIMEOUT_S + 1)
        return {}
    start = time.monotonic()
    try:
        C.all_reduce(torch.ones(3), groups["tp"].group)
    except CollectiveError as exc:
        return {"waited_s": time.monotonic() - start, "message": str(exc), "kind": exc.kind,
                "group": exc.group, "ranks": exc.ranks, "rank": exc.rank}
    return {"waited_s": time.monotonic() - start, "message": None}


def test_a_collective_waiting_past_the_timeout_names_itself_its_group_and_rank():
    out = spawn(_stall, 2)[0]
    assert out["message"] is not None, "the all-reduce returned without its peer"
    assert TIMEOUT_S - 0.5 < out["waited_s"] < TIMEOUT_S + 5, out
    assert (out["kind"], out["group"], out["ranks"], out["rank"]) == ("all_reduce", "tp", [0, 1], 0)
    assert out["message"].startswith("rank 0: all_reduce over process group 'tp' (ranks [0, 1]) "
                                     "failed: "), out["message"]
    assert "did not join within the process group's timeout" in out["message"]
