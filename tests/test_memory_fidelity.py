"""The memory the plan promises is the memory the run holds: the cost model's activation bytes per rank
(`cost_model.memory.plan_activation_bytes`) against what one forward of the runtime leaves for
backward, measured by storage (`runtime.memory_probe`: parameters and tensors made from them alone
left out), and against the most a recomputed layer's re-run holds in backward.

    one process    tiny-gpt, tiny-llama, tiny-moe x float32, bfloat16 (autocast) x none, selective,
                   matmul-only, full, full:1; and x bf16-master (bf16 parameters) x none, full
    2 gloo ranks   tp (Megatron), tp with sequence parallelism, cp (Ulysses), ep, over the families,
                   dtypes and policies (a sample of the product, every pair of them present)

Each within TOLERANCE per rank; under ep the plan prices the busiest rank (the routed rows with the
imbalance margins, `cost_model.activations.ep_imbalance_margins`), so an ep case is checked against the
most any rank holds (within EP_OVER above it and TOLERANCE below), and its price at the mean over the
expert group against the mean of the ranks. Also: with nothing recomputed the probe's count equals the
saved-tensor hooks' count (two views of the same bytes); on a Llama block "selective" frees at least
FREED_MIN of what "none" keeps, and the model says how much to within TOLERANCE.
"""

from __future__ import annotations

import pytest

from _dist import batches, make_plan, spawn

pytestmark = pytest.mark.gloo

TOLERANCE = 0.05  # relative, per rank
EP_OVER = 0.10  # ep: the busiest rank's price may exceed it by this much (issue 19: none beyond 10%)
FREED_MIN = 0.15  # of none's bytes, that selective frees on a Llama block
SEQ = 64
POLICIES = ("none", "selective", "matmul-only", "full", "full:1")
MICROBATCH = {"tiny-moe": 4}  # more tokens per expert: routing closer to its mean over the ranks
SINGLE = [(f"{model}-{dtype}-{policy}", model, dict(dtype=dtype, recompute=policy))
          for model in ("tiny-gpt", "tiny-llama", "tiny-moe") for dtype in ("float32", "bfloat16")
          for policy in POLICIES]
# bf16 parameters with fp32 masters (plan precision "bf16-master"): the residual stream in bf16
SINGLE += [(f"{model}-bf16-master-{policy}", model, dict(dtype="bfloat16", precision="bf16-master", recompute=policy))
           for model in ("tiny-gpt", "tiny-llama", "tiny-moe") for policy in ("none", "full")]
PARALLEL = [(f"{model}-{name}-{dtype}-{policy}", model, dict(dtype=dtype, recompute=policy, **mesh))
            for model, name, mesh, dtype, policy in (
                ("tiny-gpt", "tp2", dict(tp=2, assignment="megatron"), "float32", "selective"),
                ("tiny-gpt", "sp2", dict(tp=2, assignment="megatron-sp"), "bfloat16", "full"),
                ("tiny-gpt", "cp2", dict(cp=2), "bfloat16", "none"),
                ("tiny-llama", "tp2", dict(tp=2, assignment="megatron"), "bfloat16", "matmul-only"),
                ("tiny-llama", "sp2", dict(tp=2, assignment="megatron-sp"), "float32", "selective"),
                ("tiny-llama", "cp2", dict(cp=2), "float32", "full:1"),
                ("tiny-moe", "tp2", dict(tp=2, assignment="megatron"), "float32", "none"),
                ("tiny-moe", "sp2", dict(tp=2, assignment="megatron-sp"), "bfloat16", "selective"),
                ("tiny-moe", "cp2", dict(cp=2), "float32", "matmul-only"),
                ("tiny-moe", "ep2", dict(ep=2), "float32", "selective"),
                ("tiny-moe", "ep2", dict(ep=2), "bfloat16", "none"),
                ("tiny-moe", "ep2", dict(ep=2), "bfloat16", "full"))]
PARALLEL += [("tiny-llama-sp2-bf16-master-selective", "tiny-llama",
              dict(dtype="bfloat16", precision="bf16-master", recompute="selective", tp=2, assignment="megatron-sp"))]


def _plan(model: str, kwargs: dict):
    kwargs = dict(kwargs)
    tp = kwargs.pop("tp", 1)
    return make_plan(model, 1, tp, seq_len=SEQ, microbatch_size=MICROBATCH.get(model, 2), **kwargs)


def _measure_all(rank: int, world: int, cases: list) -> dict:
    from autoplan.models import build_model, get_model_config
    from autoplan.runtime.launch import parallelize
    from autoplan.runtime.memory_probe import measure_saved_bytes

    out = {}
    for cid, model, plan in cases:
        config = get_model_config(model)
        program = parallelize(build_model(config, device="meta"), None, plan, config=config)
        tokens, targets = batches(plan.global_batch, plan.seq_len, 1)
        shard = program.shard_batch(tokens[0], targets[0])
        _, measured = measure_saved_bytes(lambda: program(*shard), program)
        out[cid] = (measured.saved_bytes, measured.hooked_bytes, measured.recompute_bytes)
    return out


def _predict(model: str, plan, imbalance: bool = True) -> tuple[float, float]:
    from autoplan.api import capture_model
    from autoplan.cost_model.memory import plan_activation_bytes
    from autoplan.models import get_model_config

    config = get_model_config(model)
    return plan_activation_bytes(plan, capture_model(config, SEQ, plan.dtype), config.rule_info(), imbalance)


@pytest.fixture(scope="module")
def measured() -> dict:
    """{case id: {"plan", "model", "ranks": [(saved, hooked, recompute) per rank]}}."""
    found = {}
    for world, cases in ((1, SINGLE), (2, PARALLEL)):
        plans = [(cid, model, _plan(model, kwargs)) for cid, model, kwargs in cases]
        ranks = spawn(_measure_all, world, plans)
        found |= {cid: {"plan": plan, "model": model, "ranks": [r[cid] for r in ranks]}
                  for cid, model, plan in plans}
    return found


def _within(predicted: float, got: float) -> bool:
    return abs(predicted - got) <= TOLERANCE * got


@pytest.mark.parametrize("cid", [c[0] for c in SINGLE + PARALLEL])
def test_predicted_activations_within_tolerance(measured, cid):
    case = measured[cid]
    kept, transient = _predict(case["model"], case["plan"])
    if case["plan"].mesh.expert_parallel > 1:
        _check_busiest_rank(case, cid, (kept, transient))
        return
    for rank, (saved, _, recompute) in enumerate(case["ranks"]):
        assert _within(kept, saved), f"{cid} rank {rank}: predicted {kept:.0f} B held, measured {saved}"
        assert _within(transient, recompute), (f"{cid} rank {rank}: predicted {transient:.0f} B while a layer "
                                               f"is re-run, measured {recompute}")


def _check_busiest_rank(case: dict, cid: str, predicted: tuple[float, float]) -> None:
    """Under ep the plan's bytes (held; while a layer is re-run) price the busiest rank's: at most
    TOLERANCE under them and EP_OVER over, and above the price at the mean (the margins add bytes)."""
    at_mean = _predict(case["model"], case["plan"], imbalance=False)
    for i, what in ((0, "held"), (1, "while a layer is re-run")):
        busiest = max(r[2 * i] for r in case["ranks"])
        assert busiest * (1 - TOLERANCE) <= predicted[i] <= busiest * (1 + EP_OVER) and predicted[i] >= at_mean[i], (
            f"{cid}: busiest rank {busiest} B {what}, predicted {predicted[i]:.0f} B (at the mean {at_mean[i]:.0f})")


@pytest.mark.parametrize("cid", [c[0] for c in PARALLEL if c[2].get("ep", 1) > 1])
def test_ep_mean_price_is_the_mean_of_the_ranks(measured, cid):
    """Without the margins the model prices the mean over the expert group: the bytes held after the
    forward within TOLERANCE of the ranks' mean (what the margins add is the busiest rank's excess over
    it). Not the re-run: each rank's is its own busiest layer, whose mean is not the mean's layer."""
    case = measured[cid]
    kept, _ = _predict(case["model"], case["plan"], imbalance=False)
    mean = sum(r[0] for r in case["ranks"]) / len(case["ranks"])
    assert _within(kept, mean), (cid, kept, case["ranks"])


@pytest.mark.parametrize("cid", [c[0] for c in SINGLE if c[2]["recompute"] == "none"])
def test_probe_equals_saved_tensor_hooks_without_recompute(measured, cid):
    (saved, hooked, recompute), = measured[cid]["ranks"]
    assert saved == hooked and recompute == 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_selective_frees_real_bytes_on_a_llama_block(measured, dtype):
    """Measured: selective keeps at least FREED_MIN less than none; the model's figure of what it frees
    is within TOLERANCE of the measured one."""
    none, selective = (measured[f"tiny-llama-{dtype}-{p}"] for p in ("none", "selective"))
    freed = none["ranks"][0][0] - selective["ranks"][0][0]
    assert freed >= FREED_MIN * none["ranks"][0][0]
    predicted = _predict("tiny-llama", none["plan"])[0] - _predict("tiny-llama", selective["plan"])[0]
    assert _within(predicted, freed), (predicted, freed)
