"""The JSON form of the resolved strategies a Plan carries: a table of the distinct strategies (a model of
96 identical layers has a few dozen), each op naming its row.

    {"strategies": [{"name": "column", "inputs": [["R", true]], "output": "S(2)",
                     "params": [["weight", "S(0)", false]], "compute_fraction": 0.5,
                     "expert_ffn_split": 1, "fwd_comm": [], "bwd_comm": ["all_reduce:input:0"]}, ...],
     "placements": {"ops": {"<node>": {"strategy": "column", "output": {...}, "module": "layers.0.attn.q_proj",
                                        "tp": 0}}}}
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from autoplan.errors import PlanError
from autoplan.placement import parse_placement
from autoplan.strategies import Comm, InputSpec, ParamSpec, Strategy

if TYPE_CHECKING:
    from autoplan.plan import OpPlacement


def strategy_to_json(s: Strategy) -> dict:
    return {"name": s.name, "inputs": [[str(i.placement), i.grad_partial] for i in s.inputs],
            "output": str(s.output), "params": [[p.name, str(p.placement), p.grad_partial] for p in s.params],
            "compute_fraction": s.compute_fraction, "expert_ffn_split": s.expert_ffn_split,
            "fwd_comm": [f"{c.kind}:{c.tensor}" for c in s.fwd_comm],
            "bwd_comm": [f"{c.kind}:{c.tensor}" for c in s.bwd_comm]}


def strategy_from_json(d: dict) -> Strategy:
    try:
        return Strategy(d["name"], tuple(InputSpec(parse_placement(p), bool(g)) for p, g in d["inputs"]),
                        parse_placement(d["output"]),
                        tuple(ParamSpec(n, parse_placement(p), bool(g)) for n, p, g in d["params"]),
                        float(d["compute_fraction"]), int(d["expert_ffn_split"]),
                        tuple(Comm(*c.split(":", 1)) for c in d["fwd_comm"]),
                        tuple(Comm(*c.split(":", 1)) for c in d["bwd_comm"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise PlanError(f"plan: a strategy entry {d!r} is malformed ({exc!r}); re-make the plan with "
                        f"`autoplan search` or `autoplan estimate`") from None


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
        row = o.get("tp")
        if row is not None and not (isinstance(row, int) and 0 <= row < len(rows)):
            raise PlanError(f"plan: op {node!r} names strategy row {row!r}, but the table has {len(rows)} rows")
        found.append(None if row is None else rows[row])
    return found
