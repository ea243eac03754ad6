"""Recomputation in the runtime for the user's own module, as the plan's policy says
(`autoplan.recompute_policy`), with the zoo's mechanism (`runtime.recompute`): torch's non-reentrant
checkpoint under selective activation checkpointing contexts, one region per recomputed block.

    blocks       the members of the model's layer lists (`module_program.block_lists`, the blocks FSDP2
                 wraps), in the model's order: block i is layer i of the plan
    regions      the blocks `policy.recomputed_layers(len(blocks))` (every block, or the first k under
                 "<kind>:k", k counted over the whole model also under pp, as the cost model prices
                 it: a pipeline rank wraps those of its held blocks); each block's `forward` runs as
                     recompute(original_forward, *args, saves=policy.saves, **kwargs)
                 so forward keeps the block's inputs and the outputs of the ops whose family the policy
                 saves (selective: matmul and attention; matmul-only: matmul; full: nothing), and
                 backward re-runs the whole block (its tp collectives too) before differentiating it

The block's own parameters and module path are untouched (the forward is replaced on the instance,
not wrapped in another module), so names, state dicts and FSDP2's per-block sharding stay as they
were; FSDP2's hooks stay outside the region (they run around `__call__`), as torchtitan orders them,
and its pre-backward gather brings the parameters back before the re-run. The ops and their order are
those of the plain forward, so the numbers are the same.

A plan whose layers are not the blocks of the model's layer lists (none, or more lists than the layers)
cannot be applied so: `check_recompute_blocks` refuses it.
"""

from __future__ import annotations

import functools

from torch import nn

from autoplan.errors import PlanError
from autoplan.recompute_policy import RecomputePolicy, check_recompute
from autoplan.runtime.module_program import block_lists
from autoplan.runtime.recompute import recompute


def check_recompute_blocks(plan_recompute: str, model: nn.Module, num_layers: int) -> RecomputePolicy:
    """The plan's policy, checked against the model's blocks: PlanError when it recomputes layers
    the model has no layer list for, or when its blocks are not the plan's `num_layers` layers (the
    policy's layer i would not be the plan's)."""
    policy = check_recompute(plan_recompute, num_layers)
    if policy.kind == "none":
        return policy
    blocks = block_lists(model)
    if len(blocks) != num_layers:
        raise PlanError(f"recompute {plan_recompute!r}: the plan's model has {num_layers} layers but the "
                        f"model ({type(model).__name__}) holds {len(blocks)} blocks in nn.ModuleLists, "
                        f"which are the regions the module runtime recomputes; keep exactly the layers "
                        f"in an nn.ModuleList, or plan recompute 'none'")
    return policy


def apply_module_recompute(model: nn.Module, policy: RecomputePolicy,
                           held: list[nn.Module | None] | None = None) -> tuple[int, ...]:
    """Run each block `policy` recomputes as one checkpointed region (module docstring), in place;
    returns the indices of those blocks. `held`: with a pipeline, every layer's block in the model's
    order, None where another stage holds it (`StageCut.held_blocks`): the policy's layers are the
    model's (global) indices, as the cost model and the zoo runtime count them, so "full:k" re-runs
    the first k layers of the model, those this rank holds; other stages' stand-ins are never wrapped."""
    blocks = block_lists(model) if held is None else held
    layers = tuple(i for i in policy.recomputed_layers(len(blocks)) if blocks[i] is not None)
    saves = tuple(sorted(policy.saves))
    for i in layers:
        block = blocks[i]
        if "forward" in vars(block):
            raise PlanError(f"block {i} ({type(block).__name__}) is already recomputed or has its "
                            f"forward replaced; apply the plan to a freshly built model")
        block.forward = functools.partial(_recomputed, block.forward, saves)
    return layers


def _recomputed(forward, saves: tuple[str, ...], *args, **kwargs):
    """`forward(*args, **kwargs)` as one recomputed region keeping the `saves` families' outputs."""
    return recompute(forward, *args, saves=saves, **kwargs)
