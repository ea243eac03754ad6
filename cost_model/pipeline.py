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
full-duplex link, so each stage pays 2 * v * (B / bw + alpha) per microbatch, with B the bytes of the
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

Interleaving needs the layers divisible by pp * v (uniform chunks; chunk c of stage s holds layers
[(c pp + s) k, (c pp + s + 1) k) with k = L / (pp v)) and m divisible by pp (Megatron-LM's rule).
"""

from __future__ import annotations

from typing import Sequence

from autoplan.cluster import ClusterSpec
from autoplan.cost_model.comm import link_for_axis, p2p_time_s
from autoplan.errors import ConfigError
from autoplan.mesh import MeshShape

SCHEDULE_1F1B = "1f1b"
SCHEDULE_INTERLEAVED = "interleaved-1f1b"


def in_flight_microbatches(stage: int, pp: int, num_microbatches: int, virtual_stages: int = 1) -> float:
    """Microbatches' worth of activations stage `stage` keeps at its peak (module docstring)."""
    if not 0 <= stage < pp:
        raise ConfigError(f"stage {stage} is outside 0..{pp - 1}")
    if virtual_stages == 1:
        return float(min(num_microbatches, pp - stage))
    warmup = 2 * (pp - stage - 1) + (virtual_stages - 1) * pp
    return float(min(num_microbatches, (warmup + 1) / virtual_stages))


def pipeline_time_s(stage_times_s: Sequence[float], num_microbatches: int, virtual_stages: int = 1
                    ) -> tuple[float, float]:
    """(steady-state seconds, bubble seconds) of one step (module docstring)."""
    if not stage_times_s or num_microbatches < 1 or virtual_stages < 1:
        raise ConfigError(f"pipeline time needs >= 1 stage, >= 1 microbatch and >= 1 virtual stage; got "
                          f"{len(stage_times_s)} stages, m={num_microbatches}, v={virtual_stages}")
    slowest = max(stage_times_s)
    return num_microbatches * slowest, (sum(stage_times_s) - slowest) / virtual_stages


def p2p_per_microbatch_s(boundary_bytes: float, cluster: ClusterSpec, mesh: MeshShape, virtual_stages: int = 1) -> float:
    """Seconds of stage-to-stage sends one stage pays per microbatch (0 without pipelining)."""
    if mesh.pp == 1:
        return 0.0
    link = link_for_axis(cluster, mesh, "pp")
    return 2 * virtual_stages * p2p_time_s(boundary_bytes, link.bandwidth_bytes_per_s, link.latency_s)


def interleaved_chunks(num_layers: int, pp: int, virtual_stages: int) -> tuple[tuple[int, int, int, int], ...]:
    """(stage, chunk, first layer, last layer) of each uniform chunk of the interleaved schedule."""
    chunks = pp * virtual_stages
    if num_layers % chunks:
        raise ConfigError(f"interleaving needs the {num_layers} layers divisible by pp x v = {pp} x {virtual_stages}")
    k = num_layers // chunks
    return tuple((s, c, (c * pp + s) * k, (c * pp + s + 1) * k) for c in range(virtual_stages) for s in range(pp))
