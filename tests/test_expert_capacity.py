"""Expert capacity (`ModelConfig.capacity_factor`, `models.config.expert_capacity`): each expert takes at
most C = ceil(factor * T * k / E) rows of each sequence, the first in token order, in a buffer padded to
exactly C rows (runtime.experts), so the memory a rank's experts hold no longer depends on the routing
and the plan prices it from the same C, without the ep imbalance margin.

    pure          the slots: which pairs are kept and where; the config's checks
    one process   the runtime's padded experts (local_experts_ffn) equal the zoo module's loop
    2 gloo ranks  ep2 with a capacity that drops pairs: 3 AdamW steps equal one process of the same model
                  (losses, gradients, parameters) and the collectives its plan counts; the activation bytes
                  every rank holds (after the forward, and while a layer is re-run) within TOLERANCE of
                  the plan's, which has no ep margin
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from _dist import assert_matches, batches, make_plan, spawn, train_program

SEED, STEPS, LR, EPS = 5, 3, 1e-3, 1e-6
TOLERANCE = 0.05
SEQ = 64
FACTOR = 1.0  # tight: the untrained routers overfill some experts, so pairs are dropped


def _interpreting() -> bool:
    from autoplan.runtime.kernels import dispatch

    return dispatch.interpreting() and dispatch.load_triton() is not None


def _config(factor: float = FACTOR):
    from autoplan.models import get_model_config

    return dataclasses.replace(get_model_config("tiny-moe"), name=f"tiny-moe-cap{factor}", capacity_factor=factor)


# ------------------------------------------------------------------------------ pure


def test_slots_keep_the_first_c_pairs_of_each_expert_and_sequence():
    from autoplan.runtime.experts import capacity_slots

    gen = torch.Generator().manual_seed(0)
    experts, groups, tokens, k, capacity = 4, 3, 10, 2, 3
    top_idx = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(groups * tokens)])
    slots = capacity_slots(top_idx, experts, tokens, capacity)
    size = experts * groups * capacity
    assert slots.gather.shape == (size,) and slots.pos.shape == top_idx.shape and slots.rows_per_expert == 9
    for e in range(experts):
        for g in range(groups):
            pairs = [(n, j) for n in range(g * tokens, (g + 1) * tokens) for j in range(k) if top_idx[n, j] == e]
            for rank, (n, j) in enumerate(pairs):
                row = int(slots.pos[n, j])
                if rank < capacity:  # kept: its row of expert e's run, group g, in token order
                    assert row == (e * groups + g) * capacity + rank and int(slots.gather[row]) == n
                else:
                    assert row == size  # dropped: the zero row
            padding = range((e * groups + g) * capacity + min(len(pairs), capacity), (e * groups + g + 1) * capacity)
            assert all(int(slots.gather[r]) == groups * tokens for r in padding)


def test_capacity_factor_is_checked_and_fingerprinted_only_when_set():
    from autoplan.errors import ConfigError
    from autoplan.models import get_model_config
    from autoplan.models.config import expert_capacity

    base = get_model_config("tiny-moe")
    assert dataclasses.replace(base, capacity_factor=0.0).fingerprint() == base.fingerprint()
    assert _config().fingerprint() != base.fingerprint() != _config(1.25).fingerprint()
    assert expert_capacity(1.25, 64, 2, 4) == 40 and expert_capacity(1.0, 10, 2, 8) == 3
    with pytest.raises(ConfigError, match="capacity_factor=-1"):
        dataclasses.replace(base, capacity_factor=-1.0)
    with pytest.raises(ConfigError, match="only for family 'moe'"):
        dataclasses.replace(get_model_config("tiny-llama"), capacity_factor=1.0)


@pytest.mark.parametrize("factor", [0.5, 1.0, 4.0])
def test_padded_experts_equal_the_modules_loop(factor):
    """The runtime's experts (gather into the padded buffer, SwiGLU per expert, combine) give the zoo
    module's values and gradients; at 0.5 and 1.0 pairs are dropped (the output differs from dropless)."""
    from autoplan.models.layers import MoEFeedForward
    from autoplan.runtime.kernel_ops import kernel_module

    torch.manual_seed(0)
    module = MoEFeedForward(16, 24, 4, 2, factor)
    runtime = kernel_module(module, "torch", None)
    x = torch.randn(3, 10, 16, requires_grad=True)
    outputs, grads = [], []
    for m in (module, runtime):
        x.grad = None
        m.zero_grad()
        y = m(x)
        y.square().sum().backward()
        outputs.append(y.detach())
        grads.append([x.grad.clone()] + [p.grad.clone() for p in m.parameters()])
    torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-5, atol=1e-6)
    for got, want in zip(grads[1], grads[0]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    module.capacity_factor = 0.0
    dropped = not torch.allclose(module(x), outputs[0])
    assert dropped == (factor < 4.0)  # 4.0: C = 20 rows of 10 tokens x 2 slots, nothing can drop


@pytest.mark.skipif(not _interpreting(), reason="runs in the TRITON_INTERPRET=1 child of test_interpreter_suite")
def test_triton_padded_experts_equal_the_torch_path():
    """The Triton permute / combine kernels on the padded buffers (rows no pair reads get no gradient)."""
    from autoplan.runtime.experts import local_experts_ffn

    gen = torch.Generator().manual_seed(3)
    x, w = torch.randn(20, 16, generator=gen), torch.rand(20, 2, generator=gen)
    top_idx = torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(20)])
    weights = [torch.randn(4, 16, 24, generator=gen) * 0.2, torch.randn(4, 16, 24, generator=gen) * 0.2,
               torch.randn(4, 24, 16, generator=gen) * 0.2]
    results = []
    for backend in ("torch", "triton"):
        leaves = [t.clone().requires_grad_() for t in (x, w, *weights)]
        out = local_experts_ffn(*leaves[:1], top_idx, leaves[1], *leaves[2:], backend, capacity=3, group_tokens=10)
        out.square().sum().backward()
        results.append([out.detach()] + [t.grad for t in leaves])
    for got, want in zip(results[1], results[0]):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_interpreter_suite():
    from _interpret import run_triton_tests_interpreted

    run_triton_tests_interpreted(__file__)


# ------------------------------------------------------------------------------ gloo ranks


def _run(rank: int, world: int, config, plan, memory_plans) -> dict:
    from autoplan.models import build_model
    from autoplan.runtime.counting import expected_collectives
    from autoplan.runtime.launch import parallelize
    from autoplan.runtime.memory_probe import measure_saved_bytes

    program = parallelize(build_model(config), None, plan, seed=SEED, config=config)
    optimizer = program.make_optimizer(torch.optim.AdamW, lr=LR, eps=EPS)
    out = train_program(program, optimizer, *batches(plan.global_batch, plan.seq_len, STEPS))
    out["expected"] = dict(expected_collectives(plan, config))
    memory = {}
    for policy, mplan in memory_plans.items():
        mprogram = parallelize(build_model(config, device="meta"), None, mplan, config=config)
        tokens, targets = batches(mplan.global_batch, mplan.seq_len, 1)
        _, measured = measure_saved_bytes(lambda: mprogram(*mprogram.shard_batch(tokens[0], targets[0])), mprogram)
        memory[policy] = (measured.saved_bytes, measured.recompute_bytes)
    out["memory"] = memory
    return out


@pytest.fixture(scope="module")
def ep2():
    config = _config()
    plan = make_plan(config, 1, 1, ep=2, microbatch_size=2)
    memory_plans = {policy: make_plan(config, 1, 1, ep=2, seq_len=SEQ, microbatch_size=4, recompute=policy)
                    for policy in ("none", "full")}
    return config, plan, memory_plans, spawn(_run, 2, config, plan, memory_plans)


@pytest.mark.gloo
def test_ep2_with_dropped_pairs_matches_one_process(ep2, reference_run):
    config, plan, _, ranks = ep2
    ref = reference_run(config, *batches(plan.global_batch, plan.seq_len, STEPS), SEED, LR, EPS)
    dropless = reference_run(_config(0.0), *batches(plan.global_batch, plan.seq_len, STEPS), SEED, LR, EPS)
    assert abs(dropless["losses"][0] - ref["losses"][0]) > 1e-4  # pairs were dropped
    for rank, got in enumerate(ranks):
        assert_matches(got, ref, f"ep2 capacity {FACTOR} rank {rank}")
        assert got["counts"] == got["expected"], rank


@pytest.mark.gloo
@pytest.mark.parametrize("policy", ["none", "full"])
def test_ep2_memory_is_the_capacitys_on_every_rank(ep2, policy):
    """Every rank holds what the plan prices (no margin: the rows are E C per sequence whatever the
    routing), after the forward and while a recomputed layer is re-run."""
    from autoplan.api import capture_model
    from autoplan.cost_model.memory import plan_activation_bytes, plan_activations

    config, _, memory_plans, ranks = ep2
    plan = memory_plans[policy]
    graph = capture_model(config, SEQ, plan.dtype)
    acts, _ = plan_activations(plan, graph, config.rule_info())
    assert acts.margins == (0.0, 0.0) and plan.predicted.memory.ep_imbalance_bytes == 0.0
    predicted = plan_activation_bytes(plan, graph, config.rule_info())
    for rank, got in enumerate(ranks):
        for what, want, measured in zip(("held", "re-run"), predicted, got["memory"][policy]):
            assert abs(want - measured) <= TOLERANCE * measured, (policy, rank, what, want, measured)
