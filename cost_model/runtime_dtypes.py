"""The dtype each captured node's output has as the runtime holds it (`runtime_itemsizes`), which the
activation storages are counted in (`cost_model.activations`).

Under mixed precision: GEMM, attention and MoE outputs in the compute dtype; the embedding (fp32 weights)
and so the residual stream and norm inputs in fp32; pointwise ops in their inputs' widest dtype. Under
master weights (plan precision "bf16-master", `RunShape.master`) the parameters are bf16: the embedding,
and so the residual stream, in the compute dtype.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping

from autoplan.strategies import Strategy

if TYPE_CHECKING:
    from autoplan.capture import CapturedGraph, NodeInfo, TensorMeta

FP32 = 4
# pointwise targets by what their backward keeps (`cost_model.activations`); together, the binary arithmetic
# whose output takes its widest float input's dtype
NO_SAVE_POINTWISE = frozenset({"add", "iadd", "add_", "sub", "isub", "sub_", "neg", "float", "to"})
SAVE_ALL_POINTWISE = frozenset({"mul", "imul", "mul_", "truediv", "div"})


def runtime_itemsizes(graph: "CapturedGraph", mixed: bool, strategies: Mapping[str, Strategy],
                      master: bool = False) -> dict[str, int]:
    """Bytes per element of each node's output as the runtime holds it (module docstring); `master`:
    parameters held in the compute dtype (`RunShape.master`)."""
    found: dict[str, int] = {}
    for node in graph.nodes:
        meta = node.output
        if meta is None:
            continue
        size = meta.nbytes // max(meta.numel, 1)
        if mixed and is_float(meta):
            size = _mixed_itemsize(node, found, size, strategies[node.name], master)
        found[node.name] = size
    return found


def biased(node: "NodeInfo") -> bool:
    return any(name.endswith(".bias") for name, _ in node.params)


def is_float(meta: "TensorMeta") -> bool:
    return meta.dtype in ("float32", "bfloat16", "float16", "float64")


def _mixed_itemsize(node: "NodeInfo", found: Mapping[str, int], compute: int, strategy: Strategy,
                    master: bool = False) -> int:
    """Under autocast over fp32 parameters: GEMM-like ops give the compute dtype (a row-parallel linear
    with a bias fp32: its bias is added after the reduction, outside autocast's GEMM), embeddings fp32,
    "float" fp32, the rest their (first, or for binary arithmetic widest) float input's. Under master
    weights (bf16 parameters) the embedding and a row-parallel linear's bias are in the compute dtype."""
    if node.op_kind == "linear" and strategy.name in ("row", "row_sp") and biased(node):
        return compute if master else FP32
    if node.op_kind in ("linear", "attention", "moe"):
        return compute
    if node.op_kind == "embedding":
        return compute if master else FP32
    if node.target == "float":
        return FP32
    widths = [found[p] for p, m in zip(node.inputs, node.input_metas) if p in found and is_float(m)]
    binary = node.op_kind == "elementwise" and node.target in SAVE_ALL_POINTWISE | NO_SAVE_POINTWISE
    return max(widths if binary else widths[:1], default=compute)
