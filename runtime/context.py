"""Context parallelism, DeepSpeed-Ulysses style, on the `cp` mesh axis (on ep x cp when the ep
ranks are context-parallel ranks of the dense layers, mesh ep_as = "cp": then "cp" below stands for
that group, of cp x ep ranks, and c for a rank's position in it).

Every activation of a cp rank holds its own T/cp tokens of each sequence (rank c: tokens
[c T/cp, (c+1) T/cp)); the program shards tokens and targets so (`RankProgram.shard_batch`).
Linear layers, norms, pointwise ops, the MoE and the loss are per token and run unchanged. Around
each attention core the graph gets, for q, k and v (B, T/cp, heads * d) on this tp rank:

    cp_heads(x, repeat, cp)     all-to-all: sequence shards -> head shards (B, T, heads/cp * d),
                                kv heads first repeated `repeat` times when fewer than cp divide them
    core(q, k, v)               the unchanged attention on the whole sequence for heads/cp heads:
                                causal masking and RoPE (computed from T inside the core) see global
                                positions
    cp_sequence(y, cp)          all-to-all back: (B, T, heads/cp * d) -> (B, T/cp, heads * d)

Learned positions (GPT's `arange(T)` before the position embedding) get this rank's offset:
`cp_positions(arange, cp)` = arange + c T/cp. The loss is this rank's mean over its tokens; the
program averages it over the data ranks (dp x ep x cp), all of which hold equally many tokens, and
sums the parameter gradients over cp (each rank's are partial sums over its tokens).

Head counts per tp rank must divide by cp for q; kv heads are repeated up to the smallest count that
cp divides and that divides the q heads (as Ulysses does for grouped-query attention).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from autoplan.capture import NodeInfo
from autoplan.errors import PlanError
from autoplan.placement import Shard
from autoplan.runtime.collectives import all_to_all_dims
from autoplan.runtime.groups import RankGroup
from autoplan.strategies import Strategy
from autoplan.validity import ulysses_kv_heads


def cp_heads(x: torch.Tensor, head_dim: int, repeat: int, cp: RankGroup) -> torch.Tensor:
    """(B, T/cp, h d) sequence shard -> (B, T, h repeat / cp * d) head shard."""
    if repeat > 1:
        B, T, width = x.shape
        x = x.view(B, T, width // head_dim, head_dim).repeat_interleave(repeat, dim=2)
        x = x.reshape(B, T, width * repeat)
    return all_to_all_dims(x, 1, 2, cp.group)


def cp_sequence(y: torch.Tensor, cp: RankGroup) -> torch.Tensor:
    """(B, T, h/cp * d) head shard -> (B, T/cp, h d) sequence shard."""
    return all_to_all_dims(y, 2, 1, cp.group)


def cp_positions(positions: torch.Tensor, cp: RankGroup) -> torch.Tensor:
    """Local position indices 0..T/cp-1 -> this rank's global ones."""
    return positions + cp.index * positions.shape[-1]


def kv_repeat(q_heads: int, kv_heads: int, cp: int) -> int:
    """The smallest r with cp | kv_heads r and kv_heads r | q_heads (`validity.ulysses_kv_heads`, the
    heads the step model prices)."""
    return ulysses_kv_heads(q_heads, kv_heads, cp) // kv_heads


def apply_context_parallel(gm: fx.GraphModule, infos: dict[str, NodeInfo],
                           strategies: dict[str, Strategy], cp: RankGroup, tp_size: int,
                           head_dim: int) -> None:
    """Insert the Ulysses all-to-alls around every attention core and offset the positions."""
    graph = gm.graph
    gm.add_submodule("cp", cp)
    first = next(n for n in graph.nodes if n.op != "placeholder")
    with graph.inserting_before(first):
        cp_node = graph.get_attr("cp")
    for node in list(graph.nodes):
        info = infos.get(node.name)
        if info is None:
            continue
        if info.op_kind == "attention":
            _wrap_attention(graph, node, info, strategies[node.name], cp_node, cp.size, tp_size,
                            head_dim)
        elif node.op == "call_function" and node.target is torch.arange:
            _offset_positions(graph, node, cp_node)


def _local_heads(info: NodeInfo, strategy: Strategy, i: int, tp_size: int, head_dim: int) -> int:
    width = info.input_metas[i].shape[-1]
    split = strategy.inputs[i].placement == Shard(2)
    return width // head_dim // (tp_size if split else 1)


def _wrap_attention(graph: fx.Graph, node: fx.Node, info: NodeInfo, strategy: Strategy,
                    cp_node: fx.Node, cp: int, tp_size: int, head_dim: int) -> None:
    q_heads = _local_heads(info, strategy, 0, tp_size, head_dim)
    kv_heads = _local_heads(info, strategy, 1, tp_size, head_dim)
    if q_heads % cp:
        raise PlanError(f"node {node.name!r}: {q_heads} q heads per tp rank are not divisible by "
                        f"cp={cp}; Ulysses needs heads divisible by tp * cp")
    repeat = kv_repeat(q_heads, kv_heads, cp) if kv_heads % cp else 1
    q, k, v = node.args
    made = []
    with graph.inserting_before(node):
        for x, r in ((q, 1), (k, repeat), (v, repeat)):
            made.append(graph.call_function(cp_heads, (x, head_dim, r, cp_node)))
            made[-1].meta.update(layer=info.layer)
    node.args = tuple(made)
    with graph.inserting_after(node):
        back = graph.call_function(cp_sequence, (node, cp_node))
    back.meta.update(layer=info.layer)
    node.replace_all_uses_with(back, delete_user_cb=lambda user: user is not back)


def _offset_positions(graph: fx.Graph, node: fx.Node, cp_node: fx.Node) -> None:
    """`arange(tokens.size(1))` (learned positions) -> this rank's global positions."""
    length = node.args[0] if node.args else None
    is_seq = (isinstance(length, fx.Node) and length.op == "call_method" and length.target == "size"
              and length.args[0].op == "placeholder" and tuple(length.args[1:]) in ((1,), (-1,)))
    if not is_seq:
        raise PlanError(f"node {node.name!r} (torch.arange) is not arange(tokens.size(1)): context "
                        f"parallelism cannot tell whether it indexes positions; plan with cp=1")
    with graph.inserting_after(node):
        shifted = graph.call_function(cp_positions, (node, cp_node))
    node.replace_all_uses_with(shifted, delete_user_cb=lambda user: user is not shifted)
