"""The public Python entry points: `search` (plan only) and `parallelize` (plan if needed, then compile).

    plan = autoplan.search("gpt3-175b", "128x8xh100", global_batch=1536, seq_len=2048)

    # under torchrun, one process per rank:
    program = autoplan.parallelize(model, "1x4xcpu", plan=plan)
    loss = program.train_step(tokens, targets, optimizer)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from autoplan.cluster import ClusterSpec
    from autoplan.models.config import ModelConfig
    from autoplan.plan import Plan


def search(model: "ModelConfig | str", cluster: "ClusterSpec | str", global_batch: int, seq_len: int, **options) -> "Plan":
    """Find the fastest plan for `model` (a config or known name) on `cluster` (spec or shorthand).

    Options are those of `autoplan.planner.search` (dtype, fold, time_limit_s, progress).
    """
    from autoplan.planner import search as _search

    return _search(model, cluster, global_batch, seq_len, **options)


def parallelize(model, cluster: "ClusterSpec | str", plan: "Plan | str | None" = None, *, config: "ModelConfig | None" = None,
                global_batch: int | None = None, seq_len: int | None = None, seed: int = 0,
                timeout_s: float | None = None, check_finite: bool = True):
    """Compile `model` into this rank's program under `plan`, searching for a plan when none is given.

    `model` is an autoplan model (ideally built on the meta device: only this rank's shards are
    ever allocated). `plan` may be a Plan or the path of a plan file. Without a plan, `global_batch`
    and `seq_len` are required and the plan is searched for `cluster`. Must run inside an
    initialised torch.distributed job (torchrun) or one this call can initialise from the environment.

    `timeout_s` bounds how long any collective waits for the other ranks (the timeout of the process
    groups this call creates; None: 300 s): a stalled rank then ends the job instead of hanging
    it. With `check_finite` (default), `train_step` raises `TrainingDivergedError` on every rank,
    before the optimizer step, when the global loss or gradient norm is not finite.
    """
    from autoplan.cluster import ClusterSpec, parse_cluster
    from autoplan.errors import AutoplanError
    from autoplan.plan import Plan
    from autoplan.runtime.launch import parallelize as _parallelize

    cluster = cluster if isinstance(cluster, ClusterSpec) else parse_cluster(cluster)
    config = config or getattr(model, "config", None)
    if isinstance(plan, str):
        plan = Plan.load(plan)
    if plan is None:
        if global_batch is None or seq_len is None or config is None:
            raise AutoplanError("parallelize without a plan needs global_batch=, seq_len= and a model that carries .config (or config=)")
        plan = search(config, cluster, global_batch, seq_len)
    return _parallelize(model, cluster, plan, config=config, seed=seed, timeout_s=timeout_s,
                        check_finite=check_finite)
