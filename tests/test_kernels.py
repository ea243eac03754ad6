"""Kernels in `autoplan.runtime.kernels` against float64 torch references, forward and backward.

Three ways the Triton kernels are checked:

- interpreter (`test_triton_*`): the kernels run on CPU under TRITON_INTERPRET=1. triton reads that
  flag when it is first imported, and the flag also makes backend "auto" pick Triton on CPU, so
  setting it in this process would leak into every other test (and, on a GPU machine, turn the
  real launches into interpreted ones). A normal run therefore starts one child pytest with
  TRITON_INTERPRET=1 on this file's `test_triton_*` tests (`test_interpreter_suite`); a run that
  already has the flag set (`TRITON_INTERPRET=1 pytest tests/test_kernels.py`) runs them here.
- compiler (`test_compiles_for_h100_h200`): each kernel at its CUDA launch parameters compiled
  to a sm_90 cubin without a GPU, which catches what the lenient interpreter lets through.
- GPU (`gpu` marker): the kernels on CUDA against the same references, skipped without CUDA.

Inputs are fresh seeded random tensors; the references get the same (rounded) inputs in float64,
so a bf16 test measures only the kernel's own rounding. Sizes are odd on purpose: hidden 96 and
200 (not powers of two), 37 tokens, a vocabulary slice of 1000 (not a multiple of the block).
"""

from __future__ import annotations

import importlib
import sys
import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from _interpret import run_triton_tests_interpreted
from autoplan.errors import ConfigError
from autoplan.models.layers import MoEFeedForward, RMSNorm, apply_rope as model_apply_rope
from autoplan.models.layers import rope_cos_sin, swiglu
from autoplan.runtime.kernels import activations, cross_entropy, dispatch, norms, rope
from autoplan.runtime.kernels import (apply_rope, bias_gelu, layer_norm, moe_routing,
                                      rms_norm, silu_mul, use_triton,
                                      vocab_parallel_cross_entropy)

# the package exports the function `moe_permute`, which hides the submodule of that name
moe_permute = importlib.import_module("autoplan.runtime.kernels.moe_permute")

INTERPRETING = dispatch.interpreting()
HAS_TRITON = dispatch.load_triton() is not None
HAS_CUDA = torch.cuda.is_available()
REPO = Path(__file__).resolve().parents[1]

triton_interp = pytest.mark.skipif(
    not (INTERPRETING and HAS_TRITON),
    reason="interpreter tests run in the TRITON_INTERPRET=1 child of test_interpreter_suite"
    if HAS_TRITON else "triton is not installed (pip install 'autoplan[triton]')")
needs_cuda = pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON) or INTERPRETING,
                                reason="needs CUDA and triton, without TRITON_INTERPRET")

# (rtol, atol) of a kernel's output or grad against the float64 reference
TOL = {torch.float32: (2e-5, 2e-5), torch.bfloat16: (1.6e-2, 1.6e-2)}
DTYPES = [torch.float32, torch.bfloat16]


def _rand(*shape, seed: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen, dtype=torch.float64) * scale


def _compare(kernel_fn, ref_fn, inputs: list[torch.Tensor], dtype: torch.dtype, device="cpu",
             seed: int = 99, tol_scale: float = 1.0) -> None:
    """kernel_fn on `inputs` rounded to dtype vs ref_fn on the same values in float64: the
    outputs, and the grads of every input for one random output grad (also rounded)."""
    kin = [t.to(dtype).to(device).requires_grad_() for t in inputs]
    out = kernel_fn(*kin)
    grad = _rand(*out.shape, seed=seed).to(dtype).to(device)
    out.backward(grad)
    rin = [t.detach().cpu().double().requires_grad_() for t in kin]
    ref = ref_fn(*rin)
    ref.backward(grad.cpu().double())
    rtol, atol = (v * tol_scale for v in TOL[dtype])
    assert out.dtype == dtype
    torch.testing.assert_close(out.cpu().double(), ref.detach(), rtol=rtol, atol=atol)
    for i, (k, r) in enumerate(zip(kin, rin)):
        assert k.grad is not None and k.grad.dtype == dtype, f"input {i}: grad dtype"
        torch.testing.assert_close(k.grad.cpu().double(), r.grad, rtol=rtol, atol=atol,
                                   msg=lambda m, i=i: f"grad of input {i}: {m}")


# ----------------------------------------------------------------------------- dispatch


def test_use_triton_choices(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not use_triton("cpu", "torch")
    assert not use_triton("cpu", "auto")  # torch on CPU unless interpreting
    with pytest.raises(ConfigError, match="TRITON_INTERPRET|pip install"):
        use_triton("cpu", "triton")
    with pytest.raises(ConfigError, match="not one of"):
        use_triton("cpu", "cuda")
    assert use_triton("cuda", "auto") == HAS_TRITON
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert use_triton("cpu", "auto") == HAS_TRITON
    assert not use_triton("cpu", "torch")


def test_works_without_triton(monkeypatch):
    """With `import triton` failing, the package imports, picks torch, says how to get triton."""
    import autoplan.runtime
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(autoplan.runtime, "kernels", sys.modules["autoplan.runtime.kernels"])
    for name in list(sys.modules):
        if name.startswith("autoplan.runtime.kernels"):
            monkeypatch.delitem(sys.modules, name)  # restored after the test
        if name == "triton" or name.startswith("triton."):
            monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` raises ImportError
    fresh = importlib.import_module("autoplan.runtime.kernels")
    assert fresh.dispatch.load_triton() is None
    assert not fresh.use_triton("cuda", "auto")
    with pytest.raises(ConfigError, match="pip install"):
        fresh.use_triton("cuda", "triton")
    x, w = _rand(4, 8, seed=0).float(), _rand(8, seed=1).float()
    torch.testing.assert_close(fresh.rms_norm(x, w), norms.rms_norm_torch(x, w))


def test_launch_parameters_are_powers_of_two():
    for cfg in (norms.config(32768, 12288, True), activations.config(8192, 28672, True),
                rope.config(8192 * 32, 128, True), cross_entropy.config(16384, 50000, True),
                moe_permute.config(65536, 4096, True), norms.config(37, 200, False)):
        blocks = [v for k, v in cfg.items() if k.startswith("BLOCK")]
        assert all(b & (b - 1) == 0 for b in blocks), cfg
        assert cfg["num_warps"] in (4, 8, 16, 32), cfg


# ----------------------------------------------------------------------------- torch references


def test_references_match_the_model_layers():
    x = _rand(3, 37, 200, seed=1).float()
    module = RMSNorm(200, eps=1e-6)
    with torch.no_grad():
        module.weight.copy_(_rand(200, seed=2))
    torch.testing.assert_close(norms.rms_norm_torch(x, module.weight, 1e-6), module(x))
    ln = torch.nn.LayerNorm(200)
    torch.testing.assert_close(layer_norm(x, ln.weight, ln.bias, 1e-5, backend="torch"), ln(x))
    torch.testing.assert_close(bias_gelu(x, None, backend="torch"),
                               F.gelu(x, approximate="tanh"))
    cos, sin = rope_cos_sin(37, 64, 10000.0, torch.device("cpu"))
    q = _rand(2, 3, 37, 64, seed=3).float()
    assert torch.equal(apply_rope(q, cos, sin, backend="torch"), model_apply_rope(q, cos, sin))


def test_moe_reference_matches_mixtral_loop():
    torch.manual_seed(0)
    moe = MoEFeedForward(hidden=32, ffn_hidden=48, experts=5, top_k=2)
    x = _rand(37, 32, seed=4).float()
    top_logits, top_idx = moe.router(x).topk(2, dim=-1)
    weights = F.softmax(top_logits, dim=-1)
    routing = moe_routing(top_idx, 5)
    xp = moe_permute.moe_permute(x, routing, backend="torch")
    ys, start = [], 0
    for e, count in enumerate(routing.tokens_per_expert.tolist()):
        ys.append(swiglu(xp[start:start + count], moe.w_gate[e], moe.w_up[e], moe.w_down[e]))
        start += count
    out = moe_permute.moe_unpermute(torch.cat(ys), weights, routing, backend="torch")
    torch.testing.assert_close(out, moe(x), rtol=1e-5, atol=1e-6)


class _Threads:
    """n ranks as threads: reduce(t, op) returns the max / sum over the ranks' tensors."""

    def __init__(self, n: int) -> None:
        self.barrier, self.slots = threading.Barrier(n), [None] * n

    def reduce_for(self, rank: int):
        def reduce(t: torch.Tensor, op: str) -> torch.Tensor:
            self.slots[rank] = t.clone()
            self.barrier.wait()
            stacked = torch.stack(self.slots)
            out = stacked.amax(0) if op == "max" else stacked.sum(0)
            self.barrier.wait()  # all have read the slots before anyone writes the next round
            return out
        return reduce


def _ce_reference(logits: torch.Tensor, targets: torch.Tensor, reduction: str):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                           reduction=reduction).reshape(() if reduction != "none"
                                                        else targets.shape)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_vocab_parallel_ce_threads_torch(reduction):
    """Two ranks (threads) each holding half of a 2000-token vocabulary, through the whole
    autograd Function with a callable all-reduce; loss and the concatenated grads vs F."""
    logits, targets = _rand(2, 37, 2000, seed=5, scale=3.0), _ce_targets(seed=6, vocab=2000)
    group, results = _Threads(2), [None, None]
    slices = [(0, 1000), (1000, 2000)]
    grad_out = (_rand(2, 37, seed=7) if reduction == "none"
                else torch.tensor(0.7, dtype=torch.float64))

    def rank(r):
        try:
            start, end = slices[r]
            z = logits[..., start:end].float().requires_grad_()
            loss = vocab_parallel_cross_entropy(z, targets, start, group.reduce_for(r),
                                                reduction=reduction, backend="torch")
            loss.backward(grad_out.float())
            results[r] = loss.detach(), z.grad
        except BaseException as e:  # noqa: BLE001 - reported below
            group.barrier.abort()  # release the other rank
            results[r] = e

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for r, result in enumerate(results):
        assert isinstance(result, tuple), f"rank {r}: {result!r}"
    ref_in = logits.clone().requires_grad_()
    ref = _ce_reference(ref_in, targets, reduction)
    ref.backward(grad_out)
    for loss, _ in results:
        torch.testing.assert_close(loss.double(), ref.detach(), rtol=1e-5, atol=1e-5)
    grad = torch.cat([g for _, g in results], dim=-1)
    torch.testing.assert_close(grad.double(), ref_in.grad, rtol=1e-5, atol=1e-7)


def _ce_targets(seed: int, vocab: int, shape=(2, 37)) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    targets = torch.randint(0, vocab, shape, generator=gen)
    targets.view(-1)[::9] = cross_entropy.IGNORE_INDEX  # some ignored tokens
    return targets


def _ce_gloo_rank(rank: int, world: int, logits, targets):
    import torch.distributed as dist
    vocab = logits.shape[-1] // world
    z = logits[..., rank * vocab:(rank + 1) * vocab].float().requires_grad_()
    loss = vocab_parallel_cross_entropy(z, targets, rank * vocab, dist.group.WORLD,
                                        backend="torch")
    loss.backward()
    return loss.detach(), z.grad


@pytest.mark.gloo
def test_vocab_parallel_ce_gloo_process_group():
    from _dist import spawn
    logits, targets = _rand(2, 37, 2000, seed=8, scale=3.0), _ce_targets(seed=9, vocab=2000)
    results = spawn(_ce_gloo_rank, 2, logits, targets)
    ref_in = logits.clone().requires_grad_()
    ref = _ce_reference(ref_in, targets, "mean")
    ref.backward()
    for loss, _ in results:
        torch.testing.assert_close(loss.double(), ref.detach(), rtol=1e-5, atol=1e-5)
    grad = torch.cat([g for _, g in results], dim=-1)
    torch.testing.assert_close(grad.double(), ref_in.grad, rtol=1e-5, atol=1e-7)


# ----------------------------------------------------------------------------- interpreter


def test_interpreter_suite():
    """The `triton` tests of this file in a child pytest with TRITON_INTERPRET=1."""
    run_triton_tests_interpreted(__file__)


@triton_interp
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 37, 200), (37, 96)])
def test_triton_rms_norm(shape, dtype):
    _compare(lambda x, w: rms_norm(x, w, 1e-6, backend="triton"),
             lambda x, w: norms.rms_norm_torch(x, w, 1e-6),
             [_rand(*shape, seed=10, scale=2.0), _rand(shape[-1], seed=11)], dtype)


@triton_interp
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 37, 200), (37, 96)])
def test_triton_layer_norm(shape, dtype):
    x = _rand(*shape, seed=12, scale=2.0) + 0.5
    _compare(lambda x, w, b: layer_norm(x, w, b, 1e-5, backend="triton"),
             lambda x, w, b: norms.layer_norm_torch(x, w, b, 1e-5),
             [x, _rand(shape[-1], seed=13), _rand(shape[-1], seed=14)], dtype)


@triton_interp
def test_triton_layer_norm_without_bias():
    _compare(lambda x, w: layer_norm(x, w, None, backend="triton"),
             lambda x, w: norms.layer_norm_torch(x, w, None),
             [_rand(37, 200, seed=15), _rand(200, seed=16)], torch.float32)


@triton_interp
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_silu_mul_on_chunks_of_a_fused_projection(dtype):
    def kernel(fused):  # (2, 37, 2*200): the gate and up halves are strided views
        gate, up = fused.chunk(2, dim=-1)
        return silu_mul(gate, up, backend="triton")

    def ref(fused):
        gate, up = fused.chunk(2, dim=-1)
        return activations.silu_mul_torch(gate, up)

    _compare(kernel, ref, [_rand(2, 37, 400, seed=17, scale=3.0)], dtype)


@triton_interp
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_bias_gelu(dtype):
    _compare(lambda x, b: bias_gelu(x, b, backend="triton"), activations.bias_gelu_torch,
             [_rand(3, 37, 300, seed=18, scale=2.0), _rand(300, seed=19)], dtype)


@triton_interp
def test_triton_gelu_without_bias():
    _compare(lambda x: bias_gelu(x, None, backend="triton"),
             lambda x: F.gelu(x, approximate="tanh"), [_rand(37, 200, seed=20, scale=3.0)],
             torch.float32)


@triton_interp
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_rope_on_the_attention_transpose(dtype):
    """q (B, T, H*d) viewed as (B, H, T, d) by a transpose, as CausalAttention does."""
    B, T, H, d = 2, 37, 3, 96
    cos, sin = rope_cos_sin(T, d, 10000.0, torch.device("cpu"))

    def kernel(q):
        out = apply_rope(q.view(B, T, H, d).transpose(1, 2), cos, sin, backend="triton")
        assert out.stride() == q.view(B, T, H, d).transpose(1, 2).stride()  # layout kept
        return out

    def ref(q):
        return rope.apply_rope_torch(q.view(B, T, H, d).transpose(1, 2), cos.double(),
                                     sin.double())

    _compare(kernel, ref, [_rand(B, T, H * d, seed=21)], dtype)


@triton_interp
def test_triton_rope_matches_model_and_3d_input():
    cos, sin = rope_cos_sin(37, 64, 10000.0, torch.device("cpu"))
    q = _rand(3, 37, 64, seed=22).float()
    torch.testing.assert_close(apply_rope(q, cos, sin, backend="triton"),
                               model_apply_rope(q, cos, sin), rtol=1e-6, atol=1e-6)


@triton_interp
def test_triton_broadcast_output_grads():
    """Output grads with zero strides (from `.sum()`), which the kernels read by their strides."""
    cos, sin = rope_cos_sin(37, 64, 10000.0, torch.device("cpu"))
    cases = [(lambda x, w: rms_norm(x, w, backend="triton").sum(0), lambda x, w:
              norms.rms_norm_torch(x, w).sum(0), [_rand(37, 96, seed=60), _rand(96, seed=61)]),
             (lambda x: apply_rope(x, cos, sin, backend="triton").sum(), lambda x:
              rope.apply_rope_torch(x, cos.double(), sin.double()).sum(),
              [_rand(2, 3, 37, 64, seed=62)]),
             (lambda a, b: silu_mul(a, b, backend="triton").sum(), lambda a, b:
              activations.silu_mul_torch(a, b).sum(), [_rand(37, 200, seed=63),
                                                       _rand(37, 200, seed=64)])]
    for kernel, ref, inputs in cases:
        _compare(kernel, ref, inputs, torch.float32, tol_scale=5.0)


@triton_interp
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_triton_cross_entropy_single_rank(dtype, reduction):
    targets = _ce_targets(seed=23, vocab=1000)
    _compare(lambda z: vocab_parallel_cross_entropy(z, targets, reduction=reduction,
                                                    backend="triton").to(z.dtype),
             lambda z: _ce_reference(z, targets, reduction),
             [_rand(2, 37, 1000, seed=24, scale=3.0)], dtype,
             tol_scale=0.1 if dtype == torch.float32 else 1.0)


@triton_interp
def test_triton_cross_entropy_two_ranks_by_phases():
    """Vocabulary 2000 as slices [0, 1000) and [1000, 2000), one process: phase 1 per slice, the
    all-reduces done by hand, phase 2, and each slice's backward; vs F.cross_entropy in float64."""
    logits, targets = _rand(74, 2000, seed=25, scale=3.0), _ce_targets(seed=26, vocab=2000,
                                                                       shape=(74,))
    slices = [(0, 1000), (1000, 2000)]
    stats = [cross_entropy.cross_entropy_stats(logits[:, a:b].float(), targets, a, "triton")
             for a, b in slices]
    vmax = torch.maximum(stats[0].vmax, stats[1].vmax)
    sumexp = sum(s.sumexp * (s.vmax - vmax).exp() for s in stats)
    target_logit = stats[0].target_logit + stats[1].target_logit
    lse = vmax + sumexp.log()
    valid = targets != cross_entropy.IGNORE_INDEX
    loss = cross_entropy.token_losses(lse, target_logit, valid).sum() / valid.sum()
    scale = valid.float() / valid.sum()
    grad = torch.cat([cross_entropy.cross_entropy_grad(logits[:, a:b].float(), targets, a, lse,
                                                       scale, "triton") for a, b in slices], 1)
    ref_in = logits.clone().requires_grad_()
    ref = F.cross_entropy(ref_in, targets)
    ref.backward()
    torch.testing.assert_close(loss.double(), ref.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad.double(), ref_in.grad, rtol=1e-5, atol=1e-8)
    # what each rank owns: the target logit sums to the full-row pick, exactly once
    owned = torch.where(valid, logits.float().gather(1, targets.clamp(min=0)[:, None])[:, 0], 0.0)
    torch.testing.assert_close(target_logit, owned)


@triton_interp
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_moe_permute_unpermute(dtype):
    """permute -> a per-expert op on each contiguous run -> weighted unpermute; grads of x and of
    the routing weights vs the float64 torch path."""
    routing = moe_routing(torch.randn(37, 5, generator=torch.Generator().manual_seed(27))
                          .topk(2, dim=-1).indices, 5)
    scales = torch.linspace(0.5, 1.5, 5, dtype=torch.float64)

    def pipeline(permute, unpermute):
        def run(x, w):
            xp = permute(x, routing)
            parts = xp.split(routing.tokens_per_expert.tolist())
            y = torch.cat([torch.tanh(p * scales[e].to(p.dtype)) for e, p in enumerate(parts)])
            return unpermute(y, w, routing)
        return run

    _compare(pipeline(lambda x, r: moe_permute.moe_permute(x, r, backend="triton"),
                      lambda y, w, r: moe_permute.moe_unpermute(y, w, r, backend="triton")),
             pipeline(moe_permute.permute_torch, moe_permute.unpermute_torch),
             [_rand(37, 200, seed=28), _rand(37, 2, seed=29).softmax(-1)], dtype)


@triton_interp
def test_triton_cuda_launch_parameters(monkeypatch):
    """The CUDA tile shapes (one row per program, 4096-wide vocab chunks) through the interpreter
    on a few rows, so the configuration the H200 runs is checked numerically too."""
    for module in (norms, activations, rope, cross_entropy, moe_permute):
        config = module.config
        monkeypatch.setattr(module, "config", lambda r, c, cuda, f=config: f(r, c, True))
    _compare(lambda x, w: rms_norm(x, w, backend="triton"), norms.rms_norm_torch,
             [_rand(3, 4096, seed=30), _rand(4096, seed=31)], torch.float32)
    _compare(lambda x, w, b: layer_norm(x, w, b, backend="triton"), norms.layer_norm_torch,
             [_rand(3, 4096, seed=32), _rand(4096, seed=33), _rand(4096, seed=34)],
             torch.float32)
    targets = torch.tensor([5, 4500, cross_entropy.IGNORE_INDEX])
    _compare(lambda z: vocab_parallel_cross_entropy(z, targets, backend="triton"),
             lambda z: F.cross_entropy(z, targets), [_rand(3, 5000, seed=35, scale=3.0)],
             torch.float32)
    _compare(lambda x, b: bias_gelu(x, b, backend="triton"), activations.bias_gelu_torch,
             [_rand(3, 1500, seed=36), _rand(1500, seed=37)], torch.float32)
