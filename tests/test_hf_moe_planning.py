"""transformers' MoE models planned as MoE (autoplan.capture.hf_moe), by the mechanism of the zoo's.

The transformers Mixtral 8x7B (its real config, built locally, captured on meta) against the zoo's
`mixtral-8x7b` of identical shapes: expert parallelism divides the expert weights per rank (ep 2 vs 8
differ by exactly the expert share), the step model prices both alike (the dispatch and combine
all-to-alls included) within TOLERANCE at fixed meshes (`benchmarks/hf_moe_vs_zoo.py` compares the
best plans of a search too). Tiny
Qwen2-MoE: the routed experts are one "moe" node per layer, the shared experts dense linears.
"""

from __future__ import annotations

import warnings

import pytest

transformers = pytest.importorskip("transformers")

SEQ, BATCH = 4096, 256
TOLERANCE = 0.02  # relative, HF vs zoo step time (measured 0.4-0.7%: the dense ops' captures differ slightly)


@pytest.fixture(scope="module")
def mixtral():
    from autoplan.capture.hf import capture_hf_for_planner

    config = transformers.MixtralConfig(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, max_position_embeddings=32768, num_local_experts=8, num_experts_per_tok=2,
        rope_theta=1e6, tie_word_embeddings=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return capture_hf_for_planner(config, SEQ, "bfloat16")


def _estimate(model, mesh, cluster: str, hf=None, **kw):
    from autoplan.api import estimate
    from autoplan.capture.hf_rules import hf_registry

    extra = dict(graph=hf[1], info=hf[2], registry=hf_registry()) if hf is not None else {}
    return estimate(model, cluster, BATCH, SEQ, mesh=mesh, microbatch_size=1, recompute="full", **extra, **kw)


def test_routed_experts_are_one_moe_node_per_layer(mixtral):
    _, graph, _ = mixtral
    moe = [n for n in graph.nodes if n.op_kind == "moe"]
    assert len(moe) == 32 and {n.module_path for n in moe} == {f"model.layers.{i}.mlp" for i in range(32)}
    names = {name.rsplit(".", 1)[-1] for name, _ in moe[0].params}
    assert names == {"weight", "gate_up_proj", "down_proj"}
    assert not [n for n in graph.nodes if n.target.startswith("grouped_linear")]


def test_ep_divides_the_expert_weights_per_rank(mixtral):
    from autoplan.mesh import MeshShape

    summary = mixtral[0]
    experts = 32 * 8 * 3 * 4096 * 14336  # layers x experts x (gate, up, down) x h x f
    found = {ep: _estimate(summary, MeshShape(dp=8 // ep, ep=ep), "1x8xh100", mixtral, zero_stage=0)
             for ep in (2, 8)}
    params = {ep: p.predicted.memory.parameters_bytes for ep, p in found.items()}
    # estimate's default precision, autocast: fp32 weights and autocast's bf16 copy of each (cost_model.memory),
    # the parts of the forward + backward phase; both peak at the optimizer step, where the copies are gone
    # and the gradients held (cost_model.step_sums.peak_phase)
    assert all(p.predicted.memory.peaks_at_optimizer_step() for p in found.values())
    assert all(p.predicted.memory.activations_bytes > 0 for p in found.values())
    assert params[2] - params[8] == pytest.approx((4 + 2) * experts * (1 / 2 - 1 / 8), rel=1e-9)
    placed = {p.name: dict(p.placements) for p in found[2].params}
    assert placed["model.layers.0.mlp.experts.gate_up_proj"]["ep"].dim == 0
    assert "ep" not in placed["model.layers.0.mlp.gate.weight"]


@pytest.mark.parametrize("mesh", ["pp2-dp4-ep2-tp4", "pp2-dp1-ep8-tp4", "2x8:pp2-dp1-ep2-tp4-etp1"])
def test_hf_and_zoo_mixtral_price_alike(mixtral, mesh):
    """Fixed meshes: experts split by ep with the "ffn" strategy inside each (etp = tp), and the
    searched best plan on 2 x 8 H100s (pp2 x ep2 x tp4, etp 1: the "expert" strategy)."""
    from autoplan.mesh import MeshShape

    cluster, _, spec = mesh.rpartition(":")
    degrees = {part.rstrip("0123456789"): int(part[len(part.rstrip("0123456789")):]) for part in spec.split("-")}
    cluster = {"": "8x8xh100", "2x8": "2x8xh100"}[cluster]
    shape = MeshShape(**degrees)
    hf = _estimate(mixtral[0], shape, cluster, mixtral, zero_stage=1)
    zoo = _estimate("mixtral-8x7b", shape, cluster, zero_stage=1)
    assert hf.predicted.step_time_s == pytest.approx(zoo.predicted.step_time_s, rel=TOLERANCE)
    assert hf.predicted.memory.parameters_bytes == pytest.approx(zoo.predicted.memory.parameters_bytes, rel=1e-6)
    assert hf.predicted.time.communication_s == pytest.approx(zoo.predicted.time.communication_s, rel=0.05)


def test_qwen2_moe_shared_experts_stay_dense():
    import torch

    from autoplan.capture.hf import capture_hf

    config = transformers.Qwen2MoeConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=24,
        shared_expert_intermediate_size=40, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = capture_hf(config, 1, 16, torch.float32)
    moe = [n for n in graph.nodes if n.op_kind == "moe"]
    assert len(moe) == 2 and all(n.input_metas[0].shape == n.output.shape == (1, 16, 32) for n in moe)
    assert moe[0].fwd_flops == 2 * 16 * 32 * 4 + 2 * 3 * 2 * 16 * 32 * 24  # router + top-2 SwiGLU experts
    shared = [n for n in graph.nodes if n.module_path.startswith("model.layers.0.mlp.shared_expert.")
              and n.op_kind == "linear"]
    assert len(shared) == 3
