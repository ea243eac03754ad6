"""The step model: what one full configuration (pp x dp x ep x cp x tp, microbatches, ZeRO, recompute,
schedule) costs per optimizer step, from one tensor-parallel solution split into parts (`autoplan.cost_model.parts`).

Per microbatch and rank, with mbs / C sequences of full length standing for the rank's share (C = cp, or
cp x ep under ep_as = "cp": `Config.context_parallel`; the expert all-to-alls then carry the same tokens per
rank as with the ep ranks splitting the batch)
(`parallel_dims`), a layer costs

    t_layer = compute (+ recompute) + autocast's casts of its GEMM weights and their gradients (`cast_s`)
              + tp communication + Ulysses all-to-alls (attention layers, over the
                cp ranks, or the ep x cp ranks when the ep ranks are context-parallel ranks too, ep_as = "cp")
              + expert dispatch / combine all-to-alls (MoE layers whose experts are spread over more than
                one rank: over ep, or over ep x tp / etp when etp < tp, `parallel_dims`)
              + the expert-TP all-gather / reduce-scatter of the dispatched rows (1 < etp < tp)

Stages: a given partition (`Config.stage_layers`, layers per chunk in flow order), else the stage DP
(`solver.stages`: the time-optimal layers per pipeline rank with the embedding and head weighed,
memory-checked, re-solved under the memory limit only when it does not fit), each rank's layers split
into its v chunks (`cost_model.pipeline.chunk_sizes`; v = 1 under 1F1B). Each stage also pays its p2p
sends (`cost_model.pipeline`). Per optimizer step:

    compute_s       = m * compute of the slowest stage
    communication_s = m * (communication of the slowest stage, p2p included) + exposed data-parallel
                      sync (the largest over stages; `cost_model.dp_sync`)
    bubble_s        = (sum of stage times - slowest) / v
    optimizer_s     = torch's AdamW over the stage's local parameters (ZeRO 1-3: their 1 / data-parallel
                      share), its passes over memory (`optimizer.adamw_time_s`: at a hidden x hidden tensor's
                      size, its tp shard's and ZeRO slice's, where a CPU profile measured copies by size)

Data-parallel sync per stage: `cost_model.dp_sync` (in buckets overlapped with backward, as
`runtime.grad_sync` runs it; ZeRO 1/2 as a distributed optimizer; ZeRO 3 in FSDP2's units).

Memory per rank of a stage: model states of its parts (ZeRO over the data-parallel ranks of each
kind), + in-flight microbatches x activations + the transient, + temporary buffers (the largest tp
collective buffer; ZeRO-2/3 one layer of gradients, ZeRO-3 two layers of gathered weights). With MoE
experts spread over an expert group, activations are the busiest rank's: routed rows at the mean times
1 + `activations.ep_imbalance_margins` (held, or a layer re-run); the
breakdown shows those bytes as their own line (`MemoryBreakdown.ep_imbalance_bytes`) and the
activations at the mean. The reported memory breakdown is that of the stage with the largest total.

The mesh's order of axes over ranks (`Config.order`) enters only through the links: which node each
group of tp, cp (ep x cp under ep_as = "cp"), ep, pp and the data-parallel sync spans, and how many of its
ranks share a node (their NICs), via `parallel_dims.axes_group`; every cache of per-layer times and partitions
is keyed by them.

Ignored: contention between data-parallel, pipeline and tensor-parallel traffic sharing a link (each
is priced as if alone); compute slowed by overlapped communication; expert load imbalance.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import numpy as np

from autoplan.cluster import ClusterSpec
from autoplan.validity import ulysses_kv_heads
from autoplan.cost_model.comm import AxisGroup
from autoplan.cost_model.compute import Efficiency, memory_time_s
from autoplan.cost_model.optimizer import adamw_time_s, optimizer_host_time_s, stepped_tensors
from autoplan.cost_model.dp_sync import DataParallelSync
from autoplan.cost_model.memory import FP32_BYTES, model_state_bytes, state_bytes_for, temporary_bytes
from autoplan.cost_model.parallel_dims import (axes_group, expert_all_to_all_s, expert_tp_exchange_s,
                                               ulysses_all_to_all_s, ulysses_skew_s)
from autoplan.validity import stage_min_layers
from autoplan.cost_model.pipeline import (Part, StageProblem, chunk_ends, chunk_ranges, chunk_sizes,
                                          in_flight_microbatches, p2p_per_microbatch_s, pipeline_buffer_bytes,
                                          pipeline_time_s, sends_kept)
from autoplan.mesh import MeshShape
from autoplan.models.config import ModelConfig
from autoplan.cost_model.parts import BlockCosts, PartCost
from autoplan.plan import MemoryBreakdown, TimeBreakdown
from autoplan.cost_model.step_config import ITEMSIZE, Config
from autoplan.cost_model.step_bounds import rising_floors, step_time_floor_s
from autoplan.cost_model.step_sums import LayerStates, LayerTimes, flat_value, peak_phase, prefix_sums, range_peak


class StagePartitionLike(Protocol):
    """What the step model reads of a partition (`solver.stages.StagePartition`)."""

    bounds: tuple[int, ...]

    @property
    def ranges(self) -> tuple[tuple[int, int], ...]: ...


Partition = Callable[[StageProblem], "StagePartitionLike | None"]


@dataclass(frozen=True)
class StepEnv:
    """What the step model needs besides the solution and the configuration."""

    model: ModelConfig
    cluster: ClusterSpec
    seq_len: int
    dtype: str
    efficiency: Efficiency
    head_dim: int = 0  # the strategy rules' (a Hugging Face config's head_dim may differ from hidden / heads); 0: the model's

    @property
    def memory_limit_bytes(self) -> float:
        return self.cluster.device.memory_bytes


@dataclass(frozen=True)
class Priced:
    """A configuration with its step time, peak memory and stages."""

    config: Config
    variant: str
    time: TimeBreakdown
    memory: MemoryBreakdown  # the stage with the most memory
    stages: tuple[tuple[int, int, int, int], ...]  # (stage, chunk, first layer, last layer)
    stage_time_s: tuple[float, ...]  # per microbatch
    stage_memory_bytes: tuple[float, ...]
    fits: bool

    @property
    def step_time_s(self) -> float:
        return self.time.total_s()

    @property
    def peak_memory_bytes(self) -> float:
        return self.memory.total_bytes()

    def rank_key(self) -> tuple:
        return (self.step_time_s, self.config.sort_key(), self.variant)


class StepModel(DataParallelSync):
    """Prices configurations of one model on one cluster (module docstring); caches what configurations share."""

    def __init__(self, env: StepEnv, partition: Partition) -> None:
        """`partition`: the stage DP (`autoplan.solver.stages.partition_bounds`), which the solver passes in:
        the step model prices a partition, the solver finds it."""
        self.env, self.partition = env, partition
        self._groups: dict[tuple, AxisGroup] = {}
        self._partitions: dict[tuple, tuple[int, ...]] = {}
        self._times: dict[tuple, LayerTimes] = {}
        self._states: dict[tuple, LayerStates] = {}
        self._links_of: dict[MeshShape, tuple[AxisGroup, ...]] = {}
        self._schedules: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
        self._p2p: dict[tuple, float] = {}
        self.floor_memo: dict[tuple, object] = {}  # the floors' cached parts (`memory_floor_bytes`, `cost_model.step_bounds`)
        self._pipeline: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}  # (pp, m, v): per boundary byte

    def group(self, cfg: Config, axes: tuple[str, ...]) -> AxisGroup:
        key = (cfg.pp, cfg.dp, cfg.ep, cfg.cp, cfg.tp, cfg.order, axes, cfg.etp)  # etp: the tp halves' sizes
        if key not in self._groups:
            self._groups[key] = axes_group(cfg.mesh, axes, self.env.cluster.gpus_per_node)
        return self._groups[key]

    # ------------------------------------------------------------------ what configurations share
    def _extra_comm_s(self, block: BlockCosts, cfg: Config, part: PartCost) -> float:
        """Ulysses (with the ranks' skew at them) and expert all-to-alls of one part per microbatch."""
        env, itemsize, total = self.env, ITEMSIZE[self.env.dtype], 0.0
        context = cfg.context_parallel  # the Ulysses group: cp, or ep x cp under ep_as = "cp"
        if context > 1 and part.q_width:
            head_dim = env.head_dim or env.model.head_dim  # kv heads repeated as the runtimes send them (validity.ulysses_kv_heads)
            kv_width = ulysses_kv_heads(round(part.q_width / head_dim), round(part.kv_width / head_dim), context) * head_dim
            total += ulysses_all_to_all_s(cfg.microbatch_size * env.seq_len, part.q_width, kv_width, itemsize,
                                          env.cluster, self.group(cfg, cfg.mesh.context_axes),
                                          env.efficiency)
            total += ulysses_skew_s(part.fwd_compute_s, part.bwd_compute_s, part.attention_s, env.efficiency)
        if cfg.mesh.expert_parallel > 1 and part.moe_layers:  # tokens / tp each under etp < tp (moe_token_share)
            tokens = float(block.microbatch) * env.seq_len * part.moe_token_share
            rows = env.model.dispatched_rows_per_token  # top_k; padded to the expert capacity where set
            total += part.moe_layers * expert_all_to_all_s(tokens, env.model.expert_width, rows, itemsize,
                                                           env.cluster, self.group(cfg, cfg.mesh.expert_axes),
                                                           env.efficiency)
            if 1 < cfg.mesh.etp < cfg.tp:  # the etp peers of one set of experts exchange the dispatched rows
                total += part.moe_layers * expert_tp_exchange_s(
                    tokens, env.model.expert_width, rows, itemsize, env.cluster,
                    self.group(cfg, cfg.mesh.expert_tp_axes), env.efficiency)
        return total

    def _links(self, cfg: Config) -> tuple[AxisGroup, ...]:
        """The context (cp, or ep x cp), expert (ep, or ep x tp / etp) and expert-TP groups' shapes on the
        network: what the per-layer times depend on of the order."""
        links = self._links_of.get(cfg.mesh)  # asked per configuration visited: once per mesh
        if links is None:
            links = self._links_of[cfg.mesh] = (self.group(cfg, cfg.mesh.context_axes),
                                                self.group(cfg, cfg.mesh.expert_axes),
                                                self.group(cfg, cfg.mesh.expert_tp_axes))
        return links

    def times(self, block: BlockCosts, cfg: Config) -> LayerTimes:
        piped = cfg.num_microbatches if cfg.pp > 1 and state_bytes_for(self.env.dtype, cfg.precision).cast else 0
        key = (id(block), cfg.recompute, cfg.cp, cfg.ep, cfg.ep_as, cfg.microbatch_size, self._links(cfg), cfg.precision,
               piped)
        if key not in self._times:
            a = block.arrays(cfg.recompute)
            spread, master = cfg.mesh.expert_parallel, cfg.precision == "bf16-master"  # spread: the expert group
            held = block.activations(cfg.recompute, cfg.context_parallel, spread, True, master)  # the busiest rank's
            mean = block.activations(cfg.recompute, cfg.context_parallel, spread, False, master)  # the ep margin's share
            comm = a["comm"]
            kind, recomputed = block.recomputed(cfg.recompute)
            if cfg.context_parallel > 1 or cfg.mesh.expert_parallel > 1:
                extra = np.array([self._extra_comm_s(block, cfg, p) for p in block.distinct])[block.index]
                # a recomputed layer re-runs its forward all-to-alls (half of forward + backward) in
                # backward: collectives are never cached, as its tp collectives (PartCost.full_comm_s)
                comm = comm + extra * np.where(recomputed & (kind != "none"), 1.5, 1.0)
            cast_f, cast_b = self._cast_phases(cfg, a["cast"] + a["expert"] / cfg.ep, piped)
            if not piped:  # a fully re-run forward casts again in backward (`cast_s`)
                cast_b = cast_b + np.where(recomputed & (kind == "full"), cast_f, 0.0)
            forward, backward = a["forward"] + cast_f, a["backward"] + cast_b
            compute = a["compute"] + cast_f + cast_b
            time = compute + comm
            ends = (block.pre, block.post)  # never recomputed
            casts = [self._cast_phases(cfg, p.cast_params + p.expert_params / cfg.ep, piped) for p in ends]
            ends_f = tuple(p.fwd_compute_s + f for p, (f, _) in zip(ends, casts))
            ends_b = tuple(p.backward_s() + b for p, (_, b) in zip(ends, casts))
            ends = [f + b + p.comm_s() for p, f, b in zip(ends, ends_f, ends_b)]
            prefix = {"time": prefix_sums(time), "compute": prefix_sums(compute), "forward": prefix_sums(forward),
                      "backward": prefix_sums(backward), "activation": prefix_sums(held["activation"]),
                      "imbalance": prefix_sums(held["activation"] - mean["activation"])}
            self._times[key] = LayerTimes(time, prefix, ends[0], ends[1], float(time.sum()) + sum(ends),
                                          held["transient"], (held["pre"], held["post"]), mean["transient"],
                                          (flat_value(held["transient"]), flat_value(mean["transient"])),
                                          ends_forward=ends_f, ends_backward=ends_b)
        return self._times[key]

    def cast_s(self, cfg: Config, cast_params):
        """Seconds of autocast's weight casts per microbatch, each way, over `cast_params` local parameters that
        GEMMs read (a number or an array): forward casts each fp32 weight to the compute dtype as a GEMM reads
        it (read 4, write c bytes), backward converts its gradient back to the fp32 parameter's (read c, write
        4). As the runtime enters autocast (`times`): once per microbatch's forward without pp, so a fully
        recomputed layer casts again in backward; around the whole pipelined step under pp, whose cache casts
        each weight once per step (priced as 1 / m per microbatch) and a recomputed layer reuses. None
        without autocast's copies (fp32, bf16-master: c = 0)."""
        c = state_bytes_for(self.env.dtype, cfg.precision).cast
        return memory_time_s((FP32_BYTES + c) * cast_params, self.env.cluster.device, self.env.efficiency) if c \
            else 0.0 * cast_params  # zeros of the parameters' shape

    def _cast_phases(self, cfg: Config, cast_params, piped: int):
        """(forward, backward) seconds of autocast's casts per microbatch over `cast_params` (`cast_s`); `piped`:
        the microbatches of a pipelined step, whose forward casts once (0 without pp)."""
        each = self.cast_s(cfg, cast_params)
        return (each / piped if piped else each), each

    def _split_states(self, dense, expert, cfg: Config, cast=0.0):
        """(weights, gradients, optimizer) bytes of `dense` and `expert` parameters per rank, `cast` of the
        dense ones read by GEMMs (the experts' all are) under the configuration's precision."""
        data = cfg.data_ranks  # dp x ep x cp hold the same dense shards, dp x cp the same experts
        state = state_bytes_for(self.env.dtype, cfg.precision)
        w, g, o = model_state_bytes(dense, data, cfg.zero_stage, state, cast)
        we, ge, oe = model_state_bytes(expert, data // cfg.ep, cfg.zero_stage, state, expert)
        return w + we, g + ge, o + oe

    def states(self, block: BlockCosts, cfg: Config) -> LayerStates:
        held = cfg.num_microbatches > 1  # a step's gradients live through a later microbatch's forward
        key = (id(block), cfg.zero_stage, cfg.data_ranks, cfg.ep, cfg.precision, held)  # ep_as moves no parameter
        if key not in self._states:
            a = block.arrays("none")
            dense, expert = a["params"], a["expert"] / cfg.ep
            w, g, o = self._split_states(dense, expert, cfg, a["cast"])
            cast, temp = self._step_phase(dense, expert, a["cast"], cfg)
            ends, ends_step = [], []
            for part in (block.pre, block.post):
                e = part.expert_params / cfg.ep
                ends.append((part.params, e, *self._split_states(part.params, e, cfg, part.cast_params)))
                ends_step.append(tuple(float(x) for x in self._step_phase(part.params, e, part.cast_params, cfg)))
            largest = float(np.max(dense + expert)) if dense.size else 0.0
            prefix = {"dense": prefix_sums(dense), "expert": prefix_sums(expert), "weights": prefix_sums(w), "grads": prefix_sums(g),
                      "optimizer": prefix_sums(o), "cast": prefix_sums(cast), "step_temp": prefix_sums(temp),
                      "tensors": prefix_sums(a["tensors"])}
            self._states[key] = LayerStates(w + o + (g if held else 0.0), prefix, ends[0], ends[1],
                                            temporary_bytes(block.comm_buffer_bytes, largest, cfg.zero_stage,
                                                            state_bytes_for(self.env.dtype, cfg.precision)),
                                            grads_held=held, ends_step=(ends_step[0], ends_step[1]))
        return self._states[key]

    def _step_phase(self, dense, expert, cast, cfg: Config):
        """(autocast's weight copies, AdamW's fp32 temporary) bytes of `dense` and `expert` parameters per rank
        (`cast` of the dense ones read by GEMMs): the copies are gone by the optimizer step, and foreach AdamW
        makes one fp32 tensor per parameter it steps (its sqrt of v; 4 B each, of this rank's 1 / data-ranks
        share under ZeRO 1-3), measured on the lent H200 (benchmarks/README.md, one-GPU steps)."""
        state = state_bytes_for(self.env.dtype, cfg.precision)
        data = cfg.data_ranks if cfg.zero_stage >= 1 else 1
        expert_data = cfg.data_ranks // cfg.ep if cfg.zero_stage >= 1 else 1
        return state.cast * (cast + expert), FP32_BYTES * (dense / data + expert / expert_data)

    def lower_bound_s(self, block: BlockCosts, cfg: Config, fewer_recomputed: int = 0) -> float:
        """A floor under `price(block, cfg).step_time_s` whatever partition the stage DP picks
        (`cost_model.step_bounds`, where each part is argued); `fewer_recomputed` = j > 0: under every "full:k"
        with k >= j as well (`cfg` recomputing "full")."""
        return step_time_floor_s(self, block, cfg, fewer_recomputed)

    def priced_above(self, block: BlockCosts, cfg: Config, limit_s: float, fewer_recomputed: int = 0) -> bool:
        """Whether `lower_bound_s` exceeds `limit_s`, its costlier parts found only while needed: what the search
        asks before pricing."""
        return any(floor > limit_s for floor in rising_floors(self, block, cfg, fewer_recomputed))

    def optimizer_s(self, cfg: Config, params: float, tensors: float = 0.0) -> float:
        """AdamW's step over a stage's `params` (ZeRO 1-3: this rank's 1 / data-ranks share of them), on the
        gradients the sync reduced (fp32 under every precision) and, where the parameters are narrower than the
        fp32 masters it steps on (bf16-master, ZeRO 0-2; FSDP2's shards are the fp32 masters), their cast; the
        host's work it exposes over the stage's `tensors` parameter tensors (`optimizer_host_time_s`: the
        tensors themselves, or the fp32 master buckets where the optimizer steps on those); and where it steps
        on masters (`Config.steps_on_masters`), the copy of each bucket's updated values, all-gathered or cast,
        into the parameters (`GradSync.gather_parameters`: read and write w bytes per local parameter)."""
        shard = cfg.data_ranks if cfg.zero_stage >= 1 else 1
        tensor = self.env.model.hidden ** 2 / (cfg.mesh.tp * shard)  # the representative tensor (module docstring)
        state = state_bytes_for(self.env.dtype, cfg.precision)
        weight = FP32_BYTES if cfg.zero_stage == 3 else state.held_weight
        device, efficiency, masters = self.env.cluster.device, self.env.efficiency, cfg.steps_on_masters
        host = optimizer_host_time_s(stepped_tensors(tensors, params / shard, masters), efficiency)
        copy = memory_time_s(2 * state.held_weight * params, device, efficiency) if masters else 0.0
        return adamw_time_s(params / shard, state.held_grad, weight, tensor, device, efficiency) + host + copy

    def memory_floor_bytes(self, block: BlockCosts, cfg: Config) -> float:
        """A floor under the busiest pipeline rank's memory, whatever the partition (given or searched, ranks
        of contiguous layers or interleaved chunks): the ranks' memory sums to at least every layer's and
        both ends' model states, pp temporaries, and the activations held f_min times (f_min: the fewest
        microbatches in flight on any rank; transients >= 0), so the busiest holds at least their mean.
        O(1) from the cached sums: the search drops a configuration whose floor exceeds the device before
        it builds a stage problem, most of a deep model's misfits. The activations are the block's, which the
        order's links do not change: read without the per-layer times (`times`), one set per order."""
        st, spread = self.states(block, cfg), cfg.mesh.expert_parallel
        key = ("held", id(block), cfg.recompute, cfg.context_parallel, spread, cfg.precision)
        if key not in self.floor_memo:  # as `times` holds them: the busiest rank's, both ends included
            held = block.activations(cfg.recompute, cfg.context_parallel, spread, True, cfg.precision == "bf16-master")
            self.floor_memo[key] = float(held["activation"].sum()) + held["pre"] + held["post"]
        # a deep model's search asks this of hundreds of configurations that share their states and their
        # schedule and boundary: each sum is found once per what it reads (the same sums, the same bits)
        states = ("states", id(st))
        if states not in self.floor_memo:  # what forward + backward holds (no gradients in a one-microbatch step)
            self.floor_memo[states] = float(st.static.sum()) + st.held(st.pre) + st.held(st.post)
        sends = ("sends", id(block), cfg.context_parallel, spread, cfg.pp, cfg.num_microbatches, cfg.virtual_stages)
        if sends not in self.floor_memo:  # the pipeline's bytes, exact per rank (their mean), and f_min
            in_flight, _ = self.schedule(cfg)
            self.floor_memo[sends] = (float(self._pipeline_bytes(block, cfg, in_flight).sum()), float(in_flight.min()))
        pipeline, fewest = self.floor_memo[sends]
        return (self.floor_memo[states] + fewest * self.floor_memo[key] + pipeline) / cfg.pp + st.temporary

    def schedule(self, cfg: Config) -> tuple[np.ndarray, np.ndarray]:
        """Microbatches in flight and the fewest layers per pipeline rank: what the schedule alone decides."""
        pp, m, v = cfg.pp, cfg.num_microbatches, cfg.virtual_stages
        if (pp, m, v) not in self._schedules:  # asked per configuration
            self._schedules[(pp, m, v)] = (np.array([in_flight_microbatches(s, pp, m, v) for s in range(pp)]),
                                           np.array(stage_min_layers(pp, v)))
        return self._schedules[(pp, m, v)]

    # ------------------------------------------------------------------ stages
    def stage_problem(self, block: BlockCosts, cfg: Config) -> StageProblem:
        """The partition problem of `cfg` with the tp solution `block` (what `price` partitions)."""
        return self._problem(block, cfg, self.times(block, cfg), self.states(block, cfg))

    def _problem(self, block: BlockCosts, cfg: Config, t: LayerTimes, st: LayerStates) -> StageProblem:
        pp, p2p = cfg.pp, self.p2p_s(block, cfg)
        first = Part(t.pre_s, st.held(st.pre), t.ends_bytes[0])
        last = Part(t.post_s, st.held(st.post), t.ends_bytes[1])
        activation = np.diff(t.prefix["activation"])
        in_flight, min_layers = self.schedule(cfg)
        return StageProblem(t.time, st.static, activation, t.transient, in_flight, self.env.memory_limit_bytes,
                            first, last, np.full(pp, p2p), st.temporary + self._pipeline_bytes(block, cfg, in_flight),
                            min_layers)

    def _pipeline_bytes(self, block: BlockCosts, cfg: Config, in_flight: np.ndarray) -> np.ndarray:
        """Per pipeline rank, the pipeline's receive buffers (`pipeline.pipeline_buffer_bytes`), the most outputs its
        sends keep (`pipeline.sends_kept`) and each sending chunk's output of the microbatches in flight, less
        each receiving chunk's input (its first layer's)."""
        pp, m, v = cfg.pp, cfg.num_microbatches, cfg.virtual_stages
        if pp == 1:
            return np.zeros(1)
        if (pp, m, v) not in self._pipeline:  # per boundary byte, what the schedule alone decides: a walk per rank
            ends = [chunk_ends(s, pp, v) for s in range(pp)]
            self._pipeline[(pp, m, v)] = (
                np.array([pipeline_buffer_bytes(s, pp, m, v, 1.0) / m for s in range(pp)]),  # r + s receive buffers
                np.array([sends_kept(s, pp, m, v) + in_flight[s] * (send - receive) / v
                          for s, (receive, send) in enumerate(ends)]))
        buffers, held = self._pipeline[(pp, m, v)]
        boundary = block.boundary_bytes(cfg.context_parallel, cfg.mesh.expert_parallel, cfg.precision == "bf16-master")
        return boundary * m * buffers + boundary * held  # `pipeline_buffer_bytes`' b m (r + s), then the rest

    def p2p_s(self, block: BlockCosts, cfg: Config) -> float:
        """The sends each pipeline rank pays per microbatch (`pipeline.p2p_per_microbatch_s`): they read of the
        mesh whether it pipelines and whether a pp group leaves its node (the link), asked per configuration."""
        if cfg.pp == 1:
            return 0.0
        v, boundary = cfg.virtual_stages, block.boundary_full_bytes / cfg.tp  # Megatron's scatter / gather: 1 / tp
        key = (v, boundary, self.group(cfg, ("pp",)).nodes > 1)
        if key not in self._p2p:
            e = self.env.efficiency  # a send blocks its receiver as a collective does (`comm`, inside a step)
            self._p2p[key] = p2p_per_microbatch_s(boundary, self.env.cluster, cfg.mesh, v,
                                                  e.collective_call_s + e.collective_sync_s)
        return self._p2p[key]

    def _ranges(self, block: BlockCosts, cfg: Config, problem: StageProblem) -> list[list[tuple[int, int]]]:
        """Layer ranges of each pipeline rank, chunk by chunk: the given partition, else the stage DP's layers
        per rank split into v chunks (module docstring)."""
        sizes = cfg.stage_layers
        if sizes is None:
            sizes = chunk_sizes(np.diff(self._bounds(block, cfg, problem)), cfg.virtual_stages)
        ranges: list[list[tuple[int, int]]] = [[] for _ in range(cfg.pp)]
        for rank, _, a, b in chunk_ranges(sizes, cfg.pp):
            ranges[rank].append((a, b))
        return ranges

    def _bounds(self, block: BlockCosts, cfg: Config, problem: StageProblem) -> tuple[int, ...]:
        """The stage DP's ranks: the fastest partition (memory aside: what it depends on is the key), or,
        where that does not fit, the fastest that does (keyed by the rest of the problem too)."""
        if cfg.pp == 1:  # one stage holds every layer, fitting or not
            return (0, problem.num_layers)
        key = (id(block), cfg.recompute, cfg.cp, cfg.ep, cfg.ep_as, cfg.microbatch_size, self._links(cfg), cfg.pp,
               cfg.virtual_stages)
        if key not in self._partitions:
            fastest = self.partition(StageProblem(problem.layer_time_s, problem.layer_static_bytes,
                                                  problem.layer_activation_bytes, problem.layer_transient_bytes,
                                                  problem.in_flight, np.inf, problem.first, problem.last,
                                                  min_layers=problem.min_layers))
            self._partitions[key] = fastest.bounds
        bounds = self._partitions[key]
        if cfg.pp == 1 or problem.fits(bounds):
            return bounds
        # in flight (pp, m, v), model states (ZeRO over the data ranks), temporaries and sends: the rest
        tight = key + (cfg.num_microbatches, cfg.zero_stage, cfg.data_ranks, cfg.precision, float(problem.overhead_s[0]),
                       tuple(problem.extra_bytes.tolist()))
        if tight not in self._partitions:
            fitting = self.partition(problem)
            self._partitions[tight] = bounds if fitting is None else fitting.bounds
        return self._partitions[tight]

    # ------------------------------------------------------------------ pricing
    def price(self, block: BlockCosts, cfg: Config) -> Priced:
        """Step time and memory of `cfg` with the tp solution `block` (module docstring)."""
        t, st = self.times(block, cfg), self.states(block, cfg)
        problem = self._problem(block, cfg, t, st)
        ranges = self._ranges(block, cfg, problem)
        sums = [self._stage_sums(block, cfg, t, st, problem, s, rs) for s, rs in enumerate(ranges)]
        times = tuple(x["time"] for x in sums)
        memory = tuple(x["memory"] for x in sums)
        steady, bubble = pipeline_time_s(times, cfg.num_microbatches, cfg.virtual_stages)
        slowest, heaviest = int(np.argmax(times)), int(np.argmax(memory))
        compute = cfg.num_microbatches * sums[slowest]["compute"]
        dp_memo: dict[tuple, float] = {}
        dp = max(self._dp_exposed_s(cfg, x, dp_memo) for x in sums)
        h = sums[heaviest]
        breakdown = MemoryBreakdown(h["weights"], h["grads"], h["optimizer_states"], h["activations"], h["temporary"],
                                    h["imbalance"], h["step_phase"])
        stages = tuple((s, chunk, a, b) for chunk in range(cfg.virtual_stages)
                       for s, rs in enumerate(ranges) for k, (a, b) in enumerate(rs) if k == chunk)
        return Priced(cfg, block.variant, TimeBreakdown(compute, steady - compute + dp, bubble,
                                                        max(x["optimizer"] for x in sums)),
                      breakdown, stages, times, memory, memory[heaviest] <= problem.memory_limit_bytes)

    def _stage_sums(self, block: BlockCosts, cfg: Config, t: LayerTimes, st: LayerStates, problem: StageProblem, stage: int,
                    ranges: list[tuple[int, int]]) -> dict[str, float]:
        """Seconds, parameters and bytes of one stage, from prefix sums over its layer ranges and its ends."""
        ends = [(p, e, held, step) for p, e, held, step, here in (
            (block.pre, st.pre, t.ends_bytes[0], st.ends_step[0], stage == 0),
            (block.post, st.post, t.ends_bytes[1], st.ends_step[1], stage == cfg.pp - 1)) if here]
        sums = {k: float(sum(v[b] - v[a] for a, b in ranges)) for k, v in (*t.lists().items(), *st.lists().items())}
        for (p, e, held, step), (forward, backward) in zip(ends, t.ends_compute(stage == 0, stage == cfg.pp - 1)):
            sums["cast"] += step[0]
            sums["step_temp"] += step[1]
            sums["dense"] += e[0]
            sums["expert"] += e[1]
            sums["tensors"] += p.tensors
            sums["weights"] += e[2]
            sums["grads"] += e[3]
            sums["optimizer"] += e[4]
            sums["activation"] += held
            sums["compute"] += forward + backward
            sums["forward"] += forward
            sums["backward"] += backward
        transient = range_peak(problem.layer_transient_bytes, ranges, t.flat[0])
        mean_transient = range_peak(t.mean_transient, ranges, t.flat[1])
        in_flight = float(problem.in_flight[stage])
        imbalance = in_flight * sums["imbalance"] + transient - mean_transient  # the ep margin's bytes
        activations = in_flight * sums["activation"] + transient - imbalance
        time = sums["time"] + (t.pre_s if stage == 0 else 0.0) + (t.post_s if stage == cfg.pp - 1 else 0.0)
        peak = peak_phase(sums, st.grads_held, activations, imbalance, float(problem.extra_bytes[stage]))
        return {
            "time": time + float(problem.overhead_s[stage]), "compute": sums["compute"], "forward": sums["forward"],
            "backward": sums["backward"], "dense": sums["dense"], "expert": sums["expert"],
            "buckets": sum(b - a for a, b in ranges) + 1, **peak,
            "optimizer": self.optimizer_s(cfg, sums["dense"] + sums["expert"], sums["tensors"]),
        }

