"""Block detection: segments, cuts and kinds of captured graphs, mixed block kinds included (tier 1)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from autoplan.capture import capture
from autoplan.capture import node_label
from autoplan.capture.blocks import fold_graph
from autoplan.models import build_model, get_model_config
from autoplan.models.config import ModelConfig
from autoplan.models.gpt import GPTBlock
from autoplan.models.layers import Attention, LMLoss, MoEFeedForward, RMSNorm
from autoplan.models.llama import LlamaBlock, SwiGLUMLP

VOCAB, SEQ = 128, 16
NARROW = ModelConfig("fold-test", "llama", 4, 64, 4, 2, 128, VOCAB, 64)  # head_dim 16
WIDE = dataclasses.replace(NARROW, hidden=128, heads=8, kv_heads=4, ffn_hidden=256)  # head_dim 16 too


# ------------------------------------------------------------------------------ test-only models


def dense(c: ModelConfig = NARROW) -> nn.Module:
    return LlamaBlock(c, SwiGLUMLP(c.hidden, c.ffn_hidden))


def moe(c: ModelConfig = NARROW) -> nn.Module:
    return LlamaBlock(c, MoEFeedForward(c.hidden, 96, experts=4, top_k=2))


def gpt(c: ModelConfig = NARROW) -> nn.Module:
    return GPTBlock(dataclasses.replace(c, family="gpt", kv_heads=c.heads))


class RenamedBlock(nn.Module):
    """The dense Llama block under other attribute names: same structure, other module paths."""

    def __init__(self, c: ModelConfig = NARROW) -> None:
        super().__init__()
        self.pre_attention = RMSNorm(c.hidden, c.norm_eps)
        self.mixer = Attention(c.hidden, c.heads, c.kv_heads, False, True, c.max_seq, c.rope_theta)
        self.pre_ffn = RMSNorm(c.hidden, c.norm_eps)
        self.ffn = SwiGLUMLP(c.hidden, c.ffn_hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.mixer(self.pre_attention(x))
        return x + self.ffn(self.pre_ffn(x))


class ParallelBlock(nn.Module):
    """x + attn(n1(x)) + mlp(n2(x)) (GPT-J style); `mlp_first` traces the same graph in another order."""

    def __init__(self, mlp_first: bool, c: ModelConfig = NARROW) -> None:
        super().__init__()
        self.mlp_first = mlp_first
        self.n1, self.n2 = RMSNorm(c.hidden), RMSNorm(c.hidden)
        self.attn = Attention(c.hidden, c.heads, c.kv_heads, False, True, c.max_seq, c.rope_theta)
        self.mlp = SwiGLUMLP(c.hidden, c.ffn_hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mlp_first:
            m = self.mlp(self.n2(x))
            a = self.attn(self.n1(x))
        else:
            a = self.attn(self.n1(x))
            m = self.mlp(self.n2(x))
        return x + a + m


class SkipBlock(nn.Module):
    """A dense block that also reads the embeddings: x + mlp(norm(x)) + e (two tensors cross every cut)."""

    def __init__(self, c: ModelConfig = NARROW) -> None:
        super().__init__()
        self.norm = RMSNorm(c.hidden)
        self.mlp = SwiGLUMLP(c.hidden, c.ffn_hidden)

    def forward(self, x: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x)) * e


class StackLM(nn.Module):
    """tok_emb -> layers (a width change `up` after layer `up_after`, if any) -> norm -> lm_head -> loss."""

    def __init__(self, layers: list[nn.Module], hidden: int = 64, final_hidden: int | None = None,
                 up_after: int | None = None, skip: bool = False) -> None:
        super().__init__()
        final = final_hidden or hidden
        self.tok_emb = nn.Embedding(VOCAB, hidden)
        self.layers = nn.ModuleList(layers)
        self.up_after, self.skip = up_after, skip
        self.up = nn.Linear(hidden, final, bias=False) if up_after is not None else None
        self.norm = RMSNorm(final)
        self.lm_head = nn.Linear(final, VOCAB, bias=False)
        self.loss = LMLoss()

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = e = self.tok_emb(tokens)  # (B, T, h)
        for i, block in enumerate(self.layers):
            x = block(x, e) if self.skip else block(x)
            if i == self.up_after:
                x = self.up(x)  # (B, T, final)
        return self.loss(self.lm_head(self.norm(x)), targets)


class EncoderDecoderLM(nn.Module):
    """An encoder stack (dense blocks at `encoder.layers.<i>`) then a decoder stack (`decoder.<i>`,
    blocks that also read the encoder's output, as cross-attention would) -> norm -> head -> loss."""

    def __init__(self, encoders: int, decoders: int, hidden: int = 64) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(VOCAB, hidden)
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList([dense() for _ in range(encoders)])
        self.decoder = nn.ModuleList([SkipBlock() for _ in range(decoders)])
        self.norm = RMSNorm(hidden)
        self.lm_head = nn.Linear(hidden, VOCAB, bias=False)
        self.loss = LMLoss()

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(tokens)
        for block in self.encoder.layers:
            x = block(x)
        memory = x
        for block in self.decoder:
            x = block(x, memory)
        return self.loss(self.lm_head(self.norm(x)), targets)


def captured(make, seq: int = SEQ):
    """Capture a test model built on meta in bf16; `make` builds it (called under the meta device)."""
    with torch.device("meta"):
        model = make()
    return capture(model.to(torch.bfloat16), NARROW, 1, seq)


def kinds(graph) -> list[int]:
    return [seg.kind for seg in fold_graph(graph).segments]


# ------------------------------------------------------------------------------ grouping


@pytest.mark.parametrize("name", ["tiny-gpt", "tiny-llama", "tiny-moe"])
def test_identical_layers_are_one_kind(name):
    cfg = dataclasses.replace(get_model_config(name), num_layers=4)
    graph = capture(build_model(cfg, "meta", torch.bfloat16), cfg, 1, SEQ)
    folded = fold_graph(graph)
    assert [seg.kind for seg in folded.segments] == [0, 1, 1, 1, 1, 2]
    assert [seg.layer for seg in folded.segments] == [None, 0, 1, 2, 3, None]
    assert folded.layer_kinds() == {1: 4}
    assert "4 layers: 4 x kind 1" in folded.describe()
    assert sorted(n for seg in folded.segments for n in seg.nodes) == sorted(n.name for n in graph.nodes)
    by_name = {n.name: n for n in graph.nodes}
    blocks = [seg for seg in folded.segments if seg.layer is not None]
    for seg in blocks[1:]:  # position j plays the same part in every block
        assert [node_label(by_name[n]) for n in seg.nodes] == [node_label(by_name[n]) for n in blocks[0].nodes]
        assert seg.reads == blocks[0].reads and seg.provides == blocks[0].provides


def test_dense_and_moe_layers_alternate():
    graph = captured(lambda: StackLM([dense(), moe(), dense(), moe()]))
    assert kinds(graph) == [0, 1, 2, 1, 2, 3]


def test_a_first_or_last_layer_that_differs():
    assert kinds(captured(lambda: StackLM([gpt(), dense(), dense(), dense()]))) == [0, 1, 2, 2, 2, 3]
    assert kinds(captured(lambda: StackLM([dense(), dense(), dense(), moe()]))) == [0, 1, 1, 1, 2, 3]


def test_two_widths_with_glue_between():
    graph = captured(lambda: StackLM([dense(), dense(), dense(WIDE), dense(WIDE)], final_hidden=128, up_after=1))
    folded = fold_graph(graph)
    assert [seg.kind for seg in folded.segments] == [0, 1, 1, 2, 3, 3, 4]
    assert [seg.layer for seg in folded.segments] == [None, 0, 1, None, 2, 3, None]  # the `up` glue at top level
    assert folded.num_kinds == 5


def test_encoder_and_decoder_stacks_are_found_under_any_name():
    graph = captured(lambda: EncoderDecoderLM(encoders=3, decoders=4))
    folded = fold_graph(graph)
    assert [seg.block for seg in folded.segments] == [None, "encoder.layers.0", "encoder.layers.1",
                                                      "encoder.layers.2", "decoder.0", "decoder.1", "decoder.2",
                                                      "decoder.3", None]
    # encoder blocks share a kind; the first decoder reads the encoder output twice (x and memory), the
    # last one does not pass the memory on: each has an interface of its own, the middle ones share one
    assert [seg.kind for seg in folded.segments] == [0, 1, 1, 1, 2, 3, 3, 4, 5]
    assert folded.layer_kinds() == {1: 3, 2: 1, 3: 2, 4: 1}
    assert "7 layers" in folded.describe()


def test_module_names_do_not_matter():
    graph = captured(lambda: StackLM([dense(), RenamedBlock(), dense()]))
    assert kinds(graph) == [0, 1, 1, 1, 2]


def test_the_same_block_traced_in_another_order_is_matched_by_isomorphism():
    graph = captured(lambda: StackLM([ParallelBlock(False), ParallelBlock(True), ParallelBlock(False)]))
    folded = fold_graph(graph)
    assert [seg.kind for seg in folded.segments] == [0, 1, 1, 1, 2]
    by_name = {n.name: n for n in graph.nodes}
    first, second = folded.segments[1], folded.segments[2]
    topological = [n.name for n in graph.nodes if n.layer == 1]
    assert list(second.nodes) != topological  # reordered into the kind's order
    assert [node_label(by_name[n]) for n in second.nodes] == [node_label(by_name[n]) for n in first.nodes]
    # the correspondence keeps each op's module role: attention matches attention, mlp matches mlp
    roles = [[by_name[n].module_path.split(".", 2)[-1] for n in seg.nodes if by_name[n].op_kind == "linear"]
             for seg in (first, second)]
    assert roles[0] == roles[1]


def test_shapes_decide_not_names():
    short = captured(lambda: StackLM([dense(), dense()]), seq=SEQ)
    long = captured(lambda: StackLM([dense(), dense()]), seq=2 * SEQ)
    assert fold_graph(short).kind_hashes[1] != fold_graph(long).kind_hashes[1]


# ------------------------------------------------------------------------------ cuts


def test_cuts_carry_the_residual_and_pass_the_targets_through():
    cfg = dataclasses.replace(get_model_config("tiny-llama"), num_layers=3)
    graph = capture(build_model(cfg, "meta", torch.bfloat16), cfg, 1, SEQ)
    folded = fold_graph(graph)
    assert len(folded.cuts) == len(folded.segments) - 1
    assert all(cut[0] == "targets" and len(cut) == 2 for cut in folded.cuts)
    for s, seg in enumerate(folded.segments[1:-1], start=1):
        assert seg.provides[0] == ("slot", 0)  # the targets, untouched
        what, p = seg.provides[1]
        assert what == "node" and seg.nodes[p] == folded.cuts[s][1]
        # the residual feeds the attention norm and the first add, both from one producer
        assert {slot for slot, _, _ in seg.reads} == {1} and len(seg.reads) == 2


def test_a_skip_connection_crosses_every_cut():
    graph = captured(lambda: StackLM([SkipBlock() for _ in range(4)], skip=True))
    folded = fold_graph(graph)
    # layer 0 reads the embeddings as both x and e; the last layer is the last reader of e, so it
    # does not pass e on: both have interfaces of their own, the middle layers share one kind
    assert [seg.kind for seg in folded.segments] == [0, 1, 2, 2, 3, 4]
    assert all(cut == ("targets", "tok_emb", f"add{suffix}") for cut, suffix in zip(folded.cuts[1:3], ("", "_1")))
    middle = folded.segments[2]
    assert middle.provides[:2] == (("slot", 0), ("slot", 1))  # targets and embeddings passed through
    assert {slot for slot, _, _ in middle.reads} == {1, 2}  # embeddings and residual read


def test_fold_is_deterministic_and_fast():
    cfg = dataclasses.replace(get_model_config("tiny-gpt"), num_layers=48)
    graph = capture(build_model(cfg, "meta", torch.bfloat16), cfg, 1, SEQ)
    first, second = fold_graph(graph), fold_graph(graph)
    assert first == second
    assert first.fold_time_s < 1.0
    assert first.num_kinds == 3


def test_kind_hashes_are_the_same_in_another_process():
    """Python salts str hashes per process; the Weisfeiler-Lehman hash must not depend on that."""
    script = ("import dataclasses, torch\n"
              "from autoplan.capture import capture\n"
              "from autoplan.capture.blocks import fold_graph\n"
              "from autoplan.models import build_model, get_model_config\n"
              "cfg = dataclasses.replace(get_model_config('tiny-moe'), num_layers=2)\n"
              f"graph = capture(build_model(cfg, 'meta', torch.bfloat16), cfg, 1, {SEQ})\n"
              "print(' '.join(fold_graph(graph).kind_hashes))\n")
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    child = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    cfg = dataclasses.replace(get_model_config("tiny-moe"), num_layers=2)
    here = fold_graph(capture(build_model(cfg, "meta", torch.bfloat16), cfg, 1, SEQ)).kind_hashes
    assert child.stdout.split() == list(here) and len(set(here)) == 3
