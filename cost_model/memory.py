"""Memory per rank: model states under ZeRO, activations saved for backward, temporary buffers.

Model states, mixed precision with Adam (Rajbhandari et al., "ZeRO", SC'20, section 3.1): per
parameter 2 B bf16 weights + 2 B bf16 gradients + 12 B optimizer states (fp32 master copy, momentum,
variance). In float32 training: 4 + 4 + 8 (no master copy). With N the parameters a rank holds after
tensor parallelism, divided over the dp ranks by the ZeRO stage:

    stage 0: 2N + 2N + 12N      stage 1: 2N + 2N + 12N/dp
    stage 2: 2N + 2N/dp + 12N/dp      stage 3: 2N/dp + 2N/dp + 12N/dp

Activations of one microbatch (pp = 1: one microbatch in flight; gradient accumulation frees each
microbatch's activations in its backward), at each tensor's local size under the chosen strategies:
every op keeps the tensors its backward needs (`_saved_inputs`), each (producer, placement) once, as
autograd does when several ops save the same tensor:

    linear, norm       their input (norm also 2 fp32 statistics per token)
    attention          flash kernel (the default): q, k, v, its output and the log-sum-exp (B, Hq, T) fp32,
                       no T x T tensor; materialized kernel (`compute.AttentionKernel`, Megatron-LM before
                       FlashAttention): q, k, v and, per score element, the softmax output (itemsize)
                       and, with attention dropout, its mask (1 B) and the dropped probabilities
                       (itemsize): Korthikanti et al.'s 5 a s^2 b bytes per layer
    pointwise          mul / div: both inputs; add / sub / neg / casts: nothing; others (gelu, silu,
                       tanh, ...): their input
    cross_entropy      fp32 log-probabilities (4 B per logit) and the targets
    embedding          the token ids
    moe                its input, the router logits, and per routed token the gate, up, activation
                       and product (3 f), the expert GEMMs' input row and output row (2 h); a rank runs
                       the rows of the g ranks whose experts' FFN it shares, each row at width f / g:
                       g = tp under "ffn" (every token, each expert's FFN split over tp), etp under
                       "expert" (the rows gathered over the expert_tp group), 1 otherwise; so the full
                       bytes (before the strategy's 1 / tp) are tokens k (3 f + 2 h g) itemsize

Recompute policies:
    none       everything above;
    selective  drops the tensors produced by attention and by pointwise ops that keep their own
               inputs (gelu, silu, mul: the MLP activations), and attention's output and
               log-sum-exp; backward re-runs those ops' forward (`selective_recompute_nodes`);
    full       keeps each layer's input tensors, everything outside the layers, and one layer's
               working set (the layer being recomputed); backward re-runs every layer's forward.

Temporary buffers: the largest tensor a tp collective produces (all-gathered or all-reduced), and
under ZeRO-3 two layers of gathered bf16 weights (the current one and the prefetched next), under
ZeRO-2/3 one layer of full gradients waiting for its reduce-scatter.

Ignored: allocator fragmentation, the CUDA context (the datasheet capacity leaves its headroom),
the loss's fp32 gradient buffer, dropout masks (the built-in models have no dropout).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping

from autoplan.errors import ConfigError
from autoplan.placement import Partial, Placement, Shard
from autoplan.plan import RECOMPUTE_POLICIES, MemoryBreakdown
from autoplan.strategies import Comm, Strategy

if TYPE_CHECKING:
    from autoplan.capture import CapturedGraph, NodeInfo, TensorMeta
    from autoplan.cost_model.compute import AttentionKernel

NO_SAVE_POINTWISE = frozenset({"add", "iadd", "add_", "sub", "isub", "sub_", "neg", "float", "to"})
SAVE_ALL_POINTWISE = frozenset({"mul", "imul", "mul_", "truediv", "div"})
FP32_BYTES = 4
INT64_BYTES = 8
MASK_BYTES = 1  # a dropout mask element (torch keeps a bool mask)


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter of weights, gradients and optimizer states."""

    weight: float
    grad: float
    optimizer: float
    source: str = ""


def state_bytes_for(dtype: str) -> StateBytes:
    """Mixed precision with Adam for bfloat16 / float16; plain fp32 Adam for float32."""
    if dtype in ("bfloat16", "float16"):
        return StateBytes(2, 2, 12, "ZeRO (Rajbhandari et al. 2020) sec. 3.1: fp16 weights + grads, fp32 Adam copy, m, v")
    if dtype == "float32":
        return StateBytes(4, 4, 8, "fp32 weights and grads, Adam m and v")
    raise ConfigError(f"dtype {dtype!r} has no model-state sizes; use bfloat16, float16 or float32")


def model_state_bytes(num_params: float, dp: int, zero_stage: int, state: StateBytes) -> tuple[float, float, float]:
    """(weights, gradients, optimizer states) bytes per rank for `num_params` local parameters."""
    if zero_stage not in (0, 1, 2, 3):
        raise ConfigError(f"zero_stage {zero_stage!r} must be 0, 1, 2 or 3")
    weights = state.weight * num_params / (dp if zero_stage >= 3 else 1)
    grads = state.grad * num_params / (dp if zero_stage >= 2 else 1)
    optimizer = state.optimizer * num_params / (dp if zero_stage >= 1 else 1)
    return weights, grads, optimizer


# ------------------------------------------------------------------------------------- sizes


def local_nbytes(nbytes: float, placement: Placement, tp: int) -> float:
    """Bytes one tp rank holds of a tensor of `nbytes` full bytes under `placement`."""
    return nbytes / tp if isinstance(placement, Shard) else nbytes


def is_batched(meta: "TensorMeta", capture_batch: int) -> bool:
    """Whether a tensor's leading dim is the batch (its size then scales with the microbatch)."""
    return len(meta.shape) >= 2 and meta.shape[0] == capture_batch


def scaled_nbytes(meta: "TensorMeta", capture_batch: int, batch_scale: float) -> float:
    """Full bytes of `meta` at microbatch = capture batch * batch_scale."""
    return meta.nbytes * (batch_scale if is_batched(meta, capture_batch) else 1.0)


def param_placements(node: "NodeInfo", strategy: Strategy) -> list[tuple[str, "TensorMeta", Placement]]:
    """(full name, meta, tp placement) of each parameter the node uses."""
    return [(name, meta, strategy.param_placement(relative))
            for (name, meta), (relative, _) in zip(node.params, node.relative_params)]


def comm_tensor_nbytes(node: "NodeInfo", comm: Comm, capture_batch: int, batch_scale: float) -> float:
    """Full bytes of the tensor a strategy's collective moves (`autoplan.strategies.Comm`)."""
    if comm.tensor == "output":
        return scaled_nbytes(node.output, capture_batch, batch_scale)
    if comm.tensor.startswith("input:"):
        return scaled_nbytes(node.input_metas[int(comm.tensor.split(":")[1])], capture_batch, batch_scale)
    if comm.tensor == "params":
        return float(sum(meta.nbytes for _, meta in node.params))
    if comm.tensor.startswith("param:"):  # one parameter, named relative to the op's module
        suffix = "." + comm.tensor.split(":", 1)[1]
        return float(sum(meta.nbytes for name, meta in node.params if ("." + name).endswith(suffix)))
    if comm.tensor == "stats":
        logits = node.input_metas[0]
        return 3 * FP32_BYTES * logits.numel / logits.shape[-1] * batch_scale
    raise ConfigError(f"node {node.name!r}: collective tensor {comm.tensor!r} is not output, input:<i>, params, "
                      f"param:<name> or stats")


def parameter_count_by_layer(graph: "CapturedGraph", strategies: Mapping[str, Strategy], tp: int
                             ) -> dict[int | None, float]:
    """Parameters one tp rank holds, per layer (None: outside the layers), each parameter once."""
    seen: set[str] = set()
    counts: dict[int | None, float] = defaultdict(float)
    for node in graph.nodes:
        for name, meta, placement in param_placements(node, strategies[node.name]):
            if name not in seen:
                seen.add(name)
                counts[node.layer] += local_nbytes(meta.numel, placement, tp)
    return dict(counts)


def local_parameter_count(graph: "CapturedGraph", strategies: Mapping[str, Strategy], tp: int) -> float:
    """Parameters one tp rank holds (shards count 1/tp)."""
    return float(sum(parameter_count_by_layer(graph, strategies, tp).values()))


# ---------------------------------------------------------------------------------- activations


@dataclass(frozen=True)
class SavedTensor:
    """One tensor kept for backward: its producer (or "<node>:<what>" for op internals), placement,
    bytes per rank at the capture batch, whether it scales with the batch, the layer of the op that
    keeps it, and whether selective recompute drops it."""

    key: str
    placement: str
    nbytes: float
    batched: bool
    layer: int | None
    recomputable: bool


def _cheap_to_recompute(node: "NodeInfo") -> bool:
    return node.op_kind == "attention" or (node.op_kind == "elementwise" and node.target not in NO_SAVE_POINTWISE)


def selective_recompute_nodes(graph: "CapturedGraph") -> tuple[str, ...]:
    """Ops whose forward selective recompute re-runs in backward: attention and pointwise ops that
    keep their own inputs (module docstring)."""
    return tuple(n.name for n in graph.nodes if _cheap_to_recompute(n))


def _saved_inputs(node: "NodeInfo") -> tuple[int, ...]:
    kind = node.op_kind
    if kind in ("linear", "norm", "moe"):
        return (0,)
    if kind in ("attention", "embedding", "cross_entropy"):
        return tuple(range(len(node.inputs)))[: 3 if kind == "attention" else None]
    if kind == "elementwise":
        if node.target in NO_SAVE_POINTWISE:
            return ()
        return tuple(range(len(node.inputs))) if node.target in SAVE_ALL_POINTWISE else (0,)
    return ()


def _internal_tensors(node: "NodeInfo", strategy: Strategy, info: Mapping,
                      attention: "AttentionKernel | None" = None) -> list[tuple[str, float]]:
    """(name, full bytes at the capture batch) of tensors an op keeps besides its inputs."""
    if node.op_kind == "attention":
        batch, seq, width = node.output.shape
        heads = width // int(info.get("head_dim", 128))
        if attention is not None and attention.kind == "materialized":
            scores, itemsize = batch * heads * seq * seq, node.output.nbytes / node.output.numel
            kept = [("probs", scores * itemsize)]
            return kept + ([("mask", scores * MASK_BYTES), ("dropped", scores * itemsize)] if attention.dropout else [])
        return [("out", node.output.nbytes), ("lse", batch * heads * seq * FP32_BYTES)]
    if node.op_kind == "norm":
        return [("stats", 2 * FP32_BYTES * node.output.numel / node.output.shape[-1])]
    if node.op_kind == "cross_entropy":
        return [("logprobs", FP32_BYTES * node.input_metas[0].numel)]
    if node.op_kind == "moe":
        x = node.input_metas[0]
        tokens, hidden = x.numel // x.shape[-1], x.shape[-1]
        experts, _, ffn = dict((n.rsplit(".", 1)[-1], m.shape) for n, m in node.params)["w_gate"]
        top_k = max(1, round((node.fwd_flops - 2 * tokens * hidden * experts) / (6 * tokens * hidden * ffn)))
        itemsize = x.nbytes // x.numel
        served = {"ffn": round(1 / strategy.compute_fraction), "expert": strategy.expert_ffn_split}.get(strategy.name, 1)
        return [("router", tokens * experts * itemsize),
                ("experts", tokens * top_k * (3 * ffn + hidden * served) * itemsize),  # gate, up, product; output
                ("expert_inputs", tokens * top_k * hidden * served * itemsize)]
    return []


def saved_tensors(graph: "CapturedGraph", strategies: Mapping[str, Strategy], tp: int,
                  info: Mapping | None = None, attention: "AttentionKernel | None" = None) -> tuple[SavedTensor, ...]:
    """Every tensor kept for backward at the capture batch (module docstring), each once; `attention`:
    the attention kernel (None: flash)."""
    info = info or {}
    by_name = {n.name: n for n in graph.nodes}
    found: dict[tuple[str, str], SavedTensor] = {}
    for node in graph.nodes:
        strategy = strategies[node.name]
        for i in _saved_inputs(node):
            if node.op_kind == "cross_entropy" and i == 0:
                continue  # replaced by its fp32 log-probabilities
            producer, meta, placement = node.inputs[i], node.input_metas[i], strategy.inputs[i].placement
            key = (producer, str(placement))
            if key not in found:
                found[key] = SavedTensor(producer, str(placement), local_nbytes(meta.nbytes, placement, tp),
                                         is_batched(meta, graph.batch_size), node.layer,
                                         _cheap_to_recompute(by_name[producer]))
        for what, nbytes in _internal_tensors(node, strategy, info, attention):
            found[(f"{node.name}:{what}", "")] = SavedTensor(
                f"{node.name}:{what}", str(strategy.output), nbytes * strategy.compute_fraction, True, node.layer,
                node.op_kind == "attention")
    return tuple(found.values())


def _layer_inputs(graph: "CapturedGraph", strategies: Mapping[str, Strategy], tp: int) -> list[tuple[float, bool]]:
    """(bytes per rank, batched) of each tensor made outside a layer and used inside it (checkpoints)."""
    layer_of = {n.name: n.layer for n in graph.nodes}
    found: dict[str, tuple[float, bool]] = {}
    for node in graph.nodes:
        if node.layer is None:
            continue
        for producer, meta in zip(node.inputs, node.input_metas):
            if layer_of[producer] != node.layer and producer not in found:
                placement = strategies[producer].output
                found[producer] = (local_nbytes(meta.nbytes, placement, tp), is_batched(meta, graph.batch_size))
    return list(found.values())


def activation_bytes(graph: "CapturedGraph", strategies: Mapping[str, Strategy], tp: int, microbatch_size: int,
                     recompute: str, info: Mapping | None = None,
                     saved: tuple[SavedTensor, ...] | None = None, attention: "AttentionKernel | None" = None) -> float:
    """Bytes per rank kept for backward by one microbatch under `recompute` (module docstring)."""
    if recompute not in RECOMPUTE_POLICIES:
        raise ConfigError(f"recompute {recompute!r} must be one of {RECOMPUTE_POLICIES}")
    scale = microbatch_size / graph.batch_size
    saved = saved if saved is not None else saved_tensors(graph, strategies, tp, info, attention)

    def size(nbytes: float, batched: bool) -> float:
        return nbytes * (scale if batched else 1.0)

    if recompute == "none":
        return sum(size(t.nbytes, t.batched) for t in saved)
    if recompute == "selective":
        return sum(size(t.nbytes, t.batched) for t in saved if not t.recomputable)
    outside = sum(size(t.nbytes, t.batched) for t in saved if t.layer is None)
    per_layer: dict[int, float] = defaultdict(float)
    for t in saved:
        if t.layer is not None:
            per_layer[t.layer] += size(t.nbytes, t.batched)
    checkpoints = sum(size(nbytes, batched) for nbytes, batched in _layer_inputs(graph, strategies, tp))
    return outside + checkpoints + max(per_layer.values(), default=0.0)


# ---------------------------------------------------------------------------------- temporaries


def _reshards(src: Placement, dst: Placement, grad_partial: bool) -> bool:
    return src != dst or grad_partial or isinstance(src, Partial)


def comm_buffer_lines(graph: "CapturedGraph", strategies: Mapping[str, Strategy], tp: int
                      ) -> tuple[tuple[float, float], ...]:
    """Each distinct tensor a tp collective produces as (a, b): a * m / B + b full bytes at microbatch m
    (capture batch B; batched tensors have b = 0, the others a = 0). Found in one pass over the nodes, so
    that `largest_comm_buffer_bytes` at many microbatches does not walk the graph again."""
    if tp == 1:
        return ()
    lines: set[tuple[float, float]] = set()
    for node in graph.nodes:
        strategy = strategies[node.name]
        for comm in strategy.fwd_comm + strategy.bwd_comm:
            if not comm.tensor.startswith("param"):  # parameter gradients are reduced in place
                fixed = comm_tensor_nbytes(node, comm, graph.batch_size, 0.0)
                lines.add((comm_tensor_nbytes(node, comm, graph.batch_size, 1.0) - fixed, fixed))
        for producer, meta, spec in zip(node.inputs, node.input_metas, strategy.inputs):
            if _reshards(strategies[producer].output, spec.placement, spec.grad_partial):
                fixed = scaled_nbytes(meta, graph.batch_size, 0.0)
                lines.add((scaled_nbytes(meta, graph.batch_size, 1.0) - fixed, fixed))
    return tuple(sorted(lines))


def largest_comm_buffer_bytes(graph: "CapturedGraph", strategies: Mapping[str, Strategy], tp: int,
                              microbatch_size: float, lines: tuple[tuple[float, float], ...] | None = None) -> float:
    """Full bytes of the largest tensor a tp collective produces (0 when tp == 1); `lines`: the graph's
    `comm_buffer_lines`, when found before."""
    scale = microbatch_size / graph.batch_size
    lines = comm_buffer_lines(graph, strategies, tp) if lines is None else lines
    return max((a * scale + b for a, b in lines), default=0.0)


def largest_layer_parameter_count(graph: "CapturedGraph", strategies: Mapping[str, Strategy], tp: int) -> float:
    """Parameters per tp rank of the largest layer (the nodes outside the layers count as one group)."""
    return max(parameter_count_by_layer(graph, strategies, tp).values(), default=0.0)


def temporary_bytes(comm_buffer_bytes: float, largest_layer_params: float, zero_stage: int, state: StateBytes) -> float:
    """Largest tp communication buffer + ZeRO-3 gathered weights of 2 layers + ZeRO-2/3 one layer's gradients."""
    total = comm_buffer_bytes
    if zero_stage >= 2:
        total += state.grad * largest_layer_params
    if zero_stage == 3:
        total += 2 * state.weight * largest_layer_params
    return total


def memory_breakdown(graph: "CapturedGraph", strategies: Mapping[str, Strategy], tp: int, dp: int,
                     microbatch_size: int, zero_stage: int, recompute: str, dtype: str = "bfloat16",
                     info: Mapping | None = None, attention: "AttentionKernel | None" = None) -> MemoryBreakdown:
    """Peak memory per rank, by component (module docstring)."""
    state = state_bytes_for(dtype)
    weights, grads, optimizer = model_state_bytes(local_parameter_count(graph, strategies, tp), dp, zero_stage, state)
    activations = activation_bytes(graph, strategies, tp, microbatch_size, recompute, info, attention=attention)
    temporary = temporary_bytes(largest_comm_buffer_bytes(graph, strategies, tp, microbatch_size),
                                largest_layer_parameter_count(graph, strategies, tp), zero_stage, state)
    return MemoryBreakdown(weights, grads, optimizer, activations, temporary)

