"""Conversion of an exported Hugging Face ATen graph into autoplan's `NodeInfo` records.

`autoplan.capture.hf` exports the model; this module groups and classifies the ATen nodes (fused
attention cores, norms, activations, cross-entropy; views; routing ops), fixes the batch-leading
layout, and prices each node. The groupings, op kinds, layout and cost formulas are documented in
`autoplan.capture.hf`'s module docstring.
"""

from __future__ import annotations

import operator
import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Iterable

import torch
import torch.fx as fx
from torch import nn

from autoplan.capture import NodeInfo, TensorMeta
from autoplan.capture.hf_moe import MoeBlock, moe_blocks, moe_forward_flops, moe_region
from autoplan.capture.hf_attention import LATENT_ATTENTION, attention_flops, fused_widths, in_attention, key_window
from autoplan.capture.graph import COMPOSITE
from autoplan.capture.hf_ops import (ACTIVATION_CLASS, ATTENTION_TARGETS, COPIES, EXTRA_ELEMENTWISE, FLOAT_DTYPES, HfLayout, LOSS_TARGETS, MATMUL_TARGETS, NLL_TARGETS, NORM_CLASS, NORM_TARGETS, PERMUTES, RESHAPES, SKIPPED, SOFTMAX, SPLITS, VIEW_OTHERS, _costs, _elementwise_name, _first_getitem, _is_pointwise, _is_tuple, _meta, _module_path, _ordered_unique, _readable_names, _swaps_last_two, _target_name, _zero_dead, layer_of, split_target,
                                     view_target)


@dataclass
class _Group:
    """Nodes fused into one NodeInfo (module docstring)."""

    name: str
    kind: str
    target: str
    path: str
    members: set[str]
    output: fx.Node
    inputs: list[fx.Node]  # fx nodes outside the group, argument order
    pieces: tuple[int, int, int] | None = None  # attention on one fused QKV input: its q, k, v widths


@dataclass
class _Param:
    fqn: str
    transposed: bool  # the consumer sees the stored tensor with its last two dims swapped


@dataclass
class GraphConverter:
    """ExportedProgram -> NodeInfos: parameters and constants, groups, kinds, layout, costs."""

    program: torch.export.ExportedProgram
    model: nn.Module
    layout: HfLayout
    params: dict[str, _Param] = field(default_factory=dict)  # fx node -> parameter it stands for
    constants: set[str] = field(default_factory=set)  # buffers, lifted constants, their views
    groups: dict[str, _Group] = field(default_factory=dict)  # member name -> its group
    paths: dict[str, tuple[str, str]] = field(default_factory=dict)
    param_meta: dict[str, TensorMeta] = field(default_factory=dict)  # fqn -> stored shape and dtype

    def __post_init__(self) -> None:
        self.graph = self.program.graph
        self.by_name = {n.name: n for n in self.graph.nodes}
        self.paths = {n.name: _module_path(n) for n in self.graph.nodes}
        self.order = {n.name: i for i, n in enumerate(self.graph.nodes)}
        sig = self.program.graph_signature
        by_id = defaultdict(list)
        for name, p in self.model.named_parameters(remove_duplicate=False):
            by_id[id(p)].append(name)
        self.aliases = {name: names for names in by_id.values() for name in names}
        for n in self.graph.nodes:
            if n.op == "placeholder" and n.name in sig.inputs_to_parameters:
                self.params[n.name] = _Param(sig.inputs_to_parameters[n.name], False)
                self.param_meta[self.params[n.name].fqn] = _meta(n.meta["val"], _NO_LAYOUT)
            elif n.op == "placeholder" and (n.name in sig.inputs_to_buffers
                                            or n.name in sig.inputs_to_lifted_tensor_constants):
                self.constants.add(n.name)
            elif n.op in ("get_attr",):
                self.constants.add(n.name)
            elif n.op == "call_function":
                self._propagate_constant(n)

    def _propagate_constant(self, n: fx.Node) -> None:
        """Views and casts of a parameter stand for the parameter; of a buffer, for a constant."""
        target = _target_name(n)
        if target not in RESHAPES | COPIES | PERMUTES | {"to", "_to_copy", "type_as", "expand"}:
            return
        tensors = [a for a in n.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]
        if len(tensors) != 1:
            return
        source = tensors[0].name
        if source in self.params:
            swap = target in PERMUTES and _swaps_last_two(n)
            self.params[n.name] = _Param(self.params[source].fqn, self.params[source].transposed ^ swap)
        elif source in self.constants:
            self.constants.add(n.name)

    # ------------------------------------------------------------------ groups

    def _find_groups(self) -> None:
        self.latent = self._latent_tensors()
        for block in moe_blocks(self.model):
            self._add(self._moe_group(block))
        for n in self.graph.nodes:
            if n.op == "call_function" and _target_name(n) in ATTENTION_TARGETS:
                self._add(self._attention_group(n))
            elif n.op == "call_function" and _target_name(n) in ("matmul", "bmm") and self._eager_qkv(n):
                self._add(self._attention_group(n, self._eager_qkv(n)))
            elif n.op == "call_function" and _target_name(n) in NLL_TARGETS:
                self._add(self._loss_group(n))
        by_module: dict[tuple[str, str], list[fx.Node]] = defaultdict(list)
        for n in self.graph.nodes:
            if n.op == "call_function" and n.name not in self.groups and self._is_op(n):
                path, cls = self.paths[n.name]
                if path and NORM_CLASS.search(cls):
                    by_module[("norm", path)].append(n)
                elif path and ACTIVATION_CLASS.search(cls) and not NORM_CLASS.search(cls):
                    by_module[("act", path)].append(n)
        for (kind, path), members in by_module.items():
            cls = self.paths[members[0].name][1]
            if kind == "norm":
                self._add(self._module_group(members, "norm", cls, path))
            elif len(members) > 1:
                target = next((a for a in ("gelu", "silu", "relu", "tanh", "mish") if a in cls.lower()), cls.lower())
                # several ops (transformers' NewGELUActivation: 0.5 x (1 + tanh(...))), not one kernel
                self._add(self._module_group(members, "elementwise", f"{target}{COMPOSITE}", path))

    def _add(self, group: _Group | None) -> None:
        if group is not None:
            for m in group.members:
                self.groups[m] = group

    def _is_op(self, n: fx.Node) -> bool:
        return (n.name not in self.params and n.name not in self.constants
                and _target_name(n) not in SKIPPED)

    def _module_group(self, members: list[fx.Node], kind: str, target: str, path: str) -> _Group | None:
        names = {m.name for m in members}
        outputs = [m for m in members if any(u.name not in names and _target_name(u) not in SKIPPED
                                             for u in m.users)]
        inputs = _ordered_unique(a for m in members for a in m.all_input_nodes
                                 if a.name not in names and self._is_tensor_input(a))
        if len(outputs) != 1 or not inputs or not isinstance(outputs[0].meta.get("val"), torch.Tensor):
            return None
        return _Group(self._free_name(path), kind, target, path, names, outputs[0], inputs)

    def _attention_group(self, sdpa: fx.Node, qkv: tuple | None = None) -> _Group | None:
        """The core of the attention module running `sdpa` (module docstring; the building blocks it
        takes in: `autoplan.capture.hf_attention`), or None when it does not have the (B, T, H*d) ->
        (B, T, Hq*d) shape the planner's attention rule expects. `qkv`: the q, k, v operands of an eager
        core ending at `sdpa` = probs @ v (`_eager_qkv`); None: SDPA's first three arguments."""
        path = self.paths[sdpa.name][0]
        members = {sdpa.name}
        todo = [a for a in sdpa.all_input_nodes]
        while todo:  # backwards, inside the module's own ops and per-head norms, to the 3-D activations
            a = todo.pop()
            if (a.name in members or a.op != "call_function" or not in_attention(*self.paths[a.name], path)
                    or not self._is_op(a) or self._is_activation(a)):
                continue
            members.add(a.name)
            todo.extend(a.all_input_nodes)
            todo.extend(self._in_place_fills(a))
        out = sdpa
        while not self._is_activation(out):  # forwards to the (B, T, Hq*d) result
            users = [u for u in out.users if _target_name(u) not in SKIPPED]
            if len(users) != 1 or self.paths[users[0].name][0] != path:
                return None
            out = users[0]
            members.add(out.name)
        sources = [self._source(a, members) for a in (qkv or sdpa.args[:3])]
        latent = self._latent_sources(sources, (qkv or sdpa.args[:3])[1], members)
        computed = self._downstream(latent or [s for s in sources if s is not None], members)
        for m in computed - {out.name}:
            if any(u.name not in members and _target_name(u) not in SKIPPED for u in self.by_name[m].users):
                return None  # an inner tensor is used outside the core
        if None in sources:
            return None
        if latent is not None:  # multi-head latent attention (DeepSeek): q, the expanded latent, the shared rotary key
            return _Group(self._free_name(f"{path}.core"), "attention", LATENT_ATTENTION, path, members, out, latent)
        pieces = None
        sliced = self._fused_slices(sources, members)
        if sliced is not None:  # q, k, v sliced from one fused QKV projection (Phi-3)
            members.update(s.name for s in sources)
            sources, pieces = sliced
        elif len({s.name for s in sources}) == 1:  # one fused QKV projection, sliced inside the core
            pieces = fused_widths(sources[0].meta["val"].shape[-1], out.meta["val"].shape[-1])
            sources = sources[:1]
        if len({s.name for s in sources}) != len(sources) or (len(sources) == 1 and pieces is None):
            return None
        return _Group(self._free_name(f"{path}.core"), "attention", "scaled_dot_product_attention", path,
                      members, out, sources, pieces)

    def _eager_qkv(self, n: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node] | None:
        """(q, k, v) when matmul `n` is eager attention's probs @ v: its first operand a softmax (through casts,
        dropout, views) of q @ k^T (through the mask's add and soft-capping; BLOOM's ALiBi baddbmm), all in
        one module and without parameters (`autoplan.capture.hf_attention`); else None."""
        path, seen_softmax = self.paths[n.name][0], False
        if not path or any(a.name in self.params for a in n.all_input_nodes) or len(n.args) < 2:
            return None
        a = n.args[0]
        while isinstance(a, fx.Node) and a.op == "call_function" and in_attention(*self.paths[a.name], path):
            target = _target_name(a)
            if target in ("matmul", "bmm", "baddbmm") and seen_softmax:
                q, k = a.args[-2:] if target == "baddbmm" else a.args[:2]
                return (q, k, n.args[1]) if not any(x.name in self.params for x in a.all_input_nodes) else None
            if target not in EAGER_SCORES and target not in SOFTMAX:
                return None
            seen_softmax = seen_softmax or target in SOFTMAX
            a = next((x for x in a.all_input_nodes if x.name not in self.params and x.name not in self.constants), None)
        return None

    def _downstream(self, sources: list[fx.Node], members: set[str]) -> set[str]:
        """The members computed from the core's input activations; the others compute positions only (rotary
        tables cast in the module, such as DeepSeek V2's complex frequencies, which export shares with the next
        layer): another core may read those."""
        found, todo = set(), list(sources)
        while todo:
            for u in todo.pop().users:
                if u.name in members and u.name not in found:
                    found.add(u.name)
                    todo.append(u)
        return found

    def _in_place_fills(self, n: fx.Node) -> list[fx.Node]:
        """The slices of `n` that copy_ fills in place, and those copy_s (DeepSeek's key, built as new_empty
        with its no-rotary and rotary parts copied in): they write `n`'s values, so a core reading `n`
        takes them in."""
        found = []
        for s in n.users:
            copies = list(s.users)
            if _target_name(s) == "slice" and copies and all(_target_name(c) == "copy_" and c.args[0] is s
                                                             for c in copies):
                found += [s, *copies]
        return found

    def _latent_sources(self, sources: list, k: object, members: set[str]) -> list[fx.Node] | None:
        """[q's, the expanded latent's, the shared rotary key's] activations of a multi-head latent attention
        core (`autoplan.capture.hf_attention`): k and v from one activation (kv_b_proj's, per head its
        no-rotary key | value), k also filled from a second, narrower one (the rotary key all heads share);
        else None."""
        if len(sources) != 3 or None in sources or sources[1] is not sources[2] or sources[0] is sources[1]:
            return None
        fills = self._in_place_fills(k) if isinstance(k, fx.Node) else []
        filled = {self._source(c.args[1], members) for c in fills if _target_name(c) == "copy_"}
        rotary = [f for f in filled if f is not None and f is not sources[1]]
        return [sources[0], sources[1], rotary[0]] if len(rotary) == 1 and None not in filled else None

    def _latent_tensors(self) -> set[str]:
        """Single-head 4-D views of token activations, (B, 1, T, F) for (B, T, F), that a linear reads, and
        those linears (DeepSeek's kv_b_proj on its compressed latent): described as the (B, T, F) they are
        (`_meta_of`), so the projection is an ordinary linear and its output an activation."""
        found: set[str] = set()
        for n in self.graph.nodes:
            val = n.meta.get("val")
            if n.op != "call_function" or not isinstance(val, torch.Tensor) or not val.is_floating_point() \
                    or tuple(val.shape[:3]) != (self.layout.batch, 1, self.layout.seq) or val.dim() != 4:
                continue
            target, x = _target_name(n), n.args[0] if n.args else None
            if not isinstance(x, fx.Node):
                continue
            if target in RESHAPES | {"unsqueeze"} and self._is_activation(x) \
                    and x.meta["val"].shape[-1] == val.shape[-1] and any(self._is_linear(u) for u in n.users):
                found.add(n.name)
            elif self._is_linear(n) and x.name in found:
                found.add(n.name)
        return found

    def _is_linear(self, n: fx.Node) -> bool:
        """A matmul with a parameter (a projection)."""
        return _target_name(n) in MATMUL_TARGETS and any(a.name in self.params for a in n.all_input_nodes)

    def _meta_of(self, n: fx.Node) -> TensorMeta | None:
        """The canonical meta of fx node `n`'s value (a latent (B, 1, T, F) as (B, T, F): `_latent_tensors`)."""
        meta = _meta(n.meta.get("val"), self.layout)
        if meta is not None and n.name in getattr(self, "latent", ()):
            return TensorMeta((meta.shape[0],) + meta.shape[2:], meta.dtype)
        return meta

    def _fused_slices(self, sources: list[fx.Node], members: set[str]
                      ) -> tuple[list[fx.Node], tuple[int, int, int]] | None:
        """([the fused tensor], (q, k, v widths)) when q, k and v are last-dim slices of one activation
        that only the core reads, else None."""
        if len(sources) != 3 or any(_target_name(s) not in ("slice", "narrow") or not s.args for s in sources):
            return None
        parent = sources[0].args[0]
        rank = parent.meta["val"].dim() if isinstance(parent, fx.Node) else 0
        for s in sources:
            dim = s.args[1] if len(s.args) > 1 else s.kwargs.get("dim", 0)
            if (s.args[0] is not parent or dim % max(rank, 1) != rank - 1
                    or any(u.name not in members and _target_name(u) not in SKIPPED for u in s.users)):
                return None
        widths = tuple(int(s.meta["val"].shape[-1]) for s in sources)
        if sum(widths) != parent.meta["val"].shape[-1] or widths[1] != widths[2]:
            return None
        return [parent], widths

    def _moe_group(self, block: MoeBlock) -> _Group | None:
        """The routed part of a MoE block as one "moe" node (`autoplan.capture.hf_moe`)."""
        found = moe_region(block, self.graph, self.paths, self._is_op)
        if found is None:
            return None
        members, out = found
        inputs = _ordered_unique(a for m in members for a in self.by_name[m].all_input_nodes
                                 if a.name not in members and self._is_tensor_input(a))
        if len(inputs) != 1 or not self._is_activation(inputs[0]) or not self._is_activation(out):
            return None
        return _Group(self._free_name(block.path), "moe", "moe", block.path, members, out, inputs)

    def _loss_group(self, nll: fx.Node) -> _Group | None:
        """log_softmax -> (views) -> nll_loss as one cross-entropy node reading the logits and targets."""
        members, a = {nll.name}, nll.args[0]
        while isinstance(a, fx.Node) and _target_name(a) in RESHAPES | COPIES and len(a.users) == 1:
            members.add(a.name)
            a = a.args[0]
        if not (isinstance(a, fx.Node) and _target_name(a) in SOFTMAX and "log" in _target_name(a)
                and len(a.users) == 1 and isinstance(nll.args[1], fx.Node)):
            return None
        members.add(a.name)
        path = self.paths[nll.name][0]
        return _Group(nll.name, "cross_entropy", "cross_entropy", path, members, nll, [a.args[0], nll.args[1]])

    def _source(self, a: object, members: set[str]) -> fx.Node | None:
        """The activation outside the core that q (k, v) comes from, following first tensor args."""
        while isinstance(a, fx.Node) and a.name in members:  # the first activation, lists too (partial rotary's cat)
            a = next((x for x in a.all_input_nodes if x.name not in self.params and x.name not in self.constants), None)
        return a if isinstance(a, fx.Node) and self._is_activation(a) else None

    def _is_activation(self, n: fx.Node) -> bool:
        """A floating (B, T, F) activation in the canonical layout."""
        val = n.meta.get("val")
        if not isinstance(val, torch.Tensor) or not val.is_floating_point():
            return False
        if n.name in getattr(self, "latent", ()):
            return True
        shape = self.layout.shape(tuple(val.shape))
        return len(shape) == 3 and shape[:2] == (self.layout.batch, self.layout.seq)

    def _is_tensor_input(self, a: fx.Node) -> bool:
        return (isinstance(a.meta.get("val"), torch.Tensor) and a.name not in self.params
                and a.name not in self.constants and _target_name(a) not in SKIPPED)

    def _free_name(self, path: str) -> str:
        name = re.sub(r"\W", "_", path) or "root"
        taken = {g.name for g in self.groups.values()}
        while name in self.by_name or name in taken:
            name += "_"
        return name

    # ------------------------------------------------------------------ nodes

    def nodes(self) -> tuple[NodeInfo, ...]:
        self._find_groups()
        drafts: list[NodeInfo] = []
        emitted: set[str] = set()
        for n in self.graph.nodes:
            if n.name in self.groups:
                group = self.groups[n.name]
                if n is group.output and group.name not in emitted:
                    drafts.extend(self._fused_pieces(group) + [self._group_info(group)])
                    emitted.add(group.name)
                continue
            if n.op == "placeholder" and (n.name in self.params or n.name in self.constants
                                          or not isinstance(n.meta.get("val"), torch.Tensor)):
                continue
            if n.op == "call_function" and (not self._is_op(n) or _is_tuple(n)):
                continue
            if n.op == "get_attr":
                continue
            drafts.append(self._node_info(n))
        return _zero_dead(_readable_names(drafts))

    def _resolve(self, a: fx.Node) -> str | None:
        """The NodeInfo name standing for fx node `a` as an input (None: parameter or constant)."""
        if a.name in self.params or a.name in self.constants or _target_name(a) in SKIPPED:
            return None
        if a.name in self.groups:
            return self.groups[a.name].name
        return a.name

    def _inputs(self, nodes: Iterable[fx.Node]) -> tuple[tuple[str, ...], tuple[TensorMeta, ...]]:
        names, metas = [], []
        for a in nodes:
            name = self._resolve(a)
            meta = self._meta_of(a)
            if name is not None and meta is not None and name not in names:
                names.append(name)
                metas.append(meta)
        return tuple(names), tuple(metas)

    def _param_metas(self, nodes: Iterable[fx.Node], path: str) -> tuple[tuple[str, TensorMeta], ...]:
        found: dict[str, TensorMeta] = {}
        for a in nodes:
            if a.name in self.params:
                fqn = self.params[a.name].fqn
                found[self._local_alias(fqn, path)] = self.param_meta[fqn]
        return tuple(found.items())

    def _local_alias(self, fqn: str, path: str) -> str:
        """A tied parameter's name under the module using it (lm_head.weight vs wte.weight)."""
        prefix = path + "." if path else ""
        return next((a for a in self.aliases.get(fqn, [fqn]) if a.startswith(prefix)), fqn)

    def _module(self, path: str) -> nn.Module | None:
        try:
            return self.model.get_submodule(path)
        except AttributeError:  # a path export spells otherwise than named_modules
            return None

    def _fused_pieces(self, g: _Group) -> list[NodeInfo]:
        """The q, k, v pieces of a fused QKV input as `split[2]` views (`autoplan.capture.hf_attention`)."""
        if g.pieces is None:
            return []
        (source,), (meta,) = self._inputs(g.inputs)
        return [NodeInfo(f"{g.name}_{piece}", "view", "split[2]", g.path, layer_of(g.path), (source,), (meta,),
                         TensorMeta(meta.shape[:-1] + (width,), meta.dtype), (), 0.0, 0.0, 0.0, 0.0)
                for piece, width in zip("qkv", g.pieces)]

    def _group_info(self, g: _Group) -> NodeInfo:
        members = [self.by_name[m] for m in sorted(g.members, key=self.order.__getitem__)]
        inputs, input_metas = self._inputs(g.inputs)
        if g.pieces is not None:
            pieces = self._fused_pieces(g)
            inputs, input_metas = tuple(p.name for p in pieces), tuple(p.output for p in pieces)
        params = self._param_metas((a for m in members for a in m.all_input_nodes), g.path)
        output = self._meta_of(g.output)
        fwd = {"attention": lambda: attention_flops(*input_metas[0].shape, key_window(self._module(g.path)),
                                                    output.shape[-1]),
               "norm": lambda: 5 * output.numel,
               "moe": lambda: moe_forward_flops(input_metas[0].shape, {n.rsplit(".", 1)[-1]: m.shape for n, m in params},
                                                self.layout.top_k),
               "elementwise": lambda: output.numel, "cross_entropy": lambda: 5 * input_metas[0].numel}[g.kind]()
        nbytes = sum(m.nbytes for m in input_metas) + sum(m.nbytes for _, m in params) + output.nbytes
        scale = 2.0 if g.kind in ("attention", "moe") else 1.0
        return NodeInfo(g.name, g.kind, g.target, g.path, layer_of(g.path), inputs, input_metas, output,
                        params, float(fwd), scale * fwd, float(nbytes), scale * nbytes)

    def _node_info(self, n: fx.Node) -> NodeInfo:
        path = self.paths[n.name][0]
        source = n.args[0] if n.target is operator.getitem and isinstance(n.args[0], fx.Node) else None
        tuple_op = source if source is not None and _is_tuple(source) else None
        op_node = tuple_op if tuple_op is not None else n
        tensor_args = [a for a in op_node.all_input_nodes]
        inputs, input_metas = self._inputs(tensor_args)
        params = self._param_metas(tensor_args, path)
        output = self._meta_of(n)
        kind, target = self._classify(n, op_node, params)
        if kind == "linear":  # the activation only: grouped_mm's expert offsets are routing metadata
            keep = [k for k, m in enumerate(input_metas) if m.dtype in FLOAT_DTYPES][:1]
            inputs, input_metas = tuple(inputs[k] for k in keep), tuple(input_metas[k] for k in keep)
        fwd, nbytes = _costs(kind, _target_name(op_node), op_node, n, input_metas, output, params)
        if tuple_op is not None and n.args[1] != _first_getitem(tuple_op):
            fwd = 0.0  # the op's FLOPs are counted once, on its first result
        floating = output is not None and output.dtype in FLOAT_DTYPES
        scale = (2.0 if kind == "linear" or _target_name(op_node) in MATMUL_TARGETS | ATTENTION_TARGETS
                 else 1.0) if floating or kind == "cross_entropy" else 0.0
        return NodeInfo(n.name, kind if n.op != "output" else "output", target, path, layer_of(path),
                        inputs, input_metas, output, params, float(fwd), scale * fwd, float(nbytes),
                        scale * nbytes)

    def _classify(self, n: fx.Node, op_node: fx.Node, params) -> tuple[str, str]:
        """(op kind, readable target) of a single node (module docstring)."""
        if n.op in ("placeholder", "output"):
            return n.op, n.op if n.op == "output" else n.name
        target = _target_name(op_node)
        if target in MATMUL_TARGETS:
            weight = next((self.params[a.name] for a in op_node.all_input_nodes if a.name in self.params
                           and a.meta["val"].dim() >= 2), None)
            if weight is None:
                return "other", target
            stored_out_in = weight.transposed != (target == "linear")  # linear(x, W) reads W as (out, in)
            base = "grouped_linear" if op_node.args[1].meta["val"].dim() == 3 else "linear"
            return "linear", base if stored_out_in else f"{base}_in_out"
        if target == "embedding" and params:
            return "embedding", "embedding"
        if target in NORM_TARGETS:
            return "norm", target
        if target in LOSS_TARGETS:
            return "cross_entropy", "cross_entropy"
        if target in ATTENTION_TARGETS:
            return "other", target  # not fused: runs replicated (see the warning)
        if op_node is not n:  # getitem of a tuple op
            if target in SPLITS:
                return "view", split_target(op_node, n, self.layout)
            return "other", f"{target}[{n.args[1]}]"
        if target in RESHAPES | COPIES | PERMUTES | SPLITS | VIEW_OTHERS:
            return "view", view_target(n, target, self.layout)
        if target == "dropout" and len(n.args) > 1 and n.args[1] == 0:
            return "view", "copy"  # torch's dropout with p = 0 returns its input: nothing made, nothing kept
        if _is_pointwise(n) or target in EXTRA_ELEMENTWISE:
            return "elementwise", _elementwise_name(target)
        return "other", target


_NO_LAYOUT = HfLayout(batch=0, seq=0, top_k=0)
# what eager attention does between q @ k^T and probs @ v besides the softmax: mask, scale, soft-cap, casts
EAGER_SCORES = RESHAPES | COPIES | frozenset({"add", "sub", "mul", "div", "tanh", "dropout", "native_dropout", "to",
                                             "_to_copy", "type_as", "masked_fill", "where"})

