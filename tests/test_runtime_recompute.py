"""Recomputation as the plan says, and bf16 mixed precision, on 2 gloo ranks.

Recompute ("full": each layer's subgraph in torch.utils.checkpoint; "selective": attention cores and
pointwise ops; also under ZeRO 3, whose FSDP2 hooks then gather parameters again for the
recomputation) must not change the numbers: each policy's losses, first-step gradients and final
parameters equal the run without recomputation (the same ops in the same order: bit for bit) and
the single-process run. It must also keep less for backward: the bytes saved for backward in one
forward (counted with saved-tensor hooks; a checkpointed region's own inputs are held by the
checkpoint, not counted) fall from none to selective to full.

Mixed precision (plan dtype bfloat16): master weights and gradients stay fp32, matmuls run in bf16
(the lm_head's output is bf16), and the loss stays finite and within 2e-3 of the fp32 run's.
"""

from __future__ import annotations

import pytest
import torch

from _dist import assert_matches, batches, make_plan, spawn, train_program

pytestmark = pytest.mark.gloo

SEED, STEPS, LR, EPS = 5, 3, 1e-3, 1e-6
POLICIES = ("none", "selective", "full")
SETUPS = {  # id: (model, make_plan keyword arguments)
    "gpt-tp2-megatron-sp": ("tiny-gpt", dict(dp=1, tp=2, assignment="megatron-sp")),
    "llama-dp2": ("tiny-llama", dict(dp=2, tp=1, num_microbatches=2)),
    "moe-tp2-megatron": ("tiny-moe", dict(dp=1, tp=2, assignment="megatron")),
}
EXTRAS = {  # recompute composed with other features: id -> (model, make_plan keyword arguments)
    "gpt-dp2-zero3-full": ("tiny-gpt", dict(dp=2, tp=1, zero_stage=3, recompute="full")),
}


def _plans() -> list[tuple]:
    found = []
    for sid, (model, kwargs) in SETUPS.items():
        kwargs = dict(kwargs)
        dp, tp = kwargs.pop("dp"), kwargs.pop("tp")
        for policy in POLICIES:
            found.append((f"{sid}-{policy}", model, make_plan(model, dp, tp, recompute=policy,
                                                              **kwargs)))
    for cid, (model, kwargs) in EXTRAS.items():
        kwargs = dict(kwargs)
        found.append((cid, model, make_plan(model, kwargs.pop("dp"), kwargs.pop("tp"), **kwargs)))
    for dtype in ("bfloat16", "float32"):
        found.append((f"llama-tp2-megatron-{dtype}", "tiny-llama",
                      make_plan("tiny-llama", 1, 2, "megatron", dtype=dtype)))
    return found


# ------------------------------------------------------------------------------ in the ranks


def _saved_bytes(program, tokens, targets) -> int:
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = program(*program.shard_batch(tokens, targets))
    loss.backward()
    return total


def _dtypes_seen(program, tokens, targets) -> dict:
    seen = {}

    def hook(module, inputs, output) -> None:
        seen["lm_head"] = str(output.dtype)

    handle = program.graph_module.get_submodule("lm_head").register_forward_hook(hook)
    loss = program(*program.shard_batch(tokens, targets))
    loss.backward()
    handle.remove()
    seen["params"] = sorted({str(p.dtype) for _, p in program.named_local_parameters()})
    seen["grads"] = sorted({str(p.grad.dtype) for _, p in program.named_local_parameters()})
    return seen


def _run_all(rank: int, world: int, plans: list) -> dict:
    from autoplan.models import build_model, get_model_config
    from autoplan.runtime.counting import expected_collectives
    from autoplan.runtime.launch import parallelize

    out = {}
    for cid, model, plan in plans:
        config = get_model_config(model)
        tokens, targets = batches(plan.global_batch, plan.seq_len, STEPS)
        program = parallelize(build_model(config), None, plan, seed=SEED, config=config)
        saved = _saved_bytes(program, tokens[0], targets[0])  # grads only: train_step clears them
        dtypes = _dtypes_seen(program, tokens[0], targets[0]) if "megatron-" in cid else None
        optimizer = program.make_optimizer(torch.optim.AdamW, lr=LR, eps=EPS)
        out[cid] = {**train_program(program, optimizer, tokens, targets), "saved": saved,
                    "expected": dict(expected_collectives(plan, config)),
                    "dtypes": dtypes, "regions": sum(1 for n in program.graph_module.graph.nodes
                                                     if n.name.startswith("recompute_"))}
    return out


# ------------------------------------------------------------------------------ in pytest

_PLANS = {}


@pytest.fixture(scope="module")
def results() -> list[dict]:
    plans = _plans()
    _PLANS.update({cid: (model, plan) for cid, model, plan in plans})
    return spawn(_run_all, 2, plans)


def _reference(reference_run, model: str, plan) -> dict:
    from autoplan.models import get_model_config

    return reference_run(get_model_config(model), *batches(plan.global_batch, plan.seq_len, STEPS), SEED, LR, EPS)


@pytest.mark.parametrize("setup", SETUPS)
@pytest.mark.parametrize("policy", POLICIES)
def test_recompute_matches_single_process(results, setup, policy, reference_run):
    model, plan = _PLANS[f"{setup}-{policy}"]
    ref = _reference(reference_run, model, plan)
    for rank, out in enumerate(results):
        assert_matches(out[f"{setup}-{policy}"], ref, f"{setup}-{policy} rank {rank}")


@pytest.mark.parametrize("cid", EXTRAS)
def test_recompute_composes(results, cid, reference_run):
    model, plan = _PLANS[cid]
    for rank, out in enumerate(results):
        assert_matches(out[cid], _reference(reference_run, model, plan), f"{cid} rank {rank}")


@pytest.mark.parametrize("setup", SETUPS)
@pytest.mark.parametrize("policy", ("selective", "full"))
def test_recompute_changes_no_number(results, setup, policy):
    for out in results:
        base, got = out[f"{setup}-none"], out[f"{setup}-{policy}"]
        assert got["losses"] == base["losses"]
        for name in base["params"]:
            assert torch.equal(got["grads"][name], base["grads"][name]), name
            assert torch.equal(got["params"][name], base["params"][name]), name


@pytest.mark.parametrize("setup", SETUPS)
@pytest.mark.parametrize("policy", POLICIES)
def test_recomputed_collectives_match_the_plan(results, setup, policy):
    """Full recompute re-runs every forward collective of the layers in backward (the whole
    region, not stopping early); selective regions hold none."""
    for rank, out in enumerate(results):
        got, want = out[f"{setup}-{policy}"]["counts"], out[f"{setup}-{policy}"]["expected"]
        assert got == want, f"{setup}-{policy} rank {rank}: {sorted(got.items())} != " \
                            f"{sorted(want.items())}"


@pytest.mark.parametrize("setup", SETUPS)
def test_recompute_keeps_less_for_backward(results, setup):
    for out in results:
        none, selective, full = (out[f"{setup}-{p}"] for p in POLICIES)
        assert none["regions"] == 0 < selective["regions"] and full["regions"] >= 2
        assert full["saved"] < selective["saved"] < none["saved"], (full["saved"],
                                                                     selective["saved"],
                                                                     none["saved"])


def test_bf16_computes_in_bf16_with_fp32_master_weights(results):
    for out in results:
        bf16, fp32 = out["llama-tp2-megatron-bfloat16"], out["llama-tp2-megatron-float32"]
        assert bf16["dtypes"] == {"lm_head": "torch.bfloat16", "params": ["torch.float32"],
                                  "grads": ["torch.float32"]}
        assert fp32["dtypes"]["lm_head"] == "torch.float32"
        losses, want = torch.tensor(bf16["losses"]), torch.tensor(fp32["losses"])
        assert torch.isfinite(losses).all()
        torch.testing.assert_close(losses, want, rtol=2e-3, atol=0)
        assert not torch.equal(losses, want)  # bf16 really ran
