"""Llama style decoder: RoPE, grouped-query attention, pre-RMSNorm blocks, SwiGLU MLP, no biases."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from autoplan.models.config import ModelConfig
from autoplan.models.layers import Attention, LMLoss, RMSNorm


class SwiGLUMLP(nn.Module):
    """down_proj(silu(gate_proj(x)) * up_proj(x)): (B, T, h) -> (B, T, f) -> (B, T, h)."""

    def __init__(self, hidden: int, ffn_hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, ffn_hidden, bias=False)
        self.up_proj = nn.Linear(hidden, ffn_hidden, bias=False)
        self.down_proj = nn.Linear(ffn_hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nn.Module):
    """x = x + attn(attn_norm(x)); x = x + mlp(mlp_norm(x)); `mlp` is given (dense or MoE)."""

    def __init__(self, config: ModelConfig, mlp: nn.Module) -> None:
        super().__init__()
        c = config
        self.attn_norm = RMSNorm(c.hidden, c.norm_eps)
        self.attn = Attention(c.hidden, c.heads, c.kv_heads, bias=False, rope=True,
                              max_seq=c.max_seq, rope_theta=c.rope_theta)
        self.mlp_norm = RMSNorm(c.hidden, c.norm_eps)
        self.mlp = mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    """tokens (B, T) -> logits (B, T, V), or the mean cross-entropy when targets are given."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = c = config  # the runtime checks plans against it
        self.tok_emb = nn.Embedding(c.vocab, c.hidden)
        self.layers = nn.ModuleList(LlamaBlock(c, self.make_mlp(c, i)) for i in range(c.num_layers))
        self.norm = RMSNorm(c.hidden, c.norm_eps)
        self.lm_head = nn.Linear(c.hidden, c.vocab, bias=False)
        self.loss = LMLoss()

    def make_mlp(self, config: ModelConfig, layer: int) -> nn.Module:
        """The MLP of block `layer`."""
        return SwiGLUMLP(config.hidden, config.ffn_hidden)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        x = self.tok_emb(tokens)  # (B, T, h)
        for block in self.layers:
            x = block(x)
        logits = self.lm_head(self.norm(x))  # (B, T, V)
        return logits if targets is None else self.loss(logits, targets)
