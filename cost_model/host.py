"""The host's share of a step: eager PyTorch's dispatch of every kernel, and recomputation's bookkeeping.

Host dispatch (`Efficiency.host_kernel_s`): eager PyTorch issues every kernel from the CPU (Python, the
dispatcher, autograd's bookkeeping, a Triton launcher), and the GPU can run no faster than it is fed.
Where a rank's work per kernel is small (a 2048-wide layer at tp 4-8, short sequences) the host sets the
pace: on the lent H200 one layer's forward + backward took 3.6-5.7 ms however little its kernels did
(0.8 ms of GPU work at h 2048, tp 8; benchmarks/gpu_layer_time.py). So a set of ops priced together (a
layer, the embedding, the head: `intra_op.price_assignment`) takes, forward and backward apart,

    max(the sum of its kernels' times, the kernels it launches x host_kernel_s)

(the CPU runs ahead of the GPU within a layer, so a long GEMM hides the dispatch of the small ops around
it). Kernels are counted as the floor counts them, weight-gradient accumulations included
(`intra_op.node_kernels`). host_kernel_s: measured by `autoplan profile` (`profiler.dispatch`), else
HOST_KERNEL_S on a GPU, and 0 on a CPU. On a CPU the host is the device: an op's dispatch runs on the core
that then runs its kernels, so nothing overlaps, and the profile's figure there is what eager training adds
per kernel beyond the bare call its profiled time holds (the module call, autograd's bookkeeping):

    the sum of its kernels' times + the kernels it launches x host_kernel_s

(`host_paced_s` with serial = `Efficiency.host_serial`: True on a CPU).

Recomputation (`Efficiency.host_recompute_s`): a recomputed layer costs the host, per forward kernel of the
layer, r_f in forward (the checkpoint's bookkeeping and, where the kind saves something, torch's selective
checkpointing's Python dispatch mode over every op) and r_b in backward (the re-run's dispatch and the replay
mode's). `intra_op.layer_rerun_s` paces the first with the layer's forward and the second with the re-run's
ops, by `host_paced_s`. On a CPU measured by `autoplan profile` (`profiler.dispatch.measure_recompute_host_s`),
else CPU_RECOMPUTE_S; on a GPU GPU_RECOMPUTE_S, fitted to training steps (below), whatever a profile holds.

The optimizer's host work (`cost_model.optimizer.optimizer_host_time_s`): zero_grad and AdamW's per-tensor
bookkeeping run where the device has nothing queued (after the batch's blocking copy, after the loss is read), so
they add a + b per tensor stepped; `autoplan profile` measures (a, b), else GPU_OPTIMIZER_HOST_S on a GPU.
"""

from __future__ import annotations

from typing import Sequence

# host (CPU) seconds to issue one priced kernel from eager PyTorch, autograd included (module docstring):
# one layer forward + backward of this runtime (Triton kernels) on the lent H200's host, where the GPU work
# is far shorter: the median of (layer time / the 47 (Llama) or 49 (GPT) kernels the model counts) over the
# 13 host-bound layers of benchmarks/data/h200_layer_times.json (GPU busy under 60% of the layer's time;
# 77-121 us, layers of 3.6-5.7 ms)
HOST_KERNEL_S = 75e-6
# (recompute kind, forward, re-run): host seconds per forward kernel of a recomputed layer where no profile
# measured them (`profiler.dispatch.measure_recompute_host_s`: in forward the checkpoint's bookkeeping and, where the
# kind saves something, torch's selective checkpointing's Python dispatch mode over every op; in backward the
# re-run's dispatch and the replay mode's). CPU: CPU_BLOCK on the 2-core development machine, the fastest window by
# thread CPU time (2026-11-26; totals 43.3-44.4 / 133.7-138.2 / 135.9-143.1 us over four runs at load 2-4).
CPU_RECOMPUTE_S = (("full", 10.7e-6, 32.6e-6), ("matmul-only", 58.2e-6, 80.0e-6), ("selective", 59.1e-6, 84.0e-6))
# GPU: fitted to the lent H200's steps of selective against recompute none at the same shapes (2026-11-26,
# benchmarks/data/h200_steps_isolated.json: Llama 1B T2048 b4 +23.2 ms, its forward +24.0 of it; GPT 2.7B T2048 b4
# +22.1 ms) under this pacing: (120, 40) us put both within 1% of the step that recompute none's price misses by.
# An isolated block (`measure_recompute_host_s` on CUDA) read 144 + 260 us on the same machine and priced those
# steps 22-35% over, so a GPU profile's figures are not used. matmul-only runs the same dispatch modes: priced
# as selective. full (plain checkpointing): the eighth session's profile, 116 us in all, split as the CPU splits it.
GPU_RECOMPUTE_S = (("full", 29e-6, 87e-6), ("matmul-only", 120e-6, 40e-6), ("selective", 120e-6, 40e-6))
# (seconds per step, seconds per tensor stepped) the optimizer's host work exposes on a GPU without a profile's figure
# (`cost_model.optimizer.optimizer_host_time_s`): `autoplan profile` on the lent H100 (2026-11-26, its profile
# autoplan/profiles/h100.json; `profiler.memory.measure_optimizer_host_s`)
GPU_OPTIMIZER_HOST_S = (0.678e-3, 1.61e-6)


def host_paced_s(ops: "Sequence[tuple[float, int]]", host_kernel_s: float, serial: bool = False) -> float:
    """Seconds of `ops` run in order, each (its kernels' device seconds d, the kernels k it launches), when
    the host issues one kernel per host_kernel_s h and the device starts an op once its first kernel is
    issued and the op before it is done (module docstring):

        issued_i = h * sum_{j < i} k_j
        end_i    = max(max(end_{i-1}, issued_i + h) + d_i,  issued_i + k_i h + d_i / k_i)
        time     = max(end_n, issued_n + k_n h)

    h = 0 gives sum d; d = 0 gives h sum k; a long op lets the host run ahead, and the short ops it then
    issues wait no more. `serial` (a CPU: the host is the device): sum (d_i + k_i h)."""
    if serial:
        return sum(device_s + kernels * host_kernel_s for device_s, kernels in ops)
    issued = end = 0.0
    for device_s, kernels in ops:
        if kernels == 0:
            end += device_s
            continue
        end = max(max(end, issued + host_kernel_s) + device_s, issued + kernels * host_kernel_s + device_s / kernels)
        issued += kernels * host_kernel_s
    return max(end, issued)
