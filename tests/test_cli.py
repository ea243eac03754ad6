"""The `autoplan` command line: search writes a valid plan, show reads it, bad input exits 2 with a hint."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from autoplan.cli import main
from autoplan.plan import Plan


def test_search_writes_a_plan_and_show_reads_it(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["search", "--model", "tiny-gpt", "--cluster", "1x4xh100", "--global-batch", "8", "--seq", "32", "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "step time" in printed and "MFU" in printed and "memory per GPU" in printed
    plan = Plan.load(out)
    assert plan.mesh.world_size == 4 and plan.global_batch == 8 and plan.seq_len == 32
    assert main(["show", str(out)]) == 0
    assert "tiny-gpt" in capsys.readouterr().out


def test_search_json_goes_to_stdout(capsys):
    assert main(["search", "--model", "tiny-llama", "--cluster", "2xh100", "--global-batch", "4", "--seq", "16", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert Plan.from_json(data).model.name == "tiny-llama"


def test_model_config_file(tmp_path, capsys):
    path = tmp_path / "mine.yaml"
    path.write_text("family: llama\nlayers: 2\nhidden: 64\nheads: 4\nkv_heads: 2\nffn_hidden: 128\nvocab: 256\nmax_seq: 64\n")
    assert main(["search", "--model-config", str(path), "--cluster", "2xh100", "--global-batch", "4", "--seq", "32", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model"]["name"] == "mine"


def test_unknown_model_lists_known_ones(capsys):
    assert main(["search", "--model", "gpt5", "--cluster", "8xh100", "--global-batch", "8", "--seq", "128"]) == 2
    err = capsys.readouterr().err
    assert "gpt5" in err and "gpt3-175b" in err and "llama3-8b" in err


def test_malformed_cluster_shows_the_form(capsys):
    assert main(["search", "--model", "tiny-gpt", "--cluster", "eight-h100s", "--global-batch", "8", "--seq", "32"]) == 2
    assert "128x8xh100" in capsys.readouterr().err


def test_model_too_big_says_by_how_much(capsys):
    assert main(["search", "--model", "gpt3-175b", "--cluster", "1x8xa100", "--global-batch", "8", "--seq", "2048"]) == 2
    err = capsys.readouterr().err
    assert "GB" in err and "ZeRO" in err


def test_show_refuses_a_corrupt_plan(tmp_path, capsys):
    path = tmp_path / "bad.json"
    path.write_text('{"version": 1}')
    assert main(["show", str(path)]) == 2
    assert "missing keys" in capsys.readouterr().err


def test_models_lists_presets(capsys):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert "gpt3-175b" in out and "mixtral-8x7b" in out


def test_console_script_runs_as_module():
    result = subprocess.run([sys.executable, "-m", "autoplan", "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "search" in result.stdout


@pytest.mark.parametrize("argv", [["search"], ["show"]])
def test_missing_arguments_are_usage_errors(argv, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "required" in err and "--help" in err


def test_search_plans_a_hugging_face_config(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                                      intermediate_size=256, vocab_size=512, max_position_embeddings=256)
    config.save_pretrained(tmp_path)
    with pytest.warns(UserWarning, match="without a sharding rule"):
        assert main(["search", "--hf-config", str(tmp_path), "--cluster", "1x4xh100", "--global-batch", "8", "--seq", "128", "--json"]) == 0
    plan = Plan.from_json(json.loads(capsys.readouterr().out))
    assert plan.mesh.world_size == 4 and plan.model.num_layers == 2


def test_profile_of_another_device_is_refused(tmp_path, capsys):
    from autoplan.profiler.profile import GemmSample, HardwareProfile, MemorySample

    profile = HardwareProfile(device_name="NVIDIA A100-SXM4-80GB", device_kind="cuda", memory_bytes=80_000_000_000, threads=1,
                              torch_version="2.13.0", created="2026-11-21", gemm=(GemmSample(1024, 1024, 1024, "bfloat16", 1e-5),),
                              memory=MemorySample(2**30, 1e-3), collective_backend="nccl")
    path = tmp_path / "a100.json"
    profile.save(path)
    argv = ["estimate", "--model", "tiny-gpt", "--cluster", "1x8xh100", "--tp", "2", "--global-batch", "8", "--seq", "32",
            "--profile", str(path)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "A100" in err and "h100" in err.lower()


def test_estimate_takes_the_experts_tensor_parallel_degree(tmp_path, capsys):
    out = tmp_path / "plan.json"
    argv = ["estimate", "--model", "tiny-moe", "--cluster", "1x4xh100", "--tp", "2", "--ep", "2", "--global-batch", "8",
            "--seq", "32", "--zero", "0"]
    assert main(argv + ["--etp", "1", "-o", str(out)]) == 0
    assert "etp=1" in capsys.readouterr().out  # the summary shows it where it differs from tp
    plan = Plan.load(out)
    assert (plan.mesh.tp, plan.mesh.ep, plan.mesh.etp) == (2, 2, 1)
    assert main(argv + ["--etp", "3"]) == 2
    assert "etp=3 must be a positive divisor of tp=2" in capsys.readouterr().err


def test_estimate_takes_what_the_ep_ranks_are(tmp_path, capsys):
    out = tmp_path / "plan.json"
    argv = ["estimate", "--model", "mixtral-8x7b", "--cluster", "1x8xh100", "--ep", "4", "--dp", "2", "--global-batch",
            "4", "--seq", "8192", "--mbs", "2", "--recompute", "full", "--ep-as", "cp"]
    assert main(argv + ["-o", str(out)]) == 0
    assert "ep_as=cp" in capsys.readouterr().out
    plan = Plan.load(out)
    assert (plan.mesh.dp, plan.mesh.ep, plan.mesh.ep_as, plan.mesh.context_parallel) == (2, 4, "cp", 4)
    argv[argv.index("--seq") + 1] = "8194"  # not divisible over the 4 context-parallel ranks
    assert main(argv) == 2
    assert "sequence 8194 is not divisible by tp x cp x ep = 4" in capsys.readouterr().err


def test_estimate_takes_the_layers_of_each_stage(tmp_path, capsys):
    out = tmp_path / "plan.json"
    argv = ["estimate", "--model", "gpt3-1.3b", "--cluster", "1x8xh100", "--pp", "4", "--dp", "2",
            "--global-batch", "16", "--seq", "2048", "--schedule", "interleaved-1f1b", "--virtual-stages", "2"]
    assert main(argv + ["--stage-layers", "2,3*6,4", "-o", str(out)]) == 0  # 24 layers over pp 4 x v 2 chunks
    assert Plan.load(out).stage_layers == (2, 3, 3, 3, 3, 3, 3, 4)
    assert main(argv + ["--stage-layers", "3*7"]) == 2
    assert "stage layers 3*7 (7 chunks, 21 layers) must list pp x v = 4 x 2 = 8" in capsys.readouterr().err
    assert main(argv + ["--stage-layers", "3,x"]) == 2  # a usage error: one line, exit 2
    assert "'x' in '3,x' is not N or N*K" in capsys.readouterr().err


# ------------------------------------------------------------------ --hf-model: a local checkpoint


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """A 2-layer Llama written by `python -m autoplan.examples.tiny_hf` (config.json + safetensors)."""
    pytest.importorskip("transformers")
    from autoplan.examples.tiny_hf import main as tiny_hf

    out = tmp_path_factory.mktemp("hf") / "tiny"
    assert tiny_hf([str(out), "--layers", "2", "--hidden", "256", "--vocab", "128"]) == 0
    return out


HF_SEARCH = ["--cluster", "1x4xcpu", "--global-batch", "8", "--seq", "32", "--dtype", "float32"]


def test_search_hf_model_plans_what_the_module_runtime_runs(tiny_checkpoint, tmp_path, capsys):
    from autoplan.api import hf_model_on_meta
    from autoplan.capture.hf import hf_model_config, load_hf_config
    from autoplan.runtime.module_launch import check_module_plan

    found = {}
    for flag in ("--hf-config", "--hf-model"):
        top = tmp_path / flag.strip("-")
        assert main(["search", flag, str(tiny_checkpoint), *HF_SEARCH, "--top", "6", "--save-top", str(top)]) == 0
        found[flag] = [Plan.load(p) for p in sorted(top.glob("plan-*.json"))]
    assert "plan written" not in capsys.readouterr().out  # no -o given
    # the module runtime runs no context parallelism: its search offers none
    assert found["--hf-model"] and all(p.mesh.cp == 1 for p in found["--hf-model"])
    model = hf_model_on_meta(tiny_checkpoint)
    for plan in found["--hf-model"]:
        assert plan.model.fingerprint == hf_model_config(load_hf_config(tiny_checkpoint)).fingerprint()
        assert any("runtime for your own module" in n for n in plan.provenance.notes)
        check_module_plan(plan, model, plan.cluster)  # raises if the runtime would refuse it


def test_search_hf_model_skips_plans_the_runtime_refuses(tmp_path, capsys):
    """Dropout under tp is refused by the module runtime: a batch of 1 leaves only tp."""
    pytest.importorskip("transformers")
    from autoplan.examples.tiny_hf import tiny_llama_config

    config = tiny_llama_config(layers=2, hidden=64, vocab=128)
    config.attention_dropout = 0.1
    config.save_pretrained(tmp_path)
    argv = ["search", "--hf-model", str(tmp_path), *HF_SEARCH]
    assert main(argv) == 0  # dp plans run
    argv[argv.index("--global-batch") + 1] = "1"
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "none of the best plans runs on the module runtime" in err and "dropout under tensor parallelism" in err


def test_estimate_hf_model_prices_any_configuration_and_says_what_cannot_run(tiny_checkpoint, tmp_path, capsys):
    out = tmp_path / "plan.json"
    argv = ["estimate", "--hf-model", str(tiny_checkpoint), *HF_SEARCH, "--tp", "2", "--zero", "0",
            "--recompute", "none"]
    assert main(argv + ["-o", str(out)]) == 0
    assert "cannot run" not in capsys.readouterr().err
    plan = Plan.load(out)
    assert plan.mesh.tp == 2 and plan.model.name == f"hf-{tiny_checkpoint.name}"
    assert any(op.node.startswith("model_layers_0_self_attn_q_proj") for op in plan.ops)  # the HF graph's ops
    assert main(argv + ["--pp", "2", "--dp", "1"]) == 0
    assert "cannot run" not in capsys.readouterr().err  # pipelines run too
    assert main(argv + ["--cp", "2", "--dp", "1"]) == 0
    assert "cannot run" not in capsys.readouterr().err  # context parallelism too (runtime.module_context)
    dropout = tmp_path / "dropout"  # the same checkpoint with attention dropout, which tp refuses
    shutil.copytree(tiny_checkpoint, dropout)
    config = json.loads((dropout / "config.json").read_text())
    (dropout / "config.json").write_text(json.dumps(config | {"attention_dropout": 0.1}))
    assert main(["estimate", "--hf-model", str(dropout), *argv[3:]]) == 0
    assert ("`autoplan.train --hf-model` cannot run this plan yet: dropout under tensor parallelism"
            in capsys.readouterr().err)
    config_only = ["estimate", "--hf-config", str(tiny_checkpoint / "config.json"), *argv[3:], "-o", str(out)]
    assert main(config_only) == 0 and Plan.load(out).model.fingerprint == plan.model.fingerprint


def test_explain_hf_model_shows_per_op_costs(tiny_checkpoint, tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["estimate", "--hf-model", str(tiny_checkpoint), *HF_SEARCH, "--tp", "2", "-o", str(out)]) == 0
    capsys.readouterr()
    assert main(["explain", str(out)]) == 0  # not a preset: no per-op table
    assert "per-op costs: not shown" in capsys.readouterr().out
    assert main(["explain", str(out), "--hf-model", str(tiny_checkpoint)]) == 0
    text = capsys.readouterr().out
    assert "per op family" in text and "model_layers.*.mlp_up_proj" in text


@pytest.mark.parametrize("what", ["missing", "file", "other-model"])
def test_hf_model_bad_input_says_what_to_give(tiny_checkpoint, tmp_path, capsys, what):
    from autoplan.examples.tiny_hf import write_tiny_llama

    if what == "other-model":
        out = tmp_path / "plan.json"
        assert main(["estimate", "--hf-model", str(tiny_checkpoint), *HF_SEARCH, "-o", str(out)]) == 0
        other = write_tiny_llama(tmp_path / "other", layers=3, hidden=256, vocab=128)
        assert main(["explain", str(out), "--hf-model", str(other)]) == 2
        assert "another model than the plan's" in capsys.readouterr().err
        return
    path = tmp_path / "nothing" if what == "missing" else tiny_checkpoint / "config.json"
    assert main(["search", "--hf-model", str(path), *HF_SEARCH]) == 2
    err = capsys.readouterr().err
    assert "config.json" in err and ("does not exist" in err if what == "missing" else "--hf-config" in err)
