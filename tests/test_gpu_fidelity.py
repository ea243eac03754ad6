"""The cost model against what the lent H200 measured (benchmarks/data/, benchmarks/gpu_layer_time.py):
per-rank layer times of the runtime's own layers, and the H200 profile shipped with autoplan. No GPU is
needed: the measurements are data; what is checked is the model's prediction of them."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import gpu_layer_time  # noqa: E402
import gpu_steps  # noqa: E402

from autoplan.profiler.profile import HardwareProfile, shipped_profiles  # noqa: E402

MEASURED = BENCHMARKS / "data" / "h200_layer_times.json"
STEPS = BENCHMARKS / "data" / "h200_steps_isolated.json"


def test_layer_times_on_the_h200_are_predicted_within_the_goal_by_the_preset():
    """Issue 16's goal on the committed measurements: median |error| <= 10%, p90 <= 15%, over hidden
    2048-12288 and tp 1-8, priced by the h200 preset (no profile)."""
    measured = json.loads(MEASURED.read_text())
    rows = gpu_layer_time.comparison(measured, None, "triton", "h200")
    assert len(rows) == 40 and {r["case"].split("-")[0] for r in rows} == {"llama", "gpt"}
    summary = gpu_layer_time.summary(rows)
    assert summary["median_abs_error"] <= 0.10 and summary["p90_abs_error"] <= 0.15, summary


def test_the_shipped_profile_prices_the_layers_as_well_as_the_preset_at_the_median():
    """With `--profile h200` (its GEMM sweep, copy, launch floor and host figure) the median holds too
    (3.8%, p90 14.2% with the profile the tenth session shipped)."""
    measured = json.loads(MEASURED.read_text())
    summary = gpu_layer_time.summary(gpu_layer_time.comparison(measured, HardwareProfile.load("h200"), "triton", "h200"))
    assert summary["median_abs_error"] <= 0.10, summary


def test_a_host_bound_layer_is_priced_at_the_hosts_pace_not_its_kernels():
    """The 2048-wide Llama layer at tp 8 does 0.8 ms of GPU work and took 3-4 ms: the prediction follows
    the host (within 15%), where the kernels' own times alone are under a third of it."""
    measured = json.loads(MEASURED.read_text())
    case = next(c for c in measured["cases"] if (c["family"], c["hidden"], c["tp"], c["seq"]) == ("llama", 2048, 8, 4096))
    predicted = gpu_layer_time.predicted_layer_s(gpu_layer_time.Case("llama", 2048, 8, 4096), "h200")
    assert predicted["fwd_s"] + predicted["bwd_s"] == pytest.approx(case["fwd_bwd_s"], rel=0.15)
    assert sum(k["s"] for k in case["kernels"]) < 0.3 * case["fwd_bwd_s"]


def test_the_shipped_h200_profile_loads_by_name_and_calibrates_the_host():
    assert "h200" in shipped_profiles()
    profile = HardwareProfile.load("h200")
    assert profile.device_kind == "cuda" and "H200" in profile.device_name
    assert 1e-5 < profile.host_kernel_s < 1e-3 and len(profile.gemm) == 343
    from autoplan.cluster import parse_cluster
    from autoplan.cost_model.compute import calibrate

    _, efficiency = calibrate(parse_cluster("8xh200"), None, profile, "auto", "bfloat16")
    assert efficiency.host_kernel_s == profile.host_kernel_s


def test_one_gpu_steps_are_priced_within_five_percent_at_the_median_by_the_shipped_profile():
    """Issue 20's GPU goal on the committed one-GPU steps of the runtime (15 cases, Llama and GPT, recompute
    none / selective / full, autocast and bf16-master; each in its own process, measured the same call as
    the shipped profile): median step |error| <= 5% priced with it (3.3%; 2.8% before autocast's weight casts
    were priced), and every peak within 5% (issue 19).
    The selective cases took part in fitting `cost_model.host.GPU_RECOMPUTE_S`; the other 12 did not."""
    rows = gpu_steps.comparison(json.loads(STEPS.read_text()), HardwareProfile.load("h200"))
    assert len(rows) == 15 and all("error" not in r for r in rows)
    errors = sorted(abs(r["step_error"]) for r in rows)
    assert errors[len(errors) // 2] <= 0.05, errors
    assert max(abs(r["memory_error"]) for r in rows) <= 0.05



def test_the_flash_kernels_are_priced_pass_by_pass_from_what_cudnn_ran():
    """cuDNN's causal flash kernels of the 40 committed layers: each pass's median |error| within 10% with
    `attention_cost.GPU_FLASH_RATES` (the GEMM curve alone priced the forward 27.5% slow and the backward 14.4% fast,
    at the median: the backward took about 3x the forward's time, not 2x)."""
    rows = gpu_layer_time.flash_rows(json.loads(MEASURED.read_text()), "h200")
    assert len(rows) == 40
    for phase in ("fwd", "bwd"):
        errors = sorted(abs(r[f"{phase}_priced_s"] / r[f"{phase}_s"] - 1) for r in rows)
        assert errors[len(errors) // 2] <= 0.10, (phase, errors)
    assert all(2.5 < r["bwd_s"] / r["fwd_s"] < 3.5 for r in rows)


@pytest.mark.parametrize("steps, cases", [("h100_steps_isolated.json", 15), ("h100_steps_isolated_second.json", 15),
                                          ("h100_steps_third.json", 15)])
def test_one_gpu_steps_on_an_h100_are_priced_by_its_own_profile_held_out(steps, cases):
    """The same cases run on a lent H100 on three starts of the machine (the twelfth session's and the thirteenth's
    each case in its own process, the thirteenth's in the same call as the profile shipped as `h100`; the
    fourteenth's as its `runs` says, bf16-master's 3B case on a fourth start): no constant of the cost model was fitted
    to these steps. Median step |error| within issue 20's 5% (3.0%, 3.1% and 3.1% with autocast's weight casts priced;
    4.5%, 4.9% and 4.3% without), every peak of a case run alone within 5%."""
    assert "h100" in shipped_profiles()
    data = json.loads((BENCHMARKS / "data" / steps).read_text())
    assert "H100" in data["device"]
    rows = gpu_steps.comparison(data, HardwareProfile.load("h100"))
    assert len(rows) == cases and all("error" not in r for r in rows)
    errors = sorted(abs(r["step_error"]) for r in rows)
    assert errors[len(errors) // 2] <= 0.05, errors
    # peaks of cases that shared a process with earlier ones read what those left (up to 52 GiB here): not checked
    shared = {c["case"] for c in data["cases"] if not c.get("own_process", True)}
    assert max(abs(r["memory_error"]) for r in rows if r["case"] not in shared) <= 0.05


@pytest.mark.parametrize("steps", ["h100_steps_isolated.json", "h100_steps_isolated_second.json", "h100_steps_third.json"])
def test_the_optimizer_phase_on_an_h100_is_priced_with_its_host_work(steps):
    """Each step's gradient norm and optimizer step, timed by CUDA events (`gpu_steps.phase_rows`), against the
    optimizer part priced with the shipped profile (its bytes at the AdamW rate measured, and the host's work per
    tensor it exposes, `cost_model.optimizer.optimizer_host_time_s`): median |error| within 5% over the autocast
    cases (2.5%, 3.9% and 2.2% measured; the bf16-master ones add their masters' copies)."""
    data = json.loads((BENCHMARKS / "data" / steps).read_text())
    rows = [r for r in gpu_steps.phase_rows(data, HardwareProfile.load("h100")) if not r["case"].startswith("bfm-")]
    assert len(rows) == 10
    errors = sorted(abs(r["optimizer_s"] / r["norm_optimizer_s"] - 1) for r in rows)
    assert (errors[4] + errors[5]) / 2 <= 0.05, errors
