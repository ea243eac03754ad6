"""A configuration the step model prices (`Config`): the mesh and the knobs around it (microbatch size and
count, ZeRO stage, recompute policy, pipeline schedule, precision scheme). The search space that enumerates them is
`autoplan.solver.space`; the step model that prices them is `autoplan.cost_model.step`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from fractions import Fraction
from functools import cached_property

from autoplan.mesh import DEFAULT_ORDER, MeshShape
from autoplan.recompute_policy import recompute_policy
from autoplan.validity import SCHEDULE_1F1B

ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}
MESH_FIELDS = frozenset(f.name for f in dataclasses.fields(MeshShape))


@dataclass(frozen=True)
class Config:
    """One point of the search space: the mesh (`MeshShape`: degrees, order over ranks, etp, ep_as) and the
    knobs around it. The mesh's fields read through (`cfg.tp` is `cfg.mesh.tp`), so there is one spelling of
    each and one set of rules: `MeshShape` validates and normalises them."""

    mesh: MeshShape
    microbatch_size: int
    num_microbatches: int
    zero_stage: int
    recompute: str
    schedule: str = SCHEDULE_1F1B
    virtual_stages: int = 1
    stage_layers: tuple[int, ...] | None = None  # layers per chunk in flow order, given; None: the stage search's
    precision: str = "autocast"  # `autoplan.plan.PRECISIONS`: which copies of the weights a rank holds

    @classmethod
    def of(cls, tp: int, cp: int, pp: int, ep: int, dp: int, microbatch_size: int, num_microbatches: int,
           zero_stage: int, recompute: str, schedule: str = SCHEDULE_1F1B, virtual_stages: int = 1,
           order: tuple[str, ...] = DEFAULT_ORDER, etp: int | None = None, ep_as: str = "dp") -> "Config":
        """A Config from the mesh degrees (as the search enumerates them)."""
        mesh = MeshShape(pp=pp, dp=dp, tp=tp, cp=cp, ep=ep, order=order, etp=etp, ep_as=ep_as)
        return cls(mesh, microbatch_size, num_microbatches, zero_stage, recompute, schedule, virtual_stages)

    def replace(self, **changes) -> "Config":
        """A copy with `changes` applied, mesh fields (tp, dp, etp, order, ...) and knobs alike."""
        mesh_fields = {k: changes.pop(k) for k in list(changes) if k in MESH_FIELDS}
        mesh = dataclasses.replace(self.mesh, **mesh_fields) if mesh_fields else self.mesh
        return dataclasses.replace(self, mesh=mesh, **changes)

    tp = property(lambda self: self.mesh.tp)
    cp = property(lambda self: self.mesh.cp)
    pp = property(lambda self: self.mesh.pp)
    ep = property(lambda self: self.mesh.ep)
    dp = property(lambda self: self.mesh.dp)
    etp = property(lambda self: self.mesh.etp)
    order = property(lambda self: self.mesh.order)
    ep_as = property(lambda self: self.mesh.ep_as)
    data_parallel = property(lambda self: self.mesh.batch_shards, doc="ranks that split the batch")
    context_parallel = property(lambda self: self.mesh.context_parallel, doc="ways each sequence is split")

    @property
    def data_ranks(self) -> int:
        """Ranks holding the same dense shards (ZeRO shards over them, gradients reduce over them): dp x ep x cp,
        whatever ep_as."""
        return self.dp * self.ep * self.cp

    @property
    def steps_on_masters(self) -> bool:
        """Whether the optimizer steps on fp32 master slices of the gradient buckets (`runtime.grad_sync`): ZeRO
        1/2 over more than one data rank, and bf16-master wherever FSDP2 does not hold the masters (ZeRO 3 over
        more than one data rank)."""
        sharded = self.zero_stage in (1, 2) and self.data_ranks > 1
        fsdp = self.zero_stage == 3 and self.data_ranks > 1
        return sharded or (self.precision == "bf16-master" and not fsdp)

    @cached_property
    def rank_microbatch(self) -> Fraction:
        """Sequences' worth of tokens one rank processes per microbatch: mbs / cp (mbs / (cp ep) under
        ep_as = "cp")."""
        return Fraction(self.microbatch_size, self.context_parallel)

    def sort_key(self) -> tuple:
        """Deterministic order between configurations of equal step time (simpler ones first)."""
        return (self.pp, self.tp, self.cp, self.ep, self.microbatch_size, self.zero_stage,
                recompute_policy(self.recompute).sort_key(), self.schedule, self.virtual_stages,
                self.order != DEFAULT_ORDER, self.order, self.etp != self.tp, self.ep_as != "dp", self.precision)

    def describe(self) -> str:
        schedule = self.schedule if self.virtual_stages == 1 else f"{self.schedule} v={self.virtual_stages}"
        if self.stage_layers is not None:
            schedule += f", stage layers {','.join(map(str, self.stage_layers))}"
        order = "" if self.order == DEFAULT_ORDER else f" (order {' > '.join(self.order)})"
        return (f"{self.mesh}{order}, microbatch {self.microbatch_size} x {self.num_microbatches}, ZeRO-{self.zero_stage}, "
                f"recompute {self.recompute}, {schedule}" + (f", {self.precision}" if self.precision != "autocast" else ""))
