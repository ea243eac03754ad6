"""Which linears of a captured graph are Megatron's column and row projections, read from the graph's
data flow rather than from their names (issue 21: fused `qkv_proj`, `query_key_value`, `dense`,
`out_proj`, `c_fc`, DeepSeek's `kv_b_proj` are spelled differently in every family).

Walking from a linear's output through views and elementwise ops inside its parent module (the code
between two projections of one attention or MLP module, which runs on feature shards: the module
runtime's region), the ops it reaches there decide:

    column   it reaches an attention core (q, k, v, fused qkv, latent kv: the core splits on heads; not a
             latent core's rotary key, which every head reads whole), the
             cross-entropy (the lm_head: vocab-parallel logits), or another linear through an elementwise
             op other than a residual add / sub (an MLP's activation or gate: silu(gate) * up)
    row      walking back from its input through views and elementwise ops it reaches an attention core's
             output or a column linear of the above (o_proj, dense, out_proj, down_proj, fc2, c_proj)

A norm, an embedding, a MoE block, any other op, and any op outside the parent module (a residual add
in the decoder layer, a norm's ops where export left them ungrouped) end a walk. Linears
that are neither get no role (Megatron replicates them: DeepSeek's q_a_proj and kv_a_proj, whose outputs
are normalised first).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from autoplan.capture.hf_attention import LATENT_ATTENTION

if TYPE_CHECKING:
    from autoplan.capture.graph import CapturedGraph, NodeInfo

PASS_THROUGH = ("view", "elementwise")  # ops that run on whatever shard arrives
RESIDUAL = ("add", "sub")  # elementwise ops that join a residual stream, not an activation


def tp_roles(graph: "CapturedGraph") -> dict[str, str]:
    """{linear node name: "column" or "row"} by the data flow (module docstring)."""
    users: dict[str, list[NodeInfo]] = {}
    for node in graph.nodes:
        for name in node.inputs:
            users.setdefault(name, []).append(node)
    linears = [n for n in graph.nodes if n.op_kind == "linear"]
    column = {n.name for n in linears if _feeds_split_op(n, users)}
    by_name = {n.name: n for n in graph.nodes}
    row = {n.name for n in linears if n.name not in column and _fed_by_split_op(n, by_name, column)}
    return {name: "column" for name in column} | {name: "row" for name in row}


def _feeds_split_op(linear: "NodeInfo", users: dict) -> bool:
    """Whether `linear`'s output reaches an attention core or the cross-entropy, or another linear through
    a non-residual elementwise op, through views and elementwise ops only."""
    todo, seen, region = [(linear, False)], {linear.name}, _parent(linear)
    while todo:
        node, gated = todo.pop()
        for user in users.get(node.name, ()):
            if not _inside(user, region):
                continue
            if user.op_kind == "attention" and not _shared_input(user, node.name):
                return True
            if user.op_kind == "cross_entropy" or (user.op_kind == "linear" and gated):
                return True
            if user.op_kind in PASS_THROUGH and user.name not in seen:
                seen.add(user.name)
                todo.append((user, gated or (user.op_kind == "elementwise" and user.target not in RESIDUAL)))
    return False


def _fed_by_split_op(linear: "NodeInfo", by_name: dict, column: set[str]) -> bool:
    """Whether `linear`'s input comes from an attention core's output or a column linear, through views
    and elementwise ops only."""
    todo, seen, region = list(linear.inputs[:1]), set(), _parent(linear)
    while todo:
        node = by_name.get(todo.pop())
        if node is None or node.name in seen or not _inside(node, region):
            continue
        seen.add(node.name)
        if node.op_kind == "attention" or node.name in column:
            return True
        if node.op_kind in PASS_THROUGH:
            todo.extend(node.inputs)
    return False


def _shared_input(core: "NodeInfo", name: str) -> bool:
    """Whether input `name` of attention `core` is read whole by every head (a latent core's rotary key,
    `autoplan.capture.hf_attention`): its producer is not split."""
    return core.target == LATENT_ATTENTION and core.inputs.index(name) == 2


def _parent(linear: "NodeInfo") -> str:
    """The module holding `linear`'s module (its region)."""
    return linear.module_path.rpartition(".")[0]


def _inside(node: "NodeInfo", region: str) -> bool:
    return not region or node.module_path == region or node.module_path.startswith(region + ".")
