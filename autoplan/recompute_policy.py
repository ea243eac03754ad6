"""Recompute policies: which transformer layers backward re-runs, and which ops' outputs such a layer
keeps, as one value that the runtime applies and the cost model prices.

A recomputed layer is one region (the whole block, as torchtitan applies torch's selective
activation checkpointing): forward keeps the region's inputs and the outputs of the ops whose family
the policy saves, and nothing else of the region; backward re-runs the region's forward, taking
those saved outputs from the cache instead of re-running their ops, and then differentiates it.
Because the region is the whole block, the tensors a consumer saves as its input are covered too
(the o_proj input is the attention output: both are in the block).

    policy          saves in a recomputed layer            layers recomputed
    none            (nothing is recomputed)                none
    selective       matmul and attention outputs           every layer
    matmul-only     matmul outputs (the attention core     every layer
                    is recomputed too)
    full            nothing                                every layer
    full:<k>        nothing                                the first k layers (Megatron's
                                                           --recompute-num-layers with pp = 1)

"<kind>:<k>" recomputes the first k layers of the model under any kind; the search tries it with
"full". The first layers are the ones whose activations live longest under 1F1B.

Op families, the words both sides use (`aten_op_family` for the runtime's aten ops,
`captured_op_family` for the captured graph's op kinds):

    matmul      mm, addmm, bmm, baddbmm (every linear and expert GEMM)
    attention   the fused scaled-dot-product attention kernels (output and log-sum-exp)
    collective  c10d collectives: never saved. The runtime issues them in place (`dist.all_reduce`
                on its own buffer), which a cache cannot replay, so a recomputed layer re-runs its
                forward collectives in backward, in the same order on every rank
    other       everything else: norms, pointwise ops, casts, copies, views, routing
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from autoplan.errors import PlanError

FAMILIES = ("matmul", "attention", "collective", "other")
KINDS = {"none": frozenset(), "selective": frozenset({"matmul", "attention"}),
         "matmul-only": frozenset({"matmul"}), "full": frozenset()}
SEARCHED = ("none", "selective", "matmul-only", "full")  # the kinds the search tries on every layer
MATMUL_OPS = frozenset({"mm", "addmm", "bmm", "baddbmm", "addbmm", "_grouped_mm"})
ATTENTION_OPS = frozenset({
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_fused_attention_overrideable", "_flash_attention_forward",
    "_efficient_attention_forward"})
COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd")
CAPTURED_FAMILIES = {"linear": "matmul", "moe": "matmul", "attention": "attention"}


def aten_op_family(op: str) -> str:
    """The family of a dispatched op named "<namespace>.<name>" (`str(OpOverload.overloadpacket)`,
    e.g. "aten.mm", "c10d.allreduce_")."""
    namespace, _, name = op.partition(".")
    if namespace in COLLECTIVE_NAMESPACES:
        return "collective"
    if namespace == "aten" and name in MATMUL_OPS:
        return "matmul"
    if namespace == "aten" and name in ATTENTION_OPS:
        return "attention"
    return "other"


def captured_op_family(op_kind: str) -> str:
    """The family of a captured node's op kind (`autoplan.capture.graph.OP_KINDS`) as a whole: a linear
    is its GEMM, a MoE its expert GEMMs, attention its fused kernel; the cost model prices time by it."""
    return CAPTURED_FAMILIES.get(op_kind, "other")


@dataclass(frozen=True)
class RecomputePolicy:
    """What backward re-runs (module docstring). `layers`: how many layers, from the first, are
    recomputed (None: every layer)."""

    kind: str
    layers: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise PlanError(f"recompute {self.kind!r}: the kind must be one of {list(KINDS)}; write "
                            f"'<kind>' or '<kind>:<layers>', e.g. 'selective' or 'full:4'")
        if self.layers is not None and (self.layers < 1 or self.kind == "none"):
            raise PlanError(f"recompute {self.kind}:{self.layers}: the layer count must be >= 1 and "
                            f"the kind not 'none'; write 'none' to recompute nothing")

    @property
    def name(self) -> str:
        """The text a Plan carries: "selective", "full:4"."""
        return self.kind if self.layers is None else f"{self.kind}:{self.layers}"

    @property
    def saves(self) -> frozenset[str]:
        """The op families whose outputs a recomputed layer keeps."""
        return KINDS[self.kind]

    def saves_family(self, family: str) -> bool:
        return family in self.saves

    def recomputed_layers(self, num_layers: int) -> range:
        """The layers backward re-runs, of a model of `num_layers`."""
        if self.kind == "none":
            return range(0)
        return range(num_layers if self.layers is None else min(self.layers, num_layers))

    def recomputes(self, layer: int | None, num_layers: int) -> bool:
        """Whether `layer` (None: outside every layer) is re-run in backward."""
        return layer is not None and layer in self.recomputed_layers(num_layers)

    def sort_key(self) -> tuple[int, float]:
        """Order between policies of equal cost: less recomputed first (the order of `KINDS`)."""
        return list(KINDS).index(self.kind), float("inf") if self.layers is None else self.layers

    def describe(self) -> str:
        """One line for `autoplan explain`."""
        if self.kind == "none":
            return "none: every op keeps what its backward needs"
        which = "every layer" if self.layers is None else f"the first {self.layers} layers"
        kept = " and ".join(sorted(self.saves)) + " outputs" if self.saves else "only its inputs"
        return f"{self.name}: {which} re-run in backward, each keeping {kept}"


def recompute_policy(text: str | RecomputePolicy) -> RecomputePolicy:
    """The policy named by `text` ("selective", "full", "full:4"; module docstring)."""
    if isinstance(text, RecomputePolicy):
        return text
    if not isinstance(text, str):
        raise PlanError(f"recompute must be a policy name such as 'selective' or 'full:4', got "
                        f"{type(text).__name__} {text!r}")
    return _parse(text)


@functools.lru_cache(maxsize=256)  # a search sorts thousands of configurations by their policy
def _parse(text: str) -> RecomputePolicy:
    kind, sep, count = text.partition(":")
    if sep and not count.isdigit():
        raise PlanError(f"recompute {text!r}: the part after ':' must be a layer count, e.g. 'full:4'")
    return RecomputePolicy(kind, int(count) if sep else None)


def check_recompute(text: str, num_layers: int | None = None) -> RecomputePolicy:
    """`recompute_policy(text)`, also refusing more recomputed layers than the model has."""
    policy = recompute_policy(text)
    if num_layers is not None and policy.layers is not None and policy.layers > num_layers:
        raise PlanError(f"recompute {text!r} names {policy.layers} layers but the model has "
                        f"{num_layers}; use at most '{policy.kind}:{num_layers}' or '{policy.kind}'")
    return policy
