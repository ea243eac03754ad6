"""Recompute policies (`autoplan.recompute_policy`): names, the layers they recompute, what they save,
and the op families both sides read, the runtime's aten ops and the captured op kinds (tier 1)."""

from __future__ import annotations

import pytest

from autoplan.errors import PlanError
from autoplan.recompute_policy import (SEARCHED, RecomputePolicy, aten_op_family, captured_op_family,
                                       recompute_policy)


@pytest.mark.parametrize("name, saves, layers", [
    ("none", set(), []), ("selective", {"matmul", "attention"}, [0, 1, 2, 3]), ("matmul-only", {"matmul"}, [0, 1, 2, 3]),
    ("full", set(), [0, 1, 2, 3]), ("full:2", set(), [0, 1]), ("selective:1", {"matmul", "attention"}, [0])])
def test_policies_say_what_they_save_and_which_layers(name, saves, layers):
    policy = recompute_policy(name)
    assert policy.name == name and set(policy.saves) == saves
    assert list(policy.recomputed_layers(4)) == layers
    assert [policy.recomputes(i, 4) for i in (None, 0, 3)] == [False, 0 in layers, 3 in layers]


def test_searched_policies_go_from_least_to_most_recomputed():
    keys = [recompute_policy(name).sort_key() for name in SEARCHED]
    assert keys == sorted(keys) and recompute_policy("full:2").sort_key() < recompute_policy("full").sort_key()


@pytest.mark.parametrize("text, match", [
    ("some", r"recompute 'some': the kind must be one of \['none', 'selective', 'matmul-only', 'full'\]"),
    ("full:x", "the part after ':' must be a layer count"), ("full:0", "the layer count must be >= 1"),
    ("none:2", "the kind not 'none'")])
def test_bad_names_say_what_is_accepted(text, match):
    with pytest.raises(PlanError, match=match):
        recompute_policy(text)


def test_families_of_aten_ops_and_captured_op_kinds():
    assert [aten_op_family(op) for op in ("aten.mm", "aten.addmm", "aten.bmm")] == ["matmul"] * 3
    assert aten_op_family("aten._scaled_dot_product_flash_attention_for_cpu") == "attention"
    assert aten_op_family("c10d.allreduce_") == "collective"
    assert [aten_op_family(op) for op in ("aten.mul", "aten.native_layer_norm", "aten._to_copy")] == ["other"] * 3
    assert [captured_op_family(k) for k in ("linear", "moe", "attention", "norm")] == ["matmul", "matmul", "attention",
                                                                                       "other"]
    assert RecomputePolicy("selective").describe().startswith("selective: every layer re-run in backward")
