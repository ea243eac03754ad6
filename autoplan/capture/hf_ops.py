"""The ATen vocabulary of `autoplan.capture.hf_convert`: which targets are matmuls, attention cores, norms,
views and reductions; the batch-leading layout; and the per-node helpers (paths, permutations, costs)
the converter applies.
"""

from __future__ import annotations

import operator
import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable

import torch
import torch.fx as fx

from autoplan.capture import NodeInfo, TensorMeta

MATMUL_TARGETS = frozenset({"linear", "addmm", "mm", "matmul", "bmm", "baddbmm", "_grouped_mm",
                            "grouped_mm", "grouped_mm_fallback"})
ATTENTION_TARGETS = frozenset({"scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
                               "_scaled_dot_product_flash_attention_for_cpu",
                               "_scaled_dot_product_efficient_attention",
                               "_scaled_dot_product_cudnn_attention"})
NORM_TARGETS = frozenset({"layer_norm", "rms_norm", "native_layer_norm"})
LOSS_TARGETS = frozenset({"cross_entropy_loss", "cross_entropy"})
NLL_TARGETS = frozenset({"nll_loss", "nll_loss_nd", "nll_loss2d"})
EXTRA_ELEMENTWISE = frozenset({"to", "_to_copy", "type_as", "dropout", "native_dropout", "__and__",
                               "__or__", "__xor__", "floor_divide", "float", "bitwise_not"})
RESHAPES = frozenset({"view", "reshape", "_unsafe_view", "flatten", "unflatten", "squeeze",
                      "unsqueeze", "view_as", "reshape_as"})
COPIES = frozenset({"contiguous", "clone", "alias", "lift_fresh_copy", "detach"})
PERMUTES = frozenset({"transpose", "t", "numpy_T", "permute", "swapaxes", "movedim"})  # numpy_T: `W.T` (Falcon)
SPLITS = frozenset({"split", "split_with_sizes", "chunk", "unbind", "tensor_split"})
VIEW_OTHERS = frozenset({"expand", "expand_as", "slice", "narrow", "select", "cat", "concat"})
REDUCTIONS = frozenset({"sum", "mean", "amax", "amin", "max", "min", "prod", "cumsum", "var",
                        "std", "any", "all", "histc", "logsumexp", "argmax", "argmin", "topk",
                        "sort", "argsort", "bincount"})
SOFTMAX = frozenset({"softmax", "_softmax", "log_softmax", "_log_softmax", "_safe_softmax"})
GATHERS = frozenset({"index", "index_select", "gather", "take_along_dim", "index_put",
                     "index_put_", "scatter", "scatter_add", "scatter_add_", "index_add",
                     "index_add_", "one_hot", "masked_select"})
SKIPPED = frozenset({"_assert_tensor_metadata", "_assert_scalar", "_assert_async",
                     "sym_constrain_range_for_size", "sym_constrain_range"})
NORM_CLASS = re.compile(r"(RMSNorm|LayerNorm)$", re.IGNORECASE)
ACTIVATION_CLASS = re.compile(r"(GELU|SiLU|ReLU|Tanh|Mish|Activation)", re.IGNORECASE)
# the first numbered entry of a module list, whatever the list is called ("model.layers.3",
# "transformer.h.3", "stack.3"): a decoder-only model's block; experts lists sit inside it
LAYER_PATH = re.compile(r"^(?:[^.]+\.)*?[A-Za-z_]\w*\.(\d+)(?:\.|$)")
FLOAT_DTYPES = ("bfloat16", "float16", "float32", "float64")

# ---------------------------------------------------------------------------------- layout


@dataclass(frozen=True)
class HfLayout:
    """Batch-leading layout of token-flattened tensors (module docstring)."""

    batch: int
    seq: int
    top_k: int

    def flattened(self, shape: tuple[int, ...]) -> bool:
        rows = {self.batch * self.seq * k for k in {1, max(self.top_k, 1)}}
        return len(shape) >= 1 and shape[0] != self.batch and shape[0] in rows

    def shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        if self.flattened(shape):
            return (self.batch, shape[0] // self.batch, *shape[1:])
        return shape

    def dim(self, shape: tuple[int, ...], dim: int) -> int | None:
        """The canonical dim of real dim `dim` (None: the flattened token dim, which is two)."""
        dim = dim % len(shape) if shape else 0
        if not self.flattened(shape):
            return dim
        return None if dim == 0 else dim + 1


def _meta(value: object, layout: HfLayout) -> TensorMeta | None:
    if not isinstance(value, torch.Tensor):
        return None
    return TensorMeta(layout.shape(tuple(int(s) for s in value.shape)), str(value.dtype).removeprefix("torch."))


def _target_name(n: fx.Node) -> str:
    if n.target is operator.getitem:
        return "getitem"
    name = getattr(n.target, "_opname", None) or getattr(n.target, "__name__", str(n.target))
    return name.split(".")[0]


def _clean_path(path: str) -> str:
    """Export's module paths ("model.layers.0.mlp"); strict-mode spellings made the same."""
    path = re.sub(r"^L\['self'\]\.?", "", path)
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    return re.sub(r"\._modules\['([^']+)'\]", r".\1", path).strip(".")


def _module_path(n: fx.Node) -> tuple[str, str]:
    """(path, class name) of the innermost module running node `n` ("", "" at top level)."""
    stack = n.meta.get("nn_module_stack") or {}
    if not stack:
        return "", ""
    path, cls = list(stack.values())[-1]
    cls_name = cls.__name__ if isinstance(cls, type) else str(cls).rsplit(".", 1)[-1]
    return _clean_path(path), cls_name


def layer_of(path: str) -> int | None:
    """i of the first numbered module-list entry of a module path (`layers.<i>`, `h.<i>`, any name)."""
    match = LAYER_PATH.search(path)
    return int(match.group(1)) if match else None


# ---------------------------------------------------------------------------------- conversion


def _ordered_unique(items: Iterable[fx.Node]) -> list[fx.Node]:
    seen: dict[str, fx.Node] = {}
    for item in items:
        seen.setdefault(item.name, item)
    return list(seen.values())


def _is_tuple(n: fx.Node) -> bool:
    return n.op == "call_function" and isinstance(n.meta.get("val"), (tuple, list))


def _first_getitem(n: fx.Node) -> int:
    return min((u.args[1] for u in n.users if u.target is operator.getitem), default=0)


def _is_pointwise(n: fx.Node) -> bool:
    return isinstance(n.target, torch._ops.OpOverload) and torch.Tag.pointwise in n.target.tags


def _elementwise_name(target: str) -> str:
    """aten names as `autoplan.cost_model.memory` reads them: add_ -> add, _to_copy -> to."""
    if target in ("_to_copy", "type_as"):
        return "to"
    return target[:-1] if target.endswith("_") and not target.endswith("__") else target


def _swaps_last_two(n: fx.Node) -> bool:
    rank = n.meta["val"].dim()
    perm = _permutation(n, rank)
    return perm is not None and rank >= 2 and perm[-2:] == [rank - 1, rank - 2]


def _permutation(n: fx.Node, rank: int) -> list[int] | None:
    target = _target_name(n)
    perm = list(range(rank))
    if target in ("t", "numpy_T"):
        return perm[::-1]
    if target in ("transpose", "swapaxes"):
        a, b = (d % rank for d in n.args[1:3])
        perm[a], perm[b] = perm[b], perm[a]
        return perm
    if target == "permute":
        return [d % rank for d in n.args[1]]
    return None


def _canonical_perm(perm: list[int], shape: tuple, out_shape: tuple, layout: HfLayout) -> list[int] | None:
    """The permutation in canonical dims; None when it moves the flattened token dim."""
    if not layout.flattened(shape):
        return None if layout.flattened(out_shape) else perm
    if perm[0] != 0 or not layout.flattened(out_shape):
        return None
    return [0, 1] + [d + 1 for d in perm[1:]]


def _costs(kind: str, target: str, op_node: fx.Node, n: fx.Node, inputs: tuple, output: TensorMeta | None,
           params: tuple) -> tuple[float, float]:
    """(forward FLOPs, forward bytes) of a single node (module docstring)."""
    out_numel = output.numel if output is not None else 0
    in_bytes = sum(m.nbytes for m in inputs)
    out_bytes = output.nbytes if output is not None else 0
    param_bytes = sum(m.nbytes for _, m in params)
    if kind in ("placeholder", "output"):
        return 0.0, 0.0
    if target in MATMUL_TARGETS:
        k = _contracted(op_node)
        return 2.0 * out_numel * k, in_bytes + param_bytes + out_bytes
    if target in ATTENTION_TARGETS:
        q = op_node.args[0].meta["val"]  # (B, Hq, T, d)
        return 4.0 * q.shape[0] * q.shape[-2] ** 2 * q.shape[1] * q.shape[-1], in_bytes + out_bytes
    if kind == "embedding" or target in GATHERS:
        return 0.0, in_bytes - (inputs[0].nbytes if target in GATHERS and inputs else 0) + 2 * out_bytes
    if kind == "view":
        copies = target in ("contiguous", "clone", "cat", "concat")
        return 0.0, (in_bytes + out_bytes) if copies else 0.0
    if kind == "norm":
        return 5.0 * out_numel, in_bytes + param_bytes + out_bytes
    if kind == "cross_entropy":
        return 5.0 * (inputs[0].numel if inputs else 0), in_bytes + out_bytes
    if kind == "elementwise":
        return float(out_numel), in_bytes + param_bytes + out_bytes
    if target in SOFTMAX:
        return 5.0 * out_numel, in_bytes + out_bytes
    if target in REDUCTIONS:
        return float(sum(m.numel for m in inputs[:1])), in_bytes + out_bytes
    return 0.0, in_bytes + out_bytes


def _contracted(n: fx.Node) -> int:
    """K of a matmul-like op: the last dim of its (activation) input."""
    target = _target_name(n)
    a = n.args[1] if target in ("addmm", "baddbmm") else n.args[0]
    return int(a.meta["val"].shape[-1])


def _readable_names(nodes: list[NodeInfo]) -> list[NodeInfo]:
    """Single-op modules (linears, embeddings, norms) named after their module path, as
    `autoplan.capture` names call_module nodes; others keep export's names."""
    count = defaultdict(int)
    for n in nodes:
        if n.op_kind in ("linear", "embedding", "norm") and n.module_path:
            count[n.module_path] += 1
    taken = {n.name for n in nodes}
    rename = {}
    for n in nodes:
        if n.op_kind in ("linear", "embedding", "norm") and count.get(n.module_path) == 1:
            new = re.sub(r"\W", "_", n.module_path)
            if new not in taken:
                rename[n.name] = new
                taken.add(new)
    if not rename:
        return nodes
    return [NodeInfo(rename.get(n.name, n.name), n.op_kind, n.target, n.module_path, n.layer,
                     tuple(rename.get(i, i) for i in n.inputs), n.input_metas, n.output, n.params,
                     n.fwd_flops, n.bwd_flops, n.fwd_bytes, n.bwd_bytes) for n in nodes]


def _zero_dead(nodes: list[NodeInfo]) -> tuple[NodeInfo, ...]:
    """Nodes without a path to the output cost nothing (module docstring)."""
    live = {nodes[-1].name} if nodes else set()
    for n in reversed(nodes):
        if n.name in live:
            live.update(n.inputs)
    return tuple(n if n.name in live or n.op_kind == "placeholder" else
                 NodeInfo(n.name, n.op_kind, n.target, n.module_path, n.layer, n.inputs, n.input_metas,
                          n.output, n.params, 0.0, 0.0, 0.0, 0.0) for n in nodes)


def view_target(n: fx.Node, target: str, layout: HfLayout) -> str:
    """A view's rule-readable target: reshape, copy, expand, permute[p], slice[d], select[d], cat[d]."""
    x = n.args[0] if not isinstance(n.args[0], (list, tuple)) else n.args[0][0]
    val = x.meta.get("val") if isinstance(x, fx.Node) else None
    shape = tuple(val.shape) if isinstance(val, torch.Tensor) else ()
    if target in RESHAPES:
        return "reshape"
    if target in COPIES:
        return "copy"
    if target in ("expand", "expand_as"):
        return "expand"
    if target in PERMUTES:
        perm = _permutation(n, len(shape))
        canon = _canonical_perm(perm, shape, tuple(n.meta["val"].shape), layout) if perm else None
        return f"permute[{','.join(map(str, canon))}]" if canon else "permute"
    dim = n.args[1] if len(n.args) > 1 and isinstance(n.args[1], int) else n.kwargs.get("dim", 0)
    if target in ("cat", "concat"):
        dim = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim", 0)
    name = {"narrow": "slice", "concat": "cat"}.get(target, target)
    canon = layout.dim(shape, dim) if shape else None
    return f"{name}[{canon}]" if canon is not None else name

def split_target(op_node: fx.Node, n: fx.Node, layout: HfLayout) -> str:
    """A split's or unbind's piece (a getitem of it) as a rule-readable target: split[d] or select[d]."""
    x = op_node.args[0]
    shape = tuple(x.meta["val"].shape)
    target = _target_name(op_node)
    dim = (op_node.args[2] if len(op_node.args) > 2 else op_node.kwargs.get("dim", 0)) if target != "unbind" \
        else (op_node.args[1] if len(op_node.args) > 1 else 0)
    canon = layout.dim(shape, dim)
    name = "select" if target == "unbind" else "split"
    return f"{name}[{canon}]" if canon is not None else name
