"""One tensor-parallel solution split into the parts a pipeline stage is made of, each priced per microbatch.

Parts: the nodes before the first layer ("embedding", pinned to stage 0), each layer, and the nodes
after the last layer ("head": final norm, lm_head, loss; pinned to the last stage). A part's costs
(`PartCost`), per microbatch and tp rank:

    seconds      the op and resharding costs of its nodes (`cost_model.intra_op.price_assignment` on
                 the part; a resharding edge counts at its consumer), split into forward / backward
                 compute and communication, and what selective / full recompute re-run
    parameters   per tp rank, each parameter once; expert FFN weights apart (ep divides them)
    activations  kept for backward: none / selective: the solution's saved tensors of the part
                 (`cost_model.memory.saved_tensors`); full: a layer keeps its input tensors
                 (checkpoints) and, only while it is recomputed, its whole set (the transient);
                 the parts outside the layers keep everything

Layers whose nodes, strategies, input placements and tallies are equal share one PartCost, so a
96-layer model prices a handful of parts. The microbatch-independent facts of a solution
(`SolutionParts`) are computed once; `block_costs` scales them to a microbatch (possibly a fraction
of a sequence: mbs / cp sequences per rank under context parallelism), re-pricing time at that size.
Saved tensors made outside the layers and kept by the head (the loss targets) are counted with the
embedding: a few bytes per token.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from fractions import Fraction
from typing import TYPE_CHECKING, Mapping

import numpy as np

from autoplan.cost_model.intra_op import CostContext, price_assignment
from autoplan.cost_model.memory import is_batched, largest_comm_buffer_bytes, local_nbytes, param_placements
from autoplan.placement import Shard
from autoplan.strategies import EXPERT_WEIGHTS, Strategy

if TYPE_CHECKING:
    from autoplan.capture import CapturedGraph, NodeInfo
    from autoplan.cost_model.assignment import TpSolution



@dataclass(frozen=True)
class PartCost:
    """Per microbatch and tp rank: seconds, parameters and activation bytes of one part."""

    fwd_compute_s: float
    bwd_compute_s: float
    fwd_comm_s: float
    bwd_comm_s: float
    selective_s: float  # forward compute that selective recompute re-runs
    full_compute_s: float  # forward compute that full recompute re-runs (layers only)
    full_comm_s: float  # forward tp communication that full recompute re-runs
    params: float  # dense parameters per tp rank
    expert_params: float  # expert FFN weights per tp rank (ep divides them)
    saved_bytes: float  # activations kept, recompute none
    selective_bytes: float
    checkpoint_bytes: float  # kept under full recompute
    is_layer: bool
    q_width: float = 0.0  # attention q features per tp rank (0: no attention)
    kv_width: float = 0.0
    moe_layers: int = 0
    moe_token_share: float = 1.0  # of the rank's tokens its MoE dispatches (1 / tp when tokens are split)

    def compute_s(self, recompute: str) -> float:
        extra = {"none": 0.0, "selective": self.selective_s, "full": self.full_compute_s}[recompute]
        return self.fwd_compute_s + self.bwd_compute_s + extra

    def backward_s(self, recompute: str) -> float:
        """The backward window (with the forward recomputed inside it)."""
        return self.compute_s(recompute) - self.fwd_compute_s

    def comm_s(self, recompute: str) -> float:
        return self.fwd_comm_s + self.bwd_comm_s + (self.full_comm_s if recompute == "full" else 0.0)

    def activation_bytes(self, recompute: str) -> float:
        return {"none": self.saved_bytes, "selective": self.selective_bytes, "full": self.checkpoint_bytes}[recompute]

    def transient_bytes(self, recompute: str) -> float:
        return self.saved_bytes if recompute == "full" and self.is_layer else 0.0


@dataclass
class Tally:
    """A part's parameters and activation bytes at the capture batch, batched (scaling) and fixed."""

    params: float = 0.0
    expert: float = 0.0
    saved: list = field(default_factory=lambda: [0.0, 0.0])  # [batched, fixed]
    selective: list = field(default_factory=lambda: [0.0, 0.0])
    checkpoint: list = field(default_factory=lambda: [0.0, 0.0])

    def key(self) -> tuple:
        return (self.params, self.expert, *self.saved, *self.selective, *self.checkpoint)

    @staticmethod
    def at(pair: list, scale: float) -> float:
        return pair[0] * scale + pair[1]


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
                    is_expert = node.op_kind == "moe" and name.rsplit(".", 1)[-1] in EXPERT_WEIGHTS
                    dense, expert = dense + (not is_expert) * count, expert + is_expert * count
            if fresh:
                counted[key] = (dense, expert)
        seen.update(name for name, _ in node.params)
        part.params += dense
        part.expert += expert
    for t in sol.saved:
        owner = t.layer if t.layer is not None else ("pre" if part_of.get(t.key.split(":")[0]) == "pre" else "post")
        part, slot = tally.setdefault(owner, Tally()), 0 if t.batched else 1
        part.saved[slot] += t.nbytes
        part.selective[slot] += 0.0 if t.recomputable else t.nbytes
    for key in ("pre", "post"):  # a model with no op outside its layers after them has an empty "post"
        part = tally.setdefault(key, Tally())
        part.checkpoint = list(part.saved)
    return tally


def _checkpoints(graph: "CapturedGraph", sol: "TpSolution", layers: dict[int, list], tally: dict) -> float:
    """Fill each layer's checkpoint: tensors it reads from outside itself; return the largest batched set
    of full bytes per sequence (what crosses a stage boundary)."""
    layer_of = {n.name: n.layer for n in graph.nodes}
    boundary = 0.0
    for i, nodes in layers.items():
        seen, full = set(), 0.0
        checkpoint = tally.setdefault(i, Tally()).checkpoint
        for node in nodes:
            for producer, meta in zip(node.inputs, node.input_metas):
                if layer_of[producer] == i or producer in seen:
                    continue
                seen.add(producer)
                batched = is_batched(meta, graph.batch_size)
                checkpoint[0 if batched else 1] += local_nbytes(meta.nbytes, sol.strategies[producer].output, sol.tp)
                full += meta.nbytes / graph.batch_size if batched else 0.0
        boundary = max(boundary, full)
    return boundary


def _signature(nodes: list["NodeInfo"], strategies: Mapping[str, Strategy], tally: Tally) -> tuple:
    """Equal signatures, equal costs: ops, sizes, strategies, the placements each node reads, tallies."""
    return tuple((n.op_kind, n.target, n.fwd_flops, n.bwd_flops, n.fwd_bytes, n.bwd_bytes, strategies[n.name].name,
                  tuple(strategies[p].output for p in n.inputs)) for n in nodes) + tally.key()


def solution_parts(graph: "CapturedGraph", sol: "TpSolution") -> SolutionParts:
    pre, layers, post = _split(graph)
    part_of: dict[str, object] = {n.name: "pre" for n in pre} | {n.name: "post" for n in post}
    part_of |= {n.name: i for i, nodes in layers.items() for n in nodes}
    tally = _tallies(graph, sol, part_of)
    boundary = _checkpoints(graph, sol, layers, tally)
    groups: dict[tuple, int] = {}
    members, index = [], []
    for i in sorted(layers):
        key = _signature(layers[i], sol.strategies, tally[i])
        if key not in groups:
            groups[key] = len(members)
            members.append((tuple(layers[i]), tally[i]))
        index.append(groups[key])
    return SolutionParts(sol, tuple(pre), tuple(post), tuple(members), np.array(index, dtype=np.int64),
                         tally["pre"], tally["post"], boundary)


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
    scale = ctx.batch_scale
    return PartCost(cost.fwd_compute_s, cost.bwd_compute_s, cost.fwd_comm_s, cost.bwd_comm_s,
                    cost.selective_fwd_compute_s, cost.layer_fwd_compute_s if is_layer else 0.0,
                    cost.layer_fwd_comm_s if is_layer else 0.0, tally.params, tally.expert,
                    Tally.at(tally.saved, scale), Tally.at(tally.selective, scale), Tally.at(tally.checkpoint, scale),
                    is_layer, q_width, kv_width, len(moe), share)


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
    _arrays: dict = field(default_factory=dict, repr=False)

    @property
    def layers(self) -> tuple[PartCost, ...]:
        return tuple(self.distinct[k] for k in self.index)

    @property
    def num_layers(self) -> int:
        return int(self.index.shape[0])

    def total_s(self, recompute: str) -> float:
        """One microbatch's seconds over every part (equals the intra-op objective with no recompute)."""
        counts = np.bincount(self.index, minlength=len(self.distinct))
        layers = sum(c * (p.compute_s(recompute) + p.comm_s(recompute)) for c, p in zip(counts, self.distinct))
        return float(layers) + sum(p.compute_s(recompute) + p.comm_s(recompute) for p in (self.pre, self.post))

    def arrays(self, recompute: str) -> dict[str, np.ndarray]:
        """Per-layer arrays of what the step model sums, for one recompute policy."""
        if recompute not in self._arrays:
            per = {
                "compute": [p.compute_s(recompute) for p in self.distinct],
                "comm": [p.comm_s(recompute) for p in self.distinct],
                "forward": [p.fwd_compute_s for p in self.distinct],
                "backward": [p.backward_s(recompute) for p in self.distinct],
                "activation": [p.activation_bytes(recompute) for p in self.distinct],
                "transient": [p.transient_bytes(recompute) for p in self.distinct],
                "params": [p.params for p in self.distinct],
                "expert": [p.expert_params for p in self.distinct],
            }
            self._arrays[recompute] = {k: np.array(v, dtype=np.float64)[self.index] for k, v in per.items()}
        return self._arrays[recompute]


def block_costs(graph: "CapturedGraph", parts: SolutionParts, ctx: CostContext, variant: str,
                microbatch: Fraction) -> BlockCosts:
    """`parts` priced at `ctx`'s microbatch (module docstring)."""
    sol = parts.solution
    distinct = tuple(_part(graph, nodes, sol, ctx, tally, True) for nodes, tally in parts.groups)
    return BlockCosts(sol.tp, microbatch, variant, sol, _part(graph, parts.pre, sol, ctx, parts.pre_tally, False),
                      distinct, parts.index, _part(graph, parts.post, sol, ctx, parts.post_tally, False),
                      parts.boundary_bytes_per_sequence * float(microbatch),
                      largest_comm_buffer_bytes(graph, sol.strategies, sol.tp, float(microbatch),
                                                sol.comm_lines or None))
