"""The ep routing imbalance margins (`cost_model.activations.ep_imbalance_margins`: held after the forward,
and while a recomputed layer is re-run): with MoE experts spread over an expert group, the plan prices the
busiest rank's routed rows at the mean times (1 + margin), the margins following the expert group, the
experts per rank and the layers as the stated model says; shows those bytes as their own line of the
memory breakdown and of `autoplan explain`, and leaves every other storage, and every plan without ep (a
MoE at ep = 1, a dense model), as it was. The measured side: tests/test_memory_fidelity.py's ep cases."""

from __future__ import annotations

import dataclasses

import pytest

from _dist import make_plan
from autoplan.api import capture_model
from autoplan.cli.explain import EP_MARGIN_LINE, activation_families, explain_plan
from autoplan.cost_model.ep_margins import ep_imbalance_margins
from autoplan.cost_model.storages import activation_bytes
from autoplan.recompute_policy import recompute_policy
from autoplan.cost_model.memory import plan_activation_bytes, plan_activations
from autoplan.models import get_model_config

SEQ = 64
ROUTED = ("received", "expert_in", "gate", "up", "product", "down")  # `_moe`'s storages per received row


def _case(model, ep: int, recompute: str = "none"):
    config = get_model_config(model) if isinstance(model, str) else model
    plan = make_plan(model, 1, 1, seq_len=SEQ, microbatch_size=4, ep=ep, recompute=recompute)
    return plan, capture_model(config, SEQ, plan.dtype), config.rule_info()


def _routed_bytes(plan, graph, info) -> tuple[float, float]:
    """(held, re-run) bytes of the routed storages, at the mean: `activation_bytes` over them alone."""
    acts, scale = plan_activations(plan, graph, info, False)
    routed = {k: s for k, s in acts.storages.items() if s.routed}
    others = activation_bytes(dataclasses.replace(acts, storages={**acts.storages, **{
        k: dataclasses.replace(s, nbytes=0.0) for k, s in routed.items()}}), recompute_policy(plan.recompute), scale)
    mean = activation_bytes(acts, recompute_policy(plan.recompute), scale)
    return mean[0] - others[0], mean[1] - others[1]


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_margins_scale_the_routed_rows_only_under_ep(recompute):
    """Busiest rank = mean + margin x the routed storages' bytes (held; re-run), and the routed storages
    are the per-received-row ones of `_moe`."""
    plan, graph, info = _case("tiny-moe", 2, recompute)
    acts, _ = plan_activations(plan, graph, info)
    assert {k.rsplit(":", 1)[-1] for k, s in acts.storages.items() if s.routed} == set(ROUTED)
    config = get_model_config("tiny-moe")  # h 64, E 4, k 2, 2 layers: at ep 2, 2 experts a rank
    assert acts.margins == ep_imbalance_margins(2, config.experts, config.top_k, config.hidden, 2)
    mean, busiest = plan_activation_bytes(plan, graph, info, False), plan_activation_bytes(plan, graph, info)
    routed = _routed_bytes(plan, graph, info)
    assert routed[0 if recompute == "none" else 1] > 0.3 * mean[0 if recompute == "none" else 1]
    for i, margin in enumerate(acts.margins):
        assert busiest[i] == pytest.approx(mean[i] + margin * routed[i], rel=1e-12)


@pytest.mark.parametrize("model, ep", [("tiny-moe", 1), ("tiny-llama", 1), ("tiny-gpt", 1)])
def test_no_margin_without_ep(model, ep):
    plan, graph, info = _case(model, ep, "full")
    acts, _ = plan_activations(plan, graph, info)
    assert acts.margins == (0.0, 0.0) and not any(s.routed for s in acts.storages.values())
    assert plan_activation_bytes(plan, graph, info) == plan_activation_bytes(plan, graph, info, False)
    assert plan.predicted.memory.ep_imbalance_bytes == 0.0
    assert EP_MARGIN_LINE not in explain_plan(plan, ops=False)


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_breakdown_shows_the_margin_as_its_own_line(recompute):
    """The plan's activations are the mean's, its ep line the margin's bytes (held, or while a layer is
    re-run under full recompute), and the two add up to the busiest rank's `plan_activation_bytes`."""
    plan, graph, info = _case("tiny-moe", 2, recompute)
    memory = plan.predicted.memory
    at_mean, busiest = sum(plan_activation_bytes(plan, graph, info, False)), sum(plan_activation_bytes(plan, graph, info))
    assert memory.activations_bytes == pytest.approx(at_mean, rel=1e-9)
    assert memory.ep_imbalance_bytes == pytest.approx(busiest - at_mean, rel=1e-9)
    assert memory.ep_imbalance_bytes > 0.01 * memory.activations_bytes  # tiny-moe (h 64) routes evenly: a small share
    assert plan.predicted.peak_memory_bytes == pytest.approx(memory.total_bytes(), rel=1e-12)
    config = get_model_config("tiny-moe")
    rows, transient = activation_families(plan, graph, config)
    assert rows[0] == (EP_MARGIN_LINE, pytest.approx(memory.ep_imbalance_bytes, rel=1e-9))
    assert sum(b for _, b in rows) + transient == pytest.approx(memory.activations_bytes + memory.ep_imbalance_bytes,
                                                                 rel=1e-9)
    assert EP_MARGIN_LINE in explain_plan(plan, ops=False)


def test_margins_follow_the_group_and_the_layers():
    """The stated model's shape: a larger expert group (fewer experts a rank, the max of more ranks) has the
    larger margins; more layers held average the held excess down, and the busiest of more re-run layers
    is busier; the re-run margin (one layer) exceeds the held one (a mean over the layers)."""
    held2, rerun2 = ep_imbalance_margins(2, 8, 2, 256, 4)
    held4, rerun4 = ep_imbalance_margins(4, 8, 2, 256, 4)
    assert held4 > held2 > 0 and rerun4 > rerun2 > held2
    deep = ep_imbalance_margins(2, 8, 2, 256, 16)
    assert deep[0] < held2 and deep[1] > rerun2
    assert ep_imbalance_margins(2, 8, 2, 64, 4)[0] < held2  # narrow: the per-token embedding dominates routing


def test_deep_model_prices_its_whole_depth():
    """The margins read the model's MoE layers (rule info "moe_layers"), not the layers of the graph a
    walk sees: the step model walks a representative graph of a deep model (`cost_model.layer_runs`), and
    its plan's ep line must equal the whole graph's `plan_activation_bytes` over the mean."""
    config = dataclasses.replace(get_model_config("tiny-moe"), name="tiny-moe-deep", num_layers=8)
    plan, graph, info = _case(config, 2)
    acts, _ = plan_activations(plan, graph, info)
    assert acts.margins == ep_imbalance_margins(2, config.experts, config.top_k, config.hidden, 8)
    at_mean, busiest = sum(plan_activation_bytes(plan, graph, info, False)), sum(plan_activation_bytes(plan, graph, info))
    assert plan.predicted.memory.ep_imbalance_bytes == pytest.approx(busiest - at_mean, rel=1e-9)


@pytest.mark.parametrize("recompute", ["full:1", "selective"])
def test_a_policy_prices_the_margins_over_the_layers_it_holds_and_reruns(recompute):
    """`Activations.policy_margins`: under full:k the routed rows after the forward are the L - k layers left
    whole (their mean's excess is larger over fewer layers) and the re-run's busiest is one of the k re-run
    layers (smaller over fewer); a policy keeping routed rows of every layer (selective) holds all L. The
    plan's breakdown (step model) and `plan_activation_bytes` price the same margins."""
    plan, graph, info = _case("tiny-moe", 2, recompute)
    acts, _ = plan_activations(plan, graph, info)
    config = get_model_config("tiny-moe")
    shape = (2, config.experts, config.top_k, config.hidden, 2)
    if recompute == "full:1":
        assert acts.policy_margins("full", 1) == ep_imbalance_margins(*shape, held_layers=1, rerun_layers=1)
        held, rerun = acts.policy_margins("full", 1)
        assert held > acts.margins[0] and rerun < acts.margins[1]
    else:
        assert acts.policy_margins("selective", 2) == acts.margins
    memory = plan.predicted.memory
    assert memory.activations_bytes + memory.ep_imbalance_bytes == pytest.approx(
        sum(plan_activation_bytes(plan, graph, info)), rel=1e-9)
    assert memory.activations_bytes == pytest.approx(sum(plan_activation_bytes(plan, graph, info, False)), rel=1e-9)
