"""`--precision {autocast,bf16-master}` on `autoplan estimate`, `autoplan search` and `autoplan.train`: the plan
holds what was asked, priced so, and a precision the dtype cannot run is refused before any work with the check
the runtime makes (`autoplan.plan.precision_problem`)."""

from __future__ import annotations

import pytest

from autoplan.cli import main
from autoplan.plan import Plan

WORKLOAD = ["--model", "tiny-llama", "--cluster", "1x2xh100", "--global-batch", "4", "--seq", "32"]
ESTIMATE = ["estimate", *WORKLOAD, "--dp", "2", "--zero", "1", "--recompute", "none"]


def _estimated(tmp_path, *extra: str) -> Plan:
    out = tmp_path / f"estimate{'-'.join(extra)}.json"
    assert main([*ESTIMATE, *extra, "-o", str(out)]) == 0
    return Plan.load(out)


def test_estimate_plans_the_precision_asked_for(tmp_path, capsys):
    """Without --precision a bfloat16 plan is bf16-master, as the search plans it; --precision autocast keeps
    fp32 parameters (twice the bytes) and all-gathers them in fp32 after the step (ZeRO 1)."""
    default, master, autocast = (_estimated(tmp_path, *extra) for extra in
                                 ((), ("--precision", "bf16-master"), ("--precision", "autocast")))
    assert (default.precision, master.precision, autocast.precision) == ("bf16-master", "bf16-master", "autocast")
    assert default.predicted == master.predicted
    # fp32 parameters and autocast's bf16 copies of the GEMM weights (4N + 2C) against bf16 ones (2N)
    assert autocast.predicted.memory.parameters_bytes > 2 * master.predicted.memory.parameters_bytes
    assert autocast.predicted.time.communication_s > master.predicted.time.communication_s
    assert "bfloat16 (autocast)" in capsys.readouterr().out  # the summary says which
    assert _estimated(tmp_path, "--dtype", "float32").precision == "autocast"


@pytest.mark.parametrize("command", ["estimate", "search"])
def test_bf16_master_with_float32_is_refused_naming_both_flags(command, capsys):
    argv = ESTIMATE if command == "estimate" else ["search", *WORKLOAD]
    assert main([*argv, "--dtype", "float32", "--precision", "bf16-master"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert "--precision bf16-master with --dtype float32" in err
    assert "holds bfloat16 parameters but the plan's dtype is 'float32'" in err
    assert "plan with dtype 'bfloat16', or precision 'autocast'" in err


def test_an_unknown_precision_is_a_usage_error(capsys):
    assert main([*ESTIMATE, "--precision", "fp8"]) == 2
    err = capsys.readouterr().err
    assert "--precision" in err and "'fp8'" in err and "autocast" in err


def test_search_plans_the_precision_asked_for_and_its_baselines_too(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["search", *WORKLOAD, "--precision", "autocast", "-o", str(out)]) == 0
    assert Plan.load(out).precision == "autocast"
    assert main(["search", *WORKLOAD, "-o", str(out)]) == 0
    assert Plan.load(out).precision == "bf16-master"  # `searched_precision`: the default for bfloat16
    from autoplan.api import search_plans

    result = search_plans("tiny-llama", "1x2xh100", 4, 32, precision="autocast")
    assert {p.precision for p in result.plans} == {"autocast"}
    assert {b.plan.precision for b in result.baselines if b.plan is not None} == {"autocast"}


def test_train_refuses_precision_beside_a_plan_file(tmp_path, capsys):
    from autoplan.train import main as train_main

    plan = tmp_path / "plan.json"
    assert main([*ESTIMATE, "-o", str(plan)]) == 0
    capsys.readouterr()
    assert train_main(["--model", "tiny-llama", "--plan", str(plan), "--precision", "autocast"]) == 2
    err = capsys.readouterr().err
    assert f"--precision autocast with --plan {plan}" in err and "autoplan search ... --precision autocast" in err
