"""A floor under a configuration's priced step time, whatever stage partition pricing finds: what the search
compares with the K-th best step time before it builds a stage problem or prices (`StepModel.priced_above`, which
stops at the first of `rising_floors` above it; `StepModel.lower_bound_s`, all of them).

`StepModel.price` sums, over pipeline ranks s = 0..pp-1 with t_s the rank's seconds per microbatch (its layers,
its ends, its sends p2p), m microbatches and v chunks per rank:

    step = m max_s t_s + (S - max_s t_s) / v  +  max_s dp_s  +  max_s opt_s,     S = sum_s t_s = T + pp p2p

with T every layer's time and both ends' (`LayerTimes.total_s`, the same whatever the partition), dp_s the
stage's exposed data-parallel sync and opt_s its optimizer step. Each term is bounded on its own:

- pipeline: m max + (S - max) / v grows with max_s t_s (m >= 1 >= 1 / v), and max_s t_s >= S / pp (the mean)
  and >= the least slowest rank of any split of the layers, each at the fastest layer's time
  (`slowest_rank_floor_s`).
- optimizer: AdamW's step over the mean stage's parameters, 1 / pp of all (the busiest holds at least that,
  and the step's time only grows with its bytes, `compute.op_time_s`), and the host's work over every tensor
  under pp = 1, over one tensor under pp > 1 (each stage steps one at least; the tensors stepped, under master
  buckets, are not convex in the stage's share: `optimizer.stepped_tensors`).
- data-parallel sync (`dp_sync_floor_s`): pp = 1 has one stage, every layer and both ends, so its sync is
  known exactly. Under pp > 1 (ZeRO 0/1 only, `validity.zero_problem`) every part of the sync is at least
  (traffic - window) and at least 0, so the largest is at least the mean over stages; the stages' traffic
  sums to at least the whole model's in its own buckets, where a collective's time is affine in its bytes
  with a nonnegative intercept (`comm.collective_is_affine`), and their windows sum to the whole backward.

A "full" configuration stands for the "full:k" the search bisects to from it as well: its floor takes the layers
at the least time any of those that can fit takes (`recomputing_layers_s`, `fewest_fitting_layers`) and the sync
behind "full"'s backward, the longest. The floors read the per-layer arrays' cached sums (`cost_model.step_sums`).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Iterator

import numpy as np

from autoplan.cost_model.comm import collective_is_affine
from autoplan.cost_model.parts import BlockCosts
from autoplan.cost_model.pipeline import MEMORY_RTOL
from autoplan.cost_model.step_config import Config
from autoplan.cost_model.step_sums import LayerStates, LayerTimes
from autoplan.validity import stage_min_layers

if TYPE_CHECKING:  # the step model calls these with itself; no import of it at run time
    from autoplan.cost_model.step import StepModel


def step_time_floor_s(steps: "StepModel", block: BlockCosts, cfg: Config, fewer_recomputed: int = 0) -> float:
    """The floor of the module docstring, every part of it (`rising_floors`)."""
    return max(rising_floors(steps, block, cfg, fewer_recomputed))


def rising_floors(steps: "StepModel", block: BlockCosts, cfg: Config, fewer_recomputed: int = 0) -> Iterator[float]:
    """Floors under `cfg`'s step time, each at least the one before and costlier to find, so that the search
    stops at the first above its K-th best: the pipeline at the mean rank with its sends, + the mean stage's
    optimizer step + the data-parallel sync at its least; then the pipeline at the slowest rank's floor
    (`slowest_rank_floor_s`). `fewer_recomputed` = j > 0 (`cfg` recomputing "full"): floors under every
    "full:k" with k >= j too, which the search prices from a priced "full" (`recomputing_layers_s`): first
    at k = j, then at the fewest k whose memory floor fits (`fewest_fitting_layers`)."""
    t, st = steps.times(block, cfg), steps.states(block, cfg)
    pp, m, v = cfg.pp, cfg.num_microbatches, cfg.virtual_stages
    sends_s, rest_s = pp * steps.p2p_s(block, cfg), optimizer_and_sync_floor_s(steps, block, cfg, t, st)

    def floor_at(layers_s: float) -> float:  # S = layers_s + sends_s: every rank's time, summed
        return (m - 1 / v) * (layers_s + sends_s) / pp + (layers_s + sends_s) / v + rest_s

    fastest, layers_s = t, t.total_s
    if fewer_recomputed:
        fastest = plain_times(steps, block, cfg, t)
        yield floor_at(recomputing_layers_s(fastest, t, fewer_recomputed))
        layers_s = recomputing_layers_s(fastest, t, max(fewer_recomputed, fewest_fitting_layers(steps, block, cfg, t)))
    yield floor_at(layers_s)
    if pp > 1:
        slowest = slowest_rank_floor_s(steps, block, cfg, fastest)
        yield floor_at(layers_s) + (m - 1 / v) * max(0.0, slowest - (layers_s + sends_s) / pp)


def optimizer_and_sync_floor_s(steps: "StepModel", block: BlockCosts, cfg: Config, t: LayerTimes,
                               st: LayerStates) -> float:
    """AdamW's step over the mean stage's parameters and `dp_sync_floor_s` (the sync behind `t`'s backward),
    cached by what they read."""
    key = ("sync", id(t), id(st), cfg.pp, cfg.num_microbatches, cfg.zero_stage, cfg.mesh, cfg.precision)
    if key not in steps.floor_memo:
        whole = whole_model_sums(block, t, st)
        tensors = whole["tensors"] if cfg.pp == 1 else 1.0
        steps.floor_memo[key] = (steps.optimizer_s(cfg, (whole["dense"] + whole["expert"]) / cfg.pp, tensors)
                                 + dp_sync_floor_s(steps, cfg, whole))
    return steps.floor_memo[key]


def recomputing_layers_s(plain: LayerTimes, full: LayerTimes, k: int) -> float:
    """Every layer's time and both ends' of "full:k", k >= 1, with `plain` and `full` the per-layer times of
    recompute "none" and "full": "full:k" re-runs layers 0..k-1 as "full" does and runs the rest as "none"
    does (`BlockCosts.recomputed`), so its layers take N + F[k] - N[k] (N, F: prefix sums of the two), which
    grows with k (a re-run only adds): a floor under every k' >= k."""
    return plain.total_s + max(0.0, float(full.prefix["time"][k] - plain.prefix["time"][k]))


def plain_times(steps: "StepModel", block: BlockCosts, cfg: Config, full: LayerTimes) -> LayerTimes:
    """The per-layer times of `cfg` (times `full`) recomputing "none"; cached."""
    key = ("plain", id(full))
    if key not in steps.floor_memo:
        steps.floor_memo[key] = steps.times(block, cfg.replace(recompute="none"))
    return steps.floor_memo[key]


def fewest_fitting_layers(steps: "StepModel", block: BlockCosts, cfg: Config, full: LayerTimes) -> int:
    """The fewest recomputed layers k whose "full:k" meets its memory floor, for `cfg` recomputing "full" with
    times `full` (every layer where none does). A configuration fits only where its floor does
    (`StepModel.memory_floor_bytes`), which for "full:k" is "none"'s less f_min / pp (A_N[k] - A_F[k]) (A:
    prefix sums of the activations held, f_min: the fewest microbatches in flight): no "full:k" with fewer
    recomputed layers fits. Cached."""
    key = ("fewest", id(full), id(steps.states(block, cfg)), cfg.pp, cfg.num_microbatches, cfg.virtual_stages)
    if key not in steps.floor_memo:
        plain_cfg = cfg.replace(recompute="none")
        plain = plain_times(steps, block, cfg, full)
        in_flight, _ = steps.schedule(cfg)
        over = steps.memory_floor_bytes(block, plain_cfg) - steps.env.memory_limit_bytes * (1 + MEMORY_RTOL)
        shed = (plain.prefix["activation"] - full.prefix["activation"]) * (float(in_flight.min()) / cfg.pp)
        enough = np.flatnonzero(shed >= over)  # recomputing layers 0..k-1 sheds enough at k in `enough`
        steps.floor_memo[key] = int(enough[0]) if enough.size else len(full.time)
    return steps.floor_memo[key]


def slowest_rank_floor_s(steps: "StepModel", block: BlockCosts, cfg: Config, t: LayerTimes) -> float:
    """A floor under the slowest rank's seconds per microbatch, whatever partition pricing takes (the stage
    DP's fastest, the fastest that fits, their layers split into interleaved chunks, or given): rank s holds
    n_s >= least_s layers (`validity.stage_min_layers`), each taking at least tau = the fastest layer's time,
    its ends e_s (the embedding on the first, the head on the last) and its sends, so the slowest takes at
    least min over such counts of max_s (n_s tau + e_s) (`least_slowest_rank_s`), + p2p. Cached per
    (per-layer times, pp, v)."""
    key = (id(t), cfg.pp, cfg.virtual_stages)
    if key not in steps.floor_memo:
        least = stage_min_layers(cfg.pp, cfg.virtual_stages)
        steps.floor_memo[key] = least_slowest_rank_s(float(t.time.min()), t.pre_s, t.post_s, least, len(t.time))
    return steps.floor_memo[key] + steps.p2p_s(block, cfg)


def least_slowest_rank_s(tau: float, first_s: float, last_s: float, least: tuple[int, ...], layers: int) -> float:
    """min over integers n_s >= least[s] with sum n_s = layers of max_s (n_s tau + e_s), e_0 = first_s,
    e_{pp-1} = last_s, the other ranks' 0 (pp >= 2; tau, first_s, last_s >= 0). The slowest rank's time is
    n tau + e of some rank and n, and time T is reached iff every rank can hold its least within T and the
    ranks' capacities floor((T - e_s) / tau) add up to the layers: per kind of rank (first, middle, last), a
    walk up n from just below the mean rank's time (no slowest rank is faster: a capacity is at most
    (T - e_s) / tau) to the least T of that kind reached; the answer is the least of the three. Capacities are
    rounded up within 1e-9 of a whole layer, which can only lower the answer."""
    pp = len(least)
    kinds = [(first_s, least[0], 1), (last_s, least[-1], 1)] + ([(0.0, min(least[1:-1]), pp - 2)] if pp > 2 else [])
    if tau <= 0.0:
        return max(first_s, last_s)

    def reached(limit: float) -> bool:
        caps = [(math.floor((limit - e) / tau + 1e-9), lo, count) for e, lo, count in kinds]
        return all(cap >= lo for cap, lo, _ in caps) and sum(cap * count for cap, _, count in caps) >= layers

    mean, best = (layers * tau + first_s + last_s) / pp, math.inf
    for e, _, _ in kinds:  # from n tau + e < mean - tau: not reached; n = layers + (first_s + last_s) / tau: reached
        n = max(0, math.ceil((mean - e) / tau) - 1)
        while not reached(n * tau + e):
            n += 1
        best = min(best, n * tau + e)
    return best


def whole_model_sums(block: BlockCosts, t: LayerTimes, st: LayerStates) -> dict[str, float]:
    """What `StepModel.dp_sync_parts` reads of a stage, for one stage holding every layer and both ends."""
    return {"dense": float(st.prefix["dense"][-1]) + st.pre[0] + st.post[0],
            "expert": float(st.prefix["expert"][-1]) + st.pre[1] + st.post[1],
            "tensors": float(st.prefix["tensors"][-1]) + block.pre.tensors + block.post.tensors,
            "buckets": block.num_layers + 1,
            "forward": float(t.prefix["forward"][-1]) + sum(t.ends_forward),
            "backward": float(t.prefix["backward"][-1]) + sum(t.ends_backward)}


def dp_sync_floor_s(steps: "StepModel", cfg: Config, whole: dict[str, float]) -> float:
    """A floor under the largest stage's exposed data-parallel sync (module docstring).

    pp = 1: the one stage's sync, as priced. pp > 1, ZeRO 0 (all-reduce A_s) or ZeRO 1 (reduce-scatter R_s
    exposed past the window W_s, all-gather G_s exposed whole): a stage exposes at least A_s - W_s, or
    G_s + R_s - W_s, and at least 0, or G_s; the largest is at least the mean over the pp stages. With
    c(x) = a + b x (a >= 0) each stage's n_s buckets cost n_s a + b x_s, and sum_s ceil(x_s / B) >=
    ceil(sum_s x_s / B), so sum_s A_s >= A, the whole model's traffic in its own buckets (the same for G, R),
    and sum_s W_s = W, the whole backward: floor = max(0, A - W) / pp, or (G + max(0, R - W)) / pp.
    Where a group's collectives are not affine (a profile's samples inside a node), 0 under pp > 1."""
    if cfg.pp == 1:
        return sum(steps.dp_sync_parts(cfg, whole).values())
    if cfg.zero_stage >= 2:  # FSDP2 runs without pp alone (`validity.zero_problem`): no floor to argue
        return 0.0
    groups = steps.dp_groups(cfg, whole)
    efficiency = steps.env.efficiency
    if not all(collective_is_affine(g, efficiency.collectives) for count, g in groups if count and g.size > 1):
        return 0.0
    window = whole["backward"] if efficiency.overlap_grad_reduce else 0.0
    grad, weight = steps.sync_bytes(cfg)
    if cfg.zero_stage == 0:
        return max(0.0, steps.dp_traffic(cfg, whole, groups, "all_reduce", grad)[0] - window) / cfg.pp
    scatter = steps.dp_traffic(cfg, whole, groups, "reduce_scatter", grad)[0]
    gather = steps.dp_traffic(cfg, whole, groups, "all_gather", weight)[0]
    return (gather + max(0.0, scatter - window)) / cfg.pp
