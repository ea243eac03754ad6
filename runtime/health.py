"""Training health: what `RankProgram.train_step` checks so that bad input or a diverging run stops
with a message instead of training on garbage.

Inputs, before anything runs (no communication: every rank is handed the same global batch, so
every rank raises together):

    0 <= token < V   and   0 <= target < V or target == -100 (F.cross_entropy's ignore index)

as the single-device model demands (its embedding and loss raise on anything else), whereas the
vocabulary-parallel embedding and loss would mask an out-of-range id and return about log V.

Divergence, after the gradients are synchronised and before the optimizer step:

    ||g||^2 = sum over ranks r, over the parameters p that r holds, of ||g_{p,r}||^2 / copies(p)
    copies(p) = (world / pp) / pieces(p)

The world / pp ranks of p's pipeline stage hold it in pieces(p) distinct pieces (the product of
the degrees it is sharded over: tp, the expert group, expert_tp; times dp x ep x cp under ZeRO 3),
each held by copies(p) ranks with the same gradient once the gradient sync has run (under ZeRO 1/2
the reduced gradients are slices over the data ranks: grad_sync.shard_pieces); so ||g|| is the
single-device model's gradient norm. Each rank's term is summed over tp (one all-reduce of a
scalar, when tp > 1), then with the loss over pp and the data ranks (the loss's own all-reduces,
now of two numbers): every rank ends with the same loss and norm, and since NaN and inf survive any
sum every rank takes the same decision. A non-finite loss or norm raises TrainingDivergedError on
every rank, naming the first parameter (in the captured model's order) whose gradient is not
finite on any rank: three MIN all-reduces of an index, on this failure path only.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from autoplan.errors import ConfigError
from autoplan.placement import Shard
from autoplan.runtime import collectives as C

if TYPE_CHECKING:
    from autoplan.runtime.program import RankProgram

IGNORE_INDEX = -100  # F.cross_entropy's default, which the models' loss uses
SPANNING_KINDS = ("tp", "pp", "data")  # orthogonal groups whose product is the whole mesh


def check_token_range(tokens: torch.Tensor, targets: torch.Tensor, vocab: int,
                      ignore_index: int = IGNORE_INDEX) -> None:
    """Refuse a token outside [0, vocab) or a target outside it other than `ignore_index`,
    naming the first offending value and its (row, column) in the global batch."""
    for what, values, allowed in (("token", tokens, None), ("target", targets, ignore_index)):
        bad = (values < 0) | (values >= vocab)
        if allowed is not None:
            bad &= values != allowed
        if not bool(bad.any()):
            continue
        where = tuple(int(i) for i in bad.nonzero()[0])
        also = f" or {allowed} (ignored)" if allowed is not None else ""
        raise ConfigError(
            f"{what} {int(values[where])} at (row, column) {where} of the global batch is "
            f"outside the vocabulary: expected 0 <= {what} < {vocab}{also}, as the single-device "
            f"model requires; map the data into the model's vocabulary of {vocab}")


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a gradient (under ZeRO 3 FSDP2 holds it as a dp-sharded DTensor)."""
    return t.to_local() if isinstance(t, DTensor) else t


def copies(program: "RankProgram", name: str) -> int:
    """How many ranks hold the same piece of parameter `name` as this rank (module docstring)."""
    mesh = program.plan.mesh
    layout = program.layouts[name]
    pieces = math.prod(degree for placement, _, degree in layout.pieces(program.groups)
                       if isinstance(placement, Shard))
    if program.fsdp:  # FSDP2 splits each piece once more over the data ranks
        pieces *= program.data.size
    return mesh.world_size // mesh.pp // pieces


def local_sumsq(program: "RankProgram") -> torch.Tensor:
    """This rank's term of ||g||^2, fp64 on the program's device: the squared norms of its
    gradient pieces, each divided by the ranks sharing it (`sumsq_by_copies`); under master weights
    the pieces are the reduced master slices (`GradSync.shard_pieces`)."""
    sync = program.grad_sync
    if sync is not None and sync.masters:  # ZeRO 0-2, master weights: the reduced gradients are master slices
        names = {id(p): n for n, p in program.named_local_parameters()}
        return sumsq_by_copies(sync.shard_pieces(lambda p: copies(program, names[id(p)])), program.device)
    by_copies: dict[int, list[torch.Tensor]] = {}
    for name, p in program.named_local_parameters():
        if p.grad is not None:
            by_copies.setdefault(copies(program, name), []).append(_local(p.grad))
    return sumsq_by_copies(by_copies, program.device)


def sumsq_by_copies(by_copies: dict[int, list[torch.Tensor]], device) -> torch.Tensor:
    """sum over groups, over their tensors, of ||t||^2 / copies: fp64 on `device`, never read on the host
    here. Each tensor's norm is one foreach kernel per group, accumulated in fp32 (fp64 for fp64 tensors)
    whatever the gradients' dtype: a norm that overflows fp32 is infinite, as torch's clip_grad_norm_
    reports it; the squares are summed in fp64."""
    total = torch.zeros((), dtype=torch.float64, device=device)
    for count, tensors in sorted(by_copies.items()):
        if tensors:
            wide = torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32
            norms = torch.stack(torch._foreach_norm(tensors, 2.0, dtype=wide))
            total += norms.to(device, torch.float64).square().sum() / count
    return total


def first_nonfinite(program: "RankProgram") -> str | None:
    """The first parameter, in the model's order (the same on every rank), whose gradient holds a
    NaN or inf on any rank; None if there is none. A collective: every rank calls it."""
    order = list(program.all_layouts)
    found = len(order)
    for name, p in program.named_local_parameters():
        if p.grad is not None and not bool(torch.isfinite(_local(p.grad)).all()):
            found = min(found, order.index(name))
    index = torch.tensor([found], dtype=torch.int64, device=program.device)
    for kind in SPANNING_KINDS:
        group = program.groups[kind]
        if group.size > 1:
            index = C.all_reduce(index, group.group, dist.ReduceOp.MIN)
    return order[int(index)] if int(index) < len(order) else None
