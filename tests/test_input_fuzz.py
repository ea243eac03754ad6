"""Property: whatever a user feeds autoplan, the outcome is success or an AutoplanError, never another
exception and never a hang. Hypothesis mutates real inputs (a zoo model's config, cluster files, a plan
made by `estimate`, command lines): keys dropped or added, values replaced by wrong types, negative,
zero, fractional, huge, NaN or infinite numbers, numbers as strings, containers for scalars. Each goes
to its loader and through `autoplan.cli.main`, whose exit status must be 0, or 2 with one line on stderr.

Kept fast (tiny-gpt, clusters of 1-4 CPUs, bounded examples; the file runs in well under a minute) with
a per-example deadline, and an alarm that turns a hang into a failure.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import os
import signal
import warnings
from datetime import timedelta
from pathlib import Path

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from autoplan.api import estimate  # noqa: E402
from autoplan.cli import main  # noqa: E402
from autoplan.cluster import ClusterSpec, load_cluster_file  # noqa: E402
from autoplan.errors import AutoplanError  # noqa: E402
from autoplan.mesh import MeshShape  # noqa: E402
from autoplan.models import get_model_config, load_model_config  # noqa: E402
from autoplan.plan import Plan  # noqa: E402

HANG_S = 30  # an example still running after this long is a hang
SETTINGS = dict(deadline=timedelta(seconds=10), derandomize=True, suppress_health_check=[HealthCheck.too_slow])

# wrong types, bad numbers, and valid-looking values of the wrong size or meaning
BAD_VALUES = [None, True, False, 0, -1, 1.5, -0.5, 2**62, -(2**62), 1e308, float("nan"), float("inf"), -float("inf"),
              "7", "1e9", "x", "", [], [1], {}, {"a": 1}, 1, 2, 3, 4, 8, 64, 0.5, "llama", "moe", "h100", "tp",
              "S(0)", "S(9)", "P", "R", "full", "interleaved-1f1b", "all_reduce:output", ["R", True], 10**400]
BAD_WORDS = ["0", "-1", "1.5", "nan", "inf", "1e999", "abc", "", "99999999999999999999", "9" * 400, "1x0xcpu", "3x3xtpu",
             "1x3xcpu", "4x1xcpu", "--json", "-o", "tiny-llama", "gpt5"]


@contextlib.contextmanager
def no_hang(seconds: int = HANG_S):
    """Fail, instead of blocking the suite, when the body runs longer than `seconds` (SIGALRM, main thread)."""
    def alarm(signum, frame):
        raise TimeoutError(f"an input hung autoplan for over {seconds} s")

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def outcome(load, *args):
    """`load(*args)`, or the AutoplanError it raised; any other exception fails the test."""
    with no_hang(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return load(*args)
        except AutoplanError as exc:
            assert "\n" not in str(exc), f"a message of more than one line: {exc}"
            return exc


def run_cli(argv: list[str]) -> tuple[int, str]:
    """(exit status, stderr) of `autoplan <argv>`; the status must be 0, or 2 with one line on stderr."""
    out, err = io.StringIO(), io.StringIO()
    with no_hang(), warnings.catch_warnings(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        warnings.simplefilter("ignore")
        status = main(argv)
    text = err.getvalue()
    assert status in (0, 2), f"autoplan {' '.join(argv)} exited {status}:\n{text}"
    if status == 2:  # one line; under --debug the traceback comes first and the line last
        lines = text.splitlines()[-1:] if "--debug" in argv else text.splitlines()
        assert len(lines) == 1 and ": error: " in lines[0], f"autoplan {' '.join(argv)}:\n{text}"
    return status, text


# ------------------------------------------------------------------------------ mutations


def _paths(tree, prefix=()):
    """Every path into a JSON tree (the root too), keys and list indices."""
    yield prefix
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, list) else ()
    for key, child in items:
        yield from _paths(child, prefix + (key,))


def _apply(tree, path: tuple, op: str, value):
    """`tree` with the node at `path` replaced by `value`, deleted, or given an unknown key."""
    if not path:
        return value if op == "replace" else tree
    parent = tree
    for key in path[:-1]:
        parent = parent[key]
    last = path[-1]
    if op == "delete":
        del parent[last]
    elif op == "add" and isinstance(parent[last], dict):
        parent[last]["unknown_key"] = value
    else:
        parent[last] = value
    return tree


@st.composite
def mutated(draw, base: dict, max_changes: int = 3):
    """`base` (a JSON tree) after 1 to `max_changes` mutations at random places."""
    tree = copy.deepcopy(base)
    for _ in range(draw(st.integers(1, max_changes))):
        path = draw(st.sampled_from(list(_paths(tree))))
        tree = _apply(tree, path, draw(st.sampled_from(["replace", "replace", "delete", "add"])),
                      copy.deepcopy(draw(st.sampled_from(BAD_VALUES))))
    return tree


def _write(folder: Path, name: str, data, yaml_file: bool = False) -> Path:
    """`data` as a JSON (or YAML) file; JSON keeps NaN and Infinity, as Python writes them."""
    path = folder / name
    if yaml_file:
        import yaml

        path.write_text(yaml.safe_dump(data))
    else:
        path.write_text(json.dumps(data))
    return path


# ------------------------------------------------------------------------------ bases


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """A folder for the files, and the working directory meanwhile (a mutated `-o` writes relative paths)."""
    path = tmp_path_factory.mktemp("fuzz")
    before = os.getcwd()
    os.chdir(path)
    yield path
    os.chdir(before)


@pytest.fixture(scope="module")
def plan_json(folder) -> dict:
    """A real plan (and the imports, capture and solver paid once, before any deadline)."""
    plan = estimate("tiny-gpt", "1x2xcpu", 4, 32, mesh=MeshShape(dp=2), microbatch_size=1, zero_stage=1,
                    recompute="selective", dtype="float32")
    run_cli(["search", "--model", "tiny-gpt", "--cluster", "1x2xcpu", "--global-batch", "4", "--seq", "32", "--json"])
    run_cli(["explain", str(_write(folder, "warm.json", plan.to_json()))])
    return plan.to_json()


MODEL = get_model_config("tiny-gpt").to_json()
CLUSTERS = [{"nodes": 1, "gpus_per_node": 2, "device": "cpu"},
            {"num_nodes": 2, "gpus_per_node": 2, "name": "mine",
             "device": {"name": "gpu-x", "peak_flops": {"float32": 1e12, "bfloat16": 4e12}, "memory_bytes": 16e9,
                        "memory_bandwidth_bytes_per_s": 1e11},
             "intra_node": {"bandwidth_bytes_per_s": 1e10, "latency_s": 5e-6},
             "inter_node": {"bandwidth_bytes_per_s": 1e9, "latency_s": 1e-5}}]


# ------------------------------------------------------------------------------ properties


@settings(max_examples=150, **SETTINGS)
@given(data=mutated(MODEL), yaml_file=st.booleans())
def test_mutated_model_configs_load_or_say_why(folder, plan_json, data, yaml_file):
    path = _write(folder, "model.yaml" if yaml_file else "model.json", data, yaml_file)
    outcome(load_model_config, path)


@settings(max_examples=30, **SETTINGS)
@given(data=mutated(MODEL, max_changes=1), command=st.sampled_from(["search", "estimate"]))
def test_mutated_model_configs_through_the_cli(folder, plan_json, data, command):
    path = _write(folder, "cli-model.json", data)
    run_cli([command, "--model-config", str(path), "--cluster", "1x2xcpu", "--global-batch", "4", "--seq", "32"])


@settings(max_examples=150, **SETTINGS)
@given(data=st.sampled_from(CLUSTERS).flatmap(mutated), yaml_file=st.booleans())
def test_mutated_cluster_files_load_or_say_why(folder, plan_json, data, yaml_file):
    found = outcome(load_cluster_file, _write(folder, "cluster.yaml" if yaml_file else "cluster.json", data, yaml_file))
    assert isinstance(found, (ClusterSpec, AutoplanError))


@settings(max_examples=30, **SETTINGS)
@given(data=st.sampled_from(CLUSTERS).flatmap(lambda c: mutated(c, max_changes=1)))
def test_mutated_cluster_files_through_the_cli(folder, plan_json, data):
    path = _write(folder, "cli-cluster.json", data)
    run_cli(["search", "--model", "tiny-gpt", "--cluster", str(path), "--global-batch", "4", "--seq", "32"])


@settings(max_examples=200, **SETTINGS)
@given(data=st.data())
def test_mutated_plans_load_or_say_why(plan_json, data):
    found = outcome(Plan.from_json, data.draw(mutated(plan_json)))
    assert isinstance(found, (Plan, AutoplanError))


@settings(max_examples=60, **SETTINGS)
@given(data=st.data(), command=st.sampled_from(["show", "explain", "compare"]))
def test_mutated_plan_files_through_the_cli(folder, plan_json, data, command):
    path = str(_write(folder, "plan.json", data.draw(mutated(plan_json, max_changes=2))))
    run_cli([command, path] + ([path] if command == "compare" else []))


HF_CONFIGS = [
    {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
     "intermediate_size": 128, "num_hidden_layers": 2, "vocab_size": 128, "max_position_embeddings": 64,
     "rope_theta": 10000.0, "rms_norm_eps": 1e-6},
    {"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 128, "n_positions": 64,
     "n_inner": None},
    {"model_type": "mixtral", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
     "intermediate_size": 96, "num_hidden_layers": 2, "vocab_size": 128, "num_local_experts": 4,
     "num_experts_per_tok": 2},
]


def _hf_summary(path: Path):
    from autoplan.capture.hf import hf_model_config, hf_model_info, load_hf_config

    config = load_hf_config(path)
    return hf_model_config(config), hf_model_info(config)


@settings(max_examples=100, **SETTINGS)
@given(data=st.sampled_from(HF_CONFIGS).flatmap(mutated))
def test_mutated_hugging_face_configs_summarise_or_say_why(folder, plan_json, data):
    pytest.importorskip("transformers")
    outcome(_hf_summary, _write(folder, "config.json", data))


BASE_COMMANDS = [
    ["search", "--model", "tiny-gpt", "--cluster", "1x2xcpu", "--global-batch", "4", "--seq", "32", "--json"],
    ["estimate", "--model", "tiny-gpt", "--cluster", "1x2xcpu", "--global-batch", "4", "--seq", "32", "--tp", "2",
     "--json"],
    ["estimate", "--model", "tiny-moe", "--cluster", "1x4xcpu", "--global-batch", "4", "--seq", "32", "--ep", "2",
     "--tp", "2", "--etp", "1", "--zero", "0", "--json"],
    ["models"],
]


@st.composite
def command_lines(draw, words: list[str]):
    """A base command line with 1-3 of its words replaced, dropped, or followed by another word."""
    argv = list(draw(st.sampled_from(BASE_COMMANDS)))
    for _ in range(draw(st.integers(1, 3))):
        at = draw(st.integers(0, len(argv)))
        word = draw(st.sampled_from(words))
        op = draw(st.sampled_from(["replace", "drop", "insert"]))
        if op == "insert" or at == len(argv):
            argv.insert(at, word)
        elif op == "replace":
            argv[at] = word
        else:
            del argv[at]
    return argv


@settings(max_examples=100, **SETTINGS)
@given(data=st.data())
def test_mutated_command_lines_succeed_or_exit_2_with_one_line(folder, plan_json, data):
    binary = folder / "binary.json"
    binary.write_bytes(bytes(range(256)))
    (folder / "broken.json").write_text("{broken")
    words = BAD_WORDS + [str(folder), str(binary), str(folder / "broken.json"), str(folder / "missing.json"),
                         "--model-config", "--cluster", "--tp", "--mbs", "--zero", "--recompute", "--schedule", "-o",
                         "--virtual-stages", "--dtype", "--top", "--time-limit", "--profile", "--debug"]
    argv = data.draw(command_lines(words))
    run_cli(argv)
