"""The data-parallel gradient buckets, as the runtime makes them (`runtime.grad_sync`) and the cost
model prices them (`cost_model.step`): one description both read.

Gradients are synchronised in buckets of at most GRAD_BUCKET_BYTES of local gradient (PyTorch DDP's
default `bucket_cap_mb=25`), filled in reverse registration order, the order backward finishes
them; the first parameters (the embedding, layer 0) fill the last bucket, which is ready only when
backward ends.

The cost model can also price another stack's buckets (`BUCKET_RULES`, `Efficiency.grad_buckets`), for
published runs that ran on it: "megatron-core", Megatron-Core DDP's default bucket_size of
max(40M, 1M x data-parallel size) gradient elements, which keeps each rank's share of a bucket large
however many ranks share it (fewer calls, each paying a ring's latency over the group).
"""

from __future__ import annotations

import math

GRAD_BUCKET_BYTES = 25 * 2**20


def bucket_count(grad_bytes: float, bucket_bytes: int = GRAD_BUCKET_BYTES) -> int:
    """How many buckets `grad_bytes` of gradients fill (at least one)."""
    return max(1, math.ceil(grad_bytes / bucket_bytes))


BUCKET_RULES = ("ddp", "megatron-core")  # this runtime's (PyTorch DDP's 25 MiB); Megatron-Core DDP's default


def bucket_bytes_for(rule: str, group_size: int, grad_bytes_per_param: float) -> float:
    """The largest bucket under `rule` (module docstring) for a data-parallel group of `group_size` ranks
    reducing gradients of `grad_bytes_per_param` bytes each."""
    if rule == "megatron-core":
        return grad_bytes_per_param * max(40_000_000, 1_000_000 * group_size)
    return GRAD_BUCKET_BYTES
