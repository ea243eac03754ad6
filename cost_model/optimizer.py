"""The optimizer step's price: torch's AdamW as the runtime runs it, pass by pass.

The optimizer step, per local parameter, moves the bytes of torch's AdamW as it runs (single-tensor
on CPU, foreach on CUDA: the same passes, `adamw_step_bytes`), its states (m, v, the fp32 weights or
their fp32 master, one temporary for the denominator) 4 bytes each and its gradient g bytes:

    decay w *= 1 - lr wd           read w, write w          8
    m.lerp_(g, 1 - b1)             read m and g, write m    8 + g
    v *= b2; v.addcmul_(g, g)      two passes over v        16 + g
    d = sqrt(v) / c2 + eps         three passes into d      24
    w.addcdiv_(m, d, -step)        read w, m, d, write w    16        -> 72 + 2 g
    + the gradient norm the runtime takes before the step (`runtime.health`: g), and under mixed
      precision the master cast into the weights (4 + weight bytes)

(the plain fp32 step: 84 bytes per parameter, 3.5 times the 24 of one pass over weights, gradients,
m and v; torch 2.13's AdamW on one CPU thread, over the 10M parameters of benchmarks/step_fidelity.py's
models, took the time of 80 to 130 bytes per parameter at the profile's copy bandwidth).

Those passes run tensor by tensor, at the bandwidth of the tensor's size (`adamw_time_s`), where a CPU
profile measured fresh-allocation copies by size (`cost_model.eager`): the three passes into d write
temporaries that torch allocates (sqrt, the division), at the fresh-copy curve read at the tensor's fp32
bytes; the in-place passes at the faster of that and the flat copy (a small tensor's passes after the
first find it in cache, as a small fresh copy's destination is; a large one streams as the flat 256 MiB
copy does, without the fresh allocation's page faults). The tensor's size: `StepModel.optimizer_s`'s
representative tensor. Without the curve (GPUs, older profiles): every pass at the flat copy.

On CUDA a profile measures AdamW itself (`profiler.memory.measure_adamw_rate`: bytes per second of the passes
`adamw_pass_bytes` counts), and the whole step is priced at that rate.

The host's work per tensor (`optimizer_host_time_s`): the runtime clears the gradients right after the batch's
blocking copy and steps right after it reads the loss and gradient norm, each time with nothing queued on the
device, so what the host does per parameter tensor before the first kernel is exposed: a + b n for n tensors
stepped, measured by `autoplan profile` (`profiler.memory.measure_optimizer_host_s`), else `host.GPU_OPTIMIZER_HOST_S` on
a GPU and nothing on a CPU. The tensors stepped (`stepped_tensors`): the stage's parameter tensors, or, where
the optimizer steps on the fp32 masters of the gradient buckets (ZeRO 1/2, bf16-master: `runtime.grad_sync`),
the buckets, one per GRAD_BUCKET_BYTES of fp32 gradients and at most one per tensor.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from autoplan.cost_model.compute import memory_time_s
from autoplan.grad_buckets import GRAD_BUCKET_BYTES, bucket_count

if TYPE_CHECKING:
    from autoplan.cluster import DeviceSpec
    from autoplan.cost_model.compute import Efficiency

ADAM_STATE_BYTES = 4  # m, v, the master weights and the denominator's temporary: fp32 in torch's AdamW


def adamw_pass_bytes(grad_bytes: float) -> float:
    """Bytes torch's AdamW passes move per parameter (module docstring): 72 + 2 g."""
    return 18 * ADAM_STATE_BYTES + 2 * grad_bytes


def adamw_step_bytes(grad_bytes: float, weight_bytes: float) -> float:
    """Bytes the optimizer step moves per local parameter (module docstring): torch's AdamW passes
    (`adamw_pass_bytes`), the gradient norm before it (g), and the master's cast into weights narrower than fp32."""
    cast = ADAM_STATE_BYTES + weight_bytes if weight_bytes < ADAM_STATE_BYTES else 0.0
    return adamw_pass_bytes(grad_bytes) + grad_bytes + cast


ADAMW_FRESH_BYTES = 6 * ADAM_STATE_BYTES  # d = sqrt(v) / c2 + eps: its three passes, into fresh temporaries


def adamw_time_s(params: float, grad_bytes: float, weight_bytes: float, tensor_params: float, device: DeviceSpec,
                 efficiency: Efficiency) -> float:
    """Seconds of the optimizer step over `params` local parameters in tensors of `tensor_params` each (module
    docstring): the temporaries' bytes at the fresh-copy curve at the tensor's fp32 bytes, the rest at the faster
    of that and the flat copy; all at the flat copy where no curve was measured; all at the AdamW rate a profile
    measured where it has one (`profiler.memory.measure_adamw_rate`, CUDA). One kernel's floor at least."""
    total = adamw_step_bytes(grad_bytes, weight_bytes) * params
    if efficiency.adamw_bytes_per_s:
        return efficiency.kernels_s(total / efficiency.adamw_bytes_per_s)
    curve = efficiency.fresh_copies
    if curve is None:
        return efficiency.kernels_s(memory_time_s(total, device, efficiency))
    fresh = curve.bandwidth(tensor_params * ADAM_STATE_BYTES)
    in_place = max(device.memory_bandwidth_bytes_per_s, fresh)
    temporaries = ADAMW_FRESH_BYTES * params
    seconds = (total - temporaries) / in_place + temporaries / fresh
    return efficiency.kernels_s(seconds / efficiency.memory)


def stepped_tensors(tensors: float, params: float, masters: bool) -> float:
    """The tensors AdamW steps over a stage's `tensors` parameter tensors of `params` local parameters (module
    docstring): the tensors themselves, or under `masters` the fp32 master buckets."""
    if not masters or tensors == 0:
        return tensors
    return min(tensors, bucket_count(params * ADAM_STATE_BYTES, GRAD_BUCKET_BYTES))


def optimizer_host_time_s(tensors: float, efficiency: Efficiency) -> float:
    """Seconds the optimizer's host work exposes per step over `tensors` stepped (module docstring): a + b n, none
    without tensors."""
    per_step, per_tensor = efficiency.optimizer_host_s or (0.0, 0.0)
    return per_step + per_tensor * tensors if tensors else 0.0
