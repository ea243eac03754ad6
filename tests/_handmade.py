"""A hand-written causal LM for the runtime tests: plain nn.Linear projections, F.scaled_dot_product_attention,
LayerNorm, learned positions, blocks in a list called `stack` (not `layers`). `forward(input_ids)` returns
logits (B, T, V); with `labels` it returns transformers' loss (mean cross-entropy of logits[:, :-1]
against labels[:, 1:]), which is also what `autoplan.capture.hf.capture_hf` exports."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.head_dim = hidden // heads
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(hidden, hidden) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        # (B, T, h*d) -> (B, h, T, d); -1: the heads this rank holds under tensor parallelism
        q, k, v = (p(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(batch, seq, -1))


class Mlp(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.up_proj, self.down_proj = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.up_proj(x)))


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(hidden), Attention(hidden, heads)
        self.ln2, self.mlp = nn.LayerNorm(hidden), Mlp(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class HandLM(nn.Module):
    def __init__(self, vocab: int = 128, hidden: int = 32, heads: int = 4, layers: int = 2,
                 max_seq: int = 64) -> None:
        super().__init__()
        self.embed, self.pos = nn.Embedding(vocab, hidden), nn.Embedding(max_seq, hidden)
        self.stack = nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.norm, self.lm_head = nn.LayerNorm(hidden), nn.Linear(hidden, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                use_cache: bool = False) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.embed(input_ids) + self.pos(positions)
        for block in self.stack:
            x = block(x)
        logits = self.lm_head(self.norm(x))  # (B, T, V)
        if labels is None:
            return logits
        # shift the labels, not the logits (as transformers does): capture keeps (B, T, V) logits
        targets = F.pad(labels[:, 1:], (0, 1), value=-100)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class MhaBlock(nn.Module):
    """A pre-norm block around torch's own nn.MultiheadAttention (one fused in_proj_weight (3h, h))."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden)
        self.attn = nn.MultiheadAttention(hidden, heads, batch_first=True)
        self.norm2, self.mlp = nn.LayerNorm(hidden), Mlp(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seq = x.shape[1]
        causal = torch.ones(seq, seq, dtype=torch.bool, device=x.device).triu(1)  # True: not attended
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=causal, need_weights=False, is_causal=True)[0]
        return x + self.mlp(self.norm2(x))


class MhaLM(nn.Module):
    """HandLM's interface with nn.MultiheadAttention blocks in a list called `decoder`."""

    def __init__(self, vocab: int = 128, hidden: int = 32, heads: int = 4, layers: int = 2,
                 max_seq: int = 64) -> None:
        super().__init__()
        self.embed, self.pos = nn.Embedding(vocab, hidden), nn.Embedding(max_seq, hidden)
        self.decoder = nn.ModuleList(MhaBlock(hidden, heads) for _ in range(layers))
        self.norm, self.lm_head = nn.LayerNorm(hidden), nn.Linear(hidden, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                use_cache: bool = False) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.embed(input_ids) + self.pos(positions)
        for block in self.decoder:
            x = block(x)
        logits = self.lm_head(self.norm(x))
        if labels is None:
            return logits
        targets = F.pad(labels[:, 1:], (0, 1), value=-100)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
