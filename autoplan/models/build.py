"""`build_model`: a zoo config -> its module, on the meta device without memory or initialisation."""

from __future__ import annotations

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from autoplan.models.config import ModelConfig
from autoplan.models.gpt import GPT
from autoplan.models.llama import Llama
from autoplan.models.moe import Mixtral


class _SkipInitOnMeta(TorchFunctionMode):
    """Makes initialisers of meta tensors no-ops (`torch.nn.init.*` and the in-place random and fill
    methods): a meta tensor holds no values, and `normal_` on meta goes through torch's reference
    decompositions, whose first use imports torch._dynamo (about 2 s of every planning run)."""

    INIT_METHODS = frozenset({torch.Tensor.normal_, torch.Tensor.uniform_, torch.Tensor.fill_, torch.Tensor.zero_})

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        initialiser = func in self.INIT_METHODS or getattr(func, "__module__", None) == "torch.nn.init"
        target = args[0] if args else kwargs.get("tensor")  # nn.init passes its tensor by keyword
        if initialiser and isinstance(target, torch.Tensor) and target.is_meta:
            return target
        return func(*args, **kwargs)


def build_model(config: ModelConfig, device: str | torch.device = "meta",
                dtype: torch.dtype = torch.float32) -> nn.Module:
    """Construct the module for `config` directly on `device` (meta: no memory, no initialisation),
    cast to `dtype`."""
    classes = {"gpt": GPT, "llama": Llama, "moe": Mixtral}
    with torch.device(device):
        if torch.device(device).type != "meta":
            return classes[config.family](config).to(dtype=dtype)
        with _SkipInitOnMeta():
            model = classes[config.family](config)
    return model.to(dtype=dtype)
