"""The runtime's fused kernels (`plan.kernels`, runtime.kernel_ops): which backend runs, and that
the Triton kernels train exactly like their torch references.

- `test_triton_*` run a 1-rank gloo program of tiny-gpt and tiny-llama with kernels="triton" and
  kernels="torch" (fp32) and compare the losses of 2 AdamW steps and the first step's gradients.
  The kernels run on CPU through Triton's interpreter, which needs TRITON_INTERPRET=1 before triton
  is imported and makes "auto" pick Triton on CPU, so they run in a child pytest with the flag set
  (`test_interpreter_suite`), as in test_kernels.py.
- The rest, in this process: "auto" picks torch on CPU (no Triton Function is even called), the
  plan option round-trips and is validated, and kernels="triton" on CPU fails at launch.
"""

from __future__ import annotations

import dataclasses
import os
import socket

import pytest
import torch

from _interpret import run_triton_tests_interpreted
from _dist import make_plan, rewritten_one_rank
from autoplan.errors import ConfigError, PlanError
from autoplan.plan import Plan
from autoplan.runtime.kernels import dispatch

INTERPRETING = dispatch.interpreting()
HAS_TRITON = dispatch.load_triton() is not None
SEQ, STEPS = 16, 2
CASES = [("tiny-gpt", "none"), ("tiny-llama", "selective")]  # (model, recompute)

triton_interp = pytest.mark.skipif(
    not (INTERPRETING and HAS_TRITON),
    reason="interpreter tests run in the TRITON_INTERPRET=1 child of test_interpreter_suite")


def _rewritten(model_name: str, kernels: str, recompute: str = "none"):
    """The 1-rank graph module of `model_name` with seeded CPU parameters, and a batch."""
    return rewritten_one_rank(model_name, kernels, SEQ, recompute)


def _loss_and_grads(gm, tokens, targets):
    loss = gm(tokens, targets)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in gm.named_parameters()}


# ------------------------------------------------------------------------- in this process


def test_auto_picks_torch_on_cpu(monkeypatch):
    """On CPU "auto" runs the torch references: no Triton Function is called, and the results are
    bitwise those of kernels="torch"."""
    from autoplan.runtime.kernels import activations, cross_entropy, norms, rope

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not dispatch.use_triton("cpu", "auto")

    def forbidden(*args, **kwargs):
        raise AssertionError("a Triton kernel ran on CPU under kernels='auto'")

    for fn in (norms._Norm, activations._SiluMul, activations._BiasGelu, rope._Rope):
        monkeypatch.setattr(fn, "apply", forbidden)
    monkeypatch.setattr(cross_entropy, "stats_triton", forbidden)
    for model, recompute in CASES:
        auto = _loss_and_grads(*_rewritten(model, "auto", recompute))
        torch_ = _loss_and_grads(*_rewritten(model, "torch", recompute))
        assert torch.equal(auto[0], torch_[0]), model
        for name, grad in auto[1].items():
            assert torch.equal(grad, torch_[1][name]), (model, name)


def test_rewrite_uses_kernel_ops():
    gm, _, _ = _rewritten("tiny-llama", "auto")
    kinds = {type(m).__name__ for m in gm.modules()}
    assert {"KernelRMSNorm", "KernelCausalAttention", "KernelLMLoss"} <= kinds
    assert "kernel_silu_mul" in gm.code and "silu(" not in gm.code
    gm, _, _ = _rewritten("tiny-gpt", "auto")
    assert "KernelLayerNorm" in {type(m).__name__ for m in gm.modules()}
    assert "kernel_gelu" in gm.code


def test_plan_kernels_option():
    plan = make_plan("tiny-gpt", 1, 1, seq_len=SEQ)
    assert plan.kernels == "auto" and plan.to_json()["kernels"] == "auto"
    forced = dataclasses.replace(plan, kernels="triton")
    assert Plan.from_json(forced.to_json()) == forced
    old = plan.to_json()
    del old["kernels"]  # a plan file written before the option
    assert Plan.from_json(old) == plan
    with pytest.raises(PlanError, match="kernels 'cuda'"):
        dataclasses.replace(plan, kernels="cuda")


def test_kernels_triton_refused_on_cpu(monkeypatch):
    """kernels="triton" where Triton cannot run is refused by parallelize, before any group."""
    from autoplan.models import build_model, get_model_config
    from autoplan.runtime.launch import parallelize

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "1")
    config = get_model_config("tiny-gpt")
    plan = make_plan("tiny-gpt", 1, 1, seq_len=SEQ)
    with pytest.raises(ConfigError, match="TRITON_INTERPRET|pip install"):
        parallelize(build_model(config, device="meta"), None, plan, config=config,
                    backend="gloo", kernels="triton")


def test_interpreter_suite():
    """The `test_triton_*` tests of this file in a child pytest with TRITON_INTERPRET=1."""
    run_triton_tests_interpreted(__file__)


# ------------------------------------------------------------------------- interpreter child


def _train(model_name: str, recompute: str, kernels: str) -> tuple[list[float], dict]:
    """2 AdamW steps of a 1-rank program (parallelize, gloo): losses and first-step grads."""
    from autoplan.models import build_model, get_model_config
    from autoplan.runtime.launch import parallelize

    config = get_model_config(model_name)
    plan = make_plan(model_name, 1, 1, seq_len=SEQ, recompute=recompute)
    program = parallelize(build_model(config, device="meta"), None, plan, seed=3, config=config,
                          kernels=kernels)
    assert program.plan.kernels == kernels
    optimizer = program.make_optimizer(torch.optim.AdamW, lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, config.vocab, (STEPS, plan.global_batch, SEQ), generator=gen)
    targets = torch.randint(0, config.vocab, tokens.shape, generator=gen)
    losses, grads = [], None
    for step in range(STEPS):
        losses.append(program.train_step(tokens[step], targets[step], optimizer))
        grads = grads or program.full_gradients()
    return losses, grads


@pytest.fixture(scope="module")
def one_rank_group():
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1",
               LOCAL_RANK="0")
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
    for k, v in saved.items():
        os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


@triton_interp
@pytest.mark.parametrize("model_name,recompute", CASES)
def test_triton_training_matches_torch(model_name, recompute, one_rank_group):
    tri_losses, tri_grads = _train(model_name, recompute, "triton")
    ref_losses, ref_grads = _train(model_name, recompute, "torch")
    torch.testing.assert_close(torch.tensor(tri_losses), torch.tensor(ref_losses),
                               rtol=1e-5, atol=1e-6)
    assert tri_grads.keys() == ref_grads.keys()
    for name, grad in tri_grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)
