"""Pipeline stages of the user's own module (runtime.module_stages) without processes: where the cut
puts each module, the stages run one after another in one process giving the model's own logits
exactly (for stage layouts with an empty first or last stage too), and the forwards that cannot be
cut, refused naming the module. Plans come from the planner (`autoplan.api.estimate`)."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch

from _handmade import Block, HandLM

transformers = pytest.importorskip("transformers")

from autoplan.errors import ConfigError, PlanError  # noqa: E402
from autoplan.mesh import MeshShape  # noqa: E402
from autoplan.runtime.module_launch import check_module_plan  # noqa: E402
from autoplan.runtime.module_stages import StageOutput, cut_stages, run_model  # noqa: E402

T, LAYERS = 16, 3


def _llama(tie: bool = False):
    config = transformers.LlamaConfig(num_hidden_layers=LAYERS, hidden_size=64, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=128, vocab_size=256,
                                      max_position_embeddings=64, tie_word_embeddings=tie)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def _hand():
    torch.manual_seed(0)
    return HandLM(layers=LAYERS)


@functools.lru_cache(maxsize=None)
def _captured(kind: str):
    """(model summary, captured graph) of "hand", "llama" or "llama-tied", captured once."""
    from autoplan.capture.hf import capture_hf, capture_hf_for_planner
    from autoplan.models.config import ModelConfig

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if kind == "hand":
            return ModelConfig("hand-lm", "gpt", LAYERS, 32, 4, 4, 128, 128, 64), capture_hf(
                HandLM(layers=LAYERS).to("meta"), 1, T, torch.float32)
        summary, graph, _ = capture_hf_for_planner(_llama(tie=kind == "llama-tied").config, T, "float32")
        return summary, graph


def _plan(model, stage_layers: tuple[int, ...], zero_stage: int = 0):
    """The planner's plan of `model` on pp = len(stage_layers) ranks with those stages."""
    from autoplan.api import estimate
    from autoplan.capture.hf_rules import hf_registry

    kind = "hand" if isinstance(model, HandLM) else "llama-tied" if model.config.tie_word_embeddings else "llama"
    summary, graph = _captured(kind)
    pp = len(stage_layers)
    return estimate(summary, f"1x{pp}xcpu", pp, T, mesh=MeshShape(pp=pp), microbatch_size=1, zero_stage=zero_stage,
                    recompute="none", dtype="float32", graph=graph, registry=hf_registry(),
                    stage_layers=stage_layers)


def _chained(model, plan, tokens: torch.Tensor) -> torch.Tensor:
    """Every stage of `plan` in order, in this process, each passing its activation on."""
    cut, x = cut_stages(model, plan), None
    for stage in range(cut.count):
        with cut.view(stage, x):
            try:
                x = run_model(model, tokens)
            except StageOutput as end:
                x = end.value
    return x


@pytest.mark.parametrize("build", [_llama, _hand], ids=["llama", "hand"])
def test_stages_run_in_turn_give_the_models_logits(build):
    model = build()
    tokens = torch.randint(0, 128, (2, T), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        whole = run_model(model, tokens)
        for layers in ((1, 2), (0, 2, 1), (2, 1, 0)):  # an embedding-only first stage, a head-only last
            got = _chained(model, _plan(model, layers), tokens)
            torch.testing.assert_close(got, whole, rtol=0, atol=0)


def test_cut_places_embeddings_first_and_head_last():
    cut = cut_stages(_llama(), _plan(_llama(), (1, 2)))
    assert [p.path for p in cut.prefix] == ["model.embed_tokens"]
    assert [p.path for p in cut.suffix] == ["model.norm", "lm_head"]
    assert cut.stages == [(0, 1), (1, 3)]
    cut = cut_stages(_hand(), _plan(_hand(), (2, 1)))
    assert [p.path for p in cut.prefix] == ["embed", "pos"] and [p.path for p in cut.suffix] == ["norm", "lm_head"]
    assert [p.path for p in cut.held(1)] == ["stack.2", "norm", "lm_head"]


def test_prune_keeps_a_ranks_modules_under_their_own_names():
    model = _hand()
    names = [n for n, _ in model.named_parameters()]
    cut = cut_stages(model, _plan(model, (1, 2)))
    cut.prune([1])
    kept = [n for n, _ in model.named_parameters()]
    assert kept == [n for n in names if n.startswith(("stack.1.", "stack.2.", "norm.", "lm_head."))]
    assert cut.param_names == names
    held = sum(p.numel() for p in model.parameters())  # the cut keeps no other stage's module alive
    assert sum(p.numel() for pos in cut.blocks + cut.prefix + cut.suffix for p in pos.module.parameters()) == held


class _SkipBlock(Block):
    """A block that also takes the embeddings (computed from parameters)."""

    def forward(self, x: torch.Tensor, x0: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().forward(x + x0)


class _SkipLM(HandLM):
    def __init__(self) -> None:
        super().__init__(layers=LAYERS)
        self.stack = torch.nn.ModuleList(_SkipBlock(32, 4) for _ in range(LAYERS))

    def forward(self, input_ids, labels=None, use_cache=False):
        x0 = self.embed(input_ids) + self.pos(torch.arange(input_ids.shape[1], device=input_ids.device))
        x = x0
        for block in self.stack:
            x = block(x, x0)
        return self.lm_head(self.norm(x))


class _ScaledLM(HandLM):
    """Something between blocks: the hidden state scaled after each."""

    def forward(self, input_ids, labels=None, use_cache=False):
        x = self.embed(input_ids) + self.pos(torch.arange(input_ids.shape[1], device=input_ids.device))
        for block in self.stack:
            x = 0.5 * block(x)
        return self.lm_head(self.norm(x))


def test_refuses_forwards_that_cannot_be_cut():
    plan = _plan(_hand(), (1, 2))
    with pytest.raises(PlanError, match=r"block 'stack.0' takes inputs besides its hidden state that are "
                                        r"computed from parameters"):
        check_module_plan(plan, _SkipLM())
    with pytest.raises(PlanError, match=r"block 'stack.1' does not take the previous block's output unchanged"):
        check_module_plan(plan, _ScaledLM(layers=LAYERS))
    tied = _llama(tie=True)
    with pytest.raises(PlanError, match=r"'model.embed_tokens.weight' \(stage 0\) and 'lm_head.weight' "
                                        r"\(stage 1\) are tied"):
        check_module_plan(_plan(tied, (1, 2)), tied)
    check_module_plan(plan, _hand())  # the model itself is accepted


def test_zero_2_and_3_with_a_pipeline_are_refused_by_the_planner():
    for zero in (2, 3):
        with pytest.raises(ConfigError, match=rf"zero_stage {zero} .*pp=2.*use zero_stage <= 1"):
            _plan(_hand(), (1, 2), zero_stage=zero)


def test_a_forward_failing_on_its_shards_names_the_module():
    """A shape error raised in a module's own code is given back as a PlanError naming the innermost
    module that raised it (what a head count of its own under a tp plan gives), the cause chained."""
    from torch import nn

    class Heads(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(8, 8)

        def forward(self, x):
            return self.proj(x).view(x.shape[0], x.shape[1], 3, -1)  # 8 features are not 3 heads

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.attn = nn.Embedding(16, 8), Heads()

        def forward(self, tokens):
            return self.attn(self.embed(tokens))

    with pytest.raises(PlanError, match=r"failed in module 'attn' \(Heads\).*plan 'attn'") as info:
        run_model(Tiny(), torch.zeros(2, 4, dtype=torch.long))
    assert isinstance(info.value.__cause__, RuntimeError)
    with pytest.raises(IndexError):  # not a layout failure: the error as it came
        run_model(Tiny(), torch.full((2, 4), 99))
