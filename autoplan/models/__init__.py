"""The model zoo: configs, presets and `build_model`."""

from __future__ import annotations

import torch
from torch import nn

from autoplan.models.config import ModelConfig, get_model_config, known_models, load_model_config
from autoplan.models.gpt import GPT
from autoplan.models.layers import LEAF_MODULE_TYPES
from autoplan.models.llama import Llama
from autoplan.models.moe import Mixtral

__all__ = ["LEAF_MODULE_TYPES", "ModelConfig", "build_model", "get_model_config", "known_models",
           "load_model_config"]


def build_model(config: ModelConfig, device: str | torch.device = "meta",
                dtype: torch.dtype = torch.float32) -> nn.Module:
    """Construct the module for `config` directly on `device` (meta: no memory), cast to `dtype`."""
    classes = {"gpt": GPT, "llama": Llama, "moe": Mixtral}
    with torch.device(device):
        model = classes[config.family](config)
    return model.to(dtype=dtype)
