"""Tier 1: every input is checked where it enters autoplan (`autoplan.validate`): the named cases of a bad
model config, cluster file, plan file, Hugging Face config, command line and public-API argument each raise
an AutoplanError (the CLI: one line on stderr, exit 2) that says what was given and what was expected."""

from __future__ import annotations

import json
import math
import re

import pytest

import autoplan
from autoplan.api import estimate, search_plans
from autoplan.cli import main
from autoplan.cluster import ClusterSpec, cluster_mismatch, load_cluster_file, parse_cluster
from autoplan.errors import AutoplanError, ConfigError, InfeasibleError, PlanError
from autoplan.mesh import MeshShape
from autoplan.models import get_model_config, load_model_config
from autoplan.models.config import MAX_LAYERS, ModelConfig
from autoplan.plan import Plan

TINY = ["--model", "tiny-gpt", "--cluster", "1x2xcpu", "--global-batch", "4", "--seq", "32"]


@pytest.fixture(scope="module")
def plan_json() -> dict:
    return estimate("tiny-gpt", "1x2xcpu", 4, 32, mesh=MeshShape(dp=2), microbatch_size=1, zero_stage=1,
                    recompute="none", dtype="float32").to_json()


def run_cli(argv, capsys) -> tuple[int, str, str]:
    status = main(argv)
    out, err = capsys.readouterr()
    return status, out, err


def assert_one_line_error(status: int, err: str, *fragments: str) -> None:
    assert status == 2, err
    assert err.count("\n") == 1 and err.endswith("\n") and ": error: " in err, err
    for fragment in fragments:
        assert fragment in err, (fragment, err)


# ------------------------------------------------------------------------------ model configs


def test_missing_field_and_wrong_types_are_refused_by_name(tmp_path):
    base = get_model_config("tiny-gpt").to_json()
    with pytest.raises(ConfigError, match=r"missing keys \['hidden'\]"):
        ModelConfig.from_json({k: v for k, v in base.items() if k != "hidden"})
    for key, value, expected in [("num_layers", "2", "integer"), ("num_layers", 1.5, "integer"),
                                 ("num_layers", True, "integer"), ("vocab", -3, "integer >= 1"),
                                 ("norm_eps", "1e-5", "finite number"), ("name", 7, "string")]:
        with pytest.raises(ConfigError, match=expected) as info:
            ModelConfig.from_json(base | {key: value})
        assert key in str(info.value) and repr(value) in str(info.value)


def test_rope_theta_infinity_is_refused(tmp_path):
    path = tmp_path / "m.json"
    path.write_text(json.dumps(get_model_config("tiny-llama").to_json() | {"rope_theta": math.inf}))
    assert "Infinity" in path.read_text()  # Python's json writes and reads it: the check must catch it
    with pytest.raises(ConfigError, match=r"rope_theta=inf: expected a finite number > 0"):
        load_model_config(path)


@pytest.mark.parametrize("name, text, fragment", [
    ("bad.json", "{not json", "not valid JSON"),
    ("bad.yaml", "family: [gpt,\n", "not valid YAML"),
    ("list.json", "[1, 2]", "holds list"),
    ("empty.yaml", "", "holds nothing"),
    ("deep.json", "[" * 100_000, "nested too deeply"),
])
def test_malformed_model_config_files_give_one_line(tmp_path, capsys, name, text, fragment):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError, match=fragment):
        load_model_config(path)
    status, _, err = run_cli(["search", "--model-config", str(path)] + TINY[2:], capsys)
    assert_one_line_error(status, err, fragment)


def test_a_folder_a_missing_file_or_a_binary_file_as_config(tmp_path, capsys):
    (tmp_path / "bin.json").write_bytes(bytes(range(256)))
    for path, fragment in [(tmp_path, "is a folder"), (tmp_path / "none.json", "does not exist"),
                           (tmp_path / "bin.json", "not UTF-8")]:
        status, _, err = run_cli(["estimate", "--model-config", str(path)] + TINY[2:], capsys)
        assert_one_line_error(status, err, fragment, str(path))


def test_a_model_too_deep_or_too_large_to_plan_is_refused_before_capture():
    base = get_model_config("tiny-llama").to_json()
    with pytest.raises(ConfigError, match="num_layers"):
        ModelConfig.from_json(base | {"num_layers": MAX_LAYERS + 1})
    with pytest.raises(ConfigError, match="parameters is more than autoplan plans"):
        ModelConfig.from_json(base | {"hidden": 2**40})


# ------------------------------------------------------------------------------ clusters


@pytest.mark.parametrize("change, fragment", [
    ({"nodes": 1.5}, "num_nodes=1.5: expected an integer"),
    ({"gpus_per_node": "2"}, "gpus_per_node='2'"),
    ({"gpus_per_node": True}, "gpus_per_node=True"),
    ({"device": 5}, "device"),
    ({"device": {"peak_flops": {"float32": "nan"}, "memory_bytes": 1e9, "memory_bandwidth_bytes_per_s": 1e9}},
     "peak_flops['float32']=nan"),
    ({"intra_node": {"bandwidth_bytes_per_s": 1e9, "latency_s": float("nan")}}, "latency_s=nan"),
    ({"nodes": 2**20, "gpus_per_node": 8}, "devices: expected at most"),
])
def test_cluster_file_numbers_are_checked_not_truncated(tmp_path, change, fragment):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"nodes": 1, "gpus_per_node": 2, "device": "cpu"} | change))
    with pytest.raises(ConfigError) as info:
        load_cluster_file(path)
    assert fragment in str(info.value)


def test_cluster_files_that_are_not_files(tmp_path, capsys):
    (tmp_path / "c.yaml").write_text("nodes: [1,\n")
    with pytest.raises(ConfigError, match="not valid YAML.*line"):
        parse_cluster(str(tmp_path / "c.yaml"))
    status, _, err = run_cli(["search", "--model", "tiny-gpt", "--cluster", str(tmp_path / "c.yaml"),
                              "--global-batch", "4", "--seq", "32"], capsys)
    assert_one_line_error(status, err, "not valid YAML")
    with pytest.raises(ConfigError, match="does not exist"):
        parse_cluster(str(tmp_path / "none.json"))


def test_a_plan_for_cpus_is_not_run_on_h100s(plan_json):
    plan = Plan.from_json(plan_json)
    assert cluster_mismatch(plan.cluster, parse_cluster("1x2xcpu")) is None
    assert "1 x 2 x h100" in cluster_mismatch(plan.cluster, parse_cluster("1x2xh100"))
    assert cluster_mismatch(plan.cluster, parse_cluster("2x1xcpu")) is not None  # same world size, other layout
    with pytest.raises(PlanError, match="made for 1 x 2 x cpu .* 1 x 2 x h100"):
        autoplan.parallelize(None, "1x2xh100", plan=plan)


# ------------------------------------------------------------------------------ plans


def _without(data: dict, *path: str) -> dict:
    data = json.loads(json.dumps(data))
    node = data
    for key in path[:-1]:
        node = node[key]
    del node[path[-1]]
    return data


def test_plan_numbers_are_checked(plan_json):
    for key, value, fragment in [("seq_len", -32, "seq_len=-32"), ("global_batch", 4.0, "global_batch=4.0"),
                                 ("zero_stage", True, "zero_stage=True"), ("version", True, "version True")]:
        with pytest.raises(PlanError, match=fragment):
            Plan.from_json(plan_json | {key: value})
    data = json.loads(json.dumps(plan_json))
    data["predicted"]["time_breakdown"]["compute_s"] = float("nan")
    with pytest.raises(PlanError, match="compute_s=nan"):
        Plan.from_json(data)


@pytest.mark.parametrize("path, fragment", [
    (("mesh", "tp"), r"mesh has missing keys \['tp'\]"),
    (("predicted", "time_breakdown", "compute_s"), r"time_breakdown has missing keys \['compute_s'\]"),
    (("model", "fingerprint"), r"model has missing keys \['fingerprint'\]"),
    (("provenance", "search_time_s"), r"provenance has missing keys \['search_time_s'\]"),
])
def test_a_plan_with_a_nested_key_missing_is_refused(plan_json, path, fragment):
    with pytest.raises(PlanError, match=fragment):
        Plan.from_json(_without(plan_json, *path))


def test_plan_files_through_the_cli(tmp_path, capsys, plan_json):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(_without(plan_json, "mesh", "tp")))
    for command in (["show", str(path)], ["explain", str(path)], ["compare", str(path), str(path)]):
        status, _, err = run_cli(command, capsys)
        assert_one_line_error(status, err, "missing keys ['tp']")
    status, _, err = run_cli(["show", str(tmp_path)], capsys)
    assert_one_line_error(status, err, "is a folder")


# ------------------------------------------------------------------------------ the command line


@pytest.mark.parametrize("flag, value", [("--tp", "0"), ("--mbs", "0"), ("--seq", "-3"), ("--global-batch", "1.5"),
                                         ("--virtual-stages", "two"), ("--dp", "0")])
def test_estimate_arguments_are_checked(capsys, flag, value):
    status, _, err = run_cli(["estimate"] + TINY + [flag, value], capsys)
    assert_one_line_error(status, err, f"argument {flag}", repr(value), "expected an integer >= 1")


@pytest.mark.parametrize("value", ["nan", "inf", "-1", "0"])
def test_search_time_limit_must_be_finite_and_positive(capsys, value):
    status, _, err = run_cli(["search"] + TINY + ["--time-limit", value], capsys)
    assert_one_line_error(status, err, "--time-limit", "finite number > 0")


def test_output_onto_a_folder_is_refused_before_any_work(tmp_path, capsys):
    for command in ("search", "estimate"):
        status, _, err = run_cli([command] + TINY + ["-o", str(tmp_path)], capsys)
        assert_one_line_error(status, err, "is a folder", "plan.json")
    (tmp_path / "file").write_text("x")
    status, _, err = run_cli(["search"] + TINY + ["-o", str(tmp_path / "file" / "plan.json")], capsys)
    assert_one_line_error(status, err, "file' is not a folder")
    with pytest.raises(PlanError, match="is a folder"):
        Plan.from_json(estimate("tiny-gpt", "1x2xcpu", 4, 32, mesh=MeshShape(dp=2), microbatch_size=1, zero_stage=1,
                                recompute="none").to_json()).save(tmp_path)


def test_debug_shows_the_traceback_of_an_error(capsys):
    argv = ["estimate", "--model", "tiny-gpt", "--cluster", "1x3xcpu", "--global-batch", "3", "--seq", "32", "--tp", "3"]
    status, _, err = run_cli(["--debug"] + argv, capsys)
    assert status == 2 and "Traceback" in err and err.strip().splitlines()[-1].startswith("autoplan estimate: error: tp=3")
    status, _, err = run_cli(argv + ["--debug"], capsys)
    assert status == 2 and "Traceback" in err
    status, _, err = run_cli(argv, capsys)
    assert_one_line_error(status, err, "tp=3 does not divide the attention heads")


def test_an_unexpected_error_shows_its_traceback_and_asks_for_a_report(capsys, monkeypatch):
    import autoplan.cli.commands as commands

    def broken(args):
        raise KeyError("a bug")

    monkeypatch.setattr(commands, "cmd_models", broken)
    status, _, err = run_cli(["models"], capsys)
    assert status == 1 and "Traceback" in err and "KeyError" in err and "please report it" in err


def test_train_arguments_are_checked_before_any_process_group(capsys, tmp_path):
    from autoplan.train import main as train_main

    for argv, fragment in [(["--lr", "nan"], "--lr"), (["--steps", "-1"], "--steps"),
                           (["--data", str(tmp_path / "none.txt")], "expected an existing file"),
                           (["--global-batch", "0"], "--global-batch")]:
        with pytest.raises(SystemExit) as info:
            train_main(["--model", "tiny-gpt"] + argv)
        err = capsys.readouterr().err
        assert info.value.code == 2 and err.count("\n") == 1 and fragment in err, err


# ------------------------------------------------------------------------------ the public API


@pytest.mark.parametrize("call, fragment", [
    (lambda: autoplan.search(123, "1x2xcpu", 4, 32), "autoplan.search: model=123"),
    (lambda: autoplan.search("tiny-gpt", 42, 4, 32), "autoplan.search: cluster=42"),
    (lambda: autoplan.search("tiny-gpt", "1x2xcpu", 4.0, 32), "global_batch=4.0"),
    (lambda: autoplan.search("tiny-gpt", "1x2xcpu", 4, 32, time_limit_s=float("nan")), "time_limit_s=nan"),
    (lambda: search_plans("tiny-gpt", "1x2xcpu", 4, 32, top="3"), "top='3'"),
    (lambda: estimate("tiny-gpt", "1x2xcpu", 4, 32, mesh=(1, 2), microbatch_size=1, zero_stage=1, recompute="none"),
     "mesh=(1, 2)"),
    (lambda: estimate("tiny-gpt", "1x2xcpu", 4, 32, mesh=MeshShape(dp=2), microbatch_size=1, zero_stage=True,
                      recompute="none"), "zero_stage=True"),
    (lambda: autoplan.parallelize(None, 42), "autoplan.parallelize: cluster=42"),
    (lambda: autoplan.parallelize(None, "1x2xcpu", plan=42), "autoplan.parallelize: plan=42"),
])
def test_wrong_types_to_the_public_api_are_refused_up_front(call, fragment):
    with pytest.raises(AutoplanError) as info:
        call()
    assert fragment in str(info.value) and "expected" in str(info.value)


# ------------------------------------------------------------------------------ Hugging Face configs

def _hf_file(tmp_path, data: dict):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    return path


LLAMA = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
         "intermediate_size": 128, "num_hidden_layers": 2, "vocab_size": 128, "max_position_embeddings": 64}


@pytest.mark.parametrize("model_type, fragment", [
    ("bert", "'bert' is an encoder-only"), ("t5", "'t5' is an encoder-decoder"),
])
def test_configs_autoplan_cannot_model_faithfully_are_refused_by_name(tmp_path, capsys, model_type, fragment):
    pytest.importorskip("transformers")
    from autoplan.capture.hf import load_hf_config

    path = _hf_file(tmp_path, {"model_type": model_type})
    with pytest.raises(ConfigError, match=fragment):
        load_hf_config(path)
    status, _, err = run_cli(["search", "--hf-config", str(path)] + TINY[2:], capsys)
    assert_one_line_error(status, err, fragment)


@pytest.mark.parametrize("change, fragment", [
    ({"hidden_size": None}, "hidden_size"), ({"num_hidden_layers": "2"}, "num_hidden_layers"),
    ({"num_hidden_layers": -1}, "num_hidden_layers=-1"), ({"rope_theta": float("inf")}, "rope_theta=inf"),
    ({"rope_theta": "fast"}, "rope_theta='fast'"), ({"model_type": ["llama"]}, "'model_type' string"),
])
def test_bad_hugging_face_fields_are_config_errors(tmp_path, change, fragment):
    pytest.importorskip("transformers")
    from autoplan.capture.hf import hf_model_config, load_hf_config

    with pytest.raises(ConfigError, match=fragment):
        hf_model_config(load_hf_config(_hf_file(tmp_path, LLAMA | change)))


def test_a_binary_hugging_face_config(tmp_path):
    pytest.importorskip("transformers")
    from autoplan.capture.hf import load_hf_config

    (tmp_path / "config.json").write_bytes(b"\x80\x81\x82" * 100)
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_hf_config(tmp_path)


# ------------------------------------------------------------------------------ hints that agree


def test_a_billion_token_sequence_is_not_told_a_few_more_gpus_would_do():
    with pytest.raises(InfeasibleError) as info:
        search_plans("gpt3-1.3b", "1x8xh100", 8, 10**9)
    message = str(info.value)
    assert "no number of h100 GPUs could work" in message and "shorter sequence" in message
    with pytest.raises(InfeasibleError, match=r"about \d+ GPUs") as info:
        search_plans("gpt3-1.3b", "1x8xh100", 8, 10**7)
    gpus = int(re.search(r"about (\d+) GPUs", str(info.value)).group(1))
    # the activations alone: 24 layers x 1e7 tokens x 2048 x 2 bytes, over 72 GB usable per GPU
    assert gpus >= 24 * 10**7 * 2048 * 2 / 72e9


@pytest.mark.parametrize("model, cluster, batch", [("tiny-gpt", "1x3xcpu", 3), ("tiny-llama", "1x6xh100", 6),
                                                   ("tiny-moe", "1x6xh100", 6)])
def test_search_returns_only_meshes_estimate_accepts(model, cluster, batch):
    result = search_plans(model, cluster, batch, 32, top=4, baselines=False, dtype="float32")
    config = get_model_config(model)
    for plan in result.plans:
        assert config.heads % plan.mesh.tp == 0 and config.kv_heads % plan.mesh.tp == 0
        estimate(model, cluster, batch, 32, mesh=plan.mesh, microbatch_size=plan.microbatch_size,
                 zero_stage=plan.zero_stage, recompute=plan.recompute, schedule=plan.schedule,
                 virtual_stages=max(1, len({s.chunk for s in plan.stages})), dtype="float32")


def test_cluster_spec_refuses_what_its_file_would():
    device = parse_cluster("1x1xcpu").device
    link = parse_cluster("1x1xcpu").intra_node
    with pytest.raises(ConfigError, match="num_nodes=1.5"):
        ClusterSpec(1.5, 2, device, link, link)


def test_plans_and_profiles_are_written_with_the_mode_a_plain_open_gives(tmp_path):
    """`validate.write_text_atomic` (plans, profiles, benchmark results): 0666 less the umask, as `open()` makes a file,
    where the temporary file it renames was 0600; the text whole."""
    import os

    from autoplan.validate import write_text_atomic

    old = os.umask(0o022)
    try:
        write_text_atomic(tmp_path / "sub" / "plan.json", "{}\n")
    finally:
        os.umask(old)
    written = tmp_path / "sub" / "plan.json"
    assert written.read_text() == "{}\n" and (written.stat().st_mode & 0o777) == 0o644
    assert [p.name for p in written.parent.iterdir()] == ["plan.json"]  # no temporary left
