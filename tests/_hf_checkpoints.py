"""Tiny transformers checkpoints for the runtime tests: each config built on CPU from one seed, saved
with `save_pretrained` (no download), its one-process reference run, and its graph captured for the
planner."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Callable

import torch


def save_and_capture(configs: dict, root: Path, tokens: torch.Tensor, reference: Callable, seq_len: int,
                     seed: int) -> tuple[dict, dict, dict]:
    """({name: checkpoint directory}, {name: reference(model, tokens)}, {name: (graph, summary)})."""
    import transformers

    from autoplan.capture.hf import capture_hf_for_planner

    dirs, refs, graphs = {}, {}, {}
    warnings.simplefilter("ignore")  # capture's notes on replicated ops; transformers' progress
    for name, config in configs.items():
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
        dirs[name] = root / name
        model.save_pretrained(dirs[name])
        refs[name] = reference(model, tokens)
        summary, graph, _ = capture_hf_for_planner(config, seq_len, "float32")
        graphs[name] = (graph, summary)
    return dirs, refs, graphs
