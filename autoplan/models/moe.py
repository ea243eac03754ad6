"""Mixture-of-experts decoders: the Llama decoder with each block's MLP replaced by a routed
mixture of SwiGLU experts (`MoEFeedForward`, a capture leaf), in three layouts of one family:

    Mixtral    mlp = MoEFeedForward(h, f, E, k)
    DeepSeekMoE (fine-grained; Dai et al. 2024)
               mlp = MoEFeedForward(h, f, E, k)(x) + SwiGLUMLP(h, S*f)(x)   S shared experts, always on
               and the first `dense_layers` blocks a dense SwiGLUMLP(h, f_dense)
    BigMac     (Jin et al. 2025: descend, communicate, communicate, ascend)
               mlp = ascend(MoEFeedForward(r, f, E, k)(descend(x)))   descend: Linear(h, r), ascend:
               Linear(r, h), r < h, so expert dispatch and combine move r-wide tokens

Everything is built from capture leaves (Linear, MoEFeedForward) and elementwise adds, so the
capture, the strategy rules and the runtime need nothing new. A Mixtral layer keeps
`layers.<i>.mlp` = the MoEFeedForward itself (parameter names `mlp.router.weight`, `mlp.w_gate`);
the other layouts nest it as `mlp.experts`, beside `mlp.shared` (gate_proj / up_proj / down_proj,
which Megatron's assignment shards like a dense MLP) and `mlp.descend` / `mlp.ascend`.
"""

from __future__ import annotations

import torch
from torch import nn

from autoplan.models.config import ModelConfig
from autoplan.models.layers import MoEFeedForward
from autoplan.models.llama import Llama, SwiGLUMLP


class MoELayer(nn.Module):
    """[descend] -> routed experts (+ shared experts) -> [ascend]: (B, T, h) -> (B, T, h).

    Shared experts run beside the routed ones at the experts' width r (h unless BigMac descends)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        c, r = config, config.expert_width
        self.descend = nn.Linear(c.hidden, r, bias=False) if r != c.hidden else None
        self.experts = MoEFeedForward(r, c.ffn_hidden, c.experts, c.top_k, c.capacity_factor)
        self.shared = SwiGLUMLP(r, c.shared_experts * c.ffn_hidden) if c.shared_experts else None
        self.ascend = nn.Linear(r, c.hidden, bias=False) if r != c.hidden else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.descend is not None:
            x = self.descend(x)  # (B, T, r)
        y = self.experts(x)  # (B, T, r)
        if self.shared is not None:
            y = y + self.shared(x)
        if self.ascend is not None:
            y = self.ascend(y)  # (B, T, h)
        return y


class Mixtral(Llama):
    """Llama with `layers.<i>.mlp` a mixture of experts (the module docstring's three layouts)."""

    def make_mlp(self, config: ModelConfig, layer: int) -> nn.Module:
        c = config
        if layer < c.dense_layers:
            return SwiGLUMLP(c.hidden, c.dense_ffn_hidden)
        if c.shared_experts or c.expert_width != c.hidden:
            return MoELayer(c)
        return MoEFeedForward(c.hidden, c.ffn_hidden, c.experts, c.top_k, c.capacity_factor)
