"""Recomputation as the plan's policy says, and bf16 mixed precision, on 2 gloo ranks.

Recompute (each recomputed layer one region under torch's selective activation checkpointing:
"selective" keeps its GEMM and attention outputs, "matmul-only" its GEMM outputs, "full" nothing,
"full:1" only the first layer recomputed; also under ZeRO 3, whose FSDP2 hooks then gather
parameters again for the recomputation) must not change the numbers: each policy's losses,
first-step gradients and final parameters equal the run without recomputation (the same ops in the
same order: bit for bit) and the single-process run. The run applies the plan's policy: the layers
it runs as regions are the policy's, and in them the outputs saved are those of the families the
policy names and no other (`runtime.recompute.observe_recompute`). It must also keep less for
backward, by real margins: the bytes one forward leaves for backward (`runtime.memory_probe`, which
sees checkpoints' inputs and their caches) fall from none to selective to full.

Mixed precision (plan dtype bfloat16): master weights and gradients stay fp32, matmuls run in bf16
(the lm_head's output is bf16), and the loss stays finite and within 2e-3 of the fp32 run's.
"""

from __future__ import annotations

import pytest
import torch

from _dist import assert_matches, batches, make_plan, spawn, train_program

pytestmark = pytest.mark.gloo

SEED, STEPS, LR, EPS = 5, 3, 1e-3, 1e-6
POLICIES = ("none", "selective", "matmul-only", "full", "full:1")
ORDERED = ("none", "selective", "full")  # each keeps less than the one before, by MARGIN of none's bytes
MARGIN = 0.05
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


def _saved_bytes(program, tokens, targets) -> tuple[int, dict]:
    """What one forward leaves for backward, and the save / recompute decisions the regions made."""
    from autoplan.runtime.memory_probe import measure_saved_bytes
    from autoplan.runtime.recompute import observe_recompute

    shard = program.shard_batch(tokens, targets)
    with observe_recompute() as decisions:
        _, measured = measure_saved_bytes(lambda: program(*shard), program)
    return measured.saved_bytes, {f"{family}:{saved}": n for (family, saved), n in decisions.items()}


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
        saved, decisions = _saved_bytes(program, tokens[0], targets[0])  # train_step clears the grads
        dtypes = _dtypes_seen(program, tokens[0], targets[0]) if "megatron-" in cid else None
        optimizer = program.make_optimizer(torch.optim.AdamW, lr=LR, eps=EPS)
        out[cid] = {**train_program(program, optimizer, tokens, targets), "saved": saved,
                    "expected": dict(expected_collectives(plan, config)), "decisions": decisions,
                    "dtypes": dtypes, "layers": list(program.recomputed_layers),
                    "policy": program.recompute_policy.name}
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
@pytest.mark.parametrize("policy", POLICIES[1:])
def test_recompute_changes_no_number(results, setup, policy):
    for out in results:
        base, got = out[f"{setup}-none"], out[f"{setup}-{policy}"]
        assert got["losses"] == base["losses"]
        for name in base["params"]:
            assert torch.equal(got["grads"][name], base["grads"][name]), name
            assert torch.equal(got["params"][name], base["params"][name]), name


@pytest.mark.parametrize("setup", SETUPS)
@pytest.mark.parametrize("policy", POLICIES)
def test_the_run_applies_the_plans_policy(results, setup, policy):
    """The program's policy is the plan's; its regions are the policy's layers; inside them every output
    of a family the policy saves was saved and nothing else was."""
    from autoplan.models import get_model_config
    from autoplan.recompute_policy import recompute_policy

    model, plan = _PLANS[f"{setup}-{policy}"]
    expected = recompute_policy(plan.recompute)
    layers = list(expected.recomputed_layers(get_model_config(model).num_layers))
    for out in results:
        got = out[f"{setup}-{policy}"]
        assert got["policy"] == plan.recompute and got["layers"] == layers
        seen = {key.split(":")[0] for key in got["decisions"]}
        saved = {family for family in seen if f"{family}:True" in got["decisions"]}
        recomputed = {family for family in seen if f"{family}:False" in got["decisions"]}
        assert bool(seen) == bool(layers)  # decisions are made in regions, which exist where the policy says
        assert saved == expected.saves & seen and recomputed == seen - expected.saves
        assert expected.saves <= seen or not layers  # the saved families did occur


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
    """Each of none > selective > full keeps at least MARGIN of none's bytes less than the one before;
    matmul-only (attention recomputed too) keeps less than selective and more than full, and so does
    recomputing the first of two layers in full."""
    for out in results:
        saved = [out[f"{setup}-{p}"]["saved"] for p in ORDERED]
        gaps = [a - b for a, b in zip(saved, saved[1:])]
        assert min(gaps) >= MARGIN * saved[0], (dict(zip(ORDERED, saved)), gaps)
        assert saved[1] > out[f"{setup}-matmul-only"]["saved"] > saved[2]
        assert saved[-1] < out[f"{setup}-full:1"]["saved"] < saved[0]


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


@pytest.mark.parametrize("saves, selective", [((), False), (("attention", "matmul"), True)])
def test_a_region_that_saves_nothing_runs_without_dispatch_modes(saves, selective):
    """A region that saves nothing runs under plain checkpointing: no Python dispatch mode sees its ops in
    forward or in the re-run (they cost the host a call per op: `Efficiency.host_recompute_s`); a region
    that saves some families runs under torch's selective checkpointing, whose modes do. Both re-run it."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    from autoplan.runtime.recompute import recompute

    modes = []

    def region(x):
        modes.append(_get_current_dispatch_mode())
        return (x @ x.T).relu().sum()

    x = torch.randn(4, 4, requires_grad=True)
    recompute(region, x, saves=saves).backward()
    assert len(modes) == 2  # forward, and its re-run in backward
    assert all((mode is not None) == selective for mode in modes)
