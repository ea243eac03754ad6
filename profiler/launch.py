"""The launch floor: the shortest time a kernel takes on this device when the runtime issues kernels
one after another from eager PyTorch.

    kernel_floor_s = the fastest timed window's (window time / calls), each call `x.add_(1)` on a
                     one-element tensor

The device's work is nil, so what is timed is the launch path: the framework's dispatch, the driver's
submission and the device's start of a kernel, whichever is slowest; on CUDA the windows are timed by
events on the stream (`profiler.gemm.timed_windows_s`), so the device idling between launches counts,
as it does in training. On a CPU it is the dispatch of a tiny eager op. The cost model takes it as the
floor of every kernel (`cost_model.compute`: no kernel takes less); without a profile it assumes 7 us.
"""

from __future__ import annotations

import torch

from autoplan.profiler.gemm import fastest_call_s


def measure_kernel_floor(device: torch.device, quick: bool = False, budget_s: float | None = None) -> float:
    """Seconds per back-to-back launch of a kernel that does nothing measurable, its fastest window (module docstring)."""
    budget_s = budget_s if budget_s is not None else (0.05 if quick else 0.2)
    x = torch.zeros(1, device=device)  # one element: the kernel's own work is nil
    with torch.no_grad():
        return fastest_call_s(lambda: x.add_(1.0), device, budget_s)
