"""The building blocks of Hugging Face decoders, one test each, on tiny configs built locally: parameter
counts (tied embeddings once), fused QKV projections, per-head q/k norms and partial rotary sharded on
heads under tp, sliding windows priced with their window, `x @ W.T` linears, eager attention where an
architecture has no SDPA path (`autoplan.capture.hf_attention`, issue 21)."""

from __future__ import annotations

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from autoplan.api import estimate  # noqa: E402
from autoplan.capture.graph import attention_keys  # noqa: E402
from autoplan.capture.hf import capture_hf_for_planner  # noqa: E402
from autoplan.capture.hf_attention import fused_widths, key_window  # noqa: E402
from autoplan.capture.hf_rules import hf_registry  # noqa: E402
from autoplan.cluster import preset  # noqa: E402
from autoplan.cost_model.attention_cost import attention_time_s  # noqa: E402
from autoplan.cost_model.compute import Efficiency  # noqa: E402
from autoplan.mesh import MeshShape  # noqa: E402
from autoplan.placement import Shard  # noqa: E402

T = 32
TOKENS = dict(vocab_size=256, pad_token_id=0, bos_token_id=1, eos_token_id=1)
SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, **TOKENS)
# wide enough that splitting pays over the collectives at tp = 2 (capture is on meta: size costs nothing)
WIDE, WIDE_T = dict(SMALL, hidden_size=2048, intermediate_size=4096, num_attention_heads=16), 2048


def _config(model_type: str, **kwargs):
    return transformers.AutoConfig.for_model(model_type, **kwargs)


def _capture(config, seq: int = T):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return capture_hf_for_planner(config, seq)


def _transformers_count(config) -> int:
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config).num_parameters()


def _tp2_plan(summary, graph, info):
    return estimate(summary, "1x2xh100", 8, graph.seq_len, mesh=MeshShape(tp=2), microbatch_size=8, zero_stage=1,
                    recompute="none", graph=graph, info=info, registry=hf_registry())


def _cores(graph):
    return [n for n in graph.nodes if n.op_kind == "attention"]


@pytest.mark.parametrize("model_type, extra", [
    ("gemma", dict(num_key_value_heads=2, head_dim=16)),  # tied embeddings
    ("starcoder2", dict(num_key_value_heads=2)),  # two-matrix MLP with biases
    ("gpt_neox", dict(rotary_pct=0.25, tie_word_embeddings=False)),  # fused QKV, parallel residual
    ("falcon", dict(new_decoder_architecture=False, multi_query=True, hidden_size=64, num_attention_heads=4)),
])
def test_parameter_count_is_transformers_own(model_type, extra):
    """The summary's count (the plan's, and the memory bound's) is transformers' num_parameters()."""
    config = _config(model_type, **(SMALL | extra))
    summary, graph, info = _capture(config)
    assert summary.num_parameters() == _transformers_count(config)
    assert _tp2_plan(summary, graph, info).model.num_parameters == _transformers_count(config)


@pytest.mark.parametrize("model_type, extra, fused", [
    ("phi3", dict(num_key_value_heads=4), "qkv_proj"),  # q, k, v sliced from the projection
    ("gpt_neox", dict(rotary_pct=0.25), "query_key_value"),  # per-head [q k v], chunked inside the core
])
def test_fused_qkv_attention_is_sharded_on_heads(model_type, extra, fused):
    """A fused QKV projection's output enters the core as q, k, v pieces; the plan splits the core on
    heads under tp = 2, and the projection (by columns, or along the sequence): neither is replicated."""
    config = _config(model_type, **(WIDE | extra))
    summary, graph, info = _capture(config, WIDE_T)
    cores = _cores(graph)
    assert len(cores) == 2
    kv = config.num_key_value_heads if model_type == "phi3" else 16
    assert [m.shape[-1] for m in cores[0].input_metas] == [2048, kv * 128, kv * 128]
    plan = _tp2_plan(summary, graph, info)
    strategies = {op.node: op.strategy for op in plan.ops}
    assert all(strategies[c.name] == "heads" for c in cores)
    projections = [op for op in plan.ops if op.module.endswith(fused)]
    assert projections and all(op.strategy != "replicate" for op in projections)
    column = hf_registry().strategy(graph.node(next(op.node for op in projections)), 2, "column", info)
    assert column.params[0].placement == Shard(0)  # the fused weight (out, in) split by output columns


def test_fused_widths():
    assert fused_widths(3 * 64, 64) == (64, 64, 64) and fused_widths(64 + 2 * 16, 64) == (64, 16, 16)
    assert fused_widths(64, 64) is None and fused_widths(64 + 15, 64) is None


def test_per_head_norms_are_in_the_core_and_their_gradients_summed():
    """Qwen3's q_norm / k_norm run inside the core: split on heads, weights whole, gradients all-reduced."""
    config = _config("qwen3", **(WIDE | dict(num_key_value_heads=4, head_dim=128)))
    summary, graph, info = _capture(config, WIDE_T)
    core = _cores(graph)[0]
    assert {name.rsplit(".", 2)[-2] for name, _ in core.params} == {"q_norm", "k_norm"}
    assert not any(n.op_kind == "norm" and ("q_norm" in n.module_path or "k_norm" in n.module_path)
                   for n in graph.nodes)
    plan = _tp2_plan(summary, graph, info)
    op = next(op for op in plan.ops if op.node == core.name)
    assert op.strategy == "heads"
    assert {p.name: p.grad_partial for p in op.resolved.params} == {"q_norm.weight": True, "k_norm.weight": True}


@pytest.mark.parametrize("q_lora_rank", [None, 512])  # DeepSeek V2-Lite's q_proj, V2 / V3's q_a_proj -> q_b_proj
def test_latent_attention_is_one_core_split_on_heads(q_lora_rank):
    """DeepSeek's multi-head latent attention: one core per layer reading q, the expanded latent (kv_b_proj's
    output, run on a (B, 1, T, r) view) and the shared rotary key; its FLOPs with the value width (dv), not
    q's; under tp = 2 split on heads with kv_b_proj and the q projection column-parallel."""
    heads, nope, rope, value = 16, 128, 64, 96
    config = _config("deepseek_v3", **(WIDE | dict(num_key_value_heads=heads, kv_lora_rank=256, q_lora_rank=q_lora_rank,
                                                   qk_nope_head_dim=nope, qk_rope_head_dim=rope, v_head_dim=value,
                                                   first_k_dense_replace=2, n_routed_experts=4, n_group=1,
                                                   topk_group=1, num_experts_per_tok=2)))
    summary, graph, info = _capture(config, WIDE_T)
    cores = _cores(graph)
    assert len(cores) == 2 and all(c.target == "latent_attention" for c in cores)
    assert [m.shape[-1] for m in cores[0].input_metas] == [heads * (nope + rope), heads * (nope + value), rope]
    assert cores[0].output.shape[-1] == heads * value
    assert cores[0].fwd_flops == 2 * WIDE_T * WIDE_T * heads * (nope + rope + value)
    plan = _tp2_plan(summary, graph, info)
    strategies = {op.module.rsplit(".", 1)[-1]: op.strategy for op in plan.ops if op.module.startswith("model.layers.0.")}
    assert strategies["self_attn"] == "heads"
    assert strategies["kv_b_proj"] == "column" and strategies["q_b_proj" if q_lora_rank else "q_proj"] == "column"
    assert strategies["o_proj"] != "replicate"


@pytest.mark.parametrize("model_type, extra", [
    ("stablelm", dict(partial_rotary_factor=0.25, num_key_value_heads=4)),
    ("phi", dict(partial_rotary_factor=0.5)),
])
def test_partial_rotary_attention_is_one_core(model_type, extra):
    config = _config(model_type, **(SMALL | extra))
    summary, graph, info = _capture(config)
    assert len(_cores(graph)) == 2
    assert all(s.name != "replicate" for s in hf_registry().strategies(_cores(graph)[0], 2, info)[1:])


def test_sliding_window_priced_with_window():
    """Mistral's window on every layer; Gemma 3's on its sliding layers only (full ones see T keys)."""
    window = 8
    mistral = _config("mistral", **(SMALL | dict(num_key_value_heads=2, sliding_window=window)))
    _, graph, _ = _capture(mistral)
    for core in _cores(graph):
        q = core.input_metas[0]
        assert core.fwd_flops == 4 * q.shape[0] * T * window * q.shape[-1]
        assert attention_keys(core) == window
    gemma3 = _config("gemma3_text", **(SMALL | dict(num_key_value_heads=2, head_dim=16, sliding_window=window,
                                                    num_hidden_layers=4, layer_types=["sliding_attention",
                                                    "full_attention", "sliding_attention", "full_attention"])))
    _, graph, _ = _capture(gemma3)
    assert [attention_keys(c) for c in _cores(graph)] == [window, T, window, T]


def test_attention_time_shrinks_with_keys():
    h100 = preset("h100").device
    full = attention_time_s(32, 8192, 128, 2, h100, "bfloat16", Efficiency())
    windowed = attention_time_s(32, 8192, 128, 2, h100, "bfloat16", Efficiency(), keys=1024)
    assert windowed[0] < full[0] / 4 and windowed[1] < full[1] / 4


def test_key_window_reads_module_then_config():
    class Config:
        sliding_window = 4096

    class Layered:  # Gemma 3's full-attention layer: its own None wins over the config
        sliding_window = None
        config = Config()

    class Shared:
        config = Config()

    assert key_window(Layered()) is None and key_window(Shared()) == 4096


def test_x_at_weight_t_is_a_linear():
    """Falcon's `x @ W.T` projections are linears (column / row under tp), not replicated matmuls."""
    config = _config("falcon", **(SMALL | dict(new_decoder_architecture=False, multi_query=False)))
    _, graph, _ = _capture(config)
    linears = [n for n in graph.nodes if n.op_kind == "linear"]
    assert {n.module_path.rsplit(".", 1)[-1] for n in linears} >= {"query_key_value", "dense", "dense_h_to_4h",
                                                                    "dense_4h_to_h"}
    assert not [n for n in graph.nodes if n.op_kind == "other" and n.target == "matmul" and n.fwd_flops]


def test_architecture_without_sdpa_is_captured_with_eager_attention():
    """BLOOM has no SDPA path: captured with eager attention (ALiBi's baddbmm, softmax, dropout, bmm) as one
    core per layer, split on heads; its count exact; every op left replicated named in the plan's notes."""
    config = _config("bloom", hidden_size=64, n_layer=2, n_head=4, **TOKENS)
    summary, graph, info = _capture(config)
    assert summary.num_parameters() == _transformers_count(config)
    assert len(_cores(graph)) == 2 and not [n for n in graph.nodes if n.target in ("baddbmm", "bmm", "softmax")]
    assert "heads" in [s.name for s in hf_registry().strategies(_cores(graph)[0], 2, info)]
    plan = _tp2_plan(summary, graph, info)
    note = next(n for n in plan.provenance.notes if n.startswith("left replicated at tp=2"))
    chosen = {op.node: op.strategy for op in plan.ops}
    for node in graph.nodes:
        if (node.fwd_flops or node.fwd_bytes) and all(s.name == "replicate" for s in
                                                      hf_registry().strategies(node, 2, info)):
            assert chosen[node.name] == "replicate" and f"x {node.op_kind} {node.target} (" in note


@pytest.mark.parametrize("softcap", [None, 50.0])
def test_eager_attention_with_window_per_layer_type(softcap):
    """Gemma 2 (soft-capping off, or on as its configs have it: tanh inside the core) runs eager attention:
    one core per layer, its sliding layers priced with the window, its full ones with T."""
    config = _config("gemma2", **(SMALL | dict(num_key_value_heads=2, head_dim=16, sliding_window=8,
                                               attn_logit_softcapping=softcap, final_logit_softcapping=softcap)))
    _, graph, _ = _capture(config)
    assert [attention_keys(c) for c in _cores(graph)] == [8, T]
