"""Building blocks shared by the model families.

The classes in `LEAF_MODULE_TYPES` are leaves for capture: each appears as one `call_module` node,
with its own FLOP formula, and its body is never traced. `CausalAttention` and `MoEFeedForward` read
their head / expert counts from the tensor widths they are given, so the same module runs unchanged
on the 1/tp slice of the heads that tensor parallelism hands it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from autoplan.errors import ConfigError
from autoplan.models.config import expert_capacity


class _RMSNormFunction(torch.autograd.Function):
    """y = x * r * w with r = 1 / sqrt(mean(x^2, -1) + eps), all in fp32, cast back to x's dtype.

    Backward keeps x and r (one fp32 per row) only; with xh = x r and g = dy w:
        dx = r (g - xh mean(g xh, -1)),   dw = sum over rows of dy xh
    (autograd of the composite would also keep xh, a second tensor of x's size)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x32 = x.float()
        rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)  # (..., 1)
        ctx.save_for_backward(x, weight, rstd)
        return (x32 * rstd * weight.float()).to(x.dtype)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        xh = x.float() * rstd
        g = dy.float() * weight.float()
        dx = rstd * (g - xh * (g * xh).mean(-1, keepdim=True))
        dw = (dy.float() * xh).reshape(-1, x.shape[-1]).sum(0)
        return dx.to(x.dtype), dw.to(weight.dtype), None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x (..., D) with weight (D,), keeping only x and the per-row scale for backward."""
    return _RMSNormFunction.apply(x, weight, eps)


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2, -1) + eps) * weight, computed in fp32 and cast back to x's dtype."""

    def __init__(self, hidden: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rope_cos_sin(seq_len: int, head_dim: int, theta: float, device: torch.device
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (T, d): angle[t, i] = t * theta^(-2i/d) for i < d/2, repeated twice."""
    even = torch.arange(0, head_dim, 2, device=device, dtype=torch.float32)  # (d/2,)
    inv_freq = theta ** (-even / head_dim)
    t = torch.arange(seq_len, device=device, dtype=torch.float32)
    angles = torch.outer(t, inv_freq)  # (T, d/2)
    emb = torch.cat((angles, angles), dim=-1)  # (T, d)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on x (B, H, T, d): x*cos + rotate_half(x)*sin, rotate_half([a, b]) = [-b, a]."""
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (x.float() * cos + rotated * sin).to(x.dtype)


class CausalAttention(nn.Module):
    """Causal scaled-dot-product attention on already-projected q, k, v; no parameters or buffers.

    q: (B, T, Hq*d), k and v: (B, T, Hkv*d) -> (B, T, Hq*d). Local head counts come from the widths,
    so a tensor-parallel shard that holds heads [i*Hq/tp, (i+1)*Hq/tp) and the matching kv heads
    gives exactly that slice of the full output. `heads` / `kv_heads` record the global counts.
    """

    def __init__(self, heads: int, kv_heads: int, head_dim: int, rope: bool, max_seq: int,
                 rope_theta: float = 10000.0) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.rope, self.max_seq, self.rope_theta = rope, max_seq, rope_theta

    def extra_repr(self) -> str:
        return (f"heads={self.heads}, kv_heads={self.kv_heads}, head_dim={self.head_dim}, "
                f"rope={self.rope}, max_seq={self.max_seq}, rope_theta={self.rope_theta}")

    def check_shapes(self, q: torch.Tensor, k: torch.Tensor) -> None:
        """The sequence fits max_seq and the local q heads group evenly over the local kv heads."""
        T, q_heads, kv_heads = q.shape[1], q.shape[-1] // self.head_dim, k.shape[-1] // self.head_dim
        if T > self.max_seq:
            raise ConfigError(f"sequence length {T} exceeds max_seq={self.max_seq}; use a shorter "
                              f"sequence or a config with a larger max_seq")
        if kv_heads == 0 or q_heads % kv_heads:
            raise ConfigError(f"local q heads {q_heads} not divisible by local kv heads "
                              f"{kv_heads}; shard q and kv heads by the same degree")

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        B, T, _ = q.shape
        self.check_shapes(q, k)
        q = q.view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, Hq, T, d)
        k = k.view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, Hkv, T, d)
        v = v.view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, Hkv, T, d)
        if self.rope:
            cos, sin = rope_cos_sin(T, self.head_dim, self.rope_theta, q.device)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # q head j uses kv head j // (Hq / Hkv), without repeating k and v to the q heads' width
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           enable_gqa=k.shape[1] != q.shape[1])  # (B, Hq, T, d)
        return y.transpose(1, 2).reshape(B, T, -1)  # (B, T, Hq*d)


def swiglu(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor
           ) -> torch.Tensor:
    """(silu(x @ w_gate) * (x @ w_up)) @ w_down; x (N, h), w_gate/w_up (h, f), w_down (f, h)."""
    return (F.silu(x @ w_gate) * (x @ w_up)) @ w_down


class MoEFeedForward(nn.Module):
    """Mixtral-style mixture of SwiGLU experts: dropless, or with an expert capacity.

    For token x: l = router(x) (E logits); (v, i) = top_k(l); w = softmax(v);
    y = sum_j w_j * swiglu(x, w_gate[i_j], w_up[i_j], w_down[i_j]).
    With `capacity_factor` > 0 each expert takes at most C = `config.expert_capacity` rows of each
    sequence (x's second-to-last dim), the first in token order; the terms of the pairs past them are
    dropped (GShard). 0: every pair is kept.
    """

    def __init__(self, hidden: int, ffn_hidden: int, experts: int, top_k: int,
                 capacity_factor: float = 0.0) -> None:
        super().__init__()
        self.top_k, self.capacity_factor = top_k, capacity_factor
        self.router = nn.Linear(hidden, experts, bias=False)
        self.w_gate = nn.Parameter(torch.empty(experts, hidden, ffn_hidden))
        self.w_up = nn.Parameter(torch.empty(experts, hidden, ffn_hidden))
        self.w_down = nn.Parameter(torch.empty(experts, ffn_hidden, hidden))
        for w, fan_in in ((self.w_gate, hidden), (self.w_up, hidden), (self.w_down, ffn_hidden)):
            nn.init.normal_(w, std=fan_in ** -0.5)

    def extra_repr(self) -> str:
        experts, hidden, ffn = self.w_gate.shape
        return f"hidden={hidden}, ffn_hidden={ffn}, experts={experts}, top_k={self.top_k}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # (N, h)
        top_logits, top_idx = self.router(flat).topk(self.top_k, dim=-1)  # (N, k), (N, k)
        weights = F.softmax(top_logits.float(), dim=-1).to(x.dtype)  # (N, k)
        if x.device.type == "meta":  # data-dependent routing has no meta kernel: dense equivalent
            return self._dense(flat, top_idx, weights).view(shape)
        out = torch.zeros_like(flat)  # (N, h)
        for e in range(self.w_gate.shape[0]):
            token, slot = torch.where(top_idx == e)  # tokens routed to expert e (ascending), and their slot
            if self.capacity_factor:
                token, slot = self._within_capacity(token, slot, shape[-2])
            if token.numel() == 0:
                continue
            y = swiglu(flat.index_select(0, token), self.w_gate[e], self.w_up[e], self.w_down[e])
            out.index_add_(0, token, y * weights[token, slot].unsqueeze(-1))
        return out.view(shape)

    def capacity(self, group_tokens: int) -> int:
        """C: the most rows one expert takes of a group of `group_tokens` tokens (0: no limit)."""
        experts = self.w_gate.shape[0]
        return expert_capacity(self.capacity_factor, group_tokens, self.top_k, experts) if self.capacity_factor else 0

    def _within_capacity(self, token: torch.Tensor, slot: torch.Tensor, group_tokens: int
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """The first C of an expert's (ascending) tokens in each group of `group_tokens` tokens."""
        group = token // group_tokens
        counts = torch.bincount(group)
        rank = torch.arange(token.numel(), device=token.device) - (counts.cumsum(0) - counts)[group]
        keep = rank < self.capacity(group_tokens)
        return token[keep], slot[keep]

    def _dense(self, flat: torch.Tensor, top_idx: torch.Tensor, weights: torch.Tensor
               ) -> torch.Tensor:
        """Every expert on every token, weighted by a dense (N, E) gate that is 0 off the top_k."""
        rows, experts = flat.shape[0], self.w_gate.shape[0]
        gate = torch.zeros(rows, experts, dtype=flat.dtype, device=flat.device)
        gate = gate.scatter(1, top_idx, weights)  # (N, E)
        hid = F.silu(torch.einsum("nh,ehf->enf", flat, self.w_gate))
        hid = hid * torch.einsum("nh,ehf->enf", flat, self.w_up)  # (E, N, f)
        y = torch.einsum("enf,efh->enh", hid, self.w_down)  # (E, N, h)
        return torch.einsum("enh,ne->nh", y, gate)  # (N, h)


class LMLoss(nn.Module):
    """Mean token cross-entropy in fp32: logits (B, T, V), targets (B, T) -> scalar."""

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        vocab = logits.shape[-1]
        return F.cross_entropy(logits.float().reshape(-1, vocab), targets.reshape(-1))


class Attention(nn.Module):
    """Projections around `CausalAttention`: o_proj(core(q_proj(x), k_proj(x), v_proj(x)))."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, bias: bool, rope: bool,
                 max_seq: int, rope_theta: float) -> None:
        super().__init__()
        head_dim = hidden // heads
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=bias)
        self.core = CausalAttention(heads, kv_heads, head_dim, rope, max_seq, rope_theta)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.core(self.q_proj(x), self.k_proj(x), self.v_proj(x))  # (B, T, Hq*d)
        return self.o_proj(y)  # (B, T, h)


LEAF_MODULE_TYPES = (nn.Linear, nn.Embedding, nn.LayerNorm, RMSNorm, CausalAttention,
                     MoEFeedForward, LMLoss)
