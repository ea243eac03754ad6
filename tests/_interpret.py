"""Running a test file's Triton tests under the interpreter, in a child pytest.

TRITON_INTERPRET=1 must be set before triton is imported, so each kernel test file has one
`test_interpreter_suite` that runs its own `test_triton_*` tests in a child process with it set;
in the child those tests run, and `test_interpreter_suite` skips itself.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from autoplan.runtime.kernels import dispatch

REPO = Path(__file__).resolve().parents[1]


def run_triton_tests_interpreted(test_file: str) -> None:
    """The `test_triton_*` tests of `test_file` in a child pytest with TRITON_INTERPRET=1; fails with
    the child's output when any of them fails or skips."""
    if dispatch.interpreting():
        pytest.skip("already interpreting: the triton tests run in this process")
    if dispatch.load_triton() is None:
        pytest.skip("triton is not installed (pip install 'autoplan[triton]')")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-W",
         "ignore::RuntimeWarning", "-k", "test_triton_", str(Path(test_file))],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    assert proc.returncode == 0 and "skipped" not in summary, \
        f"interpreter tests failed:\n{proc.stdout[-6000:]}{proc.stderr[-3000:]}"
