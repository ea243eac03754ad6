"""What one forward keeps for backward, as storages (`Storage`, `Activations`), and what a recompute
policy holds of them (`activation_bytes`, `held_storages`). `cost_model.activations` walks a captured
graph into these; its docstring states the rules.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Mapping

from autoplan.cost_model.ep_margins import ep_imbalance_margins
from autoplan.recompute_policy import KINDS, RecomputePolicy

@dataclass(frozen=True)
class Storage:
    """One allocation made in forward (module docstring)."""

    key: str
    nbytes: float  # on this rank at the capture batch
    batched: bool
    layer: int | None
    family: str
    node: str = ""  # the captured op that makes it (its conversion, cast or internal tensor included)
    routed: bool = False  # per row a rank's spread experts receive: priced with `Activations.margins`


@dataclass(frozen=True)
class Activations:
    """Storages of one forward and who keeps them (module docstring). Parts are "pre", the layer
    indices and "post"."""

    storages: Mapping[str, Storage]
    saved: tuple[tuple[str, object], ...]  # (storage key, part of an op keeping it), graph order
    inputs: Mapping[int, tuple[str, ...]]  # layer -> region inputs
    resident: tuple[str, ...] = ()  # made once per program (RoPE tables), held whatever the policy
    layers: tuple[int, ...] = field(default=())
    margins: tuple[float, float] = (0.0, 0.0)  # on routed storages, held and re-run: the busiest ep rank's
    margin_shape: tuple = ()  # `activations.ep_imbalance_margins`' arguments for `margins` (every layer held)

    @property
    def margined(self) -> bool:
        """Whether the ep routing imbalance margins price some storage (else the same at the mean)."""
        return self.margins != (0.0, 0.0)

    def policy_margins(self, kind: str, recomputed: int) -> tuple[float, float]:
        """The margins under a policy recomputing `recomputed` layers under `kind`: a layer fully recomputed
        holds no routed row after the forward, so the held margin is over the other layers, and the re-run
        one over the recomputed layers (`ep_imbalance_margins`' held_layers, rerun_layers)."""
        if not self.margined or kind == "none" or not recomputed:
            return self.margins
        layers = self.margin_shape[4]
        rerun = min(recomputed, layers)
        held = layers - rerun if not KINDS[kind] else layers  # "full" keeps no op's output of its layers
        return ep_imbalance_margins(*self.margin_shape, held_layers=max(held, 1), rerun_layers=rerun)

    @property
    def boundary_bytes(self) -> float:
        """Bytes at the capture batch crossing a stage boundary: the batched storages a layer reads from
        before it (the residual stream, float32 as the runtime's stages send it), the most of any layer."""
        return max((sum(self.storages[k].nbytes for k in keys if self.storages[k].batched)
                    for keys in self.inputs.values()), default=0.0)

    @functools.cached_property
    def _made(self) -> dict[tuple, list[str]]:
        """(layer, family) -> the storages its ops make."""
        found: dict[tuple, list[str]] = {}
        for storage in self.storages.values():
            found.setdefault((storage.layer, storage.family), []).append(storage.key)
        return found

    def holders(self, kind: str) -> dict[str, object]:
        """{storage key: the first part holding it after forward} with every layer recomputed under
        `kind` (none: nothing recomputed)."""
        recomputed = set(self.layers) if kind != "none" else set()
        holders = [(key, part) for key, part in self.saved if part not in recomputed]
        for layer in sorted(recomputed):
            holders += [(key, layer) for key in self.inputs.get(layer, ())]
            holders += [(key, layer) for family in KINDS[kind] for key in self._made.get((layer, family), ())]
        order = {part: i for i, part in enumerate(("pre", *self.layers, "post"))}
        first: dict[str, object] = dict.fromkeys(self.resident, "pre")
        for key, part in sorted(holders, key=lambda kp: order[kp[1]]):
            first.setdefault(key, part)
        return first

    @functools.cached_property
    def _held(self) -> dict[str, tuple[dict, dict]]:
        return {}

    def held(self, kind: str, margins: tuple[float, float] | None = None) -> tuple[dict, dict]:
        """({part: [batched, fixed] bytes held after forward}, {layer: [batched, fixed] transient})
        with every layer recomputed under `kind` (none: nothing recomputed), the routed rows under
        `margins` (None: `self.margins`, every layer held and re-run; `policy_margins`); computed once per
        kind and margins (callers must not change the lists)."""
        key = (kind, self.margins if margins is None else margins)
        if key not in self._held:
            self._held[key] = self._held_now(*key)
        return self._held[key]

    def _held_now(self, kind: str, margins: tuple[float, float]) -> tuple[dict, dict]:
        recomputed = set(self.layers) if kind != "none" else set()
        first = self.holders(kind)
        kept: dict[object, list] = {part: [0.0] * 4 for part in ("pre", *self.layers, "post")}
        for key, part in first.items():
            _add(kept[part], self.storages[key])
        transient: dict[object, list] = {layer: [0.0] * 4 for layer in recomputed}
        for key, part in set(self.saved):
            if part in recomputed and key not in first:
                _add(transient[part], self.storages[key])
        return ({part: _margined(q, margins[0]) for part, q in kept.items()},
                {part: _margined(q, margins[1]) for part, q in transient.items()})


def _add(quad: list, storage: Storage) -> None:
    """Add a storage's bytes to [batched, fixed, routed batched, routed fixed]."""
    quad[(0 if storage.batched else 1) + (2 if storage.routed else 0)] += storage.nbytes


def _margined(quad: list, margin: float) -> list:
    """[batched, fixed] bytes, the routed ones times (1 + margin): the busiest ep rank's. Each sum is of
    whole bytes before the one product, so it does not depend on the order storages were added in."""
    return [quad[0] + quad[2] * (1 + margin), quad[1] + quad[3] * (1 + margin)]


def activation_bytes(acts: Activations, policy: RecomputePolicy, scale: float = 1.0) -> tuple[float, float]:
    """(bytes held after one forward, the largest transient while a layer is re-run) at `scale` times
    the capture batch: the layers `policy` recomputes as `held(kind)` says, the others as "none"."""
    recomputed = set(policy.recomputed_layers(len(acts.layers)))
    margins = acts.policy_margins(policy.kind, len(recomputed))
    none, _ = acts.held("none", margins)
    kept, transient = acts.held(policy.kind, margins)
    total = sum(_at(kept[p] if p in recomputed else none[p], scale) for p in none)
    peak = max((_at(transient[i], scale) for i in recomputed), default=0.0)
    return total, peak


def _at(pair: list, scale: float) -> float:
    return pair[0] * scale + pair[1]


def held_storages(acts: Activations, policy: RecomputePolicy) -> list[Storage]:
    """The storages held after forward under `policy` (`activation_bytes`' held bytes, one by one, at the
    mean over an ep group: `Storage.nbytes`)."""
    recomputed = set(policy.recomputed_layers(len(acts.layers)))
    none, kind = acts.holders("none"), acts.holders(policy.kind)
    keys = {k for k, part in none.items() if part not in recomputed}
    keys |= {k for k, part in kind.items() if part in recomputed}
    return [acts.storages[k] for k in sorted(keys)]
