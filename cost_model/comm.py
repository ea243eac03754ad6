"""Communication costs: alpha-beta ring formulas and the link a mesh axis uses.

Each formula is a pure function of (B bytes, n ranks, bw bytes/s per rank and direction, alpha s).
B is always the FULL tensor's bytes (the all-gathered result, the all-reduced buffer), as
`autoplan.strategies.Comm` sizes them. Ring algorithms (Thakur et al. 2005; Patarasuk & Yuan 2009):

    all_reduce      2 (n-1)/n * B / bw + 2 (n-1) alpha      (reduce-scatter then all-gather)
    all_gather      (n-1)/n * B / bw + (n-1) alpha          (each rank receives the n-1 shards it lacks)
    reduce_scatter  (n-1)/n * B / bw + (n-1) alpha
    all_to_all      (n-1)/n * (B/n) / bw + (n-1) alpha      (each rank holds B/n and keeps 1/n of it;
                                                             with b = B/n its local bytes this is the
                                                             familiar (n-1)/n * b / bw)
    p2p             B / bw + alpha
    n == 1 -> 0 for every collective.

`collective_time_s` picks the link for a mesh axis. A group inside one node uses `intra_node`
(NVLink). A group spanning k nodes with r ranks in each uses, like NCCL's multi-channel rings
(one ring per NIC), the bandwidth min(bw_intra, r * bw_inter): each GPU has its own NIC in the
presets, so the r ranks of a node drive r NICs at once (DGX A100: 8 x 25 GB/s -> ~190 GB/s bus
bandwidth measured by nccl-tests across nodes). Its latency is hierarchical: (k-1) inter-node hops
plus (r-1) intra-node hops per ring pass. An all-to-all across nodes sends (n-r)/n of each rank's
bytes through its own NIC and (r-1)/n over NVLink, concurrently.

Every call also pays a fixed cost, whatever its size (`call_s`, `Efficiency.collective_call_s`):
the launch of its kernel and the protocol's setup, which the per-hop alpha above does not hold. NCCL's
own model (src/graph/tuning.cc) prices a call as baseLat + steps x hwLat + bytes / bw, with baseLat
6.6 us for a ring under the LL protocol that small messages use (8.4 us Simple): that base is the
call cost. A point-to-point send pays it too.

A hardware profile's collectives (`calibration.CollectiveCalibration`), when given, replace the
datasheet link for groups inside one node (their latency measured whole, the call cost in it): its
samples of that kind and group size read off at the message (linear between sizes, and beyond the
largest at its last slope; `calibration.sampled_time_s`), else its fit t = latency + message *
ring_factor / bus bandwidth, with the message as nccl-tests counts it (B, or B / n per rank for an
all-to-all); groups across nodes keep the ClusterSpec's links (a profile of one machine says nothing
about its network).

Inside a step (`Efficiency.collective_sync_s`, `collective_skew`): every blocking call (tp / sp / cp / ep
collectives, FSDP2's all-gathers and reduce-scatters, each data-parallel bucket, each pipeline send) costs
more than its time back to back, by

    s + c sqrt(d),   d: the compute the rank ran since its last blocking call

The waiting rank's threads sleep and must be woken (s), and the ranks reach the call out of step by what
their compute since they last met drifted apart: the sum of d's independent stretches, whose spread grows
as sqrt(d) (c). On a CPU (gloo, ranks sharing the cores) `profiler.collectives.collective_sync_s` fits both:
on the 2-core development machine (2026-11-26) 0.9-1.7 ms at 0.3 ms of compute, 1.3-2.2 ms at 2.6-9 ms,
2.9 ms at 20 ms and 2.6-4.1 ms at 40 ms (s about 0.9 ms, c about 0.45 ms per sqrt(ms)). The skew is
priced where d is known: the tp / cp / ep calls of a part (`intra_op.skew_s`, a layer's calls cyclically),
FSDP2's units and the data-parallel sync after backward (`dp_sync`); a pipeline send pays s. 0 without
such a profile (GPUs: not measured; NCCL waits on the device).

Ignored (a profile measures them): protocol efficiency (NCCL reaches ~80-90% of link bandwidth
on large messages), tree / NVLS / SHARP algorithms for small messages, contention between
collectives of different axes running at once, and oversubscribed network cores.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from autoplan.cluster import ClusterSpec, LinkSpec
from autoplan.cost_model.calibration import CollectiveCalibration
from autoplan.errors import ConfigError
from autoplan.mesh import MeshShape

COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


def _check(nbytes: float, n: int, bandwidth_bytes_per_s: float, latency_s: float) -> None:
    if nbytes < 0 or n < 1 or bandwidth_bytes_per_s <= 0 or latency_s < 0:
        raise ConfigError(f"collective cost needs bytes >= 0, n >= 1, bandwidth > 0, latency >= 0; got "
                          f"bytes={nbytes}, n={n}, bandwidth={bandwidth_bytes_per_s}, latency={latency_s}")


def all_reduce_time_s(nbytes: float, n: int, bandwidth_bytes_per_s: float, latency_s: float) -> float:
    """Ring all-reduce of a B-byte buffer: 2 (n-1)/n * B / bw + 2 (n-1) alpha."""
    _check(nbytes, n, bandwidth_bytes_per_s, latency_s)
    if n == 1:
        return 0.0
    return 2 * (n - 1) / n * nbytes / bandwidth_bytes_per_s + 2 * (n - 1) * latency_s


def all_gather_time_s(nbytes: float, n: int, bandwidth_bytes_per_s: float, latency_s: float) -> float:
    """Ring all-gather into a B-byte result: (n-1)/n * B / bw + (n-1) alpha."""
    _check(nbytes, n, bandwidth_bytes_per_s, latency_s)
    if n == 1:
        return 0.0
    return (n - 1) / n * nbytes / bandwidth_bytes_per_s + (n - 1) * latency_s


def reduce_scatter_time_s(nbytes: float, n: int, bandwidth_bytes_per_s: float, latency_s: float) -> float:
    """Ring reduce-scatter of a B-byte input: (n-1)/n * B / bw + (n-1) alpha."""
    return all_gather_time_s(nbytes, n, bandwidth_bytes_per_s, latency_s)


def all_to_all_time_s(nbytes: float, n: int, bandwidth_bytes_per_s: float, latency_s: float) -> float:
    """All-to-all of a tensor of B bytes in all (B/n per rank): (n-1)/n * (B/n) / bw + (n-1) alpha."""
    _check(nbytes, n, bandwidth_bytes_per_s, latency_s)
    if n == 1:
        return 0.0
    return (n - 1) / n * (nbytes / n) / bandwidth_bytes_per_s + (n - 1) * latency_s


def p2p_time_s(nbytes: float, bandwidth_bytes_per_s: float, latency_s: float) -> float:
    """One point-to-point send of B bytes: B / bw + alpha."""
    _check(nbytes, 2, bandwidth_bytes_per_s, latency_s)
    return nbytes / bandwidth_bytes_per_s + latency_s


def collective_formula(kind: str) -> Callable[[float, int, float, float], float]:
    """The ring formula of `kind` (one of COLLECTIVE_KINDS)."""
    formulas = {"all_reduce": all_reduce_time_s, "all_gather": all_gather_time_s,
                "reduce_scatter": reduce_scatter_time_s, "all_to_all": all_to_all_time_s}
    if kind not in formulas:
        raise ConfigError(f"collective kind {kind!r} is unknown; expected one of {', '.join(COLLECTIVE_KINDS)}")
    return formulas[kind]


@dataclass(frozen=True)
class AxisGroup:
    """One group of a mesh axis as the network sees it: `size` ranks over `nodes` nodes,
    `ranks_per_node` in each."""

    size: int
    nodes: int
    ranks_per_node: int

    @classmethod
    def of(cls, mesh: MeshShape, axis: str, gpus_per_node: int) -> "AxisGroup":
        nodes = mesh.nodes_spanned(axis, gpus_per_node)
        return cls(mesh.degree(axis), nodes, mesh.degree(axis) // nodes)


def link_for_axis(cluster: ClusterSpec, mesh: MeshShape, axis: str) -> LinkSpec:
    """The link class one group of `axis` uses: intra_node inside a node, else inter_node."""
    return cluster.intra_node if mesh.nodes_spanned(axis, cluster.gpus_per_node) == 1 else cluster.inter_node


def collective_time_s(kind: str, nbytes: float, cluster: ClusterSpec, mesh: MeshShape, axis: str,
                      measured: CollectiveCalibration | None = None, call_s: float = 0.0) -> float:
    """Time of one `kind` collective over a group of mesh `axis` (B = full tensor bytes; module doc)."""
    group = AxisGroup.of(mesh, axis, cluster.gpus_per_node)
    return group_collective_time_s(kind, nbytes, cluster, group, measured, call_s)


def group_collective_time_s(kind: str, nbytes: float, cluster: ClusterSpec, group: AxisGroup,
                            measured: CollectiveCalibration | None = None, call_s: float = 0.0) -> float:
    """`collective_time_s` for a precomputed `AxisGroup` (the per-op pricing calls this in a loop);
    `call_s`: the fixed cost of the call (module docstring), not added to a measured fit, which holds it."""
    n, nodes, per_node = group.size, group.nodes, group.ranks_per_node
    formula = collective_formula(kind)
    if n == 1:
        return 0.0
    intra, inter = cluster.intra_node, cluster.inter_node
    if nodes == 1:
        message = nbytes / n if kind == "all_to_all" else nbytes  # nccl-tests' message, as the profile's
        profiled = measured.time_s(kind, message, n) if measured is not None else None
        if profiled is not None:
            return profiled
        return call_s + formula(nbytes, n, intra.bandwidth_bytes_per_s, intra.latency_s)
    hops = (nodes - 1) * inter.latency_s + (per_node - 1) * intra.latency_s
    if kind == "all_to_all":
        local = nbytes / n
        remote_s = (n - per_node) / n * local / inter.bandwidth_bytes_per_s
        local_s = (per_node - 1) / n * local / intra.bandwidth_bytes_per_s
        return call_s + max(remote_s, local_s) + hops
    bandwidth = min(intra.bandwidth_bytes_per_s, per_node * inter.bandwidth_bytes_per_s)
    passes = 2 if kind == "all_reduce" else 1
    return call_s + formula(nbytes, n, bandwidth, 0.0) + passes * hops


def collective_is_affine(group: AxisGroup, measured: CollectiveCalibration | None) -> bool:
    """Whether `group_collective_time_s` over `group` is a + b * bytes with a >= 0 at every size: the ring
    formula, plus latencies and the call's fixed cost. A profile's samples inside a node are only monotone."""
    return measured is None or group.nodes > 1 or group.size == 1
