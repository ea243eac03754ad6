"""Strategy rules for the graphs of `autoplan.capture.hf`: views, broadcasting pointwise ops, and
linears whose weights are not nn.Linear's.

`hf_registry()` is `default_registry()` plus:

    view         reshape / permute[p] / expand / slice[d] / select[d] / split[d] / cat[d] / copy
                 keep a shard of the output on the input dim that carries it (below); so the
                 (B, T, H*d) <-> (B, T, H, d) views and token flattening of HF blocks keep heads,
                 features or tokens sharded instead of forcing replication.
    elementwise  any rank, with broadcasting: an input of the output's size on the split dim is split
                 with it; an input broadcast along it is read whole and its gradient is a partial
                 sum (`InputSpec.grad_partial`); parameters likewise (`ParamSpec.grad_partial`).
                 On (B, T, F) inputs of the output's shape this is the default rule.
    attention    the default rule (split on heads); a core holding per-head q / k norm weights (Qwen3,
                 Gemma 3: `autoplan.capture.hf_attention`) keeps them whole on every tp rank, their
                 gradients partial sums all-reduced over tp in backward. A multi-head latent attention
                 core (DeepSeek) splits on its H heads: q and the expanded latent on features (their
                 producers q_proj / q_b_proj and kv_b_proj column-parallel), the rotary key all heads
                 share read whole, its gradient a partial sum over the rank's heads (all-reduced).
    linear       nn.Linear (weight (out, in)) as the default rule; GPT-2's Conv1D (weight (in, out),
                 target "linear_in_out") and MoE expert weights (experts, out, in) ("grouped_linear",
                 or (experts, in, out) "grouped_linear_in_out") split on their own out / in dims.

Which input dim carries output dim d:

    reshape   the input dim a with prod(in[:a]) == prod(out[:d]) and in[a] > 1: both tensors are then
              cut into the same contiguous blocks (DTensor's view rule, on shapes only);
    permute   a = p[d];   expand: a = d - (rank(out) - rank(in)), broadcast dims read whole;
    slice     a = d, not the sliced dim;   select[s]: a = d, or d + 1 past s;   cat[s]: a = d != s;
    split     a = d, the split dim included: a column-parallel producer of a fused tensor (GPT-2's
              c_attn q|k|v, MoE gate|up) is assumed laid out per rank, as Megatron-LM lays out its
              fused QKV weight, so each rank's shard of the whole holds its shard of every piece.

Strategy names: a shard on dim 1 is "sequence", on the last dim "features", else "dim<d>". Dim 0
is the batch (the dp axis), never split on tp. Nothing registers at import time.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import TYPE_CHECKING, Callable

from autoplan.capture.hf_attention import LATENT_ATTENTION, latent_heads
from autoplan.placement import Placement, Replicate, Shard
from autoplan.strategies import (Comm, InputSpec, ParamSpec, Strategy, StrategyRegistry, attention_strategies,
                                 default_registry, divides, elementwise_strategies, linear_strategies, replicate_only)

if TYPE_CHECKING:
    from autoplan.capture import NodeInfo, TensorMeta

R = Replicate()
FLOAT_DTYPES = ("bfloat16", "float16", "float32", "float64")
InputMap = Callable[[int], "tuple[InputSpec, ...] | None"]  # output dim -> the inputs' specs, or None


def hf_registry() -> StrategyRegistry:
    """The default rules plus the view, broadcasting elementwise and weight-layout-aware linear rules."""
    registry = default_registry()
    registry.register("view", view_strategies)
    registry.register("elementwise", broadcast_elementwise_strategies)
    registry.register("linear", hf_linear_strategies)
    registry.register("attention", hf_attention_strategies)
    return registry


# ---------------------------------------------------------------------------------- helpers


def _relative(node: "NodeInfo", name: str) -> str:
    prefix = node.module_path + "." if node.module_path else ""
    return name[len(prefix):] if name.startswith(prefix) else name


def _strategy_name(rank: int, d: int) -> str:
    return "sequence" if d == 1 else "features" if d == rank - 1 else f"dim{d}"


def _sharded(node: "NodeInfo", tp: int, info: dict, mapping: InputMap,
             params: Callable[[int], tuple[ParamSpec, ...] | None] = lambda d: ()) -> list[Strategy]:
    """Replicate, plus one strategy per output dim d >= 1 that tp divides and `mapping` can keep."""
    found = replicate_only(node, tp, info)
    out = node.output
    if out is None or len(out.shape) < 2 or tp == 1:
        return found
    for d in range(1, len(out.shape)):
        if not divides(tp, out.shape[d]):
            continue
        specs, param_specs = mapping(d), params(d)
        if specs is None or param_specs is None or len(specs) != len(node.inputs):
            continue
        found.append(Strategy(_strategy_name(len(out.shape), d), specs, Shard(d), param_specs, 1 / tp))
    return found


def _broadcast_spec(meta: "TensorMeta", out: "TensorMeta", d: int, tp: int) -> Placement | None:
    """Shard(a) when `meta` (aligned right) has the output's size on d; R when broadcast along d (each
    rank reads it whole, its gradient is a partial sum); None when neither."""
    a = d - (len(out.shape) - len(meta.shape))
    if a < 0 or meta.shape[a] == 1:
        return R
    if meta.shape[a] == out.shape[d] and divides(tp, meta.shape[a]):
        return Shard(a)
    return None


# ---------------------------------------------------------------------------------- attention


def hf_attention_strategies(node: "NodeInfo", tp: int, info: dict) -> list[Strategy]:
    """The default attention rule; per-head norm weights of the core whole on every rank under a split,
    their gradients partial sums over the heads each rank holds (module docstring)."""
    found = latent_attention_strategies(node, tp, info) if node.target == LATENT_ATTENTION \
        else attention_strategies(node, tp, info)
    if not node.params:
        return found
    params = tuple(ParamSpec(_relative(node, name), R, grad_partial=True) for name, _ in node.params)
    return [s if s.name == "replicate" else
            dataclasses.replace(s, params=params, bwd_comm=s.bwd_comm + (Comm("all_reduce", "params"),))
            for s in found]


def latent_attention_strategies(node: "NodeInfo", tp: int, info: dict) -> list[Strategy]:
    """A multi-head latent attention core, inputs (q, expanded latent, shared rotary key): replicated, or
    split on its heads where tp divides them (module docstring)."""
    found = replicate_only(node, tp, info)
    widths = [m.shape[-1] for m in node.input_metas]
    heads = latent_heads(*widths[:2], node.output.shape[-1], widths[2]) if len(widths) == 3 else None
    if heads is not None and divides(tp, heads):
        inputs = (InputSpec(Shard(2)), InputSpec(Shard(2)), InputSpec(R, grad_partial=True))
        found.append(Strategy("heads", inputs, Shard(2), (), 1 / tp))
    return found


# ---------------------------------------------------------------------------------- elementwise


def broadcast_elementwise_strategies(node: "NodeInfo", tp: int, info: dict) -> list[Strategy]:
    """Pointwise ops of any rank with broadcasting (module docstring); the default rule on
    same-shape (B, T, F) inputs without parameters."""
    out = node.output
    if out is None:
        return replicate_only(node, tp, info)
    if not node.params and len(out.shape) == 3 and all(m.shape == out.shape for m in node.input_metas):
        return elementwise_strategies(node, tp, info)

    def mapping(d: int):
        specs = []
        for meta in node.input_metas:
            place = _broadcast_spec(meta, out, d, tp)
            if place is None:
                return None
            specs.append(InputSpec(R, grad_partial=meta.dtype in FLOAT_DTYPES) if place == R else InputSpec(place))
        return tuple(specs)

    def params(d: int):
        specs = []
        for name, meta in node.params:
            place = _broadcast_spec(meta, out, d, tp)
            if place is None:
                return None
            specs.append(ParamSpec(_relative(node, name), place, grad_partial=place == R))
        return tuple(specs)

    return _sharded(node, tp, info, mapping, params)


# ---------------------------------------------------------------------------------- views


def _dims(target: str) -> list[int] | None:
    match = re.search(r"\[([-\d,]+)\]$", target)
    return [int(x) for x in match.group(1).split(",")] if match else None


def reshape_source_dim(in_shape: tuple[int, ...], out_shape: tuple[int, ...], d: int) -> int | None:
    """The input dim that carries a shard of output dim d through a reshape (module docstring)."""
    prefix = math.prod(out_shape[:d])
    for a in range(len(in_shape)):
        if math.prod(in_shape[:a]) == prefix and in_shape[a] > 1:
            return a
    return None


def _view_source(node: "NodeInfo", d: int) -> int | None:
    """The dim of input 0 that carries output dim d (module docstring), or None."""
    kind, dims = node.target.split("[")[0], _dims(node.target)
    x, out = node.input_metas[0].shape, node.output.shape
    if kind == "copy":
        return d if x == out else None
    if kind == "reshape":
        return reshape_source_dim(x, out, d)
    if kind == "expand":
        a = d - (len(out) - len(x))
        return a if a >= 0 and x[a] == out[d] else -1  # -1: read whole (broadcast)
    if dims is None:
        return None
    if kind == "permute":
        return dims[d] if len(dims) == len(out) else None
    if kind == "select":  # one dim fewer, unless the recorded layout kept it (nn.MultiheadAttention's q|k|v)
        return (d if d < dims[0] else d + 1) if len(out) == len(x) - 1 else None
    if kind == "slice":
        return d if d != dims[0] else None
    if kind == "split":
        return d
    return None


def view_strategies(node: "NodeInfo", tp: int, info: dict) -> list[Strategy]:
    """Shape ops keep a shard on the input dim that carries it (module docstring)."""
    if node.output is None or not node.inputs:
        return replicate_only(node, tp, info)
    if node.target.startswith("cat"):
        dims = _dims(node.target)

        def cat_mapping(d: int):
            if dims is None or d == dims[0] % len(node.output.shape):
                return None
            if not all(len(m.shape) == len(node.output.shape) and divides(tp, m.shape[d]) for m in node.input_metas):
                return None
            return tuple(InputSpec(Shard(d)) for _ in node.inputs)
        return _sharded(node, tp, info, cat_mapping)

    def mapping(d: int):
        a = _view_source(node, d)
        x = node.input_metas[0]
        if a is None:
            return None
        first = (InputSpec(R, grad_partial=x.dtype in FLOAT_DTYPES) if a == -1 else
                 InputSpec(Shard(a)) if divides(tp, x.shape[a]) else None)
        if first is None:
            return None
        return (first,) + tuple(InputSpec(R) for _ in node.inputs[1:])
    return _sharded(node, tp, info, mapping)


# ---------------------------------------------------------------------------------- linears


def hf_linear_strategies(node: "NodeInfo", tp: int, info: dict) -> list[Strategy]:
    """y = x W (+ b) with W stored (out, in) ("linear", the default rule), (in, out) ("linear_in_out",
    GPT-2's Conv1D) or per expert (E, out, in) / (E, in, out) ("grouped_linear"[_in_out], MoE experts,
    whose rows are tokens sorted by expert: no sequence split).

    column: W split on out -> y split on features; x.grad partial.   row: W split on in, x split on
    features -> y all-reduced (row_sp: reduce-scattered along the sequence).   sequence: x split on
    the sequence, W replicated, W.grad summed over tp."""
    names = [_relative(node, name) for name, _ in node.params]
    if node.target == "linear" and set(names) <= {"weight", "bias"}:
        return linear_strategies(node, tp, info)
    found = replicate_only(node, tp, info)
    weights = [(n, m) for n, (_, m) in zip(names, node.params) if len(m.shape) >= 2]
    if len(weights) != 1 or not node.input_metas or node.output is None:
        return found
    (weight, meta), rank = weights[0], len(weights[0][1].shape)
    out_dim, in_dim = (rank - 1, rank - 2) if node.target.endswith("_in_out") else (rank - 2, rank - 1)
    biases = [(n, m) for n, (_, m) in zip(names, node.params) if n != weight]
    grouped = node.target.startswith("grouped")
    x, out = node.input_metas[0], node.output
    feat_in, feat_out = Shard(len(x.shape) - 1), Shard(len(out.shape) - 1)
    if divides(tp, meta.shape[out_dim]):
        params = (ParamSpec(weight, Shard(out_dim)),) + tuple(ParamSpec(b, Shard(len(m.shape) - 1))
                                                               for b, m in biases)
        found.append(Strategy("column", (InputSpec(R, grad_partial=True),), feat_out, params, 1 / tp))
    if divides(tp, meta.shape[in_dim]):
        params = (ParamSpec(weight, Shard(in_dim)),) + tuple(ParamSpec(b, R) for b, _ in biases)
        found.append(Strategy("row", (InputSpec(feat_in),), R, params, 1 / tp,
                              fwd_comm=(Comm("all_reduce", "output"),)))
        if not grouped and len(out.shape) >= 3 and divides(tp, out.shape[1]):
            found.append(Strategy("row_sp", (InputSpec(feat_in),), Shard(1), params, 1 / tp,
                                  fwd_comm=(Comm("reduce_scatter", "output"),),
                                  bwd_comm=(Comm("all_gather", "output"),)))
    if not grouped and len(x.shape) >= 3 and divides(tp, x.shape[1]):
        params = tuple(ParamSpec(n, R, grad_partial=True) for n in names)
        found.append(Strategy("sequence", (InputSpec(Shard(1)),), Shard(1), params, 1 / tp,
                              bwd_comm=(Comm("all_reduce", "params"),)))
    return found
