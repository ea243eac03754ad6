"""Runtime: turns a Plan into per-rank programs with collectives and runs them on torch.distributed.

    program = parallelize(model, cluster, plan, seed=0, config=config)   # under torchrun
    optimizer = program.make_optimizer(torch.optim.AdamW, lr=3e-4)
    loss = program.train_step(global_tokens, global_targets, optimizer)
    print(program.graph_module.code)                                     # this rank's program

Names are imported lazily, so importing the package has no side effects.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "parallelize": "autoplan.runtime.launch",
    "check_plan": "autoplan.runtime.launch",
    "RankProgram": "autoplan.runtime.program",
    "rewrite": "autoplan.runtime.rewrite",
    "init_parameters": "autoplan.runtime.init",
    "init_shard": "autoplan.runtime.init",
}


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'autoplan.runtime' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_EXPORTS))
