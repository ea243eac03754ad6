"""Checkpoints through torch.distributed.checkpoint, on 4 gloo ranks: a run saved under one plan
resumes under another and continues as the uninterrupted run would.

tiny-gpt: 3 AdamW steps under dp2 x tp2 (Megatron), save; then, from fresh programs of other plans
(another init seed, so every value must come from the checkpoint), load and take steps 4 and 5:

    same plan                  bit for bit equal to 5 uninterrupted steps under the save plan
    dp4 (ZeRO 1), tp4, dp2 x tp2 with random strategies and ZeRO 3, pp2 x dp2 (ZeRO 1)
                               equal to 5 single-process steps (the parity tolerances)

tiny-moe: saved under ep2 x dp2 with ZeRO 1 (each rank saves the optimizer states it owns), resumed
under dp2 x tp2 (Megatron, experts split on their FFN dim) with ZeRO 3, and under ep2 x tp2 with
etp = 1 (whole experts spread over the 4 ranks: Shard(0) on both ep and tp).

`autoplan.train --save/--resume`: 3 steps + resume to 5 equals 5 steps, loss for loss.

Bad input, each leaving the existing checkpoint as it was: saving another model's program over it,
loading it into another model's program (both messages name both fingerprints), loading its AdamW
states into another optimizer, a save that crashes halfway (only a `.tmp-*` directory is left, the
next save removes it).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from _dist import assert_matches, batches, make_plan, reference, spawn, train_program

pytestmark = pytest.mark.gloo

SEED, RESUME_SEED, LR, EPS, SEQ, BATCH = 5, 99, 1e-3, 1e-6, 16, 4

RESUMES = {  # id: make_plan arguments (global batch 4 for each)
    "same": dict(dp=2, tp=2, assignment="megatron", microbatch_size=2),
    "dp4-zero1": dict(dp=4, zero_stage=1),
    "tp4-megatron": dict(tp=4, assignment="megatron", microbatch_size=4),
    "dp2tp2-random-zero3": dict(dp=2, tp=2, assignment="random:3", microbatch_size=2,
                                zero_stage=3),
    "pp2dp2-zero1": dict(pp=2, dp=2, num_microbatches=2, zero_stage=1),
}
MOE_SAVE = dict(ep=2, dp=2, zero_stage=1)
MOE_RESUME = dict(dp=2, tp=2, assignment="megatron", microbatch_size=2, zero_stage=3)
MOE_RESUME_ETP1 = dict(ep=2, tp=2, etp=1, assignment="megatron-sp", microbatch_size=2)


def _plan(model: str, kwargs: dict):
    kwargs = dict(kwargs)
    dp, tp = kwargs.pop("dp", 1), kwargs.pop("tp", 1)
    return make_plan(model, dp, tp, kwargs.pop("assignment", "replicate"), seq_len=SEQ, **kwargs)


# ------------------------------------------------------------------------------ in the ranks


def _program(plan, seed: int = SEED):
    from autoplan.models import build_model, get_model_config
    from autoplan.runtime.launch import parallelize

    config = get_model_config(plan.model.name)
    program = parallelize(build_model(config), None, plan, seed=seed, config=config)
    program.make_optimizer(torch.optim.AdamW, lr=LR, eps=EPS)
    return program


def _save_and_resume(save_plan, resumes: dict, directory: Path, steps_before: int = 3) -> dict:
    tokens, targets = batches(BATCH, SEQ, 5)
    program = _program(save_plan)
    first = train_program(program, program.optimizer, tokens[:steps_before],
                          targets[:steps_before])
    program.save_checkpoint(directory, step=steps_before)
    out = {"first": first["losses"], "first_params": first["params"]}
    for cid, plan in resumes.items():
        program = _program(plan, RESUME_SEED)
        meta = program.load_checkpoint(directory)
        out[cid] = train_program(program, program.optimizer, tokens[steps_before:],
                                 targets[steps_before:])
        out[cid]["step"] = meta["step"]
    return out


def _listing(directory: Path) -> dict:
    return {str(p.relative_to(directory.parent)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(directory.parent.rglob("*")) if p.is_file()}


def _refusals(gpt_dir: Path, llama_plan, gpt_plan) -> dict:
    """Another model's program may neither overwrite nor load the gpt checkpoint; an optimizer of
    another kind may not load its AdamW states."""
    from autoplan.runtime.checkpoint import CheckpointError

    program, out, before = _program(llama_plan), {}, _listing(gpt_dir)
    for action in ("save", "load"):
        try:
            if action == "save":
                program.save_checkpoint(gpt_dir, step=1)
            else:
                program.load_checkpoint(gpt_dir)
            out[action] = "no error"
        except CheckpointError as exc:
            out[action] = str(exc)
    sgd = _program(gpt_plan)
    sgd.make_optimizer(torch.optim.SGD, lr=LR)
    try:
        sgd.load_checkpoint(gpt_dir)
        out["optimizer"] = "no error"
    except CheckpointError as exc:
        out["optimizer"] = str(exc)
    out["untouched"] = _listing(gpt_dir) == before
    return out


def _crashed_save(gpt_dir: Path, save_plan) -> dict:
    """A save that dies after writing part of its files leaves the previous checkpoint loadable."""
    import torch.distributed.checkpoint as dcp

    program = _program(save_plan, seed=7)  # other values than the checkpoint's
    real = dcp.save

    def crash(state_dict, *, checkpoint_id, **kwargs):
        Path(checkpoint_id).mkdir(parents=True, exist_ok=True)
        (Path(checkpoint_id) / f"__{torch.distributed.get_rank()}_0.distcp").write_bytes(b"half")
        raise RuntimeError("simulated crash")

    dcp.save = crash
    try:
        program.save_checkpoint(gpt_dir, step=99)
        crashed = False
    except RuntimeError:
        crashed = True
    finally:
        dcp.save = real
    torch.distributed.barrier()
    stale = sorted(p.name for p in gpt_dir.parent.glob(gpt_dir.name + ".tmp-*"))
    step = program.load_checkpoint(gpt_dir)["step"]
    params = program.full_parameters()
    program.save_checkpoint(gpt_dir, step=step)  # a good save clears what the crash left
    torch.distributed.barrier()
    left = sorted(p.name for p in gpt_dir.parent.glob(gpt_dir.name + ".*"))
    return {"crashed": crashed, "stale": stale, "step": step, "params": params, "left": left}


def _train_cli(rank: int, plan_file: str, directory: Path) -> dict:
    from autoplan.train import build_parser, train

    base = ["--model", "tiny-gpt", "--plan", plan_file, "--lr", "1e-3", "--seed", "3"]
    whole = train(build_parser().parse_args(base + ["--steps", "5"]))
    first = train(build_parser().parse_args(base + ["--steps", "3", "--save", str(directory)]))
    rest = train(build_parser().parse_args(base + ["--steps", "5", "--resume", str(directory)]))
    return {"whole": whole, "first": first, "rest": rest}


def _run_all(rank: int, world: int, plans: dict, root: str) -> dict:
    root = Path(root)
    tokens, targets = batches(BATCH, SEQ, 5)
    program = _program(plans["save"])
    out = {"uninterrupted": train_program(program, program.optimizer, tokens, targets)}
    out["gpt"] = _save_and_resume(plans["save"], plans["resumes"], root / "gpt")
    out["moe"] = _save_and_resume(plans["moe_save"], {"moe": plans["moe_resume"],
                                                      "moe-etp1": plans["moe_resume_etp1"]},
                                  root / "moe")
    out["files"] = sorted(p.name for p in root.iterdir())
    out["metadata"] = json.loads((root / "gpt" / "autoplan.json").read_text())
    out["refusals"] = _refusals(root / "gpt", plans["llama"], plans["save"])
    out["crash"] = _crashed_save(root / "gpt", plans["save"])
    out["cli"] = _train_cli(rank, plans["plan_file"], root / "cli")
    return out


# ------------------------------------------------------------------------------ in pytest


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    root = tmp_path_factory.mktemp("checkpoints")
    save = _plan("tiny-gpt", RESUMES["same"])
    plan_file = root / "plan.json"
    save.save(plan_file)
    plans = {"save": save, "resumes": {cid: _plan("tiny-gpt", kw) for cid, kw in RESUMES.items()},
             "moe_save": _plan("tiny-moe", MOE_SAVE), "moe_resume": _plan("tiny-moe", MOE_RESUME),
             "moe_resume_etp1": _plan("tiny-moe", MOE_RESUME_ETP1),
             "llama": _plan("tiny-llama", dict(dp=2, tp=2, assignment="megatron",
                                               microbatch_size=2)),
             "plan_file": str(plan_file)}
    (root / "runs").mkdir()
    return spawn(_run_all, 4, plans, str(root / "runs"))


def _reference(model: str) -> dict:
    from autoplan.models import get_model_config

    tokens, targets = batches(BATCH, SEQ, 5)
    return reference(get_model_config(model), SEED, tokens, targets, LR, EPS)


@pytest.fixture(scope="module")
def references() -> dict:
    return {m: _reference(m) for m in ("tiny-gpt", "tiny-moe")}


def _continued(ref: dict) -> dict:
    """The reference's steps 4 and 5 and its final parameters."""
    return {"losses": ref["losses"][3:], "params": ref["params"], "grads": None}


@pytest.mark.parametrize("cid", RESUMES)
def test_resume_under_another_plan_continues_the_run(results, references, cid):
    ref = references["tiny-gpt"]
    for rank, out in enumerate(results):
        torch.testing.assert_close(torch.tensor(out["gpt"]["first"]),
                                   torch.tensor(ref["losses"][:3]), rtol=1e-5, atol=0)
        assert out["gpt"][cid]["step"] == 3
        assert_matches(out["gpt"][cid], _continued(ref), f"{cid} rank {rank}", grads=False)


def test_resume_under_the_same_plan_is_bit_for_bit(results):
    for out in results:
        whole, resumed = out["uninterrupted"], out["gpt"]["same"]
        assert out["gpt"]["first"] + resumed["losses"] == whole["losses"]
        for name, value in whole["params"].items():
            assert torch.equal(resumed["params"][name], value), name


def test_expert_parallel_zero1_checkpoint_resumes_under_tensor_parallel_zero3(results, references):
    ref = references["tiny-moe"]
    for rank, out in enumerate(results):
        torch.testing.assert_close(torch.tensor(out["moe"]["first"]),
                                   torch.tensor(ref["losses"][:3]), rtol=1e-5, atol=0)
        assert_matches(out["moe"]["moe"], _continued(ref), f"moe rank {rank}", grads=False)
        assert_matches(out["moe"]["moe-etp1"], _continued(ref), f"moe etp1 rank {rank}",
                       grads=False)


def test_saves_are_atomic_and_describe_themselves(results):
    from autoplan.models import get_model_config

    out = results[0]
    assert out["files"] == ["gpt", "moe"]  # no .tmp-* or .old-* left behind
    meta, gpt = out["metadata"], get_model_config("tiny-gpt")
    assert meta["model"] == {"name": "tiny-gpt", "fingerprint": gpt.fingerprint()}
    assert meta["step"] == 3 and meta["mesh"]["tp"] == 2
    assert meta["parameters"]["lm_head.weight"] == [gpt.vocab, gpt.hidden]  # full shapes


def test_another_models_checkpoint_is_refused_and_left_intact(results):
    from autoplan.models import get_model_config

    gpt, llama = (get_model_config(m).fingerprint() for m in ("tiny-gpt", "tiny-llama"))
    for out in results:
        refusals = out["refusals"]
        for action in ("save", "load"):
            assert gpt in refusals[action] and llama in refusals[action], refusals[action]
        assert "refusing to overwrite" in refusals["save"]
        assert "optimizer states of AdamW, but the optimizer to load into is a SGD" in \
            refusals["optimizer"]
        assert refusals["untouched"]


def test_a_crashed_save_leaves_the_previous_checkpoint(results):
    for out in results:
        crash = out["crash"]
        assert crash["crashed"] and len(crash["stale"]) == 1 and crash["stale"][0].startswith(
            "gpt.tmp-")
        assert crash["step"] == 3  # the checkpoint saved before, not the crashed one
        for name, value in out["gpt"]["first_params"].items():  # its values, as saved
            assert torch.equal(crash["params"][name], value), name
        assert crash["left"] == []  # the next good save removed the stale directory


def test_train_cli_resumes_to_the_same_losses(results):
    for out in results:
        cli = out["cli"]
        assert cli["first"] + cli["rest"] == cli["whole"]
        assert len(cli["rest"]) == 2


def test_an_interrupted_swap_is_found_at_the_old_name(tmp_path):
    from autoplan.runtime.checkpoint import CheckpointError, resolve

    (tmp_path / "ck.old-1234").mkdir()
    (tmp_path / "ck.old-1234" / "autoplan.json").write_text('{"kind": "autoplan-checkpoint"}')
    (tmp_path / "ck.old-9999").mkdir()  # newer, but no manifest: not a checkpoint
    (tmp_path / "ck.old-9999" / "notes.txt").write_text("a user's")
    assert resolve(tmp_path / "ck") == tmp_path / "ck.old-1234"
    with pytest.raises(CheckpointError, match="does not exist"):
        resolve(tmp_path / "other")
