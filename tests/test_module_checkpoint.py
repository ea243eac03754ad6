"""DCP checkpoints of the runtime for the user's own module (runtime.module_checkpoint through
runtime.checkpoint), resumed under another plan, on 2 gloo ranks.

A tiny transformers Llama saved with save_pretrained trains under one plan, saves, and takes two
more steps (the run without a restart); another plan of the same model loads that checkpoint and
takes the same two steps: their losses must equal the uninterrupted ones (1e-5). The first resumed
loss checks the parameters; the second, after an update, the AdamW states (exp_avg, exp_avg_sq,
the step count in the bias correction). The chain crosses layouts:

    dp2 ZeRO 1 (ShardedOptimizer: states gathered over dp)  -- 2 steps, save -->  tp2 (DTensors)
    tp2 (resumed)                                            -- 3 steps, save -->  pp2 (a stage each)
    tp2's checkpoint                                                         -->  dp2 ZeRO 3 (FSDP2)
    tp2's checkpoint  -->  cp2 ZeRO 1 (sequence halves; states over the cp ranks) -- 1 step, save -->  dp2 ZeRO 1
    Mixtral ep2 (experts Shard(0) over ep)                   -- 1 step, save  -->  dp2 (experts whole)
    Mixtral dp2 (resumed)                                    -- 3 steps, save -->  ep2

Besides: the manifest records the model's parameter names and full shapes (gathered over the
pipeline stages), and, as for the zoo, a save onto a directory autoplan did not write is refused
(the directory left as it was), and so is loading another model's checkpoint.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from _dist import spawn

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.gloo

B, T, LR, EPS, SEED = 4, 16, 1e-2, 1e-6, 0
PLANS = {"dp2-zero1": dict(dp=2, zero=1, microbatches=2), "tp2": dict(tp=2),
         "pp2": dict(pp=2, microbatches=2), "dp2-zero3": dict(dp=2, zero=3), "cp2-zero1": dict(cp=2, zero=1)}
MOE_PLANS = {"moe-ep2": dict(ep=2), "moe-dp2": dict(dp=2)}


def _plan(graph, summary, dp: int = 1, tp: int = 1, pp: int = 1, ep: int = 1, cp: int = 1, zero: int = 0,
          microbatches: int = 1):
    from autoplan.api import plan_from_assignment
    from autoplan.capture.hf_rules import hf_registry
    from autoplan.cluster import parse_cluster
    from autoplan.mesh import MeshShape
    from autoplan.solver.intra_op import megatron_assignment
    from autoplan.strategies import strategy_info

    registry, info = hf_registry(), strategy_info(summary.rule_info(), tp, tp)
    assignment = megatron_assignment(graph, registry, tp, info, False) if tp > 1 else {}
    return plan_from_assignment(graph, summary, parse_cluster("1x2xcpu"), MeshShape(pp=pp, dp=dp, ep=ep, tp=tp, cp=cp),
                                assignment, B // (dp * ep) // microbatches, microbatches, zero, "none",
                                registry=registry, dtype="float32")


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict:
    from autoplan.capture.hf import capture_hf_for_planner

    root = tmp_path_factory.mktemp("module-dcp")
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=128, vocab_size=256,
                                      max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(SEED)
    transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").save_pretrained(root / "llama")
    warnings.simplefilter("ignore")
    summary, graph, _ = capture_hf_for_planner(config, T, "float32")
    plans = {name: _plan(graph, summary, **knobs) for name, knobs in PLANS.items()}
    moe = transformers.MixtralConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=4,
                                     num_key_value_heads=2, vocab_size=256, max_position_embeddings=64,
                                     tie_word_embeddings=False, num_experts_per_tok=2, intermediate_size=48,
                                     num_local_experts=4)
    transformers.AutoModelForCausalLM.from_config(moe, attn_implementation="sdpa").save_pretrained(root / "moe")
    summary, graph, _ = capture_hf_for_planner(moe, T, "float32")
    plans |= {name: _plan(graph, summary, **knobs) for name, knobs in MOE_PLANS.items()}
    tokens = torch.randint(0, 256, (5, B, T), generator=torch.Generator().manual_seed(SEED))
    (root / "users").mkdir()
    (root / "users" / "notes.txt").write_text("mine")
    return {"root": root, "plans": plans, "tokens": tokens}


# ------------------------------------------------------------------------------- in the ranks


def _program(setup_: dict, name: str):
    import autoplan

    model = "moe" if name.startswith("moe") else "llama"
    program = autoplan.parallelize(str(setup_["root"] / model), "1x2xcpu", setup_["plans"][name])
    program.make_optimizer(torch.optim.AdamW, lr=LR, eps=EPS)
    return program


def _step(program, tokens: torch.Tensor, step: int) -> float:
    targets = tokens[step].roll(-1, dims=1)
    targets[:, -1] = -100
    return program.train_step(tokens[step], targets, program.optimizer)


def _dense_chain(setup_: dict, found: dict):
    """Llama: dp2 ZeRO 1 -> tp2 -> pp2 and dp2 ZeRO 3 (module docstring); returns the tp2 program."""
    root, tokens = setup_["root"], setup_["tokens"]
    first = _program(setup_, "dp2-zero1")
    found["dp2-zero1"] = [_step(first, tokens, s) for s in range(2)]
    first.save_checkpoint(root / "at2", step=first.step)
    found["dp2-zero1"] += [_step(first, tokens, s) for s in (2, 3)]  # the run without a restart
    second = _program(setup_, "tp2")
    found["tp2 step"] = second.load_checkpoint(root / "at2")["step"]
    found["tp2"] = [_step(second, tokens, 2)]
    second.save_checkpoint(root / "at3", step=second.step)
    found["tp2"] += [_step(second, tokens, s) for s in (3, 4)]
    for name in ("pp2", "dp2-zero3"):
        program = _program(setup_, name)
        found[f"{name} step"] = program.load_checkpoint(root / "at3")["step"]
        found[name] = [_step(program, tokens, s) for s in (3, 4)]
        if name == "pp2":  # each stage saves its own parameters; the manifest names them all
            program.save_checkpoint(root / "pp2-at5", step=program.step)
    _context_chain(setup_, found)
    return second


def _context_chain(setup_: dict, found: dict) -> None:
    """Llama: tp2's checkpoint -> cp2 ZeRO 1 -> dp2 ZeRO 1 (module docstring)."""
    root, tokens = setup_["root"], setup_["tokens"]
    program = _program(setup_, "cp2-zero1")
    found["cp2-zero1 step"] = program.load_checkpoint(root / "at3")["step"]
    found["cp2-zero1"] = [_step(program, tokens, 3)]
    program.save_checkpoint(root / "cp2-at4", step=program.step)
    found["cp2-zero1"] += [_step(program, tokens, 4)]
    program = _program(setup_, "dp2-zero1")
    found["after cp step"] = program.load_checkpoint(root / "cp2-at4")["step"]
    found["after cp"] = [_step(program, tokens, 4)]


def _moe_chain(setup_: dict, found: dict) -> None:
    """Mixtral: ep2 -> dp2 -> ep2 (module docstring)."""
    root, tokens = setup_["root"], setup_["tokens"]
    moe = _program(setup_, "moe-ep2")  # the expert weights DTensors Shard(0) over ep
    found["moe-ep2"] = [_step(moe, tokens, 0)]
    moe.save_checkpoint(root / "moe-at1", step=moe.step)
    found["moe-ep2"] += [_step(moe, tokens, s) for s in (1, 2, 3)]
    moe = _program(setup_, "moe-dp2")  # the experts whole on every rank
    moe.load_checkpoint(root / "moe-at1")
    found["moe resumed"] = [_step(moe, tokens, s) for s in (1, 2)]
    moe.save_checkpoint(root / "moe-at3", step=moe.step)
    moe = _program(setup_, "moe-ep2")
    moe.load_checkpoint(root / "moe-at3")
    found["moe resumed"] += [_step(moe, tokens, 3)]  # back under ep2


def _chain(rank: int, world: int, setup_: dict) -> dict:
    from autoplan.runtime.checkpoint import CheckpointError, read_metadata

    warnings.simplefilter("ignore")
    found: dict = {}
    second = _dense_chain(setup_, found)
    _moe_chain(setup_, found)
    root = setup_["root"]
    for key, attempt in (("refused", lambda: second.save_checkpoint(root / "users")),
                         ("another model", lambda: second.load_checkpoint(root / "moe-at3"))):
        try:
            attempt()
            found[key] = ""
        except CheckpointError as exc:
            found[key] = str(exc)
    found["manifest"] = read_metadata(root / "pp2-at5")
    return found


@pytest.fixture(scope="module")
def runs(setup) -> list[dict]:
    shared = {k: setup[k] for k in ("root", "plans", "tokens")}
    return spawn(_chain, 2, shared)


# ------------------------------------------------------------------------------- checks


def test_resumes_under_another_plan_with_the_uninterrupted_loss(runs):
    for found in runs:
        assert found["tp2 step"] == 2 and found["pp2 step"] == found["dp2-zero3 step"] == 3
        assert found["tp2"][:2] == pytest.approx(found["dp2-zero1"][2:], rel=1e-5, abs=1e-5)
        assert found["pp2"] == pytest.approx(found["tp2"][1:], rel=1e-5, abs=1e-5)
        assert found["dp2-zero3"] == pytest.approx(found["tp2"][1:], rel=1e-5, abs=1e-5)
        assert found["cp2-zero1 step"] == 3 and found["after cp step"] == 4
        assert found["cp2-zero1"] == pytest.approx(found["tp2"][1:], rel=1e-5, abs=1e-5)
        assert found["after cp"] == pytest.approx(found["tp2"][2:], rel=1e-5, abs=1e-5)
        assert found["moe resumed"] == pytest.approx(found["moe-ep2"][1:], rel=1e-5, abs=1e-5)


def test_manifest_names_the_models_parameters(setup, runs):
    manifest = runs[0]["manifest"]
    model = transformers.AutoModelForCausalLM.from_pretrained(setup["root"] / "llama")
    assert manifest["parameters"] == {n: list(p.shape) for n, p in sorted(model.named_parameters())}
    assert manifest["step"] == 5 and manifest["optimizer"] == "AdamW" and manifest["mesh"]["pp"] == 2
    assert manifest["model"]["fingerprint"] == setup["plans"]["tp2"].model.fingerprint


def test_a_users_directory_and_another_models_checkpoint_are_refused(setup, runs):
    assert "holds no autoplan checkpoint" in runs[0]["refused"]
    moe, llama = (setup["plans"][name].model for name in ("moe-ep2", "tp2"))
    assert f"holds model {moe.name!r} with fingerprint {moe.fingerprint}" in runs[0]["another model"]
    assert f"runs model {llama.name!r}" in runs[0]["another model"]
    assert [p.name for p in (setup["root"] / "users").iterdir()] == ["notes.txt"]
