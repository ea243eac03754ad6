"""The captured graph: per-node records (shapes, dtypes, module path, FLOPs, bytes) that every later
stage reads. Plain data and numpy: no torch.fx, so the cost model and the solver can hold a graph
without importing the tracer. `autoplan.capture.fx` (torch.fx) and `autoplan.capture.hf`
(torch.export) both produce a `CapturedGraph`; the cost conventions are in `capture.fx`'s docstring.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass, field

import numpy as np

from typing import TYPE_CHECKING

from autoplan.errors import AutoplanError

if TYPE_CHECKING:
    import torch.fx as fx

# bytes per element of the dtypes a captured graph names (torch's names); others ask torch
ITEMSIZES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "int64": 8, "int32": 4, "int16": 2,
             "int8": 1, "uint8": 1, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1, "complex64": 8}


def itemsize(dtype: str) -> int:
    """Bytes per element of the torch dtype named `dtype` ("bfloat16" -> 2)."""
    if dtype in ITEMSIZES:
        return ITEMSIZES[dtype]
    import torch  # a rare dtype: only then is torch needed

    return getattr(torch, dtype).itemsize

OP_KINDS = ("placeholder", "output", "embedding", "linear", "norm", "attention", "moe",
            "cross_entropy", "elementwise", "other")
MATMUL_KINDS = ("linear", "attention", "moe")
_LAYER_PREFIX = re.compile(r"^layers\.\d+")
_BLOCK_PREFIX = re.compile(r"^(?:[^.]+\.)*?\d+(?=\.|$)")  # up to the first numeric part: "encoder.layers.3"
COMPOSITE = "_composite"  # the target suffix of an activation module captured as one node of several ops
ELEMENTWISE_TARGETS = frozenset({
    "add", "iadd", "add_", "sub", "isub", "sub_", "mul", "imul", "mul_", "truediv", "div", "neg",
    "gelu", "silu", "relu", "tanh", "sigmoid", "exp", "pow", "rsqrt", "sqrt", "float", "to"})


@dataclass(frozen=True)
class TensorMeta:
    """Shape and dtype (torch name without the "torch." prefix, e.g. "bfloat16") of one tensor."""

    shape: tuple[int, ...]
    dtype: str

    @functools.cached_property  # read ~10^5 times in a search
    def numel(self) -> int:
        return math.prod(self.shape)

    @functools.cached_property
    def nbytes(self) -> int:
        return self.numel * itemsize(self.dtype)


@dataclass(frozen=True)
class NodeInfo:
    """One fx node with its shapes, the parameters it uses and its costs (module docstring)."""

    name: str
    op_kind: str
    target: str  # readable: "Linear", "add", "gelu", ...
    module_path: str  # call_module target, else the innermost enclosing module ("" at top level)
    layer: int | None  # i of a "layers.<i>" prefix of module_path
    inputs: tuple[str, ...]  # tensor-valued input nodes, argument order, each once
    input_metas: tuple[TensorMeta, ...]
    output: TensorMeta | None  # None for non-tensor outputs (size(), device)
    params: tuple[tuple[str, TensorMeta], ...]  # fully qualified parameter names
    fwd_flops: float
    bwd_flops: float
    fwd_bytes: float
    bwd_bytes: float

    @functools.cached_property
    def relative_params(self) -> tuple[tuple[str, TensorMeta], ...]:
        """`params` named relative to the op's module ("weight", "router.weight"), as strategies name them."""
        prefix = self.module_path + "." if self.module_path else ""
        return tuple((name[len(prefix):] if name.startswith(prefix) else name, meta) for name, meta in self.params)

    @functools.cached_property
    def rule_key(self) -> tuple:
        """What a strategy rule may read of the node, the layer index aside: equal keys, equal
        strategies (cached: the cost model asks for it per node in every pricing pass)."""
        path = _LAYER_PREFIX.sub("layers.*", self.module_path, 1) if self.layer is not None else self.module_path
        return self.op_kind, self.target, path, self.input_metas, self.output, self.relative_params


@dataclass(frozen=True)
class GraphIndex:
    """A graph's structure as flat arrays, for passes that must cost little per node (the fold):
    node i has label `labels[i]` (`CapturedGraph.labels`), block `blocks[i]` (`block_of` its module
    path, numbered in order of first appearance; -1 outside every block), and inputs
    `inputs[input_ptr[i]:input_ptr[i + 1]]` (node indices, in input order)."""

    names: tuple[str, ...]
    labels: np.ndarray
    blocks: np.ndarray
    input_ptr: np.ndarray
    inputs: np.ndarray
    block_paths: tuple[str, ...] = ()  # block id -> its module path ("encoder.layers.0")


@dataclass(frozen=True)
class CapturedGraph:
    """The captured model: nodes in topological order plus the traced GraphModule."""

    model_name: str
    fingerprint: str
    batch_size: int
    seq_len: int
    dtype: str
    nodes: tuple[NodeInfo, ...]
    graph_module: fx.GraphModule = field(compare=False, repr=False)
    # the model runs its own forward op by op (`capture_hf`: a transformers or hand-written module, which
    # the module runtime runs as it is), not the zoo's with autoplan's fused kernels (runtime.kernel_ops)
    own_forward: bool = False
    @functools.cached_property
    def _label_table(self) -> tuple[tuple[int, ...], tuple[tuple, ...]]:
        ids: dict[tuple, int] = {}
        labels = tuple(ids.setdefault(node_label(n), len(ids)) for n in self.nodes)
        return labels, tuple(ids)

    @property
    def labels(self) -> tuple[int, ...]:
        """A small int per node, equal iff `node_label` is equal (ids in order of first appearance);
        computed once per graph for whoever groups nodes by structure (the fold)."""
        return self._label_table[0]

    @property
    def label_texts(self) -> tuple[tuple, ...]:
        """The `node_label` each id of `labels` stands for."""
        return self._label_table[1]

    @functools.cached_property
    def rule_table(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(per node a small int, equal iff `NodeInfo.rule_key` is equal; per int the index of its first
        node): the strategy rules are asked once per int, and a pass over every node compares ints, not
        keys (computed once per graph)."""
        ids: dict[tuple, int] = {}
        firsts: list[int] = []
        per_node = []
        for k, node in enumerate(self.nodes):
            found = ids.setdefault(node.rule_key, len(ids))
            if found == len(firsts):
                firsts.append(k)
            per_node.append(found)
        return tuple(per_node), tuple(firsts)

    @functools.cached_property
    def input_indices(self) -> tuple[tuple[int, ...], ...]:
        """Per node, the indices of its `inputs` in `nodes`."""
        index = {n.name: i for i, n in enumerate(self.nodes)}
        return tuple(tuple(index[u] for u in n.inputs) for n in self.nodes)

    @functools.cached_property
    def index(self) -> GraphIndex:
        """Names, labels, blocks and inputs of every node as arrays (`GraphIndex`)."""
        counts = np.fromiter((len(x) for x in self.input_indices), np.int64, len(self.nodes))
        ids: dict[str | None, int] = {None: -1}
        blocks = np.fromiter((ids.setdefault(block_of(n.module_path), len(ids) - 1) for n in self.nodes), np.int64,
                             len(self.nodes))
        return GraphIndex(tuple(n.name for n in self.nodes), np.asarray(self.labels, np.int64), blocks,
                          np.concatenate([[0], np.cumsum(counts)]).astype(np.int64),
                          np.fromiter((u for x in self.input_indices for u in x), np.int64, int(counts.sum())),
                          tuple(path for path in ids if path is not None))

    def node(self, name: str) -> NodeInfo:
        for n in self.nodes:
            if n.name == name:
                return n
        raise AutoplanError(f"no node named {name!r} in the capture of {self.model_name!r}; "
                            f"names look like {[n.name for n in self.nodes[:5]]}")

    def total_fwd_flops(self) -> float:
        return sum(n.fwd_flops for n in self.nodes)

    def total_bwd_flops(self) -> float:
        return sum(n.bwd_flops for n in self.nodes)

    def parameter_count(self) -> int:
        """Elements of the distinct parameters used by the nodes."""
        unique = {name: meta for n in self.nodes for name, meta in n.params}
        return sum(meta.numel for meta in unique.values())

    def layers(self) -> list[int]:
        return sorted({n.layer for n in self.nodes if n.layer is not None})

    def nodes_of_layer(self, i: int) -> tuple[NodeInfo, ...]:
        return tuple(n for n in self.nodes if n.layer == i)


def block_of(module_path: str) -> str | None:
    """The entry of a module list that encloses a node: its module path up to the first numeric part
    ("layers.3" of "layers.3.mlp", "encoder.layers.0" of "encoder.layers.0.attn", "h.11"), None outside
    every list. Decoder layers, encoder and decoder stacks and blocks under any name are found alike."""
    found = _BLOCK_PREFIX.match(module_path)
    return found.group(0) if found else None


def attention_keys(node: NodeInfo) -> int:
    """Keys each query of attention core `node` attends to: its forward FLOPs over 4 B T (Hq d), the
    capture's count being 4 B T K (Hq d) with K = T (full attention) or min(T, window) for a sliding
    window (`autoplan.capture.hf_attention`); T when the node carries no FLOPs."""
    q = node.input_metas[0]  # (B, T, Hq d)
    per_key = 4.0 * q.shape[0] * q.shape[1] * q.shape[-1]
    return max(1, round(node.fwd_flops / per_key)) if node.fwd_flops and per_key else q.shape[1]


def node_label(node: NodeInfo) -> tuple:
    """What the cost model and the strategy rules read of a node; no module path, no layer index."""
    params: tuple = ()
    if node.params:
        prefix = node.module_path + "." if node.module_path else ""
        params = tuple([(name.removeprefix(prefix), meta.shape, meta.dtype) for name, meta in node.params])
    inputs = tuple([(m.shape, m.dtype) for m in node.input_metas])
    output = (node.output.shape, node.output.dtype) if node.output is not None else None
    return (node.op_kind, node.target, inputs, output, params,
            node.fwd_flops, node.bwd_flops, node.fwd_bytes, node.bwd_bytes)
