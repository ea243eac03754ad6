"""The model zoo: configs and presets (`config`, torch-free), the modules (`gpt`, `llama`, `moe`, `layers`)
and `build_model` (`build`). The modules and `build_model` load torch on first use, so the planner can
read a config without it."""

from __future__ import annotations

import importlib

from autoplan.models.config import ModelConfig, get_model_config, known_models, load_model_config

_LAZY = {"build_model": "autoplan.models.build", "LEAF_MODULE_TYPES": "autoplan.models.layers"}

__all__ = ["LEAF_MODULE_TYPES", "ModelConfig", "build_model", "get_model_config", "known_models",
           "load_model_config"]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'autoplan.models' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
