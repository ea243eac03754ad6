"""The building blocks of Hugging Face attention that `autoplan.capture.hf_convert` fuses into one core.

Every decoder family computes the same core, softmax(q k^T / sqrt(d) + mask) v over (B, T, H*d) q, k
and v, but builds q, k and v differently. What the converter's attention group accepts:

    split QKV          q_proj, k_proj, v_proj: three (B, T, H*d) activations enter the core (Llama, Qwen2, ...)
    fused QKV          one projection whose (B, T, (Hq + 2 Hkv) d) output the core slices (Phi-3 qkv_proj,
                       GPT-NeoX query_key_value, Falcon): one input. The converter records it as three
                       pieces, `split[2]` views of the fused tensor (`fused_widths`), so the core reads
                       q, k and v as with split projections. A column-parallel fused projection is taken
                       as laid out per rank (each rank's columns hold its heads' q, k and v: GPT-NeoX's
                       per-head interleaving is, Megatron-LM lays out its fused weight so), as the view
                       rule of `autoplan.capture.hf_rules` assumes for every split.
    per-head norms     an RMSNorm / LayerNorm submodule of the attention module applied to each head's q
                       or k (Qwen3, Gemma 3, OLMo 2's q_norm / k_norm): part of the core. Its weight is
                       shared by all heads, so under head-parallel tp each rank holds it whole and its
                       gradient is a partial sum (`autoplan.capture.hf_rules.hf_attention_strategies`).
    eager attention    where an architecture has no SDPA path (Gemma 2, BLOOM): q @ k^T, the mask's add (BLOOM's
                       ALiBi baddbmm), scaling, soft-capping, softmax, dropout, probs @ v: the same core,
                       priced as flash attention (the cost model's attention kind says how it runs).
    partial rotary     RoPE on the first part of each head, the rest passed through and concatenated
                       (Phi-2, StableLM, GPT-NeoX, GPT-J): inside the core.
    sliding windows    a layer whose module says so (`key_window`) attends to at most `window` keys
                       per query; its core is priced with key length min(T, window).
    latent attention   DeepSeek V2 / V3's multi-head latent attention: kv_a_proj compresses the tokens to a
                       latent c (and one rotary key k_r all heads share), kv_b_proj expands c per head into
                       the no-rotary key | value, q comes from q_proj or q_a_proj -> norm -> q_b_proj. The
                       core (target LATENT_ATTENTION) takes three inputs: q (B, T, H (dn + dr)), the expanded
                       latent (B, T, H (dn + dv)) and k_r (B, T, dr); its output is (B, T, H dv), the value
                       width, not q's. kv_b_proj runs on a single-head 4-D view of c, (B, 1, T, r), taken
                       as the (B, T, r) it is. Heads: H = (q - kv + out) / dr (`latent_heads`).

FLOPs of a core: 2 B T K (Hq dqk + Hq dv) forward (q k^T, then probs v: 4 B T K (Hq d) where the value width
is the query's), K = min(T, window) keys per query (the full count: the causal half is not discounted, as
for full attention), 2 x that backward.
"""

from __future__ import annotations

import re

LATENT_ATTENTION = "latent_attention"  # the target of a multi-head latent attention core
CORE_SUBMODULE = re.compile(r"(RMSNorm|LayerNorm|Dropout)$", re.IGNORECASE)  # per-head norms, attention dropout


def in_attention(path: str, cls: str, attention_path: str) -> bool:
    """Whether an op of module `path` (class `cls`) belongs to the core of the attention module at
    `attention_path`: the module's own ops, and those of its per-head norm and dropout submodules."""
    if path == attention_path:
        return True
    return path.startswith(attention_path + ".") and bool(CORE_SUBMODULE.search(cls))


def fused_widths(fused: int, q_width: int) -> tuple[int, int, int] | None:
    """(q, k, v) widths of a fused QKV activation of width `fused` whose core returns `q_width`
    features (Hq d): (q_width, w, w) with w = (fused - q_width) / 2 > 0, else None."""
    rest = fused - q_width
    if q_width <= 0 or rest <= 0 or rest % 2:
        return None
    return q_width, rest // 2, rest // 2


def key_window(module: object) -> int | None:
    """The most keys a query of this attention module attends to, None for all: the module's own
    `sliding_window` where it has one (the per-layer-type families: Gemma 2 / 3, Qwen2, Cohere 2, whose
    full-attention layers set None), else its config's (Mistral, Mixtral, Phi-3, StarCoder2, which pass
    `config.sliding_window` to every layer)."""
    if hasattr(module, "sliding_window"):
        window = getattr(module, "sliding_window")
    else:
        window = getattr(getattr(module, "config", None), "sliding_window", None)
    return window if isinstance(window, int) and not isinstance(window, bool) and window > 0 else None


def attention_flops(batch: int, seq: int, q_width: int, window: int | None, v_width: int | None = None) -> float:
    """Forward FLOPs of one core (module docstring): `v_width` the output's (the values'), q's when None."""
    keys = min(seq, window) if window else seq
    return 2.0 * batch * seq * keys * (q_width + (q_width if v_width is None else v_width))


def latent_heads(q_width: int, kv_width: int, out_width: int, rotary_width: int) -> int | None:
    """H of a latent attention core from its widths (module docstring): q = H (dn + dr), kv = H (dn + dv),
    out = H dv, so q - kv + out = H dr; None when that is not a whole number of heads."""
    rotary = q_width - kv_width + out_width
    if rotary_width <= 0 or rotary <= 0 or rotary % rotary_width:
        return None
    heads = rotary // rotary_width
    return heads if out_width % heads == 0 and (kv_width - out_width) % heads == 0 else None
