"""Activation memory per rank: the storages one microbatch's forward leaves for backward, as the
runtime makes them (`autoplan.runtime`), and what a recompute policy keeps of them.

A storage is one allocation (views share it; two ops saving the same tensor keep it once), with its
bytes on this rank at the capture batch, whether it scales with the microbatch, the layer whose ops
make it and the family of the op that makes it (`autoplan.recompute_policy`). `activations()` walks
the captured graph once and records, per op, the storages it makes and those its backward keeps:

    linear        keeps its input as the GEMM reads it: under mixed precision (autocast over fp32
                  parameters) a bf16 copy of an fp32 input, one per tensor read by several linears
                  of a layer (runtime.casts); makes its GEMM output (matmul); row-parallel: a full
                  size partial GEMM output, then the all-reduced (or reduce-scattered) output
    norm          keeps its input and fp32 row statistics (LayerNorm mean and 1/std, RMSNorm 1/rms); the
                  zoo's LayerNorm on CPU an fp32 copy of a half-precision input instead
    attention     flash kernel: keeps q and k after RoPE (fresh tensors; plain q and k without it),
                  v, its output (the o_proj input is a view of it) and the fp32 log-sum-exp (B, H, T);
                  under cp the all-to-all'd q, k, v (kv heads repeated where cp needs it) and a second
                  all-to-all of the output. RoPE's cos and sin are made once per program (resident).
                  Materialized kernel (Korthikanti et al.): q, k, v, the T x T probabilities (and with
                  dropout its mask and the dropped probabilities), and the projection input, a copy
    pointwise     silu * mul (fused): the gate and up inputs; gelu, silu: the input; tanh, sigmoid,
                  exp, relu, rsqrt, sqrt: the output; mul / div: both inputs; add / sub / neg: nothing
    embedding     the token ids (made in forward only under vocabulary parallelism: masked ids + mask)
    cross_entropy the logits as given, fp32 log-sum-exp and a valid mask per token (vocab and
                  replicated: runtime.kernels.cross_entropy); sequence parallel: fp32 log-probabilities
    moe           `_moe` below
    conversions   each tp conversion of a producer's output (gather, split, all-to-all) is a fresh
                  storage of the local size in the consumer's layer; copy-to-region is a view

Runtime dtypes under mixed precision: `cost_model.runtime_dtypes`.

What a policy keeps (`held`): without recomputation, every storage some op keeps. A recomputed layer
(a checkpointed region, runtime.recompute) keeps instead its region inputs (storages made outside it
that its ops read) and the outputs of its ops whose family the policy saves, saved or not; while
backward re-runs it, it holds the rest of what its ops keep (the transient). Storages are
attributed to the first part (pre, layers in order, post) that holds them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Mapping

from autoplan.capture.graph import COMPOSITE
from autoplan.models.config import expert_capacity
from autoplan.placement import Placement, Replicate, Shard
from autoplan.strategies import Strategy, expert_dims
from autoplan.cost_model.ep_margins import ep_imbalance_margins
from autoplan.cost_model.runtime_dtypes import (FP32, NO_SAVE_POINTWISE, SAVE_ALL_POINTWISE, biased, is_float,
                                                 runtime_itemsizes)
from autoplan.cost_model.storages import Activations, Storage

if TYPE_CHECKING:
    from autoplan.capture import CapturedGraph, NodeInfo, TensorMeta
    from autoplan.cost_model.compute import AttentionKernel

INT64, BOOL = 8, 1
REPLICATE = Replicate()
VIEW_TARGETS = frozenset({"view", "reshape", "unsqueeze", "squeeze", "expand", "transpose", "permute",
                          "flatten", "contiguous", "getitem", "chunk", "split", "t"})
CASTS = frozenset({"to", "float", "type_as"})
SAVE_OUTPUT_POINTWISE = frozenset({"tanh", "sigmoid", "exp", "relu", "rsqrt", "sqrt"})
MOE_ROUTER_INTS = 2  # top-k indices and softmax weights kept per routed slot (int64 + fp32 below)
ROUTED_ROWS = frozenset({"received", "expert_in", "gate", "up", "product"})  # `_moe`'s storages per received row


# ------------------------------------------------------------------------------------ the walk


@dataclass(frozen=True)
class RunShape:
    """What the runtime's storages depend on beyond the tp strategies: mixed precision, the context
    group (Ulysses all-to-alls around attention when > 1), whether each MoE layer's experts are
    spread over an expert group of `spread` > 1 ranks (ep x tp / etp: tokens dispatched by all-to-all;
    1: not spread, unless a layer's "expert" strategy spreads them over its tp ranks), and whether
    the fused kernels run as Triton (GPUs) or as their torch paths (CPU): of what they keep, only the
    MoE combine differs (the kernel keeps the expert outputs as they are, the torch path an fp32 copy);
    `imbalance`: the routed rows of spread experts priced for the busiest rank (`ep_imbalance_margins`),
    or (False) at the mean over the expert group; `master`: parameters
    held in the compute dtype (plan precision "bf16-master"), not fp32 under autocast."""

    mixed: bool = False
    context: int = 1
    spread: int = 1
    triton: bool = False
    imbalance: bool = True
    master: bool = False


def activations(graph: "CapturedGraph", strategies: Mapping[str, Strategy], tp: int, info: Mapping | None = None,
                shape: RunShape = RunShape(), attention: "AttentionKernel | None" = None) -> Activations:
    """Every storage one forward makes and keeps for backward (module docstring), per rank at the
    capture batch; `attention`: the attention kernel (None: flash)."""
    walk = _Walk(graph, strategies, tp, dict(info or {}), shape, attention)
    for node in graph.nodes:
        walk.visit(node)
    return walk.result()


class _Walk:
    """The state of `activations`: storages made so far, who keeps which, each node's output."""

    def __init__(self, graph, strategies, tp, info, shape: RunShape, attention) -> None:
        self.graph, self.strategies, self.tp, self.info, self.shape = graph, strategies, tp, info, shape
        self.attention = attention
        self.itemsize = runtime_itemsizes(graph, shape.mixed, strategies, shape.master)
        self.users = _users(graph)
        self.storages: dict[str, Storage] = {}
        self.saved: list[tuple[str, object]] = []
        self.inputs: dict[int, dict[str, None]] = {}
        self.resident: list[str] = []
        self.out: dict[str, str] = {}  # node -> the storage of its output
        self.nodes = {n.name: n for n in graph.nodes}
        layered = [k for k, n in enumerate(graph.nodes) if n.layer is not None]
        first = layered[0] if layered else len(graph.nodes)
        self.part = {n.name: n.layer if n.layer is not None else ("pre" if k < first else "post")
                     for k, n in enumerate(graph.nodes)}
        self.readers = _linear_readers(self)
        self.grads = _requiring_grad(graph)
        self.moe_shapes: list[tuple[int, int, int, int]] = []  # (expert group, E, k, h) of each MoE layer

    def result(self) -> Activations:
        layers = tuple(sorted({n.layer for n in self.graph.nodes if n.layer is not None}))
        return Activations(dict(self.storages), tuple(self.saved),
                           {i: tuple(keys) for i, keys in self.inputs.items()}, tuple(self.resident), layers,
                           *self.margins())

    def margins(self) -> tuple[tuple[float, float], tuple]:
        """((held, re-run) imbalance margins on the routed storages with every layer held and re-run, the
        `ep_imbalance_margins` arguments that give them): none where no row is routed."""
        routed = (self.shape.imbalance and not self.info.get("capacity_factor")  # a capacity bounds the rows
                  and any(s.routed for s in self.storages.values()))
        if not routed:
            return (0.0, 0.0), ()
        group, experts, k, h = self.moe_shapes[0]  # the zoo's MoE layers are alike
        shape = (group, experts, k, h, self.info.get("moe_layers") or len(self.moe_shapes))
        return ep_imbalance_margins(*shape), shape

    # ---------------------------------------------------------------- bookkeeping
    def make(self, key: str, nbytes: float, node: "NodeInfo", family: str, batched: bool = True,
             routed: bool = False) -> str:
        if key not in self.storages:  # the first maker's (a conversion shared by several consumers)
            self.storages[key] = Storage(key, float(nbytes), batched, node.layer, family, node.name, routed)
        return key

    def keep(self, key: str, node: "NodeInfo") -> None:
        if self.storages[key].nbytes and node.name in self.grads:  # autograd records no op outside it
            self.saved.append((key, self.part[node.name]))

    def output(self, node: "NodeInfo", family: str, key: str | None = None) -> str:
        """Make the node's output storage (its local size under its strategy) and return its key."""
        meta = node.output
        nbytes = self.local(self.bytes_of(node.name), self.strategies[node.name].output)
        self.out[node.name] = self.make(key or f"out:{node.name}", nbytes, node, family,
                                        _batched(meta, self.graph.batch_size))
        return self.out[node.name]

    def bytes_of(self, name: str) -> float:
        """Full bytes of a node's output as the runtime holds it."""
        meta = self.nodes[name].output
        return meta.numel * self.itemsize.get(name, meta.nbytes // max(meta.numel, 1))

    def local(self, nbytes: float, placement: Placement) -> float:
        return nbytes / self.tp if isinstance(placement, Shard) else nbytes

    def rows(self, meta: "TensorMeta", placement: Placement) -> float:
        """Rows (elements over the last dim) of a tensor on this rank under `placement`."""
        split = isinstance(placement, Shard) and placement.dim % len(meta.shape) != len(meta.shape) - 1
        return meta.numel / meta.shape[-1] / (self.tp if split else 1)

    def edge(self, node: "NodeInfo", i: int) -> tuple:
        """(producer, conversion) of input i: the identity of the tensor the op reads; the conversion
        (source, destination placement, grad_partial), None when there is none or it is a view."""
        producer = node.inputs[i]
        if self.tp == 1:
            return producer, None
        src, spec = self.strategies[producer].output, self.strategies[node.name].inputs[i]
        if src is spec.placement and not spec.grad_partial:  # the rules share placement objects: no compare
            return producer, None
        if src == spec.placement and not spec.grad_partial or spec.grad_partial and src == REPLICATE:
            return producer, None  # no conversion, or copy-to-region (a view)
        return producer, (src, spec.placement, spec.grad_partial)

    def seen(self, node: "NodeInfo", i: int) -> str:
        """The storage op `node` reads as input i: its producer's output, or the tp conversion of it
        (a fresh storage in the consumer's layer); records region inputs."""
        producer, conversion = self.edge(node, i)
        key = self.out[producer]
        if node.layer is not None and self.nodes[producer].layer != node.layer:
            self.inputs.setdefault(node.layer, {})[key] = None
        if conversion is None:
            return key
        src, dst, grad_partial = conversion
        key = f"conv:{producer}:{src}>{dst}:{grad_partial}"
        if key in self.storages:
            return key
        family = "other" if src == REPLICATE else "collective"  # a split copies
        return self.make(key, self.local(self.bytes_of(producer), dst), node, family,
                         _batched(self.nodes[producer].output, self.graph.batch_size))

    def matmul_input(self, node: "NodeInfo", i: int) -> str:
        """What a linear keeps of input i: the tensor as read, or under mixed precision the compute-dtype
        copy autocast makes of an fp32 one, shared by the linears of a layer reading it (runtime.casts)."""
        key, producer = self.seen(node, i), node.inputs[i]
        compute = node.output.nbytes // max(node.output.numel, 1)
        width = self.itemsize.get(producer, compute)
        if not self.shape.mixed or width <= compute:
            return key
        shared = self.readers[(self.edge(node, i), node.layer)] >= 2
        cast = f"cast:{key}" if shared else f"cast:{key}:{node.name}"
        stored = self.storages[key]
        return self.make(cast, stored.nbytes * compute / width, node, "other", stored.batched)

    # ---------------------------------------------------------------- ops
    def visit(self, node: "NodeInfo") -> None:
        if node.op_kind == "placeholder":
            self.out[node.name] = self.make(f"in:{node.name}", 0.0, node, "other")  # not made in forward
        elif node.op_kind != "output" and node.output is not None:
            getattr(self, f"_{node.op_kind}", self._other)(node)

    def _view(self, node: "NodeInfo") -> None:
        """Views, reshapes, slices (captured Hugging Face graphs): the input's storage, or a copy where
        the shape cannot be viewed, which nothing keeps (a copy's backward needs no input)."""
        if node.inputs:
            self.out[node.name] = self.seen(node, 0)
        else:
            self.output(node, "other")

    def _other(self, node: "NodeInfo") -> None:
        if node.target in VIEW_TARGETS and node.inputs:
            self.out[node.name] = self.seen(node, 0)
        else:
            self.output(node, "other")

    def _embedding(self, node: "NodeInfo") -> None:
        if self.strategies[node.name].name in ("vocab", "vocab_sp"):  # masked local ids and the mask
            ids = node.input_metas[0].numel
            self.keep(self.make(f"{node.name}:ids", ids * INT64, node, "other"), node)
            self.keep(self.make(f"{node.name}:mask", ids * BOOL, node, "other"), node)
            made = self.output(node, "collective")
            if self.graph.own_forward:  # DTensor's reduction: the functional collective's output and the
                # autograd wrapper of it, alive together (measured, runtime.memory_probe): twice the bytes
                self.storages[made] = replace(self.storages[made], nbytes=2 * self.storages[made].nbytes)
            return
        self.keep(self.seen(node, 0), node)
        self.output(node, "other")

    def _linear(self, node: "NodeInfo") -> None:
        self.keep(self.matmul_input(node, 0), node)
        if self.strategies[node.name].name in ("row", "row_sp"):  # a full-size partial GEMM output, reduced
            self.make(f"{node.name}:partial", node.output.nbytes, node, "matmul",
                      _batched(node.output, self.graph.batch_size))
            self.output(node, "other" if biased(node) else "collective")
        else:
            self.output(node, "matmul")

    def _norm(self, node: "NodeInfo") -> None:
        read = self.seen(node, 0)
        rows = self.rows(node.output, self.strategies[node.name].output)
        stats = 1 if node.target.endswith("RMSNorm") else 2  # 1/rms; LayerNorm's mean and 1/std
        width = self.itemsize.get(node.name, FP32)
        if stats == 2 and self.shape.master and not self.shape.triton and width < FP32 and not self.graph.own_forward:
            # the zoo's LayerNorm torch path (runtime.kernels.norms) runs F.layer_norm on an fp32 copy of
            # a half-precision input (bf16 parameters: the residual stream is bf16), which it keeps
            local = self.local(self.bytes_of(node.name), self.strategies[node.name].output)
            read = self.make(f"{node.name}:upcast", local * FP32 / width, node, "other")
        self.keep(read, node)
        self.keep(self.make(f"{node.name}:stats", rows * stats * FP32, node, "other"), node)
        if self.graph.own_forward and stats == 1:  # x * rsqrt, kept by the weight's product (no fused kernel)
            normed = self.local(self.bytes_of(node.name), self.strategies[node.name].output)
            self.keep(self.make(f"{node.name}:normed", normed, node, "other"), node)
        self.output(node, "other")

    def _elementwise(self, node: "NodeInfo") -> None:
        target, floats = node.target, [i for i, m in enumerate(node.input_metas) if is_float(m)]
        if target in CASTS and node.inputs and self.itemsize.get(node.inputs[0]) == self.itemsize.get(node.name):
            self.out[node.name] = self.seen(node, 0)  # a cast to its input's own dtype returns the input
            return
        if target == "gelu" + COMPOSITE:  # transformers' tanh GELU op by op: its input, tanh's output,
            # 1 + tanh and 0.5 x (the last two kept by their product, the output)
            made = self.output(node, "other")
            self.keep(self.seen(node, 0), node)
            for i in range(3):
                self.keep(self.make(f"{made}:{i}", self.storages[made].nbytes, node, "other"), node)
            return
        if target == "silu" and self.fused_silu(node):
            self.out[node.name] = self.seen(node, 0)  # runtime.kernel_ops fuses it into the mul
            return
        if target in SAVE_ALL_POINTWISE and any(self.fused_silu(self.nodes[p]) for p in node.inputs):
            kept = [self.out[p] for p in node.inputs]  # silu's input (the gate) and the other operand
        elif target in NO_SAVE_POINTWISE:
            kept = []
        elif target in SAVE_ALL_POINTWISE:
            kept = [self.seen(node, i) for i in floats]
        else:
            kept = [self.seen(node, i) for i in floats[:1]]
        made = self.output(node, "other")
        for key in [made] if target in SAVE_OUTPUT_POINTWISE else kept:
            self.keep(key, node)

    def fused_silu(self, node: "NodeInfo") -> bool:
        """A silu whose only user is a mul, which runtime.kernel_ops makes one silu_mul kernel."""
        users = self.users.get(node.name, ())
        return (not self.graph.own_forward and node.op_kind == "elementwise" and node.target == "silu" and len(users) == 1
                and self.nodes[users[0]].target in ("mul", "imul"))

    def _attention(self, node: "NodeInfo") -> None:
        qkv = [self.seen(node, i) for i in range(3)]
        if self.shape.context > 1:  # Ulysses: sequence shards -> head shards, kv heads repeated if needed
            repeat = self.kv_repeat(node)
            qkv = [self.make(f"cp:{node.name}:{i}", self.storages[key].nbytes * (repeat if i else 1), node,
                             "collective", True) for i, key in enumerate(qkv)]
        if self.info.get("rope"):
            qkv[:2] = [self.make(f"rope:{node.name}:{i}", self.storages[key].nbytes, node, "other", True)
                       for i, key in enumerate(qkv[:2])]
            self.rope_tables(node)
        for key in qkv:
            self.keep(key, node)
        out_bytes = self.local(self.bytes_of(node.name), self.strategies[node.name].output)
        heads_rows = out_bytes / self.itemsize[node.name] / int(self.info.get("head_dim", 128))
        if self.attention is not None and self.attention.kind == "materialized":
            self.materialized(node, out_bytes, heads_rows)
            return
        kernel = self.make(f"{node.name}:sdpa" if self.shape.context > 1 else f"out:{node.name}", out_bytes,
                           node, "attention")
        self.keep(kernel, node)
        self.keep(self.make(f"{node.name}:lse", heads_rows * FP32, node, "attention"), node)
        self.out[node.name] = kernel if self.shape.context == 1 else self.output(node, "collective")

    def materialized(self, node: "NodeInfo", out_bytes: float, heads_rows: float) -> None:
        """Korthikanti et al.'s attention: the T x T probabilities (itemsize each; with dropout its mask
        and the dropped ones), the P V output (not kept) and the projection's input, a copy."""
        scores, itemsize = heads_rows * node.output.shape[1], self.itemsize[node.name]
        kept = [("probs", itemsize)] + ([("mask", BOOL), ("dropped", itemsize)] if self.attention.dropout else [])
        for what, size in kept:
            self.keep(self.make(f"{node.name}:{what}", scores * size, node, "other"), node)
        self.make(f"{node.name}:pv", out_bytes, node, "matmul")
        self.output(node, "other")

    def kv_repeat(self, node: "NodeInfo") -> int:
        """How many times Ulysses repeats the local kv heads (runtime.context.kv_repeat)."""
        d, strategy = int(self.info.get("head_dim", 128)), self.strategies[node.name]
        heads = [self.local(m.shape[-1], strategy.inputs[i].placement) / d for i, m in enumerate(node.input_metas[:2])]
        q_heads, kv_heads, cp = int(heads[0]), int(heads[1]), self.shape.context
        if kv_heads % cp == 0:
            return 1
        return next((r for r in range(1, q_heads // kv_heads + 1)
                     if (kv_heads * r) % cp == 0 and q_heads % (kv_heads * r) == 0), 1)

    def rope_tables(self, node: "NodeInfo") -> None:
        """cos and sin (T, d) fp32, made once per program (runtime.kernel_ops.RopeTables)."""
        if not self.resident:
            d = int(self.info.get("head_dim", 128))
            self.resident.append(self.make("rope:tables", 2 * self.graph.seq_len * d * FP32, node, "other", False))

    def _cross_entropy(self, node: "NodeInfo") -> None:
        logits, targets = self.seen(node, 0), self.seen(node, 1)
        placement = self.strategies[node.name].inputs[0].placement
        rows = self.rows(node.input_metas[0], placement)
        if self.strategies[node.name].name == "sequence":  # F.cross_entropy: fp32 log-probabilities
            width = node.input_metas[0].shape[-1]
            kept = [self.make(f"{node.name}:logprobs", rows * width * FP32, node, "other")]
        else:  # runtime.kernels.cross_entropy: the logits as given, lse and the valid mask
            kept = [logits, self.make(f"{node.name}:lse", rows * FP32, node, "other"),
                    self.make(f"{node.name}:valid", rows * BOOL, node, "other")]
        for key in kept + [targets]:
            self.keep(key, node)
        self.out[node.name] = self.make(f"out:{node.name}", 0.0, node, "other", False)  # the loss


    def _moe(self, node: "NodeInfo") -> None:
        """The runtime's MoE (runtime.experts, on one rank; N tokens here, k slots each, M = N k rows
        reaching this rank's experts when balanced, times etp under 1 < etp < tp):
            router     its input as the GEMM reads it (as a linear), top-k indices (int64) and softmax
                       weights (fp32) per slot; the logits (N, E) made, not kept
            routing    the sorted-row and row-position indices per slot (int64, 2 N k); spread over an
                       expert group, the same again per received row (2 M)
            experts    their input rows (M, h) as the GEMMs read them, gate and up (matmul) and their
                       product (M, f) each; the down projection's output (matmul) made, not kept
            combine    the expert output rows (N k, h), kept for the weights' gradient: in fp32 on the
                       torch path, as they are (compute dtype) under the Triton kernel
        Spread over an expert group, the storages of the M received rows are `Storage.routed`: priced
        with the imbalance margins (`Activations.margins`), the busiest rank's, not the mean's.
        With an expert capacity (rule info "capacity_factor"; runtime.experts' padded dispatch) the
        buffer has S = E C rows per sequence slice whatever the routing, so M = S (times etp), priced
        exactly, without a margin; routing keeps the slots' token index (S) and the pairs' slot (N k);
        the Triton combine keeps the S padded output rows.
        """
        shape = self._moe_shape(node)
        n, k, h, f, rows, c, width = (shape[key] for key in ("tokens", "k", "h", "f", "rows", "c", "width"))
        spread = shape["spread"]
        if spread:  # `margins` reads them: the group, E, k, h
            self.moe_shapes.append((self.shape.spread if self.shape.spread > 1 else self.tp, shape["experts"], k, h))
        flat = self.seen(node, 0)
        router_in = flat if width <= c or not self.shape.mixed else self.make(
            f"{node.name}:router_in", n * h * c, node, "other")
        self.make(f"{node.name}:logits", n * shape["experts"] * c, node, "matmul")
        routing = (shape["slots"] + n * k) * INT64 if shape["slots"] else 2 * n * k * INT64
        combined = n * k * FP32 if not self.shape.triton else (shape["slots"] or n * k) * c
        kept = [router_in, ("topk", n * k * (INT64 + FP32), "other"), ("routing", routing, "other"),
                ("received", 2 * rows * INT64 if spread else 0.0, "other"),
                ("expert_in", rows * h * (c if self.shape.mixed else width), "other"),
                ("gate", rows * f * c, "matmul"), ("up", rows * f * c, "matmul"), ("product", rows * f * c, "other"),
                ("combine", combined * h, "other")]
        for item in kept:
            self.keep(item if isinstance(item, str) else self.make(
                f"{node.name}:{item[0]}", item[1], node, item[2], routed=spread and item[0] in ROUTED_ROWS), node)
        self.make(f"{node.name}:down", rows * h * c, node, "matmul", routed=spread)
        self.output(node, "collective" if self.strategies[node.name].name == "ffn" else "other")

    def _moe_shape(self, node: "NodeInfo") -> dict:
        """Sizes of one MoE layer on this rank (`_moe`)."""
        strategy, x = self.strategies[node.name], node.input_metas[0]
        h = x.shape[-1]
        experts, _, ffn = expert_dims(node)
        tokens_all = x.numel // h
        k = max(1, round((node.fwd_flops - 2 * tokens_all * h * experts) / (6 * tokens_all * h * ffn)))
        tokens = self.rows(x, strategy.inputs[0].placement)
        split = {"ffn": self.tp, "expert": strategy.expert_ffn_split}.get(strategy.name, 1)
        gathered = strategy.expert_ffn_split if strategy.name == "expert" else 1  # rows of the etp peers
        spread = self.shape.spread > 1 or strategy.name == "expert"
        slots = self._capacity_slots(x, tokens, k, experts)
        return {"tokens": tokens, "k": k, "h": h, "f": ffn / split, "rows": (slots or tokens * k) * gathered,
                "slots": slots, "experts": experts, "spread": spread, "c": node.output.nbytes // node.output.numel,
                "width": self.itemsize.get(node.inputs[0], 4)}

    def _capacity_slots(self, x: "TensorMeta", tokens: float, k: int, experts: int) -> float:
        """Rows of this rank's padded expert buffer under an expert capacity (`models.config.expert_capacity`,
        runtime.experts): E C per sequence slice of T / (cp, and tp where the tokens are split) tokens, in the
        walk's units (the cp ranks' scale, 1 / cp, is applied later); 0 without a capacity."""
        factor = self.info.get("capacity_factor", 0.0)
        if not factor:
            return 0.0
        context, seq = self.shape.context, x.shape[-2]
        per_sequence = seq * tokens / (x.numel // x.shape[-1])  # this rank's tokens of one sequence (tp split)
        capacity = expert_capacity(factor, round(per_sequence / context), k, experts)
        return experts * capacity * context * tokens / per_sequence


def _batched(meta: "TensorMeta | None", batch: int) -> bool:
    """Whether a tensor's leading dim is the batch (its size then scales with the microbatch)."""
    return meta is not None and len(meta.shape) >= 2 and meta.shape[0] == batch


def _requiring_grad(graph: "CapturedGraph") -> set[str]:
    """The nodes whose output requires grad (made from a parameter): only their ops keep anything
    for backward (RoPE's tables, masks and positions, made from inputs and buffers, keep nothing)."""
    found: set[str] = set()
    for node in graph.nodes:
        if node.params or any(p in found for p in node.inputs):
            found.add(node.name)
    return found


def _users(graph: "CapturedGraph") -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for node in graph.nodes:
        for producer in node.inputs:
            found.setdefault(producer, []).append(node.name)
    return found


def _linear_readers(walk: _Walk) -> dict[tuple, int]:
    """How many linears of each layer read each tensor (producer, conversion): the shared casts."""
    found: dict[tuple, int] = {}
    for node in walk.graph.nodes:
        if node.op_kind == "linear":
            key = (walk.edge(node, 0), node.layer)
            found[key] = found.get(key, 0) + 1
    return found

