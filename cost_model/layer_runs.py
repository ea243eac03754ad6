"""Runs of alike layers, and the representative graph that stands for a deep model's layers.

Two consecutive layers are alike under a tp assignment when their segments have the same fold kind
(`capture.blocks`: equal structure, position j playing the same part in both) and every position has
the same strategy. A run is a maximal sequence of consecutive alike layers.

What the cost model reads of layer i under an assignment (the ops' costs, parameters, the boundary it
reads, and what its ops make and keep for backward: `cost_model.activations`) depends on layer i itself,
on what it reads from the layer before, and, for "the first part that holds a storage", on which of its
storages the layer after holds. When every edge into a layer comes from that layer or the one before it,
or from outside the layers, and no parameter is shared between a layer and another segment (`local`),
the layers at offsets 2 .. n-3 of a run of n are therefore priced alike: each reads from an alike layer
and is read by one. The representative graph keeps the nodes outside the layers and, of each run,
offsets 0, 1, 2, n-2 and n-1 (all of a run of 5 or fewer); offset n-2's inputs from the dropped offset
n-3 are rewired to the same positions of offset 2. Every dropped layer stands as offset 2 of its run
(`Representatives.of_layer`), so a 96-layer model of one kind walks 5 layers, whatever its depth.
`tests/test_layer_runs.py` checks the parts of the representative graph against those of the whole one.
"""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping

if TYPE_CHECKING:
    from autoplan.capture.blocks import FoldedGraph
    from autoplan.capture.graph import CapturedGraph

KEPT_AT_EACH_END = 2  # offsets 0..2 and n-2..n-1 of a run: offset 2 reads from and is read by alike layers


@dataclass(frozen=True)
class Representatives:
    """The graph of the kept nodes (topological order) and, for every layer, the kept layer standing for it."""

    graph: "CapturedGraph"
    of_layer: Mapping[int, int]


@dataclass(frozen=True)
class LayerRuns:
    """The layer segments of one graph (found once per graph): where each starts and ends among the
    nodes, its kind, and a getter of its nodes' strategy names in the kind's order; `local` says whether
    the representative graph stands for the whole one (module docstring)."""

    graph: "CapturedGraph"
    starts: tuple[int, ...]  # per segment (layers and the rest, in order): its first node's index
    layer_segments: tuple[int, ...]  # the segments that are layers, in order
    kinds: tuple[int, ...]  # per segment
    kind_orders: tuple[tuple[str, ...], ...]  # per segment: its nodes' names in its kind's order
    local: bool

    @classmethod
    def of(cls, graph: "CapturedGraph", folded: "FoldedGraph") -> "LayerRuns":
        segments = folded.segments
        starts, at = [], 0
        for seg in segments:
            starts.append(at)
            at += len(seg.nodes)
        layer_segments = tuple(s for s, seg in enumerate(segments) if seg.block is not None)
        runs = cls(graph, tuple(starts), layer_segments, tuple(seg.kind for seg in segments),
                   tuple(seg.nodes for seg in segments), False)
        local = at == len(graph.nodes) and _local(graph, runs)
        return dataclasses.replace(runs, local=local)

    def nodes(self, s: int):
        end = self.starts[s + 1] if s + 1 < len(self.starts) else len(self.graph.nodes)
        return self.graph.nodes[self.starts[s]:end]

    def representatives(self, assignment: Mapping[str, str]) -> Representatives:
        """The representative graph of `assignment` (node name -> strategy name; module docstring); the
        whole graph, each layer standing for itself, where the graph is not `local`."""
        layers = [self.graph.nodes[self.starts[s]].layer for s in self.layer_segments]
        if not self.local:
            return Representatives(self.graph, {i: i for i in layers})
        kept, of_layer, rewire = set(range(len(self.starts))) - set(self.layer_segments), {}, {}
        for run in self._runs(assignment):
            n = len(run)
            for offset, s in enumerate(run):
                stands = offset if n <= 2 * KEPT_AT_EACH_END + 1 or offset <= KEPT_AT_EACH_END or \
                    offset >= n - KEPT_AT_EACH_END else KEPT_AT_EACH_END
                of_layer[self.graph.nodes[self.starts[s]].layer] = self.graph.nodes[self.starts[run[stands]]].layer
                kept.add(run[stands])
            if n > 2 * KEPT_AT_EACH_END + 1:  # offset n-2 reads offset 2 where it read offset n-3
                rewire[run[n - KEPT_AT_EACH_END]] = dict(zip(self.kind_orders[run[n - KEPT_AT_EACH_END - 1]],
                                                             self.kind_orders[run[KEPT_AT_EACH_END]]))
        nodes = []
        for s in sorted(kept):
            renamed = rewire.get(s)
            for node in self.nodes(s):
                if renamed and any(u in renamed for u in node.inputs):
                    node = dataclasses.replace(node, inputs=tuple(renamed.get(u, u) for u in node.inputs))
                nodes.append(node)
        return Representatives(dataclasses.replace(self.graph, nodes=tuple(nodes)), of_layer)

    def _runs(self, assignment: Mapping[str, str]) -> list[list[int]]:
        """The layer segments cut into runs of alike layers (consecutive segments, same kind, same strategy
        at every position)."""
        runs: list[list[int]] = []
        previous = None
        for s in self.layer_segments:
            names = self.kind_orders[s]
            key = (self.kinds[s], operator.itemgetter(*names)(assignment) if names else ())
            if runs and key == previous and runs[-1][-1] == s - 1:
                runs[-1].append(s)
            else:
                runs.append([s])
            previous = key
        return runs


def _local(graph: "CapturedGraph", runs: LayerRuns) -> bool:
    """Whether every edge into a segment comes from it, from the segment just before, or from a segment that
    is not a layer; every layer segment's nodes carry one layer index, its own; and no parameter of a layer
    is used by another segment (tied weights would be counted once where they are first used); the nodes
    outside the layer segments carry none."""
    segment_of, layer_of, owner = {}, {}, {}
    is_layer = set(runs.layer_segments)
    for s in range(len(runs.starts)):
        for node in runs.nodes(s):
            segment_of[node.name] = s
            for name, _ in node.params:
                if owner.setdefault(name, s) != s and (s in is_layer or owner[name] in is_layer):
                    return False
            if s not in is_layer and node.layer is not None:
                return False
            if s in is_layer and (node.layer is None or node.layer != layer_of.setdefault(s, node.layer)):
                return False
    if len(set(layer_of.values())) != len(layer_of):
        return False
    for s in range(len(runs.starts)):
        for node in runs.nodes(s):
            for u in node.inputs:
                source = segment_of[u]
                if source != s and source in is_layer and source != s - 1:
                    return False
    return True
