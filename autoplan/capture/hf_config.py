"""What autoplan accepts of a Hugging Face config, checked before anything is built from it.

A config is planned only when autoplan can model it faithfully: a decoder-only causal LM whose attention
and logits are the ones the capture and the strategy rules price. Refused by name, with one sentence
(`unsupported_reason`):

    encoder-decoder   `is_encoder_decoder` (T5, BART, ...): two stacks and cross-attention
    encoder-only      a masked-LM architecture that is not configured as a decoder (BERT, RoBERTa, ...):
                      bidirectional attention, planned as a causal LM it would be priced and run wrongly
    no causal LM      a model_type transformers has no causal-LM class for (vision, audio, ...)

Soft-capping (Gemma 2's `attn_logit_softcapping` / `final_logit_softcapping`: c tanh(x / c) of the attention
scores and of the logits) is planned: it is elementwise, so it runs in the model's own eager attention on
each rank's heads and in its own head on each rank's vocabulary shard (`hf_attention`: captured inside
the core). Only context parallelism, whose attention is SDPA's, refuses it (`runtime.module_context`).

The numbers the summary reads (`hf_count`, `hf_number`) are checked for type, range and finiteness:
a float is never truncated to an int, and bool is not a count.
"""

from __future__ import annotations

from autoplan.errors import ConfigError
from autoplan.validate import check_int, check_number


def unsupported_reason(config) -> str | None:
    """Why autoplan cannot plan the model of transformers config `config` faithfully (module docstring), or None."""
    from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                                                        MODEL_FOR_MASKED_LM_MAPPING_NAMES)

    model_type = getattr(config, "model_type", None)
    if getattr(config, "is_encoder_decoder", False):
        return (f"{model_type!r} is an encoder-decoder model (an encoder, a decoder and cross-attention); "
                f"autoplan plans decoder-only causal language models")
    if model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES and not getattr(config, "is_decoder", False):
        return (f"{model_type!r} is an encoder-only (masked-LM, bidirectional attention) model; autoplan plans "
                f"decoder-only causal language models and would price and run it as one")
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return f"{model_type!r} has no causal-LM class in transformers; autoplan plans decoder-only causal language models"
    return None


def check_supported(config, source: str) -> None:
    """ConfigError naming `source` and why, when autoplan cannot plan `config` faithfully."""
    reason = unsupported_reason(config)
    if reason:
        raise ConfigError(f"{source}: {reason}; not planned")


def _first(config, names: tuple[str, ...]):
    """(name, value) of the first of `names` that `config` sets (not None), or (names[0], None)."""
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return name, value
    return names[0], None


def hf_count(config, names: tuple[str, ...], default: int | None = None, minimum: int = 1) -> int:
    """The first of `names` `config` sets, checked as an integer >= `minimum`; `default` when none is set."""
    name, value = _first(config, names)
    if value is None:
        if default is None:
            raise ConfigError(f"the Hugging Face config sets none of {list(names)}; expected an integer >= {minimum}")
        return default
    return check_int(f"Hugging Face config {name}", value, minimum)


def hf_number(config, names: tuple[str, ...], default: float) -> float:
    """The first of `names` `config` sets, checked as a finite number > 0; `default` when none is set."""
    name, value = _first(config, names)
    return default if value is None else check_number(f"Hugging Face config {name}", value)
