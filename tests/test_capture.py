"""Capture: node kinds, shapes, parameters, FLOP formulas, determinism, and a 175B model on meta."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import time

import pytest
import torch

from autoplan.capture import OP_KINDS, CapturedGraph, TensorMeta, capture, trace_model
from autoplan.errors import ConfigError
from autoplan.models import build_model, get_model_config

B, T = 2, 16


def _capture(name: str, **kwargs) -> CapturedGraph:
    config = get_model_config(name)
    return capture(build_model(config), config, B, T, **kwargs)


@pytest.mark.parametrize("name, kinds", [
    ("tiny-gpt", {"placeholder", "output", "embedding", "linear", "norm", "attention",
                  "cross_entropy", "elementwise", "other"}),
    ("tiny-llama", {"placeholder", "output", "embedding", "linear", "norm", "attention",
                    "cross_entropy", "elementwise"}),
    ("tiny-moe", {"placeholder", "output", "embedding", "linear", "norm", "attention", "moe",
                  "cross_entropy", "elementwise"}),
])
def test_tiny_capture_kinds_layers_and_parameters(name, kinds):
    config = get_model_config(name)
    graph = _capture(name)
    assert {n.op_kind for n in graph.nodes} == kinds and kinds <= set(OP_KINDS)
    assert graph.layers() == [0, 1]
    assert graph.parameter_count() == config.num_parameters()
    assert graph.total_fwd_flops() > 0 and graph.fingerprint == config.fingerprint()
    last = graph.nodes[-1]
    assert last.op_kind == "output" and last.output == TensorMeta((), "float32")
    core = graph.node("layers_1_attn_core")
    assert core.layer == 1 and core.module_path == "layers.1.attn.core" and core.params == ()
    assert core.inputs == ("layers_1_attn_q_proj", "layers_1_attn_k_proj", "layers_1_attn_v_proj")
    assert core.fwd_flops == 4 * B * T * T * config.hidden == core.bwd_flops / 2
    q = graph.node("layers_0_attn_q_proj")
    assert [p for p, _ in q.params][0] == "layers.0.attn.q_proj.weight"
    assert q.params[0][1] == TensorMeta((config.hidden, config.hidden), "bfloat16")
    assert graph.node("lm_head").output == TensorMeta((B, T, config.vocab), "bfloat16")


def test_linear_flops_and_bytes_are_exact():
    config = get_model_config("tiny-llama")
    graph = _capture("tiny-llama")
    for node in graph.nodes:
        if node.op_kind == "linear":
            (x,), out = node.input_metas, node.output
            assert node.fwd_flops == 2 * B * T * x.shape[-1] * out.shape[-1]
            assert node.bwd_flops == 2 * node.fwd_flops
            weight = x.shape[-1] * out.shape[-1] * 2  # bf16
            assert node.fwd_bytes == x.nbytes + weight + out.nbytes
    k = graph.node("layers_0_attn_k_proj")
    assert k.output.shape == (B, T, config.kv_heads * config.head_dim)


def test_moe_flops_formula():
    c = get_model_config("tiny-moe")
    node = _capture("tiny-moe").node("layers_0_mlp")
    rows = B * T
    expected = 2 * rows * c.hidden * c.experts + c.top_k * 3 * 2 * rows * c.hidden * c.ffn_hidden
    assert node.op_kind == "moe" and node.fwd_flops == expected
    assert {p for p, _ in node.params} == {f"layers.0.mlp.{w}" for w in
                                          ("router.weight", "w_gate", "w_up", "w_down")}


def test_module_paths_of_function_nodes():
    graph = _capture("tiny-gpt")
    gelu = next(n for n in graph.nodes if n.target == "gelu" and n.layer == 1)
    assert (gelu.op_kind, gelu.module_path) == ("elementwise", "layers.1.mlp")
    residuals = [n for n in graph.nodes if n.target == "add" and n.layer == 0]
    assert [n.module_path for n in residuals] == ["layers.0", "layers.0"]
    embed_sum = graph.node("add")
    assert (embed_sum.module_path, embed_sum.layer, embed_sum.inputs) == ("", None,
                                                                         ("tok_emb", "pos_emb"))
    size = graph.node("size")
    assert size.op_kind == "other" and size.output is None and size.inputs == ("tokens",)


def test_capture_is_deterministic_and_leaves_the_model_alone():
    config = get_model_config("tiny-moe")
    torch.manual_seed(0)
    model = build_model(config, device="cpu")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    first, second = (capture(model, config, B, T) for _ in range(2))
    assert [n.name for n in first.nodes] == [n.name for n in second.nodes]
    assert first == second
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.device.type == "cpu" and p.dtype == torch.float32 for p in model.parameters())


def test_trace_model_keeps_leaves_whole():
    gm = trace_model(build_model(get_model_config("tiny-llama")))
    modules = [n.target for n in gm.graph.nodes if n.op == "call_module"]
    assert "layers.0.attn.core" in modules and "layers.0.attn_norm" in modules
    assert "layers.0.attn" not in modules and "loss" in modules


def test_capture_rejects_too_long_sequences_and_bad_sizes():
    config = get_model_config("tiny-gpt")
    model = build_model(config)
    with pytest.raises(ConfigError, match="seq_len=65 exceeds max_seq=64"):
        capture(model, config, 1, 65)
    with pytest.raises(ConfigError, match="batch_size=0"):
        capture(model, config, 0, 8)


def test_capture_gpt3_175b_on_meta():
    config = get_model_config("gpt3-175b")
    batch, seq = 1, 2048
    model = build_model(config)
    start = time.perf_counter()
    graph = capture(model, config, batch, seq)
    elapsed = time.perf_counter() - start
    assert len(graph.nodes) == 15 + 12 * config.num_layers  # 11 before the blocks, 4 after
    assert graph.layers() == list(range(96)) and len(graph.nodes_of_layer(95)) == 12
    tokens = batch * seq
    attention = config.num_layers * 4 * batch * seq * seq * config.hidden
    analytic = 2 * config.num_parameters() * tokens + attention
    assert abs(graph.total_fwd_flops() / analytic - 1) < 0.02
    assert graph.parameter_count() == config.num_parameters()
    assert elapsed < 10.0  # about 0.4 s measured; generous for slow CI machines



@pytest.mark.parametrize("name", ["tiny-gpt", "tiny-llama", "tiny-moe", "tiny-gqa"])
def test_shape_rules_agree_with_meta_kernels(name):
    """autoplan.capture.shape_rules gives every node the shape and dtype its meta kernel gives."""
    config = get_model_config(name) if name != "tiny-gqa" else _gqa_config()
    by_rule = capture(build_model(config), config, 2, 16, torch.bfloat16)
    by_kernel = capture(build_model(config), config, 2, 16, torch.bfloat16, shape_rules=False)
    assert [(n.name, n.input_metas, n.output) for n in by_rule.nodes] == \
        [(n.name, n.input_metas, n.output) for n in by_kernel.nodes]


def _gqa_config():
    base = get_model_config("tiny-llama")
    return dataclasses.replace(base, name="tiny-gqa", kv_heads=max(1, base.heads // 2))


def test_planning_capture_never_imports_dynamo():
    """Building and capturing a model on meta runs no reference decomposition, whose first use
    imports torch._dynamo (seconds of every planning run)."""
    code = ("import sys\nfrom autoplan.models import get_model_config\nfrom autoplan.api import capture_model\n"
            "for name in ('tiny-gpt', 'tiny-llama', 'tiny-moe'):\n    capture_model(get_model_config(name), 32)\n"
            "print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"


def test_attention_shape_rule_keeps_the_head_check():
    from autoplan.models.layers import CausalAttention
    from autoplan.capture.shape_rules import module_output

    attention = CausalAttention(heads=4, kv_heads=4, head_dim=8, rope=False, max_seq=64)
    q, k = torch.empty(1, 16, 32, device="meta"), torch.empty(1, 16, 24, device="meta")  # 4 q heads, 3 kv heads
    with pytest.raises(ConfigError, match="not divisible"):
        module_output(attention, (q, k, k))
    assert module_output(attention, (q, q, q)).shape == (1, 16, 32)
