"""Activation recomputation as the plan's policy says (`autoplan.recompute_policy`): each recomputed
transformer layer becomes one region of the graph, run under torch's selective activation
checkpointing with the policy's choice of what to save.

    regions      the layers `policy.recomputed_layers(L)`: every node of layer i (the capture's
                 `NodeInfo.layer`, or `meta["layer"]` for nodes the runtime inserted, such as the
                 tensor-parallel conversions, which belong to the node they feed)
    per region   recompute(self.recompute_<layer>_<i>, *inputs, saves=(families...)), placed where
                 the region's last node was:
                     torch.utils.checkpoint.checkpoint(region, *inputs, use_reentrant=False,
                         context_fn=save_contexts(saves))
                 under set_checkpoint_early_stop(False): torch's selective checkpointing, whose
                 backward side `ReplaySaved` consults only for the saved families' ops. Forward keeps the region's inputs and the
                 outputs of the ops whose family (`aten_op_family`) the policy saves; backward
                 re-runs the whole region (its collectives too, in the same order on every rank),
                 taking the saved outputs from the cache, and then differentiates it.

The ops and their order are unchanged, so the numbers equal those without recomputation (bit for bit,
as tests/test_runtime_recompute.py checks). `observe_recompute()` counts the decisions the policy
functions make, by (family, saved), so a test can check that the run applied the plan's policy.

A region may move as one call only if no node outside it that runs before its last node uses one
of its values; a layer is cut into the longest runs in graph order that can (the zoo's layers are
one run each).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import operator
from collections import Counter
from collections.abc import Callable, Iterator

import torch.fx as fx
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint,
                                    create_selective_checkpoint_contexts,
                                    set_checkpoint_early_stop)

from autoplan.capture import NodeInfo
from autoplan.recompute_policy import RecomputePolicy, aten_op_family

SKIPPED_OPS = ("placeholder", "output", "get_attr")

# The open observation: a Counter of (family, saved) -> ops; None when nobody observes.
_OBSERVED: contextvars.ContextVar[Counter | None] = contextvars.ContextVar(
    "autoplan_recompute_observed", default=None)


@contextlib.contextmanager
def observe_recompute() -> Iterator[Counter]:
    """Count the save / recompute decisions of every recomputed region run inside the block, as
    {(family, saved): ops} over the forward ops of the regions."""
    seen: Counter = Counter()
    token = _OBSERVED.set(seen)
    try:
        yield seen
    finally:
        _OBSERVED.reset(token)


# The open watch of region runs: an object with enter_region() and exit_region(output); None when none.
_WATCHER: contextvars.ContextVar[object | None] = contextvars.ContextVar("autoplan_recompute_watcher", default=None)


@contextlib.contextmanager
def watch_regions(watcher) -> Iterator[None]:
    """Call `watcher.enter_region()` and `watcher.exit_region(output)` around every run of a recomputed
    region inside the block (both runtimes'): its forward, and its re-run while backward runs on this
    thread (runtime.memory_probe measures what a re-run holds)."""
    token = _WATCHER.set(watcher)
    try:
        yield
    finally:
        _WATCHER.reset(token)


def _run_region(region: Callable, *args, **kwargs):
    watcher = _WATCHER.get()
    if watcher is None:
        return region(*args, **kwargs)
    watcher.enter_region()
    output = region(*args, **kwargs)
    watcher.exit_region(output)
    return output


class SavePolicy:
    """The policy function of torch's selective checkpointing: save the outputs of the ops whose
    family is in `saves`, recompute the rest (`PREFER_RECOMPUTE`, as plain checkpointing does)."""

    def __init__(self, saves: frozenset[str]) -> None:
        self.saves = saves

    def __call__(self, ctx, op, *args, **kwargs) -> CheckpointPolicy:
        family = aten_op_family(str(op.overloadpacket))
        saved = family in self.saves
        observed = _OBSERVED.get()
        if observed is not None and not ctx.is_recompute:
            observed[(family, saved)] += 1
        return CheckpointPolicy.MUST_SAVE if saved else CheckpointPolicy.PREFER_RECOMPUTE


class ReplaySaved(TorchDispatchMode):
    """Backward's side of selective checkpointing, consulted only for the ops of the saved families;
    every other op re-runs as it comes. torch's own side counts every op and refuses a re-run whose
    count of some op differs from forward's, which FSDP2 causes: re-running a region it issues more
    or fewer bookkeeping ops (record_function, copies) than the first run did."""

    def __init__(self, cached: TorchDispatchMode, saves: frozenset[str]) -> None:
        super().__init__()
        self.cached, self.saves = cached, saves

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if aten_op_family(str(func.overloadpacket)) in self.saves:
            return self.cached.__torch_dispatch__(func, types, args, kwargs)
        return func(*args, **(kwargs or {}))


def save_contexts(saves: frozenset[str]) -> tuple[TorchDispatchMode, TorchDispatchMode]:
    """The (forward, recompute) contexts of a region saving the `saves` families' outputs."""
    caching, cached = create_selective_checkpoint_contexts(SavePolicy(saves))
    return caching, ReplaySaved(cached, saves)


class CountRecomputed(TorchDispatchMode):
    """Forward's side of a region that saves nothing, while someone observes: counts each op as
    recomputed, the decision the policy function would have made."""

    def __init__(self, observed: Counter) -> None:
        super().__init__()
        self.observed = observed

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.observed[(aten_op_family(str(func.overloadpacket)), False)] += 1
        return func(*args, **(kwargs or {}))


def recompute_all_contexts() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """The contexts of a region that saves nothing: none (plain checkpointing), or under
    `observe_recompute` a counting forward."""
    observed = _OBSERVED.get()
    forward = CountRecomputed(observed) if observed is not None else contextlib.nullcontext()
    return forward, contextlib.nullcontext()


def recompute(region: Callable, *args, saves: tuple[str, ...] = (), **kwargs):
    """Run `region(*args, **kwargs)` (a graph region, or a module block's forward:
    runtime.module_recompute) keeping its inputs and the outputs of the `saves` families' ops for
    backward (non-reentrant selective checkpoint). The whole region is re-run (early_stop=False), as
    the cost model prices it and as runtime.counting predicts its collectives.

    A region that saves nothing runs under plain checkpointing, without selective checkpointing's
    dispatch modes: those cost the host a Python call per op in forward and again in the re-run
    (3.1 against 1.4 ms per forward + backward of a small Llama block on a CPU, whose plain forward +
    backward took 0.6 ms), and keep nothing more. The cost model prices the host's time per kernel
    under selective checkpointing apart (`Efficiency.host_sac_kernel_s`)."""
    contexts = (functools.partial(save_contexts, frozenset(saves)) if saves else recompute_all_contexts)
    with set_checkpoint_early_stop(False):  # the context manager exists in every torch we support
        return checkpoint(functools.partial(_run_region, region), *args, use_reentrant=False, context_fn=contexts,
                          **kwargs)


def node_layer(node: fx.Node, infos: dict[str, NodeInfo]) -> int | None:
    """The transformer layer a node of the rewritten graph belongs to: the capture's for captured
    nodes, `meta["layer"]` for nodes the runtime inserted (that of the node they serve)."""
    info = infos.get(node.name)
    return info.layer if info is not None else node.meta.get("layer")


def apply_recompute(gm: fx.GraphModule, policy: RecomputePolicy, infos: dict[str, NodeInfo],
                    num_layers: int) -> tuple[int, ...]:
    """Move each layer `policy` recomputes into checkpointed regions; returns those layers."""
    layers = set(policy.recomputed_layers(num_layers))
    candidates: dict[int, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        layer = node_layer(node, infos)
        if node.op not in SKIPPED_OPS and layer in layers:
            candidates.setdefault(layer, []).append(node)
    saves = tuple(sorted(policy.saves))
    for layer, nodes in candidates.items():
        for index, region in enumerate(_valid_regions(nodes)):
            _extract(gm, region, f"recompute_{layer}_{index}", layer, saves)
    gm.graph.lint()
    return tuple(sorted(candidates))


def _valid_regions(nodes: list[fx.Node]) -> list[list[fx.Node]]:
    """`nodes` (graph order) cut into the longest runs that can move as one call."""
    position = {n: i for i, n in enumerate(nodes[0].graph.nodes)}
    runs: list[list[fx.Node]] = []
    for node in nodes:
        if runs and _movable(runs[-1] + [node], position):
            runs[-1].append(node)
        else:
            runs.append([node])
    return runs


def _movable(region: list[fx.Node], position: dict[fx.Node, int]) -> bool:
    inside, last = set(region), position[region[-1]]
    return all(position[user] > last for n in region for user in n.users if user not in inside)


def _extract(gm: fx.GraphModule, region: list[fx.Node], name: str, layer: int,
             saves: tuple[str, ...]) -> None:
    inside = set(region)
    inputs = list(dict.fromkeys(a for n in region for a in n.all_input_nodes
                                if a not in inside and a.op != "get_attr"))
    outputs = [n for n in region if any(u not in inside for u in n.users)]
    sub = fx.Graph()
    env: dict[fx.Node, fx.Node] = {a: sub.placeholder(a.name) for a in inputs}
    for n in region:
        for a in n.all_input_nodes:
            if a.op == "get_attr" and a not in env:
                env[a] = sub.get_attr(a.target)
        env[n] = sub.node_copy(n, lambda a: env[a])
    sub.output(env[outputs[0]] if len(outputs) == 1 else tuple(env[o] for o in outputs))
    gm.add_submodule(name, fx.GraphModule(gm, sub, class_name=name))
    graph = gm.graph
    with graph.inserting_after(region[-1]):
        module = graph.get_attr(name)
    with graph.inserting_after(module):
        call = graph.create_node("call_function", recompute, (module, *inputs), {"saves": saves},
                                 name=f"{name}_out")
    results = [call]
    if len(outputs) > 1:
        results = []
        for i in range(len(outputs)):
            with graph.inserting_after(results[-1] if results else call):
                results.append(graph.call_function(operator.getitem, (call, i)))
    for made in (module, call, *results):
        made.meta["layer"] = layer
    for out, new in zip(outputs, results):
        out.replace_all_uses_with(new, delete_user_cb=lambda user: user not in inside)
    for n in reversed(region):
        graph.erase_node(n)
