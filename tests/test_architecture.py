"""The import graph over every `autoplan.*` module follows the data flow (docs/architecture.md):
no cycle, no import from a later stage in an earlier one, the runtime never imports the search or the
cost model, and the solver and cost model never load torch.fx.

Imports are read from the source (ast), function-local ones included: a local import still makes a
dependency. Imports under `if TYPE_CHECKING:` are annotations only and are left out.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"autoplan": "autoplan", "autoplan.profiler": "profiler", "autoplan.cost_model": "cost_model",
           "autoplan.solver": "solver", "autoplan.runtime": "runtime"}
# what each stage may import (itself included); docs/architecture.md draws it
ALLOWED = {
    "vocabulary": {"vocabulary"},
    "capture": {"vocabulary", "capture"},
    "cost_model": {"vocabulary", "capture", "cost_model"},
    "solver": {"vocabulary", "capture", "cost_model", "solver"},
    "runtime": {"vocabulary", "capture", "runtime"},
    "profiler": {"vocabulary", "capture", "cost_model", "runtime", "profiler"},
    "interface": {"vocabulary", "capture", "cost_model", "solver", "runtime", "profiler", "interface"},
}
INTERFACE = ("autoplan.api", "autoplan.train", "autoplan.train_hf", "autoplan.__main__", "autoplan.cli",
             "autoplan.examples")


def stage_of(module: str) -> str:
    if module.startswith(INTERFACE):
        return "interface"
    if module == "autoplan.profiler.profile":  # the hardware profile: a contract type the cost model reads
        return "vocabulary"
    for stage in ("capture", "cost_model", "solver", "runtime", "profiler"):
        if module == f"autoplan.{stage}" or module.startswith(f"autoplan.{stage}."):
            return stage
    return "vocabulary"


def _modules() -> dict[str, Path]:
    found = {}
    for package, folder in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            found[".".join((package, *parts))] = path
    return found


class _Imports(ast.NodeVisitor):
    def __init__(self) -> None:
        self.found: list[str] = []

    def visit_If(self, node: ast.If) -> None:
        if "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                self.visit(child)
        else:
            self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        self.found += [a.name for a in node.names if a.name.startswith("autoplan")]

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.module and node.module.startswith("autoplan"):  # a name may be a submodule or an attribute
            self.found += [f"{node.module}.{a.name}" for a in node.names]


def import_graph() -> nx.DiGraph:
    modules = _modules()
    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    for name, path in modules.items():
        visitor = _Imports()
        visitor.visit(ast.parse(path.read_text()))
        for target in visitor.found:
            while target not in modules and "." in target:  # `from pkg import name`: the module, else pkg
                target = target.rsplit(".", 1)[0]
            if target in modules and target != name:
                graph.add_edge(name, target)
    return graph


@pytest.fixture(scope="module")
def graph() -> nx.DiGraph:
    return import_graph()


def test_the_import_graph_has_no_cycle(graph):
    cycles = list(nx.simple_cycles(graph))
    assert not cycles, f"import cycles: {cycles[:5]}"


def test_imports_follow_the_data_flow(graph):
    wrong = [f"{a} ({stage_of(a)}) -> {b} ({stage_of(b)})" for a, b in graph.edges
             if stage_of(b) not in ALLOWED[stage_of(a)]]
    assert not wrong, "imports against the data flow:\n" + "\n".join(wrong)


def test_the_check_sees_every_stage(graph):
    stages = {stage_of(m) for m in graph.nodes}
    assert stages == set(ALLOWED)
    assert graph.has_edge("autoplan.solver.search", "autoplan.solver.baselines")  # the graph is read at all


def test_the_solver_and_cost_model_load_no_torch():
    """The search runs on arrays and records: importing it loads neither torch nor torch.fx."""
    code = ("import sys, autoplan.solver.search, autoplan.solver.baselines, autoplan.cost_model.step\n"
            "print(sorted(m for m in ('torch', 'torch.fx', 'autoplan.runtime') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"
