"""Autograd-aware collectives over one process group (the tensor-parallel axis, usually).

Each is a pair of collectives in one `torch.autograd.Function` (`_Paired`), the backward the adjoint
of the forward, so autograd builds the backward communication by itself. With n ranks in the group and x_r the local tensor:

    copy_to_region          fwd  y = x                       bwd  dx = sum_r dy_r      (Megatron's f)
    reduce_from_region      fwd  y = sum_r x_r               bwd  dx = dy              (Megatron's g)
    split_along(d)          fwd  y = x[rank-th 1/n of dim d] bwd  dx = all_gather_d(dy)
    gather_along(d)         fwd  y = cat_d(x_0..x_{n-1})     bwd  dx = dy[rank-th 1/n of dim d]
    reduce_scatter_along(d) fwd  y = (sum_r x_r)[rank-th 1/n of dim d]   bwd  dx = all_gather_d(dy)
    gather_fwd_reduce_scatter_bwd(d)
                            fwd  y = cat_d(x_r)              bwd  dx = (sum_r dy_r)[rank-th 1/n of d]
                            (sequence parallelism: the consumer's input grad is a partial sum)
    all_to_all_dims(a, b)   fwd  sharded on dim a -> sharded on dim b    bwd  b -> a
    all_to_all_uneven       fwd  rows [send_0 | send_1 | ...] to ranks 0, 1, ...; receive recv_j
                            rows from rank j (expert dispatch)            bwd  the reverse exchange
    gather_rows_uneven      fwd  y = cat_r(x_r), x_r with rows[r] rows    bwd  dx = rank's rows of sum_r dy_r
    reduce_scatter_rows_uneven
                            fwd  y = rank's rows[rank] rows of sum_r x_r  bwd  dx = cat_r(dy_r)
                            (the expert-TP exchange of 1 < etp < tp, runtime.experts; both pad every
                            rank's rows to max(rows), so they run as one all-gather / reduce-scatter)

A group of one rank makes every function the identity. On meta tensors (shape inference) nothing
communicates: the results only have the right shapes.

Every collective the runtime issues goes through one of the raw functions below, which report it to
the `count_collectives()` context when one is open: (kind, group name) -> calls, with kinds
"all_reduce", "all_gather", "reduce_scatter", "all_to_all" (a reduce-scatter counts as one even where
gloo runs it as an all-reduce). Collectives whose name moved between torch
2.11 and 2.13 (`all_gather_into_tensor` -> `all_gather_single`, `reduce_scatter_tensor` ->
`reduce_scatter_single`) are called only through `_gather_into` and `_reduce_scatter_into`.
A collective that fails (gloo's timeout, a peer's closed connection) raises `CollectiveError`
naming its kind, its group's description and ranks, and this rank.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections import Counter
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.autograd import Function

from autoplan.errors import CollectiveError

Group = dist.ProcessGroup | None

# The open counting context: (Counter, {process group: name}); None when nobody counts.
_COUNTING: contextvars.ContextVar[tuple[Counter, dict] | None] = contextvars.ContextVar(
    "autoplan_collective_counting", default=None)


@contextlib.contextmanager
def count_collectives(names: dict | None = None) -> Iterator[Counter]:
    """Count the collectives issued inside the block: {(kind, group name): calls}. `names` maps
    process groups to names (e.g. "tp"); unnamed groups count as "world" (None) or "other"."""
    counts: Counter = Counter()
    token = _COUNTING.set((counts, dict(names or {})))
    try:
        yield counts
    finally:
        _COUNTING.reset(token)


def _record(kind: str, group: Group) -> None:
    counting = _COUNTING.get()
    if counting is not None:
        counts, names = counting
        counts[(kind, names.get(group, "world" if group is None else "other"))] += 1


@contextlib.contextmanager
def _issuing(kind: str, group: Group) -> Iterator[None]:
    """Count the collective issued inside the block, and turn the backend's RuntimeError (gloo's
    timeout, a peer's closed connection) into a CollectiveError that names the collective, its
    group and this rank: the backend's own message names neither."""
    _record(kind, group)
    with _named(kind, group):
        yield


@contextlib.contextmanager
def _named(kind: str, group: Group) -> Iterator[None]:
    """The backend's RuntimeError inside the block as a CollectiveError naming `kind` and `group`."""
    try:
        yield
    except CollectiveError:
        raise
    except RuntimeError as exc:
        name = "world" if group is None else getattr(group, "group_desc", "") or "unnamed"
        raise CollectiveError(kind, name, dist.get_process_group_ranks(group or dist.group.WORLD),
                              dist.get_rank(), str(exc)) from exc


def group_size(group: Group) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def group_rank(group: Group) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


# ------------------------------------------------------------------ raw collectives (no autograd)


def _is_gloo(group: Group) -> bool:
    return dist.get_backend(group) == "gloo"


def _single_tensor(kind: str, group: Group):
    """torch.distributed's single-tensor all-gather or reduce-scatter, as `autoplan profile` times them
    (`profiler.collectives`): torch 2.13's `all_gather_single` / `reduce_scatter_single` on every backend, else
    `all_gather_into_tensor` / `reduce_scatter_tensor`; None on a gloo group of an older torch, which lacks them."""
    single = getattr(dist, f"{kind}_single", None)
    if single is not None:
        return single
    return None if _is_gloo(group) else getattr(dist, {"all_gather": "all_gather_into_tensor",
                                                          "reduce_scatter": "reduce_scatter_tensor"}[kind])


def _gather_into(out: torch.Tensor, inp: torch.Tensor, group: Group) -> None:
    """out (n*m, ...) <- cat over ranks of inp (m, ...): the single-tensor all-gather (`_single_tensor`), or on
    an older gloo the list form."""
    gather = _single_tensor("all_gather", group)
    if gather is None:
        dist.all_gather(list(out.chunk(group_size(group))), inp, group=group)
        return
    gather(out, inp, group=group)


def _reduce_scatter_into(out: torch.Tensor, inp: torch.Tensor, group: Group) -> None:
    """out (m, ...) <- this rank's m rows of the sum over ranks of inp (n*m, ...): the single-tensor
    reduce-scatter (`_single_tensor`; on 2 gloo ranks 0.6 ms at 1 MiB, where an all-reduce and a copy of our
    rows took 2.6), or on an older gloo, which lacks it, an all-reduce that keeps our rows."""
    scatter = _single_tensor("reduce_scatter", group)
    if scatter is None:
        total = inp.clone()
        dist.all_reduce(total, group=group)
        out.copy_(total.chunk(group_size(group))[group_rank(group)])
        return
    scatter(out, inp, group=group)


def start(kind: str, out: torch.Tensor, inp: torch.Tensor, group: Group):
    """Issue one asynchronous collective of a gradient bucket (runtime.grad_sync), counted and
    named as the others: "all_reduce" sums `inp` in place (`out` is `inp`), "reduce_scatter" puts
    this rank's rows of the sum of `inp` in `out`, "all_gather" puts every rank's `inp` in `out`.
    Returns its Work (wait on it before reading `out`)."""
    single = None if kind == "all_reduce" else _single_tensor(kind, group)
    if kind != "all_reduce" and single is None:
        raise RuntimeError(f"an asynchronous {kind} over gloo needs torch >= 2.13 (this is {torch.__version__}); "
                           f"use ZeRO stage 0 there")
    with _issuing(kind, group):
        if single is None:
            return dist.all_reduce(inp, group=group, async_op=True)
        return single(out, inp, group=group, async_op=True)


def wait(kind: str, work, group: Group) -> None:
    """Wait for an asynchronous collective `start` issued; its failure (a peer's timeout) named as
    the collective's own."""
    with _named(kind, group):
        work.wait()


def all_reduce(x: torch.Tensor, group: Group, op: dist.ReduceOp = dist.ReduceOp.SUM) -> torch.Tensor:
    """A new tensor holding the reduction of `x` over the group (no autograd)."""
    out = x.clone(memory_format=torch.contiguous_format)
    if group_size(group) > 1 and not x.is_meta:
        with _issuing("all_reduce", group):
            dist.all_reduce(out, op=op, group=group)
    return out


def all_reduce_(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Sum `x` over the group in place (no autograd); returns `x`."""
    if group_size(group) > 1 and not x.is_meta:
        with _issuing("all_reduce", group):
            dist.all_reduce(x, group=group)
    return x


def all_gather_dim(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """cat over ranks of x along `dim` (no autograd): every rank's x gathered whole, rank after rank along dim 0,
    then joined along `dim` in one copy (none for dim 0). A fresh tensor, never a view of x."""
    n = group_size(group)
    if n == 1:
        return x
    inp = x.contiguous()
    out = inp.new_empty((n * inp.shape[0], *inp.shape[1:]))  # rank r's x in the r-th block of rows
    if not x.is_meta:  # meta tensors (shape inference) only get the shape
        with _issuing("all_gather", group):
            _gather_into(out, inp, group)
    return out if dim % x.dim() == 0 else torch.cat(out.chunk(n), dim=dim)


def reduce_scatter_dim(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """This rank's 1/n slice along `dim` of the sum over ranks of x (no autograd): the n slices laid rank after
    rank along dim 0 in one copy (none for a contiguous x and dim 0), then reduce-scattered into a fresh tensor."""
    n = group_size(group)
    if n == 1:
        return x
    _check_divisible(x, dim, n)
    first = dim % x.dim() == 0
    inp = x.contiguous() if first else torch.cat(x.chunk(n, dim=dim), dim=0)  # rank r's slice in the r-th block
    out = inp.new_empty((inp.shape[0] // n, *inp.shape[1:]))
    if not x.is_meta:
        with _issuing("reduce_scatter", group):
            _reduce_scatter_into(out, inp, group)
    return out


def split_dim(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """This rank's 1/n slice of x along `dim`, as a fresh contiguous tensor (no communication, no
    autograd): a view would keep all of x alive wherever the slice is saved for backward."""
    n = group_size(group)
    if n == 1:
        return x
    _check_divisible(x, dim, n)
    return x.chunk(n, dim=dim)[group_rank(group)].clone(memory_format=torch.contiguous_format)


def all_to_all_dim(x: torch.Tensor, src_dim: int, dst_dim: int, group: Group) -> torch.Tensor:
    """x sharded on `src_dim` (local slice) -> the same tensor sharded on `dst_dim` (no autograd).

    Rank r sends its j-th chunk along dst_dim to rank j and concatenates, along src_dim, the chunks
    it receives in rank order."""
    n = group_size(group)
    if n == 1 or src_dim == dst_dim:
        return x
    _check_divisible(x, dst_dim, n)
    send = torch.stack(x.chunk(n, dim=dst_dim)).contiguous()  # (n, ..., dst/n, ...)
    recv = torch.empty_like(send)
    if not x.is_meta:
        with _issuing("all_to_all", group):
            dist.all_to_all_single(recv, send, group=group)
    return torch.cat(recv.unbind(0), dim=src_dim).contiguous()


def exchange(x: torch.Tensor, group: Group) -> torch.Tensor:
    """x (n, ...): row j goes to rank j; returns (n, ...) whose row j came from rank j (no autograd)."""
    if group_size(group) == 1:
        return x
    recv = torch.empty_like(x)
    if not x.is_meta:
        with _issuing("all_to_all", group):
            dist.all_to_all_single(recv, x.contiguous(), group=group)
    return recv


def all_to_all_rows(x: torch.Tensor, send_rows: list[int], recv_rows: list[int], group: Group
                    ) -> torch.Tensor:
    """Rows [sum(send_rows[:j]), sum(send_rows[:j+1])) of x go to rank j; the result holds
    recv_rows[j] rows from each rank j, in rank order (no autograd; uneven splits)."""
    if group_size(group) == 1:
        return x
    out = x.new_empty((sum(recv_rows), *x.shape[1:]))
    if not x.is_meta:
        with _issuing("all_to_all", group):
            dist.all_to_all_single(out, x.contiguous(), list(recv_rows), list(send_rows),
                                   group=group)
    return out


def _padded(x: torch.Tensor, rows: int) -> torch.Tensor:
    """x (m, ...) with zero rows appended up to `rows`."""
    if x.shape[0] == rows:
        return x.contiguous()
    return torch.cat([x, x.new_zeros((rows - x.shape[0], *x.shape[1:]))])


def all_gather_rows(x: torch.Tensor, rows: list[int], group: Group) -> torch.Tensor:
    """cat over ranks of x_r (rows[r] rows each; this rank's x has rows[rank]), no autograd: one
    all-gather of every x padded to max(rows), then the padding dropped."""
    n = group_size(group)
    if n == 1:
        return x
    width = max(max(rows), 1)  # never an empty message
    gathered = all_gather_dim(_padded(x, width), 0, group)  # (n * width, ...)
    return torch.cat([gathered[r * width: r * width + rows[r]] for r in range(n)])


def reduce_scatter_rows(x: torch.Tensor, rows: list[int], group: Group) -> torch.Tensor:
    """This rank's rows of sum_r x_r, x laid out as [rows[0] | rows[1] | ...] on every rank (no
    autograd): one reduce-scatter of the blocks padded to max(rows), then the padding dropped."""
    n = group_size(group)
    if n == 1:
        return x
    width = max(max(rows), 1)  # never an empty message
    blocks = x.split(rows)
    summed = reduce_scatter_dim(torch.cat([_padded(b, width) for b in blocks]), 0, group)  # (width, ...)
    return summed[: rows[group_rank(group)]].contiguous()


def _check_divisible(x: torch.Tensor, dim: int, n: int) -> None:
    if x.shape[dim] % n:
        raise ValueError(f"tensor of shape {tuple(x.shape)}: dim {dim} (size {x.shape[dim]}) is not "
                         f"divisible by the group size {n}")


# ------------------------------------------------------------------ autograd functions


class _Paired(Function):
    """A collective (or identity) whose backward is another: y = fwd(x, *args) forward, and
    dx = bwd(dy, *bwd_args) backward. Every autograd-aware collective below is one such pair."""

    @staticmethod
    def forward(ctx, x, fwd, bwd, args, bwd_args):
        ctx.bwd, ctx.bwd_args = bwd, bwd_args
        return fwd(x, *args)

    @staticmethod
    def backward(ctx, dy):
        return ctx.bwd(dy, *ctx.bwd_args), None, None, None, None


def _paired(x: torch.Tensor, fwd, bwd, args: tuple, bwd_args: tuple | None = None) -> torch.Tensor:
    """`_Paired` over x; `bwd_args` default to `args`."""
    return _Paired.apply(x, fwd, bwd, args, args if bwd_args is None else bwd_args)


def _view(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x.view_as(x)


def _norm_dim(x: torch.Tensor, dim: int) -> int:
    return dim % x.dim()


def copy_to_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Identity forward, all-reduce backward (Megatron's f): x is used on a partial-grad path."""
    return x if group_size(group) == 1 else _paired(x, _view, all_reduce, (group,))


def reduce_from_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """All-reduce forward, identity backward (Megatron's g): sums partial results."""
    return x if group_size(group) == 1 else _paired(x, all_reduce, _view, (group,))


def split_along(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """Keep this rank's slice of dim `dim` forward; all-gather the grad backward."""
    if group_size(group) == 1:
        return x
    return _paired(x, split_dim, all_gather_dim, (_norm_dim(x, dim), group))


def gather_along(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """All-gather along `dim` forward; keep this rank's slice of the grad backward."""
    if group_size(group) == 1:
        return x
    return _paired(x, all_gather_dim, split_dim, (_norm_dim(x, dim), group))


def reduce_scatter_along(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """Sum over ranks and keep this rank's slice of `dim` forward; all-gather the grad backward."""
    if group_size(group) == 1:
        return x
    return _paired(x, reduce_scatter_dim, all_gather_dim, (_norm_dim(x, dim), group))


def gather_fwd_reduce_scatter_bwd(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """All-gather along `dim` forward; reduce-scatter the (partial) grad backward."""
    if group_size(group) == 1:
        return x
    return _paired(x, all_gather_dim, reduce_scatter_dim, (_norm_dim(x, dim), group))


def all_to_all_dims(x: torch.Tensor, src_dim: int, dst_dim: int, group: Group) -> torch.Tensor:
    """Re-shard from dim `src_dim` to dim `dst_dim` (and back in backward)."""
    if group_size(group) == 1:
        return x
    src, dst = _norm_dim(x, src_dim), _norm_dim(x, dst_dim)
    return _paired(x, all_to_all_dim, all_to_all_dim, (src, dst, group), (dst, src, group))


def all_to_all_uneven(x: torch.Tensor, send_rows: list[int], recv_rows: list[int],
                      group: Group) -> torch.Tensor:
    """Send send_rows[j] rows of x (in order) to rank j, receive recv_rows[j] from rank j; the
    backward sends the grads back the same way."""
    if group_size(group) == 1:
        return x
    send, recv = list(send_rows), list(recv_rows)
    return _paired(x, all_to_all_rows, all_to_all_rows, (send, recv, group), (recv, send, group))


def gather_rows_uneven(x: torch.Tensor, rows: list[int], group: Group) -> torch.Tensor:
    """All-gather rows forward (rank r brings rows[r] of them); backward: the sum of the grads
    over ranks, this rank's rows of it (the uneven reduce-scatter)."""
    if group_size(group) == 1:
        return x
    return _paired(x, all_gather_rows, reduce_scatter_rows, (list(rows), group))


def reduce_scatter_rows_uneven(x: torch.Tensor, rows: list[int], group: Group) -> torch.Tensor:
    """Sum over ranks and keep this rank's rows[rank] rows forward (x holds every rank's rows in
    rank order); backward: the all-gather of the rows' grads."""
    if group_size(group) == 1:
        return x
    return _paired(x, reduce_scatter_rows, all_gather_rows, (list(rows), group))
