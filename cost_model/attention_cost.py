"""The attention core's price: flash or materialized attention, and RoPE where the core rotates q and k itself.

    flash          one fused kernel each way, its FLOPs counted in full (4 T^2 d forward, 8 T^2 d backward per
                   head) at the GEMM curve's rate scaled as cuDNN's kernels ran on a GPU (`GPU_FLASH_RATES`),
                   or at a CPU profile's measured SDPA rates (`cost_model.eager.AttentionRates`)
    materialized   Megatron-LM <= 2021 / eager PyTorch: QK^T and PV batched GEMMs with the T x T scores in
                   HBM, a fused scale-mask-softmax, an optional dropout (`attention_kernels`)
    RoPE           per rotated tensor, the passes of the variant that runs (`ROPE_PASSES`)

Each priced per node by `cost_model.intra_op.node_compute_s`; the efficiency, the floor per kernel and the
memory roofline are `cost_model.compute`'s.
"""

from __future__ import annotations

from dataclasses import replace

from autoplan.cluster import DeviceSpec
from autoplan.cost_model.compute import AttentionKernel, Efficiency, gemm_time_s, memory_time_s
from autoplan.profiler.profile import same_device

MASK_BYTES = 1  # a dropout mask element (torch keeps a bool / uint8 mask)


def attention_kernels(kernel: AttentionKernel, itemsize: float) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    """(forward, backward) kernels of the materialized attention core: per kernel (T x T x d GEMMs per
    head it does, bytes per score element it moves); module docstring. Forward: S = QK^T (writes S),
    softmax (reads S, writes P), dropout (reads P, writes P' and a mask), O = P'V (reads P'). Backward:
    dP' = dO V^T (writes), dropout (reads dP' and the mask, writes dP), softmax (reads dP and P, writes
    dS), dQ = dS K, dK = dS^T Q, dV = P'^T dO (each reads its T x T operand)."""
    i = itemsize
    drop_fwd = [(0, 2 * i + MASK_BYTES)] if kernel.dropout else []
    drop_bwd = [(0, 2 * i + MASK_BYTES)] if kernel.dropout else []
    forward = [(1, i), (0, 2 * i)] + drop_fwd + [(1, i)]
    backward = [(1, i)] + drop_bwd + [(0, 3 * i), (1, i), (1, i), (1, i)]
    return forward, backward


def attention_time_s(batch_heads: float, seq: int, head_dim: int, itemsize: float, device: DeviceSpec, dtype: str,
                     efficiency: Efficiency, keys: int | None = None) -> tuple[float, float]:
    """(forward, backward) seconds of the attention core over `batch_heads` (sequence, head) pairs.

    FLOPs are counted in full (4 T^2 d forward, 8 T^2 d backward per head), as Narayanan et al. 2021
    count them. Flash: one kernel each way whose HBM traffic is q, k, v, o (and dO, dq, dk, dv); a causal
    flash kernel skips the masked half of those FLOPs but runs at well below the GEMM rate (FlashAttention-2
    reaches 50-73% of A100 peak forward and less backward, Dao 2023), so the full count is priced from the
    GEMM rate of the device's default curve (`Efficiency.attention_efficiency`: a profile's GEMM sweep does
    not measure it), as cuDNN's kernels ran on a GPU (`default_flash_rates`), or at a CPU profile's measured
    SDPA rates. Materialized: `attention_kernels`, each at its own roofline. `keys`: the keys each query
    attends to (a sliding window's min(T, window); None: all T), the T x keys that stands for T x T above."""
    keys = seq if keys is None else keys
    vectors = batch_heads * seq * head_dim * itemsize  # one of q, k, v, o
    peak = device.peak_flops_for(dtype)
    if efficiency.attention.kind == "flash":
        per_head = 2.0 * seq * keys * head_dim  # one T x keys x d GEMM
        rate = peak * efficiency.attention_efficiency(batch_heads * seq, keys, head_dim, device, dtype)
        measured = _measured_attention_rates(2 * batch_heads * per_head, device, dtype, efficiency)
        fwd_rate, bwd_rate = measured or default_flash_rates(rate, device, efficiency)
        fwd = max(2 * batch_heads * per_head / fwd_rate, memory_time_s(4 * vectors, device, efficiency))
        bwd = max(4 * batch_heads * per_head / bwd_rate, memory_time_s(8 * vectors, device, efficiency))
        return efficiency.kernels_s(fwd, 1), efficiency.kernels_s(bwd, 2)
    scores = batch_heads * seq * keys  # elements of the T x keys tensor

    def run(kernels: list[tuple[int, float]]) -> float:
        total = 0.0
        for gemms, per_score in kernels:
            if gemms:  # a batched T x T x d GEMM: its own operands plus the T x T one
                total += gemm_time_s(seq, keys, head_dim, itemsize, device, dtype, efficiency, batch_heads)
            else:
                total += efficiency.kernels_s(memory_time_s(scores * per_score, device, efficiency))
        return total

    forward, backward = attention_kernels(efficiency.attention, itemsize)
    return run(forward), run(backward)


# (forward, backward) rate of cuDNN's causal flash kernels over the device's default GEMM curve's at the same shape,
# FLOPs counted in full: on the lent H200 (benchmarks/data/h200_layer_times.json: the kernels of 40 runtime layers,
# hidden 2048-12288, tp 1-8, 2048-8192 tokens) the forward ran at 1.09-2.19x the curve (median 1.275: it skips the
# masked half), the backward's kernels (the main one, the dO.O row sums, dQ's reduction and cast) at 0.74-1.39x
# (median 0.87: it recomputes the scores, 5 GEMMs to the forward's 2), taking 2.7-3.2x the forward's time where
# the curve alone priced 2x. Priced so, the median |error| per pass is 6.2% forward, 6.7% backward (the curve alone:
# 27.5% and 14.4%; `python benchmarks/gpu_layer_time.py flash benchmarks/data/h200_layer_times.json`)
GPU_FLASH_RATES = (1.275, 0.87)


def default_flash_rates(rate: float, device: DeviceSpec, efficiency: Efficiency) -> tuple[float, float]:
    """(forward, backward) FLOP/s of the flash kernel where no profile measured it, given `rate`, the GEMM
    curve's at its shape: on a GPU `GPU_FLASH_RATES` x `rate`; on a CPU, or under a flat matmul efficiency
    (every matmul at one rate), both at `rate`."""
    if efficiency.matmul is not None or same_device(device.name, "cpu"):
        return rate, rate
    return rate * GPU_FLASH_RATES[0], rate * GPU_FLASH_RATES[1]


# RoPE inside the attention op (the zoo's attention cores; a Hugging Face model's rotation is captured as ops of its
# own): per pass, (bytes moved per byte of a rotated tensor, kernels per tensor). The runtime's Triton kernel reads
# and writes the tensor once each way (`runtime.kernels.rope`; its cos and sin tables stay in cache); torch's, on a
# CPU (`apply_rope_torch`), negates one half, joins the halves, multiplies by cos and by sin and adds (10 bytes per
# byte in 5 kernels), and its backward multiplies by cos and by sin, negates, joins the halves' gradients and adds
# the two paths (10 in 5)
ROPE_PASSES = {True: ((2.0, 1), (2.0, 1)), False: ((10.0, 5), (10.0, 5))}


def rope_time_s(rotated_bytes: float, tensors: int, device: DeviceSpec, efficiency: Efficiency) -> tuple[float, float]:
    """(forward, backward) seconds of RoPE over `tensors` tensors (q and k: 2) of `rotated_bytes` in all, as
    `ROPE_PASSES` counts the variant that runs, at the `rope` kernel's measured efficiency where a profile
    measured it (`cost_model.kernels`: the Triton kernel on a GPU)."""
    seconds = []
    for (per_byte, kernels), direction in zip(ROPE_PASSES[bool(efficiency.kernels.triton)], ("fwd", "bwd")):
        nbytes, launched = per_byte * rotated_bytes, kernels * tensors
        measured = efficiency.kernels.efficiency("rope", direction, nbytes)
        pass_efficiency = replace(efficiency, memory=measured) if measured is not None else efficiency
        seconds.append(pass_efficiency.kernels_s(memory_time_s(nbytes, device, pass_efficiency, launched), launched))
    return seconds[0], seconds[1]


def _measured_attention_rates(flops: float, device: DeviceSpec, dtype: str, efficiency: Efficiency
                              ) -> tuple[float, float] | None:
    """(forward, backward) FLOP/s of causal SDPA of `flops` forward FLOPs as a profile measured it, each
    at most the best GEMM rate (module docstring); None where the profile measured none in `dtype`."""
    rates = efficiency.attention_rates.rates(flops, dtype) if efficiency.attention_rates is not None else None
    if rates is None:
        return None
    best = device.peak_flops_for(dtype) * efficiency.max_matmul(device, dtype)
    return min(rates[0], best), min(rates[1], best)
