"""Runtime: turns a Plan into per-rank programs with collectives and runs them on torch.distributed.

    program = parallelize(model, cluster, plan, seed=0, config=config)   # under torchrun
    optimizer = program.make_optimizer(torch.optim.AdamW, lr=3e-4)
    loss = program.train_step(global_tokens, global_targets, optimizer)
    program.grad_norm                   # its global gradient norm (runtime.health: a non-finite
                                        # loss or norm raises TrainingDivergedError instead)
    print(program.graph_module.code)                                     # this rank's program
    program.save_checkpoint("ckpt", step=100)     # full names and shapes: resumable under any plan
    program.load_checkpoint("ckpt")               # (after make_optimizer) -> its metadata
    with program.count_collectives() as counts:   # (kind, group) -> calls; compare with
        program.train_step(...)                   # expected_collectives(plan, config, pp_index)

Every mesh axis runs: dp (ZeRO 0-3), tp (with sequence parallelism), cp (Ulysses), ep (expert
dispatch; with etp < tp over ep x tp / etp, each expert's FFN over etp), pp
(torch.distributed.pipelining schedules); recompute and bf16 autocast as the plan says. Module map:
launch (checks, groups) -> rewrite (tp modules and conversions, then context, recompute) -> program
(materialise, pipeline, data parallel, checkpoints); collectives, losses, modules, experts are the
pieces the graph calls; counting predicts a step's collectives. grad_sync, for both runtimes: the
data-parallel gradients in buckets synchronised while backward runs, ZeRO 1/2 as a distributed
optimizer (`program.make_optimizer` makes it).

The user's own module (a transformers causal LM, or any nn.Module whose forward(input_ids)
returns logits) runs on the PyTorch-native stack instead, without a graph rewrite: dp (ZeRO 0-2
on grad_sync; 3 as FSDP2) and tp with sequence parallelism, as DTensor parallel styles on its modules:

    program = parallelize_module_program(model, plan, checkpoint=None)    # (autoplan.parallelize
    print(program.module_plan)                    # dispatches here) {module path: style}
    loss = program.train_step(global_tokens, global_targets, optimizer)
    logits = program.forward(tokens, gather=True)                         # evaluation
    save_hf(program, "out")                       # from_pretrained("out") loads it

module_plan (Plan -> module styles, and what it refuses) -> module_styles (torch styles) ->
module_launch (checks, weights, FSDP2) -> module_program (steps, state dicts); weights (checkpoint
slices), hf_export.

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
    "check_memory_fits": "autoplan.runtime.launch",
    "expected_collectives": "autoplan.runtime.counting",
    "count_collectives": "autoplan.runtime.collectives",
    "CheckpointError": "autoplan.runtime.checkpoint",
    "parallelize_module_program": "autoplan.runtime.module_launch",
    "ModuleProgram": "autoplan.runtime.module_program",
    "module_plan": "autoplan.runtime.module_plan",
    "save_hf": "autoplan.runtime.hf_export",
}


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'autoplan.runtime' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_EXPORTS))
