"""`parallelize`: a model + a Plan -> this process's RankProgram, under torchrun or any launcher that
has initialised (or set the environment for) the default process group.

Everything that can be checked without communicating is checked first, so a wrong launch fails on
every rank with a message instead of hanging in a collective, and before any parameter is allocated:

    model fingerprint (its ModelConfig's) == plan.model.fingerprint
    the plan's batch, sequence, microbatches and schedule suit its mesh (`check_plan`)
    launched world size == plan.mesh.world_size
    the requested backend exists in this torch build (gloo on CPU, nccl on CUDA by default)
    plan.predicted.peak_memory_bytes <= this rank's device memory (`check_memory`)
    timeout_s > 0

Bounded waits: every process group this call creates (the default one when nobody has, and the
mesh axes' groups) gets `timeout_s` (default DEFAULT_TIMEOUT_S = 300 s): a collective that waits
longer for another rank fails. Under gloo it raises `CollectiveError` naming the collective, its
group and the rank; under NCCL torch's watchdog aborts the process. torchrun then stops the job.
"""

from __future__ import annotations

import dataclasses
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from autoplan.cluster import ClusterSpec, cluster_mismatch, parse_cluster
from autoplan.errors import ConfigError, PlanError
from autoplan.models.config import ModelConfig
from autoplan.plan import Plan
from autoplan.runtime.groups import build_axis_groups
from autoplan.runtime.init import init_rules
from autoplan.runtime.kernels import use_triton
from autoplan.runtime.program import RankProgram
from autoplan.runtime.rewrite import rewrite
from autoplan.validity import SCHEDULE_INTERLEAVED, check, configuration_problems

GIB = float(1 << 30)
DEFAULT_TIMEOUT_S = 300.0  # how long a collective may wait for the slowest rank


def parallelize(model: nn.Module, cluster: ClusterSpec | str | None, plan: Plan, *, seed: int = 0,
                group: dist.ProcessGroup | None = None, config: ModelConfig | None = None,
                backend: str | None = None, check_memory: bool = True,
                kernels: str | None = None, timeout_s: float | None = None,
                check_finite: bool = True) -> RankProgram:
    """This rank's program for `plan`. `model` may be on meta (preferred) or CPU; its weights are
    not used: parameters come from the seeded init. `config` defaults to `model.config`.
    `backend` names the torch.distributed backend when this call initialises the process group
    (default: nccl with CUDA, else gloo). `kernels` overrides `plan.kernels` ("auto": the Triton
    kernels of runtime.kernels on CUDA, torch on CPU; "triton"; "torch"). `timeout_s` bounds every
    collective on the groups this call creates (None: DEFAULT_TIMEOUT_S; module docstring).
    `check_finite`: train_step refuses a non-finite loss or gradient norm (runtime.health; one
    more all-reduce of a scalar over tp per step when tp > 1)."""
    config = _config_of(model, config)
    if kernels is not None:
        plan = dataclasses.replace(plan, kernels=kernels)  # validated by Plan
    check_plan(plan, config, cluster)
    world = _launched_world_size(group)
    if world != plan.mesh.world_size:
        raise PlanError(f"launched world size {world} != plan mesh world size "
                        f"{plan.mesh.world_size} ({plan.mesh}); launch {plan.mesh.world_size} "
                        f"processes or plan for {world}")
    backend = _check_backend(backend)
    if check_memory:
        check_memory_fits(plan, _device_for(backend))
    use_triton(_device_for(backend), plan.kernels)  # "triton" where it cannot run: a ConfigError
    timeout = _timeout(timeout_s)
    _init_process_group(backend, timeout)
    if group is not None and world != dist.get_world_size():
        raise PlanError(f"group has {world} ranks but the job has {dist.get_world_size()}: every "
                        f"process must join, because each one creates every mesh group")
    mesh_rank = dist.get_rank(group)
    to_global = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
    groups = build_axis_groups(plan.mesh, mesh_rank, to_global, timeout)
    rewritten = rewrite(model, config, plan, groups)
    rules = init_rules(model, config.num_layers)
    return RankProgram(rewritten, plan, groups, rules, seed, _device(), mesh_rank, to_global,
                       vocab=config.vocab, check_finite=check_finite)


def check_plan(plan: Plan, config: ModelConfig, cluster: ClusterSpec | str | None = None) -> None:
    """Every check that needs no communication; raises PlanError naming both values. The configuration
    rules are `autoplan.validity`'s, the ones `autoplan estimate` applies, in the same words."""
    if config.fingerprint() != plan.model.fingerprint:
        raise PlanError(f"model fingerprint {config.fingerprint()} ({config.name}) != plan model "
                        f"fingerprint {plan.model.fingerprint} ({plan.model.name}); this plan was "
                        f"made for another model: re-run the search for this one")
    check_cluster(plan, cluster)
    stages_per_rank = max(1, len(plan.stages) // plan.mesh.pp)
    problems = configuration_problems(config, plan.mesh, plan.global_batch, plan.seq_len, plan.microbatch_size,
                                      plan.zero_stage, plan.recompute, plan.schedule, stages_per_rank,
                                      heads_rule=False,  # the plan's strategies decide how heads split
                                      stage_layers=plan.stage_layers)
    check(problems, PlanError)
    if plan.schedule != SCHEDULE_INTERLEAVED and len(plan.stages) > plan.mesh.pp:
        raise PlanError(f"the plan has {len(plan.stages)} stages for pp={plan.mesh.pp} (virtual stages) but "
                        f"schedule {plan.schedule!r}: use '{SCHEDULE_INTERLEAVED}'")


def check_cluster(plan: Plan, cluster: ClusterSpec | str | None) -> None:
    """The cluster given must be the plan's (`autoplan.cluster.cluster_mismatch`: device and layout),
    whichever runtime runs it; None: not checked."""
    if cluster is None:
        return
    spec = parse_cluster(cluster) if isinstance(cluster, str) else cluster
    mismatch = cluster_mismatch(plan.cluster, spec)
    if mismatch:
        raise PlanError(mismatch)


def device_memory_bytes(device: torch.device) -> tuple[float, str]:
    """(bytes, description) of the memory one rank may use: the GPU's, or on CPU the machine's
    RAM divided among the ranks on this node (LOCAL_WORLD_SIZE)."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return float(props.total_memory), f"{device} ({props.name})"
    ram = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    return ram / max(local, 1), f"cpu ({ram / GIB:.1f} GiB RAM shared by {local} local ranks)"


def check_memory_fits(plan: Plan, device: torch.device) -> None:
    """Refuse, before any allocation, a plan whose predicted peak exceeds this rank's memory."""
    need = plan.predicted.peak_memory_bytes
    have, what = device_memory_bytes(device)
    if need > have:
        m = plan.predicted.memory
        margin = (f", ep routing imbalance margin {m.ep_imbalance_bytes / GIB:.2f}"  # as `autoplan explain`
                  if m.ep_imbalance_bytes else "")
        raise PlanError(
            f"plan predicts a peak of {need / GIB:.2f} GiB per rank (parameters "
            f"{m.parameters_bytes / GIB:.2f}, gradients {m.gradients_bytes / GIB:.2f}, optimizer "
            f"{m.optimizer_bytes / GIB:.2f}, activations {m.activations_bytes / GIB:.2f}{margin} GiB) but "
            f"this rank's device {what} has {have / GIB:.2f} GiB: it would not fit. Plan for this "
            f"device (autoplan search --cluster ...), or pass check_memory=False to try anyway")


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


def _check_backend(backend: str | None) -> str:
    """The backend to run on: the initialised group's, else `backend`, else nccl / gloo; it must
    exist in this torch build (and nccl needs CUDA)."""
    if dist.is_initialized():
        found = str(dist.get_backend())
        if backend is not None and backend not in found.split(":"):
            raise ConfigError(f"backend {backend!r} was requested but the process group is "
                              f"already initialised with {found!r}")
        return found
    wanted = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    available = [b for b in ("gloo", "nccl", "mpi", "ucc", "xccl")
                 if dist.is_backend_available(b)]
    if wanted not in available:
        raise ConfigError(f"torch.distributed backend {wanted!r} is not available in this torch "
                          f"build (torch {torch.__version__}); available: {available}")
    if wanted == "nccl" and not torch.cuda.is_available():
        raise ConfigError("backend 'nccl' needs CUDA devices, but torch.cuda.is_available() is "
                          "False; use backend 'gloo' on CPU")
    return wanted


def _timeout(timeout_s: float | None) -> timedelta:
    if timeout_s is None:
        return timedelta(seconds=DEFAULT_TIMEOUT_S)
    if not timeout_s > 0:  # also refuses NaN
        raise ConfigError(f"timeout_s={timeout_s!r}: a collective's timeout must be a positive "
                          f"number of seconds (default {DEFAULT_TIMEOUT_S:g})")
    return timedelta(seconds=timeout_s)


def _init_process_group(backend: str, timeout: timedelta) -> None:
    """Initialise the default group from torchrun's environment if nobody has (`timeout` also
    bounds the wait for every rank to join)."""
    if dist.is_initialized():
        return
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise ConfigError(f"no process group is initialised and the environment lacks "
                          f"{missing}: launch with torchrun, or call "
                          f"torch.distributed.init_process_group first")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    store = _attempt_store(timeout)
    if store is None:
        dist.init_process_group(backend, timeout=timeout)
    else:
        dist.init_process_group(backend, store=store, rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)


def _attempt_store(timeout: timedelta) -> dist.Store | None:
    """torchrun's store with its keys scoped to this attempt, for a one-node job whose torchrun
    shares its own store with the workers; else None (torch's default rendezvous).

    Such a store outlives a restart (`--max-restarts`), so the restarted ranks could read the dead
    attempt's gloo addresses and fail to connect (pytorch/pytorch#135712): a prefix per
    TORCHELASTIC_RESTART_COUNT keeps attempts apart. That count is kept per node, so a multi-node
    job is left alone: run it with `--rdzv-backend c10d` and TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1,
    which gives every attempt a store of its own."""
    shared = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    one_node = os.environ.get("LOCAL_WORLD_SIZE") == os.environ["WORLD_SIZE"]
    if not (shared and one_node):
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          int(os.environ["WORLD_SIZE"]), is_master=False, timeout=timeout)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"autoplan/attempt-{attempt}/", store)


def _device_for(backend: str) -> torch.device:
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def _device() -> torch.device:
    """cuda:LOCAL_RANK (else the current CUDA device) under nccl, CPU under gloo."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", torch.cuda.current_device())))
    return torch.device("cpu")
