"""The memory a run holds against the memory its plan promised (issue 19): after the first step,
`autoplan.train` runs one microbatch's forward under `runtime.memory_probe` on every rank and compares
the bytes it leaves for backward (the largest rank's) with `cost_model.memory.plan_activation_bytes`,
the same quantity as the plan prices it. It warns when the run holds more than 5% above the prediction.

A pipelined plan is not measured (its program runs whole steps only), and the measurement runs no
backward, so it changes no gradient and no optimizer state.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from autoplan.models.config import ModelConfig
    from autoplan.plan import Plan

OVER = 0.05  # measured above predicted by more than this share earns a warning


def measured_activation_bytes(program, plan: "Plan", tokens: torch.Tensor, targets: torch.Tensor) -> float:
    """The bytes one microbatch's forward leaves for backward, the largest over the ranks (collective)."""
    from autoplan.runtime.memory_probe import measure_saved_bytes

    rows_tokens, rows_targets = program.shard_batch(tokens, targets)
    microbatch = (rows_tokens[:plan.microbatch_size], rows_targets[:plan.microbatch_size])
    _, measured = measure_saved_bytes(lambda: program(*microbatch), program, backward=False)
    largest = torch.tensor([float(measured.saved_bytes)], dtype=torch.float64, device=program.device)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    return float(largest.item())


def memory_line(program, plan: "Plan", config: "ModelConfig", tokens: torch.Tensor,
                targets: torch.Tensor) -> tuple[str, bool] | None:
    """(the line to log, whether measured exceeds predicted by more than OVER), or None for a pipelined
    plan. Every rank must call it: the measurement ends in a collective."""
    if plan.mesh.pp > 1:
        return None
    from autoplan.api import capture_model
    from autoplan.cost_model.memory import plan_activation_bytes

    measured = measured_activation_bytes(program, plan, tokens, targets)
    predicted, _ = plan_activation_bytes(plan, capture_model(config, plan.seq_len, plan.dtype), config.rule_info())
    error = measured / predicted - 1 if predicted else float("inf")
    line = (f"activations of one microbatch: measured {measured / 1e6:.2f} MB (largest rank) against "
            f"{predicted / 1e6:.2f} MB predicted ({error:+.1%})")
    return line, error > OVER
