"""Context (Ulysses), expert and pipeline parallelism, alone and with tp, dp, ZeRO and recompute,
against a single-process run: losses of 3 AdamW steps, the first step's gradients and the final
parameters (fp32; the tolerances of test_runtime_parity). One spawn per world size (2, 4, 8 ranks)
runs every configuration of that size; each configuration also counts the collectives of its first
step and compares them with `runtime.counting.expected_collectives` of its plan.

    cp    sequence sharded over cp ranks, all-to-all to head shards around attention; GPT's learned
          positions offset, Llama's RoPE computed on the whole sequence; kv heads repeated when
          tp * cp exceeds them (tiny-llama: 2 kv heads, cp2 x tp2)
    ep    experts split over ep ranks, tokens dispatched and combined by uneven all-to-alls
    etp   etp = 1 < tp (MoE parallel folding): each tp rank routes its 1/tp of the tokens to whole
          experts spread over ep x tp (tp alone, with dp and ZeRO 0 / 3; ep x tp, ep innermost)
    pp    stages from the plan: 1F1B, GPipe, interleaved 1F1B (a 4-layer Llama, 2 chunks per rank);
          stages of unequal size: a 5-layer Llama on pp 2 x v 2 (the stage search's chunks, and given
          ones whose first chunk holds only the embedding and last only the head), 1F1B with the
          head alone on the last stage

Plans are built directly from autoplan.plan types (`_dist.make_plan` with cp, ep or pp > 1): the
planner's rules refuse sequences this short for cp and layer counts this small for pp.
"""

from __future__ import annotations

import pytest
import torch

from _dist import assert_matches, batches, make_plan, spawn, train_program

pytestmark = pytest.mark.gloo

SEED, STEPS, LR, EPS = 5, 3, 1e-3, 1e-6


def _llama(layers: int):
    from autoplan.models.config import ModelConfig

    return ModelConfig(f"tiny-llama-{layers}l", "llama", layers, 64, 4, 2, 128, 128, 64)


CONFIGS = {
    2: [("gpt-cp2", "tiny-gpt", dict(cp=2)),
        ("llama-cp2", "tiny-llama", dict(cp=2, microbatch_size=2)),
        ("moe-ep2", "tiny-moe", dict(ep=2)),
        ("gpt-pp2-1f1b", "tiny-gpt", dict(pp=2, num_microbatches=2)),
        ("llama4-pp2-interleaved", "tiny-llama-4l", dict(pp=2, virtual_stages=2,
                                                         num_microbatches=2)),
        ("llama5-pp2-interleaved-uneven", "tiny-llama-5l", dict(pp=2, virtual_stages=2, num_microbatches=2)),
        ("llama5-pp2-interleaved-end-chunks", "tiny-llama-5l", dict(pp=2, virtual_stages=2, num_microbatches=2,
                                                                    stage_layers=(0, 2, 3, 0))),
        ("gpt-pp2-1f1b-head-stage", "tiny-gpt", dict(pp=2, num_microbatches=2, stage_layers=(2, 0))),
        ("moe-pp2-gpipe-full", "tiny-moe", dict(pp=2, num_microbatches=2, schedule="gpipe",
                                                recompute="full")),
        ("moe-tp2-etp1-megatron", "tiny-moe", dict(tp=2, etp=1, assignment="megatron"))],
    4: [("gpt-cp2tp2-megatron-sp", "tiny-gpt", dict(cp=2, tp=2, assignment="megatron-sp")),
        ("llama-cp2tp2-megatron", "tiny-llama", dict(cp=2, tp=2, assignment="megatron")),
        ("moe-ep2dp2", "tiny-moe", dict(ep=2, dp=2)),
        ("moe-ep2tp2-megatron", "tiny-moe", dict(ep=2, tp=2, assignment="megatron")),
        ("moe-ep2cp2-full", "tiny-moe", dict(ep=2, cp=2, recompute="full")),
        ("moe-dp2tp2-etp1-megatron", "tiny-moe", dict(dp=2, tp=2, etp=1, assignment="megatron")),
        ("moe-dp2tp2-etp1-megatron-sp-zero3", "tiny-moe", dict(dp=2, tp=2, etp=1, zero_stage=3,
                                                               assignment="megatron-sp")),
        ("moe-ep2tp2-etp1-megatron-sp-ep-inner", "tiny-moe",
         dict(ep=2, tp=2, etp=1, assignment="megatron-sp", order=("pp", "dp", "cp", "tp", "ep"))),
        ("llama-tp2pp2-megatron-sp", "tiny-llama", dict(pp=2, tp=2, assignment="megatron-sp",
                                                        num_microbatches=2)),
        ("gpt-dp2pp2-zero1", "tiny-gpt", dict(pp=2, dp=2, num_microbatches=2, zero_stage=1)),
        ("gpt-dp2cp2-zero3", "tiny-gpt", dict(dp=2, cp=2, zero_stage=3))],
    8: [("gpt-dp2pp2tp2-megatron-sp", "tiny-gpt", dict(dp=2, pp=2, tp=2,
                                                       assignment="megatron-sp",
                                                       num_microbatches=2))],
}
CASES = [(world, cid) for world, configs in CONFIGS.items() for cid, _, _ in configs]


def _config(model: str):
    from autoplan.models import get_model_config

    return _llama(int(model[len("tiny-llama-"):-1])) if model.startswith("tiny-llama-") else get_model_config(model)


_PLANS: dict[str, tuple] = {}


def _plans(world: int) -> list[tuple]:
    """(id, config, plan) per configuration of `world`, built once, in pytest only."""
    for cid, model, kwargs in CONFIGS[world]:
        if cid not in _PLANS:
            kwargs = dict(kwargs)
            dp, tp = kwargs.pop("dp", 1), kwargs.pop("tp", 1)
            config = _config(model)
            _PLANS[cid] = (cid, config, make_plan(config, dp, tp,
                                                  kwargs.pop("assignment", "replicate"), **kwargs))
    return [_PLANS[cid] for cid, _, _ in CONFIGS[world]]


# ------------------------------------------------------------------------------ in the ranks


def _run_config(rank: int, config, plan) -> dict:
    from autoplan.models import build_model
    from autoplan.runtime.counting import expected_collectives
    from autoplan.runtime.launch import parallelize

    program = parallelize(build_model(config), None, plan, seed=SEED, config=config)
    optimizer = program.make_optimizer(torch.optim.AdamW, lr=LR, eps=EPS)
    tokens, targets = batches(plan.global_batch, plan.seq_len, STEPS)
    out = train_program(program, optimizer, tokens, targets)
    coords = plan.mesh.coords(rank)
    out.update(expected=dict(expected_collectives(plan, config, coords["pp"])),
               coords=coords, shapes={n: tuple(p.shape) for n, p in
                                      program.named_local_parameters()},
               code=program.graph_module.code if program.pipeline is None else
               "\n".join(m.code for m in program.pipeline.modules))
    return out


def _run_all(rank: int, world: int, configs: list) -> dict:
    torch.manual_seed(1234 + rank)  # nothing may depend on the global RNG
    return {cid: _run_config(rank, config, plan) for cid, config, plan in configs}


# ------------------------------------------------------------------------------ in pytest


@pytest.fixture(scope="module")
def results() -> dict[int, list[dict]]:
    return {world: spawn(_run_all, world, _plans(world)) for world in CONFIGS}


def _reference(reference_run, config, plan) -> dict:
    return reference_run(config, *batches(plan.global_batch, plan.seq_len, STEPS), SEED, LR, EPS)


@pytest.mark.parametrize("world,cid", CASES, ids=[c[1] for c in CASES])
def test_matches_single_process(results, world, cid, reference_run):
    _, config, plan = _PLANS[cid]
    ref = _reference(reference_run, config, plan)
    for rank, out in enumerate(results[world]):
        assert_matches(out[cid], ref, f"{cid} rank {rank}")


@pytest.mark.parametrize("world,cid", CASES, ids=[c[1] for c in CASES])
def test_collectives_match_the_plan(results, world, cid):
    for rank, out in enumerate(results[world]):
        got, want = out[cid]["counts"], out[cid]["expected"]
        assert got == want, f"{cid} rank {rank}: counted {sorted(got.items())}, plan predicts " \
                            f"{sorted(want.items())}"


@pytest.mark.parametrize("world,cid", [(w, c) for w, c in CASES if "pp" in c],
                         ids=[c for w, c in CASES if "pp" in c])
def test_pipeline_ranks_hold_only_their_stages(results, world, cid, reference_run):
    """Every parameter lives on exactly one pipeline coordinate (per dp, tp coordinate)."""
    _, config, plan = _PLANS[cid]
    per_rank = results[world]
    names = set(_reference(reference_run, config, plan)["params"])
    first = {r: out[cid] for r, out in enumerate(per_rank)
             if all(out[cid]["coords"][a] == 0 for a in ("dp", "tp", "cp", "ep"))}
    held = [set(out["shapes"]) for out in first.values()]
    assert len(held) == plan.mesh.pp and set().union(*held) == names
    assert sum(len(h) for h in held) == len(names), "a parameter is on two stages"


def test_the_stage_cases_are_uneven():
    plans = {cid: plan for cid, _, plan in _plans(2)}
    assert plans["llama5-pp2-interleaved-uneven"].stage_layers == (1, 1, 2, 1)  # 5 layers, pp x v = 4 chunks
    assert plans["llama5-pp2-interleaved-end-chunks"].stage_layers == (0, 2, 3, 0)
    assert plans["gpt-pp2-1f1b-head-stage"].stage_layers == (2, 0)


EXPERT_CASES = [(w, c) for w, c in CASES if "ep" in c or "etp" in c]


@pytest.mark.parametrize("world,cid", EXPERT_CASES, ids=[c for _, c in EXPERT_CASES])
def test_experts_are_split_over_ep(results, world, cid):
    """Over ep, and over ep x tp with etp = 1 (whole experts: the FFN dim unsplit)."""
    _, config, plan = _PLANS[cid]
    for out in results[world]:
        for name, shape in out[cid]["shapes"].items():
            if name.endswith(("w_gate", "w_up", "w_down")):
                assert shape[0] == config.experts // plan.mesh.expert_parallel, (name, shape)
                whole = plan.mesh.etp == plan.mesh.tp or config.ffn_hidden in shape[1:]
                assert whole, (name, shape)
            if name.endswith("router.weight"):
                assert shape[0] == config.experts, (name, shape)


def test_context_parallel_graph_reads_as_ulysses(results):
    code = results[2][0]["gpt-cp2"]["code"]
    assert code.count("cp_positions(") == 1  # GPT's learned positions
    assert code.count("cp_heads(") == 3 * 2 and code.count("cp_sequence(") == 2  # q, k, v; out
