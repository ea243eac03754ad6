"""Training health and bounded faults in the runtime (runtime.health, runtime.collectives), on 4
gloo ranks and without processes.

    token range   ids outside the vocabulary are refused at train_step's entry, on every rank,
                  as the single-device model refuses them (the vocab-parallel loss would mask them)
    gradient norm RankProgram.grad_norm equals the single-device model's gradient norm
    divergence    a NaN in one parameter's gradient on ONE rank stops train_step on EVERY rank
                  (dp2 x tp2 and pp2 x tp2: the rank without that parameter learns its name too),
                  naming the step and that parameter, with no optimizer step taken: the next good
                  step trains exactly as a single process that never saw the bad one
    option        with check_finite=False the same NaN trains on, and a step issues one
                  collective less on tp than with the check (runtime.counting predicts both)
    timeout       a collective that waits for a stalled rank longer than its group's timeout
                  (build_axis_groups(timeout=...), which parallelize(timeout_s=...) passes to
                  every group) fails on every waiting rank with a CollectiveError naming the
                  collective, the group and the rank, instead of hanging

The end-to-end runs (`autoplan.train` diverging, with a stalled rank, with a killed rank under
torchrun's restarts) are in test_train_faults.
"""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch

from _dist import assert_matches, batches, make_plan, reference, spawn

SEED, LR, EPS = 3, 1e-3, 1e-6
TIMEOUT_S = 1.5


def test_token_range_names_the_value_its_place_and_the_range():
    from autoplan.errors import ConfigError
    from autoplan.runtime.health import check_token_range

    tokens, targets = torch.zeros(2, 4, dtype=torch.int64), torch.ones(2, 4, dtype=torch.int64)
    targets[1, 2] = -100  # ignored, as by F.cross_entropy
    check_token_range(tokens, targets, 128)
    targets[1, 3] = 128
    with pytest.raises(ConfigError, match=r"target 128 at \(row, column\) \(1, 3\) of the global "
                                          r"batch .* expected 0 <= target < 128 or -100"):
        check_token_range(tokens, targets, 128)
    tokens[0, 1] = -100  # the ignore index is no token
    with pytest.raises(ConfigError, match=r"token -100 at \(row, column\) \(0, 1\) .* "
                                          r"expected 0 <= token < 128, as"):
        check_token_range(tokens, targets, 128)


def test_out_of_range_targets_fail_the_eager_model_too():
    """The behaviour the runtime copies: the single-device model refuses such a target."""
    from autoplan.models import build_model, get_model_config

    config = get_model_config("tiny-gpt")
    model = build_model(config, device="cpu")
    tokens = torch.zeros(1, 8, dtype=torch.int64)
    with pytest.raises(IndexError):
        model(tokens, torch.full_like(tokens, config.vocab))


# ------------------------------------------------------------------------------ in the ranks


def _poison(program, rank: int, world: int):
    """On the last rank only: a hook that turns its last parameter's gradient into NaN."""
    if rank != world - 1:
        return None, None
    name, param = list(program.named_local_parameters())[-1]
    return name, param.register_hook(lambda g: torch.full_like(g, float("nan")))


def _diverge(rank: int, world: int, config, plan) -> dict:
    from autoplan.errors import ConfigError, TrainingDivergedError
    from autoplan.runtime.launch import parallelize
    from autoplan.models import build_model

    program = parallelize(build_model(config, "meta"), None, plan, seed=SEED, config=config)
    optimizer = program.make_optimizer(torch.optim.AdamW, lr=LR, eps=EPS)
    tokens, targets = batches(plan.global_batch, plan.seq_len, 2)
    out = {"losses": [], "vocab_error": None, "diverged": None}
    bad = targets[0].clone()
    bad[-1, -1] = config.vocab  # the last rank's token: every rank must still refuse the batch
    try:
        program.train_step(tokens[0], bad, optimizer)
    except ConfigError as exc:
        out["vocab_error"] = str(exc)
    out["losses"].append(program.train_step(tokens[0], targets[0], optimizer))
    out["grad_norm"], out["grads"] = program.grad_norm, program.full_gradients()
    victim, hook = _poison(program, rank, world)
    try:
        program.train_step(tokens[1], targets[1], optimizer)
    except TrainingDivergedError as exc:
        out["diverged"] = {"step": exc.step, "parameter": exc.parameter, "loss": exc.loss,
                           "message": str(exc)}
    if hook is not None:
        hook.remove()
    out["victim"] = victim
    out["losses"].append(program.train_step(tokens[1], targets[1], optimizer))
    out["params"], out["step"] = program.full_parameters(), program.step
    return out


def _unchecked(rank: int, world: int, config, plan) -> dict:
    from autoplan.models import build_model
    from autoplan.runtime.counting import expected_collectives
    from autoplan.runtime.launch import parallelize

    counts = {}
    for check in (True, False):
        program = parallelize(build_model(config, "meta"), None, plan, seed=SEED, config=config,
                              check_finite=check)
        optimizer = program.make_optimizer(torch.optim.AdamW, lr=LR, eps=EPS)
        tokens, targets = batches(plan.global_batch, plan.seq_len, 1)
        if not check:
            _poison(program, rank, world)
        with program.count_collectives() as counted:
            loss = program.train_step(tokens[0], targets[0], optimizer)
        counts[check] = (dict(counted), dict(expected_collectives(plan, config,
                                                                  check_finite=check)))
    nan = any(bool(p.detach().isnan().any()) for _, p in program.named_local_parameters())
    return {"counts": counts, "loss": loss, "nan_params": nan, "grad_norm": program.grad_norm}


def _stall(rank: int, world: int) -> dict:
    """The last rank stalls past the timeout and leaves; the others all-reduce over tp = world."""
    from autoplan.errors import CollectiveError
    from autoplan.mesh import MeshShape
    from autoplan.runtime import collectives as C
    from autoplan.runtime.groups import build_axis_groups

    groups = build_axis_groups(MeshShape(tp=world), rank, timeout=timedelta(seconds=TIMEOUT_S))
    if rank == world - 1:
        time.sleep(TIMEOUT_S + 1)
        return {}
    start = time.monotonic()
    try:
        C.all_reduce(torch.ones(3), groups["tp"].group)
    except CollectiveError as exc:
        return {"waited_s": time.monotonic() - start, "message": str(exc), "kind": exc.kind,
                "group": exc.group, "ranks": exc.ranks, "rank": exc.rank}
    return {"waited_s": time.monotonic() - start, "message": None}


def _run(rank: int, world: int, cases: list) -> dict:
    found = {cid: _diverge(rank, world, config, plan) for cid, config, plan in cases}
    cid, config, plan = cases[0]
    found["unchecked"] = _unchecked(rank, world, config, plan)
    found["stall"] = _stall(rank, world)  # last: it leaves that group broken
    return found


# ------------------------------------------------------------------------------ in pytest

CASES = [("gpt-dp2tp2-megatron", "tiny-gpt", dict(dp=2, tp=2, assignment="megatron")),
         ("llama-pp2tp2-megatron-sp", "tiny-llama", dict(dp=1, tp=2, pp=2, num_microbatches=2,
                                                          assignment="megatron-sp"))]


@pytest.fixture(scope="module")
def plans():
    from autoplan.models import get_model_config

    return [(cid, get_model_config(model), make_plan(model, kw.pop("dp"), kw.pop("tp"),
                                                     kw.pop("assignment"), **kw))
            for cid, model, kw in [(c, m, dict(k)) for c, m, k in CASES]]


@pytest.fixture(scope="module")
def results(plans):
    return spawn(_run, 4, plans)


@pytest.mark.gloo
def test_every_rank_refuses_a_target_outside_the_vocabulary(plans, results):
    for cid, config, _ in plans:
        for rank, out in enumerate(results):
            assert out[cid]["vocab_error"] is not None, f"{cid} rank {rank}"
            assert f"target {config.vocab} at (row, column)" in out[cid]["vocab_error"]


@pytest.mark.gloo
def test_grad_norm_is_the_single_device_norm(plans, results):
    for cid, config, plan in plans:
        tokens, targets = batches(plan.global_batch, plan.seq_len, 2)
        ref = reference(config, SEED, tokens, targets, LR, EPS)
        want = torch.stack([g.norm() for g in ref["grads"].values()]).norm().item()
        for rank, out in enumerate(results):
            assert out[cid]["grad_norm"] == pytest.approx(want, rel=1e-5), f"{cid} rank {rank}"


@pytest.mark.gloo
def test_one_ranks_nan_gradient_stops_every_rank_before_the_update(plans, results):
    for cid, config, plan in plans:
        victim = results[-1][cid]["victim"]
        tokens, targets = batches(plan.global_batch, plan.seq_len, 2)
        ref = reference(config, SEED, tokens, targets, LR, EPS)
        for rank, out in enumerate(results):
            diverged = out[cid]["diverged"]
            assert diverged is not None, f"{cid} rank {rank} trained on"
            assert diverged["step"] == 1 and diverged["parameter"] == victim, (cid, rank, diverged)
            assert "training diverged at step 1" in diverged["message"]
            assert f"first parameter with a non-finite gradient: {victim}" in diverged["message"]
            assert diverged["loss"] == pytest.approx(ref["losses"][1], rel=1e-5)
            # the refused step took no optimizer step: the retried one matches one process
            assert_matches(out[cid], ref, f"{cid} rank {rank}")
            assert out[cid]["step"] == 2


@pytest.mark.gloo
def test_without_the_check_a_nan_trains_on_and_one_tp_collective_is_saved(results):
    for rank, out in enumerate(results):
        unchecked = out["unchecked"]
        for check, (got, want) in unchecked["counts"].items():
            assert got == want, f"rank {rank} check_finite={check}"
        assert sum(unchecked["counts"][True][0].values()) == \
            sum(unchecked["counts"][False][0].values()) + 1
        assert unchecked["grad_norm"] is None
    assert any(out["unchecked"]["nan_params"] for out in results)  # the update took the NaN


@pytest.mark.gloo
def test_a_collective_waiting_past_the_timeout_names_itself_its_group_and_rank(results):
    for rank, out in enumerate(results[:-1]):
        stall = out["stall"]
        assert stall["message"] is not None, f"rank {rank}: the all-reduce returned alone"
        assert TIMEOUT_S - 0.5 < stall["waited_s"] < TIMEOUT_S + 5, stall
        assert (stall["kind"], stall["group"], stall["ranks"], stall["rank"]) == \
            ("all_reduce", "tp", [0, 1, 2, 3], rank)
        assert stall["message"].startswith(f"rank {rank}: all_reduce over process group 'tp' "
                                           f"(ranks [0, 1, 2, 3]) failed: "), stall["message"]
        assert "did not join within the process group's timeout" in stall["message"]
