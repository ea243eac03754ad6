"""How the planner takes the decoder-only causal LMs of transformers, at real size (issue 21).

For each architecture a real-size config is built locally from transformers' own config class (no
download; the sizes of the published checkpoints), captured on the meta device with `capture_hf_for_planner`
and planned with `autoplan.api.search_plans` on a cluster it fits. Per architecture the table reports:

    planned      a plan came back (else the error's first line)
    params       the plan's parameter count (`Plan.model.num_parameters`, which feeds the memory bound)
                 against transformers' `num_parameters()` of the model built on meta, as a relative error
    attention    attention cores recognised (fused nodes / decoder layers) and sharded under tp: every core
                 has a strategy other than replicate at the largest tp in {8, 4, 2} dividing its heads
    window       for a config with a sliding window: the windowed layers' attention FLOPs priced with the
                 window (key length min(T, window)) rather than T
    replicated   the share of the forward FLOPs in ops no strategy rule shards at that tp

    .venv/bin/python benchmarks/hf_architectures.py [--seq 4096] [--json out.json] [--only llama,qwen2]

Capture runs at batch 1 and `--seq` tokens (default 8192, where Mistral's window of 4096 bites; shorter for a
model whose max_position_embeddings is), the search
is cut at `--time-limit` seconds per architecture. The README's architecture table is this script's
output (`--from-json FILE` re-prints a saved run).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

SEQ = 8192

# Real sizes of the published checkpoints, as their config.json give them (cluster: where the plan fits).
ARCHITECTURES: dict[str, tuple[str, str, dict]] = {
    "Llama 3 8B": ("llama", "8x8xh100", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                   num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192,
                   rope_theta=500000.0, tie_word_embeddings=False)),
    "Qwen2.5 7B": ("qwen2", "8x8xh100", dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                   num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, max_position_embeddings=32768,
                   tie_word_embeddings=False)),
    "Qwen3 8B": ("qwen3", "8x8xh100", dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                 num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                 max_position_embeddings=40960, tie_word_embeddings=False)),
    "Qwen1.5-MoE A2.7B": ("qwen2_moe", "8x8xh100", dict(hidden_size=2048, intermediate_size=5632,
                          num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=16, vocab_size=151936,
                          moe_intermediate_size=1408, shared_expert_intermediate_size=5632, num_experts=60,
                          num_experts_per_tok=4, max_position_embeddings=8192, tie_word_embeddings=False)),
    "Qwen3-MoE 30B-A3B": ("qwen3_moe", "8x8xh100", dict(hidden_size=2048, intermediate_size=6144,
                          num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                          vocab_size=151936, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                          max_position_embeddings=40960, tie_word_embeddings=False)),
    "Gemma 7B": ("gemma", "8x8xh100", dict(hidden_size=3072, intermediate_size=24576, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=16, head_dim=256, vocab_size=256000,
                 max_position_embeddings=8192)),
    "Gemma 2 9B": ("gemma2", "8x8xh100", dict(hidden_size=3584, intermediate_size=14336, num_hidden_layers=42,
                   num_attention_heads=16, num_key_value_heads=8, head_dim=256, vocab_size=256000,
                   sliding_window=4096, max_position_embeddings=8192)),
    "Gemma 3 12B": ("gemma3_text", "8x8xh100", dict(hidden_size=3840, intermediate_size=15360,
                    num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=8, head_dim=256,
                    vocab_size=262208, sliding_window=1024, max_position_embeddings=131072)),
    "Phi-2": ("phi", "8x8xh100", dict(hidden_size=2560, intermediate_size=10240, num_hidden_layers=32,
              num_attention_heads=32, vocab_size=51200, partial_rotary_factor=0.4, max_position_embeddings=2048)),
    "Phi-3 mini": ("phi3", "8x8xh100", dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
                   num_attention_heads=32, num_key_value_heads=32, vocab_size=32064, sliding_window=2047,
                   max_position_embeddings=4096, tie_word_embeddings=False)),
    "Mistral 7B": ("mistral", "8x8xh100", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                   num_attention_heads=32, num_key_value_heads=8, vocab_size=32000, sliding_window=4096,
                   max_position_embeddings=32768)),
    "Mixtral 8x7B": ("mixtral", "16x8xh100", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                     num_attention_heads=32, num_key_value_heads=8, vocab_size=32000, num_local_experts=8,
                     num_experts_per_tok=2, max_position_embeddings=32768)),
    "DeepSeek V2-Lite": ("deepseek_v2", "8x8xh100", dict(hidden_size=2048, intermediate_size=10944,
                         moe_intermediate_size=1408, num_hidden_layers=27, num_attention_heads=16,
                         num_key_value_heads=16, n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6,
                         first_k_dense_replace=1, kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128,
                         qk_rope_head_dim=64, v_head_dim=128, vocab_size=102400, max_position_embeddings=16384)),
    "DeepSeek V3": ("deepseek_v3", "128x8xh100", dict(hidden_size=7168, intermediate_size=18432,
                    moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128,
                    num_key_value_heads=128, n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8,
                    first_k_dense_replace=3, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                    qk_rope_head_dim=64, v_head_dim=128, vocab_size=129280, max_position_embeddings=163840)),
    "OLMo 2 7B": ("olmo2", "8x8xh100", dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=32, vocab_size=100352, max_position_embeddings=4096)),
    "GPT-NeoX 20B": ("gpt_neox", "8x8xh100", dict(hidden_size=6144, intermediate_size=24576, num_hidden_layers=44,
                     num_attention_heads=64, vocab_size=50432, rotary_pct=0.25, max_position_embeddings=2048,
                     tie_word_embeddings=False)),
    "Falcon 7B": ("falcon", "8x8xh100", dict(hidden_size=4544, num_hidden_layers=32, num_attention_heads=71,
                  multi_query=True, parallel_attn=True, new_decoder_architecture=False, alibi=False, bias=False,
                  vocab_size=65024, max_position_embeddings=2048)),
    "StableLM 3B": ("stablelm", "8x8xh100", dict(hidden_size=2560, intermediate_size=6912, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=32, vocab_size=50304, partial_rotary_factor=0.25,
                    max_position_embeddings=4096)),
    "StarCoder2 7B": ("starcoder2", "8x8xh100", dict(hidden_size=4608, intermediate_size=18432,
                      num_hidden_layers=32, num_attention_heads=36, num_key_value_heads=4, vocab_size=49152,
                      sliding_window=4096, max_position_embeddings=16384)),
    "GPT-2 medium": ("gpt2", "8x8xh100", dict(n_embd=1024, n_layer=24, n_head=16, vocab_size=50257,
                     n_positions=1024)),
    "GPT-J 6B": ("gptj", "8x8xh100", dict(n_embd=4096, n_layer=28, n_head=16, rotary_dim=64, vocab_size=50400,
                 n_positions=2048, tie_word_embeddings=False)),
    "BLOOM 7B1": ("bloom", "8x8xh100", dict(hidden_size=4096, n_layer=30, n_head=32, vocab_size=250880)),
    "OPT 6.7B": ("opt", "8x8xh100", dict(hidden_size=4096, ffn_dim=16384, num_hidden_layers=32,
                 num_attention_heads=32, vocab_size=50272, max_position_embeddings=2048, word_embed_proj_dim=4096)),
    "Granite 3 8B": ("granite", "8x8xh100", dict(hidden_size=4096, intermediate_size=12800, num_hidden_layers=40,
                     num_attention_heads=32, num_key_value_heads=8, vocab_size=49155, tie_word_embeddings=True,
                     max_position_embeddings=4096)),
    "Command-R 35B": ("cohere", "16x8xh100", dict(hidden_size=8192, intermediate_size=22528, num_hidden_layers=40,
                      num_attention_heads=64, num_key_value_heads=64, vocab_size=256000, tie_word_embeddings=True,
                      max_position_embeddings=8192)),
    "InternLM3 8B": ("internlm3", "8x8xh100", dict(hidden_size=4096, intermediate_size=10240, num_hidden_layers=48,
                     num_attention_heads=32, num_key_value_heads=2, head_dim=128, vocab_size=128512,
                     max_position_embeddings=32768, tie_word_embeddings=False)),
    # not decoder-only: refused in one sentence
    "BERT base": ("bert", "1x8xh100", dict()),
    "T5 base": ("t5", "1x8xh100", dict()),
}


def hf_config(model_type: str, kwargs: dict, name: str):
    """The transformers config of `model_type` with `kwargs`, built locally (no download)."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type, **kwargs)
    config._name_or_path = name.replace(" ", "-")
    return config


def transformers_count(config) -> int:
    """transformers' own `num_parameters()` of the causal LM built on meta (tied weights once)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config).num_parameters()


def windows(config, layers: int) -> list[int | None]:
    """The key window of each layer as transformers runs it: `layer_types` where the config has them
    ("sliding_attention" layers see `sliding_window` keys), else `sliding_window` on every layer."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types:
        return [window if "sliding" in t else None for t in types]
    return [window] * layers


def tp_of(config) -> int:
    """The largest of 8, 4, 2 dividing the query and kv heads; 2 where none does (attention then cannot
    be split, and the replicated share says what that costs)."""
    heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_head", 1)
    kv = 1 if getattr(config, "multi_query", False) else getattr(config, "num_key_value_heads", None) or heads
    return next((tp for tp in (8, 4, 2) if heads % tp == 0 and kv % tp == 0), 2)


def seq_of(config, seq: int) -> int:
    """`seq`, or the model's longest sequence where that is shorter."""
    longest = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    return min(seq, longest) if isinstance(longest, int) else seq


def attention_row(graph, info: dict, config, tp: int) -> dict:
    """Attention cores found and sharded; windowed FLOPs against the windowed count; replicated share."""
    from autoplan.capture.hf_rules import hf_registry
    from autoplan.strategies import strategy_info

    registry, rule_info = hf_registry(), strategy_info(info, tp, 1)
    cores = [n for n in graph.nodes if n.op_kind == "attention"]
    layers = len({n.layer for n in graph.nodes if n.layer is not None})
    sharded = tp > 1 and bool(cores) and all(any(s.name != "replicate" for s in registry.strategies(n, tp, rule_info))
                                            for n in cores)
    replicated = sum(n.fwd_flops for n in graph.nodes
                     if n.fwd_flops and all(s.name == "replicate" for s in registry.strategies(n, tp, rule_info)))
    row = {"attention_cores": len(cores), "layers": layers, "tp": tp, "attention_sharded": sharded,
           "replicated_flops_share": replicated / graph.total_fwd_flops()}
    per_layer = windows(config, layers)
    if any(w is not None and w < graph.seq_len for w in per_layer) and cores:
        T = graph.seq_len  # a core's windowed count: 4 B T min(T, w) (Hq d), q = (B, T, Hq d)
        expected = sum(4.0 * n.input_metas[0].shape[0] * T * min(T, per_layer[n.layer] or T)
                       * n.input_metas[0].shape[-1] for n in cores)
        ratio = sum(n.fwd_flops for n in cores) / expected
        row.update(window_priced=abs(ratio - 1) < 0.01, attention_flops_vs_windowed=ratio)
    return row


def measure(name: str, seq: int, time_limit: float) -> dict:
    """One architecture's row (module docstring)."""
    from autoplan.api import search_plans
    from autoplan.capture.hf import capture_hf_for_planner
    from autoplan.capture.hf_rules import hf_registry
    from autoplan.cluster import parse_cluster

    model_type, cluster, kwargs = ARCHITECTURES[name]
    row: dict = {"architecture": name, "model_type": model_type, "cluster": cluster}
    start = time.perf_counter()
    try:
        config = hf_config(model_type, kwargs, name)
        row["seq"] = seq = seq_of(config, seq)
        row["transformers_params"] = transformers_count(config) if model_type not in ("bert", "t5") else None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            summary, graph, info = capture_hf_for_planner(config, seq)
        row.update(attention_row(graph, info, config, tp_of(config)))
        result = search_plans(summary, parse_cluster(cluster), 512, seq, top=1, baselines=False, graph=graph,
                              info=info, registry=hf_registry(), time_limit_s=time_limit)
        plan = result.plans[0]
        row.update(planned=True, plan_params=plan.model.num_parameters, mesh=str(plan.mesh),
                   mfu=plan.predicted.mfu, notes=[n for n in plan.provenance.notes if "replicated" in n])
    except Exception as e:  # noqa: BLE001 - the table reports whatever stops an architecture
        row.update(planned=False, error=f"{type(e).__name__}: {str(e).splitlines()[0][:400]}")
    if row.get("plan_params") and row.get("transformers_params"):
        row["param_error"] = row["plan_params"] / row["transformers_params"] - 1
    row["seconds"] = round(time.perf_counter() - start, 1)
    return row


def measure_row(name: str, args) -> dict:
    """`measure`'s row (none with --runs-only), with the tiny runs of `hf_arch_runs` under "runs" (--runs)."""
    row = {"architecture": name} if args.runs_only else measure(name, args.seq, args.time_limit)
    if args.runs or args.runs_only:
        import tempfile

        from hf_arch_runs import run_architecture

        with tempfile.TemporaryDirectory() as root:
            row["runs"] = run_architecture(name, Path(root))
    return row


def markdown(rows: list[dict]) -> str:
    """The README table: architecture, planned, parameter count error, attention sharded, window, runs."""
    from hf_arch_runs import runs_cell

    lines = ["| architecture | planned | param count error | attention sharded (tp) | window priced | "
             "replicated FLOPs | runs |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        reason = r.get("error", "").split(": ", 2)[-1].split(";")[0]  # past "ConfigError: hf-NAME: "
        planned = "yes" if r.get("planned") else f"refused: {reason}"
        err = f"{r['param_error']:+.2%}" if "param_error" in r else "-"
        attn = (f"{'yes' if r['attention_sharded'] else 'no'} ({r['attention_cores']}/{r['layers']} cores, "
                f"tp={r['tp']})") if "attention_sharded" in r else "-"
        window = ("yes" if r["window_priced"] else f"no ({r['attention_flops_vs_windowed']:.2f}x)") \
            if "window_priced" in r else "n/a"
        repl = f"{r['replicated_flops_share']:.1%}" if "replicated_flops_share" in r else "-"
        lines.append(f"| {r['architecture']} | {planned} | {err} | {attn} | {window} | {repl} | "
                     f"{runs_cell(r['runs']) if 'runs' in r else 'not measured'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=SEQ)
    parser.add_argument("--time-limit", type=float, default=5.0, help="search seconds per architecture")
    parser.add_argument("--only", default="", help="comma-separated substrings of architecture names")
    parser.add_argument("--json", default="", help="write the rows to this file")
    parser.add_argument("--runs", action="store_true",
                        help="also run each at tiny size on 2 gloo ranks against transformers (hf_arch_runs.py)")
    parser.add_argument("--runs-only", action="store_true", help="the tiny runs alone, no real-size planning")
    parser.add_argument("--from-json", default="", help="print the table of rows saved by --json, measuring nothing")
    args = parser.parse_args(argv)
    if args.from_json:
        print(markdown(json.loads(Path(args.from_json).read_text())))
        return 0
    names = [n for n in ARCHITECTURES if not args.only or any(s.lower() in n.lower() for s in args.only.split(","))]
    rows = []
    for name in names:
        rows.append(measure_row(name, args))
        print(json.dumps(rows[-1], default=str), file=sys.stderr, flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rows, indent=1, default=str))
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
