"""The torch parallel styles of a `ModulePlan` (`runtime.module_plan`), applied with
`parallelize_module` on the tp mesh.

    colwise      ColwiseParallel(input_layouts=R, output_layouts=S(-1))      weight (and bias) S(0)
    rowwise      RowwiseParallel(input_layouts=S(-1) | R for an embedding,   weight S(1) (embedding
                 output_layouts=R | S(1))                                    S(0)), bias R
    sequence     SequenceParallel()                                          weights R, grads summed
    replicated   `Replicated`: weights R; input brought to R; output DTensor R
    Conv1D       `Conv1DColwise` / `Conv1DRowwise` (transformers' GPT-2 projection, weight (in, out)):
                 the same layouts with the weight's dims swapped: colwise weight S(1), bias S(0);
                 rowwise weight S(0), bias R
    replicated_region  `ReplicatedRegion`: weights stay plain tensors (every tp rank computes the same);
                 DTensor inputs gathered to plain tensors, floating outputs wrapped as DTensor R

torch's Colwise / Rowwise styles redistribute a DTensor input only when their declared input
layout differs from the wanted one, trusting the declaration; activations here arrive as DTensors
of whatever placement their producer gave them, so a pre-hook registered before the style's own
first brings a DTensor input to the wanted placement (`_bring_first_input`). A plain tensor input
is taken as the declared layout: a local shard S(-1) for a row projection (the region's local
code), R for an embedding's token ids.
"""

from __future__ import annotations

import weakref
from functools import partial

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (ColwiseParallel, ParallelStyle, RowwiseParallel,
                                               SequenceParallel, parallelize_module)

from autoplan.placement import Placement, Replicate as PlanReplicate, Shard as PlanShard
from autoplan.runtime.module_plan import ModulePlan, ModuleStyle


def torch_placement(p: Placement):
    """autoplan's placement -> DTensor's (Shard(dim) or Replicate())."""
    if isinstance(p, PlanShard):
        return Shard(p.dim)
    if isinstance(p, PlanReplicate):
        return Replicate()
    raise ValueError(f"placement {p} has no module style (a module output is S(d) or R)")


def _map_tensors(value, fn):
    """`fn` on every tensor of a (nested tuple / list / dict of) module output(s)."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (tuple, list)):
        return type(value)(_map_tensors(v, fn) for v in value)
    if isinstance(value, dict):
        return {k: _map_tensors(v, fn) for k, v in value.items()}
    return value


class Replicated(ParallelStyle):
    """Every tp rank runs the whole module on whole tensors: weights become DTensor R (their
    gradients, equal on every rank, stay R), every tensor input, positional or keyword, is brought to
    R (OPT's learned positions take their ids as a keyword), the output is a DTensor R."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def replicate(t):
            if isinstance(t, DTensor):
                return t.redistribute(placements=[Replicate()])
            return DTensor.from_local(t, device_mesh, [Replicate()], run_check=False)

        def to_replicate(_module, args, kwargs):
            return _map_tensors(args, replicate), _map_tensors(kwargs, replicate)
        distribute_module(module, device_mesh)
        module.register_forward_pre_hook(to_replicate, with_kwargs=True)
        return module


class ReplicatedRegion(ParallelStyle):
    """A whole module (e.g. an attention block with plain-tensor code inside) replicated on tp:
    its weights stay plain tensors, DTensor inputs are gathered to plain whole tensors, floating
    outputs are wrapped as DTensor R so the DTensor activations around it stay DTensors."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def gather(_module, args, kwargs):
            plain = lambda t: t.redistribute(placements=[Replicate()]).to_local() \
                if isinstance(t, DTensor) else t  # noqa: E731
            return _map_tensors(args, plain), _map_tensors(kwargs, plain)

        def wrap(_module, _args, output):
            return _map_tensors(output, lambda t: DTensor.from_local(t, device_mesh, [Replicate()], run_check=False)
                                if t.is_floating_point() and not isinstance(t, DTensor) else t)
        module.register_forward_pre_hook(gather, with_kwargs=True)
        module.register_forward_hook(wrap)
        return module


class OnShards(ParallelStyle):
    """A module inside a split region that takes the region's local heads (the per-head q / k norms of a
    head-parallel attention core: `module_plan` admits no other): weights R (DTensor settles their
    gradients, partial sums over each rank's heads); its plain (..., heads, head_dim) input taken as this
    rank's shard of the heads, S(-2); its output given back as the local heads, a plain tensor."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def to_shard(_mod, inputs, mesh):
            return (DTensor.from_local(inputs[0], mesh, [Shard(inputs[0].dim() - 2)], run_check=False), *inputs[1:])

        def to_local(_mod, output, _mesh):
            return output.to_local()
        return distribute_module(module, device_mesh, None, to_shard, to_local)


class Conv1DColwise(ColwiseParallel):
    """ColwiseParallel for transformers' Conv1D (y = x @ weight + bias, weight (in, out)): the output
    features are the weight's dim 1, so weight S(1) and bias S(0)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, _partition({"weight": Shard(1), "bias": Shard(0)}),
                                 partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
                                 partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))


class Conv1DRowwise(RowwiseParallel):
    """RowwiseParallel for transformers' Conv1D: the input features are the weight's dim 0, so weight
    S(0) and bias R; the input a shard of the last dim."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self.desired_input_layouts = (Shard(-1),)
        return distribute_module(module, device_mesh, _partition({"weight": Shard(0), "bias": Replicate()}),
                                 partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
                                 partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))


def _partition(placements: dict):
    """A partition_fn of `distribute_module` putting each named parameter at its placement."""
    def partition(_name, module: nn.Module, device_mesh: DeviceMesh) -> None:
        for name, param in list(module.named_parameters(recurse=False)):
            module.register_parameter(name, nn.Parameter(
                distribute_tensor(param, device_mesh, [placements[name]]), requires_grad=param.requires_grad))
    return partition


def _bring_first_input(placement, made: dict):
    """A forward pre-hook that redistributes a DTensor first input to `placement`, once per tensor:
    the modules reading one activation (q, k and v of a norm's output; gate and up) share `made`, so
    under sequence parallelism one all-gather makes one whole-sequence copy, which their backward
    keeps once (as the zoo's runtime and the cost model's conversions have it), not one per reader."""
    def hook(_module, args):
        if not (args and isinstance(args[0], DTensor) and tuple(args[0].placements) != (placement,)):
            return None
        given, key = args[0], (id(args[0]), placement)
        ref, version, brought = made.get(key, (None, None, None))
        if ref is None or ref() is not given or version != given._version:  # new, or changed in place
            brought = given.redistribute(placements=[placement])
            ref = weakref.ref(given, lambda _, key=key: made.pop(key, None))  # dropped with the input
            made[key] = (ref, given._version, brought)
        return (brought, *args[1:])
    return hook


class _GradAsOutput(torch.autograd.Function):
    """The identity, whose backward brings a DTensor gradient to the placements of the forward's output:
    a replicated activation read by a column projection gets a Partial gradient, which the vocab-parallel
    embedding's own backward (from its MaskPartial output) cannot take unless it is summed first."""

    @staticmethod
    def forward(ctx, x):
        ctx.placements = tuple(x.placements)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if isinstance(grad, DTensor) and tuple(grad.placements) != ctx.placements:
            return grad.redistribute(placements=list(ctx.placements))
        return grad


def _settle_output_grad(_module, _inputs, output):
    """A forward hook: the output's gradient as the output is laid out (`_GradAsOutput`)."""
    return _GradAsOutput.apply(output) if isinstance(output, DTensor) else output


def torch_style(style: ModuleStyle, module: nn.Module) -> ParallelStyle:
    """The torch ParallelStyle of one module's style (module docstring)."""
    out = torch_placement(style.output)
    conv1d = not isinstance(module, (nn.Linear, nn.Embedding))  # module_plan styles no other such module
    if style.kind == "colwise" and conv1d:
        return Conv1DColwise(input_layouts=Replicate(), output_layouts=out, use_local_output=style.local_output)
    if style.kind == "rowwise" and conv1d:
        return Conv1DRowwise(input_layouts=Shard(-1), output_layouts=out, use_local_output=style.local_output)
    if style.kind == "colwise":
        return ColwiseParallel(input_layouts=Replicate(), output_layouts=out, use_local_output=style.local_output)
    if style.kind == "rowwise":
        given = Replicate() if isinstance(module, nn.Embedding) else Shard(-1)
        return RowwiseParallel(input_layouts=given, output_layouts=out, use_local_output=style.local_output)
    if style.kind == "sequence":
        return SequenceParallel(use_local_output=style.local_output)
    if style.kind == "replicated":
        return Replicated()
    if style.kind == "replicated_region":
        return ReplicatedRegion()
    if style.kind == "on_shards":
        return OnShards()
    raise ValueError(f"module style kind {style.kind!r} is unknown")


def weight_layout(style: ModuleStyle | None, module: nn.Module) -> str:
    """How a style holds its module's weight on tp: "S(0)", "S(1)", "R" (a DTensor) or "plain" (a
    plain tensor: no style, or inside a replicated region). torch's styles shard an nn.Linear's
    weight (out, in) on dim 0 colwise and 1 rowwise, an nn.Embedding's (vocab, hidden) the other way."""
    if style is None or style.kind == "replicated_region":
        return "plain"
    if style.kind in ("replicated", "sequence", "on_shards"):
        return "R"
    flipped = not isinstance(module, nn.Linear)  # nn.Embedding (vocab, hidden), Conv1D (in, out)
    return "S(1)" if (style.kind == "colwise") == flipped else "S(0)"


def tied_groups(model: nn.Module) -> list[list[str]]:
    """The names of each parameter held under more than one name (tied weights), in model order."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return [group for group in names.values() if len(group) > 1]


def _replicate_keywords(mesh: DeviceMesh, _module, args, kwargs):
    """A vocab-parallel embedding's plain tensor keywords taken as R, as torch's style takes its first
    positional input (OPT's learned positions get their ids as `position_ids=`)."""
    return args, {k: DTensor.from_local(v, mesh, [Replicate()], run_check=False)
                  if isinstance(v, torch.Tensor) and not isinstance(v, DTensor) else v for k, v in kwargs.items()}


HEAD_COUNTS = ("num_heads", "num_key_value_heads", "num_attention_heads")


def localise_head_counts(model: nn.Module, mplan: ModulePlan) -> None:
    """A region whose column projections keep their local outputs runs its own code on this rank's
    heads; the head counts such a module keeps as attributes (StableLM's
    `q.view(b, t, self.num_heads, d)`) are set to the rank's counts, count / tp, where tp divides them
    (a count it does not divide belongs to heads the plan keeps whole)."""
    parents = {path.rpartition(".")[0] for path, s in mplan.styles if s.kind == "colwise" and s.local_output}
    for parent in sorted(parents):
        module = model.get_submodule(parent)
        for attr in HEAD_COUNTS:
            count = getattr(module, attr, None)
            if type(count) is int and count % mplan.tp == 0:
                setattr(module, attr, count // mplan.tp)


def apply_module_plan(model: nn.Module, mplan: ModulePlan, tp_mesh: DeviceMesh) -> None:
    """Put every style of `mplan` on `model` (in place), parameters distributed over `tp_mesh`
    from the module's own tensors (rank 0's values: every rank must hold the same model). Each
    style replaces its module's parameters, so tied weights (which `module_launch` checks are held
    alike by every style) are tied again to the first name's new parameter."""
    tied = tied_groups(model)
    made: dict = {}  # (id of an input, placement) -> (weakref to it, its version, its redistribution)
    for path, style in mplan.styles:
        module = model.get_submodule(path)
        if style.kind == "colwise":
            module.register_forward_pre_hook(_bring_first_input(Replicate(), made))
        parallelize_module(module, tp_mesh, torch_style(style, module))
        if isinstance(module, nn.Embedding) and style.kind == "rowwise":  # post-norm models (OLMo 2)
            module.register_forward_hook(_settle_output_grad)
            module.register_forward_pre_hook(partial(_replicate_keywords, tp_mesh), with_kwargs=True)
    localise_head_counts(model, mplan)
    for first, *aliases in tied:
        for alias in aliases:
            owner, _, attr = alias.rpartition(".")
            setattr(model.get_submodule(owner), attr, model.get_parameter(first))
