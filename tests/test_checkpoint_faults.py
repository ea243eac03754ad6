"""Checkpoints that keep what they should, on 2 gloo ranks (tiny-gpt, tp2), spawned once:

    a save onto a folder of the user's files        refused, naming it; the files are untouched
    the user's `ck.tmp-user` beside a checkpoint    survives saves (and so does a hex-named one)
    a crafted `.metadata` (os.system payload)       nothing runs; refused, with its checksum
                                                    forged in the manifest or not
    a shard with flipped bytes / truncated / gone   refused before DCP reads it, the file named
    a checkpoint of format 1 (before checksums)     loads, with a warning; a shard gone: a
                                                    CheckpointError from DCP's failure
    --save-every 1 --keep 2 over 4 steps            step-000003 and step-000004 kept, the user's
                                                    folder beside them too
    --resume of that folder                         continues from step 4, loss for loss
    its newest damaged                              the one before is loaded, with a warning
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import warnings
from pathlib import Path

import pytest
from _crafted import Call
import torch

from _dist import batches, make_plan, spawn

pytestmark = pytest.mark.gloo

SEED, LR, SEQ, BATCH = 5, 1e-3, 16, 4
PLAN = dict(assignment="megatron", microbatch_size=4)



# ------------------------------------------------------------------------------ in the ranks


def _program(plan):
    from autoplan.models import build_model, get_model_config
    from autoplan.runtime.launch import parallelize

    config = get_model_config(plan.model.name)
    program = parallelize(build_model(config), None, plan, seed=SEED, config=config)
    program.make_optimizer(torch.optim.AdamW, lr=LR)
    return program


def _error(action) -> str:
    from autoplan.runtime.checkpoint import CheckpointError

    try:
        action()
    except CheckpointError as exc:
        return str(exc)
    return "no error"


def _on_rank0(rank: int, action) -> None:
    """Let rank 0 change the files, and every rank see the change."""
    if rank == 0:
        action()
    torch.distributed.barrier()


def _tree(directory: Path) -> dict:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*"))
            if p.is_file()}


def _onto_users_folder(rank: int, program, root: Path) -> dict:
    mine = root / "mine"

    def fill():
        (mine / "sub").mkdir(parents=True)
        (mine / "thesis.tex").write_text("years of work")
        (mine / "sub" / "data.csv").write_text("1,2,3")

    _on_rank0(rank, fill)
    before = _tree(mine)
    error = _error(lambda: program.save_checkpoint(mine, step=1))
    return {"error": error, "untouched": _tree(mine) == before,
            "siblings": sorted(p.name for p in root.iterdir() if p.name.startswith("mine"))}


def _siblings_survive(rank: int, program, root: Path) -> dict:
    users = ("ck.tmp-user", "ck.old-user", "ck.tmp-00000000deadbeef")

    def fill():
        for name in users:
            (root / name).mkdir()
            (root / name / "keep.txt").write_text(name)

    _on_rank0(rank, fill)
    program.save_checkpoint(root / "ck", step=1)
    program.save_checkpoint(root / "ck", step=2)  # replaces the first
    torch.distributed.barrier()
    return {"names": sorted(p.name for p in root.iterdir() if p.name.startswith("ck")),
            "kept": all((root / n / "keep.txt").read_text() == n for n in users),
            "step": json.loads((root / "ck" / "autoplan.json").read_text())["step"]}


def _crafted(rank: int, program, good: Path, root: Path) -> dict:
    """`.metadata` replaced by a pickle that would create a marker file, with the manifest's
    checksum forged to match (as whoever can write the one can write the other) or not."""
    from autoplan.runtime.checkpoint_files import digest

    marker, out = root / "pwned", {}
    for forged in (True, False):
        evil = root / f"evil-{forged}"

        def craft():
            shutil.copytree(good, evil)
            (evil / ".metadata").write_bytes(pickle.dumps(Call(os.system, f"touch {marker}")))
            if forged:
                manifest = json.loads((evil / "autoplan.json").read_text())
                manifest["files"][".metadata"] = digest(evil / ".metadata")
                (evil / "autoplan.json").write_text(json.dumps(manifest))

        _on_rank0(rank, craft)
        out[forged] = _error(lambda: program.load_checkpoint(evil))
        torch.distributed.barrier()
        out[f"ran-{forged}"] = marker.exists()
    return out


def _damaged(rank: int, program, good: Path, root: Path, how: str) -> dict:
    target = root / how
    shard = sorted(p.name for p in good.glob("*.distcp"))[-1]

    def damage():
        shutil.copytree(good, target)
        data = bytearray((target / shard).read_bytes())
        if how == "flipped":
            data[len(data) // 2] ^= 0x10
            (target / shard).write_bytes(bytes(data))
        elif how == "truncated":
            (target / shard).write_bytes(bytes(data[: len(data) - 7]))
        else:
            (target / shard).unlink()

    _on_rank0(rank, damage)
    before = program.full_parameters()
    error = _error(lambda: program.load_checkpoint(target))
    after = program.full_parameters()
    return {"error": error, "shard": shard,
            "unchanged": all(torch.equal(after[n], v) for n, v in before.items())}


def _format1(rank: int, program, good: Path, root: Path) -> dict:
    """A checkpoint as saved before checksums loads, with a warning; with a shard gone, DCP's
    failure comes back as a CheckpointError."""
    old = root / "format1"

    def downgrade():
        shutil.copytree(good, old)
        manifest = json.loads((old / "autoplan.json").read_text())
        for key in ("kind", "files"):
            del manifest[key]
        (old / "autoplan.json").write_text(json.dumps(dict(manifest, format=1)))
        (old / ".autoplan-save").unlink()

    _on_rank0(rank, downgrade)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step = program.load_checkpoint(old)["step"]
    _on_rank0(rank, lambda: (old / "__1_0.distcp").unlink())
    return {"step": step, "warnings": [str(w.message) for w in caught],
            "gone": _error(lambda: program.load_checkpoint(old))}


def _numbered(rank: int, plan_file: str, parent: Path) -> dict:
    from autoplan.train import build_parser, train

    def run(*extra: str) -> list[float]:
        base = ["--model", "tiny-gpt", "--plan", plan_file, "--lr", "1e-3", "--seed", "3"]
        return train(build_parser().parse_args(base + list(extra)))

    _on_rank0(rank, lambda: (parent / "notes").mkdir(parents=True))
    whole = run("--steps", "5")
    first = run("--steps", "4", "--save", str(parent), "--save-every", "1", "--keep", "2")
    kept = sorted(p.name for p in parent.iterdir())
    rest = run("--steps", "5", "--resume", str(parent))
    return {"whole": whole, "first": first, "rest": rest, "kept": kept}


def _newest_damaged(rank: int, plan, parent: Path) -> dict:
    def damage():
        shard = sorted((parent / "step-000004").glob("*.distcp"))[0]
        data = bytearray(shard.read_bytes())
        data[len(data) // 3] ^= 0x01
        shard.write_bytes(bytes(data))

    _on_rank0(rank, damage)
    program = _program(plan)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step = program.load_checkpoint(parent)["step"]
    return {"step": step, "warnings": [str(w.message) for w in caught
                                       if "do not verify" in str(w.message)]}


def _run_all(rank: int, world: int, plan, plan_file: str, root: str) -> dict:
    root = Path(root)
    tokens, targets = batches(BATCH, SEQ, 1)
    program = _program(plan)
    program.train_step(tokens[0], targets[0], program.optimizer)
    good = root / "good"
    program.save_checkpoint(good, step=1)
    out = {"files": sorted(p.name for p in good.iterdir())}
    out["user"] = _onto_users_folder(rank, program, root)
    out["siblings"] = _siblings_survive(rank, program, root)
    out["crafted"] = _crafted(rank, program, good, root)
    for how in ("flipped", "truncated", "missing"):
        out[how] = _damaged(rank, program, good, root, how)
    out["format1"] = _format1(rank, program, good, root)
    out["numbered"] = _numbered(rank, plan_file, root / "numbered")
    out["newest_damaged"] = _newest_damaged(rank, plan, root / "numbered")
    return out


# ------------------------------------------------------------------------------ in pytest


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    root = tmp_path_factory.mktemp("faults")
    plan = make_plan("tiny-gpt", 1, 2, PLAN["assignment"], seq_len=SEQ,
                     microbatch_size=PLAN["microbatch_size"])
    plan.save(root / "plan.json")
    (root / "runs").mkdir()
    return spawn(_run_all, 2, plan, str(root / "plan.json"), str(root / "runs"))


def test_each_rank_writes_a_shard_and_the_manifest_records_them(results):
    assert results[0]["files"] == [".autoplan-save", ".metadata", "__0_0.distcp",
                                   "__1_0.distcp", "autoplan.json"]


def test_a_save_onto_the_users_folder_is_refused_and_leaves_it(results):
    for out in results:
        user = out["user"]
        assert "refusing to save a checkpoint to" in user["error"], user["error"]
        assert "/mine'" in user["error"] and "choose a new or empty directory" in user["error"]
        assert user["untouched"] and user["siblings"] == ["mine"]  # no temporary left either


def test_the_users_tmp_and_old_folders_beside_a_checkpoint_survive(results):
    for out in results:
        siblings = out["siblings"]
        assert siblings["names"] == ["ck", "ck.old-user", "ck.tmp-00000000deadbeef",
                                     "ck.tmp-user"]
        assert siblings["kept"] and siblings["step"] == 2


def test_a_crafted_metadata_runs_nothing_and_is_refused(results):
    for out in results:
        crafted = out["crafted"]
        assert not crafted["ran-True"] and not crafted["ran-False"]
        assert "is not a type of DCP's metadata" in crafted[True], crafted[True]
        assert "posix.system" in crafted[True] and "nothing of it was run" in crafted[True]
        assert re.search(r"file '\.metadata' has \d+ bytes but was saved with \d+",
                         crafted[False]), crafted[False]


@pytest.mark.parametrize("how, says", [("flipped", "does not match the SHA-256"),
                                       ("truncated", "bytes but was saved with"),
                                       ("missing", "is missing")])
def test_a_damaged_shard_is_refused_by_name(results, how, says):
    for out in results:
        damaged = out[how]
        assert f"file {damaged['shard']!r}" in damaged["error"], damaged["error"]
        assert says in damaged["error"] and damaged["unchanged"]


def test_a_checkpoint_saved_before_checksums_loads_with_a_warning(results):
    for rank, out in enumerate(results):
        format1 = out["format1"]
        assert format1["step"] == 1
        unverified = [w for w in format1["warnings"] if "without checksums" in w]
        assert len(unverified) == (1 if rank == 0 else 0), format1["warnings"]
        assert "reading checkpoint" in format1["gone"] and "__1_0.distcp" in format1["gone"], \
            format1["gone"]


def test_keep_keeps_the_newest_numbered_checkpoints_and_the_users_folder(results):
    for out in results:
        assert out["numbered"]["kept"] == ["notes", "step-000003", "step-000004"]


def test_resume_of_the_folder_continues_from_the_newest(results):
    for out in results:
        numbered = out["numbered"]
        assert len(numbered["rest"]) == 1
        assert numbered["first"] + numbered["rest"] == numbered["whole"]


def test_a_damaged_newest_checkpoint_falls_back_to_the_one_before_with_a_warning(results):
    assert results[0]["newest_damaged"]["step"] == 3
    assert results[1]["newest_damaged"]["step"] == 3
    assert len(results[0]["newest_damaged"]["warnings"]) == 1  # rank 0 warns
    assert "step-000004" in results[0]["newest_damaged"]["warnings"][0]
