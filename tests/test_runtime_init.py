"""Seeded shard-exact init: every shard equals the same slice of the single-device init."""

from __future__ import annotations

import math

import pytest
import torch

from autoplan.models import build_model, get_model_config
from autoplan.placement import Replicate, Shard
from autoplan.runtime.init import (CHUNK_ELEMENTS, InitRule, init_local, init_parameters,
                                   init_rules, init_shard, rows_per_chunk, shard_bounds)

NORMAL = InitRule("normal", 0.02)


def _full(name: str, shape: tuple[int, ...], rule: InitRule = NORMAL, seed: int = 7) -> torch.Tensor:
    return init_local(name, shape, rule, seed, tuple((0, s) for s in shape))


@pytest.mark.parametrize("shape,dim,degree", [
    ((96, 40), 0, 4), ((96, 40), 1, 4), ((96, 40), 1, 2),
    ((6, 24, 36), 0, 3), ((6, 24, 36), 1, 2), ((6, 24, 36), 2, 4),  # 3-D, like MoE w_gate
    ((4096, 32), 0, 8), ((4096, 32), 1, 8),  # many row chunks
    ((40,), 0, 4),
])
def test_shard_equals_slice_of_single(shape, dim, degree):
    full = _full("w", shape)
    for rank in range(degree):
        shard = init_shard("w", shape, NORMAL, 7, Shard(dim), rank, degree)
        assert torch.equal(shard, full.chunk(degree, dim=dim)[rank])


def test_replicate_is_the_full_tensor_and_chunks_are_bounded():
    shape = (3000, 50)  # 150k values: several chunks
    assert torch.equal(init_shard("w", shape, NORMAL, 7, Replicate(), 1, 4), _full("w", shape))
    assert rows_per_chunk(shape) * shape[1] <= CHUNK_ELEMENTS
    assert math.ceil(shape[0] / rows_per_chunk(shape)) > 1


def test_values_depend_on_name_and_seed_only():
    a, b = _full("a", (64, 8)), _full("b", (64, 8))
    assert not torch.equal(a, b)
    assert not torch.equal(a, _full("a", (64, 8), seed=8))
    assert torch.equal(a, _full("a", (64, 8)))
    assert abs(a.std().item() - 0.02) < 0.004 and abs(a.mean().item()) < 0.004


def test_arbitrary_row_and_column_window():
    shape = (2000, 48)
    full = _full("w", shape)
    window = ((37, 1333), (5, 29))
    assert torch.equal(init_local("w", shape, NORMAL, 7, window), full[37:1333, 5:29])


def test_shard_bounds_rejects_indivisible():
    with pytest.raises(ValueError, match="not divisible by 3"):
        shard_bounds((10, 4), Shard(0), 0, 3)


@pytest.mark.parametrize("model_name", ["tiny-gpt", "tiny-llama", "tiny-moe"])
def test_model_rules_and_single_device_init(model_name):
    config = get_model_config(model_name)
    model = init_parameters(build_model(config, device="cpu"), seed=3, num_layers=config.num_layers)
    rules = init_rules(model, config.num_layers)
    scaled = 0.02 / math.sqrt(2 * config.num_layers)
    for name, param in model.named_parameters():
        rule = rules[name]
        if name.endswith("bias"):
            assert rule.kind == "zeros" and torch.all(param == 0), name
        elif "norm" in name or "ln_" in name:
            assert rule.kind == "ones" and torch.all(param == 1), name
        elif name.rsplit(".", 2)[-2] in ("o_proj", "proj", "down_proj") or name.endswith("w_down"):
            assert rule == InitRule("normal", scaled), name
        else:
            assert rule == InitRule("normal", 0.02), name
    again = init_parameters(build_model(config, device="cpu"), seed=3)
    for (name, a), (_, b) in zip(model.named_parameters(), again.named_parameters()):
        assert torch.equal(a, b), name


def test_init_parameters_refuses_meta():
    with pytest.raises(ValueError, match="meta"):
        init_parameters(build_model(get_model_config("tiny-gpt")), seed=0)
