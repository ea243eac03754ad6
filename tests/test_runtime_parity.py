"""Parallel vs single-process numerics: the strongest check that every strategy and conversion is right.

For tiny-gpt, tiny-llama and tiny-moe under dp=2, tp=2, tp=4 and dp2 x tp2, with the Megatron-style
assignment and seeded random valid assignments (a random strategy per node from the registry), the
loss of 3 AdamW steps, the gradients of the first step and the parameters after the third equal a
single-process run of the same model from the same seeded init, and the collectives of the first
step equal what the plan predicts (runtime.counting); so do ZeRO 1 / 2 (the distributed
optimizer of runtime.grad_sync) and ZeRO 3 (FSDP2) runs. One spawn per world size runs every
configuration. Tolerances (fp32; sums run in another order, so results differ by round-off):

    loss        rtol 1e-5
    gradients   rtol 1e-4, atol 1e-6   (atol covers grads that are 0 in exact arithmetic, such as
                                        the key bias's, where both runs hold only ~1e-9 noise)
    parameters  rtol 1e-4, atol 2e-5 after 3 AdamW steps at lr 1e-3 (Adam divides by sqrt(v), which
                turns round-off in near-zero grads into update differences; a wrong gradient gives
                errors of order lr = 1e-3)

Plans come from the planner (`plan_from_assignment`, `megatron_assignment`) via `_dist.make_plan`,
except tp=4 for tiny-llama and tiny-moe (2 kv heads), which the planner refuses and the runtime runs
with attention replicated: those are built directly from autoplan.plan types.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from _dist import make_plan, spawn

pytestmark = pytest.mark.gloo

MODELS = ("tiny-gpt", "tiny-llama", "tiny-moe")
SEED, STEPS, SEQ, LR, EPS = 5, 3, 16, 1e-3, 1e-6
LOSS_RTOL, GRAD_TOL, PARAM_TOL = 1e-5, dict(rtol=1e-4, atol=1e-6), dict(rtol=1e-4, atol=2e-5)


def _configs(world: int) -> list[tuple[str, str, dict]]:
    """(id, model, make_plan keyword arguments) for one world size."""
    found = []
    for i, model in enumerate(MODELS):
        if world == 2:
            found += [
                (f"{model}-dp2", model, dict(dp=2, tp=1, num_microbatches=2)),
                (f"{model}-tp2-megatron", model, dict(dp=1, tp=2, assignment="megatron",
                                                      microbatch_size=2)),
                (f"{model}-tp2-megatron-sp", model, dict(dp=1, tp=2, assignment="megatron-sp")),
                (f"{model}-tp2-random{i}", model, dict(dp=1, tp=2, assignment=f"random:{i}")),
                (f"{model}-tp2-random{i + 10}", model, dict(dp=1, tp=2,
                                                            assignment=f"random:{i + 10}",
                                                            model_device="cpu")),
            ]
        else:
            found += [  # tp=4 over 2 kv heads: the assignment keeps attention whole where it must
                (f"{model}-tp4-megatron", model, dict(dp=1, tp=4, assignment="megatron")),
                (f"{model}-tp4-random{i}", model, dict(dp=1, tp=4, assignment=f"random:{i}")),
                (f"{model}-dp2tp2-megatron", model, dict(dp=2, tp=2, assignment="megatron",
                                                         num_microbatches=2)),
                (f"{model}-dp2tp2-random{i}", model, dict(dp=2, tp=2, assignment=f"random:{i}")),
            ]
    if world == 2:
        found += [("tiny-gpt-dp2-zero1", "tiny-gpt", dict(dp=2, tp=1, zero_stage=1)),
                  ("tiny-moe-dp2-zero3", "tiny-moe", dict(dp=2, tp=1, zero_stage=3,
                                                          num_microbatches=2))]
    else:
        found += [("tiny-llama-dp2tp2-zero1", "tiny-llama",
                   dict(dp=2, tp=2, assignment="megatron", zero_stage=1)),
                  ("tiny-gpt-dp2tp2-zero2", "tiny-gpt",
                   dict(dp=2, tp=2, assignment="random:7", zero_stage=2, num_microbatches=2)),
                  ("tiny-moe-dp2tp2-zero3", "tiny-moe",
                   dict(dp=2, tp=2, assignment="megatron", zero_stage=3))]
    return found


def _plan(model: str, kwargs: dict):
    kwargs = dict(kwargs)
    dp, tp = kwargs.pop("dp"), kwargs.pop("tp")
    kwargs.pop("model_device", None)
    return make_plan(model, dp, tp, kwargs.pop("assignment", "replicate"), seq_len=SEQ, **kwargs)


def _batches(plan) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(plan.global_batch)
    shape = (STEPS, plan.global_batch, plan.seq_len)
    return torch.randint(0, 128, shape, generator=gen), torch.randint(0, 128, shape, generator=gen)


# ------------------------------------------------------------------------------ in the ranks


def _run_config(rank: int, model_name: str, plan, model_device: str = "meta") -> dict:
    from autoplan.models import build_model, get_model_config
    from autoplan.runtime.counting import expected_collectives
    from autoplan.runtime.init import shard_bounds
    from autoplan.runtime.launch import parallelize

    config = get_model_config(model_name)
    model = build_model(config, device=model_device)  # a CPU model's weights are not used
    program = parallelize(model, None, plan, seed=SEED, config=config)
    local_numel = dp_local_numel = 0
    for name, param in program.named_local_parameters():
        layout = program.layouts[name]
        bounds = shard_bounds(layout.shape, layout.placement, program.tp.index, program.tp.size)
        assert tuple(param.shape) == tuple(b - a for a, b in bounds) and not param.is_meta, name
        local_numel += param.numel()
        dp_local_numel += param.to_local().numel() if program.fsdp else param.numel()
    optimizer = program.make_optimizer(torch.optim.AdamW, lr=LR, eps=EPS)
    tokens, targets = _batches(plan)
    losses, grads = [], None
    for step in range(STEPS):
        with program.count_collectives() as counts:
            losses.append(program.train_step(tokens[step], targets[step], optimizer))
        if step == 0:
            grads, counted = program.full_gradients(), dict(counts)
    params = program.full_parameters()
    keep = rank in (0, plan.mesh.world_size - 1)  # full tensors from two ranks are plenty
    expected = dict(expected_collectives(plan, config))
    return {"losses": losses, "local_numel": local_numel, "dp_local_numel": dp_local_numel,
            "counts": counted, "expected": expected,
            "tp_index": program.tp.index, "optimizer": type(optimizer).__name__,
            "grads": grads if keep else None, "params": params if keep else None}


def _run_all(rank: int, world: int, configs: list) -> dict:
    torch.manual_seed(1234 + rank)  # nothing may depend on the global RNG
    out = {cid: _run_config(rank, model, plan, device) for cid, model, plan, device in configs}
    out["errors"] = _launch_errors(rank, world)
    return out


def _launch_errors(rank: int, world: int) -> dict[str, str]:
    """parallelize with a wrong world size / model must fail before any collective."""
    import torch.distributed as dist

    from autoplan.errors import PlanError
    from autoplan.models import build_model, get_model_config
    from autoplan.runtime.launch import parallelize

    gpt, llama = get_model_config("tiny-gpt"), get_model_config("tiny-llama")
    cases = {"world": (gpt, make_plan("tiny-gpt", 2 * world, 1, seq_len=SEQ)),
             "fingerprint": (llama, make_plan("tiny-gpt", 1, world, seq_len=SEQ))}
    names = ("new_group", "all_reduce", "all_gather", "broadcast", "barrier", "all_to_all_single",
             "reduce_scatter_tensor", "all_gather_into_tensor")
    saved = {n: getattr(dist, n) for n in names}

    def forbidden(*args, **kwargs):
        raise AssertionError("a collective ran before the launch checks")

    messages = {}
    try:
        for n in names:
            setattr(dist, n, forbidden)
        for case, (config, plan) in cases.items():
            try:
                parallelize(build_model(config), None, plan, config=config)
                messages[case] = "no error"
            except PlanError as exc:
                messages[case] = str(exc)
    finally:
        for n, fn in saved.items():
            setattr(dist, n, fn)
    return messages


# ------------------------------------------------------------------------------ in pytest


def _reference(reference_run, model_name: str, plan) -> dict:
    """Single-process run: same seeded init, same global batches, plain AdamW (cached for the session)."""
    from autoplan.models import get_model_config

    return reference_run(get_model_config(model_name), *_batches(plan), SEED, LR, EPS)


CASES = [(world, cid, model) for world in (2, 4) for cid, model, _ in _configs(world)]
_PLANS: dict[str, tuple] = {}


def _plans(world: int) -> list[tuple]:
    """(id, model, plan, model device) of one world; plans are built once, lazily, in pytest only
    (the ranks import this module too, and must not rebuild them)."""
    for cid, model, kwargs in _configs(world):
        if cid not in _PLANS:
            _PLANS[cid] = (cid, model, _plan(model, kwargs), kwargs.get("model_device", "meta"))
    return [_PLANS[cid] for cid, _, _ in _configs(world)]


@pytest.fixture(scope="module")
def results() -> dict[int, list[dict]]:
    return {world: spawn(_run_all, world, _plans(world)) for world in (2, 4)}


@pytest.mark.parametrize("world,cid,model", CASES, ids=[c[1] for c in CASES])
def test_matches_single_process(results, world, cid, model, reference_run):
    plan = _PLANS[cid][2]
    ref = _reference(reference_run, model, plan)
    for rank, out in enumerate(results[world]):
        got = out[cid]
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]),
                                   rtol=LOSS_RTOL, atol=0, msg=f"{cid} rank {rank}: losses")
        if got["grads"] is None:
            continue
        assert set(got["grads"]) == set(ref["grads"]) == set(got["params"])
        for name in ref["grads"]:
            torch.testing.assert_close(got["grads"][name], ref["grads"][name], **GRAD_TOL,
                                       msg=lambda m: f"{cid} rank {rank} grad {name}: {m}")
            torch.testing.assert_close(got["params"][name], ref["params"][name], **PARAM_TOL,
                                       msg=lambda m: f"{cid} rank {rank} param {name}: {m}")


@pytest.mark.parametrize("world,cid,model", CASES, ids=[c[1] for c in CASES])
def test_only_local_shards_are_allocated(results, world, cid, model):
    plan = _PLANS[cid][2]
    tp = plan.mesh.tp
    expected = sum(_numel(p.name, model) // (tp if not _replicated(p) else 1) for p in plan.params)
    for rank, out in enumerate(results[world]):
        assert out[cid]["local_numel"] == expected, f"{cid} rank {rank}"
    if "megatron" in cid:
        assert expected < sum(_numel(p.name, model) for p in plan.params)


@pytest.mark.parametrize("world,cid,model", CASES, ids=[c[1] for c in CASES])
def test_collectives_match_the_plan(results, world, cid, model):
    """The first step's collectives, counted by kind and group, equal what the plan predicts
    (`runtime.counting.expected_collectives`: strategies, edges, dp sync)."""
    for rank, out in enumerate(results[world]):
        got, want = out[cid]["counts"], out[cid]["expected"]
        assert got == want, f"{cid} rank {rank}: counted {sorted(got.items())}, plan predicts " \
                            f"{sorted(want.items())}"


def test_zero12_steps_the_sharded_optimizer(results):
    """ZeRO 1 and 2 run as the distributed optimizer (runtime.grad_sync.ShardedOptimizer)."""
    assert results[2][0]["tiny-gpt-dp2-zero1"]["optimizer"] == "ShardedOptimizer"
    assert results[4][0]["tiny-llama-dp2tp2-zero1"]["optimizer"] == "ShardedOptimizer"
    assert results[4][0]["tiny-gpt-dp2tp2-zero2"]["optimizer"] == "ShardedOptimizer"


@pytest.mark.parametrize("world,cid", [(2, "tiny-moe-dp2-zero3"), (4, "tiny-moe-dp2tp2-zero3")])
def test_zero23_shards_parameters_over_dp(results, world, cid):
    """Under FSDP2 the dp ranks of one tp index hold disjoint pieces of that index's shards."""
    per_rank = [out[cid] for out in results[world]]
    for tp_index in {r["tp_index"] for r in per_rank}:
        same = [r for r in per_rank if r["tp_index"] == tp_index]
        assert len(same) == 2 and all(r["dp_local_numel"] < r["local_numel"] for r in same)
        assert sum(r["dp_local_numel"] for r in same) == same[0]["local_numel"]


def test_launch_checks_fail_before_any_collective(results):
    from autoplan.models import get_model_config

    gpt, llama = (get_model_config(m).fingerprint() for m in ("tiny-gpt", "tiny-llama"))
    for world, per_rank in results.items():
        for out in per_rank:
            world_msg, fp_msg = out["errors"]["world"], out["errors"]["fingerprint"]
            assert f"launched world size {world} != plan mesh world size {2 * world}" in world_msg
            assert gpt in fp_msg and llama in fp_msg, fp_msg


@functools.lru_cache(maxsize=None)
def _numels(model: str) -> dict[str, int]:
    from autoplan.models import build_model, get_model_config

    return {n: p.numel() for n, p in build_model(get_model_config(model)).named_parameters()}


def _numel(name: str, model: str) -> int:
    return _numels(model)[name]


def _replicated(param_placement) -> bool:
    from autoplan.placement import Replicate

    return isinstance(dict(param_placement.placements).get("tp", Replicate()), Replicate)


# ------------------------------------------------------------------------------ refusals (no processes)


@pytest.mark.parametrize("model,change,match", [
    ("tiny-gpt", dict(mesh=dict(pp=2)), r"'1f1b' needs num_microbatches >= pp: got 1 < 2"),
    ("tiny-gpt", dict(mesh=dict(cp=4), seq_len=18), "sequence 18 is not divisible by tp x cp = 4"),
    ("tiny-gpt", dict(mesh=dict(ep=2)), r"ep=2 needs a mixture-of-experts model; this model has no experts"),
    ("tiny-moe", dict(mesh=dict(ep=2), zero_stage=3), r"zero_stage 3 \(FSDP2\) with ep=2"),
    ("tiny-gpt", dict(mesh=dict(tp=2, etp=1)), "etp=1 with tp=2 needs a mixture-of-experts model"),
    ("tiny-moe", dict(mesh=dict(tp=2, etp=1), seq_len=15),
     "etp=1 splits each sequence's tokens over tp x cp = 2 ranks, which does not divide seq_len 15"),
])
def test_plans_the_runtime_cannot_run_are_refused(model, change, match):
    """Each refusal names the values that clash, before any process group exists."""
    from autoplan.cluster import parse_cluster
    from autoplan.errors import PlanError
    from autoplan.mesh import MeshShape
    from autoplan.models import build_model, get_model_config
    from autoplan.plan import StageSpec
    from autoplan.runtime.launch import parallelize

    plan = make_plan(model, 2, 1, seq_len=SEQ, microbatch_size=2)  # 4 sequences: dp x ep splits
    mesh = MeshShape(dp=2, **change.pop("mesh"))
    stages = (StageSpec(0, 0, 1), StageSpec(1, 1, 2)) if mesh.pp > 1 else plan.stages
    kwargs = dict(mesh=mesh, stages=stages, cluster=parse_cluster(f"{mesh.world_size}xcpu"),
                  **change)
    try:  # a Plan version that counts ep ranks as data-parallel wants them in the batch
        plan = dataclasses.replace(plan, global_batch=plan.global_batch * mesh.ep, **kwargs)
    except PlanError:
        plan = dataclasses.replace(plan, **kwargs)
    config = get_model_config(model)
    with pytest.raises(PlanError, match=match):
        parallelize(build_model(config), None, plan, config=config)


def test_plan_errors_name_the_node():
    from autoplan.errors import PlanError
    from autoplan.models import build_model, get_model_config
    from autoplan.runtime.groups import RankGroup
    from autoplan.runtime.rewrite import rewrite

    config = get_model_config("tiny-gpt")
    plan = make_plan("tiny-gpt", 1, 2, "megatron", seq_len=SEQ)
    tp = RankGroup("tp", (0, 1), 0, None)
    ops = tuple(dataclasses.replace(o, strategy="diagonal") if o.node == "layers_0_mlp_fc" else o
                for o in plan.ops)
    with pytest.raises(PlanError, match="layers_0_mlp_fc.*'diagonal'"):
        rewrite(build_model(config), config, dataclasses.replace(plan, ops=ops), tp)
    ops = tuple(o for o in plan.ops if o.node != "layers_1_attn_core")
    with pytest.raises(PlanError, match="layers_1_attn_core.*missing"):
        rewrite(build_model(config), config, dataclasses.replace(plan, ops=ops), tp)
