"""Fused expert weights read from checkpoints that store them per expert (`runtime.weights`).

transformers 5 keeps a MoE layer's experts fused, `experts.gate_up_proj` (E, 2f, h) and
`experts.down_proj` (E, h, f), but `save_pretrained` writes them (and the Hub holds them) per expert,
as transformers 4 stored them (transformers' `conversion_mapping`, which `from_pretrained` applies):

    gate_up_proj[e] = cat(<experts>.<e>.<gate>.weight (f, h), <experts>.<e>.<up>.weight (f, h))
    down_proj[e]    = <experts>.<e>.<down>.weight (h, f)

with (gate, up, down) = (gate_proj, up_proj, down_proj) (Qwen2-MoE and most) or (w1, w3, w2) (Mixtral),
the names as the model's (`CheckpointFiles` applies transformers' renamings, such as Mixtral's
`block_sparse_moe` -> `mlp`: `runtime.checkpoint_names`). A rank
holding experts [a, b) (expert parallelism: `runtime.module_experts`) reads only those experts'
tensors, then the rest of its index (a tp slice) of the stacked result.
"""

from __future__ import annotations

import torch

# fused name -> the per-expert names of its parts, one tuple per known layout
PER_EXPERT = {"gate_up_proj": (("gate_proj", "up_proj"), ("w1", "w3")), "down_proj": (("down_proj",), ("w2",))}


def read_per_expert(name: str, shape: tuple[int, ...], index: tuple[slice, ...], files) -> torch.Tensor | None:
    """`index` (or the whole, when empty) of fused expert weight `name` of `shape`, from its per-expert
    tensors in `files` (a `runtime.weights.CheckpointFiles`); None when the checkpoint stores none."""
    prefix, _, attr = name.rpartition(".")
    for parts in PER_EXPERT.get(attr, ()):
        if f"{prefix}.0.{parts[0]}.weight" not in files.where:
            continue
        experts = range(shape[0])[index[0]] if index else range(shape[0])
        rows = [torch.cat([files.read(f"{prefix}.{e}.{part}.weight") for part in parts]) for e in experts]
        whole = torch.stack(rows) if rows else torch.empty((0, *shape[1:]))
        return whole[(slice(None), *index[1:])] if len(index) > 1 else whole
    return None
