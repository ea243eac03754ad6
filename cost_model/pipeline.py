"""Pipeline parallelism: schedule time, bubble, point-to-point sends, activations in flight.

Schedules (Narayanan et al., SC'21, section 2.2). With m microbatches, pp stages, v virtual stages
(model chunks) per stage (v = 1: plain 1F1B) and t_s the time of one microbatch's forward + backward
on stage s (all its chunks together):

    step_pipeline = m * max_s t_s + (sum_s t_s - max_s t_s) / v
                  = (m + (pp - 1) / v) * t                 when every stage takes t

The first term is the steady state, set by the slowest stage; the second the fill and drain (the
bubble): each other stage's time is paid once more, divided by v because a chunk is 1/v of a stage.
The bubble fraction is (pp - 1) / (v m) of the steady state, as in the paper.

Point-to-point: per microbatch and per chunk, a stage receives the activation of the stage before and
sends its own forward, and the same for gradients backward; a send and a receive run at once on the
full-duplex link, so each stage pays 2 * v * (B / bw + alpha + c) per microbatch (c: a call's fixed cost,
`cost_model.comm`), with B the bytes of the
boundary tensor per rank, over the link the pp axis crosses (`comm.link_for_axis`). With tensor
parallelism each rank sends only its 1 / tp of the boundary: with sequence parallelism it holds only
that; without, Megatron's scatter / gather optimisation (Narayanan et al. 2021, section 4.1) sends 1 / tp
per rank, every rank of a node on its own NIC, and all-gathers it over NVLink on arrival (not priced:
under 1% of a stage's time in their configurations). These sends are counted as exposed: Megatron-LM's
1F1B issues them between compute kernels and waits for them.

Activations in flight (Narayanan et al. 2021, section 2.2; Korthikanti et al. 2022, section 4.2.3):

    1F1B:        stage s keeps min(m, pp - s) microbatches (stage 0 is the peak: pp of them)
    interleaved: stage s runs 2 (pp - s - 1) + (v - 1) pp warm-up chunk forwards before its first
                 backward, each holding 1/v of the stage's activations, so it keeps
                 min(m, (2 (pp - s - 1) + (v - 1) pp + 1) / v) microbatches' worth; stage 0:
                 pp + (pp - 1) / v = pp (1 + (pp - 1) / (pp v)), Korthikanti's factor.

The pipeline's own tensors (measured on gloo, benchmarks/memory_fidelity.py): a receive buffer per
microbatch and direction (`pipeline_buffer_bytes`), each sending chunk's output of every microbatch in
flight (its backward reads it) and the outputs its sends keep (`chunk_in_flight`, `sends_kept`); a
receiving chunk's input is its first layer's input.

Stages of unequal size (Llama 3, Megatron-LM's --decoder-first/last-pipeline-num-layers): the pp x v
chunks are listed in the order the layers flow through them, chunk c of pipeline rank s at position
c pp + s, each a contiguous range of layers (`chunk_ranges`); every chunk holds at least one layer but
the first, which may hold only the embedding, and the last, only the head (`autoplan.validity`). The
stage search chooses how many layers each rank holds (`solver.stages`, over the ranks' contiguous
ranges, the embedding and head weighed, each rank at least `validity.stage_min_layers`) and splits a
rank's layers into its v chunks as evenly as it can (`chunk_sizes`): the first rank's first chunk and
the last rank's last chunk take the smaller shares, beside the embedding and the head. With uneven
chunks t_s still sums the rank's chunks, and the fill and drain are priced at its mean chunk t_s / v.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from autoplan.cluster import ClusterSpec
from autoplan.cost_model.comm import link_for_axis, p2p_time_s
from autoplan.errors import AutoplanError, ConfigError
from autoplan.mesh import MeshShape


MEMORY_RTOL = 1e-9  # prefix-sum and direct sums of the same bytes differ in the last bits


@dataclass(frozen=True)
class Part:
    """A piece pinned to a stage: time (s per microbatch), static, activation and transient bytes."""

    time_s: float = 0.0
    static_bytes: float = 0.0
    activation_bytes: float = 0.0
    transient_bytes: float = 0.0


@dataclass(frozen=True, eq=False)
class StageProblem:
    """Inputs of one partition (module docstring); arrays of length L, per-stage arrays of length pp."""

    layer_time_s: np.ndarray
    layer_static_bytes: np.ndarray
    layer_activation_bytes: np.ndarray
    layer_transient_bytes: np.ndarray
    in_flight: np.ndarray  # (pp,) microbatches of activations stage s keeps
    memory_limit_bytes: float
    first: Part = field(default_factory=Part)
    last: Part = field(default_factory=Part)
    overhead_s: np.ndarray | None = None  # (pp,) per-stage seconds per microbatch, e.g. p2p sends
    extra_bytes: np.ndarray | None = None  # (pp,) per-stage bytes, e.g. temporary buffers
    min_layers: np.ndarray | None = None  # (pp,) the fewest layers each stage holds (None: one each)

    def __post_init__(self) -> None:
        arrays = {}
        for name in ("layer_time_s", "layer_static_bytes", "layer_activation_bytes", "layer_transient_bytes"):
            arrays[name] = np.asarray(getattr(self, name), dtype=np.float64)
        sizes = {a.shape for a in arrays.values()}
        if len(sizes) != 1 or len(next(iter(sizes))) != 1 or next(iter(sizes))[0] < 1:
            raise AutoplanError(f"stage problem: the four layer arrays must be 1-d of one length >= 1, got shapes "
                                f"{[a.shape for a in arrays.values()]}")
        pp = len(np.atleast_1d(self.in_flight))
        arrays["in_flight"] = np.asarray(self.in_flight, dtype=np.float64).reshape(pp)
        arrays["overhead_s"] = np.zeros(pp) if self.overhead_s is None else np.asarray(self.overhead_s, float)
        arrays["extra_bytes"] = np.zeros(pp) if self.extra_bytes is None else np.asarray(self.extra_bytes, float)
        arrays["min_layers"] = np.ones(pp) if self.min_layers is None else np.asarray(self.min_layers, float)
        for name in ("overhead_s", "extra_bytes", "min_layers"):
            if arrays[name].shape != (pp,):
                raise AutoplanError(f"stage problem: {name} must have one entry per stage ({pp}), got {arrays[name].shape}")
        joined = np.concatenate(list(arrays.values()))
        if not (np.isfinite(joined).all() and (joined >= 0).all()):
            bad = [name for name, a in arrays.items() if not (np.isfinite(a).all() and (a >= 0).all())]
            raise AutoplanError(f"stage problem: {', '.join(bad)} must be finite and >= 0, got "
                                f"{[arrays[name].tolist() for name in bad]}")
        for name, array in arrays.items():
            array.setflags(write=False)
            object.__setattr__(self, name, array)

    @property
    def num_layers(self) -> int:
        return int(self.layer_time_s.shape[0])

    @property
    def num_stages(self) -> int:
        return int(self.in_flight.shape[0])

    def stage_time_s(self, stage: int, start: int, end: int) -> float:
        """time(s, i, j) of the module docstring."""
        pp = self.num_stages
        total = float(self.layer_time_s[start:end].sum()) + float(self.overhead_s[stage])
        return total + (self.first.time_s if stage == 0 else 0.0) + (self.last.time_s if stage == pp - 1 else 0.0)

    def stage_memory_bytes(self, stage: int, start: int, end: int) -> float:
        """memory(s, i, j) of the module docstring."""
        pp, f = self.num_stages, float(self.in_flight[stage])
        static = float(self.layer_static_bytes[start:end].sum()) + float(self.extra_bytes[stage])
        act = float(self.layer_activation_bytes[start:end].sum())
        transient = [float(self.layer_transient_bytes[start:end].max())] if end > start else [0.0]
        for part, here in ((self.first, stage == 0), (self.last, stage == pp - 1)):
            if here:
                static, act = static + part.static_bytes, act + part.activation_bytes
                transient.append(part.transient_bytes)
        return static + f * act + max(transient)

    def fits(self, bounds: Sequence[int]) -> bool:
        """Whether every stage of the partition `bounds` holds at most the memory limit, by `stage_memory_bytes`
        (no tolerance). Vectorised over the stages from prefix sums, which differ from its slice sums in the last
        bits: where the largest stage is within 1e-9 of the limit, the answer is `stage_memory_bytes`' own."""
        if not np.isfinite(self.memory_limit_bytes):
            return True
        start, end = np.asarray(bounds[:-1]), np.asarray(bounds[1:])
        sums = [np.concatenate(([0.0], np.cumsum(a)))
                for a in (self.layer_static_bytes, self.layer_activation_bytes)]
        static, act = (prefix[end] - prefix[start] for prefix in sums)
        transient = np.zeros(len(start))
        held = end > start
        if held.any():
            transient[held] = (np.maximum.reduceat(self.layer_transient_bytes, start) if held.all() else
                               [self.layer_transient_bytes[a:b].max() for a, b in zip(start[held], end[held])])
        for part, s in ((self.first, 0), (self.last, self.num_stages - 1)):
            static[s] += part.static_bytes
            act[s] += part.activation_bytes
            transient[s] = max(transient[s], part.transient_bytes)
        memory = static + self.extra_bytes + self.in_flight * act + transient
        largest, limit = float(memory.max()), self.memory_limit_bytes
        if abs(largest - limit) > 1e-9 * limit:
            return largest <= limit
        return max(self.stage_memory_bytes(s, a, b) for s, (a, b) in enumerate(zip(bounds[:-1], bounds[1:]))) <= limit


def in_flight_microbatches(stage: int, pp: int, num_microbatches: int, virtual_stages: int = 1) -> float:
    """Microbatches' worth of activations stage `stage` keeps at its peak (module docstring)."""
    if not 0 <= stage < pp:
        raise ConfigError(f"stage {stage} is outside 0..{pp - 1}")
    if virtual_stages == 1:
        return float(min(num_microbatches, pp - stage))
    warmup = 2 * (pp - stage - 1) + (virtual_stages - 1) * pp
    return float(min(num_microbatches, (warmup + 1) / virtual_stages))


def chunk_in_flight(stage: int, pp: int, num_microbatches: int, virtual_stages: int = 1
                    ) -> list[tuple[tuple[int, ...], int]]:
    """After each forward of rank `stage`, in the order torch.distributed.pipelining's Schedule1F1B (v = 1)
    and ScheduleInterleaved1F1B (Megatron's) run them: (the microbatches each of its v chunks holds, the
    outputs its sends keep alive besides those). Order: w = min(m v, 2 (pp - s - 1) + (v - 1) pp + 1)
    warm-up forwards (1F1B: pp - s), then one backward and one forward in turn; the k-th forward runs
    chunk (k // pp) mod v, the k-th backward chunk v - 1 - (k // pp) mod v. Sends: Schedule1F1B waits on
    each before the next, so one per sending chunk is alive; ScheduleInterleaved1F1B waits on them at the
    end of the step, so every output a chunk has sent lives until then. The largest count sum is
    `in_flight_microbatches` times v."""
    m, v = num_microbatches, virtual_stages
    warmup = min(m, pp - stage) if v == 1 else min(m * v, 2 * (pp - stage - 1) + (v - 1) * pp + 1)
    sending = [c * pp + stage < pp * v - 1 for c in range(v)]
    counts, done, states = [0] * v, [0] * v, []
    for k in range(m * v):
        if k >= warmup:  # steady state: the backward before this forward
            counts[v - 1 - ((k - warmup) // pp) % v] -= 1
        counts[(k // pp) % v] += 1
        done[(k // pp) % v] += 1
        kept = sum(sending) if v == 1 else sum(d - n for d, n, out in zip(done, counts, sending) if out)
        states.append((tuple(counts), kept))
    return states


@functools.lru_cache(maxsize=4096)  # a pure function of four ints, asked per stage of every configuration a search prices
def sends_kept(stage: int, pp: int, num_microbatches: int, virtual_stages: int = 1) -> int:
    """The most outputs rank `stage`'s sends keep alive besides those in flight (`chunk_in_flight`); under
    1F1B (one chunk) one output while a send is waited on, none on the last rank, without the walk."""
    if virtual_stages == 1:
        return int(stage < pp - 1 and num_microbatches > 0)
    return max(kept for _, kept in chunk_in_flight(stage, pp, num_microbatches, virtual_stages))


def chunk_ends(stage: int, pp: int, virtual_stages: int = 1) -> tuple[int, int]:
    """(chunks of rank `stage` that receive activations, chunks that send them): all but the first of the
    pp v chunks receive, all but the last send."""
    chunks = [c * pp + stage for c in range(virtual_stages)]
    return sum(i > 0 for i in chunks), sum(i < pp * virtual_stages - 1 for i in chunks)


def pipeline_buffer_bytes(stage: int, pp: int, num_microbatches: int, virtual_stages: int, boundary_bytes: float
                          ) -> float:
    """Bytes of the receive buffers torch.distributed.pipelining keeps on rank `stage`, b = `boundary_bytes` per
    microbatch: b m (r + s), one per microbatch for each of its r chunks receiving activations and s receiving
    gradients (the chunks that send; `chunk_ends`), made at the first step and kept."""
    receiving, sending = chunk_ends(stage, pp, virtual_stages)
    return boundary_bytes * num_microbatches * (receiving + sending)


def pipeline_time_s(stage_times_s: Sequence[float], num_microbatches: int, virtual_stages: int = 1
                    ) -> tuple[float, float]:
    """(steady-state seconds, bubble seconds) of one step (module docstring)."""
    if not stage_times_s or num_microbatches < 1 or virtual_stages < 1:
        raise ConfigError(f"pipeline time needs >= 1 stage, >= 1 microbatch and >= 1 virtual stage; got "
                          f"{len(stage_times_s)} stages, m={num_microbatches}, v={virtual_stages}")
    slowest = max(stage_times_s)
    return num_microbatches * slowest, (sum(stage_times_s) - slowest) / virtual_stages


def p2p_per_microbatch_s(boundary_bytes: float, cluster: ClusterSpec, mesh: MeshShape, virtual_stages: int = 1,
                         call_s: float = 0.0) -> float:
    """Seconds of stage-to-stage sends one stage pays per microbatch (0 without pipelining); `call_s`: the
    fixed cost of each send (`cost_model.comm`)."""
    if mesh.pp == 1:
        return 0.0
    link = link_for_axis(cluster, mesh, "pp")
    return 2 * virtual_stages * (call_s + p2p_time_s(boundary_bytes, link.bandwidth_bytes_per_s, link.latency_s))


def chunk_sizes(rank_layers: Sequence[int], virtual_stages: int) -> tuple[int, ...]:
    """Layers per chunk, in flow order (module docstring), from the layers of each pipeline rank: rank s's
    n_s layers as v chunks of floor(n_s / v) or one more, the extra layers on the first rank's last chunks
    and every other rank's first chunks (so the embedding's and the head's chunks get the smaller shares)."""
    pp, per_rank = len(rank_layers), []
    for s, n in enumerate(rank_layers):
        base, extra = divmod(int(n), virtual_stages)
        sizes = [base + (c < extra) for c in range(virtual_stages)]
        per_rank.append(sizes[::-1] if s == 0 and pp > 1 else sizes)
    return tuple(per_rank[s][c] for c in range(virtual_stages) for s in range(pp))


def chunk_ranges(stage_layers: Sequence[int], pp: int) -> tuple[tuple[int, int, int, int], ...]:
    """(rank, chunk, first layer, end layer) of each chunk, in flow order, from the layers per chunk in
    flow order (position c pp + s is chunk c of rank s)."""
    if not stage_layers or len(stage_layers) % pp:
        raise ConfigError(f"{len(stage_layers)} chunk sizes do not make v chunks on each of pp={pp} pipeline ranks")
    bounds = np.concatenate(([0], np.cumsum(stage_layers))).astype(int)
    return tuple((k % pp, k // pp, int(bounds[k]), int(bounds[k + 1])) for k in range(len(stage_layers)))
