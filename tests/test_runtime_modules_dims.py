"""Each parallel dimension alone, for every model family of the runtime for your own module, against
transformers in one process: the cases the other module suites (test_runtime_modules, _cp, _moe) leave
out, so that every family has dp, ZeRO 1 / 2 / 3, tp, tp + sp, pp and cp (and ep for a MoE) alone.

    GPT-2      ZeRO 1, ZeRO 2; tp + sp (the tied embedding and head vocab-parallel, its attention
               replicated); cp (its learned positions read at each cp rank's global position ids),
               and cp with ZeRO 3;
               pp refused: its embedding is tied to the head (the message says what to change)
    Llama      ZeRO 2; cp with ZeRO 1 (the distributed optimizer over the dp x cp ranks)
    Qwen2      ZeRO 1, ZeRO 2; cp with ZeRO 2
    Mixtral    dp, ZeRO 1, ZeRO 2, ZeRO 3, tp, tp + sp (attention Megatron-split, the MoE block a
               replicated region), pp, cp (experts whole on every rank)
    MhaLM      a hand-written transformer on torch's nn.MultiheadAttention (tests/_handmade.py: its
               fused in_proj_weight, blocks in a list called `decoder`): dp, ZeRO 3, tp (the MLP
               split, each nn.MultiheadAttention a replicated region), pp; its loss is its own
    HandLM     the hand-written nn.Linear + SDPA transformer (blocks in `stack`): dp with ZeRO 2 (its tp,
               sp, pp and their combinations: test_runtime_modules)

Tiny configs built locally, saved with save_pretrained into a temporary directory (no download). Each
case trains 3 AdamW steps from the checkpoint's weights on 2 gloo ranks (one spawn runs all of them)
and compares with transformers in one process: the first loss is transformers' own on the same weights,
every loss within 1e-5 (relative), the first step's gradients and the final parameters within 1e-5,
the gradient norm and the loss of new tokens (`eval_loss`) after the steps.
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

from _dist import spawn
from _handmade import HandLM, MhaLM
from _hf_checkpoints import adamw_reference, assert_matches_reference, gpt2_tied_head, save_and_capture
from autoplan.errors import PlanError

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.gloo

B, T, STEPS, LR, SEED = 4, 16, 3, 1e-3, 0
EPS = 1e-6  # AdamW's eps above the noise of gradients that are zero in exact arithmetic (test_runtime_modules)
TOL = dict(rtol=1e-5, atol=1e-5)
HANDMADE = {"mha": MhaLM, "hand": HandLM}  # hand-written models (tests/_handmade.py), their loss their own


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    model: str  # "gpt2" | "llama" | "qwen2" | "mixtral" | "mha" | "hand" (HANDMADE)
    dp: int = 1
    tp: int = 1
    sp: bool = False
    pp: int = 1
    cp: int = 1
    zero: int = 0
    microbatches: int = 1
    weights: str = "module"  # "module": built with weights; "meta": loaded from the checkpoint

    @property
    def mesh(self):
        from autoplan.mesh import MeshShape

        return MeshShape(pp=self.pp, dp=self.dp, tp=self.tp, cp=self.cp)


CASES = [
    Case("gpt2-dp2-zero1", "gpt2", dp=2, zero=1),
    Case("gpt2-dp2-zero2", "gpt2", dp=2, zero=2, weights="meta"),
    Case("gpt2-tp2-sp", "gpt2", tp=2, sp=True),
    Case("gpt2-cp2", "gpt2", cp=2, weights="meta"),
    Case("gpt2-cp2-zero3", "gpt2", cp=2, zero=3),  # FSDP2 over the cp ranks holding the tied weight
    Case("llama-dp2-zero2", "llama", dp=2, zero=2),
    Case("llama-cp2-zero1", "llama", cp=2, zero=1, microbatches=2),
    Case("qwen2-dp2-zero1", "qwen2", dp=2, zero=1, weights="meta"),
    Case("qwen2-dp2-zero2", "qwen2", dp=2, zero=2),
    Case("qwen2-cp2-zero2", "qwen2", cp=2, zero=2, weights="meta"),
    Case("mixtral-dp2", "mixtral", dp=2),
    Case("mixtral-dp2-zero1", "mixtral", dp=2, zero=1, weights="meta"),
    Case("mixtral-dp2-zero2", "mixtral", dp=2, zero=2),
    Case("mixtral-dp2-zero3", "mixtral", dp=2, zero=3, weights="meta"),
    Case("mixtral-tp2", "mixtral", tp=2),
    Case("mixtral-tp2-sp", "mixtral", tp=2, sp=True, weights="meta"),
    Case("mixtral-pp2", "mixtral", pp=2, microbatches=2),
    Case("mixtral-cp2", "mixtral", cp=2, weights="meta"),
    Case("mha-dp2", "mha", dp=2),
    Case("mha-dp2-zero3", "mha", dp=2, zero=3),
    Case("mha-tp2", "mha", tp=2),
    Case("mha-pp2", "mha", pp=2, microbatches=2),
    Case("hand-dp2-zero2", "hand", dp=2, zero=2),
    Case("mha-searched", "mha"),  # the plan search_module_plans picks on 2 CPU ranks (SEARCHED)
]
SEARCHED = "mha-searched"


def _configs() -> dict:
    common = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, vocab_size=256, max_position_embeddings=64, tie_word_embeddings=False)
    gpt2 = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=64,
                                   resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, summary_first_dropout=0.0,
                                   bos_token_id=0, eos_token_id=0)  # tied wte / lm_head, Conv1D weights (in, out)
    mixtral = transformers.MixtralConfig(**common | dict(hidden_size=32, intermediate_size=48), num_local_experts=4,
                                         num_experts_per_tok=2)
    return {"gpt2": gpt2, "llama": transformers.LlamaConfig(**common), "qwen2": transformers.Qwen2Config(**common),
            "mixtral": mixtral}


def _loss(model, tokens: torch.Tensor) -> torch.Tensor:
    if isinstance(model, (MhaLM, HandLM)):
        return model(tokens, labels=tokens)
    return model(input_ids=tokens, labels=tokens).loss


def _reference(model, tokens: torch.Tensor) -> dict:
    """One process: the model's own loss (transformers' for its models), 3 AdamW steps; then the loss of
    new tokens."""
    ref = adamw_reference(model, tokens, STEPS, LR, EPS, _loss)
    with torch.no_grad():
        return ref | {"after": _loss(model, tokens[STEPS]).item()}


def _hand_model(name: str, device: str = "cpu"):
    torch.manual_seed(SEED)
    with torch.device(device):
        return HANDMADE[name]()


def _plan(case: Case, graph, summary):
    from autoplan.api import plan_from_assignment, search_module_plans
    from autoplan.capture.hf_rules import hf_registry
    from autoplan.cluster import parse_cluster
    from autoplan.solver.intra_op import megatron_assignment
    from autoplan.strategies import strategy_info

    if case.name == SEARCHED:  # planned as a transformers model is, from the module and its summary
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return search_module_plans(_hand_model(case.model, "meta"), "1x2xcpu", B, T, config=summary,
                                       dtype="float32", baselines=False).plans[0]
    registry, info = hf_registry(), strategy_info(summary.rule_info(), case.tp, case.tp)
    assignment = {}
    if case.tp > 1 and case.model == "gpt2":
        assignment = gpt2_tied_head(graph, registry, case.tp, info, case.sp)
    elif case.tp > 1:  # a MoE block replicated on tp (the module runtime splits experts over ep only)
        assignment = megatron_assignment(graph, registry, case.tp, info, case.sp)
        assignment |= {n.name: "replicate" for n in graph.nodes if n.op_kind == "moe"}
    rows = B // (case.dp * case.microbatches)
    return plan_from_assignment(graph, summary, parse_cluster(f"1x{case.mesh.world_size}xcpu"), case.mesh,
                                assignment, rows, case.microbatches, case.zero, "none", registry=registry,
                                dtype="float32")


def make_setup(root, names: list[str]) -> dict:
    """The checkpoints, tokens, one-process references, graphs and plans of the cases `names`."""
    from autoplan.capture.hf import capture_hf
    from autoplan.models.config import ModelConfig

    cases = [c for c in CASES if c.name in names]
    tokens = torch.randint(0, 128, (STEPS + 1, B, T), generator=torch.Generator().manual_seed(SEED))
    configs = {name: config for name, config in _configs().items() if any(c.model == name for c in cases)}
    dirs, refs, graphs = save_and_capture(configs, root, tokens, _reference, T, SEED)
    for name in {c.model for c in cases} & set(HANDMADE):
        refs[name] = _reference(_hand_model(name), tokens)
        with warnings.catch_warnings():  # capture's note on its replicated ops (the attention, masks)
            warnings.simplefilter("ignore")
            graphs[name] = (capture_hf(_hand_model(name, "meta"), 1, T, torch.float32),
                            ModelConfig(f"{name}-lm", "gpt", 2, 32, 4, 4, 128, 128, 64))
    plans = {c.name: _plan(c, *graphs[c.model]) for c in cases}
    return {"dirs": dirs, "tokens": tokens, "refs": refs, "plans": plans, "graphs": graphs}


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict:
    return make_setup(tmp_path_factory.mktemp("modules-dims"), [c.name for c in CASES])


# ------------------------------------------------------------------------------- in the ranks


def _build(case: Case, dirs: dict):
    if case.model in HANDMADE:
        return _hand_model(case.model), None
    if case.weights == "meta":
        config = transformers.AutoConfig.from_pretrained(dirs[case.model])
        with torch.device("meta"):
            return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa"), dirs[case.model]
    return transformers.AutoModelForCausalLM.from_pretrained(dirs[case.model], attn_implementation="sdpa"), None


def _run_case(rank: int, case: Case, plan, setup_: dict) -> dict:
    import autoplan

    model, checkpoint = _build(case, setup_["dirs"])
    program = autoplan.parallelize(model, f"1x{plan.mesh.world_size}xcpu", plan, checkpoint=checkpoint)
    optimizer = program.make_optimizer(torch.optim.AdamW, lr=LR, eps=EPS)
    tokens, losses = setup_["tokens"], []
    for step in range(STEPS + 1):
        targets = tokens[step].roll(-1, dims=1)
        targets[:, -1] = -100  # transformers' loss: T - 1 targets per row
        if step == STEPS:
            params = program.full_parameters()  # a collective: on every rank
            return {"losses": losses, "grads": grads if rank == 0 else None, "grad_norm": norm,
                    "params": params if rank == 0 else None, "eval": program.eval_loss(tokens[step], targets)}
        losses.append(program.train_step(tokens[step], targets, optimizer))
        if step == 0:
            grads, norm = program.full_gradients(), program.grad_norm


def _ranks(rank: int, world: int, names: list[str], setup_: dict) -> dict:
    warnings.simplefilter("ignore")
    cases = {c.name: c for c in CASES}
    return {name: _run_case(rank, cases[name], setup_["plans"][name], setup_) for name in names}


@pytest.fixture(scope="module")
def runs(setup) -> list[dict]:
    """Every case's results on each rank (all cases run on 2 ranks): [rank 0's dict, rank 1's]."""
    assert {p.mesh.world_size for p in setup["plans"].values()} == {2}
    shared = {k: setup[k] for k in ("dirs", "tokens", "plans")}
    return spawn(_ranks, 2, [c.name for c in CASES], shared)


# ------------------------------------------------------------------------------- checks


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_matches_transformers_in_one_process(setup, runs, case):
    assert_matches_reference([r[case.name] for r in runs], setup["refs"][case.model], TOL)


def test_gpt2_under_a_pipeline_is_refused_saying_what_to_change(setup):
    """GPT-2's wte and lm_head are one tensor; pipeline stages hold their own modules."""
    from autoplan.runtime.module_launch import check_module_plan

    plan = _plan(Case("gpt2-pp2", "gpt2", pp=2, microbatches=2), *setup["graphs"]["gpt2"])
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(_configs()["gpt2"])
    with pytest.raises(PlanError, match=r"'transformer.wte.weight' \(stage 0\) and 'lm_head.weight' \(stage 1\) "
                                        r"are tied.*untie them \(transformers: tie_word_embeddings=False\) or plan pp=1"):
        check_module_plan(plan, model)


def test_multihead_attention_is_priced_and_runs_replicated(setup):
    """nn.MultiheadAttention: its SDPA, captured inside the module's own forward, is priced as attention
    (4 B T^2 h forward) though no sharding rule splits it; under tp the module is one replicated region,
    and a plan that splits one of its ops is refused naming the module and what to plan."""
    from autoplan.runtime.module_launch import check_module_plan

    graph, _ = setup["graphs"]["mha"]
    cores = [n for n in graph.nodes if n.target == "scaled_dot_product_attention"]
    assert [n.module_path for n in cores] == ["decoder.0.attn", "decoder.1.attn"]
    assert all(n.fwd_flops == 4 * 1 * T * T * 32 and n.bwd_flops == 2 * n.fwd_flops for n in cores)
    plan, model = setup["plans"]["mha-tp2"], _hand_model("mha", "meta")
    assert check_module_plan(plan, model).style("decoder.0.attn").kind == "replicated_region"
    ops = tuple(dataclasses.replace(o, strategy="column") if o.module == "decoder.1.attn" and o.resolved.params
                else o for o in plan.ops)
    with pytest.raises(PlanError, match=r"module 'decoder.1.attn' \(nn.MultiheadAttention\).*fused in_proj_weight"
                                        r".*plan 'replicate' for the ops of 'decoder.1.attn', or tp=1"):
        check_module_plan(dataclasses.replace(plan, ops=ops), model)


def test_a_hand_written_module_is_searched_like_a_transformers_model(setup):
    """search_module_plans (and autoplan.search) on the nn.MultiheadAttention model and its ModelConfig: the plan runs
    (test_matches_transformers_in_one_process[mha-searched]), says what was searched and, under tp,
    names the attention it leaves replicated with its share of the FLOPs; without the
    ModelConfig, a PlanError says what to pass."""
    import autoplan
    from autoplan.api import MODULE_SPACE_NOTE, search_module_plans

    plan = setup["plans"][SEARCHED]
    assert plan.mesh.world_size == 2 and plan.provenance.notes[-1] == MODULE_SPACE_NOTE
    if plan.mesh.tp > 1:  # the attention priced and named where it stays replicated
        assert any("no sharding rule" in n and "2 x other scaled_dot_product_attention" in n
                   for n in plan.provenance.notes)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        searched = autoplan.search(_hand_model("mha", "meta"), "1x2xcpu", B, T, config=setup["graphs"]["mha"][1])
    assert searched.mesh == plan.mesh  # autoplan.search takes the module too
    with pytest.raises(PlanError, match=r"planning MhaLM, a module without a transformers config, needs "
                                        r"config=ModelConfig\(.*\) describing it \(config=None\); or pass a plan"):
        search_module_plans(_hand_model("mha", "meta"), "1x2xcpu", B, T, dtype="float32")
