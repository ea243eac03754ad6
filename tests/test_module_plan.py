"""The module runtime's checks without processes: a plan read as module styles
(runtime.module_plan), what it refuses and why, checkpoints that do not match the model
(runtime.weights), export targets (runtime.hf_export) and the dispatch of autoplan.parallelize."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

from _handmade import HandLM

transformers = pytest.importorskip("transformers")

from autoplan.errors import ConfigError, PlanError  # noqa: E402
from autoplan.placement import Replicate, Shard  # noqa: E402
from autoplan.runtime.module_launch import _weights_source, check_module_plan  # noqa: E402
from autoplan.runtime.module_plan import module_plan  # noqa: E402

T = 16


def _config(**changes):
    base = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=128, vocab_size=256, max_position_embeddings=64, tie_word_embeddings=False)
    return transformers.LlamaConfig(**(base | changes))


def _meta_model(config):
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


@pytest.fixture(scope="module")
def captured():
    from autoplan.capture.hf import capture_hf_for_planner

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        summary, graph, _ = capture_hf_for_planner(_config(), T, "float32")
    return summary, graph


def _plan(captured, tp: int = 2, assignment: str | dict = "megatron", **changes):
    """A plan of the tiny Llama on 1 x tp ranks: "megatron", "megatron-sp", "replicate", or the
    Megatron assignment with `assignment`'s nodes changed."""
    from autoplan.api import plan_from_assignment
    from autoplan.capture.hf_rules import hf_registry
    from autoplan.cluster import parse_cluster
    from autoplan.mesh import MeshShape
    from autoplan.solver.intra_op import megatron_assignment
    from autoplan.strategies import strategy_info

    summary, graph = captured
    registry, info = hf_registry(), strategy_info(summary.rule_info(), tp, tp)
    chosen = {} if assignment == "replicate" else megatron_assignment(graph, registry, tp, info, assignment == "megatron-sp")
    chosen |= assignment if isinstance(assignment, dict) else {}
    plan = plan_from_assignment(graph, summary, parse_cluster(f"1x{tp}xcpu"), MeshShape(tp=tp), chosen, 2, 1, 0,
                                "none", registry=registry, dtype="float32")
    return dataclasses.replace(plan, **changes) if changes else plan


def test_megatron_sp_plan_as_module_styles(captured):
    styles = module_plan(_plan(captured, assignment="megatron-sp"), _meta_model(_config()))
    q, o = styles.style("model.layers.0.self_attn.q_proj"), styles.style("model.layers.1.mlp.down_proj")
    assert (q.kind, q.input, q.output, q.local_output) == ("colwise", Replicate(), Shard(-1), True)
    assert (o.kind, o.output, o.local_output, o.strategy) == ("rowwise", Shard(1), False, "row_sp")
    assert styles.style("model.embed_tokens").strategy == "vocab_sp"
    assert styles.style("model.layers.0.input_layernorm").kind == "sequence"
    head = styles.style("lm_head")
    assert (head.kind, head.local_output) == ("colwise", False) and styles.loss == "vocab"
    table = str(styles)
    assert "model.layers.0.self_attn.o_proj" in table and "row_sp" in table and "loss: vocab" in table
    assert len(styles.styles) == 21  # 7 linears + 2 norms per layer, embedding, final norm, head


def test_megatron_plan_without_sequence_parallelism(captured):
    styles = module_plan(_plan(captured), _meta_model(_config()))
    assert styles.style("model.layers.0.self_attn.o_proj").output == Replicate()
    assert styles.style("model.layers.0.input_layernorm").kind == "replicated"
    assert styles.style("model.embed_tokens").output == Replicate()


def test_replicated_plan_replicates_whole_regions(captured):
    styles = module_plan(_plan(captured, assignment="replicate"), _meta_model(_config()))
    assert styles.style("model.layers.0.self_attn").kind == "replicated_region"
    assert styles.style("model.layers.0.mlp").kind == "replicated_region"
    assert styles.style("model.layers.0.self_attn.q_proj") is None  # plain weights inside the region
    assert module_plan(_plan(captured, tp=1), _meta_model(_config())).styles == ()


def test_refuses_regions_the_module_runtime_cannot_run(captured):
    model = _meta_model(_config())
    mixed = _plan(captured, assignment={"model_layers_0_self_attn_q_proj": "replicate"})
    with pytest.raises(PlanError, match=r"'model.layers.0.self_attn': its linears mix strategies.*q_proj: replicate"):
        module_plan(mixed, model)
    core = _plan(captured, assignment={"model_layers_1_mlp_up_proj": "column", "mul_20": "replicate"})
    with pytest.raises(PlanError, match=r"op 'mul_20' .* runs 'replicate'.*module boundaries"):
        module_plan(core, model)


def test_refuses_what_this_slice_does_not_run(captured):
    from autoplan.mesh import MeshShape

    plan, model = _plan(captured), _meta_model(_config())
    check_module_plan(dataclasses.replace(plan, mesh=MeshShape(cp=2)), model)  # runs (module_context)
    check_module_plan(dataclasses.replace(plan, recompute="selective"), model)  # runs (module_recompute)
    with pytest.raises(PlanError, match=r"recompute 'full:3' names 3 layers but the model has 2"):
        check_module_plan(dataclasses.replace(plan, recompute="full:3"), model)
    with pytest.raises(PlanError, match=r"recompute 'full': the plan's model has 2 layers but the model "
                                        r"\(Sequential\) holds 0 blocks"):
        check_module_plan(dataclasses.replace(plan, recompute="full"), torch.nn.Sequential(torch.nn.Linear(2, 2)))
    with pytest.raises(PlanError, match="dropout under tensor parallelism.*attention_dropout=0.1"):
        check_module_plan(plan, _meta_model(_config(attention_dropout=0.1)))
    with pytest.raises(PlanError, match="fingerprint.*another model"):
        check_module_plan(plan, _meta_model(_config(intermediate_size=96)))
    with pytest.raises(PlanError, match="the plan was made for 1 x 2 x cpu .* but the cluster given is 1 x 4 x cpu"):
        check_module_plan(plan, model, "1x4xcpu")


def _captured(config):
    from autoplan.capture.hf import capture_hf_for_planner

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        summary, graph, _ = capture_hf_for_planner(config, T, "float32")
    return summary, graph


def test_tied_weights_under_tp_run_only_when_held_alike():
    config = _config(tie_word_embeddings=True)
    tied, model = _captured(config), _meta_model(config)
    check_module_plan(_plan(tied), model)  # vocab-parallel embedding and column head: both hold S(0)
    with pytest.raises(PlanError, match=r"'model.embed_tokens.weight' and 'lm_head.weight' are tied .*"
                                        r"\(model.embed_tokens.weight: S\(0\), lm_head.weight: R\)"):
        check_module_plan(_plan(tied, assignment={"lm_head": "replicate"}), model)


def test_gpt2_conv1d_styles_and_the_fused_qkv_refused():
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=64, bos_token_id=0,
                                     eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    gpt2, model = _captured(config), _meta_model(config)
    styles = module_plan(_plan(gpt2, assignment="replicate"), model)
    assert styles.style("transformer.h.0.attn").kind == "replicated_region"  # its Conv1D form a region
    split = {f"transformer_h_{i}_attn_{name}": s for i in (0, 1) for name, s in (("c_attn", "column"), ("c_proj", "row"))}
    with pytest.raises(PlanError, match=r"'transformer.h.\d.attn.c_attn' \(Conv1D, 192 outputs\) is planned "
                                        r"'column' but the row projections of its region take at most 64 inputs: "
                                        r"its output is fused"):
        module_plan(_plan(gpt2, assignment=split), model)


def test_fused_qkv_and_gate_up_linears_refused_column():
    """Phi-3's qkv_proj (q|k|v) and gate_up_proj (gate|up): a contiguous column shard would cut across the pieces."""
    config = transformers.Phi3Config(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                     intermediate_size=128, vocab_size=256, max_position_embeddings=64,
                                     pad_token_id=0, tie_word_embeddings=False)
    phi3, model = _captured(config), _meta_model(config)
    regions = (("self_attn_qkv_proj", 128, "self_attn_o_proj"), ("mlp_gate_up_proj", 256, "mlp_down_proj"))
    for proj, out, rows in regions:
        split = {f"model_layers_{i}_{name}": "replicate" for i in (0, 1) for r in regions for name in r[::2]}
        split |= {f"model_layers_{i}_self_attn_core{piece}": "replicate" for i in (0, 1) for piece in ("", "_q", "_k", "_v")
                  if proj.startswith("mlp")}  # the core and its q, k, v pieces (views of qkv_proj's output)
        split |= {f"model_layers_{i}_{proj}": "column" for i in (0, 1)} | {f"model_layers_{i}_{rows}": "row" for i in (0, 1)}
        with pytest.raises(PlanError, match=rf"{out} outputs\) is planned 'column' but the row projections .* "
                                            r"its output is fused"):
            module_plan(_plan(phi3, assignment=split), model)


def test_weights_come_from_the_module_or_a_checkpoint(tmp_path):
    with pytest.raises(ConfigError, match="meta device and no checkpoint"):
        _weights_source(_meta_model(_config()), None)
    with pytest.raises(ConfigError, match="this model has weights"):
        _weights_source(HandLM(), tmp_path)
    assert _weights_source(HandLM(), None) == "module"


def test_checkpoint_that_does_not_match_names_the_parameter(tmp_path):
    from autoplan.runtime.weights import load_checkpoint

    transformers.AutoModelForCausalLM.from_config(_config()).save_pretrained(tmp_path / "ckpt")
    with pytest.raises(ConfigError, match=r"'model.layers.0.mlp.gate_proj.weight' has shape \(96, 64\) in the "
                                          r"model but \(128, 64\) in the checkpoint"):
        load_checkpoint(_meta_model(_config(intermediate_size=96)), tmp_path / "ckpt", torch.device("cpu"))
    with pytest.raises(ConfigError, match=r"no tensor 'model.layers.2.self_attn.q_proj.weight'"):
        load_checkpoint(_meta_model(_config(num_hidden_layers=3)), tmp_path / "ckpt", torch.device("cpu"))
    with pytest.raises(ConfigError, match="no \\*.safetensors"):
        load_checkpoint(_meta_model(_config()), tmp_path, torch.device("cpu"))


def test_checkpoint_loads_into_a_meta_model(tmp_path):
    """Differential, one process: the loaded model (rotary tables recomputed) gives the saved one's logits."""
    from autoplan.runtime.weights import load_checkpoint

    saved = transformers.AutoModelForCausalLM.from_config(_config(), attn_implementation="sdpa")
    saved.save_pretrained(tmp_path)
    loaded = _meta_model(_config())
    load_checkpoint(loaded, tmp_path, torch.device("cpu"))
    tokens = torch.randint(0, 256, (2, T))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=tokens).logits, saved(input_ids=tokens).logits)


def test_checkpoint_names_follow_transformers_renamings(tmp_path):
    """GPT-NeoX: transformers 5's model says `lm_head` where its checkpoints keep `embed_out` (renamed on
    load by transformers' conversion mapping); the loaded model gives the saved one's logits."""
    from autoplan.runtime.weights import load_checkpoint

    config = transformers.GPTNeoXConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                        intermediate_size=128, vocab_size=256, max_position_embeddings=64)
    saved = transformers.AutoModelForCausalLM.from_config(config)
    saved.save_pretrained(tmp_path)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as handle:
        assert "embed_out.weight" in handle.keys() and "lm_head.weight" not in handle.keys()
    loaded = _meta_model(config)
    load_checkpoint(loaded, tmp_path, torch.device("cpu"))
    tokens = torch.randint(0, 256, (2, T))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=tokens).logits, saved(input_ids=tokens).logits)


def test_local_index_is_torch_chunk():
    from autoplan.runtime.weights import local_index

    for coord in range(4):
        rows = local_index((10, 4), [torch.distributed.tensor.Shard(0)], [coord], [4])
        assert torch.arange(10)[rows].tolist() == torch.arange(10).chunk(4)[coord].tolist()
    assert local_index((10, 4), [torch.distributed.tensor.Shard(1)], [1], [2]) == (slice(None), slice(2, 4))
    assert local_index((10, 4), [torch.distributed.tensor.Replicate()], [1], [2]) == ()


def test_export_targets(tmp_path):
    from autoplan.runtime.hf_export import MARKER, export_target_error

    assert export_target_error(tmp_path / "new") is None and export_target_error(tmp_path) is None
    (tmp_path / "mine.txt").write_text("x")
    assert "did not write" in export_target_error(tmp_path)
    assert "not a directory" in export_target_error(tmp_path / "mine.txt")
    (tmp_path / MARKER).write_text("{}")
    assert export_target_error(tmp_path) is None


def test_parallelize_dispatch(tmp_path):
    from autoplan.api import hf_model_on_meta, is_zoo_model
    from autoplan.models import build_model, get_model_config

    assert is_zoo_model(build_model(get_model_config("tiny-llama"), device="meta"))
    assert not is_zoo_model(HandLM()) and not is_zoo_model(_meta_model(_config()))
    _config().save_pretrained(tmp_path)
    model = hf_model_on_meta(tmp_path)
    assert type(model).__name__ == "LlamaForCausalLM" and next(model.parameters()).is_meta
