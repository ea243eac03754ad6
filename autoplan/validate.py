"""Checks of the values that cross into autoplan: counts, numbers, config files and output paths.

Every input (a config file, a cluster file, a plan file, a command-line value, an argument of the
public API) is checked where it enters, and anything wrong raises an `AutoplanError` subclass whose
message says what was given, what was expected and what to change, on one line. The rules:

    count    an int (bool is not one; 1.5 and "2" are refused, never truncated) >= its minimum
    number   an int or float (bool is not one), finite (no NaN or infinity), above or at its minimum
    file     exists, is a regular file (not a folder), is UTF-8 text, parses as JSON or YAML (by its
             suffix: .yaml / .yml are YAML, anything else JSON), and holds a mapping
    output   a file path: not an existing folder, and its parent, where it exists, is a folder

The `error` argument picks the subclass (`ConfigError` for configs and arguments, `PlanError` for plans).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tempfile
from pathlib import Path

from autoplan.errors import AutoplanError, ConfigError, PlanError

MAX_SHOWN = 60  # characters of a given value quoted in a message (a whole nn.Module or file is no help)
# Counts that the cost model multiplies in float64 (parameters, tokens per step) stay below 2^53, where float64
# holds every integer exactly: about 9e15, thousands of times any real model or batch.
MAX_EXACT = 2**53


def shown(value: object) -> str:
    """`repr(value)` on one line, cut to MAX_SHOWN characters, with its type where the repr hides it."""
    text = " ".join(repr(value).split())
    text = text if len(text) <= MAX_SHOWN else text[:MAX_SHOWN - 3] + "..."
    return text if isinstance(value, (int, float, str, type(None))) else f"{text} ({type(value).__name__})"


def approx(count: int) -> str:
    """A count to 3 significant digits ('1.2e+17'), also one beyond the float range."""
    return f"{count:.3g}" if count < 1e300 else f"about 1e{len(str(count)) - 1}"


def one_line(text: str) -> str:
    """`text` with its lines joined by "; " (a message of the command line is one line)."""
    return "; ".join(line.strip() for line in str(text).splitlines() if line.strip())


def check_int(what: str, value: object, minimum: int = 1, error: type[AutoplanError] = ConfigError,
              hint: str = "") -> int:
    """`value` if it is an int >= `minimum`; otherwise `error` naming it (bool, float and str are refused:
    a count is never rounded, so 1.5 is an error, not 1)."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= minimum:
        return value
    whole = isinstance(value, float) and value.is_integer() and value >= minimum
    hint = "; ".join(filter(None, (f"write {int(value)}, without the fraction" if whole else "", hint)))
    raise error(f"{what}={shown(value)}: expected an integer >= {minimum}" + (f"; {hint}" if hint else ""))


def as_finite(value: object) -> float | None:
    """`value` as a float if it is a finite int or float (bool is not a number), else None (an int
    beyond the float range is not finite either)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def check_number(what: str, value: object, minimum: float = 0.0, strict: bool = True,
                 error: type[AutoplanError] = ConfigError, hint: str = "") -> float:
    """`value` as a float if it is a finite number > `minimum` (>= when not `strict`); otherwise `error`."""
    number = as_finite(value)
    if number is not None and (number > minimum if strict else number >= minimum):
        return number
    expected = f"a finite number {'>' if strict else '>='} {minimum:g}"
    raise error(f"{what}={shown(value)}: expected {expected}" + (f"; {hint}" if hint else ""))


def check_choice(what: str, value: object, choices: tuple, error: type[AutoplanError] = ConfigError) -> object:
    """`value` if it is one of `choices` (compared by type too: True is not 1); otherwise `error`."""
    if any(type(value) is type(c) and value == c for c in choices):
        return value
    raise error(f"{what}={shown(value)}: expected one of {', '.join(map(repr, choices))}")


def _check_type(what: str, value: object, kind: type, expected: str, error: type[AutoplanError]):
    """`value` if it is a `kind`; otherwise `error` saying what was given and what was `expected`."""
    if isinstance(value, kind):
        return value
    raise error(f"{what}={shown(value)}: expected {expected}")


def check_str(what: str, value: object, error: type[AutoplanError] = ConfigError) -> str:
    return _check_type(what, value, str, "a string", error)


def path_kind(path: str | Path) -> str:
    """'file', 'folder', 'missing', 'other' (a device, a socket), or why the path cannot be looked at (the
    operating system's reason, e.g. 'File name too long')."""
    path = Path(path)
    try:
        if path.is_dir():
            return "folder"
        return "file" if path.is_file() else "other" if path.exists() else "missing"
    except OSError as exc:
        return exc.strerror or str(exc)


def read_text(path: str | Path, what: str, error: type[AutoplanError] = ConfigError) -> str:
    """The UTF-8 text of the file at `path`; `error` when it is missing, a folder, binary or unreadable."""
    path = Path(path)
    kind = path_kind(path)
    if kind == "folder":
        raise error(f"{what} {str(path)!r} is a folder; expected the path of a file")
    if kind == "missing":
        raise error(f"{what} {str(path)!r} does not exist; check the path")
    if kind != "file":
        raise error(f"{what} {str(path)!r} cannot be read ({'not a regular file' if kind == 'other' else kind}); "
                    f"give the path of a file")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise error(f"{what} {str(path)!r} is not UTF-8 text (a binary file?); give the path of a text file") from None
    except OSError as exc:
        raise error(f"{what} {str(path)!r} cannot be read ({exc.strerror or exc}); check its permissions") from None


def parse_mapping(path: str | Path, text: str, what: str, error: type[AutoplanError] = ConfigError,
                  yaml_file: bool | None = None) -> dict:
    """The mapping `text` (read from `path`) holds: YAML when `yaml_file` (by default: for a .yaml / .yml
    `path`), JSON otherwise. One-line errors."""
    path = Path(path)
    if yaml_file is None:
        yaml_file = path.suffix.lower() in (".yaml", ".yml")
    try:
        data = _load_yaml(text) if yaml_file else json.loads(text)
    except RecursionError:
        raise error(f"{what} {str(path)!r} is nested too deeply to read") from None
    except ValueError as exc:  # json.JSONDecodeError and yaml.YAMLError (made a ValueError by _load_yaml)
        raise error(f"{what} {str(path)!r} is not valid {'YAML' if yaml_file else 'JSON'}: {one_line(exc)}") from None
    if not isinstance(data, dict):
        raise error(f"{what} {str(path)!r} holds {type(data).__name__ if data is not None else 'nothing'}; "
                    f"expected a mapping of keys to values")
    return data


def load_mapping(path: str | Path, what: str, error: type[AutoplanError] = ConfigError) -> dict:
    """`parse_mapping` of the file at `path` (`read_text`)."""
    return parse_mapping(path, read_text(path, what, error), what, error)


def _load_yaml(text: str):
    import yaml  # lazily: only YAML files need it

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ValueError(f"{getattr(exc, 'problem', None) or one_line(exc)}{where}") from None


def check_output_file(path: str | Path, what: str, error: type[AutoplanError] = ConfigError) -> Path:
    """`path` as a Path if a file can be written there: not a folder, and no file where a parent folder goes."""
    path = Path(path)
    kind = path_kind(path)
    if kind == "folder":
        raise error(f"{what} {str(path)!r} is a folder; give a file path such as {str(path / 'plan.json')!r}")
    if kind not in ("file", "missing"):
        raise error(f"{what} {str(path)!r} cannot be written ({kind}); choose another path")
    for parent in path.parents:
        parent_kind = path_kind(parent)
        if parent_kind != "missing":
            if parent_kind != "folder":
                raise error(f"{what} {str(path)!r}: {str(parent)!r} is not a folder; choose another path")
            break
    return path


def write_text_atomic(path: Path, text: str) -> None:
    """`text` into `path` atomically: a temporary file in the same folder, then os.replace, so a crash never
    leaves a truncated file at `path`; the file gets the mode a plain open() gives (0666 less the umask: mkstemp
    makes its file 0600, which a teammate's tools could not read). OSError where it cannot be written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def check_keys(what: str, data: dict, allowed: set[str], required: set[str] = frozenset(),
               error: type[AutoplanError] = ConfigError) -> None:
    """Refuse keys outside `allowed` and missing `required` ones, listing both."""
    unknown = sorted(map(str, set(data) - allowed))
    missing = sorted(required - set(data))
    if unknown or missing:
        parts = ([f"unknown keys {unknown}"] if unknown else []) + ([f"missing keys {missing}"] if missing else [])
        raise error(f"{what} has {' and '.join(parts)}; allowed keys: {sorted(allowed)}")


def check_mapping(what: str, value: object, error: type[AutoplanError] = ConfigError) -> dict:
    return _check_type(what, value, dict, "a mapping of keys to values", error)


def check_list(what: str, value: object, error: type[AutoplanError] = PlanError) -> list:
    return _check_type(what, value, list, "a list", error)


def record(cls, data: object, what: str, error: type[AutoplanError] = ConfigError):
    """`cls(**data)` for a dataclass `cls`, after checking `data` is a mapping with every field that has no
    default and no other key (the dataclass checks the values)."""
    check_mapping(what, data, error)
    allowed = {f.name for f in dataclasses.fields(cls)}
    required = {f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    check_keys(what, data, allowed, required, error)
    return cls(**data)


def check_tokens(global_batch: int, seq_len: int, error: type[AutoplanError] = ConfigError) -> None:
    """Tokens per step, global_batch x seq_len, below MAX_EXACT (the counts must be checked ints already)."""
    if global_batch * seq_len >= MAX_EXACT:
        raise error(f"global_batch {shown(global_batch)} x seq_len {shown(seq_len)} = {approx(global_batch * seq_len)} "
                    f"tokens per step: expected fewer than 2^53 = {MAX_EXACT:.3g}; use a smaller batch or a shorter "
                    f"sequence")
