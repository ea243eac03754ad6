"""Capture: trace a model into an fx graph and annotate every node with shapes, FLOPs and bytes.

Tracing is `torch.fx` symbolic tracing with `LEAF_MODULE_TYPES` kept as single `call_module` nodes.
Shapes come from running the graph on the meta device (no real memory), with int64 tokens and
targets of shape (B, T) and every floating parameter replaced by a meta tensor of the capture dtype;
the user's module is never modified.

Per-node costs (M = rows of the input = numel / last dim; B, T, V, h, f, E as usual):

    linear         fwd 2*M*in*out                         (bias adds ignored)
    attention      fwd 4*B*T*T*Hq*d                       (QK^T and AV, full non-causal count, as
                                                           Narayanan et al. 2021 count it)
    moe            fwd 2*M*h*E + top_k * 3 * 2*M*h*f      (router + top_k SwiGLU experts per token)
    norm           fwd 5 * numel
    elementwise    fwd numel(output)
    cross_entropy  fwd 5 * B*T*V
    embedding, other, placeholder, output: 0
    backward FLOPs: 2 x forward for linear / attention / moe (grads of both operands), 1 x forward
    for the rest.

    bytes fwd = inputs + parameters + output (nbytes), except embedding, which reads only the
    gathered rows (inputs + 2 * output); bytes bwd = 2 x fwd for linear / attention / moe,
    1 x fwd for the rest.
    "other" nodes (views, shape queries, arange in the built-in models) are free: 0 bytes.
"""
from __future__ import annotations

import re

import torch
import torch.fx as fx
from torch import nn

from autoplan.capture import shape_rules
from autoplan.capture.graph import (ELEMENTWISE_TARGETS, MATMUL_KINDS, CapturedGraph, NodeInfo,
                                    TensorMeta)
from autoplan.errors import ConfigError
from autoplan.models.config import ModelConfig
from autoplan.models.layers import (LEAF_MODULE_TYPES, CausalAttention, LMLoss, MoEFeedForward,
                                    RMSNorm)


class _LeafTracer(fx.Tracer):
    """Symbolic tracer that keeps LEAF_MODULE_TYPES whole and records each node's enclosing
    module path in `node.meta["module_path"]`."""

    def __init__(self) -> None:
        super().__init__()
        self._path_stack: list[str] = []

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return isinstance(m, LEAF_MODULE_TYPES) or super().is_leaf_module(m, qualname)

    def call_module(self, m, forward, args, kwargs):
        self._path_stack.append(self.path_of_module(m))
        try:
            return super().call_module(m, forward, args, kwargs)
        finally:
            self._path_stack.pop()

    def create_node(self, *args, **kwargs) -> fx.Node:
        node = super().create_node(*args, **kwargs)
        node.meta["module_path"] = self._path_stack[-1] if self._path_stack else ""
        return node


def trace_model(model: nn.Module) -> fx.GraphModule:
    """Leaf-aware symbolic trace; node names derive from module paths, so they are deterministic."""
    tracer = _LeafTracer()
    graph = tracer.trace(model)
    return fx.GraphModule(tracer.root, graph, type(model).__name__)


class _ShapeRecorder(fx.Interpreter):
    """Runs the graph and keeps the TensorMeta (or None) of every node's result.

    Meta kernels cost ~1 ms per op in Python, so a leaf module or elementwise function seen before
    with the same inputs, arguments and parameter shapes reuses its output meta (in a 96-layer model
    each block's ops run once instead of 96 times)."""

    def __init__(self, gm: fx.GraphModule, rules: bool = True) -> None:
        super().__init__(gm)
        self.metas: dict[str, TensorMeta | None] = {}
        self._memo: dict[tuple, TensorMeta] = {}
        self.rules = rules  # shapes of common ops by rule (autoplan.capture.shape_rules) instead of meta kernels

    def run_node(self, n: fx.Node):
        key = self._memo_key(n)
        if key in self._memo:
            meta = self._memo[key]
            result = torch.empty(meta.shape, dtype=getattr(torch, meta.dtype), device="meta")
        else:
            result = self._by_rule(n) if self.rules else None
            if result is None:
                result = super().run_node(n)
        self.metas[n.name] = _tensor_meta(result)
        if key is not None and self.metas[n.name] is not None:
            self._memo[key] = self.metas[n.name]
        return result

    def _by_rule(self, n: fx.Node) -> torch.Tensor | None:
        if n.op == "call_module":
            module = self.fetch_attr(n.target)
            if not isinstance(module, LEAF_MODULE_TYPES):
                return None
            args, _ = self.fetch_args_kwargs_from_env(n)
            return shape_rules.module_output(module, args)
        if n.op in ("call_function", "call_method"):
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            return shape_rules.function_output(_readable_target(n, None), args, kwargs)
        return None

    def _memo_key(self, n: fx.Node) -> tuple | None:
        if n.op == "call_module":
            module = self.fetch_attr(n.target)
            if not isinstance(module, LEAF_MODULE_TYPES):
                return None
            target = (repr(module), tuple((tuple(p.shape), p.dtype) for p in module.parameters()))
        elif n.op == "call_function" and _readable_target(n, None) in ELEMENTWISE_TARGETS:
            target = n.target
        else:
            return None
        args = fx.node.map_arg((n.args, n.kwargs), lambda a: self.metas[a.name])
        return (n.op, target, repr(args))


class _Runner(nn.Module):
    """Lets `torch.func.functional_call` swap in meta parameters around the interpreter."""

    def __init__(self, gm: fx.GraphModule, rules: bool = True) -> None:
        super().__init__()
        self.gm, self.rules = gm, rules

    def forward(self, *args: torch.Tensor) -> dict[str, TensorMeta | None]:
        recorder = _ShapeRecorder(self.gm, self.rules)
        recorder.run(*args)
        return recorder.metas


def _tensor_meta(value: object) -> TensorMeta | None:
    if not isinstance(value, torch.Tensor):
        return None
    return TensorMeta(tuple(value.shape), _dtype_name(value.dtype))


def _meta_state(gm: fx.GraphModule, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Meta stand-ins for every parameter and buffer; floating ones take the capture dtype."""
    state = {}
    for name, t in [*gm.named_parameters(), *gm.named_buffers()]:
        t_dtype = dtype if t.is_floating_point() else t.dtype
        state[f"gm.{name}"] = torch.empty(t.shape, dtype=t_dtype, device="meta")
    return state


def capture(model: nn.Module, config: ModelConfig, batch_size: int, seq_len: int,
            dtype: torch.dtype = torch.bfloat16, *, shape_rules: bool = True) -> CapturedGraph:
    """Trace `model`, propagate (batch_size, seq_len) token shapes on meta, and cost every node.
    `shape_rules=False` runs every op's meta kernel instead of `autoplan.capture.shape_rules` (for tests)."""
    for key, value in (("batch_size", batch_size), ("seq_len", seq_len)):
        if not isinstance(value, int) or value <= 0:
            raise ConfigError(f"capture: {key}={value!r} must be a positive integer")
    if seq_len > config.max_seq:
        raise ConfigError(f"capture: seq_len={seq_len} exceeds max_seq={config.max_seq} of model "
                          f"{config.name!r}; use seq_len <= {config.max_seq} or raise max_seq")
    gm = trace_model(model)
    tokens = torch.zeros((batch_size, seq_len), dtype=torch.int64, device="meta")  # (B, T)
    n_inputs = sum(1 for n in gm.graph.nodes if n.op == "placeholder")  # tokens, targets
    metas = torch.func.functional_call(_Runner(gm, shape_rules), _meta_state(gm, dtype), (tokens,) * n_inputs)
    nodes = tuple(_node_info(gm, n, metas, dtype) for n in gm.graph.nodes)
    graph = CapturedGraph(config.name, config.fingerprint(), batch_size, seq_len, _dtype_name(dtype), nodes, gm)
    graph.index  # noqa: B018 (structural labels and input arrays, made with the records: ~3 us a node)
    return graph


def _node_info(gm: fx.GraphModule, n: fx.Node, metas: dict, dtype: torch.dtype) -> NodeInfo:
    module = gm.get_submodule(n.target) if n.op == "call_module" else None
    output = metas[n.name]
    inputs = tuple(a.name for a in n.all_input_nodes if metas[a.name] is not None)
    input_metas = tuple(metas[a] for a in inputs)
    kind = _op_kind(n, module, input_metas, output)
    params = _params_of(gm, n, module, dtype)
    path = n.target if n.op == "call_module" else n.meta.get("module_path", "")
    match = re.match(r"layers\.(\d+)(\.|$)", path)
    fwd = _forward_flops(kind, input_metas, output, params, module)
    fwd_bytes = _forward_bytes(kind, input_metas, output, params)
    scale = 2.0 if kind in MATMUL_KINDS else 1.0
    return NodeInfo(n.name, kind, _readable_target(n, module), path,
                    int(match.group(1)) if match else None, inputs, input_metas, output, params,
                    float(fwd), scale * fwd, float(fwd_bytes), scale * fwd_bytes)


def _readable_target(n: fx.Node, module: nn.Module | None) -> str:
    if module is not None:
        return type(module).__name__
    if isinstance(n.target, str):
        return n.target
    return getattr(n.target, "__name__", str(n.target))


def _op_kind(n: fx.Node, module: nn.Module | None, input_metas: tuple, output) -> str:
    if n.op in ("placeholder", "output"):
        return n.op
    if module is not None:
        kinds = ((nn.Linear, "linear"), (nn.Embedding, "embedding"),
                 ((nn.LayerNorm, RMSNorm), "norm"), (CausalAttention, "attention"),
                 (MoEFeedForward, "moe"), (LMLoss, "cross_entropy"))
        return next((kind for cls, kind in kinds if isinstance(module, cls)), "other")
    if (n.op in ("call_function", "call_method") and output is not None
            and _readable_target(n, None) in ELEMENTWISE_TARGETS
            and any(m.shape == output.shape for m in input_metas)):
        return "elementwise"
    return "other"


def _params_of(gm: fx.GraphModule, n: fx.Node, module: nn.Module | None, dtype: torch.dtype
               ) -> tuple[tuple[str, TensorMeta], ...]:
    if module is not None:
        named = [(f"{n.target}.{name}", p) for name, p in module.named_parameters()]
    elif n.op == "get_attr" and n.target in dict(gm.named_parameters()):
        named = [(n.target, gm.get_parameter(n.target))]
    else:
        return ()
    return tuple((name, TensorMeta(tuple(p.shape), _dtype_name(dtype if p.is_floating_point()
                                                               else p.dtype)))
                 for name, p in named)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _forward_flops(kind: str, inputs: tuple, output: TensorMeta | None, params: tuple,
                   module: nn.Module | None) -> int:
    """Forward FLOPs by the formulas of the module docstring."""
    if kind == "linear":
        x = inputs[0]
        return 2 * (x.numel // x.shape[-1]) * x.shape[-1] * output.shape[-1]
    if kind == "attention":
        B, T, width = inputs[0].shape  # q: (B, T, Hq*d)
        return 4 * B * T * T * width
    if kind == "moe":
        x, shapes = inputs[0], {name.rsplit(".", 1)[-1]: m.shape for name, m in params}
        (experts, hidden, ffn), rows = shapes["w_gate"], x.numel // x.shape[-1]
        return 2 * rows * hidden * experts + module.top_k * 3 * 2 * rows * hidden * ffn
    if kind == "norm":
        return 5 * output.numel
    if kind == "elementwise":
        return output.numel
    if kind == "cross_entropy":
        return 5 * inputs[0].numel
    return 0


def _forward_bytes(kind: str, inputs: tuple, output: TensorMeta | None, params: tuple) -> int:
    """inputs + params + output nbytes; embedding reads only its gathered rows; other is free."""
    if kind in ("placeholder", "output", "other"):
        return 0
    in_bytes = sum(m.nbytes for m in inputs)
    out_bytes = output.nbytes if output is not None else 0
    if kind == "embedding":
        return in_bytes + 2 * out_bytes
    return in_bytes + sum(m.nbytes for _, m in params) + out_bytes
