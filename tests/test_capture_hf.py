"""Capture of Hugging Face models through torch.export: kinds, FLOPs, paths, warnings, configs, errors,
and the planner on the result; differential against the built-in models of the same shapes."""

from __future__ import annotations

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from autoplan.capture import CapturedGraph  # noqa: E402
from autoplan.capture.hf import (CaptureError, capture_hf, hf_model_config, hf_model_info,  # noqa: E402
                                 load_hf_config, unsupported_nodes)
from autoplan.errors import ConfigError  # noqa: E402
from autoplan.capture.hf_rules import hf_registry, reshape_source_dim  # noqa: E402
from autoplan.mesh import MeshShape  # noqa: E402
from autoplan.api import capture_model, estimate  # noqa: E402
from autoplan.strategies import default_registry, expert_dims  # noqa: E402

B, T = 2, 16


def _configs() -> dict:
    tf = transformers
    return {
        "gpt2": tf.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=128,
                              bos_token_id=0, eos_token_id=0),
        "llama": tf.LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                intermediate_size=128, vocab_size=256),
        "mixtral": tf.MixtralConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                    num_key_value_heads=2, intermediate_size=96, vocab_size=256,
                                    num_local_experts=4, num_experts_per_tok=2),
        "qwen2_moe": tf.Qwen2MoeConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                       num_key_value_heads=2, intermediate_size=128, moe_intermediate_size=32,
                                       shared_expert_intermediate_size=64, vocab_size=256, num_experts=4,
                                       num_experts_per_tok=2),
    }


@pytest.fixture(scope="module")
def captured() -> dict[str, tuple[object, CapturedGraph, list[str]]]:
    """Each family captured once at (B, T), with the warnings its capture raised."""
    found = {}
    for name, config in _configs().items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            graph = capture_hf(config, B, T, torch.bfloat16)
        found[name] = (config, graph, [str(w.message) for w in caught if "capture_hf" in str(w.message)])
    return found


# per layer: linears (a MoE block's router and experts are one "moe" node: capture.hf_moe), then the
# head; attention per layer; embeddings
EXPECTED = {"gpt2": (4, 2), "llama": (7, 1), "mixtral": (4, 1), "qwen2_moe": (8, 1)}


def _kinds(graph: CapturedGraph, kind: str) -> list:
    return [n for n in graph.nodes if n.op_kind == kind]


@pytest.mark.parametrize("name", list(EXPECTED))
def test_kinds_counts_and_layers(captured, name):
    config, graph, _ = captured[name]
    per_layer, embeddings = EXPECTED[name]
    assert len(_kinds(graph, "linear")) == per_layer * 2 + 1
    assert len(_kinds(graph, "attention")) == 2 and [n.layer for n in _kinds(graph, "attention")] == [0, 1]
    assert len(_kinds(graph, "embedding")) == embeddings
    assert len(_kinds(graph, "moe")) == (2 if name in ("mixtral", "qwen2_moe") else 0)
    assert len(_kinds(graph, "norm")) == 5 and len(_kinds(graph, "cross_entropy")) == 1
    assert graph.layers() == [0, 1] and graph.nodes[-1].op_kind == "output"
    assert {n.op_kind for n in graph.nodes} <= {"placeholder", "output", "embedding", "linear", "norm", "attention",
                                                "moe", "cross_entropy", "elementwise", "view", "other"}
    names = [n.name for n in graph.nodes]
    assert len(set(names)) == len(names)
    known = set(names)
    assert all(u in known for n in graph.nodes for u in n.inputs)


@pytest.mark.parametrize("name", list(EXPECTED))
def test_linear_flops_are_exact(captured, name):
    config, graph, _ = captured[name]
    for n in _kinds(graph, "linear"):
        (x,), out = n.input_metas, n.output
        rows = x.numel // x.shape[-1]
        assert n.fwd_flops == 2 * rows * x.shape[-1] * out.shape[-1] and n.bwd_flops == 2 * n.fwd_flops
    assert not [n for n in _kinds(graph, "linear") if n.target.startswith("grouped")]  # inside the MoE nodes
    for n in _kinds(graph, "moe"):  # router + top_k SwiGLU experts per token (the zoo's formula)
        (x,), (experts, h, f) = n.input_metas, expert_dims(n)
        assert x.shape == n.output.shape == (B, T, h) and n.bwd_flops == 2 * n.fwd_flops
        assert n.fwd_flops == 2 * B * T * h * experts + config.num_experts_per_tok * 3 * 2 * B * T * h * f


def _analytic_fwd_flops(name: str, c) -> float:
    """2 * (active matmul parameters) * tokens + 4 * B * T^2 * Hq * d per layer."""
    h, layers, vocab = c.hidden_size, c.num_hidden_layers, c.vocab_size
    kv = getattr(c, "num_key_value_heads", c.num_attention_heads) * (h // c.num_attention_heads)
    attn = 2 * h * h + 2 * h * kv
    if name == "gpt2":
        mlp = 2 * h * 4 * h
    elif name == "llama":
        mlp = 3 * h * c.intermediate_size
    elif name == "mixtral":
        mlp = h * c.num_local_experts + c.num_experts_per_tok * 3 * h * c.intermediate_size
    else:
        mlp = (h * c.num_experts + c.num_experts_per_tok * 3 * h * c.moe_intermediate_size
               + 3 * h * c.shared_expert_intermediate_size + h)
    tokens = B * T
    return 2 * ((attn + mlp) * layers + h * vocab) * tokens + layers * 4 * B * T * T * h


@pytest.mark.parametrize("name", list(EXPECTED))
def test_total_forward_flops_near_analytic(captured, name):
    config, graph, _ = captured[name]
    analytic = _analytic_fwd_flops(name, config)
    matmuls = sum(n.fwd_flops for n in graph.nodes if n.op_kind in ("linear", "attention", "moe"))
    assert matmuls == pytest.approx(analytic, rel=1e-9)
    assert graph.total_fwd_flops() == pytest.approx(analytic, rel=0.05)  # + norms, pointwise, loss


def test_module_paths_parameters_and_tied_weights(captured):
    _, llama, _ = captured["llama"]
    q = llama.node("model_layers_1_self_attn_q_proj")
    assert (q.module_path, q.layer, q.target) == ("model.layers.1.self_attn.q_proj", 1, "linear")
    assert [name for name, _ in q.params] == ["model.layers.1.self_attn.q_proj.weight"]
    norm = llama.node("model_layers_0_input_layernorm")
    assert norm.op_kind == "norm" and norm.params[0][0] == "model.layers.0.input_layernorm.weight"
    _, gpt2, _ = captured["gpt2"]
    c_attn = gpt2.node("transformer_h_1_attn_c_attn")
    assert c_attn.layer == 1 and c_attn.target == "linear_in_out"  # Conv1D stores (in, out)
    assert dict(c_attn.params)["transformer.h.1.attn.c_attn.weight"].shape == (64, 192)
    assert gpt2.node("transformer_wte").params[0][0] == "transformer.wte.weight"  # tied to lm_head.weight
    assert gpt2.node("lm_head").params[0][0] == "lm_head.weight"
    _, mixtral, _ = captured["mixtral"]
    (moe,) = [n for n in mixtral.nodes_of_layer(1) if n.op_kind == "moe"]
    assert moe.module_path == "model.layers.1.mlp" and [name for name, _ in moe.params] == [
        "model.layers.1.mlp.gate.weight", "model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"]


@pytest.mark.parametrize("name", list(EXPECTED))
def test_attention_is_flash_style(captured, name):
    config, graph, _ = captured[name]
    head_dim = hf_model_info(config)["head_dim"]
    for n in _kinds(graph, "attention"):
        q, k, v = n.input_metas
        assert len(q.shape) == 3 and q.shape[:2] == (B, T) and n.output.shape == q.shape
        assert n.fwd_flops == 4 * B * T * T * q.shape[-1] and q.shape[-1] % head_dim == 0
        assert n.fwd_bytes == q.nbytes + k.nbytes + v.nbytes + n.output.nbytes  # no T x T tensor


def test_warning_names_ops_without_rule(captured):
    _, graph, messages = captured["mixtral"]
    assert len(messages) == 1 and "run replicated" in messages[0] and "arange" in messages[0]
    for target in ("topk[0]", "topk[1]", "softmax"):  # the router's: inside the MoE node (capture.hf_moe)
        assert target not in messages[0] and target not in unsupported_nodes(graph)
    assert all(graph.node(name).op_kind == "other" for names in unsupported_nodes(graph).values() for name in names)


@pytest.mark.parametrize("name", list(EXPECTED))
def test_every_node_has_valid_strategies(captured, name):
    config, graph, _ = captured[name]
    info = hf_model_info(config)
    for factory in (default_registry, hf_registry):
        registry = factory()
        for tp in (1, 2, 4):
            for n in graph.nodes:
                found = registry.strategies(n, tp, info)
                assert found[0].name == "replicate"
                assert all(len(s.inputs) == len(n.inputs) for s in found), (n.name, [s.name for s in found])
                if factory is hf_registry:  # its placements name the node's own parameters
                    own = {p.removeprefix(n.module_path + ".") for p, _ in n.params}
                    assert all(p.name in own for s in found for p in s.params), n.name


def test_hf_rules_keep_heads_and_vocab_sharded(captured):
    config, graph, _ = captured["llama"]
    info, registry = hf_model_info(config), hf_registry()

    def names(node: str) -> set[str]:
        return {s.name for s in registry.strategies(graph.node(node), 2, info)}
    assert "heads" in names("model_layers_0_self_attn_core")
    loss = graph.node("cross_entropy_loss")
    logits = graph.node(loss.inputs[0])  # the (B*T, V) view of the fp32 logits
    assert logits.op_kind == "view" and "features" in names(logits.name) and "vocab" in names(loss.name)
    _, gpt2, _ = captured["gpt2"]
    conv = {s.name: s for s in registry.strategies(gpt2.node("transformer_h_0_attn_c_attn"), 2, info)}
    assert conv["column"].param_placement("weight").dim == 1  # Conv1D's out dim


def test_broadcast_input_gradient_is_partial(captured):
    config, graph, _ = captured["qwen2_moe"]  # sigmoid(shared_expert_gate(x)) (B, T, 1) * shared_expert(x)
    weighted = next(n for n in graph.nodes_of_layer(0) if n.target == "mul" and len(n.input_metas) == 2
                    and sorted(m.shape[-1] for m in n.input_metas) == [1, 64])
    features = {s.name: s for s in hf_registry().strategies(weighted, 2, hf_model_info(config))}["features"]
    gate = [m.shape[-1] for m in weighted.input_metas].index(1)
    assert features.inputs[1 - gate].placement.dim == 2 and features.inputs[gate].grad_partial


def test_reshape_source_dim():
    assert reshape_source_dim((2, 16, 64), (2, 16, 4, 16), 2) == 2  # heads of (B, T, H*d)
    assert reshape_source_dim((2, 16, 4, 16), (2, 16, 64), 2) == 2
    assert reshape_source_dim((2, 16, 4, 16), (2, 16, 64), 3) is None
    assert reshape_source_dim((2, 32), (2, 16, 2), 1) == 1  # token flattening keeps tokens


@pytest.mark.parametrize("name", ["gpt2", "mixtral"])
def test_planner_prices_hf_graph(captured, name):
    config, graph, _ = captured[name]
    summary = hf_model_config(config)
    for registry in (default_registry(), hf_registry()):
        plan = estimate(summary, "1x2xh100", 8, T, mesh=MeshShape(tp=2), microbatch_size=2, zero_stage=1,
                        recompute="selective", graph=graph, registry=registry)
        assert plan.predicted.step_time_s > 0 and len(plan.ops) == len(graph.nodes)


def test_llama_matches_builtin_model_of_same_shapes():
    """Differential: the HF Llama and autoplan's Llama of one ModelConfig capture to the same parameter
    count, matmul FLOPs and layer strategies."""
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=256, num_attention_heads=8,
                                      num_key_value_heads=4, intermediate_size=512, vocab_size=512,
                                      rms_norm_eps=1e-5)
    summary = hf_model_config(config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = capture_hf(config, 1, 256)
    builtin = capture_model(summary, 256)
    assert hf.parameter_count() == builtin.parameter_count() == summary.num_parameters()
    for kind in ("linear", "attention", "norm"):
        assert sum(n.fwd_flops for n in _kinds(hf, kind)) == sum(n.fwd_flops for n in _kinds(builtin, kind))
    assert hf.total_fwd_flops() == pytest.approx(builtin.total_fwd_flops(), rel=1e-3)


def test_layer_copies_equal_full_export():
    config = transformers.Qwen2MoeConfig(num_hidden_layers=4, hidden_size=64, num_attention_heads=4,
                                         num_key_value_heads=2, intermediate_size=128, moe_intermediate_size=32,
                                         shared_expert_intermediate_size=64, vocab_size=256, num_experts=4,
                                         num_experts_per_tok=2)

    def key(graph: CapturedGraph) -> list:
        position = {n.name: k for k, n in enumerate(graph.nodes)}
        return [(n.op_kind, n.target, n.module_path, n.layer, n.input_metas, n.output, n.params, n.fwd_flops,
                 n.bwd_flops, n.fwd_bytes, n.bwd_bytes, tuple(position[u] for u in n.inputs)) for n in graph.nodes]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        copied = capture_hf(config, 1, T)
        full = capture_hf(config, 1, T, replicate_layers=False)
        config.mlp_only_layers = [1]  # layer 1 dense: layers differ, so every layer is exported
        mixed = capture_hf(config, 1, T)
    assert key(copied) == key(full) and copied.layers() == [0, 1, 2, 3]
    assert len(copied.graph_module.graph.nodes) < len(full.graph_module.graph.nodes)
    assert not any(n.op_kind == "moe" for n in mixed.nodes_of_layer(1))
    assert any(n.op_kind == "moe" for n in mixed.nodes_of_layer(2))


def test_load_hf_config_file_and_directory(tmp_path):
    transformers.GPT2Config(n_layer=3, n_embd=96, n_head=4).to_json_file(tmp_path / "config.json")
    for path in (tmp_path, tmp_path / "config.json", str(tmp_path)):
        config = load_hf_config(path)
        assert config.model_type == "gpt2" and config.n_layer == 3 and config.n_embd == 96
    summary = hf_model_config(load_hf_config(tmp_path))
    assert (summary.family, summary.num_layers, summary.hidden, summary.heads, summary.ffn_hidden) == \
        ("gpt", 3, 96, 4, 384)
    (tmp_path / "bad.json").write_text('{"hidden_size": 8}')
    with pytest.raises(ConfigError, match="model_type"):
        load_hf_config(tmp_path / "bad.json")
    with pytest.raises(ConfigError, match="no such file"):
        load_hf_config(tmp_path / "missing")


def test_summary_of_real_sizes():
    llama3 = transformers.LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                                      max_position_embeddings=8192, rope_theta=500000.0)
    s = hf_model_config(llama3)
    assert (s.family, s.num_layers, s.hidden, s.heads, s.kv_heads, s.ffn_hidden, s.vocab) == \
        ("llama", 32, 4096, 32, 8, 14336, 128256)
    assert s.num_parameters() == 8_030_261_248 and s.rope_theta == 500000.0
    mixtral = hf_model_config(transformers.MixtralConfig())  # Mixtral-8x7B defaults
    assert (mixtral.family, mixtral.experts, mixtral.top_k, mixtral.ffn_hidden) == ("moe", 8, 2, 14336)
    qwen = hf_model_config(transformers.Qwen2MoeConfig())
    assert (qwen.family, qwen.experts, qwen.top_k, qwen.ffn_hidden) == ("moe", 60, 4, 1408)


class _TinyLM(torch.nn.Module):
    """Not from transformers: forward(input_ids, labels, use_cache) -> loss, via log_softmax + nll_loss."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(64, 32)
        self.head = torch.nn.Linear(32, 64, bias=False)

    def forward(self, input_ids, labels=None, use_cache=False):
        logits = self.head(self.embed(input_ids))  # (B, T, V)
        return torch.nn.functional.nll_loss(logits.log_softmax(-1).flatten(0, 1), labels.flatten())


def test_any_module_and_log_softmax_nll_is_one_cross_entropy():
    with torch.device("meta"):
        model = _TinyLM().to(torch.bfloat16)
    graph = capture_hf(model, B, T)
    (loss,) = _kinds(graph, "cross_entropy")
    assert [m.shape for m in loss.input_metas] == [(B, T, 64), (B, T)] and loss.fwd_flops == 5 * B * T * 64
    assert graph.node(loss.inputs[0]).name == "head" and graph.layers() == []
    assert not _kinds(graph, "other") and graph.parameter_count() == 2 * 64 * 32


def test_bad_model_names_module_line_and_fix():
    config = _configs()["mixtral"]
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, experts_implementation="eager")
    with pytest.raises(CaptureError) as info:
        capture_hf(model.to(torch.bfloat16), 1, T)
    text = str(info.value)
    for part in ("model.layers.0.mlp.experts", "MixtralExperts", "expert_hit", "data-dependent", "grouped_mm"):
        assert part in text


def test_bad_arguments():
    config = _configs()["llama"]
    with pytest.raises(ConfigError, match="seq_len=0"):
        capture_hf(config, 1, 0)
    with pytest.raises(ConfigError, match="max_position_embeddings"):
        capture_hf(config, 1, config.max_position_embeddings + 1)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)  # float32
    with pytest.raises(ConfigError, match="model.to"):
        capture_hf(model, 1, T, torch.bfloat16)


def test_llama3_8b_on_meta_in_seconds():
    config = transformers.LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                                      max_position_embeddings=8192, rope_theta=500000.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = capture_hf(config, 1, 2048)
    assert graph.parameter_count() == 8_030_261_248 and graph.layers() == list(range(32))
    h, layers, tokens = 4096, 32, 2048
    matmul_params = 8_030_261_248 - 128256 * h - (2 * layers + 1) * h  # without the embedding and norms
    matmuls = sum(n.fwd_flops for n in graph.nodes if n.op_kind in ("linear", "attention"))
    assert matmuls == 2 * matmul_params * tokens + layers * 4 * tokens ** 2 * h
