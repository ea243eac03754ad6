"""Runs of alike layers (`cost_model.layer_runs`): the parts of a solution found on the representative graph
equal those found on the whole graph, and the search's per-layer passes walk a number of nodes that does not
grow with depth."""

from __future__ import annotations

import dataclasses

import pytest

from autoplan.api import search_context, search_plans
from autoplan.capture.blocks import fold_graph
from autoplan.cluster import parse_cluster
from autoplan.cost_model import assignment as assignment_module
from autoplan.cost_model.layer_runs import LayerRuns
from autoplan.cost_model.memory import comm_buffer_lines
from autoplan.cost_model.parts import solution_parts
from autoplan.models.config import ModelConfig
from autoplan.recompute_policy import KINDS
from autoplan.solver.context import VARIANT_MEGATRON
from autoplan.solver.space import SearchOptions

LLAMA = ModelConfig("runs-llama", "llama", 16, 256, 8, 4, 704, 1024, 2048, rope_theta=500000.0)
GPT = ModelConfig("runs-gpt", "gpt", 16, 256, 8, 8, 1024, 1024, 2048)
MOE = ModelConfig("runs-moe", "moe", 16, 256, 8, 4, 256, 1024, 2048, experts=8, top_k=2, shared_experts=1,
                  dense_layers=1, dense_ffn_hidden=704)


def _mixed(ctx, tp: int) -> dict[str, str]:
    """Megatron's assignment with the ILP's strategies in layer 7 only: a run broken in the middle."""
    megatron = dict(ctx.assignment(VARIANT_MEGATRON, tp))
    ilp = ctx.solution(tp, 1).solution.assignment
    return megatron | {n.name: ilp[n.name] for n in ctx.graph.nodes if n.layer == 7}


def _same_parts(whole, folded) -> None:
    assert folded.walked is not None and len(folded.walked.graph.nodes) < len(whole.solution.graph.nodes)
    assert folded.index.tolist() == whole.index.tolist()
    assert [tuple(n.name for n in nodes) for nodes, _ in folded.groups] == \
           [tuple(n.name for n in nodes) for nodes, _ in whole.groups]
    assert [t.key() for _, t in folded.groups] == [t.key() for _, t in whole.groups]
    assert (folded.pre_tally.key(), folded.post_tally.key()) == (whole.pre_tally.key(), whole.post_tally.key())
    assert folded.boundary_bytes_per_sequence == whole.boundary_bytes_per_sequence
    assert folded.solution.comm_lines == comm_buffer_lines(whole.solution.graph, whole.solution.strategies,
                                                           whole.solution.tp)
    for context, spread in ((1, False), (2, False), (1, True)):
        a, b = folded.activation_tally(context, spread), whole.activation_tally(context, spread)
        assert (a.pre, a.post) == (b.pre, b.post)  # the same storages summed in the same order: equal floats
        assert all(a.layers[kind] == b.layers[kind] for kind in KINDS)


@pytest.mark.parametrize("config", [LLAMA, GPT, MOE], ids=lambda c: c.name)
def test_parts_of_the_representative_graph_equal_those_of_the_whole_graph(config):
    ctx = search_context(config, parse_cluster("1x8xh100"), 16, 512)
    runs = ctx.layer_runs()
    assert runs.local
    for tp in (2, 4):
        sols = [ctx.solution(tp, 1).solution, ctx.solution(tp, 1, VARIANT_MEGATRON).solution,
                ctx.solution(tp, 1, "given", _mixed(ctx, tp)).solution]
        for sol in sols:
            whole = sol.graph
            assert whole is ctx.graph
            full_lines = dataclasses.replace(sol, comm_lines=comm_buffer_lines(whole, sol.strategies, tp))
            _same_parts(solution_parts(whole, full_lines), solution_parts(whole, sol, runs))


def test_a_run_walks_five_layers_and_a_broken_run_keeps_its_ends():
    ctx = search_context(LLAMA, parse_cluster("1x8xh100"), 16, 512)
    runs = ctx.layer_runs()
    uniform = runs.representatives(ctx.assignment(VARIANT_MEGATRON, 2))
    assert sorted({n.layer for n in uniform.graph.nodes if n.layer is not None}) == [0, 1, 2, 14, 15]
    assert [uniform.of_layer[i] for i in range(16)] == [0, 1, 2] + [2] * 11 + [14, 15]
    mixed = _mixed(ctx, 2)
    assert any(mixed[n.name] != ctx.assignment(VARIANT_MEGATRON, 2)[n.name] for n in ctx.graph.nodes if n.layer == 7)
    broken = runs.representatives(mixed)  # runs 0-6, 7, 8-15
    assert sorted({n.layer for n in broken.graph.nodes if n.layer is not None}) == [0, 1, 2, 5, 6, 7, 8, 9, 10, 14, 15]
    assert [broken.of_layer[i] for i in range(16)] == [0, 1, 2, 2, 2, 5, 6, 7, 8, 9, 10, 10, 10, 10, 14, 15]


def test_edges_that_skip_a_layer_or_tied_layer_weights_keep_the_whole_graph():
    ctx = search_context(GPT, parse_cluster("1x8xh100"), 16, 512)
    nodes = list(ctx.graph.nodes)
    far = next(n for n in nodes if n.layer == 1)  # a node of layer 1 read again by the first node of layer 5
    k = next(k for k, n in enumerate(nodes) if n.layer == 5 and n.inputs)
    nodes[k] = dataclasses.replace(nodes[k], inputs=nodes[k].inputs + (far.name,),
                                   input_metas=nodes[k].input_metas + (far.output,))
    skipping = dataclasses.replace(ctx.graph, nodes=tuple(nodes))
    runs = LayerRuns.of(skipping, fold_graph(skipping))
    assert not runs.local
    whole = runs.representatives(ctx.assignment(VARIANT_MEGATRON, 2))
    assert whole.graph.nodes == skipping.nodes and whole.of_layer == {i: i for i in range(16)}
    weighted = next(k for k, n in enumerate(ctx.graph.nodes) if n.layer == 7 and n.params)
    tied = list(ctx.graph.nodes)
    first = next(n for n in tied if n.layer == 0 and n.params)
    tied[weighted] = dataclasses.replace(tied[weighted], params=first.params)
    tied_graph = dataclasses.replace(ctx.graph, nodes=tuple(tied))
    assert not LayerRuns.of(tied_graph, fold_graph(tied_graph)).local


def test_the_search_walks_as_many_nodes_at_32_layers_as_at_8(monkeypatch):
    """Structure, not time: every activation walk of a whole search covers a number of nodes independent of
    depth (the representative graph), so deep models cost what shallow ones do. Timing goals live in
    benchmarks/search_scaling.py."""
    walked: list[int] = []
    real = assignment_module.activations

    def counting(graph, *args, **kwargs):
        walked.append(len(graph.nodes))
        return real(graph, *args, **kwargs)

    monkeypatch.setattr(assignment_module, "activations", counting)
    options = SearchOptions(max_microbatch_size=2, zero_stages=(1,), recompute=("none", "full"), virtual_stages=())
    per_depth = {}
    for layers in (8, 32):
        config = dataclasses.replace(LLAMA, num_layers=layers)
        walked.clear()
        result = search_plans(config, "2x8xh100", 64, 512, options=options, baselines=False)
        assert result.stats.priced > 0
        per_depth[layers] = (len(walked), max(walked))
    assert per_depth[8] == per_depth[32]


def test_a_hugging_face_graph_has_the_same_parts_on_its_representative_graph():
    """torch.export graphs pass RoPE's cos and sin and the mask from outside the layers to each of them: still
    local, and the parts are the whole graph's."""
    tf = pytest.importorskip("transformers")
    import torch

    from autoplan.capture.hf import capture_hf, hf_model_config, hf_model_info
    from autoplan.capture.hf_rules import hf_registry

    config = tf.LlamaConfig(num_hidden_layers=9, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                            intermediate_size=128, vocab_size=256)
    graph = capture_hf(config, 1, 64, torch.bfloat16)
    ctx = search_context(hf_model_config(config), parse_cluster("1x8xh100"), 8, 64, graph=graph,
                         info=hf_model_info(config), registry=hf_registry())
    runs = ctx.layer_runs()
    assert runs.local
    sol = ctx.solution(2, 1).solution
    assert sorted({n.layer for n in runs.representatives(sol.assignment).graph.nodes if n.layer is not None}) == \
           [0, 1, 2, 7, 8]
    whole = dataclasses.replace(sol, comm_lines=comm_buffer_lines(graph, sol.strategies, 2))
    _same_parts(solution_parts(graph, whole), solution_parts(graph, sol, runs))
