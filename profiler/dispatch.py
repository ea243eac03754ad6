"""Host dispatch: the CPU time eager PyTorch spends issuing one priced kernel, on a GPU.

    host_kernel_s = median over windows of (window time / iterations) / kernels

where an iteration is one forward + backward of a small Llama block (hidden 256, 4 heads, 2 kv heads,
SwiGLU 512, 128 tokens, bf16) as the runtime runs it (`runtime_block`: its leaves and silu * mul swapped
for the runtime's kernels), and `kernels` is what the cost model counts for that block's nodes
(`cost_model.intra_op.node_kernels` over the block's capture). Its GPU work is a few microseconds per
kernel, so each window's time is the host's: Python, the dispatcher, autograd and the Triton launcher. The
cost model takes max(the kernels' device time, their count x host_kernel_s) for the ops it prices together
(`cost_model.compute`). The median, not the fastest window (`profiler.gemm`): the host's time per layer
varied 3.6-5.7 ms between layers on the lent H200 (benchmarks/gpu_layer_time.py), and a step pays the
typical figure, not the best. CUDA only: a CPU runs each op where it issues it, so its measured op times
hold the dispatch already.
"""

from __future__ import annotations

import statistics

import torch

HOST_BLOCK = dict(hidden=256, heads=4, kv_heads=2, ffn=512, seq=128)
COLUMN = ("q_proj", "k_proj", "v_proj", "fc", "gate_proj", "up_proj")  # Megatron's column-parallel linears
ROW = ("o_proj", "proj", "down_proj")  # row-parallel: their input features split


def runtime_block(config, tp: int, device: torch.device, dtype: torch.dtype, backend: str):
    """Layer 0 of the zoo model `config` as one rank of Megatron's tensor parallelism (no sequence
    parallelism) holds it: column linears out / tp features, row linears in / tp, norms whole; on `device`
    in `dtype`, its leaves and gelu / silu * mul the runtime's kernels of `backend` (`runtime.kernel_ops`),
    parameters normal(0, 0.02). A module of (B, T, h) -> (B, T, h)."""
    import torch.fx as fx
    from torch import nn

    from autoplan.models.gpt import GPTBlock
    from autoplan.models.layers import LEAF_MODULE_TYPES
    from autoplan.models.llama import LlamaBlock, SwiGLUMLP
    from autoplan.runtime.kernel_ops import RopeTables, apply_kernels, kernel_module

    with torch.device("meta"):
        block = LlamaBlock(config, SwiGLUMLP(config.hidden, config.ffn_hidden)) if config.family == "llama" \
            else GPTBlock(config)
    for parent in list(block.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and name in COLUMN + ROW:
                n_in, n_out = child.in_features, child.out_features
                n_in, n_out = (n_in, n_out // tp) if name in COLUMN else (n_in // tp, n_out)
                setattr(parent, name, nn.Linear(n_in, n_out, bias=child.bias is not None, device="meta"))
    block = block.to_empty(device=device).to(dtype)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.02)

    class Leaves(fx.Tracer):
        def is_leaf_module(self, m, qualname):
            return isinstance(m, LEAF_MODULE_TYPES) or super().is_leaf_module(m, qualname)

    graph = Leaves().trace(block)
    apply_kernels(graph, backend)
    module = fx.GraphModule(block, graph)
    tables = RopeTables()
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            swapped = kernel_module(child, backend, tables)
            if swapped is not child:
                setattr(parent, name, swapped)
    return module


def host_block_config():
    """The zoo config of the timed block (`HOST_BLOCK`), one layer."""
    from autoplan.models.config import ModelConfig

    b = HOST_BLOCK
    return ModelConfig("host-dispatch-block", "llama", 1, b["hidden"], b["heads"], b["kv_heads"], b["ffn"], 256,
                       b["seq"])


def block_kernels(config, seq: int) -> int:
    """The kernels the cost model counts for layer 0 of `config`, forward + backward (module docstring)."""
    from autoplan.capture import capture
    from autoplan.cluster import parse_cluster
    from autoplan.cost_model.intra_op import make_context, node_kernels
    from autoplan.mesh import MeshShape
    from autoplan.models import build_model

    graph = capture(build_model(config, "meta", torch.bfloat16), config, 1, seq, torch.bfloat16)
    ctx = make_context(graph, parse_cluster("1xh200"), MeshShape(), 1)
    return sum(sum(node_kernels(n, ctx)) for n in graph.nodes if n.layer == 0)


def measure_host_kernel_s(device: torch.device, quick: bool = False) -> tuple[float, float, int]:
    """(host_kernel_s, seconds per block forward + backward, the block's kernels) on a CUDA `device`
    (module docstring)."""
    from autoplan.profiler.gemm import timed_windows_s

    config = host_block_config()
    block = runtime_block(config, 1, device, torch.bfloat16, "auto")
    x = torch.randn(1, config.max_seq, config.hidden, device=device, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)

    def once() -> None:
        block(x).backward(dy)

    for _ in range(5):  # Triton compiles, the allocator settles
        once()
    windows = timed_windows_s(once, device, repeats=10 if quick else 30, inner=10)
    per_block = statistics.median(windows)
    kernels = block_kernels(config, config.max_seq)
    return per_block / kernels, per_block, kernels
