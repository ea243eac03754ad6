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


def adamw_reference(model, tokens: torch.Tensor, steps: int, lr: float, eps: float,
                    loss: Callable | None = None) -> dict:
    """One process: `steps` AdamW steps, step i on tokens[i] (the loss transformers' own with labels = the
    tokens unless `loss(model, tokens)` is given): the losses, the first step's gradients, the final
    parameters."""
    loss = loss or (lambda m, t: m(input_ids=t, labels=t).loss)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, eps=eps)
    losses, grads = [], None
    for step in range(steps):
        optimizer.zero_grad()
        value = loss(model, tokens[step])
        value.backward()
        grads = grads or {n: p.grad.clone() for n, p in model.named_parameters()}
        optimizer.step()
        losses.append(value.item())
    return {"losses": losses, "grads": grads, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def assert_matches_reference(ranks: list[dict], ref: dict, tol: dict) -> None:
    """Every rank's losses (rel 1e-5), loss after the steps (where it reports one), eval loss and gradient
    norm are the reference's; the first rank's first gradients and final parameters too, within `tol`."""
    import pytest

    norm = torch.stack([g.double().square().sum() for g in ref["grads"].values()]).sum().sqrt().item()
    for got in ranks:
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=0)
        if "after" in got:
            assert got["after"] == pytest.approx(ref["after"], rel=1e-5)
        assert got["eval"] == pytest.approx(ref["after"], rel=1e-5)
        assert got["grad_norm"] == pytest.approx(norm, rel=1e-5)
    first = ranks[0]
    assert set(first["params"]) == set(ref["params"])
    for name in ref["params"]:
        torch.testing.assert_close(first["grads"][name], ref["grads"][name], **tol, msg=lambda m: f"grad {name}: {m}")
        torch.testing.assert_close(first["params"][name], ref["params"][name], **tol, msg=lambda m: f"param {name}: {m}")


def count_checkpoint_reads(counter: list) -> Callable:
    """Wrap `CheckpointFiles.read` in this process so each read appends its element count to `counter`;
    the original read, to put back."""
    from autoplan.runtime import weights

    original = weights.CheckpointFiles.read

    def read(self, name, index=()):
        found = original(self, name, index)
        counter.append(found.numel())
        return found
    weights.CheckpointFiles.read = read
    return original


def gpt2_tied_head(graph, registry, tp: int, info: dict, sp: bool = False) -> dict[str, str]:
    """GPT-2 under tp: the tied embedding vocab-parallel and the lm_head column-parallel over the
    vocabulary (both hold the one weight S(0)), the loss vocab-parallel, each MLP's Conv1D column then
    row with the ops between on feature shards, the attention (c_attn's fused q|k|v) replicated. With
    `sp`: Megatron's sequence-parallel assignment for the rest (norms, residuals and the embeddings'
    outputs on sequence shards, the MLP's row projection reduce-scattered), the attention still replicated."""
    from autoplan.placement import Shard
    from autoplan.solver.intra_op import megatron_assignment

    kinds = {"embedding": "vocab", "cross_entropy": "vocab"}
    found = {n.name: kinds[n.op_kind] for n in graph.nodes if n.op_kind in kinds and n.module_path != "transformer.wpe"}
    if sp:
        attention = {n.name for n in graph.nodes if ".attn." in f"{n.module_path}."}  # c_attn, core, c_proj: replicated
        found = {name: s for name, s in megatron_assignment(graph, registry, tp, info, True).items()
                 if name not in attention} | {n.name: "vocab" for n in graph.nodes if n.op_kind == "cross_entropy"}
    between = False
    for n in graph.nodes:
        linear = n.op_kind == "linear"
        if linear and (n.module_path == "lm_head" or n.module_path.endswith(".mlp.c_fc")):
            found[n.name], between = "column", n.module_path != "lm_head"
        elif linear and n.module_path.endswith(".mlp.c_proj"):
            found[n.name], between = ("row_sp" if sp else "row"), False
        elif between:  # the views and activation between the MLP's projections: on feature shards
            last = Shard(len(n.output.shape) - 1)
            found[n.name] = next(s.name for s in registry.strategies(n, tp, info) if s.output == last)
    return found
