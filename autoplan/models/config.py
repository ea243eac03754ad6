"""Model shape descriptions and the preset zoo.

A `ModelConfig` holds every number that determines the parameter and activation shapes of one of
the three built-in families (gpt, llama, moe). Parameter counts, exact (tested against the modules):

    attention (per layer)  h*(Hq*d) + 2*h*(Hkv*d) + (Hq*d)*h   (gpt: + Hq*d + 2*Hkv*d + h biases)
    gpt mlp                h*f + f + f*h + h;  two LayerNorms 2*2h
    llama mlp              3*h*f;              two RMSNorms 2*h
    moe mlp                r*E (router) + 3*E*r*f             routed experts, r = expert width
                           + 3*r*(S*f)                        S shared experts (one SwiGLU, S*f wide)
                           + 2*h*r  when r != h               BigMac descend and ascend projections
                           the first D layers instead: 3*h*f_dense (dense SwiGLU); two RMSNorms 2*h
    embeddings             V*h (gpt: + max_seq*h positions); final norm; lm_head h*V (untied)

The moe family covers three layouts, all made of the same capture leaves (`autoplan.models.moe`):
Mixtral (S = D = 0, r = h); fine-grained DeepSeekMoE (many small routed experts, S shared experts
always on, the first D layers dense); BigMac (r = `expert_hidden` < h: a Linear descends every
token to r before dispatch and another ascends after the combine, so the all-to-alls move r-wide
tokens).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path

from autoplan.errors import ConfigError
from autoplan.validate import (MAX_EXACT, approx, check_choice, check_int, check_keys, check_mapping, check_number, check_str,
                               load_mapping)

FAMILIES = ("gpt", "llama", "moe")
# Bounds of what can be planned at all (not of what fits). Capture and costing walk every layer (about 6 ms
# per layer on a CPU) and the deepest published LLMs have ~130 (Llama 3 405B: 126), so 4096 layers is far
# beyond any real model yet still captured in under a minute. Parameter counts, and every tensor's element
# count with them, must stay exact in float64 and inside torch's int64 sizes: below 2^53 (about 9e15, thousands
# of times the largest published models).
MAX_LAYERS = 4096
MAX_PARAMETERS = MAX_EXACT
_SHAPE_FIELDS = ("family", "num_layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab",
                 "max_seq", "experts", "top_k", "norm_eps", "rope_theta")
# MoE layout fields: fingerprinted only when set, so configs without them keep their fingerprints.
_MOE_LAYOUT_FIELDS = ("shared_experts", "dense_layers", "dense_ffn_hidden", "expert_hidden")


@dataclass(frozen=True)
class ModelConfig:
    """Shapes of a decoder-only transformer; validated at construction."""

    name: str
    family: str  # "gpt" | "llama" | "moe"
    num_layers: int
    hidden: int
    heads: int
    kv_heads: int  # == heads for gpt
    ffn_hidden: int  # dense MLP width; moe: the width of one routed expert
    vocab: int
    max_seq: int = 2048  # learned positions (gpt) / longest RoPE sequence (llama, moe)
    experts: int = 0  # moe only (>= 2)
    top_k: int = 0  # moe only (1..experts)
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    shared_experts: int = 0  # moe only: always-on experts, one SwiGLU of width shared_experts * ffn_hidden
    dense_layers: int = 0  # moe only: the first dense_layers layers have a dense SwiGLU MLP instead
    dense_ffn_hidden: int = 0  # moe only: that MLP's width (> 0 exactly when dense_layers > 0)
    expert_hidden: int = 0  # moe only: BigMac's low width r < hidden the experts run at (0: hidden)
    parameters: int = 0  # the exact count where the model itself gives it (a captured Hugging Face model); 0: the formula
    capacity_factor: float = 0.0  # moe only: each expert takes at most `expert_capacity` rows per sequence; 0: dropless

    def __post_init__(self) -> None:
        check_str("model name", self.name)
        check_choice(f"model {self.name!r}: family", self.family, FAMILIES)
        for key in ("num_layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab", "max_seq"):
            check_int(f"model {self.name!r}: {key}", getattr(self, key))
        for key in ("experts", "top_k", "parameters") + _MOE_LAYOUT_FIELDS:
            check_int(f"model {self.name!r}: {key}", getattr(self, key), minimum=0)
        for key in ("norm_eps", "rope_theta"):
            check_number(f"model {self.name!r}: {key}", getattr(self, key))
        check_number(f"model {self.name!r}: capacity_factor", self.capacity_factor, strict=False,
                     hint="0 for dropless routing, or e.g. 1.25 for buffers of 1.25x the mean rows per expert")
        if self.hidden % self.heads:
            raise ConfigError(f"model {self.name!r}: hidden={self.hidden} is not divisible by "
                              f"heads={self.heads}; choose hidden as a multiple of heads")
        if self.heads % self.kv_heads:
            raise ConfigError(f"model {self.name!r}: heads={self.heads} is not divisible by "
                              f"kv_heads={self.kv_heads}; choose kv_heads dividing heads")
        if self.family == "gpt" and self.kv_heads != self.heads:
            raise ConfigError(f"model {self.name!r}: gpt needs kv_heads == heads, got "
                              f"kv_heads={self.kv_heads}, heads={self.heads}; use family 'llama' "
                              f"for grouped-query attention")
        self._check_moe_fields()
        self._check_size()

    def _check_size(self) -> None:
        if self.num_layers > MAX_LAYERS:
            raise ConfigError(f"model {self.name!r}: num_layers={self.num_layers} is more than autoplan plans "
                              f"({MAX_LAYERS}: capture and costing walk every layer); use fewer layers")
        if self.num_parameters() >= MAX_PARAMETERS:
            raise ConfigError(f"model {self.name!r}: {approx(self.num_parameters())} parameters is more than autoplan "
                              f"plans (below 2^53 = {MAX_PARAMETERS:.3g}, where counts stay exact); use smaller "
                              f"hidden, ffn_hidden, vocab, max_seq or experts")

    def _check_moe_fields(self) -> None:
        if self.family != "moe":
            extra = {k: getattr(self, k) for k in ("experts", "top_k", "capacity_factor") + _MOE_LAYOUT_FIELDS
                     if getattr(self, k)}
            if extra:
                given = ", ".join(f"{k}={v}" for k, v in extra.items())
                raise ConfigError(f"model {self.name!r}: {given}: these fields are only for "
                                  f"family 'moe'; set them to 0")
            return
        if self.experts < 2:
            raise ConfigError(f"model {self.name!r}: family 'moe' needs experts >= 2, "
                              f"got experts={self.experts!r}")
        if not 1 <= self.top_k <= self.experts:
            raise ConfigError(f"model {self.name!r}: top_k={self.top_k!r} must be in "
                              f"1..experts={self.experts}")
        if self.dense_layers >= self.num_layers:
            raise ConfigError(f"model {self.name!r}: dense_layers={self.dense_layers} leaves no MoE "
                              f"layer of num_layers={self.num_layers}; use dense_layers <= "
                              f"{self.num_layers - 1}, or family 'llama' for a dense model")
        if (self.dense_layers > 0) != (self.dense_ffn_hidden > 0):
            raise ConfigError(f"model {self.name!r}: dense_layers={self.dense_layers} and "
                              f"dense_ffn_hidden={self.dense_ffn_hidden} must be both 0 or both "
                              f"positive (dense_ffn_hidden is the width of the dense layers' MLP)")
        if self.expert_hidden >= self.hidden:
            raise ConfigError(f"model {self.name!r}: expert_hidden={self.expert_hidden} must be "
                              f"below hidden={self.hidden} (BigMac descends to a lower width); "
                              f"use expert_hidden=0 for experts at the model width")

    @property
    def expert_width(self) -> int:
        """r: the width of the tokens the routed experts see (and the all-to-alls move)."""
        return self.expert_hidden or self.hidden

    @property
    def dispatched_rows_per_token(self) -> float:
        """Rows an expert-parallel dispatch moves per token: top_k, or with an expert capacity the padded
        buffer's capacity_factor * top_k (`expert_capacity` before its rounding up)."""
        return self.top_k * (self.capacity_factor or 1.0)

    @property
    def moe_layers(self) -> int:
        """Layers with a mixture of experts (0 outside the moe family)."""
        return self.num_layers - self.dense_layers if self.family == "moe" else 0

    @property
    def head_dim(self) -> int:
        """d = hidden / heads."""
        return self.hidden // self.heads

    def rule_info(self) -> dict:
        """What the strategy rules (`autoplan.strategies`) and the activation model
        (`cost_model.activations`: RoPE's tables and rotated q, k) read of the model besides its graph."""
        info = {"head_dim": self.head_dim, "ffn_hidden": self.ffn_hidden, "rope": self.family != "gpt"}
        info |= {"moe_layers": self.moe_layers} if self.moe_layers else {}  # the ep margins' L (whole depth)
        return info | ({"capacity_factor": self.capacity_factor} if self.capacity_factor else {})

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> ModelConfig:
        """The config of a mapping with the field names as keys; unknown or missing keys are refused."""
        check_mapping("model config", d)
        allowed = {f.name for f in fields(cls)}
        required = {f.name for f in fields(cls) if f.default is MISSING}
        check_keys(f"model config {d['name']!r}" if "name" in d else "model config", d, allowed, required)
        return cls(**d)

    def fingerprint(self) -> str:
        """First 16 hex chars of sha256 over the canonical (sorted-key) JSON of the shape fields."""
        shape = {k: getattr(self, k) for k in _SHAPE_FIELDS}
        shape |= {k: getattr(self, k) for k in _MOE_LAYOUT_FIELDS + ("capacity_factor",) if getattr(self, k)}
        text = json.dumps(shape, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def num_parameters(self) -> int:
        """Exact parameter count of `build_model(self)` (formulas in the module docstring), or `parameters`
        where set: a Hugging Face model's own count (tied weights once), which no family formula gives."""
        if self.parameters:
            return self.parameters
        h, f, v, d = self.hidden, self.ffn_hidden, self.vocab, self.head_dim
        q, kv = self.heads * d, self.kv_heads * d
        attn = h * q + 2 * h * kv + q * h
        if self.family == "gpt":
            attn += q + 2 * kv + h
            block = attn + (h * f + f + f * h + h) + 2 * 2 * h
            return v * h + self.max_seq * h + self.num_layers * block + 2 * h + h * v
        if self.family == "llama":
            mlps = self.num_layers * 3 * h * f
        else:
            r = self.expert_width
            moe = r * self.experts + 3 * self.experts * r * f + 3 * r * self.shared_experts * f
            moe += 2 * h * r if r != h else 0
            mlps = self.moe_layers * moe + self.dense_layers * 3 * h * self.dense_ffn_hidden
        return v * h + self.num_layers * (attn + 2 * h) + mlps + h + h * v

    def expert_parameters(self) -> int:
        """Parameters of the routed experts' weights (w_gate, w_up, w_down: 3 E r f per MoE layer),
        the ones expert parallelism divides; the router, shared experts and projections are dense."""
        return self.moe_layers * 3 * self.experts * self.expert_width * self.ffn_hidden


def expert_capacity(factor: float, tokens: int, top_k: int, experts: int) -> int:
    """C = ceil(factor * tokens * top_k / experts): the most rows each expert takes of a group of `tokens`
    tokens (one sequence, or a rank's slice of it) routed to `top_k` of `experts` experts; the routed
    (token, slot) pairs past the first C of an expert in token order are dropped (GShard, Lepikhin et
    al. 2020; Megatron-Core's --moe-expert-capacity-factor). The runtime pads each expert's buffer to
    exactly C rows per group (runtime.experts), so its memory is that of C rows whatever the routing."""
    return max(1, math.ceil(factor * tokens * top_k / experts))


def load_model_config(path: str | Path) -> ModelConfig:
    """Read a model config from JSON (.json) or YAML (.yaml/.yml); `layers` aliases `num_layers`
    and `name` defaults to the file stem."""
    path = Path(path)
    data = dict(load_mapping(path, "model config file"))
    if "layers" in data:
        if "num_layers" in data:
            raise ConfigError(f"{path}: give either 'layers' or 'num_layers', not both")
        data["num_layers"] = data.pop("layers")
    data.setdefault("name", path.stem)
    return ModelConfig.from_json(data)


def _gpt(name: str, layers: int, hidden: int, heads: int, vocab: int = 51200,
         max_seq: int = 2048) -> ModelConfig:
    return ModelConfig(name, "gpt", layers, hidden, heads, heads, 4 * hidden, vocab, max_seq)


def known_models() -> dict[str, ModelConfig]:
    """A fresh dict of the preset configs, keyed by name."""
    presets = [
        # GPT-2 (Radford et al. 2019, table 2); vocab 50257 padded to 50304 as in nanoGPT; 1024 ctx.
        _gpt("gpt2-small", 12, 768, 12, 50304, 1024),
        _gpt("gpt2-medium", 24, 1024, 16, 50304, 1024),
        _gpt("gpt2-large", 36, 1280, 20, 50304, 1024),
        _gpt("gpt2-xl", 48, 1600, 25, 50304, 1024),
        # GPT-3 (Brown et al. 2020, table 2.1); vocab padded to 51200 as in Megatron-LM.
        _gpt("gpt3-1.3b", 24, 2048, 16),
        _gpt("gpt3-2.7b", 32, 2560, 32),
        _gpt("gpt3-6.7b", 32, 4096, 32),
        _gpt("gpt3-13b", 40, 5120, 40),
        _gpt("gpt3-175b", 96, 12288, 96),
        # Llama 3 (Dubey et al. 2024, "The Llama 3 Herd of Models", table 3; HF config.json).
        ModelConfig("llama3-8b", "llama", 32, 4096, 32, 8, 14336, 128256, 8192,
                    rope_theta=500000.0),
        ModelConfig("llama3-70b", "llama", 80, 8192, 64, 8, 28672, 128256, 8192,
                    rope_theta=500000.0),
        ModelConfig("llama3-405b", "llama", 126, 16384, 128, 8, 53248, 128256, 8192,
                    rope_theta=500000.0),
        # Mixtral (Jiang et al. 2024, "Mixtral of Experts", table 1; HF config.json).
        ModelConfig("mixtral-8x7b", "moe", 32, 4096, 32, 8, 14336, 32000, 32768, experts=8,
                    top_k=2, rope_theta=1e6),
        ModelConfig("mixtral-8x22b", "moe", 56, 6144, 48, 8, 16384, 32768, 65536, experts=8,
                    top_k=2, rope_theta=1e6),
        # DeepSeekMoE 16B (Dai et al. 2024, "DeepSeekMoE: Towards Ultimate Expert Specialization in
        # Mixture-of-Experts Language Models", arXiv:2401.06066, sec. 5; HF deepseek-moe-16b-base
        # config.json): 64 routed experts of width 1408, top 6, 2 shared experts, layer 0 dense
        # (width 10944), MHA; 16.38B parameters. Its gate is softmax-then-top-k without
        # renormalising, ours Mixtral's top-k-then-softmax: same shapes and FLOPs.
        ModelConfig("deepseek-moe-16b", "moe", 28, 2048, 16, 16, 1408, 102400, 4096, experts=64,
                    top_k=6, norm_eps=1e-6, shared_experts=2, dense_layers=1,
                    dense_ffn_hidden=10944),
        # A fine-grained (DeepSeekMoE-style, CDAC) MoE at Mixtral 8x7B's size: each of Mixtral's
        # experts segmented 8-fold as DeepSeekMoE segments (Dai et al. 2024, sec. 3.1): 64 experts
        # of width 14336/8 = 1792, top 2*8 = 16; total and active parameters equal Mixtral's, and
        # each all-to-all moves top_k*h = 65536 values per token, 8x Mixtral's.
        ModelConfig("finegrained-moe-47b", "moe", 32, 4096, 32, 8, 1792, 32000, 32768, experts=64,
                    top_k=16, rope_theta=1e6),
        # BigMac (Jin et al. 2025, "BigMac: A Communication-Efficient Mixture-of-Experts Model
        # Structure for Fast Training and Inference", AAAI 2025, arXiv:2502.16927), the DCCA twin of
        # finegrained-moe-47b: the same attention, 64 experts and top 16, but each MoE descends
        # 4096 -> r = 512 (h/8), runs experts r -> 14336 -> r (3*512*14336 weights each, as many as
        # a 4096 -> 1792 -> 4096 segment), and ascends 512 -> 4096. So expert weights per layer and
        # active expert FLOPs per token equal Mixtral's (16*512 = 2*4096), +2.4% FLOPs for the
        # projections; 46.8B parameters. An all-to-all moves top_k*r = 8192 values per token: 1/8
        # of the fine-grained twin's, as much as Mixtral's. The price: 16 experts of width 14336
        # per token keep 8x the twin's and Mixtral's expert activations (top_k * 3 * ffn per token).
        ModelConfig("bigmac-47b", "moe", 32, 4096, 32, 8, 14336, 32000, 32768, experts=64,
                    top_k=16, rope_theta=1e6, expert_hidden=512),
        # Tiny models for tests.
        ModelConfig("tiny-gpt", "gpt", 2, 64, 4, 4, 256, 128, 64),
        ModelConfig("tiny-llama", "llama", 2, 64, 4, 2, 128, 128, 64),
        ModelConfig("tiny-moe", "moe", 2, 64, 4, 2, 96, 128, 64, experts=4, top_k=2),
        ModelConfig("tiny-deepseek", "moe", 3, 64, 4, 2, 32, 128, 64, experts=8, top_k=3,
                    shared_experts=2, dense_layers=1, dense_ffn_hidden=128),
        ModelConfig("tiny-bigmac", "moe", 2, 64, 4, 2, 64, 128, 64, experts=8, top_k=4,
                    expert_hidden=16),
    ]
    return {c.name: c for c in presets}


def get_model_config(name: str) -> ModelConfig:
    """The preset called `name`; the error lists every known name."""
    models = known_models()
    if name not in models:
        raise ConfigError(f"unknown model {name!r}; known models: {', '.join(sorted(models))}; "
                          f"or pass a config file (JSON/YAML) to load_model_config")
    return models[name]
