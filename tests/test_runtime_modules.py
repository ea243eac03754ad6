"""The runtime for the user's own module (runtime.module_*), against transformers in one process.

Tiny Llama (GQA: 4 heads, 2 kv heads), Qwen2 (q/k/v biases) and GPT-2 configs (Conv1D weights (in,
out), fused q|k|v, the lm_head tied to the embedding: under tp both vocab-parallel), built locally and saved
with save_pretrained into a temporary directory, and a hand-written transformer (tests/_handmade.py:
plain nn.Linear + F.scaled_dot_product_attention, blocks in a list called `stack`). Each
configuration below trains 3 AdamW steps from the same weights as the one-process reference, whose
loss is transformers' own (`model(input_ids, labels=input_ids).loss`), and compares the losses
(relative 1e-5), the first step's gradients and the final parameters (1e-5). One spawn per world
size (2 and 4 ranks) runs all its configurations. Besides:

    meta      a model built on meta loads its weights from the checkpoint directory, each rank
              reading only its slices (the elements read equal the elements it holds)
    export    the trained weights written with save_hf load back with from_pretrained and give
              the parallel program's loss on new tokens; a directory autoplan did not write is
              refused and left as it was
    forward   program.forward returns this rank's logits, or all of them with gather=True, and
              program.eval_loss the loss on new tokens
    health    program.grad_norm after the first step is the one-process gradient norm; a NaN
              weight stops the step on every rank before the update (TrainingDivergedError)
    no plan   autoplan.parallelize of a transformers model without a plan plans on rank 0 and runs
    losses    the plan's cross-entropy strategy: vocab-parallel (Megatron), on sequence shards (the head
              "sequence"), whole (a replicated plan: attention and MLP blocks replicated regions)
    recompute the plan's policy (full, selective, matmul-only, full:1; under dp, tp, sp and ZeRO 3) gives
              the same numbers; the blocks recomputed and the op families saved are the policy's; and
              one microbatch's forward keeps less for backward (runtime.memory_probe) by the bytes the
              cost model predicts (test_recompute_frees_what_the_cost_model_predicts says how close)
    pipelines pp alone (1F1B; interleaved 1F1B with an embedding-only first and a head-only last
              chunk), with dp (ZeRO 0 and 1) and with tp (+ sp, GPipe), for each model; with a
              pipeline, program.forward says what to use instead and eval_loss gives the loss
Every case runs through autoplan.parallelize (one passes the checkpoint directory as the model).
Pure checks (no processes): the module plan of a plan, what it refuses, checkpoints that do not match.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from _dist import spawn
from _hf_checkpoints import adamw_reference, assert_matches_reference, gpt2_tied_head, save_and_capture
from _handmade import HandLM

transformers = pytest.importorskip("transformers")

from _module_cases import (B, BASES, CASES, EPS, EXPORTED, LR, SEED, STEPS, T, Case,  # noqa: E402
                           _build, _hand_model, _ranks)  # (they need transformers)

pytestmark = pytest.mark.gloo

TOL = dict(rtol=1e-5, atol=1e-5)
FREED_TOLERANCE = 0.10  # relative: activation bytes recompute frees, measured against the cost model


# What a plain (no recompute) run keeps for backward beyond the cost model's price, measured op by op:
UNPRICED = {
    "qwen2-tp2-sp-selective": "the whole-sequence copies DTensor's S(1) -> R all-gathers make for the "
                              "column projections (aten.cat), priced as sequence shards",
    "hand-tp2-sp-full:1": "the same all-gathered copies as qwen2-tp2-sp",
    "gpt2-dp2-selective": "the intermediates of GPT-2's tanh GELU (gelu_new: pow, mul, add, tanh), priced "
                          "as one GELU",
}
def _hf_configs() -> dict:
    common = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, vocab_size=256, max_position_embeddings=64,
                  tie_word_embeddings=False)
    gpt2 = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=64,
                                   resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, summary_first_dropout=0.0,
                                   bos_token_id=0, eos_token_id=0)  # tied wte / lm_head, Conv1D weights (in, out)
    return {"llama": transformers.LlamaConfig(**common), "qwen2": transformers.Qwen2Config(**common), "gpt2": gpt2}


def _hf_loss(model, tokens: torch.Tensor) -> torch.Tensor:
    if isinstance(model, HandLM):
        return model(tokens, labels=tokens)
    return model(input_ids=tokens, labels=tokens).loss


def _reference(model, tokens: torch.Tensor) -> dict:
    """One process: transformers' loss, 3 AdamW steps; then the loss on new tokens."""
    ref = adamw_reference(model, tokens, STEPS, LR, EPS, _hf_loss)
    with torch.no_grad():
        return ref | {"after": _hf_loss(model, tokens[STEPS]).item()}


def _plan(case: Case, graph, summary):
    from autoplan.api import plan_from_assignment
    from autoplan.capture.hf_rules import hf_registry
    from autoplan.cluster import parse_cluster
    from autoplan.mesh import MeshShape
    from autoplan.solver.intra_op import megatron_assignment
    from autoplan.strategies import strategy_info

    registry, info = hf_registry(), strategy_info(summary.rule_info(), case.tp, case.tp)
    assignment = {}
    if case.tp > 1 and case.assignment != "replicate":
        assignment = megatron_assignment(graph, registry, case.tp, info, case.sp)
    if case.assignment == "sequence-loss":
        assignment |= _sequence_head(graph, registry, case.tp, info)
    if case.assignment == "tied-head":
        assignment = gpt2_tied_head(graph, registry, case.tp, info)
    cluster, mesh = parse_cluster(f"1x{case.world}xcpu"), MeshShape(pp=case.pp, dp=case.dp, tp=case.tp)
    batch = (B // case.dp // case.microbatches, case.microbatches, case.zero, case.recompute)
    return plan_from_assignment(graph, summary, cluster, mesh, assignment, *batch, registry=registry,
                                dtype="float32", schedule=case.schedule, virtual_stages=case.virtual,
                                stage_layers=case.stage_layers)


def _sequence_head(graph, registry, tp: int, info: dict) -> dict[str, str]:
    """The lm_head and every op after it (views, the loss) on sequence shards where they can be."""
    nodes = list(graph.nodes)
    head = next(i for i, n in enumerate(nodes) if n.module_path == "lm_head")
    return {n.name: "sequence" for n in nodes[head:]
            if "sequence" in {s.name for s in registry.strategies(n, tp, info)}}


def _hand_summary():
    from autoplan.models.config import ModelConfig

    return ModelConfig("hand-lm", "gpt", 2, 32, 4, 4, 128, 128, 64)


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict:
    """Checkpoint directories, tokens, references, and each case's plan (captured once per model)."""
    from autoplan.capture.hf import capture_hf

    root = tmp_path_factory.mktemp("modules")
    tokens = torch.randint(0, 128, (STEPS + 1, B, T), generator=torch.Generator().manual_seed(SEED))
    dirs, refs, graphs = save_and_capture(_hf_configs(), root, tokens, _reference, T, SEED)
    refs["hand"] = _reference(_hand_model(), tokens)
    graphs["hand"] = (capture_hf(_hand_model("meta"), 1, T, torch.float32), _hand_summary())
    plans = {c.name: _plan(c, *graphs[c.model]) for c in CASES}
    predicted = {c.name: _predicted_bytes(plans[c.name], *graphs[c.model]) for c in CASES
                 if c.name in BASES or c.name in BASES.values()}
    return {"root": root, "dirs": dirs, "tokens": tokens, "refs": refs, "plans": plans, "predicted": predicted}


def _predicted_bytes(plan, graph, summary) -> float:
    """The cost model's bytes one microbatch's forward leaves for backward on a rank, for `plan`."""
    from autoplan.cost_model.memory import plan_activation_bytes

    return plan_activation_bytes(plan, graph, summary.rule_info())[0]


@pytest.fixture(scope="module")
def runs(setup) -> dict:
    """Every case's results on each rank: {world: [rank 0's dict, rank 1's, ...]}."""
    (setup["root"] / "users-dir").mkdir()
    (setup["root"] / "users-dir" / "notes.txt").write_text("mine")
    found = {}
    for world in (2, 4):
        names = [c.name for c in CASES if c.world == world]
        shared = {k: setup[k] for k in ("root", "dirs", "tokens", "plans")}
        found[world] = spawn(_ranks, world, names, shared)
    return found


# ------------------------------------------------------------------------------- checks


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_matches_transformers_in_one_process(setup, runs, case):
    assert_matches_reference([r[case.name] for r in runs[case.world]], setup["refs"][case.model], TOL)


@pytest.mark.parametrize("case", [c for c in CASES if c.weights == "meta"], ids=lambda c: c.name)
def test_meta_model_reads_only_its_slices(runs, case):
    for got in runs[case.world]:
        held = got[case.name]["held"] * (case.dp if case.zero == 3 else 1)  # before ZeRO 3 sharded it over dp
        assert got[case.name]["reads"] == held
        if case.tp > 1 or case.pp > 1:
            assert held < sum(p.numel() for p in runs[case.world][0][case.name]["params"].values())


@pytest.mark.parametrize("name", EXPORTED)
def test_export_loads_back_into_transformers(setup, runs, name):
    case = next(c for c in CASES if c.name == name)
    out = setup["root"] / f"export-{name}"
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert not list(setup["root"].glob(f"export-{name}.*")), "no temporary or old directory left"
    got = runs[case.world][0][name]
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), got["params"][n], rtol=0, atol=0)
    with torch.no_grad():
        assert _hf_loss(model, setup["tokens"][STEPS]).item() == pytest.approx(got["after"], rel=1e-5)


def test_forward_gives_local_or_gathered_logits(runs):
    vocab = 256
    got = runs[4][0]["llama-dp2tp2-sp"]  # vocab-parallel head: rows of dp, vocabulary of tp
    assert got["local_shape"] == (B // 2, T, vocab // 2) and got["gathered_shape"] == (B, T, vocab)
    got = runs[2][0]["llama-dp2"]
    assert got["local_shape"] == (B // 2, T, vocab) and got["gathered_shape"] == (B, T, vocab)


def test_forward_with_a_pipeline_says_what_to_use(runs):
    for world, name in ((2, "llama-pp2"), (4, "hand-pp2tp2")):
        for ranks in runs[world]:
            refused = ranks[name]["refused"]
            assert "pipelines the model over pp=2 stages" in refused
            assert "program.eval_loss(tokens, targets)" in refused and "full_state_dict()" in refused


def test_export_refuses_a_users_directory(setup, runs):
    for ranks in runs[2]:
        assert "users-dir" in ranks["refused"] and "did not write" in ranks["refused"]
    assert [p.name for p in (setup["root"] / "users-dir").iterdir()] == ["notes.txt"]


def test_a_nan_stops_every_rank_before_the_update(runs):
    for ranks in runs[2]:
        got = ranks["diverged"]
        assert "training diverged at step 0" in got["error"] and "not taken" in got["error"]
        assert got["parameter"] == "model.embed_tokens.weight"  # the first, in the model's order
        assert got["unchanged"]


def test_parallelize_without_a_plan(setup, runs):
    for ranks in runs[2]:
        assert ranks["unplanned"] == pytest.approx(setup["refs"]["llama"]["losses"], rel=1e-5)


@pytest.mark.parametrize("case", [c for c in CASES if c.recompute != "none"], ids=lambda c: c.name)
def test_recompute_applies_the_plans_policy(runs, case):
    """The blocks run as regions are the policy's layers, and in them only the families the policy
    names are saved (every block's matmuls and attention are seen, saved or not)."""
    from autoplan.recompute_policy import recompute_policy

    policy = recompute_policy(case.recompute)
    held = set()
    for ranks in runs[case.world]:
        got = ranks[case.name]
        held |= set(got["held_layers"])
        assert len(got["held_layers"]) == 2 // case.pp and not got["wrapped_stand_ins"]
        assert got["recomputed"] == tuple(i for i in policy.recomputed_layers(2) if i in got["held_layers"])
        saved = {k.split(":")[0] for k, n in got["decisions"].items() if k.endswith(":True") and n}
        assert saved == set(policy.saves)
        linears = {"hand": 6, "gpt2": 4}.get(case.model, 7)  # q, k, v, o, (gate,) up, down; GPT-2's c_attn fused
        matmuls = got["decisions"].get("matmul:True", 0) + got["decisions"].get("matmul:False", 0)
        # a pipeline: counted over training, each microbatch's forward and, at the first step, the
        # stage's shape inference (torch.distributed.pipelining runs the stage's forward once)
        forwards = STEPS * case.microbatches + 1 if case.pp > 1 else 1
        assert matmuls == linears * len(got["recomputed"]) * forwards
    assert held == {0, 1}


@pytest.mark.parametrize("name", sorted(BASES), ids=str)
def test_recompute_frees_what_the_cost_model_predicts(setup, runs, name):
    """One microbatch's forward keeps less for backward with recompute than the same plan without,
    and frees the bytes the cost model predicts: within FREED_TOLERANCE where the plain run keeps
    what the model prices; at least that (less the tolerance) where it keeps more (UNPRICED), which
    recompute frees as well."""
    case = next(c for c in CASES if c.name == name)
    predicted = setup["predicted"][BASES[name]] - setup["predicted"][name]
    assert predicted > 0
    for ranks in runs[case.world]:
        kept, plain = ranks[name]["saved_bytes"], ranks[BASES[name]]["saved_bytes"]
        assert kept < plain
        if name in UNPRICED:
            assert plain - kept >= predicted * (1 - FREED_TOLERANCE)
        else:
            assert plain - kept == pytest.approx(predicted, rel=FREED_TOLERANCE)


def test_recompute_under_a_pipeline_counts_the_models_layers(setup):
    """'full:1' under pp=2 re-runs the model's first layer (as the cost model and the zoo runtime count
    it), on the rank holding it only: not each stage's first layer, and no other stage's stand-in."""
    from autoplan.recompute_policy import recompute_policy
    from autoplan.runtime.module_recompute import apply_module_recompute
    from autoplan.runtime.module_stages import cut_stages

    plan = dataclasses.replace(setup["plans"]["llama-pp2-full"], recompute="full:1")
    found = []
    for stage in (0, 1):
        model, _ = _build(Case("meta", "llama", weights="meta"), setup["dirs"])
        cut = cut_stages(model, plan)
        cut.prune([stage])
        found.append(apply_module_recompute(model, recompute_policy(plan.recompute), cut.held_blocks()))
        assert not any("forward" in vars(p.module) for p in cut.blocks if p.module not in cut.held_blocks())
    assert found == [(0,), ()]
