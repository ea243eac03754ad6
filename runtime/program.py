"""RankProgram: one rank's share of a Plan, ready to train.

It holds the rewritten GraphModule (runtime.rewrite) with only this rank's parameter shards
allocated, filled with exactly the slice of the single-device initialisation for the same seed
(runtime.init), and the process groups of its `dp` and `tp` axes.

One step on a global batch of G = microbatch_size * num_microbatches * dp sequences:

    rank d of dp takes rows [d G/dp, (d+1) G/dp)               (shard_batch)
    for each of the num_microbatches microbatches m:  (loss_m / num_microbatches).backward()
    grads averaged over dp in one all-reduce per dtype bucket  (sync_gradients)
    optimizer.step()

so every gradient is the gradient of the global mean token loss, as on one device. ZeRO stage 1
shards the optimizer states over dp with `ZeroRedundancyOptimizer` (`make_optimizer`); stages 2
and 3 shard gradients and parameters over dp with FSDP2 (runtime.zero), which then reduce-scatters
the gradients in backward instead of `sync_gradients`.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from autoplan.errors import ConfigError
from autoplan.placement import Shard
from autoplan.plan import Plan
from autoplan.runtime.collectives import all_gather_dim, all_reduce
from autoplan.runtime.groups import AxisGroup
from autoplan.runtime.init import InitRule, init_shard
from autoplan.runtime.rewrite import Rewritten
from autoplan.runtime.zero import full_tensor, shard_over_dp


class RankProgram(nn.Module):
    """The per-rank program: `forward(tokens, targets)` on this rank's dp share -> mean loss."""

    def __init__(self, rewritten: Rewritten, plan: Plan, groups: dict[str, AxisGroup],
                 rules: dict[str, InitRule], seed: int, device: torch.device) -> None:
        super().__init__()
        self.graph_module = rewritten.graph_module
        self.plan, self.seed, self.device = plan, seed, device
        self.layouts = rewritten.params
        self.strategies = rewritten.strategies
        self.groups = groups  # a plain dict: not submodules
        self._materialize(rules)
        self.fsdp = plan.zero_stage >= 2 and self.dp.size > 1
        if self.fsdp:
            shard_over_dp(self.graph_module, self.dp.group, device, plan.zero_stage)
        if plan.recompute != "none":
            warnings.warn(f"plan asks for recompute={plan.recompute!r}; this runtime does not "
                          f"recompute activations yet (numerics are unchanged, memory is higher)",
                          stacklevel=2)

    @property
    def tp(self) -> AxisGroup:
        return self.groups["tp"]

    @property
    def dp(self) -> AxisGroup:
        return self.groups["dp"]

    # ------------------------------------------------------------ parameters
    @torch.no_grad()
    def _materialize(self, rules: dict[str, InitRule]) -> None:
        """Replace every meta parameter by this rank's shard, filled by the seeded init."""
        for name, layout in self.layouts.items():
            owner, _, attr = name.rpartition(".")
            module = self.graph_module.get_submodule(owner)
            local = init_shard(name, layout.shape, rules[name], self.seed, layout.placement,
                               self.tp.index, self.tp.size, torch.float32, self.device)
            expected = tuple(module._parameters[attr].shape)
            if tuple(local.shape) != expected:
                raise RuntimeError(f"parameter {name!r}: init made {tuple(local.shape)}, the "
                                   f"module expects {expected}")
            module._parameters[attr] = nn.Parameter(local)

    def named_local_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """(name in the user's model, this rank's shard), in a fixed order (under ZeRO 2/3, a
        DTensor sharding the tp-local shard over dp)."""
        for name in self.layouts:
            owner, _, attr = name.rpartition(".")
            yield name, self.graph_module.get_submodule(owner)._parameters[attr]

    @torch.no_grad()
    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter gathered over tp, on CPU (a collective: call it on every rank)."""
        return {n: self._gather(n, p.detach()) for n, p in self.named_local_parameters()}

    @torch.no_grad()
    def full_gradients(self) -> dict[str, torch.Tensor]:
        """Every gradient gathered over tp, on CPU (zeros where none); call it on every rank."""
        return {n: self._gather(n, p.grad if p.grad is not None else torch.zeros_like(p))
                for n, p in self.named_local_parameters()}

    def _gather(self, name: str, local: torch.Tensor) -> torch.Tensor:
        local = full_tensor(local)
        placement = self.layouts[name].placement
        if isinstance(placement, Shard) and self.tp.size > 1:
            local = all_gather_dim(local, placement.dim % local.dim(), self.tp.group)
        return local.cpu()

    # ------------------------------------------------------------ running
    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean token loss of this rank's (B, T) tokens and targets (B = its dp share)."""
        tokens, targets = tokens.to(self.device), targets.to(self.device)
        dtype = getattr(torch, self.plan.dtype)
        with contextlib.ExitStack() as stack:
            if self.fsdp:  # FSDP2 warns on every Linear (its 3-D output is a view); the warning is
                # about in-place ops on such views, which runtime.zero refused to shard
                stack.enter_context(warnings.catch_warnings())
                warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
            if dtype != torch.float32:
                stack.enter_context(torch.autocast(self.device.type, dtype=dtype))
            return self.graph_module(tokens, targets)

    def shard_batch(self, tokens: torch.Tensor, targets: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's dp slice (contiguous rows) of the global (G, T) tokens and targets."""
        if tokens.shape != targets.shape or tokens.shape[0] % self.dp.size:
            raise ConfigError(f"global tokens {tuple(tokens.shape)} and targets "
                              f"{tuple(targets.shape)} must have one shape whose batch is "
                              f"divisible by dp={self.dp.size}")
        rows = tokens.shape[0] // self.dp.size
        lo = self.dp.index * rows
        return tokens[lo:lo + rows], targets[lo:lo + rows]

    @torch.no_grad()
    def sync_gradients(self) -> None:
        """Average gradients over dp: one all-reduce per dtype of the flattened grads (nothing to
        do under ZeRO 2/3, where FSDP2 reduce-scatters them in backward)."""
        if self.dp.size == 1 or self.fsdp:
            return
        params = [p for _, p in self.named_local_parameters()]
        for p in params:
            if p.grad is None:  # e.g. unused on this rank: still part of every rank's bucket
                p.grad = torch.zeros_like(p)
        for dtype in sorted({p.grad.dtype for p in params}, key=str):
            grads = [p.grad for p in params if p.grad.dtype == dtype]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=self.dp.group)
            flat.div_(self.dp.size)
            offset = 0
            for g in grads:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()

    def train_step(self, tokens: torch.Tensor, targets: torch.Tensor,
                   optimizer: torch.optim.Optimizer) -> float:
        """One optimizer step on the global batch; returns the global mean token loss."""
        plan = self.plan
        if tuple(tokens.shape) != (plan.global_batch, plan.seq_len):
            raise ConfigError(f"train_step: tokens of shape {tuple(tokens.shape)}; the plan "
                              f"expects (global_batch, seq_len) = ({plan.global_batch}, "
                              f"{plan.seq_len})")
        local_tokens, local_targets = self.shard_batch(tokens, targets)
        optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), device=self.device)
        for mb_tokens, mb_targets in zip(local_tokens.chunk(plan.num_microbatches),
                                         local_targets.chunk(plan.num_microbatches)):
            loss = self(mb_tokens, mb_targets) / plan.num_microbatches
            loss.backward()
            total += loss.detach().float()
        self.sync_gradients()
        optimizer.step()
        if self.dp.size > 1:
            total = all_reduce(total, self.dp.group) / self.dp.size
        return float(total)

    def make_optimizer(self, optimizer_class: type[torch.optim.Optimizer] = torch.optim.AdamW,
                       **kwargs) -> torch.optim.Optimizer:
        """`optimizer_class` over this rank's parameters; with zero_stage 1 and dp > 1 its states
        are sharded over dp by `torch.distributed.optim.ZeroRedundancyOptimizer`."""
        params = [p for _, p in self.named_local_parameters()]
        if self.plan.zero_stage == 1 and self.dp.size > 1:
            from torch.distributed.optim import ZeroRedundancyOptimizer

            return ZeroRedundancyOptimizer(params, optimizer_class=optimizer_class,
                                           process_group=self.dp.group, **kwargs)
        return optimizer_class(params, **kwargs)

    def explain(self) -> str:
        """One line per node that is not replicated: its strategy."""
        return "\n".join(f"{node}: {s.name}" for node, s in self.strategies.items()
                         if s.name != "replicate")
