"""Expert parallelism for transformers' MoE models in the runtime for your own module
(runtime.module_experts), against transformers in one process; and their plans against the zoo's.

Tiny Mixtral and Qwen2-MoE (shared experts) configs, built locally and saved with save_pretrained into
a temporary directory. Each case trains 3 AdamW steps from the same weights as the one-process
reference, whose loss is transformers' own (`model(input_ids, labels=input_ids).loss`; no router aux
loss: output_router_logits is off by default), and compares the losses (relative 1e-5), the first
step's gradients and the final parameters (1e-5), all gathered back under the model's own names.
Each ep rank holds E / ep experts (and, loading a meta model from the checkpoint, reads only them);
the exported checkpoint (`save_hf`) holds every expert again under the model's own names and loads
back into transformers. Under tp (Qwen2-MoE ep2 x tp2: attention and shared experts Megatron-split,
the router and routed experts replicated regions, the shared-expert gate replicated) as the plan says.

Planning (no processes): the transformers Mixtral 8x7B, captured at its real size, is planned as MoE:
ep divides the expert weights per rank, and it prices within 1% of the zoo's Mixtral of the same
shapes at ep 2 and 8 and at the best plan of the search.
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

from _dist import spawn
from _hf_checkpoints import adamw_reference, count_checkpoint_reads, save_and_capture

transformers = pytest.importorskip("transformers")

B, T, STEPS, LR, SEED = 4, 16, 3, 1e-3, 0
EPS = 1e-6  # as tests/test_runtime_modules.py: above the noise of gradients zero in exact arithmetic
TOL = dict(rtol=1e-5, atol=1e-5)


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    model: str  # "mixtral" | "qwen2_moe"
    ep: int = 2
    dp: int = 1
    tp: int = 1  # Megatron's assignment, the MoE replicated on tp (ep splits its experts)
    weights: str = "module"  # "module": built with weights; "meta": loaded from the checkpoint
    pp: int = 1  # pipeline stages (1F1B over `microbatches`), each rank distributing its stages' experts
    microbatches: int = 1

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.ep * self.tp


CASES = [
    Case("mixtral-ep2", "mixtral", weights="meta"),
    Case("qwen2_moe-ep2", "qwen2_moe"),
    Case("mixtral-ep2-dp2", "mixtral", dp=2),
    Case("qwen2_moe-ep2-tp2", "qwen2_moe", tp=2, weights="meta"),
    Case("mixtral-pp2-ep2", "mixtral", pp=2, microbatches=2, weights="meta"),
]

EXPORTED = ("mixtral-ep2-dp2", "qwen2_moe-ep2-tp2")


def _configs() -> dict:
    common = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                  vocab_size=128, max_position_embeddings=64, tie_word_embeddings=False, num_experts_per_tok=2)
    return {"mixtral": transformers.MixtralConfig(**common, intermediate_size=48, num_local_experts=4),
            "qwen2_moe": transformers.Qwen2MoeConfig(**common, intermediate_size=64, moe_intermediate_size=24,
                                                     shared_expert_intermediate_size=40, num_experts=4,
                                                     decoder_sparse_step=1)}


def _reference(model, tokens: torch.Tensor) -> dict:
    return adamw_reference(model, tokens, STEPS, LR, EPS)


def _plan(case: Case, graph, summary):
    from autoplan.api import plan_from_assignment
    from autoplan.capture.hf_rules import hf_registry
    from autoplan.cluster import parse_cluster
    from autoplan.mesh import MeshShape
    from autoplan.solver.intra_op import megatron_assignment
    from autoplan.strategies import strategy_info

    assignment = {}
    if case.tp > 1:
        info = strategy_info(summary.rule_info(), case.tp, case.tp)
        assignment = megatron_assignment(graph, hf_registry(), case.tp, info, False)
        assignment |= {n.name: "replicate" for n in graph.nodes if n.op_kind == "moe"}
    mesh = MeshShape(pp=case.pp, dp=case.dp, ep=case.ep, tp=case.tp)
    return plan_from_assignment(graph, summary, parse_cluster(f"1x{case.world}xcpu"), mesh, assignment,
                                B // (case.dp * case.ep * case.microbatches), case.microbatches, 0, "none",
                                registry=hf_registry(), dtype="float32")


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("moe")
    tokens = torch.randint(0, 128, (STEPS, B, T), generator=torch.Generator().manual_seed(SEED))
    dirs, refs, graphs = save_and_capture(_configs(), root, tokens, _reference, T, SEED)
    plans = {c.name: _plan(c, *graphs[c.model]) for c in CASES}
    return {"root": root, "dirs": dirs, "tokens": tokens, "refs": refs, "plans": plans, "graphs": graphs}


# ------------------------------------------------------------------------------- in the ranks


def _run_case(case: Case, plan, setup_: dict) -> dict:
    import autoplan
    from autoplan.runtime.hf_export import save_hf
    from autoplan.runtime import weights

    reads: list[int] = []
    original = count_checkpoint_reads(reads)
    directory = setup_["dirs"][case.model]
    if case.weights == "meta":
        config = transformers.AutoConfig.from_pretrained(directory)
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
        checkpoint = directory
    else:
        model, checkpoint = transformers.AutoModelForCausalLM.from_pretrained(directory, attn_implementation="sdpa"), None
    program = autoplan.parallelize(model, f"1x{case.world}xcpu", plan, checkpoint=checkpoint)
    weights.CheckpointFiles.read = original
    held = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in program.model.parameters())
    experts = {n: tuple(p.to_local().shape) for n, p in program.model.named_parameters() if n.endswith("down_proj")}
    optimizer = program.make_optimizer(torch.optim.AdamW, lr=LR, eps=EPS)
    losses, grads = [], None
    for step in range(STEPS):
        targets = setup_["tokens"][step].roll(-1, dims=1)
        targets[:, -1] = -100
        losses.append(program.train_step(setup_["tokens"][step], targets, optimizer))
        if step == 0:
            grads, norm = program.full_gradients(), program.grad_norm
    if case.name in EXPORTED:
        save_hf(program, setup_["root"] / f"export-{case.name}")
    return {"losses": losses, "grads": grads, "params": program.full_state_dict(), "reads": sum(reads),
            "held": held, "experts": experts, "grad_norm": norm}


def _ranks(rank: int, world: int, names: list[str], setup_: dict) -> dict:
    warnings.simplefilter("ignore")
    cases = {c.name: c for c in CASES}
    return {name: _run_case(cases[name], setup_["plans"][name], setup_) for name in names}


@pytest.fixture(scope="module")
def runs(setup) -> dict:
    found = {}
    shared = {k: setup[k] for k in ("root", "dirs", "tokens", "plans")}
    for world in sorted({c.world for c in CASES}):
        found[world] = spawn(_ranks, world, [c.name for c in CASES if c.world == world], shared)
    return found


# ------------------------------------------------------------------------------- checks


@pytest.mark.gloo
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_expert_parallel_matches_transformers(setup, runs, case):
    ref = setup["refs"][case.model]
    ranks = [r[case.name] for r in runs[case.world]]
    norm = torch.stack([g.double().square().sum() for g in ref["grads"].values()]).sum().sqrt().item()
    for got in ranks:
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=0)
        assert got["grad_norm"] == pytest.approx(norm, rel=1e-5)  # expert shards counted once each
    first = ranks[0]
    assert set(first["params"]) == set(ref["params"])
    for name in ref["params"]:
        torch.testing.assert_close(first["grads"][name], ref["grads"][name], **TOL, msg=lambda m: f"grad {name}: {m}")
        torch.testing.assert_close(first["params"][name], ref["params"][name], **TOL, msg=lambda m: f"param {name}: {m}")


@pytest.mark.gloo
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_each_ep_rank_holds_its_share_of_the_experts(setup, runs, case):
    ref = setup["refs"][case.model]["params"]
    for got in runs[case.world]:
        experts = got[case.name]["experts"]
        assert experts and all(shape[0] == ref[n].shape[0] // case.ep for n, shape in experts.items())
        if case.weights == "meta":
            assert got[case.name]["reads"] == got[case.name]["held"] < sum(p.numel() for p in ref.values())


@pytest.mark.gloo
@pytest.mark.parametrize("name", EXPORTED)
def test_export_gathers_the_experts_back_into_transformers(setup, runs, name):
    case = next(c for c in CASES if c.name == name)
    model = transformers.AutoModelForCausalLM.from_pretrained(setup["root"] / f"export-{name}")
    got = runs[case.world][0][name]["params"]
    assert {n for n, _ in model.named_parameters()} == set(got)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), got[n], rtol=0, atol=0)


def _meta_model(setup, name: str):
    config = transformers.AutoConfig.from_pretrained(setup["dirs"][name])
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


def test_module_plan_replicates_the_moe_block_on_tp(setup):
    from autoplan.runtime.module_launch import check_module_plan

    graph, summary = setup["graphs"]["mixtral"]
    mplan = check_module_plan(_plan(Case("x", "mixtral", tp=2), graph, summary), _meta_model(setup, "mixtral"))
    assert mplan.style("model.layers.0.mlp.gate").kind == "replicated_region"
    assert mplan.style("model.layers.0.mlp.experts").kind == "replicated_region"
    assert mplan.style("model.layers.0.self_attn.q_proj").kind == "colwise"


@pytest.mark.parametrize("change, words", [
    (dict(zero_stage=1), "ZeRO 1"),
    (dict(moe="ffn"), "replicated on tp"),
    (dict(experts=3), "does not divide"),
], ids=["zero-over-dp", "moe-split-on-tp", "experts-not-divisible"])
def test_plans_the_expert_runtime_refuses(setup, change, words):
    """What it does not run is refused before any process group, with what to change."""
    from autoplan.errors import PlanError
    from autoplan.runtime.module_launch import check_module_plan

    graph, summary = setup["graphs"]["mixtral"]
    case = Case("x", "mixtral", dp=2, tp=2 if "moe" in change else 1)
    plan = _plan(case, graph, summary)
    if "zero_stage" in change:
        plan = dataclasses.replace(plan, zero_stage=change["zero_stage"])
    if "moe" in change:
        ops = tuple(dataclasses.replace(o, strategy=change["moe"]) if o.node.startswith("model_layers_0_mlp")
                    and o.resolved.params else o for o in plan.ops)
        plan = dataclasses.replace(plan, ops=ops)
    model = _meta_model(setup, "mixtral")
    if "experts" in change:
        for layer in model.model.layers:
            experts = layer.mlp.experts
            experts.gate_up_proj = torch.nn.Parameter(experts.gate_up_proj[:3])
            experts.down_proj = torch.nn.Parameter(experts.down_proj[:3])
    with pytest.raises(PlanError, match=words):
        check_module_plan(plan, model)
