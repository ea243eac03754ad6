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

Master weights (plan precision "bf16-master", `compute_dtype` bfloat16; Megatron-LM's
Float16OptimizerWithFloat16Params and distributed optimizer): the fp32 master copy of each bucket is
taken from the parameters' fp32 values when the sync is made, and only then are the parameters cast
to the compute dtype. Each microbatch's bf16 gradient is added to an fp32 main gradient in the hook
(and dropped), so accumulation, reduction and the step run in fp32:

    ZeRO 0   the main gradients all-reduced in fp32; the master is the whole flat bucket
    ZeRO 1/2 the main gradients reduce-scattered in fp32; the master is this rank's slice

`ShardedOptimizer` steps on the masters either way and copies (ZeRO 0) or all-gathers (ZeRO 1/2)
them into the bf16 parameters. `masters` says whether the optimizer steps on master slices.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

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
    master: torch.Tensor | None = None  # this rank's fp32 slice of the parameters (ZeRO 1/2, master weights)
    split: int = 1  # ranks the master and the reduced gradient are split over: size under ZeRO 1/2, else 1

    @property
    def padded(self) -> int:
        return -(-self.numel // self.split) * self.split

    @property
    def owned(self) -> tuple[int, int]:
        """[lo, hi) of the flat bucket this rank's slice covers."""
        width = self.padded // self.split
        index = dist.get_rank(self.group) if self.group is not None and self.split > 1 else 0
        return index * width, (index + 1) * width

    @property
    def gathered(self) -> bool:
        """Whether the whole bucket is the all-gather of the ranks' slices (else each rank holds it)."""
        return self.group is not None and self.split > 1


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _shaped_like(grad: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """`local` (a view) laid out as `grad`: a DTensor of its placements, or the view itself."""
    if not isinstance(grad, DTensor):
        return local
    return DTensor.from_local(local, grad.device_mesh, grad.placements, run_check=False,
                              shape=grad.shape, stride=grad.stride())


def _settled(grad: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """A DTensor gradient laid out as its parameter (Partial sums summed: a tp collective)."""
    if isinstance(grad, DTensor) and grad.placements != p.placements:
        return grad.redistribute(placements=p.placements)
    return grad


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
    every bucket launched by `finish`, after backward (for measuring what the overlap buys);
    `compute_dtype`: master weights (module docstring): the parameters, fp32 when given, are cast to
    it after their fp32 masters were taken."""

    def __init__(self, replicas: list[Replica], scale: float, shard: bool = False,
                 bucket_bytes: int = GRAD_BUCKET_BYTES, overlap: bool = True,
                 compute_dtype: torch.dtype | None = None) -> None:
        self.scale, self.shard, self.overlap = scale, shard, overlap
        self.masters = shard or compute_dtype is not None  # the optimizer steps on master slices
        order = list(reversed(replicas))
        self.index = {id(r.param): i for i, r in enumerate(order)}
        self.buckets = self._make_buckets(order, bucket_bytes, shard)
        self.bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self.backwards = 0  # passes expected this step; 0: hooks idle (no step running)
        self.passes: dict[int, int] = {}
        self.main: dict[int, torch.Tensor] | None = None  # fp32 main gradients under master weights
        self.next_launch = 0
        self.trace = SyncTrace()
        if compute_dtype is not None:
            self._cast_to(compute_dtype)
        for r in order:
            r.param.register_post_accumulate_grad_hook(self._on_grad)

    @torch.no_grad()
    def _cast_to(self, dtype: torch.dtype) -> None:
        """The fp32 masters taken from the parameters as they are (float32 ones: their values; a
        model built in bf16 has no more to give), then the parameters cast to `dtype` (the same
        Parameter objects: hooks, optimizers and modules keep them)."""
        self.make_masters()
        self.main = {}
        for b in self.buckets:
            for p in b.params:
                p.data = p.data.to(dtype)

    @staticmethod
    def _make_buckets(order: list[Replica], bucket_bytes: int, shard: bool) -> list[_Bucket]:
        buckets: list[_Bucket] = []
        open_: dict[tuple, _Bucket] = {}
        for r in order:
            key = (id(r.group), r.param.dtype)
            local = _local(r.param)
            bucket = open_.get(key)
            if bucket is None or (bucket.numel + local.numel()) * local.element_size() > bucket_bytes:
                bucket = open_[key] = _Bucket([], r.group, r.size, split=r.size if shard else 1)
                buckets.append(bucket)
            bucket.params.append(r.param)
            bucket.numel += local.numel()
        return buckets

    # ------------------------------------------------------------ a step
    def begin_step(self, backwards: int) -> None:
        """Expect `backwards` backward passes before `finish` (the step's microbatches)."""
        self.backwards, self.passes, self.next_launch = backwards, {}, 0
        self.trace = SyncTrace()
        if self.main is not None:
            self.main = {}
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
        if self.main is not None:
            self._accumulate_main(p)
        if count == self.backwards:
            self._mark_ready(p)

    @torch.no_grad()
    def _accumulate_main(self, p: torch.Tensor) -> None:
        """This pass's gradient added to the fp32 main gradient, and dropped (Megatron's main_grad)."""
        grad, p.grad = p.grad, None
        held = self.main.get(id(p))
        self.main[id(p)] = grad.float() if held is None else held.add_(grad)

    def grad_of(self, p: torch.Tensor) -> torch.Tensor | None:
        """The gradient this sync reduces: the fp32 main gradient under master weights, else p.grad."""
        return p.grad if self.main is None else self.main.get(id(p))

    @torch.no_grad()
    def _mark_ready(self, p: torch.Tensor) -> None:
        if self.main is None:
            p.grad = _settled(p.grad, p)
        else:
            self.main[id(p)] = _settled(self.main[id(p)], p)
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
        grads = [_local(self.grad_of(p)).reshape(-1) for p in bucket.params]
        if self.shard:
            grads.append(grads[0].new_zeros(bucket.padded - bucket.numel))
        bucket.flat = torch.cat(grads)
        self._release_grads(bucket)
        if self.shard:
            bucket.received = bucket.flat.new_empty(bucket.padded // bucket.size)
            bucket.work = C.start("reduce_scatter", bucket.received, bucket.flat, bucket.group)
        else:
            bucket.work = C.start("all_reduce", bucket.flat, bucket.flat, bucket.group)

    def _release_grads(self, bucket: _Bucket) -> None:
        """The gradients the flat buffer now holds are not kept twice: fp32 main gradients and (ZeRO
        1/2) .grad dropped, ZeRO 0's .grad made views of the buffer the all-reduce sums in place
        (DDP's gradient_as_bucket_view)."""
        if self.main is not None:
            for p in bucket.params:
                self.main.pop(id(p))
            return
        for p, view in zip(bucket.params, self.views_of(bucket.params, bucket.flat)):
            p.grad = None if self.shard else _shaped_like(p.grad, view)

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
                    if self.main is not None and id(p) not in self.main:
                        self.main[id(p)] = torch.zeros_like(p, dtype=torch.float32)
                    elif self.main is None and p.grad is None:
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
            self._settle_alone(bucket)
            return
        C.wait("reduce_scatter" if self.shard else "all_reduce", bucket.work, bucket.group)
        if self.shard:
            if bucket.master is not None:
                bucket.master.grad = bucket.received.float().mul_(self.scale)
        elif self.masters:  # ZeRO 0 with master weights: the whole fp32 sum is the master's gradient
            bucket.master.grad = bucket.flat.mul_(self.scale)
        else:  # the gradients are views of the flat sum (`_release_grads`)
            bucket.flat.mul_(self.scale)
        bucket.flat = bucket.received = bucket.work = None  # not held through the optimizer step

    def _settle_alone(self, bucket: _Bucket) -> None:
        """A bucket without replicas: its gradients scaled (into its master's gradient, fp32)."""
        if self.masters and bucket.master is not None:
            grads = [_local(self.grad_of(p)).reshape(-1).float() for p in bucket.params]
            bucket.master.grad = torch.cat(grads)
            if self.scale != 1.0:  # one data shard (one GPU under bf16-master): a pass over the gradients saved
                bucket.master.grad.mul_(self.scale)
            if self.main is not None:
                for p in bucket.params:
                    self.main.pop(id(p))
            return
        if self.scale != 1.0:
            for p in bucket.params:
                _local(p.grad).mul_(self.scale)

    @staticmethod
    def _scatter_flat(bucket: _Bucket, flat: torch.Tensor, what: str) -> None:
        """Copy consecutive pieces of `flat` into each parameter's local gradient or data: one foreach
        copy per bucket (a few multi-tensor kernels, where a copy per parameter paid the host's dispatch
        per tensor after every step of bf16-master)."""
        dests = [_local(p.grad if what == "grad" else p.data) for p in bucket.params]
        torch._foreach_copy_(dests, GradSync.views_of(bucket.params, flat))

    # ------------------------------------------------------------ ZeRO 1/2
    @torch.no_grad()
    def master_values(self) -> list[torch.Tensor]:
        """This rank's fp32 slice of every bucket's flat parameters, as the parameters are now
        (under master weights after the cast: bf16 values; `_cast_to` takes them before)."""
        values = []
        for b in self.buckets:
            flat = torch.cat([_local(p.data).reshape(-1).float() for p in b.params])
            flat = torch.cat([flat, flat.new_zeros(b.padded - b.numel)])
            lo, hi = b.owned
            values.append(flat[lo:hi].clone())
        return values

    def make_masters(self) -> list[torch.Tensor]:
        """The master slices (`master_values`) as the leaf tensors `ShardedOptimizer` steps on
        (made once: under master weights when the sync is made, from the fp32 values)."""
        if any(b.master is None for b in self.buckets):
            for b, value in zip(self.buckets, self.master_values()):
                b.master = torch.nn.Parameter(value, requires_grad=False)
        return [b.master for b in self.buckets]

    @torch.no_grad()
    def gather_parameters(self) -> None:
        """Every bucket's updated master slices all-gathered into the parameters (ZeRO 1/2)."""
        pending = []
        for b in self.buckets:
            dtype = b.params[0].dtype
            if not b.gathered:
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
            if not b.gathered:
                out.append(piece.clone())
                continue
            full = piece.new_empty(b.padded)
            C.wait("all_gather", C.start("all_gather", full, piece.contiguous(), b.group), b.group)
            out.append(full)
        return out

    @torch.no_grad()
    def param_masters(self) -> dict[int, torch.Tensor]:
        """Under master weights, id(parameter) -> its fp32 master in its local shape (each bucket's
        master slices gathered whole: a collective under ZeRO 1/2); empty otherwise. The whole buffers
        are kept for `scatter_masters` (a checkpoint loads into them)."""
        if self.main is None:
            return {}
        self._whole_masters = self.gather_full([b.master.detach() for b in self.buckets])
        return {pid: view for i, whole in enumerate(self._whole_masters)
                for pid, view in self.views(i, whole).items()}

    @torch.no_grad()
    def scatter_masters(self) -> None:
        """This rank's slices of the whole masters `param_masters` handed out (loaded into), and the
        parameters cast from them."""
        for b, whole in zip(self.buckets, self._whole_masters):
            lo, hi = b.owned
            b.master.copy_(whole[lo:hi])
        self.gather_parameters()

    def views(self, bucket_index: int, flat: torch.Tensor) -> dict[int, torch.Tensor]:
        """id(parameter) -> the piece of a bucket's whole `flat` tensor that is that parameter
        (its local shape)."""
        params = self.buckets[bucket_index].params
        return {id(p): view for p, view in zip(params, self.views_of(params, flat))}

    @staticmethod
    def views_of(params: list[torch.Tensor], flat: torch.Tensor) -> list[torch.Tensor]:
        """The consecutive pieces of `flat` that are `params`, each in its local shape."""
        views, offset = [], 0
        for p in params:
            local = _local(p)
            views.append(flat[offset:offset + local.numel()].view(local.shape))
            offset += local.numel()
        return views

    @torch.no_grad()
    def gather_gradients(self) -> None:
        """The reduced gradient slices all-gathered into every parameter's gradient (ZeRO 1/2, master
        weights; for inspection: full_gradients; a collective over each bucket's group)."""
        grads = self.gather_full([b.master.grad if b.master.grad is not None
                                  else b.master.new_zeros(b.master.shape) for b in self.buckets])
        for b, full in zip(self.buckets, grads):
            for p in b.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            self._scatter_flat(b, full.to(b.params[0].dtype), "grad")

    def shard_pieces(self, copies) -> dict[int, list[torch.Tensor]]:
        """This rank's reduced gradient slices when the optimizer steps on masters, as views grouped by
        how many ranks hold the same slice: `copies(param)` / the ranks its bucket is split over (the
        parameter's replicas, less the group that now splits it). Adjacent parameters with the same
        count are one view, so a bucket is a few views and ||g||^2 is a few foreach kernels, with no
        copy to the host per parameter (`health.sumsq_by_copies`)."""
        pieces: dict[int, list[torch.Tensor]] = {}
        for b in self.buckets:
            if b.master is None or b.master.grad is None:
                continue
            lo, hi = b.owned
            for a, z, count in self._runs(b, copies):
                a, z = max(lo, a), min(hi, z)
                if a < z:
                    pieces.setdefault(count, []).append(b.master.grad[a - lo:z - lo])
        return pieces

    @staticmethod
    def _runs(bucket: _Bucket, copies) -> list[tuple[int, int, int]]:
        """(start, end, count) over the bucket's flat elements: runs of adjacent parameters whose slices
        are held by the same number of ranks (`shard_pieces`)."""
        runs: list[tuple[int, int, int]] = []
        offset = 0
        for p in bucket.params:
            n, count = _local(p).numel(), copies(p) // bucket.split
            if runs and runs[-1][2] == count and runs[-1][1] == offset:
                runs[-1] = (runs[-1][0], offset + n, count)
            else:
                runs.append((offset, offset + n, count))
            offset += n
        return runs
