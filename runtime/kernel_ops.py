"""The fused kernels of runtime.kernels in the rewritten program, `plan.kernels` choosing the
backend ("auto": Triton on CUDA, plain torch on CPU; "triton" or "torch" force one; see
`kernels.dispatch.use_triton`). `rewrite` swaps, after capture (the kernels cannot be traced):

    call_module  nn.LayerNorm, RMSNorm       -> KernelLayerNorm, KernelRMSNorm (same parameters)
                 CausalAttention with RoPE   -> KernelCausalAttention (kernels.apply_rope on q, k)
                 LMLoss                      -> KernelLMLoss (kernels.vocab_parallel_cross_entropy)
                 MoEFeedForward (replicated) -> KernelMoEFeedForward (runtime.experts: the permute,
                                                unpermute and silu * mul kernels)
    call_function gelu(x, approximate="tanh")-> kernel_gelu(x, backend)       (kernels.bias_gelu)
                 mul(silu(a), b)             -> kernel_silu_mul(a, b, backend) (kernels.silu_mul)

The tensor-parallel loss (runtime.modules.VocabParallelLoss) and runtime.modules.ParallelMoE (set
by runtime.rewrite) take the backend themselves. Meta tensors (shape inference) always take the
torch path.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from autoplan.errors import ConfigError
from autoplan.models.layers import CausalAttention, LMLoss, MoEFeedForward, RMSNorm, rope_cos_sin
from autoplan.runtime import kernels as K
from autoplan.runtime.experts import local_experts_ffn


def on(t: torch.Tensor, backend: str) -> str:
    """`backend` for tensors on a real device; "torch" on meta (no kernel runs there)."""
    return "torch" if t.is_meta else backend


def kernel_gelu(x: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """gelu(x, approximate="tanh")."""
    return K.bias_gelu(x, None, backend=on(x, backend))


def kernel_silu_mul(gate: torch.Tensor, up: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """silu(gate) * up."""
    return K.silu_mul(gate, up, backend=on(gate, backend))


class KernelLayerNorm(nn.LayerNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return K.layer_norm(x, self.weight, self.bias, self.eps, backend=on(x, self.kernels))


class KernelRMSNorm(RMSNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return K.rms_norm(x, self.weight, self.eps, backend=on(x, self.kernels))


class KernelLMLoss(LMLoss):
    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return K.vocab_parallel_cross_entropy(logits, targets, backend=on(logits, self.kernels))


class KernelMoEFeedForward(MoEFeedForward):
    """MoEFeedForward (same routing, same parameters) with its experts run by
    `experts.local_experts_ffn`: one permute, a SwiGLU per expert's run of rows, one unpermute (or with
    an expert capacity, the padded buffer of each sequence's first C rows per expert)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_meta:  # the model's dense equivalent: routing has no meta kernel
            return super().forward(x)
        flat = x.reshape(-1, x.shape[-1])  # (N, h)
        top_logits, top_idx = self.router(flat).topk(self.top_k, dim=-1)  # (N, k)
        weights = F.softmax(top_logits.float(), dim=-1).to(x.dtype)  # (N, k)
        return local_experts_ffn(flat, top_idx, weights, self.w_gate, self.w_up, self.w_down, self.kernels,
                                 self.capacity(x.shape[-2]), x.shape[-2]).view(x.shape)


class RopeTables:
    """The cos and sin tables RoPE needs, per (T, d, theta, device), made on first use and shared by
    every attention module of one program: made once, not once per layer and forward (each layer's
    own tables would be new tensors kept for its backward)."""

    def __init__(self) -> None:
        self._made: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def get(self, seq_len: int, head_dim: int, theta: float, device: torch.device
            ) -> tuple[torch.Tensor, torch.Tensor]:
        key = (seq_len, head_dim, theta, str(device))
        if key not in self._made:
            with torch.no_grad():  # constants: no graph, in or out of a recomputed region
                self._made[key] = rope_cos_sin(seq_len, head_dim, theta, device)
        return self._made[key]


class KernelCausalAttention(CausalAttention):
    """CausalAttention with the RoPE kernel (the model's forward calls layers.apply_rope) on the
    program's shared `RopeTables`, and k, v at the kv heads' width (SDPA's enable_gqa)."""

    rope_tables: RopeTables

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        B, T, _ = q.shape
        if T > self.max_seq:
            raise ConfigError(f"sequence length {T} exceeds max_seq={self.max_seq}")
        q, k, v = (t.view(B, T, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        if q.shape[1] % k.shape[1]:
            raise ConfigError(f"local q heads {q.shape[1]} not divisible by local kv heads "
                              f"{k.shape[1]}; shard q and kv heads by the same degree")
        cos, sin = self.rope_tables.get(T, self.head_dim, self.rope_theta, q.device)
        backend = on(q, self.kernels)
        q, k = K.apply_rope(q, cos, sin, backend), K.apply_rope(k, cos, sin, backend)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           enable_gqa=k.shape[1] != q.shape[1])  # (B, Hq, T, d)
        return y.transpose(1, 2).reshape(B, T, -1)


def kernel_module(module: nn.Module, backend: str, rope_tables: RopeTables | None = None
                  ) -> nn.Module:
    """The kernel-backed module of a leaf (its parameters, shared), or `module` itself;
    `rope_tables`: the program's shared tables (None: the module's own)."""
    kind = type(module)
    if kind is nn.LayerNorm and module.elementwise_affine and len(module.normalized_shape) == 1:
        new = KernelLayerNorm(module.normalized_shape, module.eps, bias=module.bias is not None,
                              device="meta")
        new.weight, new.bias = module.weight, module.bias
    elif kind is RMSNorm:
        new = KernelRMSNorm(module.weight.shape[0], module.eps)
        new.weight = module.weight
    elif kind is CausalAttention and module.rope:
        new = KernelCausalAttention(module.heads, module.kv_heads, module.head_dim, True,
                                    module.max_seq, module.rope_theta)
        new.rope_tables = rope_tables if rope_tables is not None else RopeTables()
    elif kind is LMLoss:
        new = KernelLMLoss()
    elif kind is MoEFeedForward:
        experts, hidden, ffn = module.w_gate.shape
        with torch.device("meta"):  # no memory for the weights about to be replaced
            new = KernelMoEFeedForward(hidden, ffn, experts, module.top_k, module.capacity_factor)
        new.router, new.w_gate, new.w_up, new.w_down = (module.router, module.w_gate,
                                                        module.w_up, module.w_down)
    else:
        return module
    new.kernels = backend
    return new


def _is_silu(node) -> bool:
    return (isinstance(node, fx.Node) and node.op == "call_function" and node.target is F.silu
            and not node.kwargs.get("inplace", False) and len(node.users) == 1)


def apply_kernels(graph: fx.Graph, backend: str) -> None:
    """Swap the gelu and silu * mul call_function nodes of `graph` for kernel ones (in place; the
    gelu and mul nodes keep their names, so the capture's per-node information still applies)."""
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if (node.target is F.gelu and len(node.args) == 1
                and node.kwargs == {"approximate": "tanh"}):
            node.target, node.kwargs = kernel_gelu, {"backend": backend}
        elif node.target is operator.mul and len(node.args) == 2 and not node.kwargs:
            a, b = node.args
            silu = a if _is_silu(a) else b if _is_silu(b) else None
            other = b if silu is a else a
            if silu is None or not isinstance(other, fx.Node):
                continue
            node.target, node.args = kernel_silu_mul, (silu.args[0], other)
            node.kwargs = {"backend": backend}
            graph.erase_node(silu)
