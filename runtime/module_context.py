"""Context parallelism for the user's own module (a transformers causal LM), DeepSpeed-Ulysses style
as the zoo runs it (`runtime.context`), on the plan's cp axis.

Each cp rank c of a group of C holds tokens [c T/C, (c+1) T/C) of each sequence of its rows, and
their targets (`ContextParallel.shard`, the chunks of the zoo's `RankProgram.shard_batch`). The
model runs unchanged on those tokens with its position ids given explicitly as their global
positions (`ContextParallel.positions`: arange(T/C) + c T/C, the zoo's `cp_positions`), so rotary
tables and learned position embeddings see where each token is. Linear layers, norms, the MLP and
the loss are per token. Attention goes through transformers' attention interface: the model's
config names an implementation registered here (`install`), whose function receives this rank's
q (B, h, T/C, d) and k, v (B, h_kv, T/C, d) after the rotary embedding and runs

    cp_heads(q), cp_heads(k, repeat), cp_heads(v, repeat)   all-to-all: sequence shards -> head
                                shards (B, T, h/C d); kv heads first repeated `repeat` times when C
                                does not divide them (`runtime.context.kv_repeat`)
    SDPA(q, k, v, causal)       the whole sequence for h/C heads, causal masking on global positions
    cp_sequence(y)              all-to-all back: (B, T, h/C d) -> (B, T/C, h d)

the zoo's functions (`runtime.context.cp_heads`, `cp_sequence`) on the zoo's (B, T, heads x d)
layout, so that the four all-to-alls per layer and microbatch forward (and their four backward) are
the ones the cost model prices (`cost_model.parallel_dims.ulysses_all_to_all_s`). The core calls
torch's SDPA itself rather than transformers' sdpa function: that one reads the grouped-query ratio
from the attention module, which a kv repeat changes. The loss is this rank's sum of token
cross-entropies; the program scales it and averages gradients over dp x ep x cp
(`runtime.module_program`), so parameter gradients are summed over cp.

What cannot run so is refused by `check_context_model` (PlanError naming the module and what to
change): a model whose attention does not go through transformers' attention interface (a
hand-written module), an attention implementation other than sdpa or eager, attention-logit
softcapping, sliding windows shorter than the sequence, rotary tables rescaled from the positions a
forward sees (dynamic NTK, longrope); and, at call time, an attention mask (the
program passes none: padding is a target of -100).
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from autoplan.errors import ConfigError, PlanError
from autoplan.plan import Plan
from autoplan.runtime.context import cp_heads, cp_positions, cp_sequence, kv_repeat
from autoplan.runtime.groups import RankGroup

WRAPPED = ("sdpa", "eager")  # the implementations whose computation the Ulysses core is
_NAMES = itertools.count()  # one registered implementation per program: each holds its own group


class ContextParallel:
    """This rank's cp group (`group.index`: its sequence chunk, its position in the all-to-alls)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        ranks = tuple(dist.get_process_group_ranks(group))
        self.group = RankGroup("cp", ranks, dist.get_rank(group), group)

    @property
    def size(self) -> int:
        return self.group.size

    def shard(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's chunk of the sequence dim (1) of (B, T) tokens or targets."""
        if x.shape[1] % self.size:
            raise ConfigError(f"sequence length {x.shape[1]} is not divisible by cp={self.size}: each "
                              f"context-parallel rank holds an equal chunk; use a multiple of {self.size}")
        return x.chunk(self.size, dim=1)[self.group.index]

    def positions(self, tokens: torch.Tensor) -> torch.Tensor:
        """The global position ids (B, T/C) of this rank's (B, T/C) tokens."""
        local = torch.arange(tokens.shape[1], device=tokens.device).expand(tokens.shape[0], -1)
        return cp_positions(local, self.group)

    def attention(self, module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask, dropout: float = 0.0, scaling: float | None = None, is_causal=None,
                  **kwargs) -> tuple[torch.Tensor, None]:
        """transformers' attention-function signature: (B, h, T/C, d) q, k, v -> (B, T/C, h, d)."""
        _check_call(module, query, attention_mask, is_causal, kwargs, self.size)
        batch, heads, local, dim = query.shape
        repeat = kv_repeat(heads, key.shape[1], self.size) if key.shape[1] % self.size else 1
        q, k, v = (cp_heads(_flat(x), dim, r, self.group) for x, r in ((query, 1), (key, repeat), (value, repeat)))
        q, k, v = (_split_heads(x, dim) for x in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, scale=scaling,
                                           enable_gqa=k.shape[1] != q.shape[1])
        y = cp_sequence(y.transpose(1, 2).reshape(batch, -1, heads // self.size * dim), self.group)
        return y.view(batch, local, heads, dim), None


def _flat(x: torch.Tensor) -> torch.Tensor:
    """(B, h, T, d) -> the zoo's (B, T, h d)."""
    batch, heads, seq, dim = x.shape
    return x.transpose(1, 2).reshape(batch, seq, heads * dim)


def _split_heads(x: torch.Tensor, dim: int) -> torch.Tensor:
    """(B, T, h d) -> (B, h, T, d)."""
    batch, seq, width = x.shape
    return x.view(batch, seq, width // dim, dim).transpose(1, 2)


def _check_call(module: nn.Module, query, attention_mask, is_causal, kwargs: dict, cp: int) -> None:
    """What the Ulysses core does not compute, refused at the call (`check_context_model` refuses it
    from the config first where the config says so)."""
    name = type(module).__name__
    if isinstance(query, DTensor):
        raise PlanError(f"{name}: attention's q arrives as a DTensor ({query.placements}) under cp={cp}; the "
                        f"module runtime runs context parallelism on head-parallel (column) or replicated "
                        f"attention projections: plan them so, or cp=1")
    if attention_mask is not None:
        raise PlanError(f"{name}: an attention mask of shape {tuple(attention_mask.shape)} under cp={cp}; "
                        f"context parallelism runs causal attention without masks (mark padding with "
                        f"targets of -100 instead), or plan cp=1")
    found = {k: kwargs[k] for k in ("softcap", "sliding_window", "s_aux", "position_bias")
             if kwargs.get(k) is not None}
    if is_causal is False or getattr(module, "is_causal", True) is False:
        found["is_causal"] = False
    if found:
        raise PlanError(f"{name}: attention with {found} under cp={cp}; the module runtime's context "
                        f"parallelism runs plain causal attention: plan cp=1 for this model")


def check_context_model(plan: Plan, model: nn.Module) -> None:
    """PlanError where the model's attention cannot run context-parallel (module docstring)."""
    cp = plan.mesh.cp
    config = getattr(model, "config", None)
    if not getattr(model, "_supports_attention_backend", False) or not hasattr(config, "to_dict"):
        raise PlanError(f"cp={cp} on {type(model).__name__}{_attention_named(model)}: the module runtime runs "
                        f"context parallelism on transformers models, whose attention goes through "
                        f"transformers' attention interface, where it adds the all-to-alls; this module calls "
                        f"its attention itself. Plan cp=1 (SearchOptions(context_parallel=False))")
    implementation = config._attn_implementation
    if implementation not in WRAPPED:
        raise PlanError(f"cp={cp}: the model's attention implementation is {implementation!r}; context "
                        f"parallelism runs SDPA between its all-to-alls, in place of {WRAPPED}: load the model "
                        f"with attn_implementation='sdpa', or plan cp=1")
    if getattr(config, "attn_logit_softcapping", None) is not None:
        raise PlanError(f"cp={cp}: config.attn_logit_softcapping={config.attn_logit_softcapping} (softcapped "
                        f"attention logits), which SDPA does not compute: plan cp=1 for this model")
    _check_rope(model, cp)
    for path, module in model.named_modules():
        window = getattr(module, "sliding_window", None)
        if isinstance(window, int) and window < plan.seq_len:
            raise PlanError(f"module {path!r}: a sliding window of {window} tokens, shorter than the plan's "
                            f"sequence of {plan.seq_len}; context parallelism runs full causal attention: "
                            f"plan cp=1, or a sequence of at most {window} tokens")


def _check_rope(model: nn.Module, cp: int) -> None:
    """Rotary tables that transformers rescales from the largest position id a forward sees
    ("dynamic" NTK scaling, "longrope") would differ between the cp ranks, which see different ones."""
    for path, module in model.named_modules():
        kinds = getattr(module, "rope_type", None)
        kinds = kinds.values() if isinstance(kinds, dict) else [kinds]
        found = [k for k in kinds if isinstance(k, str) and ("dynamic" in k or k == "longrope")]
        if found:
            raise PlanError(f"module {path!r}: rope_type {found[0]!r} rescales its frequencies from the largest "
                            f"position id each forward sees, which differs between the cp={cp} ranks (each "
                            f"holds a chunk of the sequence): plan cp=1, or a rope_type without it")


def _attention_named(model: nn.Module) -> str:
    """' (attention module 'path': Type)' for the first module that looks like attention, or ''."""
    for path, module in model.named_modules():
        if isinstance(module, nn.MultiheadAttention) or path.rpartition(".")[2].lower() in ("attn", "attention",
                                                                                            "self_attn"):
            return f" (attention module {path!r}: {type(module).__name__})"
    return ""


def install(model: nn.Module, context: ContextParallel) -> str:
    """Register `context.attention` in transformers' attention interface under a name of its own and
    make the model's config (and its sub-configs) use it; returns the name. Set for good, not around
    each forward: recomputed blocks run their forward again during backward."""
    from transformers import AttentionInterface

    name = f"autoplan_ulysses_{next(_NAMES)}"
    AttentionInterface.register(name, context.attention)
    model.config._attn_implementation = name
    return name
