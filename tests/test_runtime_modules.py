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
import warnings

import pytest
import torch
import torch.nn.functional as F

from _dist import spawn
from _hf_checkpoints import (adamw_reference, assert_matches_reference, count_checkpoint_reads, gpt2_tied_head,
                             save_and_capture)
from _handmade import HandLM
from autoplan.errors import PlanError

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.gloo

B, T, STEPS, LR, SEED = 4, 16, 3, 1e-3, 0
# AdamW's eps above the noise of gradients that are zero in exact arithmetic (a key bias: softmax
# ignores a shift shared by all keys), which AdamW would otherwise blow up to +-LR either way
EPS = 1e-6
TOL = dict(rtol=1e-5, atol=1e-5)
FREED_TOLERANCE = 0.10  # relative: activation bytes recompute frees, measured against the cost model


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    model: str  # "llama" | "qwen2" | "hand"
    dp: int = 1
    tp: int = 1
    sp: bool = False
    zero: int = 0
    microbatches: int = 1
    weights: str = "module"  # "module": built with weights; "meta": loaded from the checkpoint
    assignment: str = "megatron"  # "megatron" (with sp: "megatron-sp"), "replicate", "sequence-loss":
    # Megatron with sp, the head and the loss on sequence shards, or "tied-head" (`gpt2_tied_head`)
    recompute: str = "none"  # the plan's recompute policy (runtime.module_recompute)
    pp: int = 1
    schedule: str = "1f1b"
    stage_layers: tuple[int, ...] | None = None  # None: as the planner cuts them

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.tp

    @property
    def virtual(self) -> int:
        return len(self.stage_layers) // self.pp if self.stage_layers else 1


CASES = [
    Case("llama-dp2", "llama", dp=2, microbatches=2),
    Case("llama-tp2", "llama", tp=2, weights="meta"),
    Case("llama-tp2-sp", "llama", tp=2, sp=True),
    Case("llama-dp2-zero3", "llama", dp=2, zero=3, weights="meta"),
    Case("qwen2-dp2", "qwen2", dp=2, weights="meta"),
    Case("qwen2-tp2", "qwen2", tp=2),
    Case("qwen2-tp2-sp", "qwen2", tp=2, sp=True, weights="meta"),
    Case("qwen2-dp2-zero3", "qwen2", dp=2, zero=3),
    Case("hand-tp2-sp", "hand", tp=2, sp=True),
    Case("llama-tp2-sequence-loss", "llama", tp=2, sp=True, assignment="sequence-loss"),
    Case("qwen2-tp2-replicated", "qwen2", tp=2, assignment="replicate"),
    Case("llama-dp2tp2-sp", "llama", dp=2, tp=2, sp=True, weights="meta"),
    Case("qwen2-dp2tp2-zero3", "qwen2", dp=2, tp=2, zero=3),
    Case("hand-dp2tp2-zero1", "hand", dp=2, tp=2, zero=1),
    # ZeRO 1 / 2: the distributed optimizer of runtime.grad_sync (sp: Partial gradients settled first)
    Case("llama-dp2-zero1", "llama", dp=2, zero=1, microbatches=2),
    Case("qwen2-dp2tp2-sp-zero2", "qwen2", dp=2, tp=2, sp=True, zero=2),
    # row-parallel slices read from the checkpoint are strided: FSDP2 must get them contiguous
    Case("llama-dp2tp2-zero1-meta", "llama", dp=2, tp=2, zero=1, weights="meta"),
    Case("gpt2-dp2", "gpt2", dp=2, microbatches=2),
    Case("gpt2-tp2", "gpt2", tp=2, assignment="tied-head"),
    Case("gpt2-dp2-zero3-meta", "gpt2", dp=2, zero=3, weights="meta"),
    Case("gpt2-dp2tp2-zero3", "gpt2", dp=2, tp=2, zero=3, assignment="tied-head", weights="meta"),
    # recompute: each mirrors a case above (BASES) but for its policy, so its activation bytes compare
    Case("llama-dp2-full", "llama", dp=2, microbatches=2, recompute="full"),
    Case("qwen2-tp2-sp-selective", "qwen2", tp=2, sp=True, weights="meta", recompute="selective"),
    Case("hand-tp2-sp-full:1", "hand", tp=2, sp=True, recompute="full:1"),
    Case("llama-tp2-matmul-only", "llama", tp=2, recompute="matmul-only"),
    Case("qwen2-dp2tp2-zero3-selective", "qwen2", dp=2, tp=2, zero=3, recompute="selective"),
    Case("gpt2-dp2-selective", "gpt2", dp=2, microbatches=2, recompute="selective"),
    # pipelines: stages cut at block boundaries (runtime.module_pipeline)
    Case("llama-pp2", "llama", pp=2, microbatches=2, weights="meta"),
    Case("llama-pp2dp2-zero1", "llama", pp=2, dp=2, zero=1, microbatches=2),
    Case("llama-pp2tp2-sp", "llama", pp=2, tp=2, sp=True, microbatches=2, schedule="gpipe"),
    Case("qwen2-pp2-interleaved", "qwen2", pp=2, microbatches=2, schedule="interleaved-1f1b",
         stage_layers=(0, 1, 1, 0)),
    Case("qwen2-pp2dp2-interleaved-zero1", "qwen2", pp=2, dp=2, zero=1, microbatches=2,
         schedule="interleaved-1f1b", stage_layers=(0, 1, 1, 0)),
    Case("hand-pp2", "hand", pp=2, microbatches=4),
    Case("hand-pp2dp2", "hand", pp=2, dp=2, microbatches=2),
    Case("hand-pp2tp2", "hand", pp=2, tp=2, microbatches=2),
    # recompute on the blocks a pipeline rank holds, by the model's layer indices
    Case("llama-pp2-full", "llama", pp=2, microbatches=2, recompute="full"),
    Case("qwen2-pp2tp2-selective", "qwen2", pp=2, tp=2, microbatches=2, recompute="selective"),
]
# What a plain (no recompute) run keeps for backward beyond the cost model's price, measured op by op:
UNPRICED = {
    "qwen2-tp2-sp-selective": "the whole-sequence copies DTensor's S(1) -> R all-gathers make for the "
                              "column projections (aten.cat), priced as sequence shards",
    "hand-tp2-sp-full:1": "the same all-gathered copies as qwen2-tp2-sp",
    "gpt2-dp2-selective": "the intermediates of GPT-2's tanh GELU (gelu_new: pow, mul, add, tanh), priced "
                          "as one GELU",
}
BASES = {"llama-dp2-full": "llama-dp2", "qwen2-tp2-sp-selective": "qwen2-tp2-sp",
         "hand-tp2-sp-full:1": "hand-tp2-sp", "llama-tp2-matmul-only": "llama-tp2",
         "gpt2-dp2-selective": "gpt2-dp2"}
EXPORTED = ("llama-dp2tp2-sp", "qwen2-dp2tp2-zero3", "gpt2-dp2tp2-zero3", "llama-pp2dp2-zero1")


def _hf_configs() -> dict:
    common = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, vocab_size=256, max_position_embeddings=64,
                  tie_word_embeddings=False)
    gpt2 = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=64,
                                   resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, summary_first_dropout=0.0,
                                   bos_token_id=0, eos_token_id=0)  # tied wte / lm_head, Conv1D weights (in, out)
    return {"llama": transformers.LlamaConfig(**common), "qwen2": transformers.Qwen2Config(**common), "gpt2": gpt2}


def _hand_model(device: str = "cpu") -> HandLM:
    torch.manual_seed(SEED)
    with torch.device(device):
        return HandLM()


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


# ------------------------------------------------------------------------------- in the ranks


def _build(case: Case, dirs: dict):
    if case.model == "hand":
        return _hand_model(), None
    if case.weights == "meta":
        config = transformers.AutoConfig.from_pretrained(dirs[case.model])
        with torch.device("meta"):
            return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa"), dirs[case.model]
    return transformers.AutoModelForCausalLM.from_pretrained(dirs[case.model], attn_implementation="sdpa"), None


def _local_numel(program) -> int:
    return sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in program.model.parameters())


def _train(program, tokens: torch.Tensor, keep: bool) -> dict:
    optimizer = program.make_optimizer(torch.optim.AdamW, lr=LR, eps=EPS)
    losses, grads = [], None
    for step in range(STEPS):
        targets = tokens[step].roll(-1, dims=1)
        targets[:, -1] = -100  # transformers' loss: T - 1 targets per row
        losses.append(program.train_step(tokens[step], targets, optimizer))
        if step == 0:
            grads, norm = program.full_gradients(), program.grad_norm
    params = program.full_parameters()
    return {"losses": losses, "grads": grads if keep else None, "params": params if keep else None,
            "grad_norm": norm}


def _activations(program, tokens: torch.Tensor) -> dict:
    """What one microbatch's forward leaves for backward on this rank (runtime.memory_probe), and the
    save / recompute decisions of the recomputed blocks, as {"family:saved": ops}. Its gradients are
    dropped by the first train_step (zero_grad)."""
    from autoplan.runtime.memory_probe import measure_saved_bytes
    from autoplan.runtime.recompute import observe_recompute

    rows = program._rows(tokens)[:program.plan.microbatch_size]
    targets = rows.roll(-1, dims=1)
    targets[:, -1] = -100
    with program._loss_context(), observe_recompute() as decisions:
        _, measured = measure_saved_bytes(lambda: program._token_loss_sum(rows, targets), program.model)
    return {"saved_bytes": measured.saved_bytes,
            "decisions": {f"{family}:{saved}": n for (family, saved), n in decisions.items()}}


def _held_layers(program) -> dict:
    """The layers whose blocks this rank holds, and the paths of other stages' stand-ins whose forward
    was replaced (none may be: a stand-in is never a recomputed region)."""
    if program.plan.mesh.pp == 1:
        return {"held_layers": tuple(range(program.plan.model.num_layers)), "wrapped_stand_ins": []}
    blocks = program.cut.held_blocks()
    return {"held_layers": tuple(i for i, b in enumerate(blocks) if b is not None),
            "wrapped_stand_ins": [p.path for p, b in zip(program.cut.blocks, blocks)
                                  if b is None and "forward" in vars(p.module)]}


def _trained_decisions(program, tokens: torch.Tensor, keep: bool) -> dict:
    """`_train`, counting the save / recompute decisions of the recomputed blocks over its steps."""
    from autoplan.runtime.recompute import observe_recompute

    with observe_recompute() as decisions:
        found = _train(program, tokens, keep)
    return found | {"decisions": {f"{family}:{saved}": n for (family, saved), n in decisions.items()}}


def _evaluate(program, tokens: torch.Tensor) -> dict:
    """This rank's logits, all logits, and the loss of the gathered logits on new tokens; with a
    pipeline, forward's refusal and eval_loss alone."""
    targets = tokens.roll(-1, dims=1)
    targets[:, -1] = -100
    if program.plan.mesh.pp > 1:
        try:
            program.forward(tokens)
            refused = ""
        except PlanError as exc:
            refused = str(exc)
        loss = program.eval_loss(tokens, targets)
        return {"refused": refused, "after": loss, "eval": loss}
    local = program.forward(tokens)
    logits = program.forward(tokens, gather=True)
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten()).item()
    return {"local_shape": tuple(local.shape), "gathered_shape": tuple(logits.shape), "after": loss,
            "eval": program.eval_loss(tokens, targets)}


def _run_case(rank: int, case: Case, plan, setup_: dict) -> dict:
    import autoplan
    from autoplan.runtime.hf_export import save_hf

    reads: list[int] = []
    count_checkpoint_reads(reads)
    model, checkpoint = _build(case, setup_["dirs"])
    if case.name == "llama-tp2":  # the checkpoint directory itself as the model
        model, checkpoint = str(setup_["dirs"]["llama"]), None
    program = autoplan.parallelize(model, f"1x{case.world}xcpu", plan, checkpoint=checkpoint)
    held = _local_numel(program)
    found = {"reads": sum(reads), "held": held, "table": str(program.module_plan),
             "recomputed": program.recomputed_layers} | _held_layers(program)
    if case.pp > 1 and case.recompute != "none":  # no single-microbatch forward: the decisions of training
        found |= _trained_decisions(program, setup_["tokens"], keep=rank == 0)
    else:
        if case.name in BASES or case.name in BASES.values() or case.recompute != "none":
            found |= _activations(program, setup_["tokens"][0])
        found |= _train(program, setup_["tokens"], keep=rank == 0)
    found |= _evaluate(program, setup_["tokens"][STEPS])
    if case.name in EXPORTED:
        save_hf(program, setup_["root"] / f"export-{case.name}")
        save_hf(program, setup_["root"] / f"export-{case.name}")  # replaces its own earlier export
    return found


def _refused_export(rank: int, setup_: dict) -> str:
    from autoplan.errors import ConfigError
    from autoplan.runtime.hf_export import save_hf
    from autoplan.runtime.module_launch import parallelize_module_program

    case = Case("llama-dp2-export", "llama", dp=2)
    program = parallelize_module_program(_build(case, setup_["dirs"])[0], setup_["plans"]["llama-dp2"])
    try:
        save_hf(program, setup_["root"] / "users-dir")
    except ConfigError as exc:
        return str(exc)
    return ""


def _diverged(rank: int, setup_: dict) -> dict:
    """A NaN in rank 1's lm_head (dp2, ZeRO 0): every rank refuses the step; no update taken."""
    from autoplan.errors import TrainingDivergedError
    from autoplan.runtime.module_launch import parallelize_module_program

    case = Case("llama-dp2-nan", "llama", dp=2)
    program = parallelize_module_program(_build(case, setup_["dirs"])[0], setup_["plans"]["llama-dp2"])
    optimizer = program.make_optimizer(torch.optim.AdamW, lr=LR, eps=EPS)
    if rank == 1:
        with torch.no_grad():
            program.model.lm_head.weight[0, 0] = float("nan")
    before = program.model.model.embed_tokens.weight.detach().clone()
    tokens = setup_["tokens"][0]
    try:
        program.train_step(tokens, tokens.roll(-1, dims=1), optimizer)
    except TrainingDivergedError as exc:
        same = torch.equal(before, program.model.model.embed_tokens.weight.detach())
        return {"error": str(exc), "parameter": exc.parameter, "unchanged": same}
    return {"error": ""}


def _unplanned(rank: int, setup_: dict) -> list[float]:
    import autoplan

    model = transformers.AutoModelForCausalLM.from_pretrained(setup_["dirs"]["llama"], attn_implementation="sdpa")
    program = autoplan.parallelize(model, "1x2xcpu", global_batch=B, seq_len=T)
    return _train(program, setup_["tokens"], keep=False)["losses"]


def _ranks(rank: int, world: int, names: list[str], setup_: dict) -> dict:
    warnings.simplefilter("ignore")
    cases = {c.name: c for c in CASES}
    found = {name: _run_case(rank, cases[name], setup_["plans"][name], setup_) for name in names}
    if world == 2:
        found["refused"] = _refused_export(rank, setup_)
        found["diverged"] = _diverged(rank, setup_)
        found["unplanned"] = _unplanned(rank, setup_)
    return found


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
