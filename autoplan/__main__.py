"""`python -m autoplan ...` is the same as the `autoplan` command."""

import sys

from autoplan.cli import main

sys.exit(main())
