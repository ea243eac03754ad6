"""Mixtral style decoder: the Llama decoder with each block's MLP replaced by a routed
mixture of SwiGLU experts (`MoEFeedForward`, a capture leaf)."""

from __future__ import annotations

from torch import nn

from autoplan.models.config import ModelConfig
from autoplan.models.layers import MoEFeedForward
from autoplan.models.llama import Llama


class Mixtral(Llama):
    """Llama with `layers.<i>.mlp` = MoEFeedForward(hidden, ffn_hidden, experts, top_k)."""

    def make_mlp(self, config: ModelConfig) -> nn.Module:
        return MoEFeedForward(config.hidden, config.ffn_hidden, config.experts, config.top_k)
