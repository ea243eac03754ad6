"""Pipeline parallelism: the per-rank graph cut into the plan's stages and run by a schedule of
torch.distributed.pipelining.

Stages. The plan's `StageSpec(stage, first_layer, last_layer, chunk)` puts layers on pipeline rank
`stage`; with virtual stages (chunks) the global stage index is `chunk * pp + stage`, so rank p holds
stages p, p + pp, ... (the placement `ScheduleInterleaved1F1B` expects). Stages may differ in size, and
the first and the last may hold no layer (`autoplan.validity`). Every node of the rewritten graph goes
to the stage of its layer (`node_layer`); a node outside the layers goes to the stage of the nodes
before it (the embedding to the first stage), and after the last layer to the last stage (final norm
and head): `stage_walk`. The loss and the nodes that depend only on the targets become the schedule's
`loss_fn(output, targets)`.

Each stage is a GraphModule (`StageProgram.module`, readable with `.code`) whose inputs are the
values that earlier stages make and it or later ones use, and whose outputs are those that later
stages use (cast to fp32, so that boundaries have one dtype under autocast too; to bf16 under the plan
precision "bf16-master", whose residual stream is bf16: `boundary_dtype`); on the last stage
the output is the loss's input, as made (not sent: the loss keeps it as it would in one stage). Boundary shapes are static: the whole per-rank graph runs once on
the meta device (collectives on meta tensors only compute shapes) at one microbatch's local shape.

Schedules: "1f1b" -> Schedule1F1B (one stage per rank; needs microbatches >= pp), "gpipe" ->
ScheduleGPipe, "interleaved-1f1b" -> ScheduleInterleaved1F1B (several stages per rank). Gradients
are scaled by 1 / microbatches, the loss being each microbatch's mean, by the program's gradient
sync (runtime.grad_sync) with its other factors, not by the schedule (whose scaling would come after
the sync has begun in backward).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch
import torch.fx as fx

from autoplan.validity import SCHEDULE_1F1B, SCHEDULE_GPIPE, SCHEDULE_INTERLEAVED
from autoplan.capture import NodeInfo
from autoplan.errors import PlanError
from autoplan.plan import Plan
from autoplan.runtime.groups import RankGroup
from autoplan.runtime.recompute import node_layer

SCHEDULES = {SCHEDULE_1F1B: "Schedule1F1B", SCHEDULE_GPIPE: "ScheduleGPipe",
             SCHEDULE_INTERLEAVED: "ScheduleInterleaved1F1B"}


def to_boundary(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Stage outputs leave in the boundary dtype (a no-op where they are in it already)."""
    return x.to(dtype) if x.is_floating_point() else x


def boundary_dtype(plan: Plan) -> torch.dtype:
    """The dtype of the values crossing stage boundaries: fp32, or bf16 under master weights."""
    return torch.bfloat16 if plan.precision == "bf16-master" else torch.float32


@dataclass
class StageProgram:
    index: int  # global stage index
    module: fx.GraphModule
    inputs: tuple[str, ...]  # value names, in argument order
    outputs: tuple[str, ...]


def layer_stages(plan: Plan) -> dict[int, int]:
    """layer -> global stage index (chunk * pp + stage)."""
    found = {}
    for spec in plan.stages:
        for layer in range(spec.first_layer, spec.last_layer):
            found[layer] = spec.chunk * plan.mesh.pp + spec.stage
    return found


def stage_walk(layers: Iterable[int | None], plan: Plan) -> list[int]:
    """The global stage of each node, in graph order, from its layer (None: outside the layers): its layer's
    stage; outside the layers the stage of the node before it (0 before the first layer), but after the
    last layer the last stage, which may hold no layer (module docstring)."""
    by_layer, last_layer, last = layer_stages(plan), plan.model.num_layers - 1, num_stages(plan) - 1
    found, current, done = [], 0, False
    for layer in layers:
        done = done or layer == last_layer
        current = by_layer[layer] if layer is not None else (last if done else current)
        found.append(current)
    return found


def num_stages(plan: Plan) -> int:
    return len(plan.stages)


def rank_stages(plan: Plan, pp_index: int) -> list[int]:
    """The global stage indices pipeline rank `pp_index` runs, in order."""
    return sorted(s.chunk * plan.mesh.pp + s.stage for s in plan.stages if s.stage == pp_index)


def assign(gm: fx.GraphModule, infos: dict[str, NodeInfo], plan: Plan
           ) -> tuple[dict[fx.Node, int], set[fx.Node], fx.Node]:
    """(stage of every computing node, the loss part's nodes, the loss node)."""
    last, graph = num_stages(plan) - 1, gm.graph
    output = next(n for n in graph.nodes if n.op == "output")
    loss = output.args[0]
    if not isinstance(loss, fx.Node) or loss.op != "call_module":
        raise PlanError("pipeline parallelism needs a model whose forward returns its loss module's "
                        "output (loss = self.loss(logits, targets))")
    targets = [n for n in graph.nodes if n.op == "placeholder"][1:]
    loss_part = {loss} | _derived_only_from(graph, set(targets))
    computing = [n for n in graph.nodes if n.op not in ("placeholder", "get_attr", "output") and n not in loss_part]
    stage = dict(zip(computing, stage_walk((node_layer(n, infos) for n in computing), plan)))
    for node, current in stage.items():
        for arg in node.all_input_nodes:
            if stage.get(arg, 0) > current:
                raise PlanError(f"node {node.name!r} (stage {current}) uses {arg.name!r} from the "
                                f"later stage {stage[arg]}: the stages do not follow the graph")
    for arg in loss.all_input_nodes:
        if arg in stage and stage[arg] != last:
            raise PlanError(f"the loss reads {arg.name!r} of stage {stage[arg]}, not of the last "
                            f"stage {last}")
    return stage, loss_part, loss


def _derived_only_from(graph: fx.Graph, sources: set[fx.Node]) -> set[fx.Node]:
    """Computing nodes whose every input is a source, a get_attr or such a node."""
    found = set(sources)
    for node in graph.nodes:
        if node.op in ("call_function", "call_method", "call_module"):
            inputs = [a for a in node.all_input_nodes if a.op != "get_attr"]
            if inputs and all(a in found for a in inputs):
                found.add(node)
    return found - sources


def split(gm: fx.GraphModule, infos: dict[str, NodeInfo], plan: Plan
          ) -> tuple[list[StageProgram], fx.GraphModule]:
    """Every stage's program and the loss module (module docstring)."""
    stage, loss_part, loss = assign(gm, infos, plan)
    count = num_stages(plan)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    tokens = placeholders[0]
    pred = loss.args[0]
    boundaries = []  # values crossing into stage s, for s = 1 .. count - 1
    for s in range(1, count):
        boundaries.append([v for v in stage if stage[v] < s
                           and any(stage.get(u, count) >= s for u in v.users)])
    programs = []
    for s in range(count):
        inputs = [tokens] if s == 0 else boundaries[s - 1]
        outputs = boundaries[s] if s < count - 1 else [pred]
        nodes = [n for n in gm.graph.nodes if stage.get(n) == s]
        # the last stage's output (the logits) goes to the loss on this rank, not over a link: kept as made,
        # a float32 copy would be what the loss keeps for backward
        module = _subgraph(gm, nodes, inputs, outputs, f"stage{s}", boundary_dtype(plan) if s < count - 1 else None)
        programs.append(StageProgram(s, module, tuple(n.name for n in inputs),
                                     tuple(n.name for n in outputs)))
    loss_nodes = [n for n in gm.graph.nodes if n in loss_part]
    loss_module = _subgraph(gm, loss_nodes, [pred, placeholders[1]], [loss], "loss", None)
    return programs, loss_module


def _subgraph(gm: fx.GraphModule, nodes: list[fx.Node], inputs: list[fx.Node],
              outputs: list[fx.Node], name: str, cast: torch.dtype | None) -> fx.GraphModule:
    sub = fx.Graph()
    env = {v: sub.placeholder(v.name) for v in inputs}
    for node in nodes:
        for arg in node.all_input_nodes:
            if arg.op == "get_attr" and arg not in env:
                env[arg] = sub.get_attr(arg.target)
            elif arg not in env:
                raise PlanError(f"{name}: node {node.name!r} needs {arg.name!r}, which reaches it "
                                f"neither as an input nor from this stage")
        env[node] = sub.node_copy(node, lambda a: env[a])
    results = [sub.call_function(to_boundary, (env[o], cast)) if cast is not None else env[o] for o in outputs]
    sub.output(results[0] if len(results) == 1 else tuple(results))
    module = fx.GraphModule(gm, sub, class_name=name)
    module.graph.lint()
    return module


def meta_shapes(gm: fx.GraphModule, *inputs: torch.Tensor) -> dict[str, torch.Size]:
    """Every node's output shape from one run of the graph on meta tensors (parameters must still
    be on meta)."""
    shapes: dict[str, torch.Size] = {}

    class _Recorder(fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            if isinstance(out, torch.Tensor):
                shapes[n.name] = out.shape
            return out

    with torch.no_grad():
        _Recorder(gm).run(*inputs)
    return shapes


class PipelineRunner:
    """This rank's stages under the plan's schedule; `step` runs one batch through them."""

    def __init__(self, programs: list[StageProgram], loss_module: fx.GraphModule, plan: Plan,
                 pp: RankGroup, shapes: dict[str, torch.Size], microbatch: tuple[int, int],
                 device: torch.device) -> None:
        from torch.distributed import pipelining

        self.plan, self.pp, self.device = plan, pp, device
        self.loss_module = loss_module
        self.local = [programs[i] for i in rank_stages(plan, pp.index)]
        count = len(programs)
        self.stages = []
        for program in self.local:
            dtype = boundary_dtype(plan)
            inputs = tuple(_example(name, shapes, microbatch, device, program.index == 0, dtype)
                           for name in program.inputs)
            outputs = tuple(torch.empty(shapes[name], device=device, dtype=dtype, requires_grad=True)
                            for name in program.outputs)
            self.stages.append(pipelining.PipelineStage(
                program.module, program.index, count, device, input_args=inputs,
                output_args=outputs[0] if len(outputs) == 1 else outputs, group=pp.group))
        schedule = getattr(pipelining, SCHEDULES[plan.schedule])
        n = plan.num_microbatches
        if plan.schedule == SCHEDULE_INTERLEAVED:
            self.schedule = schedule(self.stages, n, loss_fn=self._loss, scale_grads=False)
        else:
            if len(self.stages) != 1:
                raise PlanError(f"schedule {plan.schedule!r} runs one stage per rank; the plan "
                                f"gives pipeline rank {pp.index} {len(self.stages)}: use "
                                f"'interleaved-1f1b' for virtual stages")
            self.schedule = schedule(self.stages[0], n, loss_fn=self._loss, scale_grads=False)

    def _loss(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.loss_module(output, targets)

    @property
    def modules(self) -> list[fx.GraphModule]:
        return [p.module for p in self.local]

    def step(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Forward and backward of this rank's share of the batch; returns the mean microbatch
        loss on the rank holding the last stage, 0 elsewhere."""
        losses: list[torch.Tensor] = []
        # return_outputs=False: the last stage keeps no microbatch's output (its logits) to the end of the
        # step, only the losses (as runtime.module_pipeline does)
        self.schedule.step(tokens, target=targets, losses=losses, return_outputs=False)
        if not losses:
            return torch.zeros((), device=self.device)
        return torch.stack([loss.detach().float() for loss in losses]).mean()


def _example(name: str, shapes: dict[str, torch.Size], microbatch: tuple[int, int],
             device: torch.device, first: bool, dtype: torch.dtype) -> torch.Tensor:
    if first:  # the token ids
        return torch.zeros(microbatch, dtype=torch.int64, device=device)
    if name not in shapes:
        raise PlanError(f"value {name!r} crosses a pipeline stage boundary but is not a tensor")
    return torch.empty(shapes[name], device=device, dtype=dtype, requires_grad=True)  # its grad goes back

