"""Pipeline stages of the user's own module, cut at block boundaries of its layer list, each run by
the model's own forward (`StageModule`).

A decoder-only model's forward runs, in order, the modules before its layer list (embeddings, and
any parameter-free code: positions, masks, rotary tables), the blocks of the list, and the modules
after it (final norm, head). Its pieces are the modules that hold parameters of their own outside
the list (`StageCut.pieces`); one probe forward (`cut_stages`) finds which run before the first
block (the prefix: on the first stage) and which after the last (the suffix: on the last stage),
and checks that the forward can be cut at every block boundary:

    every block runs once, in list order, and takes the previous block's output as its first
    argument, unchanged (nothing runs between blocks)
    the other inputs of a block (masks, position ids, rotary tables) need no parameter (do not
    require grad): every stage derives them itself from the token ids, by the same code
    a block returns one tensor; the first suffix module takes the last block's output
    no piece runs both before and after the blocks (a head tied to the embedding), or between them

Stage s of the plan holds blocks [a, b) (`StageSpec`; stage 0 the prefix, the last the suffix).
It runs the model's forward on the microbatch's token ids with every position of the model
(pieces and blocks) given, for the duration of the call (`StageCut.view`), the module this stage
needs there:

    prefix pieces        its own on the first stage; elsewhere a stand-in: an embedding gives
                         zeros (B, T, dim), any other module passes its input through
    blocks < a           pass their input through (the received activation replaces it at a)
    blocks [a, b)        its own; block a's first argument is replaced by the received activation
    block b (b < L)      raises `StageOutput` with its input: the stage's output
    suffix pieces        its own on the last stage (the first one takes the received activation
                         when the stage holds no block); elsewhere the first one called raises
                         `StageOutput` with its input (a stage ending at the last block)

so the code around the blocks (position ids, causal masks, rotary embeddings) is the model's own
and runs on every stage; only the pieces of other stages are missing. Under tp the activation
crosses a stage boundary as this rank's local tensor of placement `boundary` (the placement the
plan gives the blocks' input), and is wrapped back as a DTensor on arrival.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from dataclasses import dataclass, field

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from autoplan.errors import PlanError
from autoplan.plan import Plan


class StageOutput(Exception):
    """Raised inside the model's forward where this stage ends, carrying the activation."""

    def __init__(self, value: torch.Tensor) -> None:
        super().__init__("pipeline stage output")
        self.value = value


class Elsewhere(nn.Module):
    """Stand-in for a module that runs on another stage (module docstring): `role` is one of
    "zeros" (an embedding before this stage: zeros of its output), "pass" (its first input),
    "end" (raise `StageOutput` with its first input), "absent" (must not run here)."""

    def __init__(self, path: str, role: str, dim: int = 0, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.path, self.role, self.dim, self.dtype = path, role, dim, dtype

    @classmethod
    def of(cls, module: nn.Module, path: str, role: str) -> "Elsewhere":
        """A stand-in for `module` (itself a stand-in or not); "zeros" keeps an embedding's width and
        dtype, and becomes "pass" for any other module."""
        if isinstance(module, nn.Embedding):
            dim, dtype = module.embedding_dim, module.weight.dtype
        elif isinstance(module, Elsewhere):
            dim, dtype = module.dim, module.dtype
        else:
            dim, dtype = 0, None
        return cls(path, "pass" if role == "zeros" and not dim else role, dim, dtype)

    def forward(self, *args, **kwargs):
        first = args[0] if args else next(iter(kwargs.values()))
        if self.role == "zeros":
            return torch.zeros(*first.shape, self.dim, dtype=self.dtype, device=first.device)
        if self.role == "pass":
            return first
        if self.role == "end":
            raise StageOutput(first)
        raise RuntimeError(f"module {self.path!r} runs on another pipeline stage of this plan, not "
                           f"on this rank")

    def extra_repr(self) -> str:
        return f"{self.path!r} on another pipeline stage"


@dataclass(frozen=True)
class Position:
    """A place in the module tree: `parent._modules[name]` (the module found there at the cut)."""

    path: str
    parent: nn.Module
    name: str
    module: nn.Module

    def put(self, module: nn.Module) -> None:
        self.parent._modules[self.name] = module


@dataclass
class StageCut:
    """The model's cut points: its layer list's blocks, the pieces before and after them (in the
    order the forward calls them), and the layers of each global stage."""

    model: nn.Module
    blocks: list[Position]
    prefix: list[Position]
    suffix: list[Position]
    stages: list[tuple[int, int]]  # global stage index -> [first layer, last layer)
    param_names: list[str]  # the whole model's, in its order (before `prune`)
    state_names: list[str]  # its state_dict's keys
    _layouts: dict = field(default_factory=dict, repr=False)  # stage -> `_layout(stage)`

    @property
    def count(self) -> int:
        return len(self.stages)

    def held(self, stage: int) -> list[Position]:
        """The positions whose own module stage `stage` runs."""
        a, b = self.stages[stage]
        return ((self.prefix if stage == 0 else []) + self.blocks[a:b]
                + (self.suffix if stage == self.count - 1 else []))

    def prune(self, stages: list[int]) -> None:
        """Keep only the modules of `stages` (this rank's) in the model; the others' positions get an
        `Elsewhere` stand-in, so their parameters are freed and the model's own names remain for
        the rest."""
        keep = {id(p.module) for s in stages for p in self.held(s)}

        def kept(position: Position) -> Position:
            if id(position.module) in keep:
                return position
            position.put(Elsewhere.of(position.module, position.path, "absent"))
            return dataclasses.replace(position, module=position.parent._modules[position.name])
        self.blocks, self.prefix, self.suffix = ([kept(p) for p in group]
                                                 for group in (self.blocks, self.prefix, self.suffix))
        self._layouts.clear()

    def held_blocks(self) -> list[nn.Module | None]:
        """The layer list's blocks in layer order (block i is the plan's layer i), None where another
        pipeline rank holds the layer (after `prune`: its stand-in)."""
        return [None if isinstance(p.module, Elsewhere) else p.module for p in self.blocks]

    def _layout(self, stage: int) -> list[tuple[Position, nn.Module]]:
        """What each position runs during stage `stage`'s forward (module docstring); made once."""
        if stage not in self._layouts:
            self._layouts[stage] = self._make_layout(stage)
        return self._layouts[stage]

    def _make_layout(self, stage: int) -> list[tuple[Position, nn.Module]]:
        stand_in = lambda p, role: Elsewhere.of(p.module, p.path, role)  # noqa: E731
        a, b = self.stages[stage]
        first, last = stage == 0, stage == self.count - 1
        found = [(p, p.module if first else stand_in(p, "zeros")) for p in self.prefix]
        for i, p in enumerate(self.blocks):
            role = "pass" if i < a else "end" if i == b else "absent"
            found.append((p, p.module if a <= i < b else stand_in(p, role)))
        found += [(p, p.module if last else stand_in(p, "end" if i == 0 else "absent"))
                  for i, p in enumerate(self.suffix)]
        return found

    @contextlib.contextmanager
    def view(self, stage: int, received: torch.Tensor | None):
        """The model arranged for stage `stage` (module docstring); restored on exit. `received`:
        the activation from the previous stage (None on the first)."""
        before = [(p, p.parent._modules[p.name]) for p in self.blocks + self.prefix + self.suffix]
        handle = None
        try:
            for position, module in self._layout(stage):
                position.put(module)
            if received is not None:
                a, b = self.stages[stage]
                entry = self.blocks[a].module if a < b else self.suffix[0].module
                handle = entry.register_forward_pre_hook(lambda _m, args: (received, *args[1:]))
            yield
        finally:
            if handle is not None:
                handle.remove()
            for position, module in before:
                position.put(module)


def layer_list(model: nn.Module, num_layers: int) -> tuple[str, nn.ModuleList]:
    """The model's layer list: its first nn.ModuleList (in module order) whose members hold
    parameters, whatever it is called; it must have the plan's number of layers."""
    for path, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) and all(
                any(True for _ in m.parameters()) for m in module):
            if len(module) != num_layers:
                raise PlanError(f"the model's layer list {path!r} has {len(module)} blocks but the plan "
                                f"has {num_layers} layers: the plan was made for another model")
            return path, module
    raise PlanError(f"{type(model).__name__} has no nn.ModuleList of blocks with parameters: pipeline "
                    f"parallelism cuts the model between the blocks of its layer list; plan pp=1")


def _positions(model: nn.Module, list_path: str) -> tuple[list[Position], list[Position]]:
    """(the blocks, the pieces: modules outside the list holding parameters of their own)."""
    modules = dict(model.named_modules())
    blocks = [Position(f"{list_path}.{name}", modules[list_path], name, m)
              for name, m in modules[list_path]._modules.items()]
    pieces = []
    for path, module in modules.items():
        inside = path == list_path or path.startswith(list_path + ".")
        if path and not inside and any(True for _ in module.parameters(recurse=False)):
            parent, _, name = path.rpartition(".")
            pieces.append(Position(path, modules[parent], name, module))
    if any(True for _ in model.parameters(recurse=False)):
        raise PlanError(f"{type(model).__name__} holds parameters of its own at the root "
                        f"({[n for n, _ in model.named_parameters(recurse=False)][:3]}); pipeline "
                        f"stages place modules: move them into a submodule, or plan pp=1")
    return blocks, pieces


# torch's words for a tensor that is not the shape or kind the code expected (DTensor mixing, a view of a shard)
_LAYOUT_FAILURE = re.compile(r"DTensor|shape|size|dimension")


def _failing_module(model: nn.Module, exc: BaseException) -> tuple[str, str] | None:
    """(path, class) of the innermost module of `model` whose own forward code was running when `exc`
    was raised (the last traceback frame whose `self` is one of its modules), or None."""
    names = {id(m): path for path, m in model.named_modules()}
    found, tb = None, exc.__traceback__
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if isinstance(owner, nn.Module) and id(owner) in names:
            found = (names[id(owner)] or "<root>", type(owner).__name__)
        tb = tb.tb_next
    return found


def run_model(model: nn.Module, tokens: torch.Tensor, positions: torch.Tensor | None = None):
    """The model's logits for (B, T) token ids: a transformers model called with input_ids and
    use_cache=False (its output's .logits), and with `positions` as its position_ids when given
    (context parallelism: a chunk of the sequence); any other module with the ids alone."""
    hf = hasattr(getattr(model, "config", None), "use_cache")
    given = {} if positions is None else {"position_ids": positions}
    try:
        out = model(input_ids=tokens, use_cache=False, **given) if hf else model(tokens)
    except RuntimeError as exc:
        module = _failing_module(model, exc) if _LAYOUT_FAILURE.search(str(exc)) else None
        if module is None:
            raise
        raise PlanError(f"{type(model).__name__}'s forward failed in module {module[0]!r} ({module[1]}) under "
                        f"this plan: {str(exc).splitlines()[0]}. Its code does not run on the shards the plan "
                        f"gives it (a head count or width of its own, a plain tensor meeting a DTensor): plan "
                        f"{module[0]!r} (or the region around it) replicated") from exc
    out = getattr(out, "logits", out)
    return out[0] if isinstance(out, (tuple, list)) else out


def cut_stages(model: nn.Module, plan: Plan) -> StageCut:
    """The plan's stages on `model` (module docstring), found and checked by one probe forward;
    PlanError naming the module where the forward cannot be cut."""
    list_path, _ = layer_list(model, plan.model.num_layers)
    blocks, pieces = _positions(model, list_path)
    calls, outputs = _probe(model, blocks, pieces, plan.seq_len)
    _check_blocks(blocks, calls, outputs)
    order = [kind for kind, _, _, _ in calls]
    first, last = order.index("block"), len(order) - 1 - order[::-1].index("block")
    prefix, suffix = [], []
    for i, (kind, index, args, _) in enumerate(calls):
        if kind == "block":
            continue
        piece = pieces[index]
        if piece in prefix or piece in suffix:
            raise PlanError(f"module {piece.path!r} runs more than once in the forward; a pipeline "
                            f"places each module on one stage: plan pp=1")
        if first < i < last:
            raise PlanError(f"module {piece.path!r} runs between the blocks of {list_path!r}; a "
                            f"pipeline cuts the forward only between blocks: plan pp=1")
        (prefix if i < first else suffix).append(piece)
        _check_piece(piece, args, outputs[("piece", index)], i < first, outputs[("block", len(blocks) - 1)],
                     first_suffix=i > last and len(suffix) == 1)
    suffix += [p for p in pieces if p not in prefix + suffix]  # never called: kept by the last stage
    ordered = sorted(plan.stages, key=lambda s: (s.chunk, s.stage))
    cut = StageCut(model, blocks, prefix, suffix, [(s.first_layer, s.last_layer) for s in ordered],
                   [n for n, _ in model.named_parameters()], list(model.state_dict()))
    _check_tied(cut)
    return cut


def _probe(model: nn.Module, blocks: list[Position], pieces: list[Position], seq_len: int):
    """One forward on a (1, seq_len) batch of fake tensors, recording every call of a block
    or piece in order: [(kind, index, args, kwargs)], {(kind, index): output}."""
    calls, outputs, handles = [], {}, []
    for kind, positions in (("block", blocks), ("piece", pieces)):
        for i, p in enumerate(positions):
            handles.append(p.module.register_forward_pre_hook(
                lambda _m, args, kwargs, key=(kind, i): calls.append((*key, args, kwargs)), with_kwargs=True))
            handles.append(p.module.register_forward_hook(
                lambda _m, _a, out, key=(kind, i): outputs.setdefault(key, out)))
    device = next(model.parameters()).device
    try:  # on fake tensors: no memory, no compute, whether the model has weights or is on meta
        with FakeTensorMode(allow_non_fake_inputs=True), torch.enable_grad(), _batched_experts(model):
            run_model(model, torch.zeros(1, seq_len, dtype=torch.long, device=device))
    finally:
        for h in handles:
            h.remove()
    return calls, outputs


@contextlib.contextmanager
def _batched_experts(model: nn.Module):
    """transformers' fused MoE experts run as "batched_mm" instead of "grouped_mm" for the call: torch's
    fake kernel of _grouped_mm takes bf16 only (the CPU and CUDA kernels take float32 too), and the probe
    needs only the shapes, which both give."""
    configs = {id(c): c for m in model.modules() if (c := getattr(m, "config", None)) is not None
               and getattr(c, "_experts_implementation", None) == "grouped_mm"}
    for c in configs.values():
        c._experts_implementation = "batched_mm"
    try:
        yield
    finally:
        for c in configs.values():
            c._experts_implementation = "grouped_mm"


def _check_blocks(blocks: list[Position], calls: list, outputs: dict) -> None:
    """Every block once, in order, chained by its first argument; other inputs parameter-free."""
    found = [(i, args, kwargs) for kind, i, args, kwargs in calls if kind == "block"]
    if [i for i, _, _ in found] != list(range(len(blocks))):
        raise PlanError(f"the forward runs the blocks of the layer list in the order "
                        f"{[i for i, _, _ in found][:8]}, not each once in list order; a pipeline "
                        f"cuts a forward that runs them so: plan pp=1")
    for i, args, kwargs in found:
        path = blocks[i].path
        if not args or not isinstance(args[0], torch.Tensor):
            raise PlanError(f"block {path!r} is called without its hidden state as first positional "
                            f"argument; a pipeline stage passes it the previous stage's activation there")
        if i > 0 and args[0] is not outputs[("block", i - 1)]:
            raise PlanError(f"block {path!r} does not take the previous block's output unchanged: the "
                            f"forward computes something between blocks, which a pipeline cannot cut")
        if not isinstance(outputs[("block", i)], torch.Tensor):
            raise PlanError(f"block {path!r} returns {type(outputs[('block', i)]).__name__}, not one "
                            f"tensor; a pipeline stage sends one activation to the next")
        extra = [*args[1:], *kwargs.values()]
        extra = [t for v in extra for t in (v if isinstance(v, (tuple, list)) else (v,))]
        if any(isinstance(t, torch.Tensor) and t.requires_grad for t in extra):
            raise PlanError(f"block {path!r} takes inputs besides its hidden state that are computed "
                            f"from parameters (they require grad); a pipeline stage derives only "
                            f"parameter-free inputs (masks, positions) itself: plan pp=1")


def _check_piece(position: Position, args: tuple, output, in_prefix: bool, last_block, first_suffix: bool) -> None:
    """A prefix piece other than an embedding keeps its input's shape (a stand-in passes it
    through); the first suffix piece takes the last block's output."""
    if in_prefix and not isinstance(position.module, nn.Embedding) and (
            not args or getattr(args[0], "shape", None) != getattr(output, "shape", None)):
        raise PlanError(f"module {position.path!r} ({type(position.module).__name__}) runs before the "
                        f"blocks and changes the shape of its input; a later pipeline stage stands it in "
                        f"by passing its input through: plan pp=1")
    if first_suffix and (not args or args[0] is not last_block):
        raise PlanError(f"module {position.path!r}, the first after the blocks, does not take the last "
                        f"block's output unchanged; a pipeline cannot cut the forward there: plan pp=1")


def _check_tied(cut: StageCut) -> None:
    """No parameter in the modules of two stages."""
    owner: dict[int, tuple[int, str]] = {}
    for stage in range(cut.count):
        for position in cut.held(stage):
            for name, p in position.module.named_parameters():
                seen = owner.setdefault(id(p), (stage, f"{position.path}.{name}"))
                if seen[0] != stage:
                    raise PlanError(f"parameters {seen[1]!r} (stage {seen[0]}) and "
                                    f"'{position.path}.{name}' (stage {stage}) are tied (one tensor); "
                                    f"pipeline stages hold their own: untie them (transformers: "
                                    f"tie_word_embeddings=False) or plan pp=1")
