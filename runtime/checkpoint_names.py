"""The model's name of each tensor a transformers checkpoint stores, by transformers' own renamings.

transformers 5 renames some modules against the names its checkpoints (and the Hub's) keep, and applies
the difference on load: GPT-NeoX's `embed_out` is the model's `lm_head`, Mixtral's `block_sparse_moe` its
`mlp`, old LayerNorms' `gamma` / `beta` their `weight` / `bias`. The renamings are transformers' conversion
mapping for the model's class or `model_type` (`conversion_mapping.get_model_conversion_mapping`, the list
`from_pretrained` uses), and a stored key k names the model's tensor

    rename(k) = core_model_loading.rename_source_key(k, the mapping's WeightRenaming entries, no converters,
                                                     the model's base_model_prefix, its state dict's names)

as `from_pretrained` computes it (the base-model prefix added or dropped as the model needs). The
mapping's WeightConverters (per-expert tensors merged into fused experts) are not renamings of one tensor:
`runtime.expert_checkpoint` reads those. A module that is not a transformers model keeps the stored names.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn


def checkpoint_renamer(model: nn.Module) -> Callable[[str], str] | None:
    """stored key -> the model's name of that tensor, by transformers' renamings for `model` (module
    docstring); None for a module that is not a transformers model or whose mapping renames nothing."""
    renamings = _weight_renamings(model)
    if not renamings:
        return None
    from transformers.core_model_loading import rename_source_key

    names = {name: True for name in model.state_dict(keep_vars=True)}
    prefix = getattr(model, "base_model_prefix", None) or None

    def rename(key: str) -> str:
        return rename_source_key(key, renamings, [], prefix, names)[0]

    return rename


def _weight_renamings(model: nn.Module) -> list:
    """The WeightRenaming entries of transformers' conversion mapping for `model` ([] when it is not a
    transformers model)."""
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming
    except ImportError:  # no transformers, or one without conversion mappings (before 5.0)
        return []
    if not isinstance(model, PreTrainedModel):
        return []
    return [t for t in get_model_conversion_mapping(model) if isinstance(t, WeightRenaming)]


def model_names(stored: list[str], rename: Callable[[str], str] | None) -> dict[str, str]:
    """The model's name -> the stored key, for every stored key; a key already one of the model's names
    wins over a renamed one that lands on the same name."""
    if rename is None:
        return {key: key for key in stored}
    renamed = {key: rename(key) for key in stored}
    found = {key: key for key, name in renamed.items() if name == key}
    for key, name in renamed.items():
        found.setdefault(name, key)
    return found
