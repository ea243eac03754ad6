"""Model zoo: presets, exact parameter counts, numerics of the leaf modules, config errors."""

from __future__ import annotations

import json
import math

import pytest
import torch

from autoplan.errors import ConfigError
from autoplan.models import (ModelConfig, build_model, get_model_config, known_models,
                             load_model_config)
from autoplan.models.layers import CausalAttention, MoEFeedForward, RMSNorm, swiglu

TINY = ("tiny-gpt", "tiny-llama", "tiny-moe")


@pytest.mark.parametrize("name", sorted(known_models()))
def test_preset_builds_on_meta_with_exact_parameter_count(name):
    config = get_model_config(name)
    model = build_model(config)
    params = list(model.parameters())
    assert all(p.is_meta for p in params)
    assert sum(p.numel() for p in params) == config.num_parameters()


@pytest.mark.parametrize("name, low, high", [
    ("gpt3-175b", 174.5e9, 176.0e9),     # Brown et al. 2020: 175.0B
    ("llama3-8b", 8.02e9, 8.04e9),       # Meta: 8.03B
    ("llama3-70b", 70.5e9, 70.6e9),      # Meta: 70.6B
    ("llama3-405b", 405.8e9, 405.9e9),   # Meta: 405.85B
    ("mixtral-8x7b", 46.6e9, 46.8e9),    # Mistral: 46.7B
    ("mixtral-8x22b", 140.5e9, 141.1e9), # Mistral: 141B (HF safetensors 140.6B)
])
def test_published_parameter_counts(name, low, high):
    assert low <= get_model_config(name).num_parameters() <= high


def test_gpt3_175b_builds_on_meta_without_memory():
    """Every parameter on meta, none materialised (its build time is benchmarks/capture_speed.py's)."""
    config = get_model_config("gpt3-175b")
    model = build_model(config, dtype=torch.bfloat16)
    params = list(model.parameters())
    assert all(p.is_meta and p.dtype == torch.bfloat16 for p in params)
    assert sum(p.numel() for p in params) == config.num_parameters()


@pytest.mark.parametrize("name", TINY)
def test_tiny_models_train_step_on_cpu(name):
    config = get_model_config(name)
    torch.manual_seed(0)
    model = build_model(config, device="cpu")
    tokens = torch.randint(0, config.vocab, (2, 16))
    targets = torch.randint(0, config.vocab, (2, 16))
    assert model(tokens).shape == (2, 16, config.vocab)
    loss = model(tokens, targets)
    loss.backward()
    assert loss.ndim == 0 and math.isfinite(loss.item())
    assert abs(loss.item() - math.log(config.vocab)) < 2.0  # near uniform at init
    for name_, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name_


@pytest.mark.parametrize("heads, kv_heads, rope", [(4, 4, False), (8, 2, True), (4, 2, True)])
def test_attention_on_half_the_heads_is_half_the_output(heads, kv_heads, rope):
    """What tensor parallelism relies on: rank r of tp=2 gets heads [r*H/2, (r+1)*H/2)."""
    torch.manual_seed(0)
    d, B, T = 8, 2, 12
    core = CausalAttention(heads, kv_heads, d, rope=rope, max_seq=64, rope_theta=10000.0)
    q = torch.randn(B, T, heads * d, dtype=torch.float64)
    k, v = (torch.randn(B, T, kv_heads * d, dtype=torch.float64) for _ in range(2))
    full = core(q, k, v)  # (B, T, Hq*d)
    qw, kw = heads * d // 2, kv_heads * d // 2
    for r in range(2):
        part = core(q[..., r * qw:(r + 1) * qw], k[..., r * kw:(r + 1) * kw],
                    v[..., r * kw:(r + 1) * kw])
        torch.testing.assert_close(part, full[..., r * qw:(r + 1) * qw])


def test_attention_is_causal_and_matches_reference_without_rope():
    torch.manual_seed(0)
    B, T, H, d = 1, 5, 2, 4
    q, k, v = (torch.randn(B, T, H * d, dtype=torch.float64) for _ in range(3))
    out = CausalAttention(H, H, d, rope=False, max_seq=8)(q, k, v)
    qh, kh, vh = (t.view(B, T, H, d).transpose(1, 2) for t in (q, k, v))
    scores = qh @ kh.transpose(-1, -2) / math.sqrt(d)
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    ref = (scores.softmax(-1) @ vh).transpose(1, 2).reshape(B, T, H * d)
    torch.testing.assert_close(out, ref)


def test_attention_rejects_sequences_longer_than_max_seq():
    core = CausalAttention(2, 2, 4, rope=True, max_seq=4)
    x = torch.zeros(1, 5, 8)
    with pytest.raises(ConfigError, match="max_seq=4"):
        core(x, x, x)


def _naive_moe(moe: MoEFeedForward, x: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(x)
    for n in range(x.shape[0]):
        logits = moe.router.weight @ x[n]  # (E,)
        top_vals, top_idx = logits.topk(moe.top_k)
        weights = top_vals.softmax(-1)
        for w, e in zip(weights, top_idx.tolist()):
            out[n] += w * swiglu(x[n:n + 1], moe.w_gate[e], moe.w_up[e], moe.w_down[e])[0]
    return out


def test_moe_matches_naive_per_token_reference_and_dense_form():
    torch.manual_seed(0)
    moe = MoEFeedForward(hidden=16, ffn_hidden=24, experts=4, top_k=2).double()
    x = torch.randn(3, 7, 16, dtype=torch.float64)
    out = moe(x)
    torch.testing.assert_close(out.view(-1, 16), _naive_moe(moe, x.view(-1, 16)))
    flat = x.view(-1, 16)
    top_logits, top_idx = moe.router(flat).topk(2, dim=-1)
    dense = moe._dense(flat, top_idx, top_logits.softmax(-1))  # the meta-device path
    torch.testing.assert_close(dense, out.view(-1, 16))


def test_moe_runs_on_meta():
    moe = MoEFeedForward(64, 96, 4, 2).to("meta").to(torch.bfloat16)
    out = moe(torch.empty(2, 8, 64, device="meta", dtype=torch.bfloat16))
    assert out.shape == (2, 8, 64) and out.dtype == torch.bfloat16


def test_rmsnorm_computes_in_fp32_and_returns_input_dtype():
    norm = RMSNorm(8, eps=1e-6)
    x = torch.randn(2, 8)
    ref = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(norm(x), ref)
    assert norm.to(torch.bfloat16)(x.bfloat16()).dtype == torch.bfloat16


def test_unknown_model_lists_every_known_name():
    with pytest.raises(ConfigError) as info:
        get_model_config("gpt5")
    assert "'gpt5'" in str(info.value)
    assert ", ".join(sorted(known_models())) in str(info.value)


@pytest.mark.parametrize("change, fragment", [
    (dict(hidden=65), "hidden=65 is not divisible by heads=4"),
    (dict(kv_heads=3), "heads=4 is not divisible by kv_heads=3"),
    (dict(family="rnn"), "family='rnn'"),
    (dict(num_layers=0), "num_layers=0"),
    (dict(experts=4), "only for family 'moe'"),
])
def test_invalid_llama_config_names_the_field(change, fragment):
    fields = get_model_config("tiny-llama").to_json() | change
    with pytest.raises(ConfigError, match=fragment.replace("(", r"\(")):
        ModelConfig(**fields)


def test_gpt_requires_kv_heads_equal_heads_and_moe_needs_experts():
    with pytest.raises(ConfigError, match="kv_heads == heads"):
        ModelConfig("x", "gpt", 2, 64, 4, 2, 256, 128)
    with pytest.raises(ConfigError, match="experts >= 2"):
        ModelConfig("x", "moe", 2, 64, 4, 2, 96, 128)
    with pytest.raises(ConfigError, match="top_k=5"):
        ModelConfig("x", "moe", 2, 64, 4, 2, 96, 128, experts=4, top_k=5)


def test_from_json_rejects_unknown_keys_and_lists_allowed():
    data = get_model_config("tiny-gpt").to_json() | {"dropout": 0.1}
    with pytest.raises(ConfigError, match=r"unknown keys \['dropout'\].*allowed keys"):
        ModelConfig.from_json(data)


def test_fingerprint_depends_on_shapes_not_name():
    config = get_model_config("tiny-llama")
    renamed = ModelConfig.from_json(config.to_json() | {"name": "other"})
    wider = ModelConfig.from_json(config.to_json() | {"ffn_hidden": 256})
    assert renamed.fingerprint() == config.fingerprint() != wider.fingerprint()
    assert len(config.fingerprint()) == 16


def test_config_files_round_trip(tmp_path):
    config = get_model_config("tiny-moe")
    (tmp_path / "a.json").write_text(json.dumps(config.to_json()))
    assert load_model_config(tmp_path / "a.json") == config
    (tmp_path / "my-moe.yaml").write_text(
        "family: moe\nlayers: 2\nhidden: 64\nheads: 4\nkv_heads: 2\nffn_hidden: 96\n"
        "vocab: 128\nexperts: 4\ntop_k: 2\nmax_seq: 64\n")
    loaded = load_model_config(tmp_path / "my-moe.yaml")
    assert loaded.name == "my-moe" and loaded.fingerprint() == config.fingerprint()
    (tmp_path / "bad.yml").write_text("family: gpt\nlayers: 2\nhidden: 64\nheads: 4\n"
                                      "kv_heads: 4\nffn_hidden: 256\nvocab: 128\nbias: true\n")
    with pytest.raises(ConfigError, match="unknown keys \\['bias'\\]"):
        load_model_config(tmp_path / "bad.yml")
