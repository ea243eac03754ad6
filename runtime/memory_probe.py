"""What one forward leaves for backward on this rank, measured exactly on any device.

A dispatch mode sees every op the forward runs (inside recomputed regions and under autocast too) and
records each storage an op makes that is not a view of its inputs' storages (a DTensor's: its local
tensor's, the bytes this rank holds). After the forward,

    saved_bytes   the bytes of those storages still alive: what autograd, checkpoints and their
                  caches hold for backward. Left out: storages made from parameters alone (autocast's
                  weight copies, parameter views; FSDP2's gathered parameters count as parameters), those the forward returns (the loss), and the
                  inputs, which the caller made
    hooked_bytes  the part of saved_bytes that `torch.autograd.graph.saved_tensors_hooks` sees (ops
                  outside recomputed regions, and the regions' inputs): equal to saved_bytes when
                  nothing is recomputed, which tests check as a second view of the same quantity

    copied_bytes  the storages made from parameters alone that the forward saved for backward and are
                  alive after it (autocast's weight copies; not FSDP2's gathered parameters): what the
                  memory model prices as weight copies (`cost_model.memory`, plan precision "autocast")

and while `backward` runs,

    recompute_bytes  the most bytes made by re-running one recomputed region that are alive when its
                     re-run ends (what the region's backward then holds besides the saved bytes).

An op runs in a recomputed region's re-run when it runs during backward inside a run of a recomputed
region (`runtime.recompute.watch_regions`: the zoo's `recompute_<layer>_<i>` modules and the module
runtime's blocks alike); the re-run ends when that run returns.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from autoplan.runtime.recompute import watch_regions


# gloo's worker threads drop their references to a collective's tensors a moment after the call
# returns; without a pause a snapshot may count a buffer that is already garbage (seen as a rank's
# +1-3 activation-sized tensors, now and then). 5 ms is ample on these machines.
SETTLE_S = 0.005


def _settle() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        time.sleep(SETTLE_S)


@dataclass(frozen=True)
class MeasuredMemory:
    """Bytes on this rank (module docstring)."""

    saved_bytes: int
    hooked_bytes: int
    recompute_bytes: int
    copied_bytes: int = 0


def _storage(t: torch.Tensor) -> torch.UntypedStorage:
    """The storage that holds `t`'s bytes on this rank: a DTensor's local tensor's (the module runtime's
    activations and parameters; the wrapper's own storage is a stand-in of the global size)."""
    while isinstance(t, DTensor):
        t = t._local_tensor
    return t.untyped_storage()


def _key(t: torch.Tensor) -> int:
    return _storage(t)._cdata


class _StorageTracker(TorchDispatchMode):
    """Records the storages each op makes, by phase: "forward", "recompute" or "backward"."""

    def __init__(self, params: Iterable[torch.Tensor]) -> None:
        super().__init__()
        self.from_params = {_key(p) for p in params}
        self.parameters = set(self.from_params)  # the parameters' own storages (FSDP2's gathered ones too)
        self.made: dict[int, tuple[StorageWeakRef, int, str]] = {}  # key -> (ref, bytes, phase)
        self.backward = False
        self.regions = 0  # region calls open
        self.recompute_bytes = 0

    def in_backward(self) -> bool:
        return self.backward

    def phase(self) -> str:
        if not self.in_backward():
            return "forward"
        return "recompute" if self.regions else "backward"

    def note_parameters(self, module: nn.Module, _args) -> None:
        """The parameters `module` runs with, as parameters: FSDP2 swaps gathered (unsharded) ones in
        before its forward, so a cast of them is a weight copy, left out as on an unsharded model."""
        keys = {_key(p) for p in module.parameters(recurse=False)}
        self.from_params.update(keys)
        self.parameters.update(keys)

    def enter_region(self) -> None:
        self.regions += 1

    def exit_region(self, output) -> None:
        self.regions -= 1
        if self.in_backward():  # a re-run ends: what it made and still holds (but the outputs the
            # re-run drops on return) is the region's backward's
            _settle()
            dropped = {_key(t) for t in tree_leaves(output) if isinstance(t, torch.Tensor)}
            held = sum(n for k, n in self.live("recompute").items() if k not in dropped)
            self.recompute_bytes = max(self.recompute_bytes, held)
            self.made = {k: v for k, v in self.made.items() if v[2] != "recompute" or not v[0].expired()}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view:  # a view allocates nothing (a DTensor's detach may wrap its bytes in a new storage object)
            return out
        phase = self.phase()
        inputs = {_key(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        derived = bool(inputs) and inputs <= self.from_params
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and _key(t) not in inputs:
                self._record(t, derived, phase)
        return out

    def _record(self, t: torch.Tensor, derived: bool, phase: str) -> None:
        key, old = _key(t), self.made.get(_key(t))
        if derived:
            self.from_params.add(key)
        elif old is None or old[0].expired():  # a new storage (an address may be reused once freed)
            self.from_params.discard(key)
            storage = _storage(t)
            self.made[key] = (StorageWeakRef(storage), storage.nbytes(), phase)

    def live(self, phase: str) -> dict[int, int]:
        return {k: n for k, (ref, n, p) in self.made.items() if p == phase and not ref.expired()}

    def live_bytes(self, phase: str) -> int:
        return sum(self.live(phase).values())


@contextlib.contextmanager
def _watch_regions(tracker: _StorageTracker, module: nn.Module | None) -> Iterator[None]:
    handles = [sub.register_forward_pre_hook(tracker.note_parameters)
               for sub in (module.modules() if module is not None else ())
               if any(True for _ in sub.parameters(recurse=False))]
    try:
        with watch_regions(tracker):  # the runs of both runtimes' recomputed regions (runtime.recompute)
            yield
    finally:
        for handle in handles:
            handle.remove()


def measure_saved_bytes(forward: Callable[[], torch.Tensor], module: nn.Module,
                        backward: bool = True) -> tuple[torch.Tensor, MeasuredMemory]:
    """Run `forward()` (returning the loss) of `module` (whose parameters are left out and whose
    recomputed regions are watched) and, with `backward`, `loss.backward()`, measuring what the
    forward leaves for backward (module docstring); returns (loss, MeasuredMemory)."""
    tracker, packed = _StorageTracker(p for _, p in module.named_parameters()), set()
    copies: dict[int, tuple[StorageWeakRef, int]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = _key(t)
        packed.add(key)
        if key in tracker.from_params and key not in tracker.parameters:  # a weight copy, saved
            copies[key] = (StorageWeakRef(_storage(t)), _storage(t).nbytes())
        return t

    with tracker, _watch_regions(tracker, module):
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = forward()
        _settle()
        returned = {_key(t) for t in tree_leaves(loss) if isinstance(t, torch.Tensor)}
        live = {k: n for k, n in tracker.live("forward").items() if k not in returned}
        copied = sum(n for ref, n in copies.values() if not ref.expired())
        tracker.backward = True
        if backward:
            loss.backward()
    hooked = sum(n for k, n in live.items() if k in packed)
    return loss, MeasuredMemory(sum(live.values()), hooked, tracker.recompute_bytes, copied)


class _StepTracker(_StorageTracker):
    """`_StorageTracker` over a whole pipelined step, whose forwards and backwards interleave: an op
    runs in backward when the autograd engine runs it (a graph task is current). Samples the bytes the
    forwards made that are alive after each stage's forward."""

    def __init__(self, params: Iterable[torch.Tensor]) -> None:
        super().__init__(params)
        self.peak_bytes = 0

    def in_backward(self) -> bool:
        return torch._C._current_graph_task_id() != -1

    def sample(self) -> None:
        _settle()
        self.peak_bytes = max(self.peak_bytes, self.live_bytes("forward"))
        self.made = {k: v for k, v in self.made.items() if not v[0].expired()}


def measure_step_peak(step: Callable[[], object], module: nn.Module, stages: Iterable[nn.Module]) -> MeasuredMemory:
    """Run `step()` (a pipelined training step of `module`, whose stage modules are `stages`) and measure
    on this rank, as `measure_saved_bytes` does for one forward (parameters and what is made from them
    alone left out): `saved_bytes` the most bytes the step's forwards left alive at once, sampled after
    each stage forward (the microbatches in flight, and the pipeline's own buffers made in the step);
    `recompute_bytes` the most a recomputed region's re-run holds as it ends; `hooked_bytes` 0."""
    tracker = _StepTracker(p for _, p in module.named_parameters())
    handles = [stage.register_forward_hook(lambda *_: tracker.sample()) for stage in stages]
    try:
        with tracker, _watch_regions(tracker, module):
            step()
    finally:
        for handle in handles:
            handle.remove()
    return MeasuredMemory(tracker.peak_bytes, 0, tracker.recompute_bytes)
