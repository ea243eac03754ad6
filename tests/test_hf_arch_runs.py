"""The architectures of benchmarks/hf_architectures.py at tiny size (issue 21): every one plans for 2 ranks
or is refused with an autoplan error (never a raw traceback), and a subset of those the module runtime
did not run before runs on 2 gloo ranks with transformers' numbers.

The tiny configs are `benchmarks/hf_arch_runs.tiny_config`'s (the same config class as the real size, the
architecture's features kept). Parity: each case trains 3 AdamW steps from the checkpoint transformers
saved and compares losses (rel 1e-5; the first is transformers' own), the first step's gradients and the
final parameters (1e-5) with transformers in one process (`hf_arch_runs.compare`). The cases exercise what
those architectures brought to the module runtime:

    Qwen3 tp2      per-head q / k norms inside a head-split attention core (style "on_shards")
    Gemma tp2      a non-persistent buffer beside loaded parameters (embed_scale), tied embeddings
    OLMo 2 tp2     q / k norms over all heads' features (attention kept replicated, the plan refused
                   otherwise), no norm between the vocab-parallel embedding and a column projection
    BLOOM dp2      no SDPA path: the model built on meta with eager attention
    Phi-3 tp2      fused qkv_proj / gate_up_proj kept replicated, a sliding window shorter than T
    StableLM tp2   head counts kept as attributes (q.view(b, t, self.num_heads, d)): set to the local counts
    OPT tp2        learned positions given their ids as a keyword; its decoder layer (fc1 / fc2's region, which
                   holds the attention and norms too) replicated
    Gemma 2 tp2    tanh soft-capping of the attention scores (eager attention, on each rank's heads) and of
                   the logits (on each rank's vocabulary shard)
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch

from _dist import spawn

transformers = pytest.importorskip("transformers")

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
# (architecture, case, regions the tp2 plan keeps replicated (their last name component))
PARITY = [("Qwen3 8B", "tp2", set()), ("Gemma 7B", "tp2", set()), ("OLMo 2 7B", "tp2", {"self_attn"}),
          ("BLOOM 7B1", "dp2", set()), ("Phi-3 mini", "tp2", {"self_attn", "mlp"}), ("StableLM 3B", "tp2", set()),
          ("OPT 6.7B", "tp2", {"layers.*"}), ("Gemma 2 9B", "tp2", set())]
# refused at tiny size, with the words their message must hold
REFUSED = {"BERT base": "encoder-only", "T5 base": "encoder-decoder"}


def _bench():
    """The benchmark modules (hf_architectures: the list; hf_arch_runs: tiny configs, plans, runs)."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    import hf_arch_runs
    import hf_architectures

    return hf_architectures, hf_arch_runs


def _tiny(name: str):
    archs, runs = _bench()
    model_type, _, kwargs = archs.ARCHITECTURES[name]
    return runs.tiny_config(model_type, kwargs, name)


def test_every_architecture_plans_or_refuses_with_a_message():
    """Capture and the search for 2 ranks at tiny size: a plan, or an AutoplanError that names the reason."""
    from autoplan.api import search_plans
    from autoplan.capture.hf import capture_hf_for_planner
    from autoplan.capture.hf_rules import hf_registry
    from autoplan.cluster import parse_cluster
    from autoplan.errors import AutoplanError

    archs, runs = _bench()
    planned, refused = [], {}
    for name in archs.ARCHITECTURES:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                summary, graph, info = capture_hf_for_planner(_tiny(name), runs.T, "float32")
            search_plans(summary, parse_cluster("1x2xcpu"), runs.B, runs.T, top=1, baselines=False, graph=graph,
                         info=info, registry=hf_registry(), time_limit_s=0.5)
            planned.append(name)
        except AutoplanError as exc:
            refused[name] = str(exc)
    assert set(refused) == set(REFUSED), refused
    for name, words in REFUSED.items():
        assert words in refused[name] and "\n" not in refused[name].strip(), refused[name]
    assert len(planned) == len(archs.ARCHITECTURES) - len(REFUSED)


def _train_cases(rank: int, world: int, cases: list) -> list:
    """In each rank: every (directory, plan, tokens) case through autoplan.parallelize and 3 steps;
    rank 0 keeps the gradients and parameters."""
    import autoplan

    _, runs = _bench()
    warnings.simplefilter("ignore")
    found = []
    for directory, plan, tokens in cases:
        got = runs.train(autoplan.parallelize(directory, f"1x{world}xcpu", plan), tokens)
        found.append(got if rank == 0 else {"losses": got["losses"]})
    return found


def test_new_architectures_match_transformers_on_two_ranks(tmp_path):
    _, runs = _bench()
    tokens = torch.randint(0, runs.TINY["vocab_size"], (runs.STEPS, runs.B, runs.T),
                           generator=torch.Generator().manual_seed(runs.SEED))
    cases, refs = [], []
    for name, case, replicated in PARITY:
        config = _tiny(name)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            refs.append(runs.save_checkpoint(config, tmp_path / config.model_type, tokens))
        plan, kept = runs.case_plan(case, config)
        assert runs.replicated_kinds(kept) == replicated, (name, kept)
        cases.append((str(tmp_path / config.model_type), plan, tokens))
    rank0, rank1 = spawn(_train_cases, 2, cases)
    for (name, case, _), got, other, ref in zip(PARITY, rank0, rank1, refs):
        assert runs.compare(got, ref) is None, (name, case, runs.compare(got, ref))
        assert other["losses"] == got["losses"], (name, case)
