"""`parallelize`: a model + a Plan -> this process's RankProgram, under torchrun or any launcher that
has initialised (or set the environment for) the default process group.

Everything that can be checked without communicating is checked first, so a wrong launch fails on
every rank with a message instead of hanging in a collective:

    launched world size == plan.mesh.world_size
    model fingerprint (its ModelConfig's) == plan.model.fingerprint
    the plan uses only what this runtime executes (pp = cp = ep = 1)
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn

from autoplan.cluster import ClusterSpec, parse_cluster
from autoplan.errors import ConfigError, PlanError
from autoplan.models.config import ModelConfig
from autoplan.plan import Plan
from autoplan.runtime.groups import build_axis_groups
from autoplan.runtime.init import init_rules
from autoplan.runtime.program import RankProgram
from autoplan.runtime.rewrite import rewrite

UNSUPPORTED_AXES = {"pp": "pipeline parallelism", "cp": "context parallelism",
                    "ep": "expert parallelism"}
LATER_ISSUE = "a later runtime issue adds it"


def parallelize(model: nn.Module, cluster: ClusterSpec | str | None, plan: Plan, *, seed: int = 0,
                group: dist.ProcessGroup | None = None, config: ModelConfig | None = None
                ) -> RankProgram:
    """This rank's program for `plan`. `model` may be on meta (preferred) or CPU; its weights are
    not used: parameters come from the seeded init. `config` defaults to `model.config`."""
    config = _config_of(model, config)
    check_plan(plan, config, cluster)
    world = _launched_world_size(group)
    if world != plan.mesh.world_size:
        raise PlanError(f"launched world size {world} != plan mesh world size "
                        f"{plan.mesh.world_size} ({plan.mesh}); launch {plan.mesh.world_size} "
                        f"processes or plan for {world}")
    _init_process_group()
    if group is not None and world != dist.get_world_size():
        raise PlanError(f"group has {world} ranks but the job has {dist.get_world_size()}: every "
                        f"process must join, because each one creates every mesh group")
    mesh_rank = dist.get_rank(group)
    to_global = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
    groups = build_axis_groups(plan.mesh, mesh_rank, to_global)
    rewritten = rewrite(model, config, plan, groups["tp"])
    rules = init_rules(model, config.num_layers)
    return RankProgram(rewritten, plan, groups, rules, seed, _device())


def check_plan(plan: Plan, config: ModelConfig, cluster: ClusterSpec | str | None = None) -> None:
    """Every check that needs no communication; raises PlanError naming both values."""
    if config.fingerprint() != plan.model.fingerprint:
        raise PlanError(f"model fingerprint {config.fingerprint()} ({config.name}) != plan model "
                        f"fingerprint {plan.model.fingerprint} ({plan.model.name}); this plan was "
                        f"made for another model: re-run the search for this one")
    if cluster is not None:
        spec = parse_cluster(cluster) if isinstance(cluster, str) else cluster
        if spec.world_size != plan.mesh.world_size:
            raise PlanError(f"cluster {spec.describe()} has {spec.world_size} devices but the plan "
                            f"mesh {plan.mesh} has {plan.mesh.world_size} ranks")
    for axis, what in UNSUPPORTED_AXES.items():
        if plan.mesh.degree(axis) > 1:
            raise PlanError(f"plan has {axis}={plan.mesh.degree(axis)}: {what} is not executed "
                            f"by this runtime yet ({LATER_ISSUE}); plan with {axis}=1")


def _config_of(model: nn.Module, config: ModelConfig | None) -> ModelConfig:
    found = config if config is not None else getattr(model, "config", None)
    if not isinstance(found, ModelConfig):
        raise ConfigError(f"parallelize needs the model's ModelConfig to check its fingerprint "
                          f"against the plan: pass config=... ({type(model).__name__} has no "
                          f".config)")
    return found


def _launched_world_size(group: dist.ProcessGroup | None) -> int:
    """The world size, read from torchrun's environment when no group exists yet."""
    if dist.is_initialized():
        return dist.get_world_size(group)
    if "WORLD_SIZE" not in os.environ:
        raise ConfigError("no process group is initialised and WORLD_SIZE is not set: launch with "
                          "torchrun, or call torch.distributed.init_process_group first")
    return int(os.environ["WORLD_SIZE"])


def _init_process_group() -> None:
    """Initialise the default group from torchrun's environment if nobody has (gloo on CPU,
    nccl on CUDA)."""
    if dist.is_initialized():
        return
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise ConfigError(f"no process group is initialised and the environment lacks "
                          f"{missing}: launch with torchrun, or call "
                          f"torch.distributed.init_process_group first")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend)


def _device() -> torch.device:
    """cuda:LOCAL_RANK (else the current CUDA device) under nccl, CPU under gloo."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", torch.cuda.current_device())))
    return torch.device("cpu")
