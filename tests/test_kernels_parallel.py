"""The Triton kernels inside the runtime's parallel paths: MoE experts (runtime.experts, local and
expert-parallel) and the vocabulary-parallel cross-entropy (runtime.modules.VocabParallelLoss).

- In this process (torch only): the MoE paths equal the model's own loop (MoEFeedForward), every
  expert gets a gradient even with no rows, and on CPU kernels="auto" runs no Triton Function.
- `test_triton_*`, in a child pytest with TRITON_INTERPRET=1 (`test_interpreter_suite`; triton
  reads the flag when first imported, as in test_kernels.py): the Triton MoE path against the torch
  path forward and backward, and two gloo ranks (spawned from that child, so they interpret too)
  running expert parallelism and the vocabulary-parallel loss with the Triton kernels, against
  float64 references of the whole computation. Each rank also counts the Triton launches, so a
  silent fall-back to torch fails the test.

Sizes are odd on purpose: hidden 40, ffn 24, 13 and 11 tokens per rank, an expert that no token
picks, and a vocabulary slice of 777 per rank (the interpreter's block is 256 columns).
"""

from __future__ import annotations

import importlib
from collections import Counter

import pytest
import torch
import torch.nn.functional as F

from _interpret import run_triton_tests_interpreted
from autoplan.runtime.experts import expert_parallel_ffn, local_experts_ffn
from autoplan.runtime.kernels import activations, cross_entropy, dispatch

moe_permute = importlib.import_module("autoplan.runtime.kernels.moe_permute")

INTERPRETING = dispatch.interpreting()
HAS_TRITON = dispatch.load_triton() is not None
HIDDEN, FFN, EXPERTS, TOP_K = 40, 24, 4, 2
TOKENS = (13, 11)  # per rank
VOCAB_SLICE = 777  # per rank: not a multiple of the interpreter's 256-column block

triton_interp = pytest.mark.skipif(
    not (INTERPRETING and HAS_TRITON),
    reason="interpreter tests run in the TRITON_INTERPRET=1 child of test_interpreter_suite")


def _rand(*shape, seed: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen, dtype=torch.float64) * scale


def _moe_inputs(tokens: int, seed: int) -> dict[str, torch.Tensor]:
    """Float64 tokens, routing over experts 0..2 only (expert 3 gets no rows), softmax gates,
    expert weights and an output grad."""
    top_logits, top_idx = _rand(tokens, EXPERTS - 1, seed=seed).topk(TOP_K, dim=-1)
    return dict(x=_rand(tokens, HIDDEN, seed=seed + 1), top_idx=top_idx,
                weights=top_logits.softmax(-1), grad=_rand(tokens, HIDDEN, seed=seed + 2),
                w_gate=_rand(EXPERTS, HIDDEN, FFN, seed=90, scale=HIDDEN ** -0.5),
                w_up=_rand(EXPERTS, HIDDEN, FFN, seed=91, scale=HIDDEN ** -0.5),
                w_down=_rand(EXPERTS, FFN, HIDDEN, seed=92, scale=FFN ** -0.5))


def _model_loop(x, top_idx, weights, w_gate, w_up, w_down):
    """MoEFeedForward.forward's loop over experts (the maths the runtime must reproduce)."""
    out = torch.zeros_like(x)
    for e in range(w_gate.shape[0]):
        token, slot = torch.where(top_idx == e)
        h = x.index_select(0, token)
        y = (F.silu(h @ w_gate[e]) * (h @ w_up[e])) @ w_down[e]
        out = out.index_add(0, token, y * weights[token, slot].unsqueeze(-1))
    return out


DIFF = ("x", "weights", "w_gate", "w_up", "w_down")  # the differentiable inputs


def _run(fn, inputs: dict, dtype: torch.dtype) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """fn on `inputs` in `dtype` (top_idx as is): its output and the grads of DIFF for inputs'
    output grad."""
    leaves = {k: inputs[k].to(dtype).requires_grad_() for k in DIFF}
    out = fn(leaves["x"], inputs["top_idx"], leaves["weights"], leaves["w_gate"], leaves["w_up"],
             leaves["w_down"])
    out.backward(inputs["grad"].to(dtype))
    return out.detach(), {k: v.grad for k, v in leaves.items()}


# ----------------------------------------------------------------------------- in this process


def test_local_experts_torch_path_is_the_model_loop():
    """fp32 torch path vs the model's loop: equal (k = 2), and an unpicked expert still gets a zero
    gradient, so the autograd graph does not depend on the routing."""
    inputs = _moe_inputs(37, seed=1)
    out, grads = _run(lambda *a: local_experts_ffn(*a, backend="torch"), inputs, torch.float32)
    ref, ref_grads = _run(_model_loop, inputs, torch.float32)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-7)
    for name in DIFF:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-5, atol=1e-7, msg=name)
    for name in ("w_gate", "w_up", "w_down"):
        assert grads[name][EXPERTS - 1].abs().sum() == 0 and grads[name][0].abs().sum() > 0


def test_expert_parallel_on_one_rank_is_the_local_path():
    """Without a process group (one rank), expert_parallel_ffn's dispatch / regroup / combine
    permutations must compose to the local path exactly."""
    inputs = _moe_inputs(29, seed=3)
    got = _run(lambda *a: expert_parallel_ffn(*a, group=None, backend="torch"), inputs,
               torch.float32)
    ref = _run(lambda *a: local_experts_ffn(*a, backend="torch"), inputs, torch.float32)
    assert torch.equal(got[0], ref[0])
    for name in DIFF:
        assert torch.equal(got[1][name], ref[1][name]), name


def _rewritten_moe(kernels: str):
    from _dist import rewritten_one_rank

    gm, tokens, targets = rewritten_one_rank("tiny-moe", kernels, 16)
    loss = gm(tokens, targets)
    loss.backward()
    return gm, loss.detach(), {n: p.grad for n, p in gm.named_parameters()}


def test_auto_runs_no_moe_triton_on_cpu(monkeypatch):
    """tiny-moe's replicated MoE becomes KernelMoEFeedForward; on CPU "auto" launches no Triton
    Function and matches kernels="torch" bitwise."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)

    def forbidden(*args, **kwargs):
        raise AssertionError("a Triton MoE kernel ran on CPU under kernels='auto'")

    monkeypatch.setattr(moe_permute._Permute, "apply", forbidden)
    monkeypatch.setattr(moe_permute._Unpermute, "apply", forbidden)
    gm, loss, grads = _rewritten_moe("auto")
    assert "KernelMoEFeedForward" in {type(m).__name__ for m in gm.modules()}
    _, ref_loss, ref_grads = _rewritten_moe("torch")
    assert torch.equal(loss, ref_loss)
    assert all(torch.equal(g, ref_grads[n]) for n, g in grads.items())


def test_interpreter_suite():
    """The `test_triton_*` tests of this file in a child pytest with TRITON_INTERPRET=1."""
    run_triton_tests_interpreted(__file__)


# ----------------------------------------------------------------------------- interpreter child


_TRITON_ENTRY_POINTS = ((moe_permute._Permute, "apply"), (moe_permute._Unpermute, "apply"),
                        (activations._SiluMul, "apply"), (cross_entropy, "stats_triton"),
                        (cross_entropy, "grad_triton"))


def _count_triton_launches(calls: Counter) -> None:
    """Wrap the Triton entry points of the MoE, activation and cross-entropy kernels so each call
    is counted under permute, unpermute, silu_mul, ce_stats, ce_grad (in this process; a test that
    runs here restores them with monkeypatch, the gloo ranks are fresh processes)."""
    keys = ("permute", "unpermute", "silu_mul", "ce_stats", "ce_grad")
    for key, (owner, name) in zip(keys, _TRITON_ENTRY_POINTS):
        def counted(*args, _original=getattr(owner, name), _key=key):
            calls[_key] += 1
            return _original(*args)

        setattr(owner, name, counted)


def _check_local_experts(dtype: torch.dtype, device: str) -> None:
    """The Triton MoE path (permute, silu * mul, unpermute) vs the float64 model loop on the same
    rounded inputs, forward and every input's grad, within the dtype's resolution (relative to
    the largest value); and in fp32 vs the torch path, tightly."""
    inputs = {k: v.to(device) for k, v in _moe_inputs(37, seed=5).items()}
    calls: Counter = Counter()
    _count_triton_launches(calls)
    out, grads = _run(lambda *a: local_experts_ffn(*a, backend="triton"), inputs, dtype)
    assert out.dtype == dtype and calls["permute"] == calls["unpermute"] == 1
    assert calls["silu_mul"] == EXPERTS - 1  # the expert with no rows takes the torch path
    cpu = {k: v.cpu() for k, v in inputs.items()}
    rounded = {k: v.to(dtype).double() if v.is_floating_point() else v for k, v in cpu.items()}
    ref, ref_grads = _run(_model_loop, rounded, torch.float64)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    for name, got, want in [("out", out, ref)] + [(n, grads[n], ref_grads[n]) for n in DIFF]:
        torch.testing.assert_close(got.cpu().double(), want, rtol=tol,
                                   atol=tol * want.abs().max(), msg=name)
    assert grads["w_gate"][EXPERTS - 1].abs().sum() == 0  # the unpicked expert
    if dtype == torch.float32:
        torch_out, torch_grads = _run(lambda *a: local_experts_ffn(*a, backend="torch"), inputs,
                                      dtype)
        torch.testing.assert_close(out, torch_out, rtol=2e-5, atol=1e-6)
        for name in DIFF:
            torch.testing.assert_close(grads[name], torch_grads[name], rtol=2e-5, atol=1e-6,
                                       msg=name)


@triton_interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_local_experts_match_torch(dtype, monkeypatch):
    for owner, name in _TRITON_ENTRY_POINTS:  # restored after the test (the counters wrap them)
        monkeypatch.setattr(owner, name, getattr(owner, name))
    _check_local_experts(dtype, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON) or INTERPRETING,
                    reason="needs CUDA and triton, without TRITON_INTERPRET")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_local_experts_match_torch(dtype, monkeypatch):
    for owner, name in _TRITON_ENTRY_POINTS:
        monkeypatch.setattr(owner, name, getattr(owner, name))
    _check_local_experts(dtype, "cuda")


def _ep_rank(rank: int, world: int, per_rank: list[dict]) -> dict:
    """Expert parallelism over the world: this rank's tokens, experts [2r, 2r + 2), Triton and
    torch backends; outputs and grads of both, and the Triton launches."""
    import torch.distributed as dist

    calls: Counter = Counter()
    _count_triton_launches(calls)
    inputs, local = dict(per_rank[rank]), EXPERTS // world
    for name in ("w_gate", "w_up", "w_down"):
        inputs[name] = inputs[name][rank * local:(rank + 1) * local]
    result = {}
    for backend in ("triton", "torch"):
        out, grads = _run(lambda *a: expert_parallel_ffn(*a, group=dist.group.WORLD,
                                                         backend=backend), inputs, torch.float32)
        result[backend] = {"out": out, **grads}
    result["calls"] = dict(calls)
    return result


@triton_interp
@pytest.mark.gloo
def test_triton_expert_parallel_two_ranks():
    """2 gloo ranks, 2 experts each, uneven token counts and an expert no token picks: outputs,
    token / gate grads and each rank's expert-weight grads vs the float64 loop over all tokens."""
    from _dist import spawn

    per_rank = [_moe_inputs(n, seed=10 * r) for r, n in enumerate(TOKENS)]  # same expert weights
    results = spawn(_ep_rank, 2, per_rank)
    full = {k: torch.cat([r[k] for r in per_rank]) for k in ("x", "top_idx", "weights", "grad")}
    full.update({k: per_rank[0][k] for k in ("w_gate", "w_up", "w_down")})
    ref, ref_grads = _run(_model_loop, full, torch.float64)
    ref_grads["out"] = ref
    local = EXPERTS // 2
    for rank, result in enumerate(results):
        assert result["calls"]["permute"] >= 3 and result["calls"]["unpermute"] >= 1
        assert result["calls"]["silu_mul"] >= 1, result["calls"]
        rows = slice(sum(TOKENS[:rank]), sum(TOKENS[:rank + 1]))
        experts = slice(rank * local, (rank + 1) * local)
        for backend in ("triton", "torch"):
            got = result[backend]
            for name in ("out", "x", "weights"):
                torch.testing.assert_close(got[name].double(), ref_grads[name][rows], rtol=1e-5,
                                           atol=1e-6, msg=f"rank {rank} {backend} {name}")
            for name in ("w_gate", "w_up", "w_down"):
                torch.testing.assert_close(got[name].double(), ref_grads[name][experts],
                                           rtol=1e-5, atol=1e-6,
                                           msg=f"rank {rank} {backend} {name}")
    assert results[1]["triton"]["w_down"][1].abs().sum() == 0  # expert 3: no rows, zero grad


def _ce_rank(rank: int, world: int, logits: torch.Tensor, targets: torch.Tensor) -> dict:
    """This rank's vocabulary slice through runtime.modules.VocabParallelLoss with kernels forced
    to Triton, in fp32 and bf16: losses, logits grads, Triton launches."""
    import torch.distributed as dist

    from autoplan.runtime.modules import VocabParallelLoss

    calls: Counter = Counter()
    _count_triton_launches(calls)
    start = rank * VOCAB_SLICE
    loss_fn = VocabParallelLoss(start, dist.group.WORLD, kernels="triton")
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        z = logits[..., start:start + VOCAB_SLICE].to(dtype).requires_grad_()
        loss = loss_fn(z, targets)
        loss.backward()
        out[str(dtype)] = (loss.detach(), z.grad)
    out["calls"] = dict(calls)
    return out


@triton_interp
@pytest.mark.gloo
def test_triton_vocab_parallel_cross_entropy_two_ranks():
    """Vocabulary 2 x 777 over 2 gloo ranks, targets in both halves, on the slice boundary and
    ignored: the mean loss and the concatenated logits grads vs F.cross_entropy in float64 over the
    whole vocabulary (fp32 tightly; bf16 logits against the reference of their rounded values)."""
    from _dist import spawn

    from autoplan.runtime.kernels.cross_entropy import IGNORE_INDEX

    vocab = 2 * VOCAB_SLICE
    logits = _rand(2, 37, vocab, seed=40, scale=3.0)
    targets = torch.randint(0, vocab, (2, 37), generator=torch.Generator().manual_seed(41))
    flat = targets.view(-1)
    flat[:4] = torch.tensor([VOCAB_SLICE - 1, VOCAB_SLICE, 0, vocab - 1])  # slice edges
    flat[5::9] = IGNORE_INDEX
    assert (targets < VOCAB_SLICE).any() and (targets >= VOCAB_SLICE).any()
    results = spawn(_ce_rank, 2, logits, targets)
    for dtype, tol in ((torch.float32, dict(rtol=1e-5, atol=1e-7)),
                       (torch.bfloat16, dict(rtol=2e-2, atol=1e-4))):
        ref_in = logits.to(dtype).double().requires_grad_()
        ref = F.cross_entropy(ref_in.view(-1, vocab), targets.view(-1))
        ref.backward()
        for rank, result in enumerate(results):
            loss, _ = result[str(dtype)]
            torch.testing.assert_close(loss.double(), ref.detach(), rtol=1e-5, atol=1e-5,
                                       msg=f"rank {rank} {dtype} loss")
        grad = torch.cat([r[str(dtype)][1] for r in results], dim=-1)
        assert grad.dtype == dtype
        torch.testing.assert_close(grad.double(), ref_in.grad, **tol, msg=f"{dtype} grad")
        assert (grad.view(-1, vocab)[5::9] == 0).all()  # ignored tokens get no gradient
    for result in results:
        assert result["calls"]["ce_stats"] == 2, result["calls"]
        assert result["calls"]["ce_grad"] == 2, result["calls"]
