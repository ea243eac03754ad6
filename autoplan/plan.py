"""The Plan: a frozen, versioned value that says how to split one training step over a cluster.

It round-trips exactly through JSON (`Plan.from_json(p.to_json()) == p`), is validated when built or
loaded, and carries its own explanation: predicted step time split into compute / communication /
bubble / optimizer, memory per rank split into parameters / gradients / optimizer states /
activations, MFU, and provenance. No pickle: files are plain JSON, written atomically.

Batch arithmetic: global_batch = microbatch_size * num_microbatches * batch_shards (sequences per
step), batch_shards = dp * ep: the dense layers are data-parallel over dp x ep (expert parallelism
folds over data-parallel ranks); or, with the mesh's ep_as = "cp", batch_shards = dp: the ep ranks
split each sequence with the cp ranks instead (`MeshShape.ep_as`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from autoplan.cluster import ClusterSpec
from autoplan.errors import AutoplanError, PlanError
from autoplan.mesh import MeshShape
from autoplan.placement import Placement
from autoplan.plan_json import axis_from_json, mesh_from_json, op_from_json, strategies_from_json, strategies_to_json
from autoplan.recompute_policy import check_recompute
from autoplan.strategies import Strategy
from autoplan.validity import SCHEDULES
from autoplan.validate import (check_choice, check_int, check_keys, check_list, check_mapping, check_number, check_output_file,
                               check_str, check_tokens, parse_mapping, read_text, record, shown, write_text_atomic)

PLAN_VERSION = 3  # 3: `recompute` names a policy (autoplan.recompute_policy), no node list
# 2: each op carries its resolved strategy and module path; a version 2 plan's recompute_nodes are
# dropped (its "selective" runs as today's policy of that name). Version 1 plans still load (show,
# explain, compare); the runtime asks for a re-made plan to run one.
READABLE_VERSIONS = (1, 2, 3)
DTYPES = ("bfloat16", "float16", "float32")
KERNELS = ("auto", "triton", "torch")  # runtime.kernels backends: "auto" is Triton on CUDA only
# How a half-precision plan runs (`runtime.grad_sync`, `runtime.zero`): "autocast", torch.autocast over
# float32 parameters (the optimizer steps on them); "bf16-master", bfloat16 parameters for compute with
# float32 master weights, float32 gradient accumulation and reduction, and the optimizer on the masters
# (Megatron-LM's distributed optimizer; FSDP2's MixedPrecisionPolicy under ZeRO 3). float32 plans: "autocast"
# (nothing is cast).
PRECISIONS = ("autocast", "bf16-master")


def searched_precision(dtype: str) -> str:
    """The precision the search plans a `dtype` run with: bf16-master for bfloat16 (what Megatron-LM and
    torchtitan run; under ZeRO 3 autocast would keep a bf16 copy of every weight from forward to backward),
    autocast otherwise (float32 casts nothing; float16 would need loss scaling)."""
    return "bf16-master" if dtype == "bfloat16" else "autocast"

AxisPlacements = tuple[tuple[str, Placement], ...]  # ((axis, placement), ...) for axes that matter
PLAN_KEYS = {"version", "model", "cluster", "mesh", "microbatch_size", "num_microbatches", "global_batch", "seq_len",
             "dtype", "kernels", "zero_stage", "recompute", "schedule", "stages", "placements", "predicted",
             "provenance", "strategies", "recompute_nodes", "precision"}
OPTIONAL_PLAN_KEYS = {"dtype", "kernels", "recompute_nodes", "strategies", "precision"}


@dataclass(frozen=True)
class ModelRef:
    name: str
    fingerprint: str
    num_layers: int
    num_parameters: int

    def __post_init__(self) -> None:
        check_str("plan model.name", self.name, PlanError)
        check_str("plan model.fingerprint", self.fingerprint, PlanError)
        check_int("plan model.num_layers", self.num_layers, 1, PlanError)
        check_int("plan model.num_parameters", self.num_parameters, 1, PlanError)


@dataclass(frozen=True)
class StageSpec:
    """Layers [first_layer, last_layer) run on pipeline stage `stage` (virtual chunk `chunk`)."""

    stage: int
    first_layer: int
    last_layer: int
    chunk: int = 0

    def __post_init__(self) -> None:
        for f in fields(self):
            check_int(f"plan stage {f.name}", getattr(self, f.name), 0, PlanError)


@dataclass(frozen=True)
class TimeBreakdown:
    compute_s: float
    communication_s: float  # exposed (not overlapped) communication
    bubble_s: float
    optimizer_s: float

    def __post_init__(self) -> None:
        _check_amounts("predicted time_breakdown", self)

    def total_s(self) -> float:
        return self.compute_s + self.communication_s + self.bubble_s + self.optimizer_s


@dataclass(frozen=True)
class MemoryBreakdown:
    parameters_bytes: float
    gradients_bytes: float
    optimizer_bytes: float
    activations_bytes: float
    temporary_bytes: float = 0.0
    ep_imbalance_bytes: float = 0.0  # the ep routing imbalance margin on MoE routed rows (cost_model.step)
    # the optimizer step's total (weights less autocast's copies + gradients + optimizer states + AdamW's
    # temporary): the peak where it exceeds the parts above, which are the forward + backward phase's
    optimizer_step_bytes: float = 0.0

    def __post_init__(self) -> None:
        _check_amounts("predicted memory_breakdown", self)

    def forward_backward_bytes(self) -> float:
        """The parts' sum: what the rank holds at the end of a forward (activations at their most)."""
        return sum(getattr(self, f.name) for f in fields(self) if f.name != "optimizer_step_bytes")

    def peaks_at_optimizer_step(self) -> bool:
        return self.optimizer_step_bytes > self.forward_backward_bytes()

    def total_bytes(self) -> float:
        """The peak: the larger of the two phases."""
        return max(self.forward_backward_bytes(), self.optimizer_step_bytes)


@dataclass(frozen=True)
class Predicted:
    step_time_s: float
    mfu: float
    tokens_per_s: float
    peak_memory_bytes: float  # the largest rank
    memory: MemoryBreakdown
    time: TimeBreakdown

    def __post_init__(self) -> None:
        for name in ("step_time_s", "mfu", "tokens_per_s", "peak_memory_bytes"):
            check_number(f"plan predicted {name}", getattr(self, name), strict=False, error=PlanError)

    def to_json(self) -> dict:
        return {
            "step_time_s": self.step_time_s,
            "mfu": self.mfu,
            "tokens_per_s": self.tokens_per_s,
            "peak_memory_bytes": self.peak_memory_bytes,
            "memory_breakdown": asdict(self.memory),
            "time_breakdown": asdict(self.time),
        }

    @classmethod
    def from_json(cls, data: dict) -> "Predicted":
        keys = {"step_time_s", "mfu", "tokens_per_s", "peak_memory_bytes", "memory_breakdown", "time_breakdown"}
        check_keys("plan predicted", check_mapping("plan predicted", data, PlanError), keys, keys, PlanError)
        return cls(
            step_time_s=data["step_time_s"],
            mfu=data["mfu"],
            tokens_per_s=data["tokens_per_s"],
            peak_memory_bytes=data["peak_memory_bytes"],
            memory=record(MemoryBreakdown, data["memory_breakdown"], "plan predicted memory_breakdown", PlanError),
            time=record(TimeBreakdown, data["time_breakdown"], "plan predicted time_breakdown", PlanError),
        )


@dataclass(frozen=True)
class OpPlacement:
    """The strategy chosen for one captured node and its output's placement per mesh axis.

    `module`: the path of the module that runs the op ("" for an op of a forward function);
    `resolved`: the strategy on tp as the planner priced it (input, output and parameter placements,
    the collectives it issues), so the runtime executes the plan without the strategy rules."""

    node: str
    strategy: str
    output: AxisPlacements = ()
    module: str = ""
    resolved: Strategy | None = None

    def __post_init__(self) -> None:
        for name in ("node", "strategy", "module"):
            check_str(f"plan op {name}", getattr(self, name), PlanError)


@dataclass(frozen=True)
class ParamPlacement:
    name: str
    placements: AxisPlacements

    def __post_init__(self) -> None:
        check_str("plan parameter name", self.name, PlanError)


@dataclass(frozen=True)
class Provenance:
    autoplan_version: str
    search_time_s: float
    solver: str = ""
    notes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        check_str("plan provenance.autoplan_version", self.autoplan_version, PlanError)
        check_number("plan provenance.search_time_s", self.search_time_s, strict=False, error=PlanError)
        check_str("plan provenance.solver", self.solver, PlanError)
        for note in self.notes:
            check_str("plan provenance note", note, PlanError)


@dataclass(frozen=True)
class Plan:
    model: ModelRef
    cluster: ClusterSpec
    mesh: MeshShape
    microbatch_size: int
    num_microbatches: int
    global_batch: int
    seq_len: int
    zero_stage: int
    recompute: str
    schedule: str
    stages: tuple[StageSpec, ...]
    params: tuple[ParamPlacement, ...]
    ops: tuple[OpPlacement, ...]
    predicted: Predicted
    provenance: Provenance
    dtype: str = "bfloat16"
    version: int = PLAN_VERSION
    kernels: str = "auto"  # the runtime's fused kernels: "auto" | "triton" | "torch"
    precision: str = "autocast"  # PRECISIONS: how a bfloat16 plan holds its parameters and master weights
    _index: dict = field(default=None, init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        _validate(self)
        index = {"params": {p.name: p for p in self.params}, "ops": {o.node: o for o in self.ops}}
        object.__setattr__(self, "_index", index)

    # ---------------------------------------------------------------- lookups
    def param_placement(self, name: str, axis: str) -> Placement:
        """Placement of parameter `name` on mesh `axis` (Replicate when the plan does not say)."""
        from autoplan.placement import Replicate

        entry = self._index["params"].get(name)
        return dict(entry.placements).get(axis, Replicate()) if entry else Replicate()

    def op(self, node: str) -> OpPlacement | None:
        return self._index["ops"].get(node)

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len

    # ---------------------------------------------------------------- JSON
    @property
    def stage_layers(self) -> tuple[int, ...]:
        """Layers of each pipeline chunk in the order the layers flow through them (chunk c of stage s at
        position c pp + s), as `autoplan estimate --stage-layers` takes them."""
        return tuple(s.last_layer - s.first_layer for s in sorted(self.stages, key=lambda s: (s.chunk, s.stage)))

    def to_json(self) -> dict:
        table, ops = strategies_to_json(self.ops, _axis_json)
        return {
            "version": self.version,
            "model": asdict(self.model),
            "cluster": self.cluster.to_json(),
            "mesh": self.mesh.to_json(),
            "microbatch_size": self.microbatch_size,
            "num_microbatches": self.num_microbatches,
            "global_batch": self.global_batch,
            "seq_len": self.seq_len,
            "dtype": self.dtype,
            "kernels": self.kernels,
            "precision": self.precision,
            "zero_stage": self.zero_stage,
            "recompute": self.recompute,
            "schedule": self.schedule,
            "stages": [asdict(s) for s in self.stages],
            "placements": {
                "parameters": {p.name: _axis_json(p.placements) for p in self.params},
                "ops": ops,
            },
            "strategies": table,
            "predicted": self.predicted.to_json(),
            "provenance": {**asdict(self.provenance), "notes": list(self.provenance.notes)},
        }

    @classmethod
    def from_json(cls, data: dict) -> "Plan":
        """The Plan of `to_json`'s object; PlanError naming the key that is missing, of the wrong type or
        out of range (every part is checked as it is built: ModelRef, StageSpec, ... and `_validate`)."""
        check_mapping("plan", data, PlanError)
        version = data.get("version")
        if not any(type(version) is int and version == v for v in READABLE_VERSIONS):
            raise PlanError(f"plan version {shown(version)} is not supported; this autoplan reads versions "
                            f"{', '.join(map(str, READABLE_VERSIONS))}. Re-run `autoplan search` to make a new plan.")
        check_keys("plan", data, PLAN_KEYS, PLAN_KEYS - OPTIONAL_PLAN_KEYS, PlanError)
        placements = check_mapping("plan placements", data["placements"], PlanError)
        check_keys("plan placements", placements, {"parameters", "ops"}, error=PlanError)
        ops = check_mapping("plan placements.ops", placements.get("ops", {}), PlanError)
        parameters = check_mapping("plan placements.parameters", placements.get("parameters", {}), PlanError)
        prov = check_mapping("plan provenance", data["provenance"], PlanError)
        return cls(
            model=record(ModelRef, data["model"], "plan model", PlanError),
            cluster=_part("cluster", ClusterSpec.from_json, data["cluster"]),
            mesh=_part("mesh", mesh_from_json, data["mesh"]),
            microbatch_size=data["microbatch_size"],
            num_microbatches=data["num_microbatches"],
            global_batch=data["global_batch"],
            seq_len=data["seq_len"],
            dtype=data.get("dtype", "bfloat16"),
            kernels=data.get("kernels", "auto"),  # plans written before the option: "auto"
            precision=data.get("precision", "autocast"),  # plans written before the option ran so
            zero_stage=data["zero_stage"],
            recompute=data["recompute"],
            schedule=data["schedule"],
            stages=tuple(record(StageSpec, st, "plan stage", PlanError) for st in check_list("plan stages", data["stages"])),
            params=tuple(ParamPlacement(n, axis_from_json(p, f"parameter {n!r}")) for n, p in parameters.items()),
            ops=tuple(OpPlacement(n, *op_from_json(n, o), resolved)
                      for (n, o), resolved in zip(ops.items(), strategies_from_json(data.get("strategies", []), ops))),
            predicted=Predicted.from_json(data["predicted"]),
            provenance=record(Provenance, {**prov, "notes": tuple(check_list("plan provenance.notes", prov.get("notes", [])))},
                              "plan provenance", PlanError),
        )

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=1)

    def save(self, path: str | Path) -> None:
        """Write atomically: a crash mid-write never leaves a truncated plan at `path`. PlanError where no file
        can be written there (a folder, a parent that is a file, no permission)."""
        path = check_output_file(path, "plan output", PlanError)
        try:
            write_text_atomic(path, self.dumps() + "\n")
        except OSError as exc:
            raise PlanError(f"cannot write the plan to {str(path)!r}: {exc.strerror or exc}; choose another path") from None

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        """The plan in the JSON file at `path`; PlanError when it is missing, a folder, not JSON or not a plan."""
        return cls.from_json(parse_mapping(path, read_text(path, "plan file", PlanError), "plan file", PlanError,
                                           yaml_file=False))


def _axis_json(placements: AxisPlacements) -> dict:
    return {axis: str(p) for axis, p in placements}


def _part(key: str, build, data):
    """`build(data)`, with an error about it said to be in the plan's `key`."""
    try:
        return build(data)
    except AutoplanError as exc:
        raise PlanError(f"plan {key}: {exc}") from None


def _check_amounts(what: str, parts) -> None:
    """Every field of a breakdown is a finite amount >= 0 (seconds or bytes)."""
    for f in fields(parts):
        check_number(f"plan {what}.{f.name}", getattr(parts, f.name), strict=False, error=PlanError)


def _validate(plan: Plan) -> None:
    """Types and ranges, then cross-field checks; each message names the values that disagree."""
    for name in ("microbatch_size", "num_microbatches", "global_batch", "seq_len"):
        check_int(f"plan {name}", getattr(plan, name), 1, PlanError)
    check_tokens(plan.global_batch, plan.seq_len, PlanError)
    check_choice("plan version", plan.version, READABLE_VERSIONS, PlanError)
    check_choice("plan zero_stage", plan.zero_stage, (0, 1, 2, 3), PlanError)
    if plan.mesh.world_size != plan.cluster.world_size:
        raise PlanError(f"mesh {plan.mesh} has {plan.mesh.world_size} ranks but the cluster {plan.cluster.describe()} has {plan.cluster.world_size}")
    if plan.microbatch_size * plan.num_microbatches * plan.mesh.batch_shards != plan.global_batch:
        shards = f"dp {plan.mesh.dp}" + (f" x ep {plan.mesh.ep}" if plan.mesh.ep_as == "dp" else " (ep as cp)")
        raise PlanError(f"global_batch {plan.global_batch} != microbatch_size {plan.microbatch_size} x num_microbatches "
                        f"{plan.num_microbatches} x {shards}")
    check_recompute(plan.recompute, plan.model.num_layers)
    if plan.schedule not in SCHEDULES:
        raise PlanError(f"schedule {plan.schedule!r} must be one of {SCHEDULES}")
    if plan.dtype not in DTYPES:
        raise PlanError(f"dtype {plan.dtype!r} must be one of {DTYPES}")
    if plan.kernels not in KERNELS:
        raise PlanError(f"kernels {plan.kernels!r} must be one of {KERNELS}")
    problem = precision_problem(plan.precision, plan.dtype)
    if problem:
        raise PlanError(problem)
    _validate_stages(plan)


def precision_problem(precision: str, dtype: str) -> str | None:
    """Why `precision` cannot run a plan of `dtype` (None: it can): bf16-master keeps bfloat16 parameters
    (float16 ones would need loss scaling, which the runtime does not do)."""
    if precision not in PRECISIONS:
        return f"precision {precision!r} must be one of {PRECISIONS}"
    if precision == "bf16-master" and dtype != "bfloat16":
        return (f"precision 'bf16-master' holds bfloat16 parameters but the plan's dtype is {dtype!r}; "
                f"plan with dtype 'bfloat16', or precision 'autocast'")
    return None


def _validate_stages(plan: Plan) -> None:
    """Stages, in (chunk, stage) order, must tile [0, num_layers) without gaps or overlaps."""
    ordered = sorted(plan.stages, key=lambda s: (s.chunk, s.stage))
    stages_per_chunk = {s.stage for s in plan.stages}
    if stages_per_chunk != set(range(plan.mesh.pp)):
        raise PlanError(f"stages name pipeline stages {sorted(stages_per_chunk)}, expected 0..{plan.mesh.pp - 1} for pp={plan.mesh.pp}")
    cursor = 0
    for stage in ordered:
        if stage.first_layer != cursor or stage.last_layer < stage.first_layer:
            raise PlanError(f"stage {stage} does not continue from layer {cursor}: stages must tile the layers in order")
        cursor = stage.last_layer
    if cursor != plan.model.num_layers:
        raise PlanError(f"stages cover layers [0, {cursor}) but the model has {plan.model.num_layers} layers")
