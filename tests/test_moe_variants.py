"""Fine-grained DeepSeekMoE (shared experts, a dense first layer) and BigMac (descend, experts at a
low width, ascend) in the moe family: config fields, exact parameter counts, numerics on CPU, capture
and folding at real size on meta, a planner search, and tp=2 (Megatron) and ep=2 runs on 2 gloo ranks
against one process (the tolerances of test_runtime_parity: loss rtol 1e-5, gradients rtol 1e-4 /
atol 1e-6, parameters after 3 AdamW steps rtol 1e-4 / atol 2e-5), with the collectives each run
issues equal to `runtime.counting.expected_collectives` of its plan.
"""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from _dist import assert_matches, batches, make_plan, reference, spawn, train_program
from autoplan.errors import ConfigError
from autoplan.models import ModelConfig, build_model, get_model_config, load_model_config
from autoplan.models.layers import MoEFeedForward
from autoplan.models.moe import MoELayer

PRESETS = ("deepseek-moe-16b", "bigmac-47b")  # captured at real size below
TWIN = "finegrained-moe-47b"  # bigmac-47b's fine-grained (CDAC) twin
TINY = ("tiny-deepseek", "tiny-bigmac")
SEED, STEPS, SEQ, LR, EPS = 5, 3, 16, 1e-3, 1e-6


# ---------------------------------------------------------------------------------- configs


@pytest.mark.parametrize("name", PRESETS + (TWIN,) + TINY)
def test_parameter_counts_are_exact(name):
    config = get_model_config(name)
    named = dict(build_model(config).named_parameters())
    assert sum(p.numel() for p in named.values()) == config.num_parameters()
    experts = sum(p.numel() for n, p in named.items() if n.rsplit(".", 1)[-1] in ("w_gate", "w_up", "w_down"))
    assert experts == config.expert_parameters()


def test_published_and_chosen_sizes():
    deepseek, bigmac, twin, mixtral = (get_model_config(n) for n in ("deepseek-moe-16b", "bigmac-47b", TWIN,
                                                                     "mixtral-8x7b"))
    assert 16.37e9 <= deepseek.num_parameters() <= 16.39e9  # Dai et al. 2024: 16.4B; HF: 16.38B
    # BigMac and its fine-grained twin at Mixtral 8x7B's size: the same expert weights and active expert FLOPs
    for moe in (bigmac, twin):
        assert moe.expert_parameters() == mixtral.expert_parameters()
        assert moe.top_k * moe.expert_width * moe.ffn_hidden == mixtral.top_k * mixtral.hidden * mixtral.ffn_hidden
        assert abs(moe.num_parameters() / mixtral.num_parameters() - 1) < 0.005
    # values per token per all-to-all: BigMac's = Mixtral's = 1/8 of the fine-grained twin's
    assert bigmac.top_k * bigmac.expert_width == mixtral.top_k * mixtral.hidden == twin.top_k * twin.hidden // 8


@pytest.mark.parametrize("base, change, fragment", [
    ("tiny-deepseek", dict(dense_layers=3), "dense_layers=3 leaves no MoE layer of num_layers=3"),
    ("tiny-deepseek", dict(dense_ffn_hidden=0), "dense_layers=1 and dense_ffn_hidden=0 must be both 0"),
    ("tiny-moe", dict(dense_ffn_hidden=64), "dense_layers=0 and dense_ffn_hidden=64"),
    ("tiny-deepseek", dict(shared_experts=-1), "shared_experts=-1: expected an integer >= 0"),
    ("tiny-deepseek", dict(shared_experts=True), "shared_experts=True: expected an integer >= 0"),
    ("tiny-bigmac", dict(expert_hidden=64), "expert_hidden=64 must be below hidden=64"),
    ("tiny-bigmac", dict(expert_hidden=2.5), "expert_hidden=2.5: expected an integer >= 0"),
    ("tiny-llama", dict(shared_experts=2), "shared_experts=2: these fields are only for family 'moe'"),
    ("tiny-llama", dict(expert_hidden=16, dense_layers=1), "dense_layers=1, expert_hidden=16: these fields"),
])
def test_invalid_layouts_name_the_fields(base, change, fragment):
    with pytest.raises(ConfigError, match=fragment):
        ModelConfig(**(get_model_config(base).to_json() | change))


def test_json_files_fingerprints_and_the_models_table(tmp_path, capsys):
    from autoplan.cli import main

    for name in PRESETS + (TWIN,) + TINY:
        config = get_model_config(name)
        assert ModelConfig.from_json(json.loads(json.dumps(config.to_json()))) == config
        (tmp_path / f"{name}.json").write_text(json.dumps(config.to_json()))
        assert load_model_config(tmp_path / f"{name}.json") == config
    (tmp_path / "mine.yaml").write_text(
        "family: moe\nlayers: 2\nhidden: 64\nheads: 4\nkv_heads: 2\nffn_hidden: 64\nvocab: 128\n"
        "max_seq: 64\nexperts: 8\ntop_k: 4\nexpert_hidden: 16\n")
    assert load_model_config(tmp_path / "mine.yaml").fingerprint() == get_model_config("tiny-bigmac").fingerprint()
    base = get_model_config("tiny-deepseek")
    prints = {base.fingerprint()} | {ModelConfig.from_json(base.to_json() | change).fingerprint() for change in (
        dict(shared_experts=1), dict(dense_layers=2), dict(dense_ffn_hidden=96), dict(expert_hidden=32))}
    assert len(prints) == 5
    mixtral = get_model_config("mixtral-8x7b")  # layouts without the new fields keep their fingerprints
    shape = {k: getattr(mixtral, k) for k in ("family", "num_layers", "hidden", "heads", "kv_heads", "ffn_hidden",
                                              "vocab", "max_seq", "experts", "top_k", "norm_eps", "rope_theta")}
    text = json.dumps(shape, sort_keys=True, separators=(",", ":"))
    assert mixtral.fingerprint() == hashlib.sha256(text.encode()).hexdigest()[:16]
    assert main(["models"]) == 0
    table = capsys.readouterr().out
    assert all(name in table for name in PRESETS + (TWIN,) + TINY)


# ---------------------------------------------------------------------------------- numerics


@pytest.mark.parametrize("name", TINY)
def test_tiny_models_train_step_on_cpu(name):
    config = get_model_config(name)
    torch.manual_seed(0)
    model = build_model(config, device="cpu")
    tokens, targets = torch.randint(0, config.vocab, (2, 2, 16))
    loss = model(tokens, targets)
    loss.backward()
    assert abs(loss.item() - torch.log(torch.tensor(float(config.vocab))).item()) < 2.0
    for pname, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, pname


def test_moe_layer_is_its_formula():
    """DeepSeek: experts(x) + shared(x); BigMac: ascend(experts(descend(x))); on meta, the dense form."""
    torch.manual_seed(0)
    x = torch.randn(2, 5, 64, dtype=torch.float64)
    deep = MoELayer(get_model_config("tiny-deepseek")).double()
    shared = deep.shared.down_proj(torch.nn.functional.silu(deep.shared.gate_proj(x)) * deep.shared.up_proj(x))
    torch.testing.assert_close(deep(x), deep.experts(x) + shared)
    assert deep.shared.gate_proj.out_features == 2 * 32 and deep.descend is None and deep.ascend is None
    big = MoELayer(get_model_config("tiny-bigmac")).double()
    torch.testing.assert_close(big(x), big.ascend(big.experts(big.descend(x))))
    assert isinstance(big.experts, MoEFeedForward) and big.experts.w_gate.shape == (8, 16, 64)
    assert big.shared is None
    assert big.to("meta")(x.to("meta")).shape == (2, 5, 64)


# ---------------------------------------------------------------------------------- capture, fold, search


@pytest.fixture(scope="module")
def captured():
    from autoplan.api import capture_model

    return {name: capture_model(get_model_config(name), 4096) for name in PRESETS}


def test_capture_at_real_size_on_meta(captured):
    deep, big = captured["deepseek-moe-16b"], captured["bigmac-47b"]
    for name, graph in captured.items():
        assert graph.parameter_count() == get_model_config(name).num_parameters()
    kinds = {i: sorted(n.op_kind for n in deep.nodes_of_layer(i)) for i in (0, 1, 27)}
    assert "moe" not in kinds[0] and kinds[1] == kinds[27] and kinds[1].count("moe") == 1
    assert kinds[1].count("linear") == 4 + 3 and kinds[0].count("linear") == 4 + 3  # q k v o + gate up down
    shared = [n for n in deep.nodes_of_layer(1) if n.module_path.startswith("layers.1.mlp.shared.")]
    assert [n.output.shape for n in shared if n.op_kind == "linear"] == [(1, 4096, 2816)] * 2 + [(1, 4096, 2048)]
    (moe,) = [n for n in deep.nodes_of_layer(1) if n.op_kind == "moe"]
    assert moe.fwd_flops == 2 * 4096 * 2048 * 64 + 6 * 3 * 2 * 4096 * 2048 * 1408
    by_path = {n.module_path: n for n in big.nodes_of_layer(3) if n.op_kind in ("linear", "moe")}
    assert by_path["layers.3.mlp.descend"].output.shape == (1, 4096, 512)
    assert by_path["layers.3.mlp.experts"].input_metas[0].shape == (1, 4096, 512)
    assert by_path["layers.3.mlp.experts"].fwd_flops == 2 * 4096 * 512 * 64 + 16 * 3 * 2 * 4096 * 512 * 14336
    assert by_path["layers.3.mlp.ascend"].output.shape == (1, 4096, 4096)


def test_fold_groups_the_dense_first_layer_apart(captured):
    from autoplan.capture.blocks import fold_graph

    deep = fold_graph(captured["deepseek-moe-16b"])
    layer_kind = {seg.layer: seg.kind for seg in deep.segments if seg.layer is not None}
    assert len(set(layer_kind[i] for i in range(1, 28))) == 1 and layer_kind[0] != layer_kind[1]
    assert sorted(deep.layer_kinds().values()) == [1, 27]
    big = fold_graph(captured["bigmac-47b"])
    assert list(big.layer_kinds().values()) == [32]


@pytest.mark.parametrize("name", TINY)
def test_search_on_a_small_cluster_gives_a_valid_plan(name):
    from autoplan.plan import Plan
    from autoplan.api import capture_model, search

    config = get_model_config(name)
    plan = search(config, "1x4xh100", 8, 64, max_microbatch_size=4)
    assert plan.model.fingerprint == config.fingerprint()
    assert plan.model.num_parameters == config.num_parameters()
    assert plan.mesh.world_size == 4 and plan.predicted.step_time_s > 0
    assert Plan.from_json(json.loads(plan.dumps())) == plan
    assert {op.node for op in plan.ops} == {n.name for n in capture_model(config, 64).nodes}


# ---------------------------------------------------------------------------------- gloo parity

# tp=2 with Megatron's assignment (the planner's `plan_from_assignment`); ep=2, where BigMac's
# dispatch and combine all-to-alls move r-wide tokens (a plan built directly: see _dist.make_plan)
PARITY = {f"{name}-{cid}": (name, kwargs) for name in TINY for cid, kwargs in (
    ("tp2-megatron", dict(dp=1, tp=2, assignment="megatron", microbatch_size=2)),
    ("ep2", dict(dp=1, tp=1, ep=2)))}


def _run_all(rank: int, world: int, configs: list) -> dict:
    from autoplan.runtime.counting import expected_collectives
    from autoplan.runtime.launch import parallelize

    torch.manual_seed(1234 + rank)  # nothing may depend on the global RNG
    out = {}
    for cid, plan in configs:
        config = get_model_config(PARITY[cid][0])
        program = parallelize(build_model(config), None, plan, seed=SEED, config=config)
        optimizer = program.make_optimizer(torch.optim.AdamW, lr=LR, eps=EPS)
        tokens, targets = batches(plan.global_batch, plan.seq_len, STEPS, config.vocab)
        out[cid] = train_program(program, optimizer, tokens, targets)
        out[cid]["expected"] = dict(expected_collectives(plan, config, 0))
        out[cid]["shapes"] = {n: tuple(p.shape) for n, p in program.named_local_parameters()}
    return out


@pytest.fixture(scope="module")
def plans():
    found = {}
    for cid, (name, kwargs) in PARITY.items():
        kwargs = dict(kwargs)
        dp, tp, assignment = kwargs.pop("dp"), kwargs.pop("tp"), kwargs.pop("assignment", "replicate")
        found[cid] = make_plan(name, dp, tp, assignment, seq_len=SEQ, **kwargs)
    return found


@pytest.fixture(scope="module")
def results(plans):
    return spawn(_run_all, 2, list(plans.items()))


@pytest.mark.gloo
@pytest.mark.parametrize("cid", sorted(PARITY))
def test_matches_one_process(plans, results, cid):
    name, plan = PARITY[cid][0], plans[cid]
    config = get_model_config(name)
    tokens, targets = batches(plan.global_batch, plan.seq_len, STEPS, config.vocab)
    ref = reference(config, SEED, tokens, targets, LR, EPS)
    for rank, out in enumerate(results):
        assert_matches(out[cid], ref, f"{cid} rank {rank}")
        assert out[cid]["counts"] == out[cid]["expected"], f"{cid} rank {rank}"
    shapes = results[0][cid]["shapes"]
    strategies = {op.node: op.strategy for op in plan.ops}
    if cid.endswith("ep2"):  # half the experts on each rank, at their full ffn width
        assert shapes["layers.1.mlp.experts.w_gate"] == (config.experts // 2, config.expert_width, config.ffn_hidden)
        assert any(kind == "all_to_all" for kind, _ in results[0][cid]["counts"])
        return
    assert {s for n, s in strategies.items() if n.endswith("mlp_experts")} == {"ffn"}
    assert shapes["layers.1.mlp.experts.w_gate"] == (config.experts, config.expert_width, config.ffn_hidden // 2)
    if name == "tiny-deepseek":  # shared experts and the dense layer: Megatron's column / row
        assert strategies["layers_1_mlp_shared_gate_proj"] == "column"
        assert strategies["layers_1_mlp_shared_down_proj"] == "row"
        assert shapes["layers.0.mlp.gate_proj.weight"] == (config.dense_ffn_hidden // 2, config.hidden)
