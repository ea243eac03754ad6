"""RankProgram: one rank's share of a Plan, ready to train.

It holds the rewritten GraphModule (runtime.rewrite) with only this rank's parameter shards
allocated (only those of its pipeline stages), filled with exactly the slice of the single-device
initialisation for the same seed (runtime.init), and the process groups of its mesh axes. Under
pipelining `graph_module` stays the whole per-rank graph, for reading (other stages' parameters
stay on meta); this rank's stages run as `pipeline.modules` (runtime.pipeline).

One step on a global batch of G sequences of T tokens:

    ids checked: every token in [0, V), every target in [0, V) or -100 (runtime.health)
    data shards: D = dp * ep ranks see different sequences, cp ranks different tokens of them:
      rank (d, e, c) takes rows [i G/D, (i+1) G/D) with i = d ep + e, and tokens [c T/cp, (c+1) T/cp);
      with the ep ranks folded over context parallelism (mesh ep_as = "cp"): D = dp, i = d, and the
      C = ep x cp ranks of the context group see different tokens: tokens [j T/C, (j+1) T/C) with j
      the rank's position in that group (runtime.groups "cp": ascending mesh ranks)
    without pipelining: for each of the num_microbatches microbatches m,
      (loss_m / num_microbatches).backward()
    with pipelining (runtime.pipeline): the schedule runs the microbatches through the stages
    gradients summed over the ranks that hold the same shard (dense: dp x ep x cp; experts: dp x
      cp, whatever etp and ep_as), in buckets launched during the last microbatch's backward,
      divided by dp * ep * cp (runtime.grad_sync)
    the global loss and gradient norm, and if either is not finite TrainingDivergedError on every
      rank instead of the step (runtime.health)
    optimizer.step()

Every rank's loss is the mean over its own tokens and all hold equally many, so every gradient is
the gradient of the global mean token loss, as on one device. ZeRO stages 1 and 2 reduce-scatter
the same buckets and step on this rank's slice of them (`grad_sync.ShardedOptimizer`, made by
`make_optimizer`), then all-gather the parameters; stage 3 shards parameters over the data ranks
with FSDP2 (runtime.zero), which reduce-scatters the gradients in backward itself.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from autoplan.errors import CollectiveError, ConfigError, PlanError, TrainingDivergedError
from autoplan.placement import Shard
from autoplan.plan import Plan
from autoplan.runtime import collectives as C
from autoplan.runtime import health
from autoplan.mesh import MeshShape
from autoplan.runtime.grad_sync import GradSync, Replica
from autoplan.runtime.sharded_optimizer import ShardedOptimizer, check_optimizer
from autoplan.runtime.groups import RankGroup, group_of
from autoplan.runtime.init import InitRule, init_local, nested_bounds
from autoplan.runtime.rewrite import ParamLayout, Rewritten
from autoplan.runtime.zero import full_tensor, shard_over_dp


class RankProgram(nn.Module):
    """The per-rank program: `forward(tokens, targets)` on this rank's data share -> mean loss.

    `vocab`: train_step refuses token and target ids outside it (None: unchecked); `check_finite`:
    train_step refuses a non-finite loss or gradient norm (runtime.health). `step` counts the
    optimizer steps taken (from a loaded checkpoint's), `grad_norm` is the last step's global
    gradient norm (None without `check_finite`)."""

    def __init__(self, rewritten: Rewritten, plan: Plan, groups: dict[str, RankGroup],
                 rules: dict[str, InitRule], seed: int, device: torch.device,
                 mesh_rank: int = 0, global_rank_of=lambda r: r, *, vocab: int | None = None,
                 check_finite: bool = True) -> None:
        super().__init__()
        self.vocab, self.check_finite = vocab, check_finite
        self.step, self.grad_norm = 0, None
        self.graph_module = rewritten.graph_module
        self.plan, self.seed, self.device = plan, seed, device
        self.mesh_rank, self.global_rank_of = mesh_rank, global_rank_of
        self.strategies = rewritten.strategies
        self.recompute_policy = rewritten.recompute  # the plan's, as applied (runtime.recompute)
        self.recomputed_layers = rewritten.recomputed_layers
        self.groups = groups  # a plain dict: not submodules
        self.all_layouts = rewritten.params
        self.pipeline = None
        self.optimizer: torch.optim.Optimizer | None = None
        if plan.mesh.pp > 1:
            self.pipeline = self._build_pipeline(rewritten)
        used = self._local_parameter_names()
        self.layouts: dict[str, ParamLayout] = {n: l for n, l in self.all_layouts.items()
                                                if n in used}
        self._materialize(rules)
        self.fsdp = plan.zero_stage == 3 and self.data.size > 1
        self.grad_sync = None
        if self.fsdp:
            shard_over_dp(self.graph_module, rewritten.module_targets, rewritten.module_layers,
                          self.data.group, device, plan.zero_stage, plan.precision)
        else:  # under master weights it takes the fp32 masters, then casts the parameters
            self.grad_sync = GradSync(
                [Replica(p, g.group if g.size > 1 else None, g.size)
                 for n, p in self.named_local_parameters() for g in [self._replicas(n)]],
                1.0 / self.data_shards / (plan.num_microbatches if self.pipeline else 1),
                shard=plan.zero_stage in (1, 2) and self.data.size > 1,
                compute_dtype=torch.bfloat16 if plan.precision == "bf16-master" else None)

    # ------------------------------------------------------------ groups
    @property
    def tp(self) -> RankGroup:
        return self.groups["tp"]

    @property
    def dp(self) -> RankGroup:
        return self.groups["dp"]

    @property
    def data(self) -> RankGroup:
        """dp x ep x cp: the ranks that hold the same dense shards and see different tokens."""
        return self.groups["data"]

    @property
    def data_shards(self) -> int:
        """How many ranks hold distinct tokens of one batch (of one pipeline and tp coordinate)."""
        return self.data.size

    def _replicas(self, name: str) -> RankGroup:
        """The ranks holding the same piece of parameter `name`."""
        return self.groups["expert_data" if self.layouts[name].expert else "data"]

    # ------------------------------------------------------------ parameters
    def _build_pipeline(self, rewritten: Rewritten):
        from autoplan.runtime import pipeline as P

        programs, loss_module = P.split(self.graph_module, rewritten.infos, self.plan)
        rows = self._local_rows() // self.plan.num_microbatches
        seq = self.plan.seq_len // self.groups["cp"].size
        meta = torch.zeros((rows, seq), dtype=torch.int64, device="meta")
        shapes = P.meta_shapes(self.graph_module, meta, meta)
        return P.PipelineRunner(programs, loss_module, self.plan, self.groups["pp"], shapes,
                                (rows, seq), self.device)

    def _local_parameter_names(self) -> set[str]:
        modules = [self.graph_module] if self.pipeline is None else self.pipeline.modules
        if self.pipeline is not None:
            modules = modules + [self.pipeline.loss_module]
        return {self._name_of(m, n) for m in modules for n, _ in m.named_parameters()}

    def _name_of(self, module: nn.Module, name: str) -> str:
        """A parameter's user name from its path in a (stage or recompute region) module: the
        path of a leaf module that the rewritten graph also holds under its own name."""
        parts = name.split(".")
        for start in range(len(parts) - 1):
            candidate = ".".join(parts[start:])
            if candidate in self.all_layouts:
                return candidate
        raise RuntimeError(f"parameter {name!r} of a stage matches no parameter of the model")

    @torch.no_grad()
    def _materialize(self, rules: dict[str, InitRule]) -> None:
        """Replace every meta parameter this rank uses by its shard, filled by the seeded init."""
        for name, layout in self.layouts.items():
            owner, _, attr = name.rpartition(".")
            module = self.graph_module.get_submodule(owner)
            bounds = nested_bounds(layout.shape, layout.pieces(self.groups))
            local = init_local(name, layout.shape, rules[name], self.seed, bounds, torch.float32,
                               self.device)
            expected = tuple(module._parameters[attr].shape)
            if tuple(local.shape) != expected:
                raise RuntimeError(f"parameter {name!r}: init made {tuple(local.shape)}, the "
                                   f"module expects {expected}")
            module._parameters[attr] = nn.Parameter(local)

    def named_local_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """(name in the user's model, this rank's shard), in a fixed order (under ZeRO 3, a
        DTensor sharding the tp-local shard over the data ranks)."""
        for name in self.layouts:
            owner, _, attr = name.rpartition(".")
            yield name, self.graph_module.get_submodule(owner)._parameters[attr]

    @torch.no_grad()
    def full_parameters(self) -> dict[str, torch.Tensor]:
        """This rank's parameters (those of its pipeline stages; under master weights their fp32
        masters) gathered over tp and the expert group, on CPU (a collective: call it on every rank)."""
        masters = self.grad_sync.param_masters() if self.grad_sync is not None else {}
        return {n: self._gather(n, masters.get(id(p), p).detach()) for n, p in self.named_local_parameters()}

    @torch.no_grad()
    def full_gradients(self) -> dict[str, torch.Tensor]:
        """This rank's gradients gathered over tp and the expert group, on CPU (zeros where none);
        call it on every rank."""
        if self.grad_sync is not None and self.grad_sync.masters:
            self.grad_sync.gather_gradients()
        return {n: self._gather(n, p.grad if p.grad is not None else torch.zeros_like(p))
                for n, p in self.named_local_parameters()}

    def _gather(self, name: str, local: torch.Tensor) -> torch.Tensor:
        local = full_tensor(local)
        layout = self.layouts[name]
        if isinstance(layout.placement, Shard) and self.tp.size > 1 and not layout.folded:
            local = C.all_gather_dim(local, layout.placement.dim % local.dim(), self.tp.group)
        if layout.ffn_split is not None:  # 1 < etp < tp: the FFN slices of the expert_tp ranks
            local = C.all_gather_dim(local, layout.ffn_split.dim, self.groups["expert_tp"].group)
        if layout.expert:  # in the expert group's (ascending rank) order, as init splits them
            local = C.all_gather_dim(local, 0, self.groups["expert"].group)
        return local.cpu()

    # ------------------------------------------------------------ running
    def _autocast(self) -> contextlib.AbstractContextManager:
        dtype = getattr(torch, self.plan.dtype)
        if dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=dtype)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean token loss of this rank's (B, T/cp) tokens and targets (B = its data share)."""
        if self.pipeline is not None:
            raise PlanError("a pipelined program runs whole steps only: use train_step")
        tokens, targets = tokens.to(self.device), targets.to(self.device)
        with self._quiet(), self._autocast():
            return self.graph_module(tokens, targets)

    def _quiet(self) -> contextlib.AbstractContextManager:
        """FSDP2 warns on every Linear (its 3-D output is a view), in forward and in recomputing
        backward; the warning is about in-place ops on such views, which runtime.zero refused."""
        stack = contextlib.ExitStack()
        if self.fsdp:
            stack.enter_context(warnings.catch_warnings())
            warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
        return stack

    def _local_rows(self) -> int:
        shards = self.plan.mesh.batch_shards
        if self.plan.global_batch % shards:
            raise ConfigError(f"global batch {self.plan.global_batch} is not divisible by the "
                              f"{_shards_text(self.plan.mesh)} = {shards} batch shards")
        return self.plan.global_batch // shards

    def shard_batch(self, tokens: torch.Tensor, targets: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's rows (of the batch shards: dp x ep, or dp under ep_as = "cp") and tokens
        (its chunk of the context group: cp, or ep x cp) of the global (G, T) tokens and targets
        (module docstring)."""
        mesh = self.plan.mesh
        shards, context = mesh.batch_shards, mesh.context_parallel
        if tokens.shape != targets.shape or tokens.shape[0] % shards:
            raise ConfigError(f"global tokens {tuple(tokens.shape)} and targets "
                              f"{tuple(targets.shape)} must have one shape whose batch is "
                              f"divisible by the {_shards_text(mesh)} = {shards} batch shards")
        if tokens.shape[1] % context:
            raise ConfigError(f"sequence length {tokens.shape[1]} is not divisible by the "
                              f"{' x '.join(mesh.context_axes)} = {context} context-parallel ranks")
        rows, width = tokens.shape[0] // shards, tokens.shape[1] // context
        lo = batch_index(mesh, self.mesh_rank) * rows
        c = context_index(mesh, self.mesh_rank)
        cols = slice(c * width, (c + 1) * width)
        return tokens[lo:lo + rows, cols], targets[lo:lo + rows, cols]

    def train_step(self, tokens: torch.Tensor, targets: torch.Tensor,
                   optimizer: torch.optim.Optimizer) -> float:
        """One optimizer step on the global batch; returns the global mean token loss. Raises
        TrainingDivergedError (every rank, no step taken) on a non-finite loss or gradient norm
        under `check_finite`, and CollectiveError, with the step, when a collective fails."""
        plan = self.plan
        if tuple(tokens.shape) != (plan.global_batch, plan.seq_len):
            raise ConfigError(f"train_step: tokens of shape {tuple(tokens.shape)}; the plan "
                              f"expects (global_batch, seq_len) = ({plan.global_batch}, "
                              f"{plan.seq_len})")
        if self.vocab is not None:
            health.check_token_range(tokens, targets, self.vocab)
        try:
            loss = self._step(tokens, targets, optimizer)
        except CollectiveError as exc:
            exc.step = self.step
            raise
        self.step += 1
        return loss

    def _step(self, tokens: torch.Tensor, targets: torch.Tensor,
              optimizer: torch.optim.Optimizer) -> float:
        """train_step's body after the checks of its input (module docstring)."""
        plan = self.plan
        local_tokens, local_targets = self.shard_batch(tokens, targets)
        # the whole local batch onto the device at once: a blocking copy from host memory synchronises the
        # stream, so one per microbatch would drain the queue the host had run ahead to fill
        local_tokens, local_targets = local_tokens.to(self.device), local_targets.to(self.device)
        check_optimizer(self.grad_sync, optimizer, self.plan.zero_stage)
        optimizer.zero_grad(set_to_none=True)
        if self.grad_sync is not None:
            self.grad_sync.begin_step(plan.num_microbatches)
        if self.pipeline is not None:
            with self._autocast():
                total = self.pipeline.step(local_tokens, local_targets)
        else:
            total = torch.zeros((), device=self.device)
            for mb_tokens, mb_targets in zip(local_tokens.chunk(plan.num_microbatches),
                                             local_targets.chunk(plan.num_microbatches)):
                loss = self(mb_tokens, mb_targets) / plan.num_microbatches
                with self._quiet():
                    loss.backward()
                total += loss.detach().float()
        if self.grad_sync is not None:
            self.grad_sync.finish()
        loss, self.grad_norm = self._global_loss(total)
        if self.check_finite and not (math.isfinite(loss) and math.isfinite(self.grad_norm)):
            raise TrainingDivergedError(self.step, loss, self.grad_norm,
                                        health.first_nonfinite(self))
        optimizer.step()
        return loss

    def _global_loss(self, total: torch.Tensor) -> tuple[float, float | None]:
        """(the mean of every data shard's loss (only the last pipeline stage has one), the
        global gradient norm or None without `check_finite`); the norm's terms are summed over tp
        first, then ride along with the loss over pp and data (runtime.health)."""
        sumsq = torch.zeros((), dtype=torch.float64, device=total.device)
        if self.check_finite:
            sumsq = health.local_sumsq(self)
            if self.tp.size > 1:
                sumsq = C.all_reduce(sumsq, self.tp.group)
        both = torch.stack((total.double(), sumsq))
        for group in (self.groups["pp"], self.data):
            if group.size > 1:
                both = C.all_reduce(both, group.group)
        loss, norm_sq = both.tolist()
        return loss / self.data_shards, math.sqrt(norm_sq) if self.check_finite else None

    def make_optimizer(self, optimizer_class: type[torch.optim.Optimizer] = torch.optim.AdamW,
                       **kwargs) -> torch.optim.Optimizer:
        """`optimizer_class` over this rank's parameters; under zero_stage 1 and 2 over this
        rank's slices of the gradient buckets, each split over the ranks that hold the same
        parameters, and under master weights over their fp32 masters (`ShardedOptimizer`). The program remembers it for
        `save_checkpoint` / `load_checkpoint`."""
        if self.grad_sync is not None and self.grad_sync.masters:
            self.optimizer = ShardedOptimizer(self.grad_sync, optimizer_class, **kwargs)
        else:
            self.optimizer = optimizer_class([p for _, p in self.named_local_parameters()], **kwargs)
        return self.optimizer

    # ------------------------------------------------------------ checkpoints
    def save_checkpoint(self, directory: str | Path, optimizer: torch.optim.Optimizer | None = None,
                        *, step: int = 0) -> Path:
        """Save parameters and optimizer states (default: the one `make_optimizer` made) under
        their full names and shapes, atomically (runtime.checkpoint); call it on every rank."""
        from autoplan.runtime.checkpoint import save

        return save(self, directory, optimizer or self.optimizer, step)

    def load_checkpoint(self, directory: str | Path,
                        optimizer: torch.optim.Optimizer | None = None, *,
                        parameters_only: bool = False) -> dict:
        """Load a checkpoint saved under any plan of this model into the parameters and the
        optimizer (default: the one `make_optimizer` made; none with `parameters_only`); returns
        its metadata (with "step"). Call it on every rank."""
        from autoplan.runtime.checkpoint import load

        meta = load(self, directory, None if parameters_only else optimizer or self.optimizer)
        if isinstance(self.optimizer, ShardedOptimizer):  # its fp32 slices of the new parameters
            self.optimizer.reload_parameters()
        self.step = int(meta.get("step", 0))
        return meta

    # ------------------------------------------------------------ inspection
    def count_collectives(self) -> contextlib.AbstractContextManager[Counter]:
        """Count the collectives issued inside the block by (kind, axis group), e.g.
        ("all_reduce", "tp"); see runtime.counting for what a plan predicts."""
        from autoplan.runtime.counting import NAME_ORDER

        names = {}
        for kind in NAME_ORDER:  # later kinds are narrower: the narrowest name wins
            group = self.groups[kind].group
            if group is not None:
                names[group] = kind
        return C.count_collectives(names)

    def explain(self) -> str:
        """One line per node that is not replicated: its strategy."""
        return "\n".join(f"{node}: {s.name}" for node, s in self.strategies.items()
                         if s.name != "replicate")


def batch_index(mesh: MeshShape, rank: int) -> int:
    """Which of the batch shards `rank` takes: d ep + e over dp x ep, or d when the ep ranks split
    the sequence instead (ep_as = "cp")."""
    coords = mesh.coords(rank)
    return coords["dp"] if mesh.ep_as == "cp" else coords["dp"] * mesh.ep + coords["ep"]


def context_index(mesh: MeshShape, rank: int) -> int:
    """Which sequence chunk `rank` holds: its position among the ascending mesh ranks of its
    context group (cp, or ep x cp), the order runtime.groups gives the "cp" group and in which
    the Ulysses all-to-alls (runtime.context) gather the chunks."""
    return group_of(mesh, rank, mesh.context_axes).index(rank)


def _shards_text(mesh: MeshShape) -> str:
    return "dp" if mesh.ep_as == "cp" or mesh.ep == 1 else "dp x ep"
