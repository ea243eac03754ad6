"""The JSON form of a Plan's parts that need more than a dataclass: the mesh, the placements and the resolved
strategies. The strategies are a table of the distinct strategies (a model of
96 identical layers has a few dozen), each op naming its row.

    {"strategies": [{"name": "column", "inputs": [["R", true]], "output": "S(2)",
                     "params": [["weight", "S(0)", false]], "compute_fraction": 0.5,
                     "expert_ffn_split": 1, "fwd_comm": [], "bwd_comm": ["all_reduce:input:0"]}, ...],
     "placements": {"ops": {"<node>": {"strategy": "column", "output": {...}, "module": "layers.0.attn.q_proj",
                                        "tp": 0}}}}
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from autoplan.errors import AutoplanError, PlanError
from autoplan.mesh import MeshShape
from autoplan.placement import AXIS_NAMES, Placement, check_axis, parse_placement
from autoplan.strategies import Comm, InputSpec, ParamSpec, Strategy
from autoplan.validate import check_int, check_keys, check_list, check_mapping, check_number, check_str, shown

if TYPE_CHECKING:
    from autoplan.plan import OpPlacement


def strategy_to_json(s: Strategy) -> dict:
    return {"name": s.name, "inputs": [[str(i.placement), i.grad_partial] for i in s.inputs],
            "output": str(s.output), "params": [[p.name, str(p.placement), p.grad_partial] for p in s.params],
            "compute_fraction": s.compute_fraction, "expert_ffn_split": s.expert_ffn_split,
            "fwd_comm": [f"{c.kind}:{c.tensor}" for c in s.fwd_comm],
            "bwd_comm": [f"{c.kind}:{c.tensor}" for c in s.bwd_comm]}


def strategy_from_json(d: dict) -> Strategy:
    """A row of the strategy table; PlanError naming the row when a field is missing or of the wrong type."""
    try:
        check_keys("plan strategy", check_mapping("plan strategy", d, PlanError), _STRATEGY_KEYS, _STRATEGY_KEYS, PlanError)
        return Strategy(check_str("plan strategy name", d["name"], PlanError),
                        tuple(InputSpec(_placement(p), _flag(g)) for p, g in _rows(d["inputs"], 2)),
                        _placement(d["output"]),
                        tuple(ParamSpec(check_str("plan strategy param", n, PlanError), _placement(p), _flag(g))
                              for n, p, g in _rows(d["params"], 3)),
                        check_number("compute_fraction", d["compute_fraction"], error=PlanError),
                        check_int("expert_ffn_split", d["expert_ffn_split"], 1, PlanError),
                        tuple(_comm(c) for c in check_list("fwd_comm", d["fwd_comm"])),
                        tuple(_comm(c) for c in check_list("bwd_comm", d["bwd_comm"])))
    except AutoplanError as exc:
        raise PlanError(f"plan: a strategy entry {shown(d)} is malformed ({exc}); re-make the plan with "
                        f"`autoplan search` or `autoplan estimate`") from None


_STRATEGY_KEYS = {"name", "inputs", "output", "params", "compute_fraction", "expert_ffn_split", "fwd_comm", "bwd_comm"}


def _rows(value: object, width: int) -> list[list]:
    rows = check_list("a strategy's inputs / params", value)
    for row in rows:
        if not (isinstance(row, list) and len(row) == width):
            raise PlanError(f"{shown(row)}: expected a list of {width} values")
    return rows


def _placement(text: object, what: str = "placement") -> Placement:
    try:
        return parse_placement(check_str(what, text, PlanError))
    except PlanError:
        raise
    except AutoplanError as exc:
        raise PlanError(f"{what}: {exc}") from None


def _flag(value: object) -> bool:
    if isinstance(value, bool):
        return value
    raise PlanError(f"grad_partial={shown(value)}: expected true or false")


def _comm(text: object) -> Comm:
    kind, sep, tensor = check_str("collective", text, PlanError).partition(":")
    if not (kind and sep and tensor):
        raise PlanError(f"collective {text!r}: expected 'kind:tensor', e.g. 'all_reduce:output'")
    return Comm(kind, tensor)


def axis_from_json(data: object, what: str) -> tuple[tuple[str, Placement], ...]:
    """((axis, placement), ...) of a mapping axis -> placement text ({"tp": "S(0)"})."""
    check_mapping(f"plan placements of {what}", data, PlanError)
    return tuple((check_axis(axis), _placement(text, f"plan placement of {what} on {axis}")) for axis, text in data.items())


def op_from_json(node: str, entry: object) -> tuple[str, tuple[tuple[str, Placement], ...], str]:
    """(strategy name, output placements, module path) of an op's entry in placements.ops."""
    check_keys(f"plan op {node!r}", check_mapping(f"plan op {node!r}", entry, PlanError),
               {"strategy", "output", "module", "tp"}, {"strategy"}, PlanError)
    return (check_str(f"plan op {node!r} strategy", entry["strategy"], PlanError),
            axis_from_json(entry.get("output", {}), f"op {node!r}"),
            check_str(f"plan op {node!r} module", entry.get("module", ""), PlanError))


def mesh_from_json(data: object) -> MeshShape:
    """The plan's mesh: every axis degree given (a plan writes them all; a missing one is a damaged file,
    not a degree of 1) and the order a list of axis names."""
    check_mapping("mesh", data, PlanError)
    check_keys("mesh", data, set(AXIS_NAMES) | {"order", "etp", "ep_as"}, set(AXIS_NAMES) | {"order"}, PlanError)
    order = check_list("mesh order", data["order"])
    for axis in order:
        check_str("mesh order entry", axis, PlanError)
    return MeshShape.from_json(data)


def strategies_to_json(ops: "tuple[OpPlacement, ...]", axis_json: Callable) -> tuple[list[dict], dict]:
    """(table of distinct resolved strategies, ops as JSON referring to its rows)."""
    rows: dict[Strategy, int] = {}
    out = {}
    for o in ops:
        entry = {"strategy": o.strategy, "output": axis_json(o.output)}
        if o.module:
            entry["module"] = o.module
        if o.resolved is not None:
            entry["tp"] = rows.setdefault(o.resolved, len(rows))
        out[o.node] = entry
    return [strategy_to_json(s) for s in rows], out


def strategies_from_json(table: list, ops: dict) -> list[Strategy | None]:
    """The resolved strategy of each op of `ops` (in order), from the rows of `table`."""
    if not isinstance(table, list):
        raise PlanError(f"plan: 'strategies' must be a list, got {type(table).__name__}")
    rows = [strategy_from_json(d) for d in table]
    found = []
    for node, o in ops.items():
        row = check_mapping(f"plan op {node!r}", o, PlanError).get("tp")
        if row is not None and not (type(row) is int and 0 <= row < len(rows)):
            raise PlanError(f"plan: op {node!r} names strategy row {row!r}, but the table has {len(rows)} rows")
        found.append(None if row is None else rows[row])
    return found
