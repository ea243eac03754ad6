"""Master weights (plan precision "bf16-master") in the runtime for the user's own module: a tiny
transformers Llama (2 layers, GQA) saved with save_pretrained, 3 AdamW steps (lr 1e-3).

2 gloo ranks under dp2 with ZeRO 0 (2 microbatches), 1 and 3 (FSDP2's MixedPrecisionPolicy) and
under tp2 (DTensor parameters cast to bf16) against one process of the same scheme, and that one
process against transformers' own float32 training; tolerances as tests/test_mixed_precision.py
says (bf16 round-off turned into Adam update differences where a gradient is near zero):

                                loss rtol   99% of master elements within   every element within
    2 ranks vs 1 (same scheme)  5e-4        2e-4                            6 lr
    bf16-master vs float32      1e-3        5e-4                            6 lr

The Hugging Face export (save_hf) of the ZeRO 0 run writes the float32 masters: from_pretrained loads
them as the program's full parameters, bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from _dist import spawn
from _hf_checkpoints import adamw_reference, save_and_capture

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.gloo

B, T, STEPS, LR, EPS, SEED = 4, 16, 3, 1e-3, 1e-6, 0
PARITY = dict(loss_rtol=5e-4, atol=2e-4)
VS_FP32 = dict(loss_rtol=1e-3, atol=5e-4)
CASES = {"dp2-zero0": dict(dp=2, zero=0, microbatches=2), "dp2-zero1": dict(dp=2, zero=1),
         "dp2-zero3": dict(dp=2, zero=3), "tp2": dict(tp=2)}


def _config():
    return transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                     num_key_value_heads=2, intermediate_size=128, vocab_size=256,
                                     max_position_embeddings=64, tie_word_embeddings=False)


def _plan(graph, summary, dp: int = 1, tp: int = 1, zero: int = 0, microbatches: int = 1):
    from autoplan.api import plan_from_assignment
    from autoplan.capture.hf_rules import hf_registry
    from autoplan.cluster import parse_cluster
    from autoplan.mesh import MeshShape
    from autoplan.solver.intra_op import megatron_assignment
    from autoplan.strategies import strategy_info

    registry, info = hf_registry(), strategy_info(summary.rule_info(), tp, tp)
    assignment = megatron_assignment(graph, registry, tp, info, False) if tp > 1 else {}
    cluster, mesh = parse_cluster(f"1x{dp * tp}xcpu"), MeshShape(dp=dp, tp=tp)
    return plan_from_assignment(graph, summary, cluster, mesh, assignment, B // dp // microbatches, microbatches,
                                zero, "none", registry=registry, dtype="bfloat16", precision="bf16-master")


def _targets(tokens: torch.Tensor) -> torch.Tensor:
    targets = tokens.roll(-1, dims=1)
    targets[:, -1] = -100  # transformers' loss: T - 1 targets per row
    return targets


def _run(rank: int, world: int, directory: str, plans: dict, tokens: torch.Tensor, export: str) -> dict:
    import autoplan
    from autoplan.runtime.hf_export import save_hf

    found = {}
    for name, plan in plans.items():
        model = transformers.AutoModelForCausalLM.from_pretrained(directory, attn_implementation="sdpa")
        program = autoplan.parallelize(model, f"1x{world}xcpu", plan)
        held = sorted({str(p.dtype) for p in program.model.parameters()})
        optimizer = program.make_optimizer(torch.optim.AdamW, lr=LR, eps=EPS)
        losses = [program.train_step(tokens[s], _targets(tokens[s]), optimizer) for s in range(STEPS)]
        found[name] = {"losses": losses, "params": program.full_parameters(), "held": held}
        if name == "dp2-zero0":
            save_hf(program, export)
    return found


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("mixed-modules")
    tokens = torch.randint(0, 128, (STEPS, B, T), generator=torch.Generator().manual_seed(SEED))
    dirs, refs, graphs = save_and_capture({"llama": _config()}, root, tokens,
                                          lambda m, t: adamw_reference(m, t, STEPS, LR, EPS), T, SEED)
    graph, summary = graphs["llama"]
    export = str(root / "export")
    one = spawn(_run, 1, str(dirs["llama"]), {"one": _plan(graph, summary)}, tokens, export)[0]["one"]
    two = spawn(_run, 2, str(dirs["llama"]), {n: _plan(graph, summary, **c) for n, c in CASES.items()},
                tokens, export)
    exported = transformers.AutoModelForCausalLM.from_pretrained(export)
    return {"one": one, "two": two, "reference": refs["llama"],
            "exported": {n: p.detach() for n, p in exported.named_parameters()}}


def _close(got: dict, ref: dict, loss_rtol: float, atol: float, what: str) -> None:
    """Losses within `loss_rtol`; at least 99% of the masters' elements within `atol`, none beyond 6 lr."""
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]),
                               rtol=loss_rtol, atol=0, msg=f"{what}: losses")
    diffs = torch.cat([(got["params"][n].float() - v).abs().flatten() for n, v in ref["params"].items()])
    assert float(diffs.max()) <= 6 * LR, f"{what}: a master moved {float(diffs.max()):.2e} from the reference"
    within = float((diffs <= atol).float().mean())
    assert within >= 0.99, f"{what}: only {within:.2%} of the masters within {atol}"


def test_parameters_are_bf16_with_float32_masters(runs):
    assert runs["one"]["held"] == ["torch.bfloat16"]
    assert runs["two"][0]["dp2-zero3"]["held"] == ["torch.float32"]  # FSDP2's shards are the masters
    assert all(v.dtype == torch.float32 for v in runs["one"]["params"].values())
    off = sum(int((v != v.bfloat16().float()).sum()) for v in runs["one"]["params"].values())
    assert off > 0.9 * sum(v.numel() for v in runs["one"]["params"].values() if v.dim() > 1)


@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_match_one_process(runs, case):
    for rank in (0, 1):
        _close(runs["two"][rank][case], runs["one"], what=f"{case} rank {rank}", **PARITY)


def test_masters_stay_close_to_transformers_float32(runs):
    _close(runs["one"], runs["reference"], what="bf16-master vs transformers float32", **VS_FP32)


def test_export_writes_the_float32_masters(runs):
    masters = runs["two"][0]["dp2-zero0"]["params"]
    assert {v.dtype for v in runs["exported"].values()} == {torch.float32}
    for name, value in runs["exported"].items():
        assert torch.equal(value, masters[name]), name
