"""ModuleProgram: the user's own module (a transformers causal LM, or any nn.Module whose
`forward(input_ids)` returns logits) run under a Plan with the PyTorch-native stack.

    mesh      a DeviceMesh ("dp", "ep", "cp", "tp") over the plan's ranks, laid out as the plan's MeshShape
    tp        `parallelize_module` with the styles of `runtime.module_plan` (`runtime.module_styles`)
    weights   the module's own tensors (rank 0's: a model with weights is first broadcast, then
              each rank keeps its shards), or, for a model on meta, this rank's slices of a
              Hugging Face checkpoint directory (`runtime.weights`)
    ZeRO      0: gradients averaged over dp in buckets all-reduced while backward runs
                 (`runtime.grad_sync`, the zoo's mechanism too)
              1, 2: the same buckets reduce-scattered while backward runs; the optimizer steps on
                 this rank's fp32 slice of them and all-gathers the parameters
                 (`grad_sync.ShardedOptimizer`, made by `make_optimizer`)
              3: FSDP2 `fully_shard(reshard_after_forward=True)` on every block of the model's
                 layer lists and on the root, over dp x cp: parameters gathered again in backward
    cp        each sequence split over the cp ranks, Ulysses all-to-alls around attention
              (`runtime.module_context`)

One step on a global batch of G sequences of T tokens (`train_step`, the contract of the zoo's
RankProgram):

    the S = dp x ep batch shards (ep ranks are data-parallel to the dense layers): the rank at
    batch coordinate s = dp coordinate x ep + ep coordinate takes rows [s G/S, (s+1) G/S), and of
    them, at cp coordinate c, tokens and targets [c T/cp, (c+1) T/cp); its tp ranks take the same
    N = the targets != -100 (ignore_index) over the global batch; D = dp x ep x cp, the ranks that
      hold the same dense parameters and see different tokens
    per microbatch m of its share:  loss_m = sum of token cross-entropies over its targets * D / N;
      loss_m.backward()  (summing gradients over the ranks holding the same parameter, dp x ep x cp
      for dense ones and dp x cp for experts (`runtime.module_experts`), / D then gives the gradient
      of sum / N)
    the global loss, all-reduce over dp x ep x cp (sum of token losses) / N, and the gradient norm
      ||g||^2 = sum over ranks of sum over their gradient shards of ||g_shard||^2 / copies
      (copies = world / the number of distinct shards of that gradient: the ranks that hold the
      same values after synchronisation); a non-finite loss or norm raises TrainingDivergedError
      on every rank before the update (under `check_finite`), naming the first parameter whose
      gradient is not finite on any rank
    optimizer.step();  returned: the global loss

so with targets = tokens shifted by one and the last target -100, the loss is transformers' own
(`model(input_ids, labels=input_ids).loss`). The cross-entropy runs as the plan's loss strategy
says (`runtime.module_plan`): vocab-parallel under `loss_parallel`, on sequence shards, or whole.
"""

from __future__ import annotations

import contextlib
import itertools
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import loss_parallel

from autoplan.errors import ConfigError, TrainingDivergedError
from autoplan.plan import Plan
from autoplan.runtime.grad_sync import GradSync, Replica
from autoplan.runtime.sharded_optimizer import ShardedOptimizer, check_optimizer
from autoplan.runtime.health import check_token_range, sumsq_by_copies
from autoplan.runtime.module_checkpoint import laid_out_like, module_state_dict, parameter_shapes
from autoplan.runtime.module_context import ContextParallel
from autoplan.runtime.module_experts import expert_weight_names
from autoplan.runtime.module_plan import ModulePlan
from autoplan.runtime.module_stages import run_model

IGNORE_INDEX = -100


MESH_DIMS = ("dp", "ep", "cp", "tp")  # the DeviceMesh's dims without a pipeline (pipeline_mesh adds "pp")


def plan_mesh(plan: Plan, device_type: str) -> DeviceMesh:
    """The ("dp", "ep", "cp", "tp") DeviceMesh of `plan`: entry [d][e][c][t] is the rank at mesh
    coordinates dp = d, ep = e, cp = c, tp = t (the MeshShape's order of axes over ranks)."""
    return axes_mesh(plan, device_type, MESH_DIMS)


def axes_mesh(plan: Plan, device_type: str, dims: tuple[str, ...]) -> DeviceMesh:
    """The DeviceMesh over the plan's mesh axes `dims`, outermost first, each entry the rank at those
    coordinates (the others 0)."""
    shape = plan.mesh
    zero = {a: 0 for a in shape.degrees()}
    sizes = [shape.degree(a) for a in dims]
    ranks = [shape.rank_of({**zero, **dict(zip(dims, coords))}) for coords in itertools.product(*map(range, sizes))]
    return DeviceMesh(device_type, torch.tensor(ranks).view(sizes), mesh_dim_names=dims)


def sub_mesh(mesh: DeviceMesh, dims: tuple[str, ...], name: str) -> DeviceMesh:
    """The 1-D mesh over `dims` of `mesh` (row-major: the first dim outermost), flattened as `name`
    where more than one of them has more than one rank."""
    wide = tuple(d for d in dims if mesh.size(mesh.mesh_dim_names.index(d)) > 1)
    if len(wide) > 1:
        return mesh[wide]._flatten(name)
    return mesh[wide[0] if wide else dims[0]]


def block_lists(model: nn.Module) -> list[nn.Module]:
    """The blocks FSDP2 wraps one by one: members of every nn.ModuleList with parameters (whatever
    the list is called), outermost lists first."""
    found = []
    for _, module in model.named_modules():
        if isinstance(module, nn.ModuleList):
            found += [m for m in module if any(True for _ in m.parameters())
                      and not any(m is f or _contains(f, m) for f in found)]
    return found


def _contains(outer: nn.Module, inner: nn.Module) -> bool:
    return any(m is inner for m in outer.modules())


class ModuleProgram(nn.Module):
    """This rank's share of the user's module under a plan (module docstring)."""

    def __init__(self, model: nn.Module, plan: Plan, mesh: DeviceMesh, mplan: ModulePlan,
                 device: torch.device, check_finite: bool = True) -> None:
        super().__init__()
        self.model, self.plan, self.mesh, self.module_plan, self.device = model, plan, mesh, mplan, device
        self.dp, self.tp = plan.mesh.dp, plan.mesh.tp
        # rows split over dp x ep; the dense layers are data-parallel over dp x ep x cp, the experts
        # over dp x cp (runtime.module_experts)
        self.batch_shards, self.data = plan.mesh.dp * plan.mesh.ep, plan.mesh.dp * plan.mesh.ep * plan.mesh.cp
        self.batch_mesh = sub_mesh(mesh, ("dp", "ep"), "batch")
        self.data_mesh = sub_mesh(mesh, ("dp", "ep", "cp"), "data")
        self.replica_mesh = sub_mesh(mesh, ("dp", "cp"), "replicas")  # ZeRO's ranks; the experts' data ranks
        self.context = ContextParallel(mesh.get_group("cp")) if plan.mesh.cp > 1 else None
        self.experts = frozenset(expert_weight_names(plan))
        self.fsdp = plan.zero_stage == 3 and self.replica_mesh.size() > 1
        self.hf = hasattr(getattr(model, "config", None), "use_cache")
        self.vocab = getattr(getattr(model, "config", None), "vocab_size", None)  # None: not checked
        self.check_finite = check_finite
        self.step = 0  # train_step calls so far
        self.grad_norm: float | None = None  # the last step's global gradient norm (under check_finite)
        self.recomputed_layers: tuple[int, ...] = ()  # the blocks run as recomputed regions (module_recompute)
        self.param_names = [n for n, _ in model.named_parameters()]  # the whole model's, in its order
        self.optimizer: torch.optim.Optimizer | None = None  # the last one make_optimizer made
        self.grad_sync = None if self.fsdp else self._grad_sync()

    # ------------------------------------------------------------ parameters
    def _grad_sync(self) -> GradSync:
        """Gradients averaged over the data-parallel ranks in buckets during backward, each tp shard
        over its replicas: dense ones over dp x ep x cp, expert ones over dp x cp
        (`runtime.module_experts`), both divided by dp x ep x cp (under ZeRO 1/2 reduce-scattered for
        `ShardedOptimizer`; ep with ZeRO is refused by module_launch); with one data-parallel rank only
        the Partial gradients settled."""
        dense = self.data_mesh.get_group() if self.data > 1 else None
        replicas = self.replica_mesh.size()
        experts = self.replica_mesh.get_group() if replicas > 1 else None
        held = [Replica(p, experts, replicas) if name in self.experts else Replica(p, dense, self.data)
                for name, p in self.model.named_parameters()]
        return GradSync(held, 1.0 / self.data, shard=self.plan.zero_stage in (1, 2) and replicas > 1,
                        compute_dtype=torch.bfloat16 if self.plan.precision == "bf16-master" else None)

    def make_optimizer(self, cls: type[torch.optim.Optimizer], **kwargs) -> torch.optim.Optimizer:
        """`cls` over the parameters; under ZeRO 1/2 over this rank's slices of them
        (`grad_sync.ShardedOptimizer`, the optimizer train_step then requires)."""
        if self.grad_sync is not None and self.grad_sync.masters:
            self.optimizer = ShardedOptimizer(self.grad_sync, cls, **kwargs)
        else:
            self.optimizer = cls(self.model.parameters(), **kwargs)
        return self.optimizer

    def save_checkpoint(self, directory, optimizer: torch.optim.Optimizer | None = None, *, step: int = 0):
        """Save the parameters under the model's own names, the optimizer's states (default: the one
        `make_optimizer` made) and `step`, atomically, as the zoo's programs do (`runtime.checkpoint`,
        `runtime.module_checkpoint`); call it on every rank. Returns the checkpoint's path."""
        from autoplan.runtime.checkpoint import save

        return save(self, directory, optimizer or self.optimizer, step)

    def checkpoint_tensors(self, states: dict[str, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """This rank's tensors for `runtime.checkpoint` to hand DCP, as it holds them; `states`: the
        optimizer's state tensors of each parameter by name (`runtime.module_checkpoint`)."""
        return module_state_dict(self, states)

    def checkpoint_shapes(self) -> dict[str, list[int]]:
        """Every parameter's full shape by name, for the manifest (a collective)."""
        return parameter_shapes(self)

    def load_checkpoint(self, directory, optimizer: torch.optim.Optimizer | None = None, *,
                        parameters_only: bool = False) -> dict:
        """Load a checkpoint of this model saved under any plan into the parameters and the optimizer
        (default: the one `make_optimizer` made; none with `parameters_only`); returns its manifest
        (with "step", which `self.step` takes). Call it on every rank."""
        from autoplan.runtime.checkpoint import load

        meta = load(self, directory, None if parameters_only else optimizer or self.optimizer)
        if isinstance(self.optimizer, ShardedOptimizer):  # its fp32 slices of the loaded parameters
            self.optimizer.reload_parameters()
        self.step = int(meta.get("step", 0))
        return meta

    def named_local_parameters(self):
        return self.model.named_parameters()

    @torch.no_grad()
    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter gathered whole (under master weights its fp32 master), on CPU (a
        collective: call it on every rank)."""
        held = self._held_parameters()
        return {n: _full(held.get(id(p), p)) for n, p in self.model.named_parameters()}

    def _held_parameters(self) -> dict[int, torch.Tensor]:
        """id(parameter) -> its fp32 master laid out as the parameter (under master weights; else empty)."""
        if self.grad_sync is None:
            return {}
        params = {id(p): p for p in self.model.parameters()}
        return {pid: laid_out_like(params[pid], m) for pid, m in self.grad_sync.param_masters().items()}

    @torch.no_grad()
    def full_gradients(self) -> dict[str, torch.Tensor]:
        """Every gradient gathered whole (zeros where none), on CPU; call it on every rank."""
        if self.grad_sync is not None and self.grad_sync.masters:
            self.grad_sync.gather_gradients()
        return {n: _full(p.grad) if p.grad is not None else torch.zeros(p.shape)
                for n, p in self.model.named_parameters()}

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's state_dict, every tensor whole and on CPU, under the model's own names
        (tied weights under each of their names; under master weights the fp32 masters); a collective:
        call it on every rank."""
        held = self._held_parameters()  # under master weights: the fp32 masters, by parameter
        return {n: _full(held.get(id(t), t)) for n, t in self.model.state_dict(keep_vars=bool(held)).items()}

    # ------------------------------------------------------------ running
    def _rows(self, tokens: torch.Tensor) -> torch.Tensor:
        """This rank's rows of the global (G, T) tokens or targets (its batch shard's)."""
        s = self.batch_mesh.get_local_rank()
        rows = tokens.shape[0] // self.batch_shards
        return tokens[s * rows:(s + 1) * rows]

    def _share(self, tokens: torch.Tensor) -> torch.Tensor:
        """This rank's rows and, under cp, its chunk of their sequence (module docstring)."""
        rows = self._rows(tokens)
        return rows if self.context is None else self.context.shard(rows)

    def _logits(self, tokens: torch.Tensor):
        """The model's logits (B, T', V) for this rank's (B, T') tokens (T' = T / cp, at their global
        positions under cp): a DTensor under tp, else a tensor."""
        tokens = tokens.to(self.device)
        positions = None if self.context is None else self.context.positions(tokens)
        with self._autocast():
            return run_model(self.model, tokens, positions)

    def _autocast(self) -> contextlib.AbstractContextManager:
        dtype = getattr(torch, self.plan.dtype)
        floats = {p.dtype for p in self.model.parameters() if p.is_floating_point()}
        if dtype == torch.float32 or floats == {dtype} or self.plan.precision == "bf16-master":
            return contextlib.nullcontext()  # bf16-master: bf16 weights (FSDP2's policy under ZeRO 3)
        return torch.autocast(self.device.type, dtype=dtype)

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, gather: bool = False) -> torch.Tensor:
        """Logits of the global (G, T) tokens for evaluation (eval mode, no_grad): this rank's rows
        (under cp its chunk of their sequence) and its tp shard of them (the vocabulary's, under a
        vocab-parallel head), or with `gather` the whole (G, T, V) on every rank (a collective)."""
        was = self.model.training
        self.model.eval()
        try:
            logits = self._logits(self._share(tokens))
        finally:
            self.model.train(was)
        if not gather:
            return logits.to_local() if isinstance(logits, DTensor) else logits
        whole = logits.full_tensor() if isinstance(logits, DTensor) else logits
        if self.context is not None:
            whole = _gathered(whole, self.mesh["cp"], dim=1)
        return whole if self.batch_shards == 1 else _gathered(whole, self.batch_mesh, dim=0)

    def _token_loss_sum(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Sum of the token cross-entropies of these rows (targets == -100 skipped), as the plan's
        loss strategy computes it; equal on every tp rank."""
        return self._logits_loss_sum(self._logits(tokens), targets)

    def _logits_loss_sum(self, logits, targets: torch.Tensor) -> torch.Tensor:
        """Sum of the token cross-entropies of `logits` (the model's, a DTensor under tp) against
        `targets` (module docstring: the plan's loss strategy)."""
        targets = targets.to(self.device)
        if not isinstance(logits, DTensor):
            return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum")
        strategy = self.module_plan.loss
        if strategy == "vocab":
            logits = logits.redistribute(placements=[Shard(logits.dim() - 1)])
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
            return loss.full_tensor() if isinstance(loss, DTensor) else loss
        if strategy == "sequence":
            local = logits.redistribute(placements=[Shard(1)]).to_local()
            t = self.mesh.get_local_rank("tp")
            mine = targets.chunk(self.tp, dim=1)[t]
            part = F.cross_entropy(local.flatten(0, 1).float(), mine.flatten(), reduction="sum")
            return DTensor.from_local(part, self.mesh["tp"], [Partial()], run_check=False).full_tensor()
        whole = logits.redistribute(placements=[Replicate()]).to_local()
        return F.cross_entropy(whole.flatten(0, 1).float(), targets.flatten(), reduction="sum")

    def _loss_context(self) -> contextlib.AbstractContextManager:
        """`loss_parallel` (forward and backward) when the loss is vocab-parallel."""
        if self.tp > 1 and self.module_plan.loss == "vocab":
            return loss_parallel()
        return contextlib.nullcontext()

    def _count_targets(self, tokens: torch.Tensor, targets: torch.Tensor, what: str) -> int:
        """N, the targets that count (not -100), after checking shapes and token ids."""
        plan = self.plan
        if tuple(tokens.shape) != (plan.global_batch, plan.seq_len) or targets.shape != tokens.shape:
            raise ConfigError(f"{what}: tokens {tuple(tokens.shape)} and targets "
                              f"{tuple(targets.shape)}; the plan expects both (global_batch, "
                              f"seq_len) = ({plan.global_batch}, {plan.seq_len})")
        if self.vocab is not None:  # a vocab-parallel embedding would mask an id out of range
            check_token_range(tokens, targets, self.vocab, IGNORE_INDEX)
        count = int((targets != IGNORE_INDEX).sum())
        if count == 0:
            raise ConfigError(f"{what}: every target is -100 (ignored); nothing to learn from")
        return count

    def train_step(self, tokens: torch.Tensor, targets: torch.Tensor,
                   optimizer: torch.optim.Optimizer) -> float:
        """One optimizer step on the global batch; returns the global mean token loss. Raises
        TrainingDivergedError (every rank, no update taken) on a non-finite loss or gradient norm
        under `check_finite` (module docstring)."""
        count = self._count_targets(tokens, targets, "train_step")
        check_optimizer(self.grad_sync, optimizer, self.plan.zero_stage)
        optimizer.zero_grad(set_to_none=True)
        if self.grad_sync is not None:
            self.grad_sync.begin_step(self.plan.num_microbatches)
        # this rank's rows onto the device at once: a blocking copy from host memory synchronises the
        # stream, so one per microbatch (or the targets' after each forward) would drain the queue
        rows, wanted = self._share(tokens).to(self.device), self._share(targets).to(self.device)
        total = self._forward_backward(rows, wanted, count)
        if self.grad_sync is not None:
            self.grad_sync.finish()
        loss = self._global_loss(total, count)
        if self.check_finite:
            self._check_finite(loss)
        optimizer.step()
        self.step += 1
        return loss

    def _forward_backward(self, rows: torch.Tensor, wanted: torch.Tensor, count: int) -> torch.Tensor:
        """Forward and backward of this rank's rows, microbatch by microbatch (module docstring);
        returns the sum of their token losses."""
        total = torch.zeros((), device=self.device)
        for mb_tokens, mb_targets in zip(rows.chunk(self.plan.num_microbatches),
                                         wanted.chunk(self.plan.num_microbatches)):
            with self._loss_context():
                loss = self._token_loss_sum(mb_tokens, mb_targets)
                (loss * (self.data / count)).backward()
            total += loss.detach().float()
        return total

    @torch.no_grad()
    def eval_loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> float:
        """The global mean token loss of the current weights on (G, T) tokens and targets, in eval
        mode and without a step (the plan's loss strategy, as in train_step); a collective."""
        count = self._count_targets(tokens, targets, "eval_loss")
        was = self.model.training
        self.model.eval()
        try:
            with self._loss_context():
                total = self._token_loss_sum(self._share(tokens), self._share(targets)).float()
        finally:
            self.model.train(was)
        return self._global_loss(total, count)

    def _global_loss(self, total: torch.Tensor, count: int) -> float:
        """all-reduce over dp x ep x cp of this rank's sum of token losses, / N (equal over tp already)."""
        if self.data > 1:
            dist.all_reduce(total, group=self.data_mesh.get_group())
        return total.item() / count

    def _check_finite(self, loss: float) -> None:
        """self.grad_norm (module docstring); TrainingDivergedError when it or `loss` is not finite."""
        world = dist.get_world_size() // self.plan.mesh.pp  # a parameter lives on one pipeline stage
        if self.grad_sync is not None and self.grad_sync.masters:  # the reduced gradients: this rank's slices
            by_copies = self.grad_sync.shard_pieces(lambda p: world // _pieces(p))
        else:
            by_copies = {}
            for grad in (_settled(p.grad) for p in self.model.parameters() if p.grad is not None):
                by_copies.setdefault(world // _pieces(grad), []).append(_local(grad))
        squares = sumsq_by_copies(by_copies, self.device)
        dist.all_reduce(squares)
        self.grad_norm = math.sqrt(squares.item())  # NaN and inf survive the sum and the root
        if not (math.isfinite(loss) and math.isfinite(self.grad_norm)):
            raise TrainingDivergedError(self.step, loss, self.grad_norm, self._first_nonfinite())

    def _first_nonfinite(self) -> str | None:
        """The first parameter (in the model's order) whose gradient is not finite on any rank."""
        names = self.param_names
        mine = next((names.index(n) for n, p in self.model.named_parameters() if p.grad is not None
                     and not bool(torch.isfinite(_local(p.grad)).all())), len(names))
        first = torch.tensor(mine, device=self.device)
        dist.all_reduce(first, op=dist.ReduceOp.MIN)
        return names[int(first)] if int(first) < len(names) else None


def _gathered(t: torch.Tensor, mesh: DeviceMesh, dim: int) -> torch.Tensor:
    """Every rank's `t` of the 1-D `mesh`, concatenated along `dim` in its order (a collective)."""
    parts = [torch.empty_like(t) for _ in range(mesh.size())]
    dist.all_gather(parts, t.contiguous(), group=mesh.get_group())
    return torch.cat(parts, dim=dim)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _settled(t: torch.Tensor) -> torch.Tensor:
    """`t` with any Partial placement summed (Replicate), so that its local values are its own."""
    if not isinstance(t, DTensor) or not any(pl.is_partial() for pl in t.placements):
        return t
    return t.redistribute(placements=[Replicate() if pl.is_partial() else pl for pl in t.placements])


def _pieces(t: torch.Tensor) -> int:
    """Into how many distinct pieces `t` is split over the ranks: the product of the mesh sizes
    over which its DTensor placements shard it (1 for a plain tensor, held whole by every rank).
    Not `is_shard()`: FSDP2's _StridedShard (dp over a tp shard) shards but is no Shard."""
    if not isinstance(t, DTensor):
        return 1
    return math.prod(t.device_mesh.size(i) for i, pl in enumerate(t.placements) if not pl.is_replicate())


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu()
