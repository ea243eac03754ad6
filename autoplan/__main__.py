"""`python -m autoplan ...` is the same as the `autoplan` command; as a torchrun rank (`autoplan profile` on
several ranks) it ends without the interpreter's teardown (`autoplan.cli.exit_now`)."""

import sys

from autoplan.cli import exit_now, is_torchrun_rank, main

code = main()
if is_torchrun_rank():
    exit_now(code)
sys.exit(code)
