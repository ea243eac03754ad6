"""The optimizer that steps on `runtime.grad_sync`'s fp32 master slices: ZeRO 1/2 (each rank's slice
of every gradient bucket, Megatron-LM's distributed optimizer) and master weights (plan precision
"bf16-master": the whole fp32 bucket under ZeRO 0). Both runtimes make it (`make_optimizer`) and
check for it before a step (`check_optimizer`).
"""

from __future__ import annotations

import torch

from autoplan.errors import ConfigError
from autoplan.runtime.grad_sync import GradSync


class ShardedOptimizer(torch.optim.Optimizer):
    """`optimizer_class` over this rank's fp32 master slices of `sync`'s buckets; `step` steps them
    and all-gathers (ZeRO 1/2) or copies (ZeRO 0) them into the parameters (`runtime.grad_sync`). `optim` is the inner optimizer
    (its `state` holds the slices' states)."""

    def __init__(self, sync: GradSync, optimizer_class: type[torch.optim.Optimizer], **kwargs) -> None:
        self.sync = sync
        masters = sync.make_masters()
        self.optim = optimizer_class(masters, **kwargs)
        super().__init__(masters, dict(self.optim.defaults))
        self.param_groups = self.optim.param_groups
        self.state = self.optim.state

    @torch.no_grad()
    def step(self, closure=None):
        """The inner step on the slices (one with no gradient yet steps on zeros: the checkpoint
        loader's lr-0 step that creates states), then the parameters all-gathered."""
        for b in self.sync.buckets:
            if b.master.grad is None:
                b.master.grad = torch.zeros_like(b.master)
        loss = self.optim.step(closure)
        self.sync.gather_parameters()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optim.zero_grad(set_to_none)
        for b in self.sync.buckets:
            for p in b.params:
                p.grad = None

    def state_dict(self):
        return self.optim.state_dict()

    def load_state_dict(self, state_dict) -> None:
        self.optim.load_state_dict(state_dict)

    @torch.no_grad()
    def reload_parameters(self) -> None:
        """The master slices taken again from the parameters (after they were loaded); under master
        weights the checkpoint loaded the masters themselves (`GradSync.scatter_masters`)."""
        if self.sync.main is not None:
            return
        for b, fresh in zip(self.sync.buckets, self.sync.master_values()):
            b.master.copy_(fresh)

    @torch.no_grad()
    def param_states(self) -> dict[int, dict[str, torch.Tensor]]:
        """id(parameter) -> its optimizer states in its local shape (a checkpoint's terms):
        each state's slices all-gathered over the bucket's group (a collective); a 0-d state
        (AdamW's step) is the bucket's own tensor. `scatter_states` writes them back."""
        masters = [b.master for b in self.sync.buckets]
        first = self.state.get(masters[0], {})
        out: dict[int, dict[str, torch.Tensor]] = {}
        self._whole: dict[str, list[torch.Tensor]] = {}
        for key, value in first.items():
            if not isinstance(value, torch.Tensor):
                continue
            if value.dim() == 0:
                for b in self.sync.buckets:
                    for p in b.params:
                        out.setdefault(id(p), {})[key] = self.state[b.master][key]
                continue
            self._whole[key] = self.sync.gather_full([self.state[m][key] for m in masters])
            for i, whole in enumerate(self._whole[key]):
                for pid, view in self.sync.views(i, whole).items():
                    out.setdefault(pid, {})[key] = view
        return out

    @torch.no_grad()
    def scatter_states(self) -> None:
        """This rank's slices of the whole states `param_states` handed out (loaded into)."""
        for key, wholes in self._whole.items():
            for b, whole in zip(self.sync.buckets, wholes):
                lo, hi = b.owned
                self.state[b.master][key].copy_(whole[lo:hi])


def check_optimizer(sync: GradSync | None, optimizer: torch.optim.Optimizer, zero_stage: int) -> None:
    """Under ZeRO 1/2 and master weights the step runs on this rank's fp32 master slices: `optimizer` must be the program's
    `ShardedOptimizer` (both runtimes' train_step check this before the step)."""
    if sync is not None and sync.masters and not isinstance(optimizer, ShardedOptimizer):
        raise ConfigError(f"ZeRO {zero_stage} {'with' if sync.shard else 'under'} master weights steps on this "
                          f"rank's fp32 master slices: make the "
                          f"optimizer with program.make_optimizer(...), not {type(optimizer).__name__} "
                          f"over the parameters")
