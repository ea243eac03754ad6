"""The benchmarks' one way to write their JSON results: atomically, so an interrupted run leaves either the
previous file or the new one, never half of one."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path


def write_json(path: Path, data: dict) -> None:
    """Write `data` to `path` atomically (a temporary file in the same folder, then a rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    os.replace(f.name, path)
