"""Tier 1: core value types (placements, mesh, cluster specs, plans) and their errors."""

from __future__ import annotations

import json

import pytest

from autoplan.cluster import ClusterSpec, load_cluster_file, parse_cluster, preset
from autoplan.errors import ConfigError, PlanError
from autoplan.mesh import MeshShape
from autoplan.placement import Partial, Replicate, Shard, parse_placement
from autoplan.plan import (
    MemoryBreakdown,
    ModelRef,
    OpPlacement,
    ParamPlacement,
    Plan,
    Predicted,
    Provenance,
    StageSpec,
    TimeBreakdown,
)


# ------------------------------------------------------------------------------ placements


@pytest.mark.parametrize("placement", [Shard(0), Shard(2), Shard(-1), Replicate(), Partial()])
def test_placement_string_round_trip(placement):
    assert parse_placement(str(placement)) == placement


def test_placement_short_forms():
    assert [str(p) for p in (Shard(1), Replicate(), Partial())] == ["S(1)", "R", "P"]


@pytest.mark.parametrize("text", ["S0", "X", "S(a)", ""])
def test_bad_placement_names_the_accepted_forms(text):
    with pytest.raises(ConfigError, match=r"'S\(<dim>\)'"):
        parse_placement(text)


# ------------------------------------------------------------------------------ mesh


def test_mesh_rank_layout_is_row_major_with_tp_innermost():
    mesh = MeshShape(pp=2, dp=2, tp=2)
    assert mesh.world_size == 8
    assert mesh.coords(5) == {"pp": 1, "dp": 0, "ep": 0, "cp": 0, "tp": 1}
    assert mesh.group_of(5, "tp") == (4, 5)
    assert mesh.group_of(5, "dp") == (5, 7)
    assert mesh.group_of(5, "pp") == (1, 5)
    for rank in range(8):
        assert mesh.rank_of(mesh.coords(rank)) == rank


def test_mesh_groups_partition_the_ranks():
    mesh = MeshShape(dp=4, tp=2, cp=2)
    for axis in ("dp", "tp", "cp"):
        groups = mesh.groups(axis)
        assert sorted(r for g in groups for r in g) == list(range(16))
        assert all(len(g) == mesh.degree(axis) for g in groups)


def test_mesh_nodes_spanned():
    mesh = MeshShape(dp=128, tp=8)
    assert mesh.nodes_spanned("tp", 8) == 1
    assert mesh.nodes_spanned("dp", 8) == 128
    assert MeshShape(dp=4, tp=4).nodes_spanned("tp", 2) == 2


def test_mesh_rejects_bad_degrees_and_order():
    with pytest.raises(ConfigError, match="tp=0"):
        MeshShape(tp=0)
    with pytest.raises(ConfigError, match="exactly once"):
        MeshShape(order=("pp", "dp", "tp"))


def test_mesh_json_round_trip():
    mesh = MeshShape(pp=4, dp=8, tp=8, order=("dp", "pp", "ep", "cp", "tp"))
    assert MeshShape.from_json(json.loads(json.dumps(mesh.to_json()))) == mesh


def test_mesh_expert_tp_defaults_to_tp_and_round_trips():
    folded = MeshShape(dp=2, ep=2, tp=4, etp=1)
    assert MeshShape.from_json(json.loads(json.dumps(folded.to_json()))) == folded
    assert folded.to_json()["etp"] == 1 and str(folded) == "dp2 x ep2 x tp4 (etp1)"
    assert (folded.expert_axes, folded.expert_parallel) == (("ep", "tp"), 8)
    default = MeshShape(dp=2, ep=2, tp=4)
    assert default.etp == 4 and default == MeshShape(dp=2, ep=2, tp=4, etp=4)
    assert "etp" not in default.to_json() and str(default) == "dp2 x ep2 x tp4"  # files as before
    assert (default.expert_axes, default.expert_parallel) == (("ep",), 2)
    old = {"pp": 1, "dp": 2, "tp": 4, "cp": 1, "ep": 2, "order": ["pp", "dp", "ep", "cp", "tp"]}
    assert MeshShape.from_json(old).etp == 4  # a plan written before etp existed


@pytest.mark.parametrize("etp,match", [
    (3, r"mesh etp=3 must be a positive divisor of tp=4 .*use one of \[1, 2, 4\]"),
    (0, "mesh etp=0 must be a positive divisor of tp=4"),
])
def test_mesh_refuses_expert_tp_it_cannot_run(etp, match):
    with pytest.raises(ConfigError, match=match):
        MeshShape(tp=4, etp=etp)


# ------------------------------------------------------------------------------ cluster


def test_cluster_shorthand():
    cluster = parse_cluster("128x8xh100")
    assert (cluster.num_nodes, cluster.gpus_per_node, cluster.world_size) == (128, 8, 1024)
    assert cluster.device.memory_bytes == 80e9
    assert cluster.device.peak_flops_for("bfloat16") == pytest.approx(989.4e12)
    assert parse_cluster("8xh200").world_size == 8
    assert parse_cluster("2x8xA100").device.name == "a100-80g"


@pytest.mark.parametrize("text", ["128-8-h100", "x8xh100", "h100x8", "128x8x"])
def test_malformed_cluster_shows_the_form_and_an_example(text):
    with pytest.raises(ConfigError, match=r"NODESxGPUSxDEVICE \(e\.g\. 128x8xh100\)"):
        parse_cluster(text)


def test_unknown_device_lists_known_ones():
    with pytest.raises(ConfigError, match="a100-80g, cpu, h100, h200"):
        parse_cluster("4x8xtpu9")


def test_cluster_json_round_trip():
    cluster = parse_cluster("16x8xh200")
    assert ClusterSpec.from_json(json.loads(json.dumps(cluster.to_json()))) == cluster


def test_cluster_yaml_file(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text(
        "nodes: 4\ngpus_per_node: 4\n"
        "device:\n  name: gpu-x\n  peak_flops: {bfloat16: 5e14}\n  memory_bytes: 48e9\n"
        "  memory_bandwidth_bytes_per_s: 1.5e12\n"
        "intra_node: {bandwidth_bytes_per_s: 1e11, latency_s: 5e-6}\n"
        "inter_node: {bandwidth_bytes_per_s: 1.25e10, latency_s: 1e-5}\n"
    )
    cluster = load_cluster_file(path)
    assert cluster.world_size == 16 and cluster.name == "mine"
    assert cluster.device.peak_flops_for("bfloat16") == 5e14
    assert cluster.device.memory_bytes == 48e9
    assert parse_cluster(str(path)) == cluster


def test_cluster_file_with_preset_device_inherits_links(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"num_nodes": 2, "gpus_per_node": 8, "device": "h100"}))
    cluster = parse_cluster(str(path))
    assert cluster.inter_node == preset("h100").inter_node


def test_cluster_file_errors_name_the_key(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"num_nodes": 2, "gpus_per_node": 8, "device": "h100", "speed": 3}))
    with pytest.raises(ConfigError, match=r"unknown keys \['speed'\]"):
        parse_cluster(str(path))
    path.write_text(json.dumps({"num_nodes": 2, "gpus_per_node": 8, "device": {"name": "g", "peak_flops": {"bfloat16": 1e14},
                                                                              "memory_bytes": "lots", "memory_bandwidth_bytes_per_s": 1e12}}))
    with pytest.raises(ConfigError, match="memory_bytes='lots': expected a number"):
        parse_cluster(str(path))


# ------------------------------------------------------------------------------ plan


def make_plan(**overrides) -> Plan:
    cluster = parse_cluster("2x4xh100")
    fields = dict(
        model=ModelRef("tiny-gpt", "0123456789abcdef", 2, 123456),
        cluster=cluster,
        mesh=MeshShape(dp=2, tp=4),
        microbatch_size=2,
        num_microbatches=4,
        global_batch=16,
        seq_len=64,
        zero_stage=1,
        recompute="selective",
        schedule="1f1b",
        stages=(StageSpec(0, 0, 2),),
        params=(ParamPlacement("layers.0.attn.q_proj.weight", (("tp", Shard(0)), ("dp", Replicate()))),),
        ops=(OpPlacement("layers_0_attn_q_proj", "column", (("tp", Shard(2)), ("dp", Shard(0)))),),
        predicted=Predicted(0.123456789, 0.4123, 1.5e5, 3.3e9, MemoryBreakdown(1e9, 1e9, 1e9, 3e8, 1.0 / 3.0), TimeBreakdown(0.1, 0.01, 0.0, 0.013456789)),
        provenance=Provenance("0.1.0", 1.25, "HiGHS", ("node x replicated: no sharding rule",)),
    )
    fields.update(overrides)
    return Plan(**fields)


def test_plan_json_round_trip_is_exact(tmp_path):
    plan = make_plan()
    text = plan.dumps()
    assert Plan.from_json(json.loads(text)) == plan
    path = tmp_path / "plan.json"
    plan.save(path)
    assert Plan.load(path) == plan
    assert Plan.load(path).dumps() == text


def test_plan_with_expert_tp_round_trips_and_old_plans_load():
    plan = make_plan(mesh=MeshShape(dp=2, tp=4, etp=1))
    data = json.loads(plan.dumps())
    assert data["mesh"]["etp"] == 1 and Plan.from_json(data) == plan
    del data["mesh"]["etp"]  # as a plan file written before etp: the experts then split like tp
    assert Plan.from_json(data).mesh.etp == 4 and Plan.from_json(data) == make_plan()


def test_plan_names_its_recompute_policy_and_version_2_plans_load():
    """Version 3 writes the policy's name and no node list; a version 2 plan's node list is dropped and
    its policy name kept; a layer count beyond the model's is refused with the largest that works."""
    plan = make_plan(recompute="full:1")
    data = json.loads(plan.dumps())
    assert data["version"] == 3 and data["recompute"] == "full:1" and "recompute_nodes" not in data
    assert Plan.from_json(data) == plan
    old = json.loads(make_plan().dumps()) | {"version": 2, "recompute_nodes": ["layers_0_attn_core", "gelu"]}
    assert Plan.from_json(old) == make_plan()
    with pytest.raises(PlanError, match=r"recompute 'full:3' names 3 layers but the model has 2; use at most 'full:2'"):
        make_plan(recompute="full:3")


def test_plan_has_the_documented_keys():
    data = make_plan().to_json()
    for key in ("version", "model", "cluster", "mesh", "microbatch_size", "num_microbatches", "global_batch", "seq_len",
                "zero_stage", "recompute", "schedule", "stages", "placements", "predicted"):
        assert key in data
    assert set(data["mesh"]) >= {"pp", "dp", "tp", "cp", "ep"}
    assert set(data["predicted"]) >= {"step_time_s", "mfu", "tokens_per_s", "peak_memory_bytes", "memory_breakdown", "time_breakdown"}
    assert set(data["predicted"]["time_breakdown"]) == {"compute_s", "communication_s", "bubble_s", "optimizer_s"}
    assert data["placements"]["parameters"]["layers.0.attn.q_proj.weight"] == {"tp": "S(0)", "dp": "R"}


def test_plan_lookups():
    plan = make_plan()
    assert plan.param_placement("layers.0.attn.q_proj.weight", "tp") == Shard(0)
    assert plan.param_placement("unknown", "tp") == Replicate()
    assert plan.op("layers_0_attn_q_proj").strategy == "column"
    assert plan.op("nope") is None


def test_plan_validation_names_the_values():
    with pytest.raises(PlanError, match="mesh dp2 x tp2 has 4 ranks but the cluster .* has 8"):
        make_plan(mesh=MeshShape(dp=2, tp=2))
    with pytest.raises(PlanError, match=r"global_batch 15 != microbatch_size 2 x num_microbatches 4 x dp 2"):
        make_plan(global_batch=15)
    with pytest.raises(PlanError, match="recompute 'some'"):
        make_plan(recompute="some")
    with pytest.raises(PlanError, match="cover layers"):
        make_plan(stages=(StageSpec(0, 0, 1),))


def test_plan_load_errors(tmp_path):
    path = tmp_path / "p.json"
    with pytest.raises(PlanError, match="does not exist"):
        Plan.load(path)
    path.write_text("{not json")
    with pytest.raises(PlanError, match="not valid JSON"):
        Plan.load(path)
    data = make_plan().to_json()
    data["version"] = 99
    with pytest.raises(PlanError, match="version 99 is not supported"):
        Plan.from_json(data)


def test_plan_save_is_atomic_and_keeps_the_old_file_on_failure(tmp_path, monkeypatch):
    path = tmp_path / "plan.json"
    plan = make_plan()
    plan.save(path)
    before = path.read_text()

    def boom(self):
        raise RuntimeError("disk full")

    monkeypatch.setattr(Plan, "dumps", boom)
    with pytest.raises(RuntimeError):
        plan.save(path)
    assert path.read_text() == before
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]
