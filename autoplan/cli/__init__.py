"""The command line, `autoplan <command>`, and what it prints.

    commands.py  argument parsing and the commands: models, search, estimate, show, profile
    explain.py   `explain` and `compare`: a plan's prediction broken down per part, stage and op family
    report.py    the rich tables `search` and `show` print

`autoplan.cli:main` is the console script; importing this package loads nothing else.
"""

from __future__ import annotations

import os
import sys


def main(argv: list[str] | None = None) -> int:
    """`autoplan.cli.commands.main`: parse `argv` (default sys.argv[1:]) and run the command."""
    from autoplan.cli.commands import main as _main

    return _main(argv)


def exit_now(code: int) -> None:
    """End the process with `code` once its output is flushed, skipping the interpreter's teardown: a rank has
    destroyed its process groups, yet a thread torch's gloo groups leave behind can still abort the teardown
    (std::terminate, SIGABRT: seen after a finished fine-tuning run had written its checkpoint, and after
    `autoplan profile` on 2 gloo ranks had written its profile), and torchrun then fails the whole job. Files
    autoplan writes are closed (atomic replaces) before this is called."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def is_torchrun_rank() -> bool:
    """Whether this process is one rank of several that torchrun started (its WORLD_SIZE)."""
    return os.environ.get("WORLD_SIZE", "1") not in ("", "1")
