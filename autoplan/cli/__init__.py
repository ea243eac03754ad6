"""The command line, `autoplan <command>`, and what it prints.

    commands.py  argument parsing and the commands: models, search, estimate, show, profile
    explain.py   `explain` and `compare`: a plan's prediction broken down per part, stage and op family
    report.py    the rich tables `search` and `show` print

`autoplan.cli:main` is the console script; importing this package loads nothing else.
"""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    """`autoplan.cli.commands.main`: parse `argv` (default sys.argv[1:]) and run the command."""
    from autoplan.cli.commands import main as _main

    return _main(argv)
