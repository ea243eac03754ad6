"""Command-line arguments checked where they enter: a parser whose errors are one line, and argument
types that refuse what `autoplan.validate` refuses (a count of 0, 1.5 or "two"; a time of nan or inf).

    autoplan estimate ... --tp 0     ->  autoplan estimate: error: argument --tp: 0: expected an integer >= 1
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable, NoReturn

from autoplan.errors import AutoplanError
from autoplan.validate import check_int, check_number, one_line, path_kind


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line on stderr (exit 2), pointing at --help.
    Subparsers made from it are of this class too (argparse passes the class on)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {one_line(message)} (see `{self.prog} --help`)\n")


def _typed(name: str, check: Callable[[object], object], parse: Callable[[str], object]) -> Callable[[str], object]:
    """An argparse type: `parse` the text, then `check` the value (AutoplanError is a ValueError too);
    argparse prefixes the message with the option's name."""
    def convert(text: str) -> object:
        try:
            value = parse(text)
            check(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: expected {name}") from None
        return value
    convert.__name__ = name
    return convert


def _int(text: str) -> int:
    return int(text.strip(), 10)


positive_int = _typed("an integer >= 1", lambda v: check_int("", v, 1), _int)
non_negative_int = _typed("an integer >= 0", lambda v: check_int("", v, 0), _int)
positive_float = _typed("a finite number > 0", lambda v: check_number("", v), float)


def existing_file(text: str) -> str:
    """An argparse type: the path of an existing file (not a folder)."""
    kind = path_kind(text)
    if kind != "file":
        raise argparse.ArgumentTypeError(f"{text!r}: expected an existing file" + (", not a folder" if kind == "folder" else ""))
    return text


def exit_on_error(prog: str, exc: AutoplanError, debug: bool) -> int:
    """Print `exc` as one line (after its traceback under --debug); the exit status of bad input, 2."""
    if debug:
        import traceback

        traceback.print_exception(exc)
    print(f"{prog}: error: {one_line(exc)}", file=sys.stderr)
    return 2


def report_bug(prog: str, exc: BaseException, argv: list[str] | None) -> int:
    """An exception autoplan did not expect: its traceback and a request to report it; exit status 1."""
    import traceback

    traceback.print_exception(exc)
    command = " ".join(sys.argv[1:] if argv is None else argv)
    print(f"{prog}: internal error ({type(exc).__name__}); this is a bug in autoplan, please report it with the "
          f"command line ({command}) and the traceback above", file=sys.stderr)
    return 1
