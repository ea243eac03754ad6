"""Folding (TAPAS): find the repeated blocks of a captured graph by their structure.

Segments. The nodes, in topological order, are cut into maximal runs of one block (`capture.block_of`:
the entry of a module list that encloses the node, "layers.3" or "encoder.layers.0", none outside the
lists): the prefix (embeddings), one segment per layer of every stack (decoder layers, encoder then
decoder stacks), glue between two stacks, the suffix (final norm, head, loss).

Cuts. Cut s lies after segment s. Its slots are the tensors that cross it: the producers in segments
<= s with a consumer in a segment > s, in topological order. Segment s reads slots of cut s - 1
(`Segment.reads`: slot, consumer position, input index) and provides every slot of cut s
(`Segment.provides`: one of its own nodes, or a slot of cut s - 1 passed through, such as the loss
targets that cross every block).

Kinds. Each segment becomes a directed graph: its nodes labelled with what the cost model and the
strategy rules read (op kind, target, input and output shapes and dtypes, parameter names relative to
the op's module and their shapes, FLOPs and bytes; never module paths), edges labelled with the
consumer's input index, and port nodes for the slots it reads ("in:j") and provides ("out:j").
Segments whose Weisfeiler-Lehman hashes (`_wl_hash`) of these graphs are equal are candidates for one
kind; a candidate joins a kind only if a node-by-node correspondence with the kind's first segment
exists (the positional one when both trace in the same order, else a graph isomorphism), so a hash
collision never merges two different blocks. Every segment lists its nodes in its kind's order:
position j plays the same part in each segment of a kind, which is how one solution of the kind is
spread to all of them. A segment whose positional signature was seen before is the same labelled
graph, so it is not hashed again: a 96-layer model hashes each kind once.

The folded solve over these blocks is `autoplan.solver.folded`.
"""
from __future__ import annotations

import hashlib
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import networkx as nx
import numpy as np
from networkx.algorithms.isomorphism import DiGraphMatcher

if TYPE_CHECKING:
    from autoplan.capture.graph import CapturedGraph, NodeInfo

WL_ITERATIONS = 4
MAX_CUT_STATES = 81  # joint placements of the tensors crossing one cut (3^4: four tensors of R / S(1) / S(2))


@dataclass(frozen=True)
class Segment:
    """A contiguous run of nodes; `nodes` in its kind's order (module docstring)."""

    kind: int
    layer: int | None  # `NodeInfo.layer` of its nodes (the i of "layers.<i>")
    nodes: tuple[str, ...]
    reads: tuple[tuple[int, int, int], ...]  # (slot of the cut before, consumer position, input index)
    provides: tuple[tuple[str, int], ...]  # per slot of the cut after: ("node", position) | ("slot", slot before)
    block: str | None = None  # the module list entry it runs ("encoder.layers.0"); None: prefix, glue, suffix


@dataclass(frozen=True)
class FoldedGraph:
    """The segments of a graph, their kinds, and the slots of every cut between them."""

    segments: tuple[Segment, ...]
    cuts: tuple[tuple[str, ...], ...]  # cut s: producer names of its slots; len(segments) - 1 cuts
    kind_hashes: tuple[str, ...]  # the Weisfeiler-Lehman hash of each kind
    fold_time_s: float = field(compare=False)
    graph: "CapturedGraph" = field(compare=False, repr=False)
    # per kind, the nodes of its first segment in the kind's order (what the folded solve prices)
    kind_nodes: tuple[tuple["NodeInfo", ...], ...] = field(default=(), compare=False, repr=False)

    @property
    def num_kinds(self) -> int:
        return len(self.kind_hashes)

    def segments_of_kind(self, kind: int) -> list[int]:
        return [s for s, seg in enumerate(self.segments) if seg.kind == kind]

    def layer_kinds(self) -> dict[int, int]:
        """Kind -> how many layer segments (blocks of any stack) have it."""
        counts: dict[int, int] = defaultdict(int)
        for seg in self.segments:
            if seg.block is not None:
                counts[seg.kind] += 1
        return dict(counts)

    def describe(self) -> str:
        layers = self.layer_kinds()
        body = ", ".join(f"{n} x kind {k}" for k, n in sorted(layers.items()))
        return (f"{len(self.segments)} segments of {self.num_kinds} kinds"
                + (f" ({sum(layers.values())} layers: {body})" if layers else ""))


# ---------------------------------------------------------------------------------- segments


@dataclass(frozen=True)
class _Layout:
    """Segments and cuts of a graph, from its `GraphIndex` by array operations (a per-node Python
    pass would make the fold linear in depth at ~10 us a layer). Segment s holds nodes
    starts[s]:starts[s + 1]; input edge e (`GraphIndex.inputs` order) has reference refs[e]: r >= 0
    the producer's position in the consumer's segment, r < 0 slot -1 - r of the cut before."""

    starts: list[int]
    cuts: list[list[int]]  # cut s: producer indices, ascending (topological)
    refs: np.ndarray
    provides: list[tuple[int, ...]]  # per segment, the reference of each slot of the cut after

    @classmethod
    def of(cls, graph: "CapturedGraph") -> "_Layout":
        index = graph.index
        blocks = index.blocks
        starts = np.concatenate([[0], np.flatnonzero(blocks[1:] != blocks[:-1]) + 1, [len(blocks)]])
        segment_of = np.repeat(np.arange(len(starts) - 1), np.diff(starts))
        consumer = np.repeat(segment_of, np.diff(index.input_ptr))  # segment of each edge's consumer
        cuts = _cuts(index.inputs, segment_of, consumer, len(starts) - 1)
        slots = [{u: j for j, u in enumerate(cut)} for cut in cuts]
        refs = index.inputs - starts[consumer]
        crossing = np.flatnonzero(segment_of[index.inputs] != consumer)  # edges that cross a cut
        refs[crossing] = [-1 - slots[c - 1][u] for c, u in zip(consumer[crossing].tolist(),
                                                               index.inputs[crossing].tolist())]
        starts_list = starts.tolist()
        provides = [tuple(u - starts_list[c] if u >= starts_list[c] else -1 - slots[c - 1][u] for u in cut)
                    for c, cut in enumerate(cuts)] + [()]
        return cls(starts_list, cuts, refs, provides)


def _cuts(inputs: np.ndarray, segment_of: np.ndarray, consumer: np.ndarray, count: int) -> list[list[int]]:
    """Producer indices crossing each of the count - 1 cuts, in topological order: u crosses cuts
    segment_of[u] .. (the last segment reading u) - 1."""
    last = segment_of.copy()
    np.maximum.at(last, inputs, consumer)
    cuts: list[list[int]] = [[] for _ in range(count - 1)]
    crossing = np.flatnonzero(last > segment_of)
    for u, first, end in zip(crossing.tolist(), segment_of[crossing].tolist(), last[crossing].tolist()):
        for c in range(first, end):
            cuts[c].append(u)
    return cuts


@dataclass
class _Draft:
    """A segment before its kind is known. Positions index `members` (topological order); a reference
    r >= 0 is the node at position r, r < 0 the slot -1 - r of the cut before; labels are the graph's
    label ids (`CapturedGraph.labels`, small ints that hash fast), `texts` the labels they stand for."""

    layer: int | None
    members: list[int]
    labels: list[int]
    refs: list[tuple[int, ...]]  # per node, per input
    provides: tuple[int, ...]  # per slot of the cut after
    texts: tuple[tuple, ...]

    @classmethod
    def of(cls, graph: "CapturedGraph", layout: _Layout, s: int) -> "_Draft":
        index = graph.index
        a, b = layout.starts[s], layout.starts[s + 1]
        ptr = index.input_ptr[a:b + 1].tolist()
        refs = [tuple(layout.refs[ptr[p]:ptr[p + 1]].tolist()) for p in range(b - a)]
        return cls(graph.nodes[a].layer, list(range(a, b)), index.labels[a:b].tolist(), refs, layout.provides[s],
                   graph.label_texts)

    def signature(self, order: list[int] | None = None) -> tuple:
        """Positional signature with the nodes taken in `order` (positions renumbered to match), or in
        their own order."""
        if order is None:
            return tuple(self.labels), tuple(self.refs), self.provides
        renumber = {old: new for new, old in enumerate(order)}
        refs = tuple(tuple(renumber[r] if r >= 0 else r for r in self.refs[p]) for p in order)
        return (tuple(self.labels[p] for p in order), refs,
                tuple(renumber[r] if r >= 0 else r for r in self.provides))

    def digraph(self) -> nx.DiGraph:
        """Nodes by position, port nodes ("in", slot) and ("out", slot), edges labelled by input index."""
        g = nx.DiGraph()
        for p, label in enumerate(self.labels):
            g.add_node(p, label=repr(self.texts[label]))

        def source(r: int):
            if r >= 0:
                return r
            g.add_node(("in", -1 - r), label=f"in:{-1 - r}")
            return ("in", -1 - r)

        for p, refs in enumerate(self.refs):
            for k, r in enumerate(refs):
                g.add_edge(source(r), p, label=str(k))
        for j, r in enumerate(self.provides):
            g.add_node(("out", j), label=f"out:{j}")
            g.add_edge(source(r), ("out", j), label="")
        return g


# ---------------------------------------------------------------------------------- kinds


def _match(rep: _Draft, kind: list, draft: _Draft) -> list[int] | None:
    """An order of `draft`'s positions in which it equals `rep` node by node, or None. `kind` is the
    kind's entry (hash, rep, rep's digraph or None): the digraph is built on the first need."""
    if len(draft.members) != len(rep.members):
        return None
    identity = list(range(len(draft.members)))
    if draft.signature() == rep.signature():
        return identity
    if kind[2] is None:
        kind[2] = rep.digraph()
    matcher = DiGraphMatcher(kind[2], draft.digraph(), node_match=lambda a, b: a["label"] == b["label"],
                             edge_match=lambda a, b: a["label"] == b["label"])
    if not matcher.is_isomorphic():
        return None
    order = [matcher.mapping[p] for p in identity]
    return order if draft.signature(order) == rep.signature() else None


def _digest(text: str) -> int:
    """A 64-bit label that is the same in every process (Python's str hash is salted per process)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def _wl_hash(draft: _Draft, iterations: int = WL_ITERATIONS) -> str:
    """Weisfeiler-Lehman subtree hash of the draft's labelled graph (the one `_Draft.digraph` builds:
    positions, "in"/"out" ports, edges labelled by input index). Start from a digest of each node's
    label; each round relabels x with a hash of (its label, the sorted (edge label, label) of its
    predecessors, the same of its successors); the result digests the sorted labels of every round.
    Independent of the order positions come in; equal graphs hash equal, and `_match` checks the rare
    collision. Written on tuples of ints: ~10x faster than networkx's, which the fold paid per kind."""
    nodes: dict = {p: _digest(repr(draft.texts[label])) for p, label in enumerate(draft.labels)}
    edges: list[tuple] = []  # (source, target, edge label)

    def source(r: int):
        if r >= 0:
            return r
        nodes.setdefault(("in", -1 - r), _digest(f"in:{-1 - r}"))
        return ("in", -1 - r)

    for p, refs in enumerate(draft.refs):
        edges += [(source(r), p, k) for k, r in enumerate(refs)]
    for j, r in enumerate(draft.provides):
        nodes[("out", j)] = _digest(f"out:{j}")
        edges.append((source(r), ("out", j), -1))
    seen = sorted(nodes.values())
    for _ in range(iterations):
        into: dict = defaultdict(list)
        out_of: dict = defaultdict(list)
        for u, v, k in edges:
            into[v].append((k, nodes[u]))
            out_of[u].append((k, nodes[v]))
        nodes = {x: hash((label, tuple(sorted(into[x])), tuple(sorted(out_of[x])))) for x, label in nodes.items()}
        seen += sorted(nodes.values())
    return hashlib.blake2b(repr(seen).encode(), digest_size=16).hexdigest()


def _kind_of(draft: _Draft, kinds: list[list], by_hash: dict[str, list[int]]
             ) -> tuple[int, list[int]]:
    """(kind, order of the draft's positions in the kind's order); appends a new kind when none matches."""
    key = _wl_hash(draft)
    for k in by_hash[key]:
        order = _match(kinds[k][1], kinds[k], draft)
        if order is not None:
            return k, order
    by_hash[key].append(len(kinds))
    kinds.append([key, draft, None])
    return len(kinds) - 1, list(range(len(draft.members)))


class _Signatures:
    """Positional signatures of segments as byte slices: per node its label and input count, per input
    edge its reference (`_Layout.refs`), as int64 bytes made once per graph, so a segment's signature
    is three slices of Python bytes. Equal iff the `_Draft.signature`s are equal."""

    def __init__(self, graph: "CapturedGraph", layout: _Layout) -> None:
        index = graph.index
        self.nodes = np.stack([index.labels, np.diff(index.input_ptr)], axis=1).astype(np.int64).tobytes()
        self.refs = layout.refs.astype(np.int64).tobytes()
        self.ptr = index.input_ptr.tolist()
        self.layout = layout

    def of(self, s: int) -> tuple:
        a, b = self.layout.starts[s], self.layout.starts[s + 1]
        return self.nodes[16 * a:16 * b], self.refs[8 * self.ptr[a]:8 * self.ptr[b]], self.layout.provides[s]


def fold_graph(graph: "CapturedGraph") -> FoldedGraph:
    """Segments, cuts and kinds of `graph` (module docstring)."""
    start = time.perf_counter()
    layout = _Layout.of(graph)
    signatures = _Signatures(graph, layout)
    names, blocks, paths = graph.index.names, graph.index.blocks.tolist(), graph.index.block_paths
    kinds: list[list] = []  # [hash, first segment, its digraph once an isomorphism test needs it]
    by_hash: dict[str, list[int]] = defaultdict(list)
    seen: dict[tuple, tuple] = {}  # positional signature -> (kind, order or None, reads, provides)
    segments, kind_nodes = [], []
    for s in range(len(layout.starts) - 1):
        signature = signatures.of(s)
        if signature not in seen:
            seen[signature] = _kind_entry(_Draft.of(graph, layout, s), kinds, by_hash)
        kind, order, reads, provides = seen[signature]
        a, b = layout.starts[s], layout.starts[s + 1]
        members = names[a:b] if order is None else tuple(names[a + p] for p in order)
        segments.append(Segment(kind, graph.nodes[a].layer, members, reads, provides,
                                paths[blocks[a]] if blocks[a] >= 0 else None))
        if kind == len(kind_nodes):  # the kind's first segment: its nodes, in the kind's order
            kind_nodes.append(graph.nodes[a:b] if order is None else tuple(graph.nodes[a + p] for p in order))
    cuts = tuple(tuple(names[u] for u in cut) for cut in layout.cuts)
    return FoldedGraph(tuple(segments), cuts, tuple(k[0] for k in kinds), time.perf_counter() - start, graph,
                       tuple(kind_nodes))


def _kind_entry(draft: _Draft, kinds: list, by_hash: dict[str, list[int]]) -> tuple:
    """(kind, order of the draft's positions in the kind's order or None when it is their own, reads,
    provides) of a segment whose signature was not seen before."""
    kind, order = _kind_of(draft, kinds, by_hash)
    renumber = {old: new for new, old in enumerate(order)}
    reads = tuple(sorted((-1 - r, renumber[p], k) for p in order for k, r in enumerate(draft.refs[p]) if r < 0))
    provides = tuple(("node", renumber[r]) if r >= 0 else ("slot", -1 - r) for r in draft.provides)
    return kind, None if order == list(range(len(order))) else order, reads, provides
