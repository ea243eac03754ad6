"""One tensor-parallel solution split into the parts a pipeline stage is made of, each priced per microbatch.

Parts: the nodes before the first layer ("embedding", pinned to stage 0), each layer, and the nodes
after the last layer ("head": final norm, lm_head, loss; pinned to the last stage). A part's costs
(`PartCost`), per microbatch and tp rank:

    seconds      the op and resharding costs of its nodes (`cost_model.intra_op.price_assignment` on
                 the part; a resharding edge counts at its consumer), split into forward / backward
                 compute and communication; a recomputed layer re-runs its forward compute but that
                 of the op families its policy saves, and all of its forward communication
                 (`autoplan.recompute_policy`: collectives are never saved)
    parameters   per tp rank, each parameter once; expert FFN weights apart (ep divides them)
    activations  what a part holds after forward, per recompute kind, and what a recomputed layer holds
                 while backward re-runs it (`cost_model.activations.Activations.held`), for the run
                 shape a configuration gives (context-parallel group, experts spread): computed once per
                 (solution, shape), scaled to the microbatch

Layers whose nodes, strategies, input placements and tallies are equal share one PartCost, so a
96-layer model prices a handful of parts; the passes over nodes that find them (tallies, boundary, what
each op keeps) walk a representative graph of a few layers per run of alike ones (`cost_model.layer_runs`). The microbatch-independent facts of a solution
(`SolutionParts`) are computed once; `block_costs` scales them to a microbatch (possibly a fraction
of a sequence: mbs / cp sequences per rank under context parallelism), re-pricing time at that size.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from fractions import Fraction
from typing import TYPE_CHECKING, Mapping

import numpy as np

from autoplan.cost_model.storages import Activations
from autoplan.cost_model.intra_op import CostContext, price_assignment
from autoplan.cost_model.memory import (CAST_KINDS, comm_buffer_lines, is_batched, largest_comm_buffer_bytes, local_nbytes,
                                        param_placements)
from autoplan.placement import Shard
from autoplan.recompute_policy import KINDS, recompute_policy
from autoplan.strategies import Strategy, is_expert_weight

if TYPE_CHECKING:
    from autoplan.capture import CapturedGraph, NodeInfo
    from autoplan.cost_model.assignment import TpSolution
    from autoplan.cost_model.layer_runs import LayerRuns



@dataclass(frozen=True)
class PartCost:
    """Per microbatch and tp rank: seconds and parameters of one part (activations: `BlockCosts`)."""

    fwd_compute_s: float
    bwd_compute_s: float
    fwd_comm_s: float
    bwd_comm_s: float
    recompute_s: tuple[float, ...]  # per recompute kind (`KINDS` order): forward compute it re-runs
    full_comm_s: float  # forward tp communication a recomputed layer re-runs, whatever the kind
    params: float  # dense parameters per tp rank
    expert_params: float  # expert FFN weights per tp rank (ep divides them)
    is_layer: bool
    cast_params: float = 0.0  # dense parameters GEMMs read (autocast copies them; experts' all are)
    q_width: float = 0.0  # attention q features per tp rank (0: no attention)
    kv_width: float = 0.0
    moe_layers: int = 0
    moe_token_share: float = 1.0  # of the rank's tokens its MoE dispatches (1 / tp when tokens are split)
    attention_s: tuple[float, float] = (0.0, 0.0)  # its attention core's (forward, backward) compute
    tensors: int = 0  # parameter tensors (`Tally.tensors`)

    def compute_s(self, kind: str = "none") -> float:
        """Forward and backward compute, with the forward a recompute kind re-runs ("none": this part is
        not recomputed)."""
        return self.fwd_compute_s + self.bwd_compute_s + self.recompute_s[list(KINDS).index(kind)]

    def backward_s(self, kind: str = "none") -> float:
        """The backward window (with the forward recomputed inside it)."""
        return self.compute_s(kind) - self.fwd_compute_s

    def comm_s(self, kind: str = "none") -> float:
        return self.fwd_comm_s + self.bwd_comm_s + (self.full_comm_s if kind != "none" else 0.0)


@dataclass
class Tally:
    """A part's parameters per tp rank (dense, expert, and of the dense those GEMMs read) and its parameter
    tensors (each rank holds a piece of every one)."""

    params: float = 0.0
    expert: float = 0.0
    cast: float = 0.0
    tensors: int = 0

    def key(self) -> tuple:
        return (self.params, self.expert, self.cast, self.tensors)

    @staticmethod
    def at(pair, scale: float) -> float:
        """[batched, fixed] bytes at `scale` times the capture batch."""
        return pair[0] * scale + pair[1]


@dataclass(frozen=True)
class ActivationTally:
    """Held bytes [batched, fixed] at the capture batch for one run shape: per kind, of each distinct layer
    recomputed under it (and its transient), and of the ends ("none")."""

    layers: dict[str, tuple[tuple[list, list], ...]]  # kind -> per group: (held, transient)
    pre: list
    post: list


@dataclass(frozen=True, eq=False)
class SolutionParts:
    """The microbatch-independent facts of one tp solution, by part (module docstring)."""

    solution: "TpSolution"
    pre: tuple["NodeInfo", ...]
    post: tuple["NodeInfo", ...]
    groups: tuple[tuple[tuple["NodeInfo", ...], Tally], ...]  # distinct layers: a representative's nodes, tally
    index: np.ndarray  # layer i -> its group
    pre_tally: Tally
    post_tally: Tally
    boundary_bytes_per_sequence: float  # full bytes crossing a stage boundary, per sequence
    walked: "TpSolution | None" = None  # the solution over the representative graph (None: `solution`)
    _activations: dict = field(default_factory=dict, repr=False)

    def activation_tally(self, context: int = 1, spread: int = 1, imbalance: bool = True,
                         master: bool = False, rerun: tuple[str, int] = ("none", 0)) -> ActivationTally:
        """What each part holds for backward when the run has a context group of `context` ranks and
        (`spread`) MoE experts dispatched over an expert group, their routed rows for the busiest rank
        or (`imbalance` False) the mean, parameters in the compute dtype or not (`master`)
        (`cost_model.activations.RunShape`), the busiest rank's under a policy recomputing `rerun` = (kind,
        layers) (`Activations.policy_margins`)."""
        walked = self.walked if self.walked is not None else self.solution
        acts = walked.activations(context, spread, imbalance, master)
        key = (context, spread, imbalance, master, acts.policy_margins(*rerun))
        if key not in self._activations:
            if not imbalance and not walked.activations(context, spread, True, master).margined:  # nothing routed
                self._activations[key] = self.activation_tally(context, spread, True, master)
            else:
                self._activations[key] = _activation_tally(acts, [nodes[0].layer for nodes, _ in self.groups],
                                                           key[-1])
        return self._activations[key]


def _split(graph: "CapturedGraph") -> tuple[list, dict[int, list], list]:
    """(nodes before the first layer node, nodes per layer, the other nodes outside the layers)."""
    layered = [k for k, n in enumerate(graph.nodes) if n.layer is not None]
    first = layered[0] if layered else len(graph.nodes)
    pre, post, layers = [], [], {}
    for k, node in enumerate(graph.nodes):
        if node.layer is not None:
            layers.setdefault(node.layer, []).append(node)
        else:
            (pre if k < first else post).append(node)
    return pre, layers, post


def _tallies(graph: "CapturedGraph", sol: "TpSolution", part_of: Mapping[str, object]) -> dict[object, Tally]:
    tally: dict[object, Tally] = {}
    seen: set[str] = set()
    counted: dict[tuple, tuple[float, float]] = {}  # (strategy, parameter shapes) -> (dense, expert) per tp rank
    for node in graph.nodes:
        part = tally.setdefault(part_of[node.name], Tally())
        if not node.params or all(name in seen for name, _ in node.params):
            continue
        strategy = sol.strategies[node.name]
        key = (id(strategy), node.op_kind, node.module_path.rsplit(".", 1)[-1], tuple(m for _, m in node.params))
        fresh = not any(name in seen for name, _ in node.params)  # shared (tied) parameters count once
        if fresh and key in counted:
            dense, expert = counted[key]
        else:
            dense = expert = 0.0
            for name, meta, placement in param_placements(node, strategy):
                if name not in seen:
                    count = local_nbytes(meta.numel, placement, sol.tp)
                    is_expert = node.op_kind == "moe" and is_expert_weight(name)
                    dense, expert = dense + (not is_expert) * count, expert + is_expert * count
            if fresh:
                counted[key] = (dense, expert)
        part.tensors += len({name for name, _ in node.params} - seen)
        seen.update(name for name, _ in node.params)
        part.params += dense
        part.expert += expert
        part.cast += dense if node.op_kind in CAST_KINDS else 0.0
    return tally


def _boundary(graph: "CapturedGraph", layers: dict[int, list]) -> float:
    """The largest batched set of full bytes per sequence a layer reads from outside itself (what
    crosses a stage boundary)."""
    layer_of = {n.name: n.layer for n in graph.nodes}
    boundary = 0.0
    for i, nodes in layers.items():
        seen, full = set(), 0.0
        for node in nodes:
            for producer, meta in zip(node.inputs, node.input_metas):
                if layer_of[producer] == i or producer in seen:
                    continue
                seen.add(producer)
                full += meta.nbytes / graph.batch_size if is_batched(meta, graph.batch_size) else 0.0
        boundary = max(boundary, full)
    return boundary


def _activation_tally(acts: Activations, representatives: list[int], margins: tuple[float, float] | None = None
                      ) -> ActivationTally:
    """`Activations.held` under every kind (the routed rows under `margins`; None: every layer held and
    re-run), for the representative layer of each group and the ends."""
    none, _ = acts.held("none", margins)
    layers = {}
    for kind in KINDS:
        kept, transient = acts.held(kind, margins) if kind != "none" else (none, {})
        layers[kind] = tuple((kept[i], transient.get(i, [0.0, 0.0])) for i in representatives)
    return ActivationTally(layers, none["pre"], none["post"])


def _signature(nodes: list["NodeInfo"], strategies: Mapping[str, Strategy], tally: Tally, held: tuple) -> tuple:
    """Equal signatures, equal costs: ops, sizes, strategies, the placements each node reads, tallies and
    the bytes held under each recompute kind."""
    return tuple((n.op_kind, n.target, n.fwd_flops, n.bwd_flops, n.fwd_bytes, n.bwd_bytes, strategies[n.name].name,
                  tuple(strategies[p].output for p in n.inputs)) for n in nodes) + tally.key() + held


def solution_parts(graph: "CapturedGraph", sol: "TpSolution", runs: "LayerRuns | None" = None) -> SolutionParts:
    """`sol` split into parts; with `runs`, every pass over nodes walks the representative graph of its
    assignment (`cost_model.layer_runs`: a few layers of each run of alike ones), each other layer taking
    the group of the layer that stands for it."""
    reps = runs.representatives(sol.assignment) if runs is not None else None
    if reps is not None:  # the same buffers as the whole graph's (`tp_solution(lines=False)`)
        sol = dataclasses.replace(sol, comm_lines=comm_buffer_lines(reps.graph, sol.strategies, sol.tp))
    walked = sol if reps is None else dataclasses.replace(sol, graph=reps.graph, activation_cache={})
    pre, layers, post = _split(walked.graph)
    part_of: dict[str, object] = {n.name: "pre" for n in pre} | {n.name: "post" for n in post}
    part_of |= {n.name: i for i, nodes in layers.items() for n in nodes}
    tally = _tallies(walked.graph, sol, part_of)
    boundary = _boundary(walked.graph, layers)
    held = _activation_tally(walked.activations(), sorted(layers))
    groups: dict[tuple, int] = {}
    members, group_of = [], {}
    for k, i in enumerate(sorted(layers)):
        by_kind = tuple(tuple(map(tuple, held.layers[kind][k])) for kind in KINDS)
        key = _signature(layers[i], sol.strategies, tally.setdefault(i, Tally()), by_kind)
        if key not in groups:
            groups[key] = len(members)
            members.append((tuple(layers[i]), tally[i]))
        group_of[i] = groups[key]
    stands = reps.of_layer if reps is not None else {i: i for i in layers}
    index = [group_of[stands[i]] for i in sorted(stands)]
    parts = SolutionParts(sol, tuple(pre), tuple(post), tuple(members), np.array(index, dtype=np.int64),
                          tally["pre"], tally["post"], boundary, walked if reps is not None else None)
    kept = [group_of[i] for i in sorted(layers)]
    first = [kept.index(g) for g in range(len(members))]  # each group's first layer, among sorted(layers)
    parts._activations[(1, False)] = ActivationTally(
        {kind: tuple(held.layers[kind][k] for k in first) for kind in KINDS}, held.pre, held.post)
    return parts


def _attention_widths(nodes, strategies: Mapping[str, Strategy], tp: int) -> tuple[float, float]:
    for n in nodes:
        if n.op_kind == "attention":
            share = tp if strategies[n.name].name == "heads" else 1
            return n.input_metas[0].shape[-1] / share, n.input_metas[1].shape[-1] / share
    return 0.0, 0.0


def _part(graph: "CapturedGraph", nodes, sol: "TpSolution", ctx: CostContext, tally: Tally, is_layer: bool) -> PartCost:
    cost = price_assignment(dataclasses.replace(graph, nodes=tuple(nodes)), sol.strategies, ctx)
    q_width, kv_width = _attention_widths(nodes, sol.strategies, sol.tp)
    moe = [n for n in nodes if n.op_kind == "moe"]
    share = (1.0 / sol.tp) if moe and isinstance(sol.strategies[moe[0].name].inputs[0].placement, Shard) else 1.0
    saved, rerun = dict(cost.layer_saved_fwd_s), dict(cost.layer_recompute_s)
    recompute = tuple(0.0 if kind == "none" or not is_layer else rerun[kind] if kind in rerun else
                      cost.layer_fwd_compute_s - sum(saved.get(f, 0.0) for f in KINDS[kind]) for kind in KINDS)
    return PartCost(cost.fwd_compute_s, cost.bwd_compute_s, cost.fwd_comm_s, cost.bwd_comm_s, recompute,
                    cost.layer_fwd_comm_s if is_layer else 0.0, tally.params, tally.expert,
                    is_layer, tally.cast, q_width, kv_width, len(moe), share, cost.attention_s, tally.tensors)


@dataclass(eq=False)
class BlockCosts:
    """One tp solution at one per-rank microbatch, split into parts (module docstring)."""

    tp: int
    microbatch: Fraction  # sequences per rank per microbatch (mbs / cp)
    variant: str
    solution: "TpSolution"
    pre: PartCost
    distinct: tuple[PartCost, ...]  # the distinct layers
    index: np.ndarray  # layer i -> distinct[index[i]]
    post: PartCost
    boundary_full_bytes: float  # the tensors crossing a stage boundary, unsharded, per microbatch
    comm_buffer_bytes: float  # the largest tp collective buffer at this microbatch
    parts: SolutionParts | None = None
    scale: float = 1.0  # this microbatch / the capture batch
    _arrays: dict = field(default_factory=dict, repr=False)

    @property
    def layers(self) -> tuple[PartCost, ...]:
        return tuple(self.distinct[k] for k in self.index)

    @property
    def num_layers(self) -> int:
        return int(self.index.shape[0])

    def recomputed(self, recompute: str) -> tuple[str, np.ndarray]:
        """The kind `recompute` re-runs layers under, and per layer whether it re-runs it (the others run
        as "none")."""
        if ("recomputed", recompute) not in self._arrays:
            policy = recompute_policy(recompute)
            self._arrays[("recomputed", recompute)] = (
                policy.kind, np.arange(self.num_layers) < len(policy.recomputed_layers(self.num_layers)))
        return self._arrays[("recomputed", recompute)]

    def _per_layer(self, recompute: str, value) -> np.ndarray:
        """`value(index of a distinct layer, kind)` for every layer, found once per distinct layer and kind."""
        kind, recomputed = self.recomputed(recompute)
        plain = np.array([value(g, "none") for g in range(len(self.distinct))], dtype=np.float64)[self.index]
        if kind == "none" or not recomputed.any():
            return plain
        under = np.array([value(g, kind) for g in range(len(self.distinct))], dtype=np.float64)[self.index]
        return np.where(recomputed, under, plain)

    def total_s(self, recompute: str) -> float:
        """One microbatch's seconds over every part (equals the intra-op objective with no recompute)."""
        a = self.arrays(recompute)
        ends = sum(p.compute_s() + p.comm_s() for p in (self.pre, self.post))
        return float(a["compute"].sum() + a["comm"].sum()) + ends

    def arrays(self, recompute: str) -> dict[str, np.ndarray]:
        """Per-layer arrays of what the step model sums, for one recompute policy."""
        if recompute not in self._arrays:
            d = self.distinct
            per = {
                "compute": lambda g, kind: d[g].compute_s(kind),
                "comm": lambda g, kind: d[g].comm_s(kind),
                "forward": lambda g, kind: d[g].fwd_compute_s,
                "backward": lambda g, kind: d[g].backward_s(kind),
                "params": lambda g, kind: d[g].params,
                "expert": lambda g, kind: d[g].expert_params,
                "cast": lambda g, kind: d[g].cast_params,
                "tensors": lambda g, kind: d[g].tensors,
            }
            self._arrays[recompute] = {k: self._per_layer(recompute, v) for k, v in per.items()}
        return self._arrays[recompute]

    def boundary_bytes(self, context: int = 1, spread: int = 1, master: bool = False) -> float:
        """Bytes per rank crossing a stage boundary at this microbatch as the runtime holds them
        (`Activations.boundary_bytes`; without the walk, the captured full bytes)."""
        if self.parts is None:
            return self.boundary_full_bytes
        walked = self.parts.walked if self.parts.walked is not None else self.parts.solution
        return walked.activations(context, spread, True, master).boundary_bytes * self.scale

    def activations(self, recompute: str, context: int = 1, spread: int = 1,
                    imbalance: bool = True, master: bool = False) -> dict:
        """Bytes held for backward at this microbatch: per layer ("activation"), per layer while it is
        re-run ("transient"), and the two ends ("pre", "post"), for a run with a context group of
        `context` ranks and MoE experts `spread` over an expert group (routed rows for the busiest
        rank, or the mean), parameters in the compute dtype or not (`master`: precision bf16-master)."""
        key = (recompute, context, spread, imbalance, master)
        if key in self._arrays:  # asked per configuration priced: the tallies are found once
            return self._arrays[key]
        kind, recomputed = self.recomputed(recompute)
        rerun = (kind, int(recomputed.sum()))
        tally = self.parts.activation_tally(context, spread, imbalance, master, rerun)
        if not imbalance and tally is self.parts.activation_tally(context, spread, True, master, rerun):  # nothing routed
            return self.activations(recompute, context, spread, True, master)
        self._arrays[key] = {
            "activation": self._per_layer(recompute, lambda g, kind: Tally.at(tally.layers[kind][g][0], self.scale)),
            "transient": self._per_layer(recompute, lambda g, kind: Tally.at(tally.layers[kind][g][1], self.scale)),
            "pre": Tally.at(tally.pre, self.scale), "post": Tally.at(tally.post, self.scale)}
        return self._arrays[key]


def block_costs(graph: "CapturedGraph", parts: SolutionParts, ctx: CostContext, variant: str,
                microbatch: Fraction) -> BlockCosts:
    """`parts` priced at `ctx`'s microbatch (module docstring)."""
    sol = parts.solution
    distinct = tuple(_part(graph, nodes, sol, ctx, tally, True) for nodes, tally in parts.groups)
    return BlockCosts(sol.tp, microbatch, variant, sol, _part(graph, parts.pre, sol, ctx, parts.pre_tally, False),
                      distinct, parts.index, _part(graph, parts.post, sol, ctx, parts.post_tally, False),
                      parts.boundary_bytes_per_sequence * float(microbatch),
                      largest_comm_buffer_bytes(graph, sol.strategies, sol.tp, float(microbatch),
                                                sol.comm_lines or None), parts, ctx.batch_scale)
