"""The benchmarks' one way to write their JSON results: atomically, so an interrupted run leaves either the
previous file or the new one, never half of one (`autoplan.validate.write_text_atomic`, as plans and profiles)."""

from __future__ import annotations

import json
from pathlib import Path

from autoplan.validate import write_text_atomic


def write_json(path: Path, data: dict) -> None:
    """Write `data` to `path` atomically (a temporary file in the same folder, then a rename)."""
    write_text_atomic(Path(path), json.dumps(data, indent=1) + "\n")
