"""Capture of Hugging Face causal LMs (GPT-2, Llama, Mixtral, Qwen2-MoE, ...) through torch.export.

torch.fx cannot trace these models symbolically (Python control flow on shapes, cache objects, mask
builders), so `capture_hf` exports the training forward, loss included, with
`torch.export.export(model, (), {input_ids, labels, use_cache=False}, strict=False)` on meta tensors
(no weights, no network) and turns the ATen graph into the `CapturedGraph` / `NodeInfo` types of
`autoplan.capture`. Every node keeps its module path (export's `nn_module_stack`), its parameters by
fully qualified name (`graph_signature.inputs_to_parameters`; a tied weight is named under the module
that uses it) and its layer (the i of `...layers.<i>`, `...h.<i>`, `...blocks.<i>`).

Nodes. One `NodeInfo` per tensor, with these groupings so that an HF block reads like the built-in
ones (`autoplan.models`) and the default strategy rules apply:

    attention  the core of each attention module fused into one node: from the q/k/v projections'
               outputs (B, T, H*d) to the (B, T, Hq*d) input of the output projection (views, RoPE,
               repeat_kv, SDPA). Its inputs are q, k, v; the rotary tables and the mask are constants
               of the core (their producers stay as nodes, free: see "dead" below). Fused QKV
               projections, per-head q/k norms, partial rotary and sliding windows:
               `autoplan.capture.hf_attention`.
    norm       every op inside a module whose class ends in RMSNorm / LayerNorm, as one node.
    moe        a MoE block's router and fused experts, as one node (`autoplan.capture.hf_moe`).
    activation every op inside a parameter-free activation module (NewGELUActivation, ...) as one
               elementwise node named after it with `graph.COMPOSITE` ("gelu_composite").
    tuples     an op returning several tensors (split, chunk, topk, sort) is represented by its
               getitem nodes; each reads the op's inputs (split pieces are slices of the input).
    Parameter and buffer placeholders, and views or casts of them, are not nodes: they are the
    params (buffers: constants) of their consumers. `_assert_*` nodes are dropped.

Op kinds from ATen targets: linear / addmm / mm / matmul / bmm / grouped_mm with a parameter operand
(or a transpose of one: `x @ W.T`, Falcon)
-> "linear" (target "linear" when the weight is stored (out, in) as in nn.Linear, "linear_in_out" for
(in, out) as in GPT-2's Conv1D, "grouped_linear"[_in_out] for the 3-D (experts, ., .) weights of MoE
experts); embedding -> "embedding"; layer_norm / rms_norm / the fused modules above -> "norm";
cross_entropy_loss, and log_softmax -> (views) -> nll_loss fused into one node, -> "cross_entropy";
pointwise ops -> "elementwise"; views, reshapes, permutes, slices, cat, contiguous -> "view"
(`autoplan.capture.hf_rules` has its rule; the default registry runs it replicated); everything else (MoE
routing: softmax, topk, sort, index, histc, cumsum; position and mask builders; matmuls of two
activations) -> "other", named in a warning (no sharding rule: replicated).

Layout. The planner's placements assume activations lead with the batch dim (`autoplan.strategies`).
HF flattens tokens inside MoE blocks and the loss, (B*T*k, ...) with k in {1, top_k}; such tensors are
recorded as (B, T*k, ...), same numel and bytes, so that dim 0 is the batch, dim 1 the tokens and the
last dim the features. The GraphModule keeps the real shapes.

Costs per node (M = rows = numel(out) / out features, K = contracted dim; B, T, V, Hq, d as usual),
the formulas of `autoplan.capture` where they overlap:

    linear / matmul   fwd 2*M*K*N = 2*numel(out)*K        bwd 2 x fwd (both operand gradients)
    grouped (MoE)     fwd 2*S*in*out, S = B*T*top_k rows: every routed (token, expert) pair
    attention         fwd 4*B*T*K*Hq*d (full non-causal count; K = T, or min(T, window) for a sliding
                      window)   bwd 2 x fwd; bytes q+k+v+out:
                      flash-style, no T x T tensor is read, written or kept
    norm              fwd 5 * numel(out)                  elementwise  fwd numel(out)
    cross_entropy     fwd 5 * numel(logits)               softmax (routing)  fwd 5 * numel
    reductions, topk, sort, cumsum, histc   fwd numel(input)
    embedding, index / gather, views        fwd 0
    bytes fwd = tensor inputs + parameters + output (nbytes); embedding and gathers read only the
    gathered rows (indices + 2 * output); pure views move nothing (contiguous / clone / cat copy).
    bwd FLOPs and bytes = 2 x fwd for linear / matmul / attention, 1 x fwd for the rest, 0 for ops
    whose output is not floating (indices, masks: no gradient).
    Dead nodes (no path to the loss or logits: the mask and rotary-table builders whose results only
    the fused attention cores read) cost 0: a flash-attention step builds no T x T mask.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import io
import json
import re
import sys
import traceback
import warnings
from collections import defaultdict
from pathlib import Path

import torch
from torch import nn

from autoplan.capture import CapturedGraph, NodeInfo
from autoplan.errors import AutoplanError, ConfigError
from autoplan.capture.hf_config import check_supported, hf_count, hf_number
from autoplan.capture.hf_convert import GraphConverter, HfLayout
from autoplan.models.config import ModelConfig
from autoplan.validate import check_number, one_line, parse_mapping, path_kind, read_text

CONFIG_VOLATILE = ("_name_or_path", "transformers_version", "torch_dtype", "dtype", "architectures",
                   "_attn_implementation", "_experts_implementation", "_commit_hash")
HIDDEN, HEADS = ("hidden_size", "n_embd"), ("num_attention_heads", "n_head")  # the keys of each, by family


class CaptureError(AutoplanError):
    """A model that capture cannot handle: names the module, the source line and what to change."""


# ---------------------------------------------------------------------------------- configs


def load_hf_config(path: str | Path):
    """A transformers config from `config.json` (a file, or a directory holding one); no network."""
    path = Path(path)
    folder = path_kind(path) == "folder"
    file = path / "config.json" if folder else path
    if path_kind(file) != "file":
        raise ConfigError(f"{path}: no such file or directory with a config.json; give the path of a "
                          f"Hugging Face config.json or of a checkpoint directory holding one")
    data = dict(parse_mapping(file, read_text(file, "Hugging Face config"), "Hugging Face config", yaml_file=False))
    if not isinstance(data.get("model_type"), str):
        raise ConfigError(f"{file}: a Hugging Face config needs a 'model_type' string (e.g. 'llama', "
                          f"'gpt2', 'mixtral', 'qwen2_moe'); found keys {sorted(data)[:12]}")
    from transformers import AutoConfig  # lazy: transformers is an optional (dev) dependency

    model_type = data.pop("model_type")
    try:
        config = AutoConfig.for_model(model_type, **data)
    except (ValueError, KeyError) as e:
        raise ConfigError(f"{file}: transformers does not know model_type {model_type!r} ({one_line(e)[:300]}); "
                          f"upgrade transformers or fix the config") from None
    except Exception as e:  # noqa: BLE001 - transformers' own checks of the values (TypeError, strict-dataclass errors)
        raise ConfigError(f"{file}: transformers refused this {model_type!r} config: {one_line(e)[:300]}; "
                          f"fix that key") from None
    config._name_or_path = str(file.parent.name if folder or file.name == "config.json"
                               else file.stem)
    check_supported(config, str(file))
    return config


def _get(config, *names: str, default=None):
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return default


def hf_model_info(config) -> dict:
    """What the strategy rules read (`ModelConfig.rule_info`), from the HF config itself, so a
    head_dim other than hidden / heads is right."""
    hidden, heads = hf_count(config, HIDDEN), hf_count(config, HEADS)
    return {"head_dim": hf_count(config, ("head_dim",), hidden // heads), "ffn_hidden": _ffn_hidden(config)}


def _ffn_hidden(config) -> int:
    return hf_count(config, ("moe_intermediate_size", "intermediate_size", "n_inner"), 4 * hf_count(config, HIDDEN))


def _experts(config) -> tuple[int, int]:
    experts = hf_count(config, ("num_local_experts", "num_experts", "n_routed_experts"), 0, minimum=0)
    top_k = hf_count(config, ("num_experts_per_tok", "moe_topk"), 0, minimum=0) if experts else 0
    return experts, top_k


def hf_model_config(config, name: str | None = None) -> ModelConfig:
    """The `ModelConfig` summary of an HF config: family (gpt: learned positions and LayerNorm, as
    GPT-2; moe: routed experts; llama otherwise), layers, hidden, heads, kv heads, ffn (the routed
    experts' for MoE), vocab, max positions, experts, top_k. Shared experts (Qwen2-MoE), tied embeddings
    and other families' layers are not in the family formula of `num_parameters`; `capture_hf_for_planner`
    sets `parameters` to transformers' own count. Configs
    autoplan cannot model faithfully are refused (`hf_config.unsupported_reason`)."""
    check_supported(config, _model_name(config))
    hidden, heads = hf_count(config, HIDDEN), hf_count(config, HEADS)
    kv_heads = hf_count(config, ("num_key_value_heads",), heads)
    experts, top_k = _experts(config)
    model_type = getattr(config, "model_type", "hf")
    family = "moe" if experts else ("gpt" if model_type in ("gpt2", "gpt_neo", "gptj", "opt", "gpt_bigcode")
                                    and kv_heads == heads else "llama")
    rope = _get(config, "rope_theta", default=None)
    if rope is None:
        parameters = getattr(config, "rope_parameters", None)
        rope = (parameters if isinstance(parameters, dict) else {}).get("rope_theta", 10000.0)
    return ModelConfig(
        name or _model_name(config), family, hf_count(config, ("num_hidden_layers", "n_layer")), hidden,
        heads, kv_heads, _ffn_hidden(config), hf_count(config, ("vocab_size",)),
        hf_count(config, ("max_position_embeddings", "n_positions"), 2048), experts, top_k,
        hf_number(config, ("rms_norm_eps", "layer_norm_epsilon", "layer_norm_eps"), 1e-5),
        check_number("Hugging Face config rope_theta", rope))


def _model_name(config) -> str:
    name = getattr(config, "_name_or_path", "") or ""
    return f"hf-{name}" if name else f"hf-{getattr(config, 'model_type', 'model')}"


def _fingerprint(config) -> str:
    """First 16 hex chars of sha256 over the HF config's sorted JSON, without volatile keys."""
    data = {k: v for k, v in config.to_dict().items() if k not in CONFIG_VOLATILE}
    text = json.dumps(data, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def build_hf_model(config, dtype: torch.dtype = torch.bfloat16, experts: str | None = "grouped_mm") -> nn.Module:
    """`AutoModelForCausalLM.from_config` on the meta device, in `dtype`, with SDPA attention and
    `experts` as the experts' implementation (grouped matmuls: with SDPA, the implementations that export
    without data-dependent control flow; None: transformers' default); eager attention for an
    architecture that has no SDPA path (BLOOM, Gemma 2: captured as the same core)."""
    kwargs = {"attn_implementation": "sdpa"}
    if _experts(config)[0] and experts:
        kwargs["experts_implementation"] = experts
    try:
        model = _from_config(config, kwargs)
    except ValueError as e:
        if "attention implementation" not in str(e):
            raise
        model = _from_config(config, kwargs | {"attn_implementation": "eager"})
    return model.to(dtype)


def _from_config(config, kwargs: dict) -> nn.Module:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        try:
            return AutoModelForCausalLM.from_config(copy.deepcopy(config), **kwargs)
        except TypeError:  # transformers < 5 has no experts_implementation
            kwargs = {k: v for k, v in kwargs.items() if k != "experts_implementation"}
            return AutoModelForCausalLM.from_config(copy.deepcopy(config), **kwargs)


# ---------------------------------------------------------------------------------- capture


def capture_hf(model_or_config, batch_size: int, seq_len: int, dtype: torch.dtype = torch.bfloat16, *,
               replicate_layers: bool = True) -> CapturedGraph:
    """Export an HF causal LM (a model, a transformers config, or the path of a config.json) with
    (batch_size, seq_len) token ids and labels on meta tensors, and cost every node (module docstring).

    Export costs about 0.5 s per decoder layer, so a config whose layers are all alike (same modules,
    parameter shapes and settings: `_layer_signature`) is exported with 2 layers and layers 2.. are
    copies of layer 1 with their own module paths and parameter names (`replicate_layers=False`
    exports every layer); `graph_module` is then the 2-layer program. A model given as a module is
    exported whole, as it is (meta or real weights: export traces fake tensors and runs no kernel);
    its floating parameters must already be in `dtype`."""
    for key, value in (("batch_size", batch_size), ("seq_len", seq_len)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"capture_hf: {key}={value!r} must be a positive integer")
    if isinstance(model_or_config, (str, Path)):
        model_or_config = load_hf_config(model_or_config)
    if not isinstance(model_or_config, nn.Module):
        check_supported(model_or_config, _model_name(model_or_config))
    model = model_or_config if isinstance(model_or_config, nn.Module) else build_hf_model(model_or_config, dtype)
    config = getattr(model, "config", None)
    _check_model(model, config, seq_len, dtype)
    stack = _layer_stack(model)
    if replicate_layers and not isinstance(model_or_config, nn.Module) and stack and len(stack[1]) > 2 \
            and _layers_alike(config, stack[1]):
        small = _capture_module(build_hf_model(_with_layers(config, 2), dtype), config, batch_size, seq_len, dtype)
        graph = _replicate(small, stack[0], len(stack[1]))
        if graph is not None and {n for n, _ in model.named_parameters(remove_duplicate=False)} >= \
                {name for node in graph.nodes for name, _ in node.params}:
            warn_unsupported(graph)
            return graph
    graph = _capture_module(model, config, batch_size, seq_len, dtype)
    warn_unsupported(graph)
    return graph


def _capture_module(model: nn.Module, config, batch_size: int, seq_len: int, dtype: torch.dtype) -> CapturedGraph:
    program = export_hf(model, batch_size, seq_len)
    layout = HfLayout(batch_size, seq_len, _experts(config)[1] if config is not None else 0)
    nodes = GraphConverter(program, model, layout).nodes()
    return CapturedGraph(_model_name(config) if config is not None else type(model).__name__,
                         _fingerprint(config) if config is not None else "", batch_size, seq_len,
                         str(dtype).removeprefix("torch."), nodes, program.graph_module, own_forward=True)


def capture_hf_for_planner(path_or_config, seq_len: int, dtype: str = "bfloat16"
                           ) -> tuple[ModelConfig, CapturedGraph, dict]:
    """What `autoplan search --hf-config FILE_OR_DIR` needs: the ModelConfig summary, the graph
    captured at batch 1 (as `autoplan.api.capture_model` does) and the strategy-rule info."""
    config = load_hf_config(path_or_config) if isinstance(path_or_config, (str, Path)) else path_or_config
    summary = dataclasses.replace(hf_model_config(config), parameters=hf_parameter_count(config))
    return summary, capture_hf(config, 1, seq_len, getattr(torch, dtype)), hf_model_info(config)


def hf_parameter_count(config) -> int:
    """transformers' own count of the model's parameters (`num_parameters()`: tied weights once), on meta."""
    return build_hf_model(config).num_parameters()


def _check_model(model: nn.Module, config, seq_len: int, dtype: torch.dtype) -> None:
    max_seq = _get(config, "max_position_embeddings", "n_positions") if config is not None else None
    if max_seq is not None and seq_len > max_seq:
        raise ConfigError(f"capture_hf: seq_len={seq_len} exceeds max_position_embeddings={max_seq} of "
                          f"{_model_name(config)}; use seq_len <= {max_seq} or raise it in the config")
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if dtypes and dtypes != {dtype}:
        raise ConfigError(f"capture_hf: the model's parameters are {sorted(map(str, dtypes))} but dtype="
                          f"{dtype}; pass dtype={next(iter(dtypes))} or convert the model with "
                          f"model.to({dtype}) first")


def export_hf(model: nn.Module, batch_size: int, seq_len: int) -> torch.export.ExportedProgram:
    """torch.export (non-strict) of the training forward; failures become a CaptureError naming the
    module being run, the source line and what to change."""
    device = next((p.device for p in model.parameters()), torch.device("meta"))
    ids = torch.zeros((batch_size, seq_len), dtype=torch.int64, device=device)  # (B, T)
    labels = torch.zeros((batch_size, seq_len), dtype=torch.int64, device=device)  # distinct tensor
    kwargs = {"input_ids": ids, "labels": labels, "use_cache": False}
    stack: list[str] = []
    handles = _track_modules(model, stack)
    stderr = io.StringIO()  # torch prints the partial graph of a failed export there: keep it out
    try:
        with contextlib.redirect_stderr(stderr):
            return torch.export.export(model, (), kwargs, strict=False)
    except Exception as e:  # noqa: BLE001 - every export failure is reported the same way
        partial = str(getattr(e, "partial_fx_graph", "") or "")
        stderr = io.StringIO(stderr.getvalue().replace(partial, "") if partial else stderr.getvalue())
        raise _capture_error(model, stack, e, partial) from e
    finally:
        if stderr.getvalue().strip():
            sys.stderr.write(stderr.getvalue())
        for handle in handles:
            handle.remove()


def _track_modules(model: nn.Module, stack: list[str]) -> list:
    """Hooks that keep `stack` = the module paths being run (left as is when a forward raises)."""
    handles = []
    for path, module in model.named_modules():
        def pre(_m, _args, path=path):
            stack.append(path)

        def post(_m, _args, _out, path=path):
            if stack and stack[-1] == path:
                stack.pop()
        handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    return handles


def _capture_error(model: nn.Module, stack: list[str], e: Exception, partial: str) -> CaptureError:
    path = stack[-1] if stack else ""
    module = type(model.get_submodule(path)).__name__ if stack else type(model).__name__
    frames = [f for f in traceback.extract_tb(e.__traceback__)
              if "/torch/" not in f.filename and not f.filename.endswith("capture_hf.py")]
    where = ""
    if frames:
        frame = frames[-1]
        where = f" at {Path(frame.filename).name}:{frame.lineno} `{(frame.line or '').strip()}`"
    first = next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)
    traced = re.findall(r"^\s*(\w+)(?::[^=]*)? = torch\.ops\.([\w.]+)\(", partial, re.MULTILINE)
    last = f" (the last op traced: {traced[-1][0]} = {traced[-1][1]})" if traced else ""
    name = type(e).__name__
    if "DataDependent" in name or "data-dependent" in str(e):
        hint = ("this code branches or loops on tensor values (data-dependent control flow), which export "
                "on meta tensors cannot follow; choose an implementation without it (transformers: "
                "attn_implementation='sdpa', experts_implementation='grouped_mm' or 'batched_mm'), or "
                "rewrite the construct with tensor ops (torch.where, torch.cond)")
    elif "autocast" in str(e) + where:
        hint = ("transformers < 5.4 opens torch.autocast on the meta device (rotary embeddings), which torch "
                "refuses; install transformers>=5.4")
    elif "pytree" in str(e) or "not a known type" in str(e):
        hint = "the model returns an object export cannot flatten; make forward return tensors (use_cache=False)"
    else:
        hint = ("capture needs a module whose forward(input_ids, labels, use_cache=False) returns the loss; "
                "export it with torch.export.export(..., strict=False) yourself to see the full trace")
    return CaptureError(f"capture_hf: torch.export failed in module {path or '<root>'!r} ({module}){where}{last}: "
                        f"{name}: {first[:300]}. Hint: {hint}")


# ---------------------------------------------------------------------------------- layer copies


def _layer_stack(model: nn.Module) -> tuple[str, nn.ModuleList] | None:
    """(path, modules) of the decoder layer list: a ModuleList called layers / h / blocks."""
    for path, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0 and re.search(r"(^|\.)(layers|h|blocks)$", path):
            return path, module
    return None


def _layer_signature(layer: nn.Module) -> tuple:
    """What makes two decoder layers run the same ops: module classes, parameter shapes and dtypes,
    and every plain setting (sliding windows, layer types), the layer index aside."""
    found = []
    for name, m in layer.named_modules():
        params = tuple((k, tuple(p.shape), p.dtype) for k, p in m.named_parameters(recurse=False))
        settings = tuple(sorted((k, v) for k, v in vars(m).items() if isinstance(v, (int, float, str, bool, type(None)))
                                and "idx" not in k and k != "training"))
        found.append((name, type(m).__name__, params, settings))
    return tuple(found)


def _layers_alike(config, layers: nn.ModuleList) -> bool:
    """Equal `_layer_signature`s, and no per-layer list in the config (layer_types, ...) that varies."""
    per_layer = [v for v in vars(config).values() if isinstance(v, (list, tuple)) and len(v) == len(layers)]
    return (len({_layer_signature(layer) for layer in layers}) == 1
            and all(len({repr(x) for x in v}) == 1 for v in per_layer))


def _with_layers(config, count: int):
    """A copy of `config` with `count` layers (per-layer lists, such as layer_types, cut to match)."""
    config = copy.deepcopy(config)
    layers = _get(config, "num_hidden_layers", "n_layer")
    for key, value in list(vars(config).items()):
        if isinstance(value, (list, tuple)) and len(value) == layers:
            setattr(config, key, type(value)(value[:count]))
    config.num_hidden_layers = count
    return config


def _replicate(graph: CapturedGraph, stack: str, layers: int) -> CapturedGraph | None:
    """`graph` of a 2-layer export grown to `layers` layers: layer i >= 2 is layer 1 with its paths,
    parameter names and node names moved to i and its inputs from layer 0 read from layer i - 1.
    None when layers 0 and 1 differ or are not contiguous runs (then the caller exports them all)."""
    nodes = list(graph.nodes)
    index = [k for k, n in enumerate(nodes) if n.layer is not None]
    first = [k for k in index if nodes[k].layer == 0]
    second = [k for k in index if nodes[k].layer == 1]
    if (not first or not second or set(n.layer for n in nodes) - {None, 0, 1}
            or first + second != list(range(first[0], second[-1] + 1)) or len(first) != len(second)):
        return None
    zero, one = [nodes[k] for k in first], [nodes[k] for k in second]
    if any(_shape_key(a, f"{stack}.0") != _shape_key(b, f"{stack}.1") for a, b in zip(zero, one)):
        return None
    twin = {a.name: b.name for a, b in zip(zero, one)}  # layer-0 node -> its layer-1 counterpart
    ones = {b.name for b in one}
    names = [{b.name: b.name for b in one}]  # per copy: layer-1 name -> this copy's name
    copies: list[NodeInfo] = []
    for i in range(2, layers):
        names.append({b.name: _moved_name(b.name, stack, i) for b in one})
        for b in one:
            inputs = tuple(names[-1][u] if u in ones else names[-2][twin[u]] if u in twin else u
                           for u in b.inputs)
            copies.append(_moved(b, stack, i, names[-1][b.name], inputs))
    last = names[-1]
    post = [dataclasses.replace(n, inputs=tuple(last.get(u, u) for u in n.inputs))
            for n in nodes[second[-1] + 1:]]
    merged = tuple(nodes[:second[-1] + 1] + copies + post)
    if len({n.name for n in merged}) != len(merged):
        return None
    return dataclasses.replace(graph, nodes=merged)


def _shape_key(n: NodeInfo, prefix: str) -> tuple:
    return (n.op_kind, n.target, n.module_path.removeprefix(prefix), n.input_metas, n.output,
            tuple((k.removeprefix(prefix), m) for k, m in n.params), n.fwd_flops, n.fwd_bytes)


def _moved_path(path: str, stack: str, i: int) -> str:
    old = f"{stack}.1"
    return f"{stack}.{i}{path[len(old):]}" if path == old or path.startswith(old + ".") else path


def _moved_name(name: str, stack: str, i: int) -> str:
    old = re.sub(r"\W", "_", f"{stack}.1") + "_"
    if name.startswith(old):  # named after its module path
        return re.sub(r"\W", "_", f"{stack}.{i}") + "_" + name[len(old):]
    return f"{name}_layer{i}"


def _moved(n: NodeInfo, stack: str, i: int, name: str, inputs: tuple[str, ...]) -> NodeInfo:
    return dataclasses.replace(n, name=name, module_path=_moved_path(n.module_path, stack, i), layer=i,
                               inputs=inputs, params=tuple((_moved_path(k, stack, i), m) for k, m in n.params))


# ---------------------------------------------------------------------------------- warnings


def unsupported_nodes(graph: CapturedGraph) -> dict[str, list[str]]:
    """Target -> names of the nodes that have no sharding rule (op kind "other"): they run replicated."""
    found: dict[str, list[str]] = defaultdict(list)
    for n in graph.nodes:
        if n.op_kind == "other":
            found[n.target].append(n.name)
    return dict(found)


def warn_unsupported(graph: CapturedGraph, shown: int = 4) -> None:
    """One `warnings.warn` naming every op without a sharding rule, grouped by target."""
    found = unsupported_nodes(graph)
    if not found:
        return
    parts = [f"{target} x{len(names)} ({', '.join(names[:shown])}{', ...' if len(names) > shown else ''})"
             for target, names in sorted(found.items(), key=lambda kv: (-len(kv[1]), kv[0]))]
    total = sum(map(len, found.values()))
    warnings.warn(f"capture_hf({graph.model_name}): {total} ops without a sharding rule run replicated: "
                  + "; ".join(parts), stacklevel=3)

