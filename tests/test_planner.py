"""The planner end to end: GPT-3 175B on 1024 H100s on paper (tier 2), plus small cases."""

from __future__ import annotations

import json
import random
import re

import pytest

from autoplan.cluster import parse_cluster
from autoplan.errors import InfeasibleError
from autoplan.mesh import MeshShape
from autoplan.models import get_model_config
from autoplan.plan import Plan
from autoplan.api import capture_model, estimate, plan_from_assignment, search
from autoplan.solver.intra_op import megatron_assignment
from autoplan.strategies import default_registry

GPT3 = dict(model="gpt3-175b", cluster="128x8xh100", global_batch=1536, seq_len=2048)


@pytest.fixture(scope="module")
def gpt3_plan() -> Plan:
    return search(**GPT3)


def _without_time(plan: Plan) -> str:
    data = plan.to_json()
    data["provenance"]["search_time_s"] = 0.0
    return json.dumps(data, sort_keys=True)


def test_gpt3_plan_uses_every_gpu_and_fits(gpt3_plan):
    plan = gpt3_plan
    assert plan.mesh.world_size == 1024 == plan.mesh.pp * plan.mesh.dp * plan.mesh.tp * plan.mesh.cp * plan.mesh.ep
    assert plan.microbatch_size * plan.num_microbatches * plan.mesh.dp == 1536
    assert plan.predicted.peak_memory_bytes < 80e9
    assert plan.predicted.peak_memory_bytes == pytest.approx(plan.predicted.memory.total_bytes())
    assert plan.predicted.step_time_s == pytest.approx(plan.predicted.time.total_s())
    assert 0.05 < plan.predicted.mfu < 0.8
    assert plan.predicted.tokens_per_s == pytest.approx(1536 * 2048 / plan.predicted.step_time_s)
    # tp = 1 leaves every op one strategy: the intra-op solve is "trivial"
    assert plan.provenance.solver in ("highs", "cbc", "elimination") or (plan.mesh.tp, plan.provenance.solver) == (1, "trivial")
    assert plan.provenance.search_time_s > 0


def test_gpt3_plan_is_at_least_as_fast_as_the_baselines(gpt3_plan):
    """The baselines are points of the search space, priced by the same model: the plan never loses."""
    ratios = {m.group(1): float(m.group(2)) for note in gpt3_plan.provenance.notes
              if (m := re.match(r"baseline (\w+): .*this plan has ([\d.]+)x its throughput", note))}
    assert ratios["megatron"] >= 1.0
    assert len(gpt3_plan.stages) >= gpt3_plan.mesh.pp and gpt3_plan.schedule in ("1f1b", "interleaved-1f1b")
    assert (gpt3_plan.predicted.time.bubble_s > 0) == (gpt3_plan.mesh.pp > 1)
    # the runtime shards ZeRO-2/3 over dp only without pp or ep: the search stays inside what runs
    assert gpt3_plan.zero_stage <= 1 or (gpt3_plan.mesh.pp == 1 and gpt3_plan.mesh.ep == 1)


def test_gpt3_plan_round_trips_through_json(gpt3_plan, tmp_path):
    assert Plan.from_json(json.loads(gpt3_plan.dumps())) == gpt3_plan
    gpt3_plan.save(tmp_path / "plan.json")
    assert Plan.load(tmp_path / "plan.json") == gpt3_plan


def test_search_is_deterministic(gpt3_plan):
    assert _without_time(search(**GPT3)) == _without_time(gpt3_plan)


def test_gpt3_plan_shards_the_layers(gpt3_plan):
    """175B parameters do not fit one H100: the plan splits most weights over tp, or over dp (ZeRO-3)."""
    axis = "tp" if gpt3_plan.mesh.tp > 1 else "dp"
    if axis == "tp":
        assert {"column", "heads"} <= {op.strategy for op in gpt3_plan.ops}
    else:
        assert gpt3_plan.zero_stage == 3
    sharded = [p for p in gpt3_plan.params if str(dict(p.placements)[axis]) != "R"]
    assert len(sharded) > 0.5 * len(gpt3_plan.params)


def test_tp8_strategies_are_megatron_like():
    config = get_model_config("gpt3-175b")
    graph = capture_model(config, 2048)
    plan = estimate(config, "128x8xh100", 1536, 2048, mesh=MeshShape(dp=128, tp=8), microbatch_size=1,
                    zero_stage=1, recompute="selective", graph=graph)
    by_path = {n.module_path: plan.op(n.name).strategy for n in graph.nodes if n.layer == 5}
    for proj in ("q_proj", "k_proj", "v_proj", "mlp.fc"):
        assert by_path[f"layers.5.{proj}" if proj == "mlp.fc" else f"layers.5.attn.{proj}"] == "column"
    assert by_path["layers.5.attn.o_proj"] in ("row", "row_sp")
    assert by_path["layers.5.mlp.proj"] in ("row", "row_sp")
    assert by_path["layers.5.attn.core"] == "heads"
    # the search's own pick is at least as fast as Megatron's hand assignment on the same mesh
    megatron = plan_from_assignment(graph, config, parse_cluster("128x8xh100"), MeshShape(dp=128, tp=8),
                                    megatron_assignment(graph, default_registry(), 8, config.rule_info()),
                                    1, 12, 1, "selective")
    assert plan.predicted.step_time_s <= megatron.predicted.step_time_s * (1 + 1e-9)


def test_model_too_big_for_a_tiny_cluster_says_by_how_much():
    with pytest.raises(InfeasibleError) as err:
        search("gpt3-6.7b", "1x1xa100", 8, 2048)
    message = str(err.value)
    assert "GB per GPU" in message and "80.0 GB" in message and "over" in message
    assert "more GPUs" in message


def test_small_search_reports_progress_and_notes():
    messages: list[str] = []
    plan = search("tiny-llama", "1x4xh100", 16, 64, progress=messages.append)
    assert plan.mesh.world_size == 4
    assert any("ILP" in m for m in messages) and any("capturing" in m for m in messages)
    assert any("searched" in note for note in plan.provenance.notes)
    assert any(note.startswith("baseline megatron") for note in plan.provenance.notes)


def test_plans_from_megatron_and_random_assignments():
    config = get_model_config("tiny-gpt")
    graph = capture_model(config, 32)
    registry, info, cluster = default_registry(), config.rule_info(), parse_cluster("1x4xcpu")
    mesh = MeshShape(dp=2, tp=2)
    megatron = megatron_assignment(graph, registry, 2, info)
    assert megatron["layers_0_attn_q_proj"] == "column" and megatron["layers_0_mlp_proj"] == "row"
    assert megatron["layers_0_attn_core"] == "heads" and megatron["tok_emb"] == "vocab"
    assert megatron["loss"] == "vocab" and megatron["gelu"] == "features" and megatron["lm_head"] == "column"
    plan = plan_from_assignment(graph, config, cluster, mesh, megatron, 2, 2, 3, "full")
    assert plan.param_placement("layers.0.attn.q_proj.weight", "tp") == plan.param_placement("lm_head.weight", "tp")
    assert str(plan.param_placement("layers.0.mlp.proj.weight", "tp")) == "S(1)"
    assert str(plan.param_placement("layers.0.mlp.proj.weight", "dp")) == "S(0)"  # ZeRO-3
    rng = random.Random(0)
    for _ in range(3):
        assignment = {n.name: rng.choice(registry.strategies(n, 2, info)).name for n in graph.nodes}
        plan = plan_from_assignment(graph, config, cluster, mesh, assignment, 1, 4, 0, "none")
        assert Plan.from_json(plan.to_json()) == plan
        assert all(plan.op(name).strategy == chosen for name, chosen in assignment.items())


def test_ops_no_rule_can_shard_are_named_in_the_plan_notes():
    """An op with work that stays whole on every tp rank is listed with its count and FLOP share."""
    from autoplan.api import estimate
    from autoplan.mesh import MeshShape
    from autoplan.models import get_model_config
    from autoplan.strategies import default_registry, replicate_only

    kwargs = dict(mesh=MeshShape(tp=2), microbatch_size=8, zero_stage=0, recompute="none", dtype="float32")
    plan = estimate("tiny-llama", "1x2xcpu", 8, 32, **kwargs)
    assert not [n for n in plan.provenance.notes if "left replicated" in n]  # every op of the zoo shards
    registry = default_registry()
    registry.register("norm", replicate_only)  # as if norms had no sharding rule
    plan = estimate("tiny-llama", "1x2xcpu", 8, 32, registry=registry, **kwargs)
    note = next(n for n in plan.provenance.notes if "left replicated" in n)
    layers = get_model_config("tiny-llama").num_layers
    assert f"left replicated at tp=2 (no sharding rule applies to them): {2 * layers + 1} x norm" in note
    assert "% of forward FLOPs" in note
