"""Data-parallel gradient sync in buckets overlapped with backward, and ZeRO 1/2 as a distributed
optimizer: the one mechanism both runtimes (`runtime.program`, `runtime.module_program`) use.

Buckets: the parameters in reverse registration order (the order backward finishes their
gradients), split by (replica group, dtype) into buckets of at most `bucket_bytes` local bytes
(`autoplan.grad_buckets`, PyTorch DDP's 25 MiB; a larger parameter is a bucket of its own).
A step of B backward passes (its microbatches) begins with `begin_step(B)`; each parameter's
`post_accumulate_grad` hook counts its passes, and on the B-th (the last microbatch: earlier ones
only accumulate, like DDP's no_sync) its gradient is final: a Partial DTensor gradient is settled to
its parameter's placements (a tp collective) and the parameter marked ready. A bucket whose
parameters are all ready is launched, asynchronously, in bucket order (the same order on every
rank of its group, whatever order its hooks fired in), while backward goes on (so a parameter that
gets no gradient holds back its bucket and the later ones until `finish`: correct, not overlapped):

    ZeRO 0   all-reduce(sum) of the bucket's flattened local gradients over its replica group
    ZeRO 1/2 reduce-scatter(sum) of the flattened gradients (padded to a multiple of the group
             size g): rank i of the group receives the sum of elements [i n/g, (i+1) n/g)

`finish()` gives parameters that got no gradient zeros (every rank's bucket must be whole), launches
what is left, waits, and scales by `scale` (1 / the ranks whose losses were summed). ZeRO 0: the sums
are copied back into the gradients. ZeRO 1/2: the scaled slice becomes the gradient of this rank's
fp32 master slice of the bucket's flat parameters; `ShardedOptimizer` steps on those slices only
(optimizer states are 1/g of the whole) and all-gathers the updated slices into every rank's
parameters (Megatron-LM's distributed optimizer; gradients are kept whole until the step, so ZeRO 2
runs as ZeRO 1). The all-gather runs after the step, exposed.

A parameter without a replica (group None: e.g. experts with dp = cp = 1) is only scaled.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from autoplan.errors import ConfigError
from autoplan.grad_buckets import GRAD_BUCKET_BYTES
from autoplan.runtime import collectives as C


@dataclass
class Replica:
    """One parameter and the process group of the ranks holding the same piece of it (None: none
    does; `size` its size, 1 then)."""
    param: torch.Tensor
    group: object | None
    size: int


@dataclass
class _Bucket:
    params: list[torch.Tensor]
    group: object | None
    size: int
    numel: int = 0
    ready: int = 0
    work: object | None = None
    flat: torch.Tensor | None = None
    received: torch.Tensor | None = None  # ZeRO 1/2: this rank's reduced slice
    master: torch.Tensor | None = None  # ZeRO 1/2: this rank's fp32 slice of the parameters

    @property
    def padded(self) -> int:
        return -(-self.numel // self.size) * self.size

    @property
    def owned(self) -> tuple[int, int]:
        """[lo, hi) of the flat bucket this rank's slice covers."""
        width = self.padded // self.size
        index = dist.get_rank(self.group) if self.group is not None else 0
        return index * width, (index + 1) * width


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _settle(p: torch.Tensor) -> None:
    """A DTensor gradient laid out as its parameter (Partial sums summed: a tp collective)."""
    if isinstance(p.grad, DTensor) and p.grad.placements != p.placements:
        p.grad = p.grad.redistribute(placements=p.placements)


@dataclass
class SyncTrace:
    """What the last step did, in order: ("hook", i) when parameter i's gradient became final,
    ("launch", b) when bucket b's collective was issued, ("backward_end", -1) when `finish` began
    and ("synced", -1) when it ended, each with its time.perf_counter()."""
    events: list[tuple[str, int, float]] = field(default_factory=list)

    def add(self, kind: str, index: int) -> None:
        self.events.append((kind, index, time.perf_counter()))


class GradSync:
    """Bucketed gradient sync of `replicas` (in registration order), overlapped with backward
    (module docstring); `shard`: ZeRO 1/2 (reduce-scatter, `ShardedOptimizer`); `overlap` False:
    every bucket launched by `finish`, after backward (for measuring what the overlap buys)."""

    def __init__(self, replicas: list[Replica], scale: float, shard: bool = False,
                 bucket_bytes: int = GRAD_BUCKET_BYTES, overlap: bool = True) -> None:
        self.scale, self.shard, self.overlap = scale, shard, overlap
        order = list(reversed(replicas))
        self.index = {id(r.param): i for i, r in enumerate(order)}
        self.buckets = self._make_buckets(order, bucket_bytes)
        self.bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self.backwards = 0  # passes expected this step; 0: hooks idle (no step running)
        self.passes: dict[int, int] = {}
        self.next_launch = 0
        self.trace = SyncTrace()
        for r in order:
            r.param.register_post_accumulate_grad_hook(self._on_grad)

    @staticmethod
    def _make_buckets(order: list[Replica], bucket_bytes: int) -> list[_Bucket]:
        buckets: list[_Bucket] = []
        open_: dict[tuple, _Bucket] = {}
        for r in order:
            key = (id(r.group), r.param.dtype)
            local = _local(r.param)
            bucket = open_.get(key)
            if bucket is None or (bucket.numel + local.numel()) * local.element_size() > bucket_bytes:
                bucket = open_[key] = _Bucket([], r.group, r.size)
                buckets.append(bucket)
            bucket.params.append(r.param)
            bucket.numel += local.numel()
        return buckets

    # ------------------------------------------------------------ a step
    def begin_step(self, backwards: int) -> None:
        """Expect `backwards` backward passes before `finish` (the step's microbatches)."""
        self.backwards, self.passes, self.next_launch = backwards, {}, 0
        self.trace = SyncTrace()
        for b in self.buckets:
            b.ready, b.work, b.flat, b.received = 0, None, None, None

    def _on_grad(self, p: torch.Tensor) -> None:
        if not self.backwards:
            return  # a backward outside a step (e.g. a memory probe): not ours to sync
        count = self.passes.get(id(p), 0) + 1
        self.passes[id(p)] = count
        if count > self.backwards:
            raise RuntimeError(f"a parameter's gradient was accumulated {count} times in a step "
                               f"of {self.backwards} backward passes; its bucket was already "
                               f"synchronised (call begin_step with the step's backward passes)")
        if count == self.backwards:
            self._mark_ready(p)

    @torch.no_grad()
    def _mark_ready(self, p: torch.Tensor) -> None:
        _settle(p)
        self.trace.add("hook", self.index[id(p)])
        self.bucket_of[id(p)].ready += 1
        if self.overlap:
            self._launch_ready()

    def _launch_ready(self) -> None:
        """Launch the complete buckets from the next one on, in order, up to the first incomplete."""
        while (self.next_launch < len(self.buckets)
               and self.buckets[self.next_launch].ready == len(self.buckets[self.next_launch].params)):
            self._launch(self.buckets[self.next_launch])

    def _launch(self, bucket: _Bucket) -> None:
        self.trace.add("launch", self.next_launch)
        self.next_launch += 1
        if bucket.group is None:
            return
        grads = [_local(p.grad).reshape(-1) for p in bucket.params]
        if self.shard:
            grads.append(grads[0].new_zeros(bucket.padded - bucket.numel))
        bucket.flat = torch.cat(grads)
        if self.shard:
            bucket.received = bucket.flat.new_empty(bucket.padded // bucket.size)
            bucket.work = C.start("reduce_scatter", bucket.received, bucket.flat, bucket.group)
        else:
            bucket.work = C.start("all_reduce", bucket.flat, bucket.flat, bucket.group)

    @torch.no_grad()
    def finish(self) -> None:
        """After the step's last backward: zeros for gradients never made, the rest of the
        buckets launched, every collective waited on, the results scaled and put in place."""
        if not self.backwards:
            raise RuntimeError("GradSync.finish without begin_step: no step is running")
        self.trace.add("backward_end", -1)
        for bucket in self.buckets:
            for p in bucket.params:
                if self.passes.get(id(p), 0) < self.backwards:  # fewer passes made it, or none
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                    self._mark_ready(p)
        self._launch_ready()
        self.backwards = 0
        for bucket in self.buckets:
            self._settle_bucket(bucket)
        self.trace.add("synced", -1)

    def exposed_s(self) -> float:
        """Seconds the last step waited for its gradient sync after backward (`finish`)."""
        times = {kind: t for kind, _, t in self.trace.events if kind in ("backward_end", "synced")}
        return times["synced"] - times["backward_end"]

    def _settle_bucket(self, bucket: _Bucket) -> None:
        if bucket.group is None:
            if self.scale != 1.0:
                for p in bucket.params:
                    _local(p.grad).mul_(self.scale)
            if self.shard and bucket.master is not None:
                bucket.master.grad = torch.cat([_local(p.grad).reshape(-1).float()
                                                for p in bucket.params])
            return
        C.wait("reduce_scatter" if self.shard else "all_reduce", bucket.work, bucket.group)
        if self.shard:
            if bucket.master is not None:
                bucket.master.grad = bucket.received.float().mul_(self.scale)
        else:
            bucket.flat.mul_(self.scale)
            self._scatter_flat(bucket, bucket.flat, "grad")
        bucket.flat = bucket.received = bucket.work = None  # not held through the optimizer step

    @staticmethod
    def _scatter_flat(bucket: _Bucket, flat: torch.Tensor, what: str) -> None:
        """Copy consecutive pieces of `flat` into each parameter's local gradient or data."""
        offset = 0
        for p in bucket.params:
            dest = _local(p.grad if what == "grad" else p.data)
            dest.copy_(flat[offset:offset + dest.numel()].view_as(dest))
            offset += dest.numel()

    # ------------------------------------------------------------ ZeRO 1/2
    @torch.no_grad()
    def master_values(self) -> list[torch.Tensor]:
        """This rank's fp32 slice of every bucket's flat parameters, as the parameters are now."""
        values = []
        for b in self.buckets:
            flat = torch.cat([_local(p.data).reshape(-1).float() for p in b.params])
            flat = torch.cat([flat, flat.new_zeros(b.padded - b.numel)])
            lo, hi = b.owned
            values.append(flat[lo:hi].clone())
        return values

    def make_masters(self) -> list[torch.Tensor]:
        """The master slices (`master_values`) as the leaf tensors `ShardedOptimizer` steps on."""
        for b, value in zip(self.buckets, self.master_values()):
            b.master = torch.nn.Parameter(value, requires_grad=False)
        return [b.master for b in self.buckets]

    @torch.no_grad()
    def gather_parameters(self) -> None:
        """Every bucket's updated master slices all-gathered into the parameters (ZeRO 1/2)."""
        pending = []
        for b in self.buckets:
            dtype = b.params[0].dtype
            if b.group is None:
                pending.append((b, b.master.to(dtype), None))
                continue
            full = torch.empty(b.padded, dtype=dtype, device=b.master.device)
            work = C.start("all_gather", full, b.master.to(dtype), b.group)
            pending.append((b, full, work))
        for b, full, work in pending:
            if work is not None:
                C.wait("all_gather", work, b.group)
            self._scatter_flat(b, full, "data")

    @torch.no_grad()
    def gather_full(self, slices: list[torch.Tensor]) -> list[torch.Tensor]:
        """Per bucket, the whole flat tensor (padded) whose slice this rank holds in `slices`
        (one per bucket, as `make_masters`): an all-gather over each bucket's group."""
        out = []
        for b, piece in zip(self.buckets, slices):
            if b.group is None:
                out.append(piece.clone())
                continue
            full = piece.new_empty(b.padded)
            C.wait("all_gather", C.start("all_gather", full, piece.contiguous(), b.group), b.group)
            out.append(full)
        return out

    def views(self, bucket_index: int, flat: torch.Tensor) -> dict[int, torch.Tensor]:
        """id(parameter) -> the piece of a bucket's whole `flat` tensor that is that parameter
        (its local shape)."""
        views, offset = {}, 0
        for p in self.buckets[bucket_index].params:
            local = _local(p)
            views[id(p)] = flat[offset:offset + local.numel()].view(local.shape)
            offset += local.numel()
        return views

    @torch.no_grad()
    def gather_gradients(self) -> None:
        """ZeRO 1/2: the reduced gradient slices all-gathered into every parameter's gradient
        (for inspection: full_gradients; a collective over each bucket's group)."""
        grads = self.gather_full([b.master.grad if b.master.grad is not None
                                  else b.master.new_zeros(b.master.shape) for b in self.buckets])
        for b, full in zip(self.buckets, grads):
            for p in b.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            self._scatter_flat(b, full.to(b.params[0].dtype), "grad")

    def shard_sumsq(self, copies) -> torch.Tensor:
        """This rank's term of ||g||^2 under ZeRO 1/2 (fp64): the squares of its reduced slices,
        each parameter's part divided by `copies(param)` / its group's size (the ranks that hold
        the same slice: the parameter's replicas, less the group that now splits it)."""
        total = torch.zeros((), dtype=torch.float64)
        for b in self.buckets:
            if b.master is None or b.master.grad is None:
                continue
            lo, hi = b.owned
            offset = 0
            for p in b.params:
                n = _local(p).numel()
                a, z = max(lo, offset), min(hi, offset + n)
                if a < z:
                    part = b.master.grad[a - lo:z - lo].double().square().sum()
                    total += part.cpu() / (copies(p) // b.size)
                offset += n
        return total


class ShardedOptimizer(torch.optim.Optimizer):
    """ZeRO 1/2: `optimizer_class` over this rank's fp32 master slices of `sync`'s buckets; `step`
    steps them and all-gathers the parameters (module docstring). `optim` is the inner optimizer
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
        """The master slices taken again from the parameters (after they were loaded)."""
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
    """Under ZeRO 1/2 the step runs on this rank's slices: `optimizer` must be the program's
    `ShardedOptimizer` (both runtimes' train_step check this before the step)."""
    if sync is not None and sync.shard and not isinstance(optimizer, ShardedOptimizer):
        raise ConfigError(f"ZeRO {zero_stage} steps on this rank's slices of the parameters: make the "
                          f"optimizer with program.make_optimizer(...), not {type(optimizer).__name__} "
                          f"over the parameters")
