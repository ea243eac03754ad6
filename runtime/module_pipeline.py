"""Pipeline parallelism for the user's own module: `PipelinedModuleProgram`, a `ModuleProgram`
whose steps run the plan's stages (`runtime.module_stages`) under a schedule of
torch.distributed.pipelining.

    mesh       a DeviceMesh ("pp", "dp", "ep", "cp", "tp") laid out as the plan's MeshShape; each
               pipeline rank runs its stages on its ("dp", "ep", "cp", "tp") sub-mesh, as a program
               without pp would (ep: the experts of its stages' MoE blocks, `runtime.module_experts`;
               cp: each stage's attention over the cp ranks, `runtime.module_context`)
    stages     global stage g = chunk * pp + stage holds the layers of the plan's StageSpec; pipeline
               rank p runs stages p, p + pp, ... (`runtime.pipeline.rank_stages`, the placement
               ScheduleInterleaved1F1B expects). The model keeps only this rank's modules, under
               their own names (the others' positions hold parameter-free stand-ins), so its
               parameters, optimizer, tp styles, checkpoint reads and ZeRO are this rank's share
    schedule   "1f1b" Schedule1F1B, "gpipe" ScheduleGPipe, "interleaved-1f1b"
               ScheduleInterleaved1F1B, over the plan's num_microbatches microbatches of this
               dp rank's rows; the token ids reach every stage as a keyword argument (each stage
               derives positions and masks from them: under cp the global positions of its chunk),
               the activation flows between stages
    ZeRO       0, 1: `runtime.grad_sync` over this rank's stage parameters, as without a pipeline:
               buckets all-reduced (1: reduce-scattered for the distributed optimizer) from the
               gradient hooks of the last microbatch's backward; 2, 3 with pp are refused by
               `autoplan.validity`

The loss is the one of `ModuleProgram.train_step`: the schedule's loss function on the last stage
returns, per microbatch m, sum of token cross-entropies of m * dp ep cp / N (`scale_grads=False`: no
further division by the microbatch count), and adds the sum to this step's total; the global loss
is that total summed over pp (only the last stage has one) and dp x ep x cp, / N.

`forward` (logits) is refused: the logits exist on the last stage only, one microbatch at a time.
`eval_loss` runs the schedule forward only. `full_state_dict` / `full_parameters` /
`full_gradients` gather every stage's share over pp (rank 0's order is the model's).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from autoplan.errors import PlanError
from autoplan.plan import Plan
from autoplan.runtime.module_plan import ModulePlan
from autoplan.runtime.module_context import ContextParallel
from autoplan.runtime.module_program import MESH_DIMS, ModuleProgram, axes_mesh
from autoplan.runtime.module_stages import Elsewhere, StageCut, StageOutput, run_model
from autoplan.runtime.module_styles import torch_placement
from autoplan.runtime.pipeline import SCHEDULES, rank_stages
from autoplan.validity import SCHEDULE_INTERLEAVED


def pipeline_mesh(plan: Plan, device_type: str) -> DeviceMesh:
    """The ("pp", "dp", "ep", "cp", "tp") DeviceMesh of `plan`: entry [p][d][e][c][t] is the rank at
    those mesh coordinates (the MeshShape's order of axes over ranks); each pipeline rank's
    ("dp", "ep", "cp", "tp") sub-mesh is the mesh of a program without pp (`module_program.plan_mesh`)."""
    return axes_mesh(plan, device_type, ("pp", *MESH_DIMS))


def held_module_plan(mplan: ModulePlan, model: nn.Module) -> ModulePlan:
    """The styles of the modules this rank still holds after `StageCut.prune`."""
    held = {path for path, m in model.named_modules() if not isinstance(m, Elsewhere)}
    return ModulePlan(mplan.tp, tuple((p, s) for p, s in mplan.styles if p in held), mplan.loss)


def boundary_placement(mplan: ModulePlan, cut: StageCut):
    """The placement an activation crosses a stage boundary in under tp: that of the input of
    the first norm-like module (a style other than a linear's or a region's) of the first block,
    the residual stream's (S(1) under sequence parallelism, else R); None without tp."""
    if mplan.tp == 1:
        return None
    inside = cut.blocks[0].path + "."
    for path, style in mplan.styles:
        if path.startswith(inside) and style.kind in ("sequence", "replicated") and style.input is not None:
            return torch_placement(style.input)
    return Replicate()


class StageModule(nn.Module):
    """One global stage of the model: the model's own forward arranged by `StageCut.view`; takes
    the previous stage's activation (none on the first) and the token ids; returns the activation
    for the next stage (this rank's local tensor in `boundary`), or the logits on the last."""

    def __init__(self, model: nn.Module, cut: StageCut, stage: int, boundary, tp_mesh: DeviceMesh,
                 context: ContextParallel | None) -> None:
        super().__init__()
        # the stage's own modules as children (its parameters: what ZeRO shards with this stage as
        # root, disjoint from the other stages of this rank); the model as a plain attribute
        self.parts = nn.ModuleList(p.module for p in cut.held(stage))
        object.__setattr__(self, "model", model)
        self.cut, self.stage = cut, stage
        self.boundary, self.tp_mesh, self.context = boundary, tp_mesh, context
        self.last = stage == cut.count - 1

    def forward(self, *received: torch.Tensor, input_ids: torch.Tensor):
        x = self._arrived(received[0]) if received else None
        positions = None if self.context is None else self.context.positions(input_ids)
        with self.cut.view(self.stage, x):
            try:
                logits = run_model(self.model, input_ids, positions)
            except StageOutput as end:
                return self._leaving(end.value)
        if not self.last:
            raise PlanError(f"pipeline stage {self.stage} of {self.cut.count} ran the model's forward "
                            f"to its end instead of stopping after its blocks")
        return logits

    def _arrived(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.boundary is None else DTensor.from_local(t, self.tp_mesh, [self.boundary], run_check=False)

    def _leaving(self, t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, DTensor):
            t = t.redistribute(placements=[self.boundary]).to_local()
        return t.contiguous()


class PipelinedModuleProgram(ModuleProgram):
    """This rank's stages of the user's module under a plan with pp > 1 (module docstring)."""

    def __init__(self, model: nn.Module, plan: Plan, mesh: DeviceMesh, mplan: ModulePlan,
                 device: torch.device, check_finite: bool, cut: StageCut) -> None:
        super().__init__(model, plan, mesh[MESH_DIMS], mplan, device, check_finite)
        self.cut, self.pp_group = cut, mesh.get_group("pp")
        self.param_names = cut.param_names
        boundary = boundary_placement(mplan, cut)
        local = rank_stages(plan, mesh.get_local_rank("pp"))
        self.stage_modules = [StageModule(model, cut, g, boundary, self.mesh["tp"], self.context) for g in local]
        self._scale = 1.0  # of the loss function: dp ep / N of the running step
        self._schedule = None

    def schedule(self):
        """The plan's schedule over this rank's stages (built at the first step: ZeRO wraps the
        stage modules after construction)."""
        if self._schedule is None:
            from torch.distributed import pipelining

            stages = [pipelining.PipelineStage(m, m.stage, self.cut.count, self.device, group=self.pp_group)
                      for m in self.stage_modules]
            cls = getattr(pipelining, SCHEDULES[self.plan.schedule])
            given = stages if self.plan.schedule == SCHEDULE_INTERLEAVED else stages[0]
            self._schedule = cls(given, self.plan.num_microbatches, loss_fn=self._stage_loss, scale_grads=False)
        return self._schedule

    def _stage_loss(self, logits, targets: torch.Tensor) -> torch.Tensor:
        return self._logits_loss_sum(logits, targets) * self._scale

    def _run(self, tokens: torch.Tensor, targets: torch.Tensor, count: int, train: bool) -> torch.Tensor:
        """The schedule over these rows (forward and backward, or forward only); the sum of the token
        losses on the last stage (its microbatches' losses / the scale), 0 elsewhere. (Not summed
        inside the loss function: the stages' metadata inference calls it too, at the first step.)"""
        self._scale, losses = self.data / count, []
        schedule = self.schedule()
        run = schedule.step if train else schedule.eval
        with self._loss_context(), self._autocast():
            run(input_ids=tokens.to(self.device), target=targets.to(self.device), losses=losses,
                **({"return_outputs": False} if train else {}))
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for loss in losses:
            total += loss.detach().double()
        return (total / self._scale).float()

    def _forward_backward(self, rows: torch.Tensor, wanted: torch.Tensor, count: int) -> torch.Tensor:
        return self._run(rows, wanted, count, train=True)

    @torch.no_grad()
    def eval_loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> float:
        """The global mean token loss on (G, T) tokens, the schedule run forward only (eval mode)."""
        count = self._count_targets(tokens, targets, "eval_loss")
        was = self.model.training
        self.model.eval()
        try:
            total = self._run(self._share(tokens), self._share(targets), count, train=False)
        finally:
            self.model.train(was)
        return self._global_loss(total, count)

    def _global_loss(self, total: torch.Tensor, count: int) -> float:
        dist.all_reduce(total, group=self.pp_group)
        return super()._global_loss(total, count)

    def forward(self, tokens: torch.Tensor, gather: bool = False) -> torch.Tensor:
        raise PlanError(f"program.forward returns logits, but this plan pipelines the model over "
                        f"pp={self.plan.mesh.pp} stages: the logits exist only on the last stage, one "
                        f"microbatch at a time. Use program.eval_loss(tokens, targets) for the loss, or "
                        f"program.full_state_dict() (save_hf) and the model in one process for logits; "
                        f"or plan pp=1 for forward")

    def full_parameters(self) -> dict[str, torch.Tensor]:
        return self._gather_stages(super().full_parameters(), self.cut.param_names)

    def full_gradients(self) -> dict[str, torch.Tensor]:
        return self._gather_stages(super().full_gradients(), self.cut.param_names)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return self._gather_stages(super().full_state_dict(), self.cut.state_names)

    def _gather_stages(self, mine: dict[str, torch.Tensor], order: list[str]) -> dict[str, torch.Tensor]:
        """Every pipeline rank's share (whole tensors, on CPU) on every rank, in the model's order."""
        parts: list = [None] * self.plan.mesh.pp
        dist.all_gather_object(parts, mine, group=self.pp_group)
        merged = {name: t for part in parts for name, t in part.items()}
        return {name: merged[name] for name in order}
