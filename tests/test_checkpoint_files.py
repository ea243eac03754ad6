"""The files of checkpoints, in one process (no process group): the restricted reader of DCP's
`.metadata` (a real one reads back equal; crafted ones run nothing), the per-file checks of the
manifest, which directories a save may replace or clean up, and numbered checkpoints.
"""

from __future__ import annotations

import builtins
import json
import os
import pickle
import subprocess
import warnings
from pathlib import Path

import pytest
from _crafted import Call
import torch

from autoplan.runtime.checkpoint_files import (KIND, MANIFEST, MARKER, CheckpointError, begin,
                                               candidates, digest, prune_series, remove_leftovers,
                                               series, swap_into_place, target_error, verify_file)
from autoplan.runtime import checkpoint_reader as reader
from autoplan.runtime.checkpoint_reader import read_dcp_metadata


def _dcp_checkpoint(directory: Path) -> None:
    import torch.distributed.checkpoint as dcp

    state = {"w": torch.randn(3, 4), "step": torch.tensor(2.0),
             "h": torch.zeros(2, dtype=torch.bfloat16)}
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(directory))


def _manifest(directory: Path, step: int = 0) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / MANIFEST).write_text(json.dumps({"kind": KIND, "format": 2, "step": step}))
    return directory



# ------------------------------------------------------------------ restricted unpickler


def test_a_real_dcp_metadata_reads_back_equal(tmp_path):
    _dcp_checkpoint(tmp_path / "ck")
    with open(tmp_path / "ck" / ".metadata", "rb") as handle:
        expected = pickle.load(handle)  # our own file, written just above
    got = read_dcp_metadata(tmp_path / "ck")
    assert got.state_dict_metadata == expected.state_dict_metadata
    assert got.storage_data == expected.storage_data


def _payloads(marker: Path) -> dict:
    touch = f"open({str(marker)!r}, 'w').close()"
    return {"os.system": Call(os.system, f"touch {marker}"),
            "builtins.exec": Call(builtins.exec, touch),
            "builtins.eval": Call(builtins.eval, touch),
            "subprocess.Popen": Call(subprocess.Popen, ["touch", str(marker)]),
            "torch.load": Call(torch.load, str(marker))}


@pytest.mark.parametrize("kind", ["os.system", "builtins.exec", "builtins.eval",
                                  "subprocess.Popen", "torch.load"])
def test_crafted_metadata_runs_nothing(tmp_path, kind):
    """A payload alone, and one hidden inside a genuine Metadata (as its storage_meta)."""
    _dcp_checkpoint(tmp_path / "ck")
    marker = tmp_path / "pwned"
    real = pickle.loads((tmp_path / "ck" / ".metadata").read_bytes())
    real.storage_meta = _payloads(marker)[kind]
    for payload in (_payloads(marker)[kind], real):
        (tmp_path / "ck" / ".metadata").write_bytes(pickle.dumps(payload))
        with pytest.raises(CheckpointError, match="nothing of it was run") as caught:
            read_dcp_metadata(tmp_path / "ck")
        assert "is not a type of DCP's metadata" in str(caught.value)
        assert not marker.exists()


def test_metadata_that_declares_bytes_is_refused(tmp_path, monkeypatch):
    """DCP would read a bytes entry with torch.load(weights_only=False): a second way in."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    _dcp_checkpoint(tmp_path / "ck")
    real = pickle.loads((tmp_path / "ck" / ".metadata").read_bytes())
    real.state_dict_metadata["w"] = BytesStorageMetadata()
    (tmp_path / "ck" / ".metadata").write_bytes(pickle.dumps(real))
    with pytest.raises(CheckpointError, match="BytesStorageMetadata is not a type"):
        read_dcp_metadata(tmp_path / "ck")
    bytes_type = (BytesStorageMetadata.__module__, "BytesStorageMetadata")
    monkeypatch.setattr(reader, "ALLOWED", reader.ALLOWED | {bytes_type})  # a later guard too
    with pytest.raises(CheckpointError, match=r"declares entries that are not tensors \(\['w'\]"):
        read_dcp_metadata(tmp_path / "ck")


def test_damaged_or_foreign_metadata_is_a_checkpoint_error(tmp_path):
    _dcp_checkpoint(tmp_path / "ck")
    path = tmp_path / "ck" / ".metadata"
    path.write_bytes(path.read_bytes()[:40])
    with pytest.raises(CheckpointError, match=r"\.metadata"):
        read_dcp_metadata(tmp_path / "ck")
    path.write_bytes(pickle.dumps(torch.Size([2, 3])))  # allowed types, but not a Metadata
    with pytest.raises(CheckpointError, match="holds a Size, not DCP checkpoint metadata"):
        read_dcp_metadata(tmp_path / "ck")
    path.unlink()
    with pytest.raises(CheckpointError, match="No such file"):
        read_dcp_metadata(tmp_path / "ck")


# ------------------------------------------------------------------ checksums


def test_verify_file_names_what_differs(tmp_path):
    path = tmp_path / "__0_0.distcp"
    path.write_bytes(bytes(range(256)) * 8)
    record = digest(path)
    assert record["bytes"] == 2048 and verify_file(tmp_path, path.name, record) is None
    data = bytearray(path.read_bytes())
    data[1000] ^= 0x01
    path.write_bytes(bytes(data))
    assert "'__0_0.distcp' does not match the SHA-256" in verify_file(tmp_path, path.name, record)
    path.write_bytes(bytes(data[:1000]))
    assert "has 1000 bytes but was saved with 2048" in verify_file(tmp_path, path.name, record)
    path.unlink()
    assert "'__0_0.distcp' is missing" in verify_file(tmp_path, path.name, record)
    assert "outside the checkpoint" in verify_file(tmp_path, "../x", record)
    assert "damaged record" in verify_file(tmp_path, "a", {"bytes": 1})


# ------------------------------------------------------------------ ownership


def test_only_new_empty_or_checkpoint_directories_may_be_replaced(tmp_path):
    assert target_error(tmp_path / "new") is None
    (tmp_path / "empty").mkdir()
    assert target_error(tmp_path / "empty") is None
    assert target_error(_manifest(tmp_path / "ck")) is None
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "thesis.tex").write_text("years of work")
    error = target_error(tmp_path / "mine")
    assert str(tmp_path / "mine") in error and "choose a new or empty directory" in error
    (tmp_path / "file").write_text("x")
    assert "is not a directory" in target_error(tmp_path / "file")
    (tmp_path / "foreign").mkdir()  # an autoplan.json that autoplan did not write
    (tmp_path / "foreign" / MANIFEST).write_text('{"format": 7}')
    assert "holds no autoplan checkpoint" in target_error(tmp_path / "foreign")


def test_leftovers_go_only_when_marked_with_their_token(tmp_path):
    begin(tmp_path / "ck.tmp-00ab", "00ab")  # a crashed save's
    begin(tmp_path / "ck.old-00cd", "00cd")
    begin(tmp_path / "ck.tmp-00ef", "1234")  # marked, but not with its own token
    begin(tmp_path / "other.tmp-0011", "0011")  # another checkpoint's
    (tmp_path / "ck.tmp-user").mkdir()
    (tmp_path / "ck.tmp-user" / "data.csv").write_text("1,2")
    (tmp_path / "ck.old-0099").mkdir()  # token-like name, no marker
    removed = remove_leftovers(tmp_path, lambda stem: stem == "ck")
    assert removed == ["ck.old-00cd", "ck.tmp-00ab"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "ck.old-0099", "ck.tmp-00ef", "ck.tmp-user", "other.tmp-0011"]
    assert (tmp_path / "ck.tmp-user" / "data.csv").read_text() == "1,2"


def test_swap_replaces_a_checkpoint_or_an_empty_directory_but_no_users_files(tmp_path):
    for name in ("ck", "empty"):
        begin(tmp_path / f"{name}.tmp-01", "01")
        _manifest(tmp_path / f"{name}.tmp-01", step=2)
    _manifest(tmp_path / "ck", step=1)
    (tmp_path / "empty").mkdir()
    swap_into_place(tmp_path / "ck.tmp-01", tmp_path / "ck", "01")
    swap_into_place(tmp_path / "empty.tmp-01", tmp_path / "empty", "01")
    for name in ("ck", "empty"):
        assert json.loads((tmp_path / name / MANIFEST).read_text())["step"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "empty"]  # old one deleted
    begin(tmp_path / "mine.tmp-02", "02")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(CheckpointError, match="complete at"):
        swap_into_place(tmp_path / "mine.tmp-02", tmp_path / "mine", "02")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    assert (tmp_path / "mine.tmp-02" / MARKER).is_file()


# ------------------------------------------------------------------ numbered checkpoints


def _series(parent: Path) -> None:
    for step in (10, 100, 20, 5):
        _manifest(parent / f"step-{step:06d}", step)
    (parent / "step-000200").mkdir()  # no manifest: not autoplan's (or never completed)
    (parent / "step-000200" / "x").write_text("x")
    (parent / "notes").mkdir()
    begin(parent / "step-000300.tmp-0a", "0a")  # a crashed numbered save


def test_numbered_checkpoints_newest_first_and_pruned(tmp_path):
    _series(tmp_path)
    assert [p.name for p in series(tmp_path)] == ["step-000100", "step-000020", "step-000010",
                                                  "step-000005"]
    assert candidates(tmp_path) == series(tmp_path)
    assert candidates(tmp_path / "step-000010") == [tmp_path / "step-000010"]
    removed = prune_series(tmp_path, 2, tmp_path / "step-000010")  # 10: the one just saved
    assert removed == ["step-000020", "step-000005", "step-000300.tmp-0a"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes", "step-000010", "step-000100",
                                                          "step-000200"]


def test_a_directory_without_checkpoints_says_why(tmp_path):
    (tmp_path / "notes").mkdir()
    with pytest.raises(CheckpointError, match="cannot read autoplan.json.*nor does it hold "
                                              "numbered checkpoints"):
        candidates(tmp_path)


def test_keep_without_numbered_checkpoints_is_refused_before_training():
    from autoplan.errors import AutoplanError
    from autoplan.train import build_parser, train

    for extra in (["--keep", "2"], ["--keep", "2", "--save", "ck"]):
        args = build_parser().parse_args(["--model", "tiny-gpt"] + extra)
        with pytest.raises(AutoplanError, match="--keep.*with --save DIR --save-every N"):
            train(args)  # refused before any process group is needed
    with pytest.raises(SystemExit) as refused:  # a negative count does not parse (one line, exit 2)
        build_parser().parse_args(["--model", "tiny-gpt", "--keep", "-1", "--save", "ck", "--save-every", "5"])
    assert refused.value.code == 2
