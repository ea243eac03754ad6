"""autoplan: find the fastest way to split PyTorch training over GPUs, explain it, and run it.

    plan = autoplan.search("gpt3-175b", "128x8xh100", global_batch=1536, seq_len=2048)
    program = autoplan.parallelize(model, "1x4xcpu", plan=plan)   # under torchrun

Names are imported lazily so that `import autoplan` stays cheap and has no side effects.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "ClusterSpec": "autoplan.cluster",
    "DeviceSpec": "autoplan.cluster",
    "LinkSpec": "autoplan.cluster",
    "parse_cluster": "autoplan.cluster",
    "MeshShape": "autoplan.mesh",
    "Shard": "autoplan.placement",
    "Replicate": "autoplan.placement",
    "Partial": "autoplan.placement",
    "Plan": "autoplan.plan",
    "AutoplanError": "autoplan.errors",
    "TrainingDivergedError": "autoplan.errors",
    "CollectiveError": "autoplan.errors",
    "search": "autoplan.api",
    "parallelize": "autoplan.api",
}


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'autoplan' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_EXPORTS))
