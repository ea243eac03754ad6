"""Activation memory per layer against Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
Transformer Models", section 4), for a GPT-3 175B layer (h 12288, a 96 heads, s 2048, b 1, t 8), tier 1.

Their fp16 accounting per layer, in bytes (section 4.1-4.2; masks 1 byte per element):

    no parallelism                   s b h (34 + 5 a s / h)
    tensor parallelism t             s b h (10 + 24 / t + 5 a s / (h t))
    t with sequence parallelism      s b h / t (34 + 5 a s / h)
    t, sequence par., selective      34 s b h / t          (the attention core recomputed)
    full recomputation               2 s b h               (the layer input; / t with sequence parallelism)

The 34 s b h: layer norms 4 (their inputs), attention 11 (QKV input 2, Q K 4, V 2, projection input 2,
hidden-dropout mask 1), MLP 19 (input 2, GeLU input 8, its output 8, hidden-dropout mask 1); the
5 a s / h term is the T x T attention state (softmax output 2, attention-dropout mask 1, its output 2).

Where our model differs, and why (each term is checked below, in fp16 throughout as theirs; what is left
is the layer norms' fp32 statistics and the log-sum-exp, under 1%):

  - our GPT has no hidden dropout: no 2 x 1 s b h masks;
  - flash attention (the default kernel) keeps no T x T state (no 5 a s / h term); its output O is the
    projection's input (a view: one storage, their "proj input 2"); the materialized kernel
    (`AttentionKernel("materialized", dropout=True)`) keeps exactly their 5 a s / h, and its projection
    input is a copy of the P V product, which it does not keep;
  - with sequence parallelism our runtime keeps the all-gathered norm outputs that the QKV and MLP-input
    GEMMs saw (2 x 2 s b h, whole), where Megatron-LM keeps the 1/t shards and all-gathers them again in
    backward: + 2 x 2 (1 - 1/t);
  - our "selective" recomputes whole layers, keeping their inputs and every GEMM and attention output
    (torch's selective activation checkpointing, `autoplan.recompute_policy`), where theirs recomputes the
    attention core only: per layer the input 2 / t, q k v 6 / t, attention out 2 / t, fc out 8 / t and the
    two row-parallel GEMMs' partial outputs, whole before their reduce-scatter (2 x 2): 18 / t + 4.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from autoplan.capture import capture
from autoplan.cost_model.compute import AttentionKernel
from autoplan.cost_model.intra_op_problem import resolve_strategies
from autoplan.cost_model.activations import RunShape, activations
from autoplan.cost_model.storages import activation_bytes
from autoplan.recompute_policy import recompute_policy
from autoplan.models import build_model, get_model_config
from autoplan.solver.intra_op import megatron_assignment
from autoplan.strategies import default_registry

S, B, H, A, T = 2048, 1, 12288, 96, 8
SBH = S * B * H
SCORES = 5 * A * S / H  # Korthikanti's attention-state term, in units of s b h (= 80 here)
MATERIALIZED = AttentionKernel("materialized", dropout=True)
TOLERANCE = 0.01  # fp32 norm statistics (8 s b per norm) and the log-sum-exp (4 a s b): < 0.1 s b h here
BASE = get_model_config("gpt3-175b")


@pytest.fixture(scope="module")
def graphs():
    """The 175B layer captured in models of 2 and 3 layers: the difference is one layer's bytes."""
    found = {}
    for layers in (2, 3):
        config = dataclasses.replace(BASE, num_layers=layers)
        found[layers] = capture(build_model(config, "meta", torch.float16), config, B, S, torch.float16)
    return found


def per_layer_sbh(graphs, tp: int, sequence_parallel: bool, recompute: str, attention=None) -> float:
    """Bytes one more layer adds to what a rank keeps for backward, in units of s b h."""
    registry, info = default_registry(), BASE.rule_info()
    totals = []
    for layers in (2, 3):
        graph = graphs[layers]
        if tp == 1:
            assignment = {n.name: "replicate" for n in graph.nodes}
        else:
            assignment = megatron_assignment(graph, registry, tp, info, sequence_parallel=sequence_parallel)
        strategies = resolve_strategies(graph, registry, info, tp, assignment)
        acts = activations(graph, strategies, tp, info, RunShape(mixed=False), attention)
        totals.append(activation_bytes(acts, recompute_policy(recompute))[0])
    return (totals[1] - totals[0]) / SBH


HIDDEN_MASKS = 2  # their hidden-dropout masks, which our GPT does not have
GATHERED_NORMS = 2 * 2 * (1 - 1 / T)  # the two all-gathered norm outputs kept whole under sequence parallelism


def test_korthikanti_no_parallelism(graphs):
    """s b h (34 + 5 a s / h): the materialized kernel keeps their T x T term exactly."""
    assert per_layer_sbh(graphs, 1, False, "none", MATERIALIZED) == pytest.approx(34 + SCORES - HIDDEN_MASKS, rel=TOLERANCE)
    assert per_layer_sbh(graphs, 1, False, "none") == pytest.approx(34 - HIDDEN_MASKS, rel=TOLERANCE)


def test_korthikanti_tensor_parallel(graphs):
    """s b h (10 + 24 / t + 5 a s / (h t)): the norms' inputs and outputs (8) and the masks (2) replicated."""
    theirs = 10 + 24 / T
    assert per_layer_sbh(graphs, T, False, "none", MATERIALIZED) == pytest.approx(
        theirs + SCORES / T - HIDDEN_MASKS, rel=TOLERANCE)
    assert per_layer_sbh(graphs, T, False, "none") == pytest.approx(theirs - HIDDEN_MASKS, rel=TOLERANCE)


def test_korthikanti_sequence_parallel(graphs):
    """s b h / t (34 + 5 a s / h), plus the all-gathered norm outputs our runtime keeps whole."""
    theirs = (34 + SCORES) / T
    assert per_layer_sbh(graphs, T, True, "none", MATERIALIZED) == pytest.approx(
        theirs - HIDDEN_MASKS / T + GATHERED_NORMS, rel=TOLERANCE)
    assert per_layer_sbh(graphs, T, True, "none") == pytest.approx(
        34 / T - HIDDEN_MASKS / T + GATHERED_NORMS, rel=TOLERANCE)


def test_korthikanti_selective_recompute(graphs):
    """Theirs keeps 34 s b h / t; ours 18 / t + 4 (module docstring), whatever the kernel: the P V product
    of the materialized one is a GEMM output, kept as flash's output is. "matmul-only" recomputes
    attention too and keeps 2 / t less."""
    ours = 18 / T + 4
    for attention in (None, MATERIALIZED):
        assert per_layer_sbh(graphs, T, True, "selective", attention) == pytest.approx(ours, rel=TOLERANCE)
    assert per_layer_sbh(graphs, T, True, "matmul-only") == pytest.approx(ours - 2 / T, rel=TOLERANCE)


def test_korthikanti_full_recompute(graphs):
    """2 s b h per layer (its input), 2 s b h / t when sequence parallelism shards it: exactly."""
    for attention in (None, MATERIALIZED):
        assert per_layer_sbh(graphs, 1, False, "full", attention) == pytest.approx(2.0, rel=1e-12)
        assert per_layer_sbh(graphs, T, False, "full", attention) == pytest.approx(2.0, rel=1e-12)
        assert per_layer_sbh(graphs, T, True, "full", attention) == pytest.approx(2.0 / T, rel=1e-12)


def test_their_worked_numbers_for_the_175b_layer(graphs):
    """Their headline for this layer: 34 s b h / t = 107 MB with t = 8, sequence parallelism and selective
    recompute, against 2 s b h / t = 6.3 MB with full recompute; ours, as stated above: 157 MB under
    "selective" (101 MB of it the two whole partial GEMM outputs) and the same 6.3 MB."""
    assert 34 * SBH / T / 1e6 == pytest.approx(107.0, rel=0.01)
    assert per_layer_sbh(graphs, T, True, "full") * SBH / 1e6 == pytest.approx(2 * SBH / T / 1e6)
    assert per_layer_sbh(graphs, T, True, "selective") * SBH / 1e6 == pytest.approx(157.3, rel=0.01)


# ------------------------------------------------------------------------------ MoE layers


@pytest.mark.parametrize("strategy, tp, etp, split, gathered", [
    ("replicate", 1, 1, 1, 1), ("sequence", 4, 4, 1, 1), ("ffn", 4, 4, 4, 1), ("expert", 4, 2, 2, 2),
    ("expert", 4, 1, 1, 1)])
def test_moe_keeps_its_routed_rows_per_rank(strategy, tp, etp, split, gathered):
    """A MoE keeps per routed row its input row (h) as the expert GEMMs read it and its gate, up and product
    (3 f / split: each expert's FFN split over `split` ranks: tp under "ffn", etp under "expert"); a rank
    runs its tokens' k slots times `gathered` rows (the etp peers' under "expert"), its tokens all of them
    unless the strategy splits them over tp ("sequence", "expert"). The combine keeps each slot's output
    row in fp32 (4 h); the router's logits (its tokens x E) are made and not kept."""
    from autoplan.strategies import strategy_info

    config = dataclasses.replace(get_model_config("tiny-moe"), num_layers=1)
    graph = capture(build_model(config, "meta", torch.bfloat16), config, 2, 64, torch.bfloat16)
    moe = next(n for n in graph.nodes if n.op_kind == "moe")
    info = strategy_info(config.rule_info(), tp, etp)
    strategies = resolve_strategies(graph, default_registry(), info, tp, {moe.name: strategy})
    acts = activations(graph, strategies, tp, info, RunShape(mixed=False, imbalance=False))  # the mean
    mine = {key.split(":")[1]: s.nbytes for key, s in acts.storages.items() if key.startswith(moe.name + ":")}
    k, h, f = config.top_k, config.hidden, config.ffn_hidden
    tokens = 2 * 64 / (tp if strategy in ("sequence", "expert") else 1)
    rows = tokens * k * gathered
    assert mine["expert_in"] + mine["gate"] + mine["up"] + mine["product"] == rows * (h + 3 * f / split) * 2
    assert mine["combine"] == tokens * k * h * 4
    assert mine["logits"] == tokens * config.experts * 2


def test_moe_formula_matches_what_the_runtime_keeps():
    """The runtime's local experts (torch path, fp32 on CPU), measured with saved-tensor hooks: the distinct
    floating activations kept for backward (parameters and their per-expert views aside, the router's input
    aside: it is the norm's output, counted there) are the model's (`cost_model.activations`) expert input
    rows, gate, up and product, and combined rows, tokens k (3 f + 2 h), plus the (tokens, k) gate weights."""
    import torch.nn.functional as F

    from autoplan.runtime.experts import local_experts_ffn

    tokens, h, f, experts, k = 256, 64, 96, 4, 2
    torch.manual_seed(0)
    x = torch.randn(tokens, h, requires_grad=True)
    router = torch.randn(experts, h, requires_grad=True)
    weights = [torch.randn(experts, *shape, requires_grad=True) for shape in ((h, f), (h, f), (f, h))]
    params = [router, *weights]
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        inside = any(p.data_ptr() <= t.data_ptr() < p.data_ptr() + p.numel() * p.element_size() for p in params)
        if t.is_floating_point() and not inside and t.data_ptr() != x.data_ptr():
            kept[t.data_ptr()] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits, top_idx = F.linear(x, router).topk(k, dim=-1)
        gates = F.softmax(logits, dim=-1)
        local_experts_ffn(x, top_idx, gates, *weights, "torch").sum().backward()
    formula = tokens * k * (3 * f + 2 * h) * 4
    gate_weights = tokens * k * 4
    assert sum(kept.values()) == formula + gate_weights


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_the_largest_tp_buffer_is_an_activation_and_scales_with_the_microbatch(sequence_parallel):
    """Megatron's tp = 2 on tiny-gpt: the collectives move (m, T, h) activations and the loss's fp32 statistics
    (3 per token, vocabulary-parallel); each tensor is one line a m / B + b, found once per solution."""
    from autoplan.cost_model.memory import comm_buffer_lines, largest_comm_buffer_bytes

    config = get_model_config("tiny-gpt")
    graph = capture(build_model(config, "meta", torch.bfloat16), config, 1, 64, torch.bfloat16)
    registry, info = default_registry(), config.rule_info()
    assignment = megatron_assignment(graph, registry, 2, info, sequence_parallel=sequence_parallel)
    strategies = resolve_strategies(graph, registry, info, 2, assignment)
    activation, stats = 64 * config.hidden * 2, 3 * 4 * 64
    assert comm_buffer_lines(graph, strategies, 2) == ((stats, 0.0), (activation, 0.0))
    assert [largest_comm_buffer_bytes(graph, strategies, 2, m) for m in (1, 2, 4)] == [activation * m for m in (1, 2, 4)]
    assert comm_buffer_lines(graph, strategies, 1) == () and largest_comm_buffer_bytes(graph, strategies, 1, 4) == 0.0
