"""The files of autoplan checkpoints, without collectives (runtime.checkpoint runs these on the
right ranks): the manifest, the marker of autoplan's temporary directories, which existing
directories a save may replace, and folders of numbered checkpoints.

Manifest: `autoplan.json` (plain JSON) with `"kind": "autoplan-checkpoint"` and, from format 2,
`"files"`: for every other file of the checkpoint, its size in bytes and SHA-256, so a file that
was changed, truncated or lost after the save is found before anything of it is read. Format 1
(saved before checksums) is still recognised and loads unverified.

Ownership: a directory is autoplan's to replace or delete only if it holds such a manifest, or, for
the `<dir>.tmp-<token>` / `<dir>.old-<token>` directories of a save, if it holds the marker file
`.autoplan-save` naming the same token (written by the save before anything else). Everything else
is the user's and is never renamed or deleted: a save onto a non-empty directory without a
manifest is refused.

Numbered checkpoints: `--save-every` writes `<parent>/step-NNNNNN`, each a whole checkpoint; the
newest (largest step) comes first, and pruning deletes only members with a manifest.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shutil
from collections.abc import Callable
from pathlib import Path

from autoplan.errors import AutoplanError

MANIFEST = "autoplan.json"
MARKER = ".autoplan-save"
KIND = "autoplan-checkpoint"
FORMAT = 2  # 1: no "kind" or "files" (before checksums)
SERIES = re.compile(r"step-(\d+)")
_LEFTOVER = re.compile(r"(?P<stem>.+)\.(?P<kind>tmp|old)-(?P<token>[0-9a-f]+)")
_CHUNK_BYTES = 1 << 20


class CheckpointError(AutoplanError):
    """A checkpoint that is missing, incomplete, damaged, unsafe, or of another model; or a save
    that would overwrite something autoplan did not write."""


# ------------------------------------------------------------------ manifest


def read_manifest(path: Path) -> dict:
    """The manifest of the checkpoint at `path`; CheckpointError saying why if there is none."""
    where = f"{str(path)!r} is not a complete autoplan checkpoint"
    try:
        data = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError) as exc:  # ValueError: bad JSON or UTF-8
        raise CheckpointError(f"{where}: cannot read {MANIFEST} ({exc})") from None
    if not isinstance(data, dict) or not (data.get("kind") == KIND or
                                          (data.get("format") == 1 and "model" in data)):
        raise CheckpointError(f"{where}: its {MANIFEST} was not written by autoplan (no "
                              f"\"kind\": \"{KIND}\")")
    return data


def is_checkpoint(path: Path) -> bool:
    """Whether `path` is a directory with autoplan's manifest."""
    try:
        read_manifest(path)
    except CheckpointError:
        return False
    return True


def list_files(directory: Path) -> list[str]:
    """The files of a checkpoint directory (POSIX paths relative to it), sorted, without the
    manifest and the marker."""
    return sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*")
                  if p.is_file() and p.name not in (MANIFEST, MARKER))


def digest(path: Path) -> dict:
    """{"bytes": size, "sha256": hex digest} of one file, read in 1 MiB chunks."""
    sha = hashlib.sha256()
    size = 0
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK_BYTES):
            sha.update(chunk)
            size += len(chunk)
    return {"bytes": size, "sha256": sha.hexdigest()}


def inside(name: str) -> bool:
    """A recorded name stays inside the checkpoint (a crafted manifest may say '../x')."""
    parts = name.split("/")
    return bool(name) and not name.startswith("/") and "\\" not in name and \
        all(p not in ("", ".", "..") for p in parts)


def verify_file(directory: Path, name: str, recorded: dict) -> str | None:
    """Why file `name` of the checkpoint differs from its record, or None if it matches."""
    where = f"checkpoint {str(directory)!r}: file {name!r}"
    redo = "resume from another checkpoint, or save this one again from a run that has the state"
    if not inside(name):
        return f"{where} is recorded outside the checkpoint directory; refusing it ({redo})"
    if not isinstance(recorded, dict) or set(recorded) != {"bytes", "sha256"}:
        return f"{where} has a damaged record in {MANIFEST} ({recorded!r}); {redo}"
    path = directory / name
    if not path.is_file():
        return f"{where} is missing (saved with {recorded.get('bytes')} bytes); {redo}"
    size = path.stat().st_size
    if size != recorded.get("bytes"):
        return (f"{where} has {size} bytes but was saved with {recorded.get('bytes')}: it was "
                f"truncated or changed after the save; {redo}")
    if digest(path)["sha256"] != recorded.get("sha256"):
        return (f"{where} does not match the SHA-256 recorded at save time (its bytes changed "
                f"after the save); {redo}")
    return None


# ------------------------------------------------------------------ ownership


def write_json(path: Path, data: dict) -> None:
    """Write JSON atomically: a temporary file beside it, fsync, rename over."""
    tmp = path.with_name(f"{path.name}.tmp-{secrets.token_hex(4)}")
    with open(tmp, "w") as handle:
        handle.write(json.dumps(data, indent=1) + "\n")
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sibling(path: Path, kind: str, token: str) -> Path:
    """`<path>.tmp-<token>` (a save in progress) or `<path>.old-<token>` (one set aside)."""
    return path.parent / f"{path.name}.{kind}-{token}"


def mark(directory: Path, token: str) -> None:
    """Say that `directory` is autoplan's, under `token` (its name's suffix once set aside)."""
    write_json(directory / MARKER, {"kind": KIND, "token": token})


def begin(tmp: Path, token: str) -> None:
    """Create a save's temporary directory, marked before anything else is written to it."""
    tmp.mkdir(parents=True)
    mark(tmp, token)


def _carries_marker(directory: Path, token: str) -> bool:
    try:
        data = json.loads((directory / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and data.get("kind") == KIND and data.get("token") == token


def remove_leftovers(parent: Path, stem: Callable[[str], bool]) -> list[str]:
    """Delete `<stem>.tmp-<token>` / `<stem>.old-<token>` directories in `parent` that carry
    autoplan's marker with that token (left by a crashed save); return their names. Anything
    else of that name (a user's `ckpt.tmp-mine`) is left alone."""
    removed = []
    for entry in sorted(parent.iterdir()):
        found = _LEFTOVER.fullmatch(entry.name)
        if found is None or not stem(found["stem"]) or entry.is_symlink() or not entry.is_dir():
            continue
        if _carries_marker(entry, found["token"]):
            shutil.rmtree(entry, ignore_errors=True)  # what stays is still marked: next time
            removed.append(entry.name)
    return removed


def target_error(path: Path) -> str | None:
    """Why a save may not write `path`, or None: a new path, an empty directory, or an autoplan
    checkpoint (of the same model: the caller checks) may be replaced; nothing else."""
    if path.is_symlink():  # the rename would replace the link, not fill what it points to
        return (f"cannot save a checkpoint to {str(path)!r}: it is a symbolic link; give the "
                f"directory it points to ({os.path.realpath(path)!r}), or a new one")
    if path.exists() and not path.is_dir():
        return (f"cannot save a checkpoint to {str(path)!r}: it exists and is not a directory; "
                f"choose a new or empty directory")
    if not path.exists() or is_checkpoint(path) or not any(path.iterdir()):
        return None
    return (f"refusing to save a checkpoint to {str(path)!r}: it is a non-empty directory that "
            f"holds no autoplan checkpoint (no {MANIFEST} written by autoplan), and a save "
            f"replaces the whole directory; choose a new or empty directory")


def swap_into_place(tmp: Path, path: Path, token: str) -> None:
    """Rename the finished `tmp` to `path`. An autoplan checkpoint there is first marked and set
    aside to `<path>.old-<token>`, and deleted once the new one is in place; an empty directory is
    replaced by the rename itself (POSIX rename onto an empty directory)."""
    old = None
    if is_checkpoint(path):
        mark(path, token)
        old = sibling(path, "old", token)
        os.rename(path, old)
    try:
        os.rename(tmp, path)
    except OSError as exc:
        if old is not None:
            os.rename(old, path)
        raise CheckpointError(f"cannot move the new checkpoint into {str(path)!r} ({exc}); it "
                              f"is complete at {str(tmp)!r}") from None
    fsync_dir(path.parent)
    if old is not None:  # the new one is in place: a failure here only leaves a marked leftover
        shutil.rmtree(old, ignore_errors=True)


# ------------------------------------------------------------------ finding checkpoints


def series_name(step: int) -> str:
    return f"step-{step:06d}"


def series(parent: Path) -> list[Path]:
    """The numbered checkpoints `parent/step-N` that hold a manifest, newest (largest N) first."""
    if not parent.is_dir():
        return []
    found = [(int(m[1]), p) for p in parent.iterdir()
             if (m := SERIES.fullmatch(p.name)) and p.is_dir() and is_checkpoint(p)]
    return [p for _, p in sorted(found, key=lambda item: item[0], reverse=True)]


def prune_series(parent: Path, keep: int, newest: Path) -> list[str]:
    """Delete all but `keep` numbered checkpoints of `parent`: `newest` (the one just saved) and
    the others with the largest steps; then what crashed numbered saves left. Returns what went."""
    others = [p for p in series(parent) if p != newest]
    removed = []
    for path in others[max(keep - 1, 0):]:
        token = secrets.token_hex(8)
        mark(path, token)  # if this dies halfway, the leftover is recognisably autoplan's
        os.rename(path, sibling(path, "old", token))
        shutil.rmtree(sibling(path, "old", token), ignore_errors=True)
        removed.append(path.name)
    return removed + remove_leftovers(parent, lambda stem: SERIES.fullmatch(stem) is not None)


def candidates(directory: str | Path) -> list[Path]:
    """The checkpoints `directory` names, to try in order: itself if it is one; else the previous
    checkpoint an interrupted save left at `<dir>.old-*`; else its numbered checkpoints, newest
    first. CheckpointError if there is none."""
    path = Path(directory)
    try:
        read_manifest(path)
        return [path]
    except CheckpointError as exc:
        reason = str(exc)
    if not path.exists():
        prefix = path.name + ".old-"
        old = sorted((p for p in (path.parent.iterdir() if path.parent.is_dir() else ())
                      if p.name.startswith(prefix) and is_checkpoint(p)), key=os.path.getmtime)
        if old:
            return old[-1:]
        raise CheckpointError(f"no checkpoint at {str(path)!r}: the directory does not exist")
    numbered = series(path)
    if numbered:
        return numbered
    raise CheckpointError(f"{reason}; nor does it hold numbered checkpoints (step-NNNNNN, as "
                          f"--save-every writes)")
