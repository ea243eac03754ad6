"""Memory per rank: model states under ZeRO, activations saved for backward, temporary buffers.

Model states with AdamW, as the runtime holds them under the plan's precision (`autoplan.plan.PRECISIONS`;
`runtime.grad_sync`, `runtime.zero`). N the parameters a rank holds after tensor parallelism, D the data
ranks ZeRO divides them over (ZeRO 2 runs as ZeRO 1: `zero_as_run`), C the parameters GEMMs read (linear
and MoE weights), all in bytes per parameter:

                          weights           gradients   optimizer (m, v; fp32 master)
    float32, ZeRO 0       4N                4N          8N
    autocast, ZeRO 0      4N + 2C           4N          8N               fp32 parameters (gradients: views
                                                                         of the all-reduced buckets); autocast's bf16
                                                                         copy of each weight lives from its
                                                                         forward to its backward
    bf16-master, ZeRO 0   2N                4N          8N + 4N          Megatron-LM's 18 bytes: fp32 main
                                                                         gradients, fp32 masters
    ZeRO 1/2              as ZeRO 0         4N + 4N/D   (8N + 4N) / D    the distributed optimizer's fp32
                                                                         master slices (a copy under every
                                                                         precision); the flat buckets and
                                                                         the reduced slices at backward's end
    ZeRO 3 (FSDP2)        4N/D (+ 2C)       4N/D        8N / D           fp32 shards (the masters under
                                                                         bf16-master), fp32 reduce-scatter

The ZeRO paper's 2 + 2 + 12 (Rajbhandari et al., SC'20, sec. 3.1) is what `StateBytes.weight`, `grad`
and `optimizer` still say: what the intra-op problem and the search's memory messages count. The
data-parallel sync moves what the runtime holds (`dp_sync_bytes`): fp32 gradients under every precision,
weights in the dtype the ranks compute with.

Activations of one microbatch, per recompute policy: `cost_model.activations` (the storages the
runtime keeps for backward, and what a recomputed layer keeps of them); `memory_breakdown` adds them
for pp = 1 (one microbatch in flight; gradient accumulation frees each microbatch's activations in
its backward) with the transient of the layer being re-run. Under ep the busiest rank's: the rows a
rank's experts receive priced with the routing imbalance margins (`activations.ep_imbalance_margins`).

Temporary buffers: the largest tensor a tp collective produces (all-gathered or all-reduced), and
under ZeRO-3 two layers of gathered weights (the current one and the prefetched next: fp32 under
autocast, bf16 under bf16-master's FSDP2 policy) and one layer of full gradients waiting for its
reduce-scatter.

Ignored: allocator fragmentation, the CUDA context (the datasheet capacity leaves its headroom),
the loss's fp32 gradient buffer.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping

from autoplan.errors import ConfigError
from autoplan.placement import Partial, Placement, Replicate, Shard
from autoplan.cost_model.activations import RunShape, activations
from autoplan.cost_model.pipeline import chunk_in_flight, pipeline_buffer_bytes
from autoplan.cost_model.storages import Activations, _at, activation_bytes
from autoplan.cost_model.kernels import fused_kernels
from autoplan.plan import MemoryBreakdown, Plan
from autoplan.recompute_policy import recompute_policy
from autoplan.strategies import Comm, InputSpec, Strategy

if TYPE_CHECKING:
    from autoplan.capture import CapturedGraph, NodeInfo, TensorMeta
    from autoplan.cost_model.compute import AttentionKernel

FP32_BYTES = 4
CAST_KINDS = ("linear", "moe")  # the ops whose weights autocast copies to the compute dtype


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter. `weight`, `grad`, `optimizer`: the ZeRO paper's (module docstring; the
    intra-op problem's memory). What a rank holds under the plan's precision: `held_weight` (the
    parameters), `held_grad` (the gradients reduced; `dp_sync_bytes`: what the sync moves), `moments`
    (AdamW's m and v), `master` (an fp32 copy the optimizer steps on, under ZeRO 0; ZeRO 1/2 always slice
    one), `cast` (autocast's copy of each GEMM weight), `gathered` (a ZeRO 3 unit's weights gathered for
    compute)."""

    weight: float
    grad: float
    optimizer: float
    source: str = ""
    held_weight: float = 4.0
    held_grad: float = 4.0
    moments: float = 8.0
    master: float = 0.0
    cast: float = 0.0
    gathered: float = 4.0


def state_bytes_for(dtype: str, precision: str = "autocast") -> StateBytes:
    """The bytes of `dtype` under `precision` (module docstring)."""
    if dtype in ("bfloat16", "float16"):
        paper = (2, 2, 12, "ZeRO (Rajbhandari et al. 2020) sec. 3.1: fp16 weights + grads, fp32 Adam copy, m, v")
        if precision == "bf16-master":
            return StateBytes(*paper, held_weight=2, master=FP32_BYTES, gathered=2)
        return StateBytes(*paper, cast=2)
    if dtype == "float32":
        return StateBytes(4, 4, 8, "fp32 weights and grads, Adam m and v")
    raise ConfigError(f"dtype {dtype!r} has no model-state sizes; use bfloat16, float16 or float32")


def dp_sync_bytes(dtype: str, precision: str, zero_stage: int) -> tuple[float, float]:
    """(gradient, weight) bytes per parameter that the data-parallel sync moves, as the runtime moves them
    (`runtime.grad_sync`, `runtime.zero`). Gradients are reduced (ZeRO 0's all-reduce, ZeRO 1-3's
    reduce-scatter) in `held_grad`'s fp32 under every precision: autocast's are the fp32 parameters' own,
    bf16-master's the fp32 main gradients (Megatron-LM's accumulate_allreduce_grads_in_fp32), ZeRO 3's in
    FSDP2's reduce_dtype fp32. Weights are all-gathered as the ranks compute with them: ZeRO 1/2's updated
    slices in the parameters' dtype (`held_weight`: bf16 under bf16-master, fp32 otherwise), ZeRO 3's units
    in the policy's param_dtype (`gathered`); ZeRO 0 gathers none."""
    state = state_bytes_for(dtype, precision)
    gathered = {0: 0.0, 3: state.gathered}.get(zero_stage, state.held_weight)
    return state.held_grad, gathered


def zero_as_run(zero_stage: int) -> int:
    """The ZeRO stage whose memory the runtime holds: ZeRO 2 runs as ZeRO 1 (`runtime.grad_sync`'s
    distributed optimizer keeps whole gradients until the step; ZeRO 3 is FSDP2's)."""
    return 1 if zero_stage == 2 else zero_stage


def model_state_bytes(num_params: float, dp: int, zero_stage: int, state: StateBytes,
                      cast_params: float = 0.0) -> tuple[float, float, float]:
    """(weights, gradients, optimizer states) bytes per rank for `num_params` local parameters, of which
    `cast_params` are GEMM weights (module docstring's table; ZeRO 2 as it runs: `zero_as_run`)."""
    if zero_stage not in (0, 1, 2, 3):
        raise ConfigError(f"zero_stage {zero_stage!r} must be 0, 1, 2 or 3")
    zero_stage, n, cast = zero_as_run(zero_stage), num_params, state.cast * cast_params
    if zero_stage == 3:  # FSDP2: fp32 shards of parameters, gradients and moments
        return FP32_BYTES * n / dp + cast, FP32_BYTES * n / dp, state.moments * n / dp
    if zero_stage == 0:
        return state.held_weight * n + cast, state.held_grad * n, (state.moments + state.master) * n
    # the flat buckets reduce-scattered (the gradients dropped once flattened) and the slices received
    return state.held_weight * n + cast, (state.held_grad + FP32_BYTES / dp) * n, (state.moments + FP32_BYTES) * n / dp


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
    """Largest tp communication buffer + ZeRO-3 gathered weights of 2 layers + ZeRO-3 one layer's
    gradients, unsharded in the compute weights' dtype (ZeRO 2 runs as ZeRO 1: `zero_as_run`)."""
    total = comm_buffer_bytes
    zero_stage = zero_as_run(zero_stage)
    if zero_stage == 3:
        total += 3 * state.gathered * largest_layer_params
    return total


def cast_parameter_count(graph: "CapturedGraph", strategies: Mapping[str, Strategy], tp: int) -> float:
    """Parameters one tp rank holds that GEMMs read (linear and MoE weights: autocast copies them)."""
    seen: set[str] = set()
    count = 0.0
    for node in graph.nodes:
        if node.op_kind not in CAST_KINDS:
            continue
        for name, meta, placement in param_placements(node, strategies[node.name]):
            if name not in seen:
                seen.add(name)
                count += local_nbytes(meta.numel, placement, tp)
    return count


def memory_breakdown(graph: "CapturedGraph", strategies: Mapping[str, Strategy], tp: int, dp: int,
                     microbatch_size: int, zero_stage: int, recompute: str, dtype: str = "bfloat16",
                     info: Mapping | None = None, attention: "AttentionKernel | None" = None,
                     precision: str = "autocast") -> MemoryBreakdown:
    """Peak memory per rank, by component (module docstring)."""
    state = state_bytes_for(dtype, precision)
    weights, grads, optimizer = model_state_bytes(local_parameter_count(graph, strategies, tp), dp, zero_stage, state,
                                                  cast_parameter_count(graph, strategies, tp))
    acts = activations(graph, strategies, tp, info, RunShape(mixed=dtype != "float32", master=precision == "bf16-master"),
                       attention)
    kept, transient = activation_bytes(acts, recompute_policy(recompute), microbatch_size / graph.batch_size)
    activations_held = kept + transient
    temporary = temporary_bytes(largest_comm_buffer_bytes(graph, strategies, tp, microbatch_size),
                                largest_layer_parameter_count(graph, strategies, tp), zero_stage, state)
    return MemoryBreakdown(weights, grads, optimizer, activations_held, temporary)


def plan_activations(plan: Plan, graph: "CapturedGraph", info: Mapping, imbalance: bool = True
                     ) -> tuple[Activations, float]:
    """(the storages one forward of `plan` keeps on a rank, at `graph`'s batch; the scale to the plan's
    microbatch per rank), from its resolved strategies over `graph` (captured at any batch of the plan's
    sequence length); `info`: the model's rule info (`ModelConfig.rule_info`); `imbalance`: spread experts'
    routed rows priced for the busiest rank (`RunShape.imbalance`), or (False) at the expert group's mean."""
    mesh = plan.mesh
    strategies = {op.node: op.resolved for op in plan.ops if op.resolved is not None}
    missing = [n.name for n in graph.nodes if n.name not in strategies and n.op_kind not in ("placeholder", "output")]
    if missing:
        raise ConfigError(f"plan has no resolved strategy for nodes {missing[:3]}: it was made for another graph "
                          f"or by hand; re-make it with `autoplan search` or `autoplan estimate`")
    for node in graph.nodes:
        strategies.setdefault(node.name, _replicated(node))
    triton = fused_kernels(plan.kernels, plan.cluster.device).triton  # what the runtime runs on that device
    shape = RunShape(plan.dtype != "float32", mesh.context_parallel, mesh.expert_parallel, triton, imbalance,
                     plan.precision == "bf16-master")
    info = {**info, "etp": mesh.etp} if mesh.etp != mesh.tp else dict(info)
    acts = activations(graph, strategies, mesh.tp, info, shape)
    return acts, plan.microbatch_size / mesh.context_parallel / graph.batch_size


def plan_activation_bytes(plan: Plan, graph: "CapturedGraph", info: Mapping, imbalance: bool = True
                          ) -> tuple[float, float]:
    """(bytes one rank holds after a microbatch's forward, the most a recomputed layer adds while backward
    re-runs it) for `plan` with pp = 1 (`plan_activations`): under ep, the busiest rank's (the routed rows
    with the imbalance margins; `imbalance` False: the mean over the expert group)."""
    if plan.mesh.pp != 1:
        raise ConfigError(f"plan_activation_bytes prices one stage holding every layer; the plan has "
                          f"pp={plan.mesh.pp}")
    acts, scale = plan_activations(plan, graph, info, imbalance)
    return activation_bytes(acts, recompute_policy(plan.recompute), scale)


def stage_activation_bytes(plan: Plan, graph: "CapturedGraph", info: Mapping, imbalance: bool = True
                           ) -> list[tuple[float, float]]:
    """Per pipeline rank s: (the most bytes of activations its forwards leave alive at once, the most one of
    its recomputed layers adds while backward re-runs it), for the runtime's torch.distributed.pipelining
    schedules:

        held_s = max over the schedule's forwards of  sum_c n_c * a_c  +  pipeline_buffer_bytes(s)

    n_c the microbatches chunk c of the rank holds then (`pipeline.chunk_in_flight`), a_c what one microbatch
    leaves on it: its parts' held bytes (`Activations.held` under the policy; the embedding with global chunk
    0, the head with the last) plus b if it sends its output on (kept for its backward) less b if it
    receives its input (the receive buffer, counted in the buffers), b = `Activations.boundary_bytes`.
    Schedule1F1B's loop holds the previous microbatch's output (the logits) until the next forward
    returns; the outputs the sends keep besides those in flight are `chunk_in_flight`'s. Every rank makes
    its own RoPE tables, once."""
    acts, scale = plan_activations(plan, graph, info, imbalance)
    policy = recompute_policy(plan.recompute)
    recomputed = set(policy.recomputed_layers(len(acts.layers)))
    margins = acts.policy_margins(policy.kind, len(recomputed))
    none, _ = acts.held("none", margins)
    kept, transient = acts.held(policy.kind, margins)
    held_by = {p: _at(kept[p] if p in recomputed else none[p], scale) for p in none}
    resident = sum(acts.storages[k].nbytes for k in acts.resident)  # once per rank, not per microbatch
    held_by["pre"] -= resident
    mesh, m, chunks, last = plan.mesh, plan.num_microbatches, len(plan.stages) // plan.mesh.pp, len(plan.stages) - 1
    boundary, logits = acts.boundary_bytes * scale, _loss_input_bytes(acts, graph) * scale
    found = []
    for s in range(mesh.pp):
        mine = [spec for spec in plan.stages if spec.stage == s]
        per_chunk = [0.0] * chunks
        for spec in mine:
            index = spec.chunk * mesh.pp + spec.stage
            parts = [*range(spec.first_layer, spec.last_layer), *(["pre"] if index == 0 else []),
                     *(["post"] if index == last else [])]
            per_chunk[spec.chunk] = sum(held_by[p] for p in parts) + boundary * ((index < last) - (index > 0))
        held = max(sum(n * a for n, a in zip(counts, per_chunk)) + kept * boundary
                   for counts, kept in chunk_in_flight(s, mesh.pp, m, chunks))
        held += pipeline_buffer_bytes(s, mesh.pp, m, chunks, boundary)
        held += resident
        held += logits if s == mesh.pp - 1 and chunks == 1 and m > 1 else 0.0
        layers = [i for spec in mine for i in range(spec.first_layer, spec.last_layer) if i in recomputed]
        found.append((held, max((_at(transient[i], scale) for i in layers), default=0.0)))
    return found


def _loss_input_bytes(acts: Activations, graph: "CapturedGraph") -> float:
    """Bytes at the capture batch of the logits the loss reads (the last stage's output), as the walk holds them."""
    node = next((n for n in graph.nodes if n.op_kind == "cross_entropy"), None)
    storage = acts.storages.get(f"out:{node.inputs[0]}") if node is not None else None
    return storage.nbytes if storage is not None else 0.0


def _replicated(node: "NodeInfo") -> Strategy:
    """The strategy of a placeholder or output node, which plans may leave out: everything replicated."""
    return Strategy("replicate", tuple(InputSpec(Replicate()) for _ in node.inputs), Replicate())
