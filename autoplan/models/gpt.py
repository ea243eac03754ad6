"""GPT-2/3 style decoder: learned positions, pre-LayerNorm blocks, GELU MLP, untied lm_head."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from autoplan.models.config import ModelConfig
from autoplan.models.layers import Attention, LMLoss


class GPTMLP(nn.Module):
    """proj(gelu(fc(x))): (B, T, h) -> (B, T, f) -> (B, T, h)."""

    def __init__(self, hidden: int, ffn_hidden: int) -> None:
        super().__init__()
        self.fc = nn.Linear(hidden, ffn_hidden)
        self.proj = nn.Linear(ffn_hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class GPTBlock(nn.Module):
    """x = x + attn(ln_1(x)); x = x + mlp(ln_2(x))."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        c = config
        self.ln_1 = nn.LayerNorm(c.hidden, eps=c.norm_eps)
        self.attn = Attention(c.hidden, c.heads, c.kv_heads, bias=True, rope=False,
                              max_seq=c.max_seq, rope_theta=c.rope_theta)
        self.ln_2 = nn.LayerNorm(c.hidden, eps=c.norm_eps)
        self.mlp = GPTMLP(c.hidden, c.ffn_hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """tokens (B, T) -> logits (B, T, V), or the mean cross-entropy when targets are given."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = c = config  # the runtime checks plans against it
        self.tok_emb = nn.Embedding(c.vocab, c.hidden)
        self.pos_emb = nn.Embedding(c.max_seq, c.hidden)
        self.layers = nn.ModuleList(GPTBlock(c) for _ in range(c.num_layers))
        self.norm = nn.LayerNorm(c.hidden, eps=c.norm_eps)
        self.lm_head = nn.Linear(c.hidden, c.vocab, bias=False)
        self.loss = LMLoss()

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        B, T = tokens.size(0), tokens.size(1)
        positions = torch.arange(T, device=tokens.device).unsqueeze(0).expand(B, T)  # (B, T)
        x = self.tok_emb(tokens) + self.pos_emb(positions)  # (B, T, h)
        for block in self.layers:
            x = block(x)
        logits = self.lm_head(self.norm(x))  # (B, T, V)
        return logits if targets is None else self.loss(logits, targets)
