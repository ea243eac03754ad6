"""benchmarks/step_fidelity.py runs what it says: its plans are distinct configurations the runtime
accepts, priced with a profile through `estimate`'s calibration, the search's plan among them; its
figures (Spearman's rho, median |error|, the search's regret) are computed as stated; and one round
of its measurement runs on 2 gloo ranks. Structural only: no timing is asserted (timings on a shared
machine are the benchmark's to report, not a test's to judge)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import step_fidelity as sf  # noqa: E402


@pytest.fixture(scope="module")
def cpu_profile(tmp_path_factory):
    """A quick profile of this CPU (GEMMs, copy bandwidth, launch floor; no collectives)."""
    from autoplan.profiler.cli import add_profile_parser, cmd_profile
    from autoplan.profiler.profile import HardwareProfile

    path = tmp_path_factory.mktemp("profile") / "cpu.json"
    parser = argparse.ArgumentParser()
    add_profile_parser(parser.add_subparsers(dest="command"))
    cmd_profile(parser.parse_args(["profile", "--quick", "--device", "cpu", "--no-collectives", "-o", str(path)]))
    return HardwareProfile.load(path)


@pytest.fixture(scope="module")
def llama_plans(cpu_profile):
    return sf.family_plans(sf.families()["llama"], cpu_profile, quick=False)


def test_plan_set_is_ten_distinct_runnable_configurations(llama_plans):
    from autoplan.runtime.launch import check_plan

    plans, search_name = llama_plans
    config = sf.families()["llama"]
    keys = {sf.configuration_key(p) for p in plans.values()}
    assert len(keys) == len(plans) >= 11  # every plan runs something different, the search's too
    assert search_name in plans
    assert {"dp2", "tp2", "cp2", "pp2"} <= {str(p.mesh) for p in plans.values()}
    assert {p.zero_stage for p in plans.values()} == {0, 1, 2, 3}
    assert {p.recompute for p in plans.values()} >= {"none", "selective", "full"}
    for plan in plans.values():
        check_plan(plan, config, plan.cluster)  # what the runtime would refuse, refused here
        assert plan.dtype == sf.DTYPE and plan.predicted.step_time_s > 0


def test_plans_are_priced_with_the_profile(cpu_profile, llama_plans):
    """The profile's measured bandwidth is the plans' device (`calibrate`), not the CPU preset's."""
    plans, _ = llama_plans
    cluster, _ = sf.calibrated(cpu_profile)
    assert cluster.device.memory_bandwidth_bytes_per_s != pytest.approx(2e10)
    for plan in plans.values():
        assert plan.cluster.device == cluster.device


def test_figures_from_samples(llama_plans, tmp_path):
    plans, search_name = llama_plans
    names = list(plans)
    # measured = predicted x (1 + 0.1 i): ranks agree exactly, errors known
    samples = {n: [{"step_s": plans[n].predicted.step_time_s * 1.1, "cpu_s": 0.0, "sync_wait_s": 0.0,
                    "optimizer_s": 0.0}] * 3 for n in names}
    result = sf.summarize(plans, samples, search_name)
    assert result["spearman"] == pytest.approx(1.0)
    assert result["median_abs_error"] == pytest.approx(1 - 1 / 1.1)
    fastest = min(p.predicted.step_time_s for p in plans.values())
    assert result["search_regret"] == pytest.approx(plans[search_name].predicted.step_time_s / fastest - 1)
    out = tmp_path / "out.json"
    sf.write_json(out, {"families": {"llama": {"model": {"name": "fid-llama"}, "load_avg_before": [0],
                                               "load_avg_after": [0], **result}}})
    assert json.loads(out.read_text())["families"]["llama"]["rows"][0]["plan"] == names[0]
    assert not list(tmp_path.glob("*.tmp"))  # the atomic write left no temporary behind


def test_spearman_ties_and_reversal():
    assert sf.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert sf.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert sf.spearman([1, 1, 2], [5, 5, 6]) == pytest.approx(1.0)


@pytest.mark.gloo
def test_one_round_runs_on_two_ranks(llama_plans, tmp_path):
    """ZeRO 1 (the timed step includes ShardedOptimizer's all-gather) and pp 2, one round of one step."""
    plans, _ = llama_plans
    chosen = {name: plans[name] for name in ("dp2 zero1", "pp2 1f1b")}
    samples = sf.measure(sf.families()["llama"], chosen, rounds=1, steps=1, partial=tmp_path / "partial.json",
                         warmup=1)
    assert set(samples) == set(chosen)
    for rows in samples.values():  # the warm-up round's steps are not among the timed ones
        assert len(rows) == 1 and rows[0]["step_s"] > 0 and rows[0]["optimizer_s"] > 0
        assert rows[0]["page_faults"] >= 0
    assert samples["dp2 zero1"][0]["sync_wait_s"] >= 0


def test_the_ranks_run_under_the_malloc_the_readme_advises(monkeypatch):
    """The profile and the ranks inherit GLIBC_TUNABLES: KEPT_PAGES unless asked for the default or already set."""
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    assert sf.keep_freed_pages(default_malloc=True) == "default"
    assert "GLIBC_TUNABLES" not in os.environ
    if sys.platform.startswith("linux"):
        assert sf.keep_freed_pages(default_malloc=False) == sf.KEPT_PAGES == os.environ["GLIBC_TUNABLES"]
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=1")
    assert sf.keep_freed_pages(default_malloc=False) == "glibc.malloc.trim_threshold=1"  # the caller's stays
