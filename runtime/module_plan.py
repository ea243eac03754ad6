"""A Plan read as module styles: {module path: how that module runs on the tp axis}.

The runtime for the user's own module (`runtime.module_program`) does not rewrite a graph: it puts
DTensor parallel styles on the modules (`parallelize_module`). This module turns the plan's
per-op strategies (`OpPlacement.strategy` and its module path) into those styles, and checks that
the plan can be run that way. `print(module_plan(plan, model))` shows the result.

Which op speaks for a module: the op(s) of the plan that run in it and use its parameters (the
linear of an nn.Linear, the lookup of an nn.Embedding, the scale of a norm). Their strategy:

    module              strategy    style                                    output
    nn.Linear           column      ColwiseParallel                          local shard S(-1)
                        row         RowwiseParallel(output R)                DTensor R
                        row_sp      RowwiseParallel(output S(1))             DTensor S(1)
                        sequence    SequenceParallel (weights replicated)    DTensor S(1)
                        replicate   Replicated                               DTensor R
    Conv1D (GPT-2)      column      Conv1DColwise (weight (in, out) S(1))   local shard S(-1)
                        row, row_sp Conv1DRowwise (weight S(0))                 DTensor R, S(1)
                        replicate   Replicated                               DTensor R
                        a fused output (c_attn: q|k|v one after another) is refused column
    nn.Embedding        vocab       RowwiseParallel(input R, output R)       DTensor R
                        vocab_sp    RowwiseParallel(input R, output S(1))    DTensor S(1)
                        hidden      ColwiseParallel(input R)                 DTensor S(-1)
                        replicate   Replicated                               DTensor R
    other (norms)       sequence    SequenceParallel                         DTensor S(1)
                        replicate   Replicated                               DTensor R

Regions. Between modules, activations are DTensors that carry their placement, so each module
redistributes what arrives to what its op wants (a column projection all-gathers a sequence
shard, as the plan's conversion on that edge does). The code between a column and a row
projection (attention heads, the MLP's activation) runs on plain local tensors: transformers'
attention infers the local head count from the projection's width (`view(..., -1, head_dim)`),
and its rotary tables are plain tensors. So the linears of one parent module (an attention or
MLP module) form a region, of one of three kinds:

    split       column and row / row_sp linears, every other op of the region on a shard (heads,
                features): the Megatron block, run on local shards (a parent with only column or
                only row linears, such as a head inside a submodule, is no region: its linears
                take and give DTensors)
    replicate   every linear and op replicated: `ReplicatedRegion` on the parent (its input
                gathered to plain tensors, its output wrapped as DTensor R, its weights plain)
    sequence    every linear "sequence" and every op on sequence shards: per-token code (an MLP)
                run on DTensor S(1)

Anything else (a region mixing kinds, a replicated attention core between column projections,
a module with parameters inside a split region other than its linears) is refused, naming the
module and op. Ops outside regions and styled modules (residual adds, position and mask builders)
run on whatever arrives: DTensor ops on DTensors, plain ops on plain tensors (the same numbers;
DTensor may choose another conversion than the plan priced for them).

MoE blocks (transformers' Mixtral, Qwen2-MoE): the block's routed part is one "moe" op using the
router's and the experts' parameters; with its strategy "replicate" the router and the experts modules
are each a replicated region (ep splits the experts over other ranks: `runtime.module_experts`); the
plan's other MoE strategies (ffn, sequence, expert) are refused. Linears the block holds itself
(Qwen2-MoE's shared-expert gate) are replicated one by one; its shared experts are a region as any MLP.

torch's nn.MultiheadAttention: one replicated region (its forward uses its fused in_proj_weight and
out_proj's weight itself, so the plan's ops of both run in its own path); a plan splitting one is refused.

The loss: the strategy of the plan's cross-entropy op (vocab: `loss_parallel` on logits split on
the vocabulary; sequence: each rank's tokens, then the mean over tp; replicate: whole logits).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from dataclasses import dataclass

from torch import nn

from autoplan.errors import PlanError
from autoplan.placement import Placement, Replicate, Shard
from autoplan.plan import OpPlacement, Plan
from autoplan.strategies import is_expert_weight

R = Replicate()
SEQ = Shard(1)
LAST = Shard(-1)

# (module class kind, strategy) -> (style kind, input wanted, output, output stays a local shard)
STYLES: dict[tuple[str, str], tuple[str, Placement | None, Placement, bool]] = {
    ("linear", "column"): ("colwise", R, LAST, True),
    ("linear", "row"): ("rowwise", LAST, R, False),
    ("linear", "row_sp"): ("rowwise", LAST, SEQ, False),
    ("linear", "sequence"): ("sequence", SEQ, SEQ, False),
    ("linear", "replicate"): ("replicated", R, R, False),
    ("conv1d", "column"): ("colwise", R, LAST, True),
    ("conv1d", "row"): ("rowwise", LAST, R, False),
    ("conv1d", "row_sp"): ("rowwise", LAST, SEQ, False),
    ("conv1d", "replicate"): ("replicated", R, R, False),
    ("embedding", "vocab"): ("rowwise", R, R, False),
    ("embedding", "vocab_sp"): ("rowwise", R, SEQ, False),
    ("embedding", "hidden"): ("colwise", R, LAST, False),
    ("embedding", "replicate"): ("replicated", R, R, False),
    ("other", "sequence"): ("sequence", SEQ, SEQ, False),
    ("other", "replicate"): ("replicated", R, R, False),
}
LOSS_STRATEGIES = ("vocab", "sequence", "replicate")


@dataclass(frozen=True)
class ModuleStyle:
    """How one module runs on tp: `kind` (colwise, rowwise, sequence, replicated,
    replicated_region), the placement its input is brought to, its output's placement, whether it
    returns its local shard as a plain tensor, and the plan's strategy and ops behind it."""

    kind: str
    input: Placement | None
    output: Placement
    local_output: bool
    strategy: str
    ops: tuple[str, ...] = ()

    def __str__(self) -> str:
        into = f"{self.input} -> " if self.input is not None else ""
        form = "local" if self.local_output else "DTensor"
        return f"{self.kind}({into}{self.output}, {form})"


@dataclass(frozen=True)
class ModulePlan:
    """The styles of a plan on a model, in the model's module order, and how the loss runs."""

    tp: int
    styles: tuple[tuple[str, ModuleStyle], ...]
    loss: str = "replicate"

    def style(self, path: str) -> ModuleStyle | None:
        return dict(self.styles).get(path)

    def table(self) -> str:
        """One line per styled module: path, plan strategy, style (readable, for users)."""
        width = max((len(p) for p, _ in self.styles), default=6)
        lines = [f"tp={self.tp}: {len(self.styles)} styled modules; loss: {self.loss}"]
        lines += [f"  {path or '<root>':{width}}  {s.strategy:10}  {s}" for path, s in self.styles]
        return "\n".join(lines)

    __str__ = table


def module_plan(plan: Plan, model: nn.Module) -> ModulePlan:
    """The styles of `plan` on `model` (module docstring); PlanError where it cannot run so."""
    tp = plan.mesh.tp
    if tp == 1:
        return ModulePlan(1, ())
    modules = dict(model.named_modules())
    by_module = _ops_by_module(plan)
    moe = _moe_styles(plan, modules) | _multihead_styles(modules, by_module)
    members = _core_members(plan, modules)
    owners = {path: _speaking_ops(path, m, by_module) for path, m in modules.items()
              if path not in members and not any(path == p or path.startswith(p + ".") for p in moe)
              and any(True for _ in m.parameters(recurse=False))}
    linears = [p for p in owners if _kind(modules[p]) in ("linear", "conv1d")]  # model order: refusals repeatable
    styles: dict[str, ModuleStyle] = dict(moe) | _member_styles(members, modules)
    regions = defaultdict(list)
    for path in linears:
        parent = path.rpartition(".")[0]
        if parent:
            regions[parent].append(path)
    for parent, members in regions.items():
        if any(m.startswith(parent + ".") for m in moe):  # a MoE block's own linears (Qwen2-MoE's shared gate)
            styles.update(_moe_block_linears(parent, sorted(members), owners, modules))
            continue
        styles.update(_region_styles(parent, sorted(members), owners, by_module, modules))
    for path, ops in owners.items():  # outside regions every output stays a DTensor (the head's logits)
        if path not in styles and not _inside_replicated(path, styles):
            styles[path] = dataclasses.replace(_leaf_style(path, modules[path], ops), local_output=False)
    # a region inside a replicated region (OPT's attention inside its replicated decoder layer) runs in
    # the outer one's plain-tensor code: a style of its own would hand that code DTensors
    styles = {p: s for p, s in styles.items() if not _inside_replicated(p, styles)}
    order = {p: i for i, p in enumerate(modules)}
    return ModulePlan(tp, tuple(sorted(styles.items(), key=lambda kv: order[kv[0]])), _loss(plan))


def _moe_styles(plan: Plan, modules: dict[str, nn.Module]) -> dict[str, ModuleStyle]:
    """The MoE ops' modules (a transformers MoE block's router and experts, whose parameters the one
    "moe" op of the block uses: `autoplan.capture.hf_moe`), each a replicated region: every tp rank
    routes and runs the experts on all tokens (expert parallelism splits them: runtime.module_experts).
    PlanError for another strategy of a MoE op."""
    found: dict[str, ModuleStyle] = {}
    for op in plan.ops:
        names = [p.name for p in op.resolved.params] if op.resolved is not None else []
        if not any(is_expert_weight(n) for n in names):
            continue
        if op.strategy != "replicate":
            raise PlanError(f"MoE op {op.node!r} (module {op.module!r}) runs {op.strategy!r} on tp; the runtime "
                            f"for your own module runs a MoE block's router and experts replicated on tp (ep "
                            f"splits the experts): plan 'replicate' for it, or tp=1")
        prefix = f"{op.module}." if op.module else ""
        for name in names:
            path = prefix + name.rpartition(".")[0]
            if path in modules:
                found[path] = ModuleStyle("replicated_region", R, R, False, "replicate", (op.node,))
    return found


def _multihead_styles(modules: dict[str, nn.Module], by_module) -> dict[str, ModuleStyle]:
    """Each nn.MultiheadAttention, a replicated region: its forward projects q|k|v with one fused
    in_proj_weight and applies out_proj's weight itself (the plan's ops of both run in the module's own
    path), so no column / row split fits it in place. PlanError when the plan splits one of its ops."""
    found: dict[str, ModuleStyle] = {}
    for path, module in modules.items():
        if not isinstance(module, nn.MultiheadAttention):
            continue
        ops = [o for m, found_ops in by_module.items() if m == path or m.startswith(path + ".") for o in found_ops]
        split = [o for o in ops if o.strategy != "replicate"]
        if split:
            raise PlanError(f"module {path!r} (nn.MultiheadAttention): op {split[0].node!r} runs "
                            f"{split[0].strategy!r}, but the module projects q|k|v with one fused in_proj_weight "
                            f"inside its own forward, which the module runtime runs replicated on tp: plan "
                            f"'replicate' for the ops of {path!r}, or tp=1")
        found[path] = ModuleStyle("replicated_region", R, R, False, "replicate", tuple(o.node for o in ops))
    return found


def _core_members(plan: Plan, modules: dict[str, nn.Module]) -> dict[str, OpPlacement]:
    """{submodule: op} for the submodules whose parameters an op of an enclosing module uses: the
    per-head q / k norms fused into an attention core (`autoplan.capture.hf_attention`), whose module is
    the attention module and whose parameters are named "q_norm.weight" under it."""
    found: dict[str, OpPlacement] = {}
    for op in plan.ops:
        if op.resolved is None:
            continue
        for name in (p.name for p in op.resolved.params if "." in p.name and not is_expert_weight(p.name)):
            path = f"{op.module}.{name.rpartition('.')[0]}" if op.module else name.rpartition(".")[0]
            if path in modules and _kind(modules[path]) == "other":
                found[path] = op
    return found


def _member_styles(members: dict[str, OpPlacement], modules: dict[str, nn.Module]) -> dict[str, ModuleStyle]:
    """A core member of a split core (heads) runs on the core's local heads with its weights R
    ("on_shards": the norm's input taken as this rank's heads, its output given back as them); one of a
    replicated core needs no style (its weights plain inside the replicated region). PlanError for a
    norm over all heads' features together (OLMo 2's q_norm / k_norm), which no head split computes."""
    split = {path: op for path, op in members.items() if op.strategy != "replicate"}
    for path, op in split.items():
        head_dim = getattr(modules[path.rpartition(".")[0]], "head_dim", None)
        width = next((p.shape[-1] for p in modules[path].parameters(recurse=False)), None)
        if width != head_dim:
            raise PlanError(f"module {path!r} ({type(modules[path]).__name__}, width {width}) normalizes "
                            f"all heads' features together, not each head's {head_dim}; the module runtime "
                            f"splits the attention core {op.node!r} on heads only where its norms are "
                            f"per head: plan {op.module!r} 'replicate'")
    return {path: ModuleStyle("on_shards", None, LAST, True, op.strategy, (op.node,)) for path, op in split.items()}


def _moe_block_linears(parent: str, members: list[str], owners, modules) -> dict[str, ModuleStyle]:
    """The linears held directly by a MoE block (Qwen2-MoE's shared_expert_gate), which holds
    styled modules of its own (router, experts, shared experts): each replicated on its own (DTensor
    R in and out), the block's other ops running on the DTensors around them. PlanError otherwise."""
    split = [m for m in members if owners[m][0].strategy != "replicate"]
    if split:
        raise PlanError(f"module {split[0]!r} ({owners[split[0]][0].strategy}) sits in MoE block {parent!r} "
                        f"beside its router and experts; the module runtime runs such a linear replicated: "
                        f"plan 'replicate' for it")
    return {m: dataclasses.replace(_leaf_style(m, modules[m], owners[m]), local_output=False) for m in members}


def _ops_by_module(plan: Plan) -> dict[str, list[OpPlacement]]:
    found = defaultdict(list)
    for op in plan.ops:
        if op.resolved is None:
            raise PlanError(f"plan op {op.node!r} has no resolved strategy (a version-1 plan): re-make "
                            f"the plan with `autoplan search` to run it")
        found[op.module].append(op)
    return found


def _speaking_ops(path: str, module: nn.Module, by_module) -> list[OpPlacement]:
    """The ops of `path` that use its parameters; PlanError if there are none or they disagree."""
    ops = [o for o in by_module.get(path, ()) if o.resolved.params]
    if not ops:
        names = [n for n, _ in module.named_parameters(recurse=False)]
        raise PlanError(f"module {path or '<root>'!r} ({type(module).__name__}) holds parameters "
                        f"{names} but no op of the plan uses them: the plan was made for another "
                        f"model (or captured a different module tree); re-plan this model")
    if len({o.strategy for o in ops}) > 1:
        found = ", ".join(f"{o.node}: {o.strategy}" for o in ops)
        raise PlanError(f"module {path!r} runs ops with different strategies ({found}); the module "
                        f"runtime gives each module one style: plan one strategy for its ops")
    return ops


def _kind(module: nn.Module) -> str:
    if isinstance(module, nn.Linear):
        return "linear"
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf"):  # transformers' GPT-2 projection
        return "conv1d"
    return "embedding" if isinstance(module, nn.Embedding) else "other"


def _leaf_style(path: str, module: nn.Module, ops: list[OpPlacement]) -> ModuleStyle:
    strategy = ops[0].strategy
    nested = [p for p, m in module.named_modules() if p and any(True for _ in m.parameters(recurse=False))]
    if _kind(module) == "other" and nested:
        raise PlanError(f"module {path!r} ({type(module).__name__}) holds parameters of its own and "
                        f"in its submodules {nested[:3]}; the module runtime styles modules whose "
                        f"parameters are their own (nn.Linear, nn.Embedding, norms): move them into a "
                        f"submodule of their own, or plan tp=1")
    entry = STYLES.get((_kind(module), strategy))
    if entry is None:
        valid = sorted(s for k, s in STYLES if k == _kind(module))
        raise PlanError(f"module {path!r} ({type(module).__name__}): strategy {strategy!r} of op "
                        f"{ops[0].node!r} has no module style; the module runtime runs {valid} for "
                        f"a module of this kind")
    kind, want, out, local = entry
    return ModuleStyle(kind, want, out, local, strategy, tuple(o.node for o in ops))


def _inside_replicated(path: str, styles: dict[str, ModuleStyle]) -> bool:
    return any(s.kind == "replicated_region" and path.startswith(p + ".") for p, s in styles.items())


def _region_ops(parent: str, members: list[str], by_module, modules) -> list[OpPlacement]:
    """The ops of region `parent` that are not its linears' (attention cores, activations, views),
    nor an nn.Dropout's: under tp its p is 0 (module_launch refuses more), an identity on any layout."""
    inside = [m for m in by_module if (m == parent or m.startswith(parent + "."))
              and not isinstance(modules.get(m), nn.Dropout)]
    return [o for m in inside if m not in members for o in by_module[m]]


def _region_styles(parent: str, members: list[str], owners, by_module, modules) -> dict[str, ModuleStyle]:
    """The styles of the linears of one parent module (module docstring, "Regions")."""
    for m in members:
        if owners[m][0].strategy == "column":
            _check_unfused(m, members, owners, modules)
    strategies = {owners[m][0].strategy for m in members}
    others = _region_ops(parent, members, by_module, modules)
    if strategies <= {"column", "row", "row_sp"} and "column" in strategies and strategies & {"row", "row_sp"}:
        _check_split(parent, members, owners, others, modules)
        return {m: _leaf_style(m, modules[m], owners[m]) for m in members}
    if strategies <= {"column", "row", "row_sp"}:  # lone projections (a head in a submodule): DTensors
        return {m: dataclasses.replace(_leaf_style(m, modules[m], owners[m]), local_output=False) for m in members}
    if strategies == {"sequence"}:
        _check_all(parent, others, lambda o: o.resolved.output == SEQ, "on sequence shards (S(1))")
        return {m: _leaf_style(m, modules[m], owners[m]) for m in members}
    if strategies == {"replicate"}:
        _check_all(parent, others, lambda o: o.strategy == "replicate", "replicated")
        ops = tuple(o.node for m in members for o in owners[m])
        return {parent: ModuleStyle("replicated_region", R, R, False, "replicate", ops)}
    found = ", ".join(f"{m.rsplit('.', 1)[-1]}: {owners[m][0].strategy}" for m in members)
    raise PlanError(f"module {parent!r}: its linears mix strategies ({found}); the module runtime "
                    f"runs a module's linears all column/row (tensor parallel), all sequence, or "
                    f"all replicate: plan one of those for {parent!r}")


def _widths(module: nn.Module) -> tuple[int, int]:
    """(inputs, outputs) of a linear (weight (out, in)) or a Conv1D (weight (in, out))."""
    rows, cols = module.weight.shape
    return (cols, rows) if _kind(module) == "linear" else (rows, cols)


def _check_unfused(path: str, members: list[str], owners, modules) -> None:
    """A column projection must not give more outputs than the widest row projection of its region
    takes: such an output is fused (GPT-2's c_attn and Phi-3's qkv_proj hold q|k|v one after another,
    Phi-3's gate_up_proj gate|up), and a contiguous column shard would hold whole q heads and no v (all
    gate, no up) instead of each rank's share of every piece. Grouped k and v are narrower, never wider."""
    rows = [m for m in members if owners[m][0].strategy in ("row", "row_sp")]
    width = _widths(modules[path])[1]
    widest = max((_widths(modules[r])[0] for r in rows), default=width)
    if width > widest:
        raise PlanError(f"module {path!r} ({type(modules[path]).__name__}, {width} outputs) is planned 'column' "
                        f"but the row projections of its region take at most {widest} inputs: its output "
                        f"is fused (q|k|v or gate|up one after another, as GPT-2's c_attn or Phi-3's "
                        f"qkv_proj), which a column split would cut across the pieces instead of giving "
                        f"each rank its share of every one; the module runtime runs it replicated: plan "
                        f"{path.rpartition('.')[0]!r} 'replicate'")


def _check_split(parent, members, owners, others, modules) -> None:
    inner = [p for p in modules if p.startswith(parent + ".") and p not in members
             and p in owners]  # not a core member (a per-head norm of the split core: `_core_members`)
    if inner:
        raise PlanError(f"module {parent!r} is tensor-parallel (column/row) but also holds "
                        f"parameters in {inner}, which the module runtime does not split inside "
                        f"a region yet; plan {parent!r} replicated")
    _check_all(parent, others, lambda o: o.strategy != "replicate",
               "on head / feature shards (the column projections' local outputs)")


def _check_all(parent: str, ops: list[OpPlacement], ok, what: str) -> None:
    bad = [o for o in ops if not ok(o)]
    if bad:
        o = bad[0]
        raise PlanError(f"module {parent!r}: op {o.node!r} (in {o.module!r}) runs {o.strategy!r} "
                        f"(output {o.resolved.output}), but its region's linears need every op "
                        f"inside it {what}; the module runtime converts layouts only at module "
                        f"boundaries: plan {parent!r} consistently")


def _loss(plan: Plan) -> str:
    """The strategy of the plan's cross-entropy op (by its captured name), else "vocab"."""
    for op in reversed(plan.ops):
        if "cross_entropy" in op.node or op.node.startswith("nll_loss"):
            return op.strategy if op.strategy in LOSS_STRATEGIES else "replicate"
    return "vocab"
