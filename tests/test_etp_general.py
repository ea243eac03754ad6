"""Expert tensor parallelism of any degree dividing tp (1 < etp < tp), as Megatron Core runs it.

tp coordinate t = t_outer * etp + t_inner: the experts spread over the ep x tp / etp ranks of the
"expert" group (ep and t_outer), each expert's FFN split over the etp ranks of the "expert_tp"
group (t_inner). Here:

    pure        the mesh's sub-axes, groups and string form; the plan file; the rules' messages
    pricing     etp 1, 2 and tp differ as the formulas say (expert GEMM width, all-to-all group,
                the etp all-gather / reduce-scatter); the search picks etp = 2 where it is best
    gloo        one process vs tp4 etp2 (4 ranks) and ep2 x tp4 etp2 (8 ranks): losses, gradients,
                parameters, the collectives the plan predicts; a checkpoint saved under etp = 2
                resumed under etp = 1 and etp = tp, and one saved under etp = 1 resumed under etp = 2
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from _dist import assert_matches, batches, make_plan, reference, spawn, train_program

from autoplan.errors import ConfigError
from autoplan.mesh import MeshShape

SEED, RESUME_SEED, STEPS, LR, EPS, SEQ = 5, 99, 3, 1e-3, 1e-6, 16


# ------------------------------------------------------------------------------ pure


def test_mesh_splits_tp_into_outer_and_inner_halves():
    mesh = MeshShape(ep=2, tp=4, etp=2)
    assert mesh.expert_axes == ("ep", "tp_outer") and mesh.expert_tp_axes == ("tp_inner",)
    assert mesh.expert_parallel == 4 and (mesh.degree("tp_outer"), mesh.degree("tp_inner")) == (2, 2)
    assert [(mesh.coord(r, "tp_outer"), mesh.coord(r, "tp_inner")) for r in range(4)] == [
        (0, 0), (0, 1), (1, 0), (1, 1)]  # t = t_outer * etp + t_inner, t_inner the fast half
    assert str(mesh) == "ep2 x tp4 (etp2)" and MeshShape.from_json(mesh.to_json()) == mesh
    assert mesh.to_json()["etp"] == 2
    assert MeshShape(tp=4, etp=1).expert_axes == ("ep", "tp") and MeshShape(tp=4, etp=1).expert_tp_axes == ()
    assert MeshShape(tp=4).expert_axes == ("ep",) and MeshShape(tp=4).expert_tp_axes == ("tp",)
    with pytest.raises(ConfigError, match=r"mesh etp=3 must be a positive divisor of tp=4 .*\[1, 2, 4\]"):
        MeshShape(tp=4, etp=3)


def test_runtime_groups_of_the_two_halves():
    from autoplan.runtime.counting import group_name
    from autoplan.runtime.groups import groups_of, kind_axes

    mesh = MeshShape(ep=2, tp=4, etp=2)  # ranks: ep * 4 + t
    assert groups_of(mesh, kind_axes(mesh, "expert")) == ((0, 2, 4, 6), (1, 3, 5, 7))
    assert groups_of(mesh, kind_axes(mesh, "expert_tp")) == ((0, 1), (2, 3), (4, 5), (6, 7))
    inner = MeshShape(ep=2, tp=4, etp=2, order=("pp", "dp", "cp", "tp", "ep"))  # ranks: t * 2 + ep
    assert groups_of(inner, kind_axes(inner, "expert")) == ((0, 1, 4, 5), (2, 3, 6, 7))
    assert groups_of(inner, kind_axes(inner, "expert_tp")) == ((0, 2), (1, 3), (4, 6), (5, 7))
    assert (group_name(mesh, "expert"), group_name(mesh, "expert_tp")) == ("expert", "expert_tp")
    assert group_name(MeshShape(tp=4), "expert_tp") == "tp"  # etp = tp: the tp group itself


def test_plan_file_keeps_an_intermediate_etp():
    from autoplan.plan import Plan

    plan = make_plan("tiny-moe", 1, 4, "megatron-sp", etp=2, seq_len=SEQ)
    data = plan.to_json()
    assert data["mesh"]["etp"] == 2 and Plan.from_json(data) == plan
    assert "expert" in {op.strategy for op in plan.ops}  # the MoE layers' one strategy under etp < tp


@pytest.mark.parametrize("args,match", [
    (dict(experts=6, ep=2, tp=4, etp=2), r"etp=2 spreads the 6 experts over ep x tp / etp = 2 x 2 ranks, .* use etp=4"),
    (dict(experts=8, ep=1, tp=4, etp=2, seq_len=2050), r"etp=2 splits each sequence's tokens over tp x cp = 4"),
    (dict(experts=8, ep=1, tp=8, etp=4, ffn=1026), r"etp=4 splits each expert's FFN width 1026 over 4 ranks"),
    (dict(experts=0, ep=1, tp=4, etp=2), r"needs a mixture-of-experts model"),
])
def test_etp_rules_say_what_to_change(args, match):
    from autoplan.validity import etp_problem

    args = {"seq_len": 2048, "cp": 1, "ffn": None, **args}
    assert re.search(match, etp_problem(args["experts"], args["ep"], args["tp"], args["etp"], args["seq_len"],
                                        args["cp"], args["ffn"]))


def test_runtime_refuses_an_etp_the_ffn_width_does_not_take():
    from autoplan.errors import PlanError
    from autoplan.models import get_model_config
    from autoplan.validity import check, configuration_problems

    plan = make_plan("tiny-moe", 1, 4, "megatron-sp", etp=2, seq_len=SEQ)
    config = dataclasses.replace(get_model_config("tiny-moe"), ffn_hidden=95)
    problems = configuration_problems(config, plan.mesh, plan.global_batch, plan.seq_len, plan.microbatch_size,
                                      plan.zero_stage, plan.recompute, plan.schedule, 1, heads_rule=False)
    with pytest.raises(PlanError, match=r"etp=2 splits each expert's FFN width 95 .* use an etp dividing 95"):
        check(problems, PlanError)  # the rule `check_plan` and `estimate` share


# ------------------------------------------------------------------------------ gloo: in the ranks

BATCH = 4
PARITY = {  # id: (world, make_plan arguments); tiny-moe has 4 experts of FFN width 96
    "tp4-etp2": (4, dict(tp=4, etp=2, assignment="megatron-sp", microbatch_size=4)),
    "ep2tp4-etp2-ep-inner": (8, dict(ep=2, tp=4, etp=2, assignment="megatron-sp", microbatch_size=2,
                                     order=("pp", "dp", "cp", "tp", "ep"))),
    "dp2tp4-etp2-zero3": (8, dict(dp=2, tp=4, etp=2, assignment="megatron-sp", microbatch_size=2, zero_stage=3)),
}
EIGHT = ("ep2tp4-etp2-ep-inner", "dp2tp4-etp2-zero3")  # one spawn of 8 ranks runs both
SAVES = {  # the plan saved under (3 steps) -> the plans resumed from it (steps 4 and 5)
    "tp4-etp2": {"tp4-etp1": dict(tp=4, etp=1, assignment="megatron-sp", microbatch_size=4),
                 "tp4-etp4": dict(tp=4, assignment="megatron", microbatch_size=4)},
    "ep2tp2-etp1": {"tp4-etp2": PARITY["tp4-etp2"][1]},
}
SAVE_PLANS = {"tp4-etp2": PARITY["tp4-etp2"][1],
              "ep2tp2-etp1": dict(ep=2, tp=2, etp=1, assignment="megatron-sp", microbatch_size=2)}


def _plan(kwargs: dict):
    kwargs = dict(kwargs)
    dp, tp = kwargs.pop("dp", 1), kwargs.pop("tp", 1)
    return make_plan("tiny-moe", dp, tp, kwargs.pop("assignment", "replicate"), seq_len=SEQ,
                     **kwargs)


def _program(plan, seed: int = SEED):
    from autoplan.models import build_model, get_model_config
    from autoplan.runtime.launch import parallelize

    config = get_model_config("tiny-moe")
    program = parallelize(build_model(config), None, plan, seed=seed, config=config)
    program.make_optimizer(torch.optim.AdamW, lr=LR, eps=EPS)
    return program


def _parity(plan, steps: int = STEPS) -> dict:
    from autoplan.models import get_model_config
    from autoplan.runtime.counting import expected_collectives

    program = _program(plan)
    tokens, targets = batches(BATCH, SEQ, steps)
    out = train_program(program, program.optimizer, tokens, targets)
    out["expected"] = dict(expected_collectives(plan, get_model_config("tiny-moe")))
    out["shapes"] = {n: tuple(p.shape) for n, p in program.named_local_parameters()}
    return out


def _save_and_resume(save_plan, resumes: dict, directory: Path) -> dict:
    tokens, targets = batches(BATCH, SEQ, 5)
    program = _program(save_plan)
    first = train_program(program, program.optimizer, tokens[:3], targets[:3], keep=False)
    program.save_checkpoint(directory, step=3)
    out = {"first": first["losses"]}
    for cid, plan in resumes.items():
        program = _program(plan, RESUME_SEED)  # another seed: every value must come from the checkpoint
        program.load_checkpoint(directory)
        out[cid] = train_program(program, program.optimizer, tokens[3:], targets[3:])
    return out


def _run_four(rank: int, world: int, plans: dict, root: str) -> dict:
    out = {"parity": _parity(plans["parity"])}
    for save, resumes in plans["saves"].items():
        out[save] = _save_and_resume(plans["save_plans"][save], resumes, Path(root) / save)
    return out


def _run_eight(rank: int, world: int, plans: dict) -> dict:
    return {cid: _parity(plan) for cid, plan in plans.items()}


# ------------------------------------------------------------------------------ gloo: in pytest


@pytest.fixture(scope="module")
def four(tmp_path_factory) -> list[dict]:
    root = tmp_path_factory.mktemp("etp")
    plans = {"parity": _plan(PARITY["tp4-etp2"][1]),
             "saves": {s: {cid: _plan(kw) for cid, kw in r.items()} for s, r in SAVES.items()},
             "save_plans": {s: _plan(kw) for s, kw in SAVE_PLANS.items()}}
    return spawn(_run_four, 4, plans, str(root))


@pytest.fixture(scope="module")
def eight() -> list[dict]:
    return spawn(_run_eight, 8, {cid: _plan(PARITY[cid][1]) for cid in EIGHT})


@pytest.fixture(scope="module")
def references() -> dict:
    from autoplan.models import get_model_config

    config = get_model_config("tiny-moe")
    return {"parity": reference(config, SEED, *batches(BATCH, SEQ, STEPS), LR, EPS),
            "five": reference(config, SEED, *batches(BATCH, SEQ, 5), LR, EPS)}


def _check_parity(results: list[dict], cid: str, references: dict) -> None:
    config_experts, ffn = 4, 96
    world, kwargs = PARITY[cid]
    mesh = _plan(kwargs).mesh
    for rank, out in enumerate(results):
        assert_matches(out, references["parity"], f"{cid} rank {rank}")
        assert out["counts"] == out["expected"], (f"{cid} rank {rank}: counted {sorted(out['counts'].items())}, "
                                                  f"plan predicts {sorted(out['expected'].items())}")
        assert out["counts"][("all_gather", "expert_tp")] > 0 and out["counts"][("reduce_scatter", "expert_tp")] > 0
        for name, shape in out["shapes"].items():
            if name.endswith(("w_gate", "w_up")):
                assert shape == (config_experts // mesh.expert_parallel, 64, ffn // mesh.etp), (name, shape)
            if name.endswith("w_down"):
                assert shape == (config_experts // mesh.expert_parallel, ffn // mesh.etp, 64), (name, shape)


@pytest.mark.gloo
def test_tp4_etp2_matches_one_process(four, references):
    _check_parity([out["parity"] for out in four], "tp4-etp2", references)


@pytest.mark.gloo
@pytest.mark.parametrize("cid", EIGHT)
def test_eight_rank_etp2_layouts_match_one_process(eight, references, cid):
    """ep2 x tp4 etp2 with ep innermost; dp2 x tp4 etp2 under ZeRO-3 (FSDP2 over the dp ranks of weights
    already split two ways on tp)."""
    _check_parity([out[cid] for out in eight], cid, references)


@pytest.mark.gloo
@pytest.mark.parametrize("save,resume", [(s, r) for s, rs in SAVES.items() for r in rs])
def test_checkpoint_resumes_across_etp(four, references, save, resume):
    ref = references["five"]
    continued = {"losses": ref["losses"][3:], "params": ref["params"], "grads": None}
    for rank, out in enumerate(four):
        torch.testing.assert_close(torch.tensor(out[save]["first"]), torch.tensor(ref["losses"][:3]),
                                   rtol=1e-5, atol=0)
        assert_matches(out[save][resume], continued, f"{save} -> {resume} rank {rank}", grads=False)


# ------------------------------------------------------------------------------ pricing


MID_MOE_ARGS = ("mid-moe", "moe", 4, 1024, 16, 4, 1024, 32000, 8192)  # as tests/test_search.py


def test_pricing_of_etp_1_2_and_tp():
    """ep2 x tp4 on 8 GPUs: the dispatch over ep x tp / etp ranks with tokens / tp each (etp < tp) or over ep
    with every token (etp = tp); the etp all-gather / reduce-scatter only for etp = 2; expert GEMMs at ffn / etp;
    expert parameters per rank the same whatever etp."""
    from fractions import Fraction

    from autoplan.cluster import parse_cluster
    from autoplan.cost_model.intra_op import _moe_shape, make_context
    from autoplan.cost_model.parallel_dims import axes_group, expert_all_to_all_s, expert_tp_exchange_s
    from autoplan.models.config import ModelConfig
    from autoplan.api import search_context
    from autoplan.solver.search import VARIANT_MEGATRON
    from autoplan.cost_model.step_config import Config

    model = ModelConfig(*MID_MOE_ARGS, experts=8, top_k=2)
    ctx = search_context(model, parse_cluster("1x8xh100"), 16, 2048)
    base = Config.of(tp=4, cp=1, pp=1, ep=2, dp=1, microbatch_size=1, num_microbatches=16, zero_stage=0,
                  recompute="none")
    moe = next(n for n in ctx.graph.nodes if n.op_kind == "moe")
    extra, memory, ffn = {}, {}, {}
    for etp in (1, 2, 4):
        cfg = base.replace(etp=etp)
        block = ctx.block(4, Fraction(1), VARIANT_MEGATRON, etp=etp)
        arrays = block.arrays("none")
        t = ctx.steps.times(block, cfg)  # its compute: the block's, with autocast's casts
        extra[etp] = (t.time - (np.diff(t.prefix["compute"]) + arrays["comm"]))[0]
        memory[etp] = ctx.price(cfg, VARIANT_MEGATRON).memory.parameters_bytes
        strategy = block.solution.strategies[moe.name]
        ffn[etp] = _moe_shape(moe, strategy, make_context(ctx.graph, ctx.cluster, cfg.mesh, 1))[1]
        assert strategy.name == ("ffn" if etp == 4 else "expert")
    mesh2 = base.replace(etp=2).mesh
    dispatch = {etp: expert_all_to_all_s(tokens, 1024, 2, 2, ctx.cluster, axes_group(mesh, axes, 8))
                for etp, tokens, mesh, axes in ((4, 2048, base.mesh, ("ep",)), (2, 512, mesh2, ("ep", "tp_outer")),
                                                (1, 512, base.mesh, ("ep", "tp")))}
    exchange = expert_tp_exchange_s(512, 1024, 2, 2, ctx.cluster, axes_group(mesh2, ("tp_inner",), 8))
    assert exchange > 0 and axes_group(mesh2, ("tp_inner",), 8).size == 2
    assert extra[4] == pytest.approx(dispatch[4]) and extra[1] == pytest.approx(dispatch[1])
    assert extra[2] == pytest.approx(dispatch[2] + exchange)
    assert (ffn[1], ffn[2]) == (1024, 512)  # whole experts, then half of each expert's FFN
    assert memory[1] == pytest.approx(memory[2]) and memory[2] == pytest.approx(memory[4])


def test_intermediate_etp_reuses_the_etp_1_ilp_exactly():
    """1 < etp < tp changes only the MoE's one strategy's cost (a constant of the ILP): the search prices the
    etp = 1 solve's choice at etp = 2, which must be the optimum of a direct unfolded solve at etp = 2. (A
    folded solve at etp = 2 reaches the same ILP objective but breaks a tie the other way: a choice whose one
    conversion feeds two consumers, which the pairwise ILP counts twice and the step model once, so the step
    model prices the unfolded choice 0.3% lower here; `AssignmentCost.shared_comm_s`.)"""
    from autoplan.cluster import parse_cluster
    from autoplan.models.config import ModelConfig
    from autoplan.api import search_context
    from autoplan.solver.intra_op import solve_tp

    model = ModelConfig(*MID_MOE_ARGS, experts=8, top_k=2)
    ctx = search_context(model, parse_cluster("1x8xh100"), 16, 2048)
    reused = ctx.solution(4, 1, etp=2).solution
    assert ctx.ilp_solves == 1 and ctx.solution(4, 1, etp=1) and ctx.ilp_solves == 1  # one solve serves both
    direct = solve_tp(ctx.graph, ctx.registry, ctx.info, ctx.cluster, MeshShape(dp=2, tp=4, etp=2), 1, ctx.dtype,
                      ctx.efficiency, False, ctx.time_limit_s)
    assert reused.assignment == direct.assignment
    assert reused.cost.total_s == pytest.approx(direct.cost.total_s, rel=1e-9)
    moe = next(n.name for n in ctx.graph.nodes if n.op_kind == "moe")
    assert reused.strategies[moe].expert_ffn_split == direct.strategies[moe].expert_ffn_split == 2


def test_search_picks_etp_2_for_few_large_experts():
    """4 experts of FFN width 28672 (48 layers, hidden 8192) on 8 x 8 H100: ep2 x tp4 cannot take etp = 1 (8
    ranks for 4 experts), but etp = 2 spreads them over ep2 x tp_outer2 with each FFN halved, which halves the
    expert weights per rank against ep = 1 and so needs 4 pipeline stages instead of 8. Best plans by etp
    (the cost model's figures, with ZeRO 1's parameter all-gather exposed after the step as the runtime runs
    it): etp2 14.64 s, etp1 14.65 s (pp8 x dp2 x tp4), etp = tp 15.50 s (pp8 x ep2 x tp4), etp4 16.55 s."""
    from autoplan.cluster import parse_cluster
    from autoplan.models.config import ModelConfig
    from autoplan.api import search_plans
    from autoplan.plan import Plan
    from autoplan.solver.space import SearchOptions

    model = ModelConfig("few-large-moe", "moe", 48, 8192, 64, 8, 28672, 32000, 8192, experts=4, top_k=2)
    options = SearchOptions(max_microbatch_size=1, zero_stages=(0, 1), recompute=("none", "full"), virtual_stages=())
    result = search_plans(model, parse_cluster("8x8xh100"), 256, 4096, options=options, baselines=False, top=50)
    best: dict[str, float] = {}
    for priced in result.priced:  # sorted by step time: the first of each etp is its best
        mesh = priced.config.mesh
        best.setdefault("tp" if mesh.etp == mesh.tp else str(mesh.etp), priced.step_time_s)
    plan = result.plans[0]
    assert (plan.mesh.ep, plan.mesh.tp, plan.mesh.etp) == (2, 4, 2) and plan.to_json()["mesh"]["etp"] == 2
    assert Plan.from_json(plan.to_json()) == plan
    # with model states priced as the runtime holds them (bf16-master's fp32 main gradients, cost_model.memory)
    # etp 1 needs more recompute: etp2 17.07 s, etp = tp 18.10 s, etp1 18.73 s
    assert best["2"] < min(best["1"], best["tp"])
    assert best["1"] / best["2"] > 1.0003 and best["tp"] / best["2"] > 1.02


def test_cli_estimate_takes_an_intermediate_etp(tmp_path, capsys):
    from autoplan.cli import main
    from autoplan.plan import Plan

    out = tmp_path / "plan.json"
    argv = ["estimate", "--model", "mixtral-8x7b", "--cluster", "1x8xh100", "--tp", "4", "--global-batch", "8",
            "--seq", "2048", "--zero", "1"]
    assert main(argv + ["--etp", "2", "-o", str(out)]) == 0
    assert "etp=2" in capsys.readouterr().out
    plan = Plan.load(out)
    assert (plan.mesh.tp, plan.mesh.etp, str(plan.mesh)) == (4, 2, "dp2 x tp4 (etp2)")
