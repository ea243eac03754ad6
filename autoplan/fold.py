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

The folded solve (`solve_folded`). At one (tp, microbatch), a cut's state is the joint output
placement of its slots (R, S(1), S(2) each, for the tensors whose producer has a choice). For each
kind and each pair of states the chain needs, the kind's ILP is solved with that boundary fixed
(`autoplan.solver.ilp`: all pairs at once by exact variable elimination when the block's pair graph
is narrow, else one ILP model per kind, re-solved per pair), giving the tables T_kind[p, q];
`autoplan.solver.chain` picks a state per cut, and each segment takes its kind's solution for its
pair. Every node and edge lies in exactly one segment, so the chain's objective is the unfolded
objective of the spread choice and its minimum is the unfolded ILP's minimum (tests/test_chain.py).
Strategy rules may read a node's label only (not its module path) for this to hold. A cut with more
than `max_cut_states` joint placements falls back to one unfolded ILP.
"""

from __future__ import annotations

import hashlib
import itertools
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping

import networkx as nx
import numpy as np
from networkx.algorithms.isomorphism import DiGraphMatcher

from autoplan.cluster import ClusterSpec
from autoplan.cost_model.compute import Efficiency
from autoplan.cost_model.intra_op import (assignment_from_choice, boundary_variant, build_intra_op_problem,
                                          entry_costs, graph_strategies, make_context, segment_arrays,
                                          segment_problem)
from autoplan.cost_model.memory import state_bytes_for
from autoplan.mesh import MeshShape
from autoplan.solver.chain import solve_chain
from autoplan.solver.ilp import solve_ilp, solve_ilp_variants
from autoplan.strategies import StrategyRegistry

if TYPE_CHECKING:
    from autoplan.capture import CapturedGraph, NodeInfo

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


# ---------------------------------------------------------------------------------- the folded solve


@dataclass(frozen=True)
class FoldedSolution:
    """The chosen strategy of every node, by a chain over per-kind cost tables (or one unfolded ILP)."""

    assignment: dict[str, str]  # node name -> strategy name, every node
    objective: float  # seconds per microbatch: the unfolded problem's objective of `assignment`
    status: str  # "optimal" | "feasible" (some block ILP stopped by its time limit)
    solver: str  # "highs" | "cbc" | "elimination" | "trivial"
    method: str  # "chain" | "unfolded: <why>"
    num_ilps: int  # block problems solved: one per kind and boundary pair
    solve_time_s: float


@dataclass
class _Entry:
    objective: float
    names: tuple[str, ...]  # strategy name per position
    status: str
    solver: str


class _Tables:
    """Cost table entries T_kind[p, q] at one (tp, microbatch): `prepare` finds the pairs of boundary
    placements the chain needs and solves each kind's pairs as variants of one problem."""

    def __init__(self, folded: FoldedGraph, strategies: dict[str, list], placements: list, ctx, dtype: str,
                 time_limit_s: float, solver: str | None) -> None:
        self.folded, self.strategies, self.placements, self.ctx = folded, strategies, placements, ctx
        self.state = state_bytes_for(dtype)
        self.time_limit_s, self.solver = time_limit_s, solver
        self.first = {seg.kind: seg for seg in reversed(folded.segments)}  # each kind's first segment
        self.entries: dict[tuple, _Entry] = {}
        self.tables: dict[tuple, np.ndarray] = {}

    def keys(self, s: int, before: tuple, after: tuple) -> tuple[tuple, tuple] | None:
        """(reads, provides) of segment s between cut states `before` and `after`: the placement read
        by each edge of `Segment.reads`, and the placement of each node the segment provides; None
        when a slot passed through would change placement."""
        seg = self.folded.segments[s]
        if any(what == "slot" and after[c] != before[r] for c, (what, r) in enumerate(seg.provides)):
            return None
        return (tuple(before[slot] for slot, _, _ in seg.reads),
                tuple(after[c] for c, (what, _) in enumerate(seg.provides) if what == "node"))

    def prepare(self, bounds: list[tuple[tuple, ...]]) -> None:
        """Solve every entry some segment needs between the states `bounds[s]` and `bounds[s + 1]`."""
        needed: dict[int, dict[tuple, None]] = defaultdict(dict)  # kind -> keys, in order of first need
        patterns = set()
        for s, seg in enumerate(self.folded.segments):
            pattern = (seg.kind, id(bounds[s]), id(bounds[s + 1]))  # equal cuts share one states tuple
            if pattern in patterns:
                continue
            patterns.add(pattern)
            for x in bounds[s]:
                for y in bounds[s + 1]:
                    keys = self.keys(s, x, y)
                    if keys is not None:
                        needed[seg.kind][keys] = None
        for kind, keys in needed.items():
            self._solve_kind(kind, list(keys))

    def _solve_kind(self, kind: int, keys: list[tuple[tuple, tuple]]) -> None:
        seg, nodes = self.first[kind], self.folded.kind_nodes[kind]
        arrays = segment_arrays(nodes, [self.strategies[n] for n in seg.nodes], self.ctx, self.state)
        rows: dict[tuple, np.ndarray] = {}

        def row(p: int, k: int, src: int) -> np.ndarray:
            if (p, k, src) not in rows:
                placement = self.placements[src]
                rows[(p, k, src)] = entry_costs(nodes[p].input_metas[k], placement, arrays.strategies[p], k, self.ctx)
            return rows[(p, k, src)]

        provided = [p for what, p in seg.provides if what == "node"]
        variants = [boundary_variant(arrays, [(p, row(p, k, src)) for (_, p, k), src in zip(seg.reads, reads)],
                                     {p: self.placements[c] for p, c in zip(provided, provides)})
                    for reads, provides in keys]
        solutions = solve_ilp_variants(segment_problem(arrays), variants, time_limit_s=self.time_limit_s,
                                       solver=self.solver)
        for key, sol in zip(keys, solutions):
            names = tuple(arrays.strategies[p][i].name for p, i in enumerate(sol.choice))
            self.entries[(kind, *key)] = _Entry(sol.objective, names, sol.status, sol.solver)

    def entry(self, kind: int, reads: tuple, provides: tuple) -> _Entry:
        return self.entries[(kind, reads, provides)]

    def table(self, s: int, before: tuple[tuple, ...], after: tuple[tuple, ...]) -> np.ndarray:
        """T[i, j] of segment s between the joint placements `before[i]` and `after[j]` of its two cuts;
        segments of one kind between equal state lists share one table."""
        key = (self.folded.segments[s].kind, id(before), id(after))  # equal cuts share one states tuple
        if key not in self.tables:
            table = np.full((len(before), len(after)), np.inf)
            for i, x in enumerate(before):
                for j, y in enumerate(after):
                    keys = self.keys(s, x, y)
                    if keys is not None:
                        table[i, j] = self.entry(self.folded.segments[s].kind, *keys).objective
            self.tables[key] = table
        return self.tables[key]


def _cut_states(folded: FoldedGraph, firsts: dict[int, Segment], strategies: dict[str, list]
                ) -> tuple[list[tuple[tuple[int, ...], ...]], list]:
    """The joint placements of each cut's slots, as tuples of placement codes, and the placement of each
    code. A slot's placements are those of the node providing it (read off its kind's first segment:
    position p of every segment of a kind has the same strategies) or, passed through, of the slot before."""
    codes: dict = {}  # placement -> small int (cheap to hash)
    by_node: dict[str, tuple[int, ...]] = {}
    shared: dict[tuple, tuple] = {}  # equal cuts share one states tuple
    states, before = [], []
    for seg in folded.segments[:-1]:
        slots = []
        for what, r in seg.provides:
            if what == "slot":
                slots.append(before[r])
                continue
            name = firsts[seg.kind].nodes[r]
            if name not in by_node:
                by_node[name] = tuple(codes.setdefault(s.output, len(codes)) for s in strategies[name])
                by_node[name] = tuple(dict.fromkeys(by_node[name]))  # distinct, in order of first appearance
            slots.append(by_node[name])
        key = tuple(slots)
        if key not in shared:
            shared[key] = tuple(itertools.product(*slots))
        states.append(shared[key])
        before = slots
    return states, list(codes)


def solve_folded(folded: FoldedGraph, registry: StrategyRegistry, info: Mapping, cluster: ClusterSpec,
                 mesh: MeshShape, microbatch_size: int, dtype: str = "bfloat16", *,
                 efficiency: Efficiency | None = None, time_limit_s: float = 60.0,
                 solver: str | None = None, max_cut_states: int = MAX_CUT_STATES) -> FoldedSolution:
    """The unfolded intra-op optimum, solving each kind once per pair of boundary placements and
    chaining the tables (`autoplan.solver.ilp` and `autoplan.solver.chain` docstrings). A cut with more
    than `max_cut_states` joint placements falls back to one ILP over the unfolded graph."""
    start = time.perf_counter()
    graph = folded.graph
    ctx = make_context(graph, cluster, mesh, microbatch_size, dtype, efficiency)
    firsts = {seg.kind: seg for seg in reversed(folded.segments)}
    # a kind's nodes share its strategies: ask for its first segment's only
    strategies = graph_strategies(graph, registry, info, mesh.tp, [n for nodes in folded.kind_nodes for n in nodes])
    states, placements = _cut_states(folded, firsts, strategies)
    widest = max((len(x) for x in states), default=1)
    if widest > max_cut_states:
        return _solve_unfolded(folded, registry, info, cluster, mesh, microbatch_size, dtype, efficiency,
                               time_limit_s, solver, f"a cut has {widest} joint placements (> {max_cut_states})", start)
    tables = _Tables(folded, strategies, placements, ctx, dtype, time_limit_s, solver)
    bounds = [((),), *states, ((),)]
    tables.prepare(bounds)
    chain = solve_chain([tables.table(s, bounds[s], bounds[s + 1]) for s in range(len(folded.segments))])
    cut_states = [()] + [x[i] for x, i in zip(states, chain.states)] + [()]
    assignment: dict[str, str] = {}
    picked: dict[tuple, tuple[str, ...]] = {}  # blocks of one kind between equal states: one entry
    for s, seg in enumerate(folded.segments):
        key = (seg.kind, id(seg.reads), id(seg.provides), cut_states[s], cut_states[s + 1])
        if key not in picked:
            picked[key] = tables.entry(seg.kind, *tables.keys(s, cut_states[s], cut_states[s + 1])).names
        assignment.update(zip(seg.nodes, picked[key]))
    used = {e.solver for e in tables.entries.values()}
    status = "optimal" if all(e.status == "optimal" for e in tables.entries.values()) else "feasible"
    name = next((x for x in ("highs", "cbc", "elimination") if x in used), "trivial")
    return FoldedSolution(assignment, chain.objective, status, name, "chain", len(tables.entries),
                          time.perf_counter() - start)


def _solve_unfolded(folded: FoldedGraph, registry: StrategyRegistry, info: Mapping, cluster: ClusterSpec,
                    mesh: MeshShape, microbatch_size: int, dtype: str, efficiency: Efficiency | None,
                    time_limit_s: float, solver: str | None, why: str, start: float) -> FoldedSolution:
    built = build_intra_op_problem(folded.graph, registry, info, mesh.tp, cluster, mesh, microbatch_size, dtype,
                                   fold=False, efficiency=efficiency)
    sol = solve_ilp(built.problem, time_limit_s=time_limit_s, solver=solver)
    return FoldedSolution(assignment_from_choice(built, sol.choice), sol.objective, sol.status, sol.solver,
                          f"unfolded: {why}", 1, time.perf_counter() - start)
