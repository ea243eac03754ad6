"""explain / compare / side-by-side text, and their command-line entry points (tier 1)."""

from __future__ import annotations

import argparse

import pytest

from autoplan.cost_model.compute import Efficiency

from autoplan.cli.explain import (activation_families, add_compare_parser, add_explain_parser, add_search_options,
                                  cmd_compare, cmd_explain, compare_plans, explain_plan, op_family, op_family_costs,
                                  save_top, search_report, side_by_side)
from autoplan.mesh import MeshShape
from autoplan.models import get_model_config
from autoplan.api import capture_model, estimate, search_plans


@pytest.fixture(scope="module")
def plans():
    kwargs = dict(zero_stage=1, recompute="selective")
    fast = estimate("gpt3-1.3b", "2x8xh100", 64, 1024, mesh=MeshShape(dp=16), microbatch_size=2, **kwargs)
    slow = estimate("gpt3-1.3b", "2x8xh100", 64, 1024, mesh=MeshShape(pp=4, dp=2, tp=2), microbatch_size=1, **kwargs)
    return fast, slow


def test_explain_shows_time_memory_stages_and_op_families(plans):
    text = explain_plan(plans[1])
    for part in ("compute", "communication (exposed)", "pipeline bubble", "optimizer", "parameters", "gradients",
                 "optimizer states", "activations", "temporary buffers", "stage 3: layers", "per op family"):
        assert part in text
    assert "layers.*.mlp_fc" in text and "column" in text  # the ILP's tp strategies, by family


def test_op_family_costs_add_up_to_the_plan_compute(plans):
    """On the kernels' own times the families add up to the plan's compute but what recompute re-runs and
    autocast's weight casts (each GEMM weight read 4 + written 2 bytes in forward, its gradient 2 + 4 in backward,
    `StepModel.cast_s`); with the host's dispatch and re-run priced (the default on a GPU), the plan's compute
    is more, and explain says how much."""
    from autoplan.cost_model.compute import memory_time_s
    from autoplan.cost_model.memory import CAST_KINDS

    config = get_model_config("gpt3-1.3b")
    graph = capture_model(config, 1024)
    own = estimate("gpt3-1.3b", "2x8xh100", 64, 1024, mesh=MeshShape(dp=16), microbatch_size=2, zero_stage=1,
                   recompute="selective", efficiency=Efficiency(host_kernel_s=0.0, host_recompute_s=()))
    weights = {name: meta.numel for n in graph.nodes if n.op_kind in CAST_KINDS for name, meta in n.params}
    cast = memory_time_s(12 * sum(weights.values()), own.cluster.device, Efficiency())
    for plan in (own, plans[0]):
        rows = op_family_costs(plan, graph, config)
        per_microbatch = sum(r[3] + r[4] for r in rows)
        beyond = plan.predicted.time.compute_s / plan.num_microbatches - per_microbatch
        if plan is own:  # selective recompute re-runs a little of the forward
            assert 0 <= beyond - cast < 0.1 * per_microbatch and cast > 0.05 * per_microbatch
        else:  # 2048 tokens of a 2048-wide layer per microbatch: the host's pace, 2.5x the kernels
            assert beyond > 0.3 * per_microbatch and "the host's dispatch" in explain_plan(plan)
    assert op_family("layers_12_attn_q_proj") == "layers.*.attn_q_proj" and op_family("add_7") == "add"
    assert op_family("model_layers_3_mlp_up_proj") == "model_layers.*.mlp_up_proj"  # a Hugging Face export's


def test_activation_families_add_up_to_the_plan_activations(plans):
    """The bytes `explain` attributes to each op family (storage by storage, `cost_model.activations`) add up,
    with the re-run layer's transient, to the plan's own activation figure (the step model's per-part sums)."""
    plan = plans[0]  # pp = 1: one microbatch of activations in flight
    config = get_model_config("gpt3-1.3b")
    rows, transient = activation_families(plan, capture_model(config, 1024), config)
    assert sum(b for _, b in rows) + transient == pytest.approx(plan.predicted.memory.activations_bytes, rel=1e-9)
    assert transient > 0 and "activations per op family" in explain_plan(plan)


def test_compare_says_which_is_faster_and_why(plans):
    fast, slow = plans
    text = compare_plans(slow, fast, ("piped", "flat"))
    ratio = slow.predicted.step_time_s / fast.predicted.step_time_s
    assert f"verdict: flat is {ratio:.2f}x faster than piped" in text
    lines = text.splitlines()
    assert any(line.split()[:1] == ["pp"] and line.split()[1:] == ["4", "1"] for line in lines)
    # the time parts are listed largest difference first
    start = lines.index(next(line for line in lines if line.startswith("step time by part"))) + 3
    diffs = [float(line.split()[-2].lstrip("+-").replace(",", "")) * (1e-3 if line.endswith("ms") else 1)
             for line in lines[start:start + 4]]
    assert diffs == sorted(diffs, reverse=True)
    assert "why: the largest difference is" in text


def test_side_by_side_and_search_report():
    result = search_plans("tiny-llama", "1x8xh100", 32, 64, top=2)
    text = search_report(result, ["all"])
    assert text.splitlines()[0].split()[:3] == ["plan", "mesh", "microbatch"]
    assert "#1" in text and "#2" in text and "megatron" in text and "fsdp" in text
    assert "intra-op solves" in text.splitlines()[-1]
    assert "why none" in side_by_side([("x", None, "why none")])


def test_command_line_entry_points(plans, tmp_path, capsys):
    fast, slow = plans
    fast.save(tmp_path / "fast.json")
    slow.save(tmp_path / "slow.json")
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    add_explain_parser(sub)
    add_compare_parser(sub)
    add_search_options(sub.add_parser("search"))
    assert cmd_explain(parser.parse_args(["explain", str(tmp_path / "fast.json"), "--no-ops"])) == 0
    assert "step time" in capsys.readouterr().out
    assert cmd_compare(parser.parse_args(["compare", str(tmp_path / "slow.json"), str(tmp_path / "fast.json")])) == 0
    assert "verdict: fast is" in capsys.readouterr().out
    args = parser.parse_args(["search", "--top", "3", "--baseline", "megatron", "--save-top", str(tmp_path)])
    assert (args.top, args.baseline, args.save_top) == (3, ["megatron"], str(tmp_path))
    result = search_plans("tiny-gpt", "1x4xh100", 16, 64, top=2)
    assert [p.rsplit("/", 1)[-1] for p in save_top(result, str(tmp_path))] == ["plan-1.json", "plan-2.json"]


def test_explain_and_compare_show_the_experts_tensor_parallel_degree():
    kwargs = dict(microbatch_size=1, zero_stage=0, recompute="none")
    split = estimate("tiny-moe", "1x4xh100", 8, 64, mesh=MeshShape(ep=2, tp=2), **kwargs)
    folded = estimate("tiny-moe", "1x4xh100", 8, 64, mesh=MeshShape(ep=2, tp=2, etp=1), **kwargs)
    text = explain_plan(folded)
    assert "ep2 x tp2 (etp1)" in text and "tp=2 etp=1" in text and "expert" in text  # the MoE's strategy
    rows = [line.split() for line in compare_plans(split, folded).splitlines()]
    assert ["etp", "(experts'", "tp)", "=", "tp", "1"] in rows
    assert not any(r[:1] == ["etp"] for r in (line.split() for line in compare_plans(split, split).splitlines()))


def test_explain_prices_the_per_op_table_with_the_profile():
    """A profile whose GEMMs run at half the datasheet rate doubles the compute of the GEMM families."""
    from test_cost_model import _h100_profile

    from autoplan.api import capture_model, estimate
    from autoplan.cli.explain import op_family_costs
    from autoplan.mesh import MeshShape
    from autoplan.models import get_model_config

    config = get_model_config("gpt3-1.3b")
    plan = estimate(config, "1x8xh100", 8, 1024, mesh=MeshShape(dp=4, tp=2), microbatch_size=1, zero_stage=1,
                    recompute="none")
    graph = capture_model(config, 1024)
    datasheet = {r[0]: r[3] for r in op_family_costs(plan, graph, config)}
    slow = {r[0]: r[3] for r in op_family_costs(plan, graph, config, _h100_profile(0.05))}
    assert slow["layers.*.mlp_fc"] > 2 * datasheet["layers.*.mlp_fc"]  # GEMM-bound: priced from the profile
