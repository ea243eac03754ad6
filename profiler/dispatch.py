"""Host dispatch: the CPU time eager PyTorch spends issuing one priced kernel, on a GPU.

    host_kernel_s = median over windows of (window time / iterations) / kernels

where an iteration is one forward + backward of a Llama block of Llama 3 8B's width and few tokens (hidden
4096, 32 heads, 8 kv heads, SwiGLU 14336, 64 tokens, bf16) as the runtime runs it (`runtime_block`: its leaves and silu * mul swapped
for the runtime's kernels), and `kernels` is what the cost model counts for that block's nodes
(`cost_model.intra_op.node_kernels` over the block's capture). Its GPU work is about 0.1 ms of a 3-4 ms
iteration, so each window's time is the host's: Python, the dispatcher, autograd and the Triton launcher.
Why this width: on the lent H200 the host's time per kernel grew with the block's width though the GPU
stayed idle (67.6 us at hidden 256 and 128 tokens, 78.7-91.3 us at hidden 1024-8192 with 16-128 tokens;
benchmarks/data/h200_host_dispatch.json), and a 256-wide block priced the host-bound layers of
benchmarks/gpu_layer_time.py up to 25% fast. The
cost model takes max(the kernels' device time, their count x host_kernel_s) for the ops it prices together
(`cost_model.compute`). The median, not the fastest window (`profiler.gemm`): the host's time per layer
varied 3.6-5.7 ms between layers on the lent H200 (benchmarks/gpu_layer_time.py), and a step pays the
typical figure, not the best. CUDA only: a CPU runs each op where it issues it, so its measured op times
hold the dispatch already, up to the launch floor's bare op call.

On a CPU the host is the device: every op's dispatch (the module call, the dispatcher, autograd's
bookkeeping, the allocator) runs on the core that then runs its kernel, one after the other. A profiled
kernel (a GEMM, a copy, the floor's one-element add) is timed as a bare call, which holds the dispatch of
a bare op; what eager training adds per kernel beyond it is measured on a block whose kernels do nothing
measurable (`measure_cpu_dispatch_s`, `CPU_BLOCK`: a Llama block of hidden 64, 8 tokens, fp32):

    host_kernel_s (CPU) = max(0, fastest window's (block forward + backward) / kernels - kernel_floor_s)

and the cost model adds it to each kernel's time (`cost_model.host.host_paced_s`, serial). On the
2-core development machine (2026-11-26, one thread a rank, both ranks at once; three profiles): 9.0-11.4 us
per kernel over a 1.8 us floor.
"""

from __future__ import annotations

import statistics

import torch

HOST_BLOCK = dict(hidden=4096, heads=32, kv_heads=8, ffn=14336, seq=64)
CPU_BLOCK = dict(hidden=64, heads=4, kv_heads=2, ffn=128, seq=8)
COLUMN = ("q_proj", "k_proj", "v_proj", "fc", "gate_proj", "up_proj")  # Megatron's column-parallel linears
ROW = ("o_proj", "proj", "down_proj")  # row-parallel: their input features split


def runtime_block(config, tp: int, device: torch.device, dtype: torch.dtype, backend: str):
    """Layer 0 of the zoo model `config` as one rank of Megatron's tensor parallelism (no sequence
    parallelism) holds it: column linears out / tp features, row linears in / tp, norms whole; on `device`
    in `dtype`, its leaves and gelu / silu * mul the runtime's kernels of `backend` (`runtime.kernel_ops`),
    parameters normal(0, 0.02). A module of (B, T, h) -> (B, T, h)."""
    from torch import nn

    from autoplan.capture.fx import trace_model
    from autoplan.models.gpt import GPTBlock
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
    module, tables = trace_model(block), RopeTables()  # the capture's leaves, swapped as runtime.rewrite does
    for node in module.graph.nodes:
        if node.op == "call_module":
            module.set_submodule(node.target, kernel_module(module.get_submodule(node.target), backend, tables))
    apply_kernels(module.graph, backend)
    module.recompile()
    return module


def host_block_config(b: dict = HOST_BLOCK):
    """The zoo config of the timed block (`HOST_BLOCK`, or `CPU_BLOCK`), one layer."""
    from autoplan.models.config import ModelConfig

    return ModelConfig("host-dispatch-block", "llama", 1, b["hidden"], b["heads"], b["kv_heads"], b["ffn"], 256,
                       max(b["seq"], 2048))


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


def measure_host_kernel_s(device: torch.device, quick: bool = False, config=None, seq: int | None = None
                          ) -> tuple[float, float, int, tuple[float, float]]:
    """(host_kernel_s, seconds per block forward + backward, the block's kernels, (forward, backward) host
    seconds per priced kernel of each pass) on a CUDA `device` (module docstring); `config` / `seq`: another
    zoo config's layer 0 at `seq` tokens (default HOST_BLOCK). The passes apart:

        forward  = median window of the forward alone / its kernels (`forward_kernels`)
        backward = (per_block - the forward's window) / the rest of the block's kernels

    Forward runs the captured graph node by node from Python (the fx module, autocast, the Triton launchers);
    backward runs from autograd's engine, so its kernels can cost the host less each."""
    from autoplan.profiler.gemm import timed_windows_s

    config = config or host_block_config()
    seq = seq or HOST_BLOCK["seq"]
    block = runtime_block(config, 1, device, torch.bfloat16, "auto")
    x = torch.randn(1, seq, config.hidden, device=device, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)

    def once() -> None:
        block(x).backward(dy)

    for _ in range(5):  # Triton compiles, the allocator settles
        once()
    repeats = 10 if quick else 30
    per_block = statistics.median(timed_windows_s(once, device, repeats=repeats, inner=10))
    forward_s = statistics.median(timed_windows_s(lambda: block(x), device, repeats=repeats, inner=10))
    kernels, forward = block_kernels(config, seq), forward_kernels(config, seq)
    phases = (forward_s / forward, max(0.0, per_block - forward_s) / max(1, kernels - forward))
    return per_block / kernels, per_block, kernels, phases


def forward_kernels(config, seq: int) -> int:
    """The kernels the cost model counts for layer 0 of `config`'s forward (`block_kernels`' first half)."""
    from autoplan.capture import capture
    from autoplan.cluster import parse_cluster
    from autoplan.cost_model.intra_op import make_context, node_kernels
    from autoplan.mesh import MeshShape
    from autoplan.models import build_model

    graph = capture(build_model(config, "meta", torch.bfloat16), config, 1, seq, torch.bfloat16)
    ctx = make_context(graph, parse_cluster("1xh200"), MeshShape(), 1)
    return sum(node_kernels(n, ctx)[0] for n in graph.nodes if n.layer == 0)


def recompute_block(device: torch.device) -> tuple[object, int, torch.dtype]:
    """(config, tokens, dtype) of the block `measure_recompute_host_s` times on `device`: HOST_BLOCK in bf16
    on a GPU, CPU_BLOCK in fp32 on a CPU (as the host dispatch is measured there)."""
    if device.type == "cuda":
        return host_block_config(), HOST_BLOCK["seq"], torch.bfloat16
    return host_block_config(CPU_BLOCK), CPU_BLOCK["seq"], torch.float32


def measure_recompute_host_s(device: torch.device, quick: bool = False) -> dict[str, tuple[float, float]]:
    """{recompute kind: (forward, re-run) host seconds per priced forward kernel of a recomputed layer}, on any
    device:

        forward = (block forward under the kind - plain forward) / K
        re-run  = (block forward + backward under the kind - plain forward + backward) / K - forward

    with K the block's forward kernels (`forward_kernels`), the block run as `runtime.recompute.recompute` runs
    it, and its device work small (`recompute_block`), so that what is timed is the host's: in forward the
    checkpoint's bookkeeping and, under a kind that saves something, selective checkpointing's Python dispatch
    mode over every op; in backward the re-run's dispatch and, under such a kind, the replay mode's. Times: the
    median window on CUDA (as `measure_host_kernel_s`), the fastest on a CPU (as `measure_cpu_dispatch_s`: a
    difference of two timings on a shared machine). The cost model pays the forward share with the layer's
    forward and the re-run share with its re-run, each as a host/device pipeline on a GPU and one after the
    other on a CPU (`cost_model.intra_op.layer_rerun_s`)."""
    from autoplan.profiler.gemm import fastest_call_s, timed_windows_s
    from autoplan.recompute_policy import KINDS
    from autoplan.runtime.recompute import recompute

    config, seq, dtype = recompute_block(device)
    block = runtime_block(config, 1, device, dtype, "auto")
    x = torch.randn(1, seq, config.hidden, device=device, dtype=dtype, requires_grad=True)
    dy = torch.randn_like(x)

    def timed(kind: str, backward: bool) -> float:
        saves = tuple(sorted(KINDS[kind]))
        forward = (lambda: block(x)) if kind == "none" else (lambda: recompute(block, x, saves=saves))
        run = (lambda: forward().backward(dy)) if backward else forward
        if device.type != "cuda":
            return fastest_call_s(run, device, 0.1 if quick else 0.3)
        for _ in range(5):
            run()
        return statistics.median(timed_windows_s(run, device, repeats=5 if quick else 15, inner=10))

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the host's time is one thread's; a CPU's pool only adds waits to tiny ops
    try:
        plain = (timed("none", False), timed("none", True))
        extra = {kind: (timed(kind, False) - plain[0], timed(kind, True) - plain[1]) for kind in KINDS if kind != "none"}
    finally:
        torch.set_num_threads(threads)
    kernels = forward_kernels(config, seq)
    return {kind: (max(0.0, f) / kernels, max(0.0, total - max(0.0, f)) / kernels) for kind, (f, total) in extra.items()}


def measure_cpu_dispatch_s(device: torch.device, kernel_floor_s: float, quick: bool = False
                           ) -> tuple[float, float, int]:
    """(host_kernel_s, seconds per block forward + backward, the block's kernels) on a CPU: `CPU_BLOCK`'s
    fastest window, per kernel, less the launch floor each kernel's profiled time already holds (module
    docstring)."""
    from autoplan.profiler.gemm import fastest_call_s

    config, seq = host_block_config(CPU_BLOCK), CPU_BLOCK["seq"]
    block = runtime_block(config, 1, device, torch.float32, "auto")
    x = torch.randn(1, seq, config.hidden, device=device, requires_grad=True)
    dy = torch.randn_like(x)
    per_block = fastest_call_s(lambda: block(x).backward(dy), device, 0.1 if quick else 0.5)
    kernels = block_kernels(config, seq)
    return max(0.0, per_block / kernels - kernel_floor_s), per_block, kernels
