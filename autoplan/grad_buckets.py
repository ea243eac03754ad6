"""The data-parallel gradient buckets, as the runtime makes them (`runtime.grad_sync`) and the cost
model prices them (`cost_model.step`): one description both read.

Gradients are synchronised in buckets of at most GRAD_BUCKET_BYTES of local gradient (PyTorch DDP's
default `bucket_cap_mb=25`), filled in reverse registration order, the order backward finishes
them; the first parameters (the embedding, layer 0) fill the last bucket, which is ready only when
backward ends.
"""

from __future__ import annotations

import math

GRAD_BUCKET_BYTES = 25 * 2**20


def bucket_count(grad_bytes: float, bucket_bytes: int = GRAD_BUCKET_BYTES) -> int:
    """How many buckets `grad_bytes` of gradients fill (at least one)."""
    return max(1, math.ceil(grad_bytes / bucket_bytes))
