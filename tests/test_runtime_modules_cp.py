"""Context parallelism in the runtime for the user's own module (runtime.module_context), against
transformers in one process.

Tiny Llama (GQA: 4 heads, 2 kv heads), Qwen2 (q/k/v biases) and Mixtral configs, built locally and saved with
save_pretrained into a temporary directory. Each configuration below trains 3 AdamW steps from the
same weights as the one-process reference, whose loss is transformers' own
(`model(input_ids, labels=input_ids).loss`), and compares the losses (relative 1e-5), the first
step's gradients and the final parameters (1e-5). Each cp rank holds T/cp tokens of every sequence
and its targets, with its global position ids; around each attention core the Ulysses all-to-alls.

    cp2            alone (two microbatches); with recompute (the all-to-alls re-run in backward)
    cp2 x dp2      with ZeRO 3 (FSDP2 over dp x cp)
    cp2 x tp2      with sequence parallelism: one kv head per tp rank, repeated to 2 for the cp group
    pp2 x cp2      pipeline stages, each with its positions
    ep2 x cp2      Mixtral: experts over ep (their gradients summed over cp), attention over cp
    all-to-alls    on the cp group in the second step of each case: 4 per layer and microbatch
                   forward (q, k, v, the output) and 4 backward, of the sizes the cost model prices (cost_model.step:
                   q_width and max(kv_width, cp head_dim) per tp rank)
    forward        program.forward(gather=True) gives the whole logits of the new tokens
    export         save_hf of a cp x dp ZeRO 3 program loads back into transformers (its config
                   names transformers' own attention, not this program's)
Pure checks: a hand-written module and a sliding window shorter than the sequence are refused with
the module named; a cp plan of a Llama passes the checks.
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

from _dist import spawn
from _handmade import HandLM
from _hf_checkpoints import adamw_reference, assert_matches_reference, save_and_capture
from autoplan.errors import PlanError

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.gloo

B, T, STEPS, LR, SEED, LAYERS = 4, 16, 3, 1e-3, 0, 2
HEAD_DIMS = {"llama": 16, "qwen2": 16, "mixtral": 8}  # hidden / 4 heads (_hf_configs)
EPS = 1e-6  # AdamW's eps above the noise of gradients that are zero in exact arithmetic (test_runtime_modules)
TOL = dict(rtol=1e-5, atol=1e-5)


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    model: str  # "llama" | "qwen2" | "mixtral"
    cp: int = 2
    dp: int = 1
    ep: int = 1
    tp: int = 1
    pp: int = 1
    sp: bool = False
    zero: int = 0
    microbatches: int = 1
    weights: str = "module"  # "module": built with weights; "meta": loaded from the checkpoint
    recompute: str = "none"

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.ep * self.tp * self.cp


CASES = [
    Case("llama-cp2", "llama", microbatches=2),
    Case("qwen2-cp2", "qwen2", weights="meta"),
    Case("llama-cp2-full", "llama", recompute="full"),
    Case("llama-cp2dp2-zero3", "llama", dp=2, zero=3, weights="meta"),
    Case("llama-cp2tp2-sp", "llama", tp=2, sp=True),
    Case("llama-pp2cp2", "llama", pp=2, microbatches=2, weights="meta"),
    Case("mixtral-ep2cp2", "mixtral", ep=2),
]
EXPORTED = "llama-cp2dp2-zero3"


def _hf_configs() -> dict:
    common = dict(num_hidden_layers=LAYERS, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, vocab_size=256, max_position_embeddings=64, tie_word_embeddings=False)
    mixtral = transformers.MixtralConfig(**common | dict(hidden_size=32, intermediate_size=48), num_local_experts=4,
                                         num_experts_per_tok=2)
    return {"llama": transformers.LlamaConfig(**common), "qwen2": transformers.Qwen2Config(**common), "mixtral": mixtral}


def _reference(model, tokens: torch.Tensor) -> dict:
    """One process: transformers' loss, 3 AdamW steps; then the logits and loss of new tokens."""
    ref = adamw_reference(model, tokens, STEPS, LR, EPS)
    with torch.no_grad():
        out = model(input_ids=tokens[STEPS], labels=tokens[STEPS])
    return ref | {"after": out.loss.item(), "logits": out.logits}


def _plan(case: Case, graph, summary, world: int | None = None):
    from autoplan.api import plan_from_assignment
    from autoplan.capture.hf_rules import hf_registry
    from autoplan.cluster import parse_cluster
    from autoplan.mesh import MeshShape
    from autoplan.solver.intra_op import megatron_assignment
    from autoplan.strategies import strategy_info

    registry, info = hf_registry(), strategy_info(summary.rule_info(), case.tp, case.tp)
    assignment = megatron_assignment(graph, registry, case.tp, info, case.sp) if case.tp > 1 else {}
    mesh = MeshShape(pp=case.pp, dp=case.dp, ep=case.ep, tp=case.tp, cp=case.cp)
    batch = (B // (case.dp * case.ep * case.microbatches), case.microbatches, case.zero, case.recompute)
    return plan_from_assignment(graph, summary, parse_cluster(f"1x{world or case.world}xcpu"), mesh, assignment,
                                *batch, registry=registry, dtype="float32")


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("modules-cp")
    tokens = torch.randint(0, 128, (STEPS + 1, B, T), generator=torch.Generator().manual_seed(SEED))
    dirs, refs, graphs = save_and_capture(_hf_configs(), root, tokens, _reference, T, SEED)
    plans = {c.name: _plan(c, *graphs[c.model]) for c in CASES}
    return {"root": root, "dirs": dirs, "tokens": tokens, "refs": refs, "plans": plans, "graphs": graphs}


# ------------------------------------------------------------------------------- in the ranks


def _build(case: Case, dirs: dict):
    if case.weights == "meta":
        config = transformers.AutoConfig.from_pretrained(dirs[case.model])
        with torch.device("meta"):
            return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa"), dirs[case.model]
    return transformers.AutoModelForCausalLM.from_pretrained(dirs[case.model], attn_implementation="sdpa"), None


class _AllToAlls:
    """Records the element count of every all_to_all_single this rank issues on `group` while open."""

    def __init__(self, group) -> None:
        self.group = group

    def __enter__(self):
        import torch.distributed as dist

        self.sizes, self._original = [], dist.all_to_all_single

        def recording(output, input, *args, **kwargs):
            if kwargs.get("group") is self.group:
                self.sizes.append(input.numel())
            return self._original(output, input, *args, **kwargs)
        dist.all_to_all_single = recording
        return self

    def __exit__(self, *exc):
        import torch.distributed as dist

        dist.all_to_all_single = self._original


def _train(program, tokens: torch.Tensor, keep: bool) -> dict:
    optimizer = program.make_optimizer(torch.optim.AdamW, lr=LR, eps=EPS)
    losses, grads, sizes = [], None, []
    for step in range(STEPS):
        targets = tokens[step].roll(-1, dims=1)
        targets[:, -1] = -100  # transformers' loss: T - 1 targets per row
        with _AllToAlls(program.context.group.group) as seen:
            losses.append(program.train_step(tokens[step], targets, optimizer))
        if step == 0:
            grads, norm = program.full_gradients(), program.grad_norm
        if step == 1:  # the first step also runs a pipeline stage's shape inference
            sizes = seen.sizes
    params = program.full_parameters()  # a collective: on every rank
    return {"losses": losses, "grads": grads if keep else None, "grad_norm": norm, "all_to_alls": sizes,
            "params": params if keep else None}


def _evaluate(program, tokens: torch.Tensor) -> dict:
    targets = tokens.roll(-1, dims=1)
    targets[:, -1] = -100
    found = {"eval": program.eval_loss(tokens, targets)}
    if program.plan.mesh.pp == 1:
        found["logits"] = program.forward(tokens, gather=True)
    return found


def _ranks(rank: int, world: int, names: list[str], setup_: dict) -> dict:
    import autoplan

    warnings.simplefilter("ignore")
    cases, found = {c.name: c for c in CASES}, {}
    for name in names:
        model, checkpoint = _build(cases[name], setup_["dirs"])
        program = autoplan.parallelize(model, f"1x{world}xcpu", setup_["plans"][name], checkpoint=checkpoint)
        found[name] = _train(program, setup_["tokens"], keep=rank == 0) | _evaluate(program, setup_["tokens"][STEPS])
        if name == EXPORTED:
            from autoplan.runtime.hf_export import save_hf

            save_hf(program, setup_["root"] / f"export-{name}")
    return found


@pytest.fixture(scope="module")
def runs(setup) -> dict:
    """Every case's results on each rank: {world: [rank 0's dict, rank 1's, ...]}."""
    shared = {k: setup[k] for k in ("root", "dirs", "tokens", "plans")}
    return {world: spawn(_ranks, world, [c.name for c in CASES if c.world == world], shared) for world in (2, 4)}


# ------------------------------------------------------------------------------- checks


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_matches_transformers_in_one_process(setup, runs, case):
    assert_matches_reference([r[case.name] for r in runs[case.world]], setup["refs"][case.model], TOL)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_all_to_alls_are_the_priced_ones(runs, case):
    """Per layer and microbatch: q and the output at q_width, k and v at the priced kv width
    (`validity.ulysses_kv_heads`, which cost_model.step prices: kv heads repeated until cp divides
    them), forward and backward, each rank sending its (B / microbatches, T / cp) tokens. A recomputed layer
    runs its forward's four again in backward, as the step model prices it (tests/test_search.py)."""
    from autoplan.validity import ulysses_kv_heads

    rows = B // (case.dp * case.ep * case.microbatches)
    head_dim = HEAD_DIMS[case.model]
    q_width = 4 // case.tp * head_dim
    kv_width = ulysses_kv_heads(4 // case.tp, 2 // case.tp, case.cp) * head_dim
    forwards = 2 if case.recompute == "full" else 1
    layers = LAYERS // case.pp
    one = sorted([rows * T // case.cp * w for w in (q_width, kv_width, kv_width, q_width)] * (forwards + 1))
    for ranks in runs[case.world]:
        assert sorted(ranks[case.name]["all_to_alls"]) == sorted(one * layers * case.microbatches)


@pytest.mark.parametrize("case", [c for c in CASES if c.pp == 1], ids=lambda c: c.name)
def test_forward_gathers_the_whole_logits(setup, runs, case):
    ref = setup["refs"][case.model]["logits"]
    for ranks in runs[case.world]:
        torch.testing.assert_close(ranks[case.name]["logits"], ref, **TOL)


def test_export_loads_back_into_transformers(setup, runs):
    model = transformers.AutoModelForCausalLM.from_pretrained(setup["root"] / f"export-{EXPORTED}")
    assert model.config._attn_implementation == "sdpa"
    got = runs[4][0][EXPORTED]
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), got["params"][n], rtol=0, atol=0)
    with torch.no_grad():
        loss = model(input_ids=setup["tokens"][STEPS], labels=setup["tokens"][STEPS]).loss.item()
    assert loss == pytest.approx(got["eval"], rel=1e-5)


def test_refuses_what_context_parallelism_does_not_run(setup):
    from autoplan.capture.hf import capture_hf
    from autoplan.models.config import ModelConfig
    from autoplan.runtime.module_launch import check_module_plan

    llama = setup["plans"]["llama-cp2"]
    with torch.device("meta"):
        check_module_plan(llama, transformers.AutoModelForCausalLM.from_config(_hf_configs()["llama"]))
        hand = HandLM()
    summary = ModelConfig("hand-lm", "gpt", 2, 32, 4, 4, 128, 128, 64)
    with warnings.catch_warnings():  # capture's note on its replicated ops (arange, pad)
        warnings.simplefilter("ignore")
        plan = _plan(Case("hand-cp2", "hand"), capture_hf(hand, 1, T, torch.float32), summary)
    with pytest.raises(PlanError, match=r"cp=2 on HandLM \(attention module 'stack.0.attn': Attention\).*"
                                        r"calls its attention itself. Plan cp=1"):
        check_module_plan(plan, hand)
    config = _hf_configs()["qwen2"]
    config.use_sliding_window, config.sliding_window = True, T // 2
    config.layer_types = ["sliding_attention"] * LAYERS
    with torch.device("meta"):
        windowed = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    with pytest.raises(PlanError, match=r"module 'model.layers.0.self_attn': a sliding window of 8 tokens, "
                                        r"shorter than the plan's sequence of 16.*plan cp=1"):
        check_module_plan(setup["plans"]["qwen2-cp2"], windowed)  # refused before the plan's fingerprint
    config = _hf_configs()["llama"]
    config.rope_parameters = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    with torch.device("meta"):
        dynamic = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    with pytest.raises(PlanError, match=r"module 'model.rotary_emb': rope_type 'dynamic' rescales .* plan cp=1"):
        check_module_plan(llama, dynamic)


def test_search_for_a_module_picks_context_parallelism_for_a_long_sequence():
    """One sequence of 32k tokens on 8 H100s: dp cannot split it, and the module runtime's search
    (module_search_options: cp searched) finds that Ulysses cp 8 is fastest; check_module_plan
    accepted the plans it returns."""
    from autoplan.api import module_search_options, search_module_plans

    assert not module_search_options().ep_over_cp  # the module runtime runs ep on data-parallel ranks
    config = transformers.LlamaConfig(num_hidden_layers=4, hidden_size=1024, num_attention_heads=16,
                                      num_key_value_heads=8, intermediate_size=2816, vocab_size=32000,
                                      max_position_embeddings=32768, tie_word_embeddings=False)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        found = search_module_plans(model, "1x8xh100", 1, 32768, top=1, dtype="bfloat16")
    assert found.plans[0].mesh.cp == 8 and "cp, ZeRO" in found.plans[0].provenance.notes[-1]
