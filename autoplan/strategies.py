"""Sharding strategies of each op kind on the tensor-parallel mesh axis.

A `Strategy` is one way to run an op over the `tp` ranks: the placement it needs for each tensor
input, the placement of its output, the placement of each of its parameters, the share of the op's
FLOPs each rank does, and the collectives the op itself issues. It is the contract between the
planner (which prices strategies and picks one per op) and the runtime (which executes the pick).

Activations are (B, T, F) with B the batch (sharded on the `dp` axis, never on `tp`), T the
sequence and F the features, so on `tp` an activation is `R`, `S(1)` (sequence parallel) or `S(2)`
(features, heads or vocabulary).

Gradients: an input marked `grad_partial` receives, on each rank, only a partial sum of its gradient
(a column-parallel matmul splits the reduction in x.grad = dy @ W); whatever produces that input
must sum it over tp in backward (Megatron's `f`, or a reduce-scatter after a sequence all-gather).
A parameter marked `grad_partial` is replicated but used on a shard of the activations (sequence
parallel norms), so its gradient is summed over tp in backward.

The registry is an explicit object: `default_registry()` builds a fresh one; nothing registers at
import time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Mapping

from autoplan.errors import ConfigError
from autoplan.placement import Placement, Replicate, Shard

if TYPE_CHECKING:  # capture imports torch; this module stays importable without it
    from autoplan.capture import NodeInfo

R = Replicate()
SEQ = Shard(1)
FEAT = Shard(2)

# A MoE op's expert weights, by the last part of their name: dim 0 is the expert, and the value is the
# dim holding the expert's FFN width (what the "ffn" strategy splits). The zoo's MoEFeedForward:
# w_gate, w_up (E, h, f), w_down (E, f, h); transformers' fused experts (Mixtral, Qwen2-MoE in
# transformers 5): gate_up_proj (E, 2f, h) with gate rows then up rows, down_proj (E, h, f).
EXPERT_FFN_DIMS = {"w_gate": 2, "w_up": 2, "w_down": 1, "gate_up_proj": 1, "down_proj": 2}
EXPERT_WEIGHTS = tuple(EXPERT_FFN_DIMS)

# Collective kinds a strategy may issue, as named in cost_model.comm and runtime.collectives.
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


@dataclass(frozen=True)
class Comm:
    """A collective over the tp group on `tensor`: "output", "input:<i>", "params", "param:<name>"
    or "stats".

    Sizes are the FULL (unsharded over tp) tensor's bytes; "params" means every parameter of the op,
    "param:<name>" one of them (named relative to the op's module, e.g. "router.weight"), "stats"
    the three per-token fp32 statistics of vocabulary-parallel cross-entropy.
    """

    kind: str
    tensor: str


@dataclass(frozen=True)
class InputSpec:
    placement: Placement
    grad_partial: bool = False


@dataclass(frozen=True)
class ParamSpec:
    name: str  # relative to the op's module, e.g. "weight", "router.weight", "w_gate"
    placement: Placement
    grad_partial: bool = False


@dataclass(frozen=True)
class Strategy:
    name: str
    inputs: tuple[InputSpec, ...]
    output: Placement
    params: tuple[ParamSpec, ...] = ()
    compute_fraction: float = 1.0  # of the op's FLOPs and bytes, per tp rank
    expert_ffn_split: int = 1  # MoE "expert": how many ranks split each expert's FFN (etp)
    fwd_comm: tuple[Comm, ...] = ()
    bwd_comm: tuple[Comm, ...] = ()

    def param_placement(self, name: str) -> Placement:
        for spec in self.params:
            if spec.name == name:
                return spec.placement
        return R


StrategyFn = Callable[["NodeInfo", int, dict], list[Strategy]]


class StrategyRegistry:
    """Maps an op kind to a function (node, tp degree, model info) -> its valid strategies.

    Kinds without a registered rule get the single replicated strategy, and `uncovered` records the
    node so the plan can say which ops were left replicated.
    """

    def __init__(self) -> None:
        self._rules: dict[str, StrategyFn] = {}

    def register(self, op_kind: str, rule: StrategyFn) -> None:
        self._rules[op_kind] = rule

    def kinds(self) -> list[str]:
        return sorted(self._rules)

    def has_rule(self, op_kind: str) -> bool:
        return op_kind in self._rules

    def strategies(self, node: "NodeInfo", tp: int, info: dict | None = None) -> list[Strategy]:
        """Valid strategies of `node` on a tp axis of degree `tp` ("replicate" is always first, but
        for a MoE under etp < tp, whose one strategy is "expert")."""
        rule = self._rules.get(node.op_kind, replicate_only)
        found = rule(node, tp, info or {})
        return found if tp > 1 else found[:1]

    def strategy(self, node: "NodeInfo", tp: int, name: str, info: dict | None = None) -> Strategy:
        for strategy in self.strategies(node, tp, info):
            if strategy.name == name:
                return strategy
        valid = [s.name for s in self.strategies(node, tp, info)]
        raise KeyError(f"node {node.name!r} ({node.op_kind}) has no strategy {name!r} at tp={tp}; valid: {valid}")


def default_registry() -> StrategyRegistry:
    registry = StrategyRegistry()
    registry.register("placeholder", replicate_only)
    registry.register("output", replicate_only)
    registry.register("other", replicate_only)
    registry.register("linear", linear_strategies)
    registry.register("embedding", embedding_strategies)
    registry.register("norm", norm_strategies)
    registry.register("elementwise", elementwise_strategies)
    registry.register("attention", attention_strategies)
    registry.register("cross_entropy", cross_entropy_strategies)
    registry.register("moe", moe_strategies)
    return registry


# ---------------------------------------------------------------------------------------- rules


def divides(tp: int, size: int) -> bool:
    """Whether `tp` ranks split a dim of `size` evenly (the strategy rules' shard test)."""
    return size % tp == 0


def is_expert_weight(name: str) -> bool:
    """Whether parameter `name` (of a "moe" op) is an expert weight (`EXPERT_FFN_DIMS`)."""
    return name.rsplit(".", 1)[-1] in EXPERT_FFN_DIMS


def expert_dims(node: "NodeInfo") -> tuple[int, int, int] | None:
    """(experts E, width h, FFN width f) of a "moe" op from its expert weights' shapes, in either
    layout of `EXPERT_FFN_DIMS`; None when it has no 3-D expert weight."""
    shapes = {name.rsplit(".", 1)[-1]: meta.shape for name, meta in node.params}
    if len(shapes.get("w_gate", ())) == 3:
        return tuple(shapes["w_gate"])
    if len(shapes.get("down_proj", ())) == 3:
        experts, width, ffn = shapes["down_proj"]
        return experts, width, ffn
    return None


def _params(node: "NodeInfo") -> list[str]:
    prefix = node.module_path + "." if node.module_path else ""
    return [name[len(prefix):] if name.startswith(prefix) else name for name, _ in node.params]


def replicate_only(node: "NodeInfo", tp: int, info: dict) -> list[Strategy]:
    """Every rank runs the whole op on whole tensors."""
    inputs = tuple(InputSpec(R) for _ in node.inputs)
    return [Strategy("replicate", inputs, R, tuple(ParamSpec(p, R) for p in _params(node)))]


def linear_strategies(node: "NodeInfo", tp: int, info: dict) -> list[Strategy]:
    """y = x W^T + b, x (B, T, in), W (out, in).

    column: W split on out -> y split on features; x.grad is partial (Megatron's f).
    row:    W split on in, x split on features -> partial y, all-reduced (Megatron's g), bias after.
    row_sp: as row, but reduce-scattered along the sequence (sequence parallelism); the bias then
            meets only local tokens, so the op sums its (tiny, unpriced) grad over tp itself.
    sequence: x split on the sequence, W replicated, W.grad summed over tp.
    """
    (x,) = node.input_metas[:1]
    out_f, in_f, seq = node.output.shape[-1], x.shape[-1], x.shape[1]
    names = _params(node)
    has_bias = "bias" in names
    found = replicate_only(node, tp, info)
    if divides(tp, out_f):
        params = (ParamSpec("weight", Shard(0)),) + ((ParamSpec("bias", Shard(0)),) if has_bias else ())
        found.append(Strategy("column", (InputSpec(R, grad_partial=True),), FEAT, params, 1 / tp))
    if divides(tp, in_f):
        params = (ParamSpec("weight", Shard(1)),) + ((ParamSpec("bias", R),) if has_bias else ())
        found.append(Strategy("row", (InputSpec(FEAT),), R, params, 1 / tp, fwd_comm=(Comm("all_reduce", "output"),)))
        if divides(tp, seq):
            found.append(Strategy("row_sp", (InputSpec(FEAT),), SEQ, params, 1 / tp,
                                  fwd_comm=(Comm("reduce_scatter", "output"),), bwd_comm=(Comm("all_gather", "output"),)))
    if divides(tp, seq):
        params = tuple(ParamSpec(p, R, grad_partial=True) for p in names)
        found.append(Strategy("sequence", (InputSpec(SEQ),), SEQ, params, 1 / tp, bwd_comm=(Comm("all_reduce", "params"),)))
    return found


def embedding_strategies(node: "NodeInfo", tp: int, info: dict) -> list[Strategy]:
    """out = W[idx], W (V, H), idx (B, T).

    vocab:    W split on rows; each rank looks up the ids it owns, zeros elsewhere, then all-reduce.
    vocab_sp: as vocab, reduce-scattered along the sequence.
    hidden:   W split on columns -> output split on features, no communication.
    """
    vocab, hidden = node.params[0][1].shape
    seq = node.input_metas[0].shape[1]
    idx = (InputSpec(R),)
    found = replicate_only(node, tp, info)
    if divides(tp, vocab):
        found.append(Strategy("vocab", idx, R, (ParamSpec("weight", Shard(0)),), 1 / tp,
                              fwd_comm=(Comm("all_reduce", "output"),)))
        if divides(tp, seq):
            found.append(Strategy("vocab_sp", idx, SEQ, (ParamSpec("weight", Shard(0)),), 1 / tp,
                                  fwd_comm=(Comm("reduce_scatter", "output"),), bwd_comm=(Comm("all_gather", "output"),)))
    if divides(tp, hidden):
        found.append(Strategy("hidden", idx, FEAT, (ParamSpec("weight", Shard(1)),), 1 / tp))
    return found


def norm_strategies(node: "NodeInfo", tp: int, info: dict) -> list[Strategy]:
    """LayerNorm / RMSNorm over the features: replicated, or on a sequence shard (weights' grads summed)."""
    found = replicate_only(node, tp, info)
    if divides(tp, node.input_metas[0].shape[1]):
        params = tuple(ParamSpec(p, R, grad_partial=True) for p in _params(node))
        bwd = (Comm("all_reduce", "params"),) if params else ()
        found.append(Strategy("sequence", (InputSpec(SEQ),), SEQ, params, 1 / tp, bwd_comm=bwd))
    return found


def elementwise_strategies(node: "NodeInfo", tp: int, info: dict) -> list[Strategy]:
    """Pointwise ops keep any placement their inputs share (inputs must have the output's shape)."""
    found = replicate_only(node, tp, info)
    out = node.output
    if out is None or len(out.shape) != 3 or any(m.shape != out.shape for m in node.input_metas):
        return found
    for name, placement in (("sequence", SEQ), ("features", FEAT)):
        if divides(tp, out.shape[placement.dim]):
            inputs = tuple(InputSpec(placement) for _ in node.inputs)
            found.append(Strategy(name, inputs, placement, (), 1 / tp))
    return found


def attention_strategies(node: "NodeInfo", tp: int, info: dict) -> list[Strategy]:
    """Causal attention core on (B, T, heads*hd): split on heads (q and kv heads both divisible)."""
    found = replicate_only(node, tp, info)
    head_dim = info.get("head_dim")
    if head_dim is None:
        return found
    q_heads = node.input_metas[0].shape[-1] // head_dim
    kv_heads = node.input_metas[1].shape[-1] // head_dim
    if divides(tp, q_heads) and divides(tp, kv_heads):
        inputs = tuple(InputSpec(FEAT) for _ in node.inputs)
        found.append(Strategy("heads", inputs, FEAT, (), 1 / tp))
    return found


def cross_entropy_strategies(node: "NodeInfo", tp: int, info: dict) -> list[Strategy]:
    """Mean token cross-entropy of logits (B, T, V) against targets (B, T).

    vocab:    logits split on the vocabulary; max, sum-exp and target logit all-reduced per token.
    sequence: logits and targets split along the sequence; the partial loss sums all-reduced.
    """
    found = replicate_only(node, tp, info)
    logits = node.input_metas[0]
    if divides(tp, logits.shape[2]):
        found.append(Strategy("vocab", (InputSpec(FEAT), InputSpec(R)), R, (), 1 / tp,
                              fwd_comm=(Comm("all_reduce", "stats"),)))
    if divides(tp, logits.shape[1]):
        found.append(Strategy("sequence", (InputSpec(SEQ), InputSpec(SEQ)), R, (), 1 / tp,
                              fwd_comm=(Comm("all_reduce", "output"),)))
    return found


def moe_strategies(node: "NodeInfo", tp: int, info: dict) -> list[Strategy]:
    """Mixture of experts, x (B, T, H) -> (B, T, H), with `info["etp"]` the expert tensor-parallel
    degree (`autoplan.mesh`; absent: tp).

    etp = tp:
    ffn:      every expert's FFN split Megatron-style on the hidden FFN dim; the router runs
              replicated; output all-reduced, the experts' part of x.grad all-reduced in backward
              (with the small (tokens, top_k) gate-weight grads, which the op sums itself).
    sequence: tokens split along the sequence, weights replicated, weight grads summed over tp.
    etp < tp, the only strategy (replicating the layer would leave idle the tp ranks that
    etp < tp gives the experts):
    expert:   tokens split along the sequence (so R -> S(1) slices them and all-gathers their
              grads, S(1) -> R all-gathers the output), experts split over tp on dim 0: each group
              of etp tp ranks holds E / (tp / etp) of them (per ep rank) and serves them to the
              expert group ep x tp / etp (runtime.experts), each of those etp ranks 1/etp of every
              expert's FFN (`expert_ffn_split`; the plan's per-axis placements say S(0) on tp, the
              bytes per rank, and the mesh's etp says how the two levels split); the router
              replicated, its grad summed over tp.
    """
    etp = info.get("etp", tp)
    if etp < tp:
        return [_expert_folded(node, tp, etp)]
    found = replicate_only(node, tp, info)
    names = _params(node)
    ffn_hidden = info.get("ffn_hidden")
    if ffn_hidden and divides(tp, ffn_hidden):
        params = tuple(ParamSpec(p, Shard(EXPERT_FFN_DIMS[p.rsplit(".", 1)[-1]]) if is_expert_weight(p) else R)
                       for p in names)
        found.append(Strategy("ffn", (InputSpec(R),), R, params, 1 / tp,
                              fwd_comm=(Comm("all_reduce", "output"),), bwd_comm=(Comm("all_reduce", "input:0"),)))
    if divides(tp, node.input_metas[0].shape[1]):
        params = tuple(ParamSpec(p, R, grad_partial=True) for p in names)
        found.append(Strategy("sequence", (InputSpec(SEQ),), SEQ, params, 1 / tp, bwd_comm=(Comm("all_reduce", "params"),)))
    return found


def _expert_folded(node: "NodeInfo", tp: int, etp: int = 1) -> Strategy:
    """The MoE strategy of etp < tp (`moe_strategies`)."""
    tokens = node.input_metas[0].shape[1]
    if not divides(tp, tokens):
        raise ConfigError(f"node {node.name!r}: etp={etp} splits the MoE's {tokens} tokens per sequence over tp={tp}, "
                          f"which does not divide them; use a sequence divisible by tp x cp, or etp={tp}")
    params = tuple(ParamSpec(p, Shard(0) if is_expert_weight(p) else R, grad_partial=not is_expert_weight(p))
                   for p in _params(node))
    return Strategy("expert", (InputSpec(SEQ),), SEQ, params, 1 / tp,
                    bwd_comm=tuple(Comm("all_reduce", f"param:{p.name}") for p in params if p.grad_partial),
                    expert_ffn_split=etp)


def strategy_info(info: Mapping, tp: int, etp: int) -> dict:
    """`info` for the rules at this tp with expert tensor-parallel degree `etp` (`moe_strategies`)."""
    return {**info, "etp": etp} if etp != tp else dict(info)
