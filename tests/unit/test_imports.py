"""Who may import whom inside `agent/`: no import cycles (the composition root at the top, the parts
below it), and no product module reaching for the test doubles in agent.testing, which the
installed package does not ship (tests/unit/test_deploy.py checks the wheel)."""

from __future__ import annotations

import ast
from pathlib import Path

AGENT = Path(__file__).resolve().parents[2] / "agent"
TESTING = "agent.testing"


def module_name(path: Path) -> str:
    parts = path.relative_to(AGENT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path, name: str) -> set[str]:
    """Every module `path` imports, anywhere in it: at the top, inside a function (a lazy import
    is still an edge) or under TYPE_CHECKING (a type names what it needs)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, `level - 1` packages up
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            out.add(base)
            out |= {f"{base}.{a.name}" for a in node.names}  # `from pkg import module`
    return out


def import_graph() -> dict[str, set[str]]:
    """agent.* module → the agent.* modules it imports."""
    files = {module_name(p): p for p in AGENT.rglob("*.py") if "__pycache__" not in p.parts}
    return {name: {m for m in imported(p, name) if m in files and m != name} for name, p in files.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_a_cycle() -> None:
    # The check below can fail: a two-module and a three-module cycle, beside acyclic edges.
    graph = {"a": {"b"}, "b": {"a", "c"}, "c": set(), "d": {"e"}, "e": {"f"}, "f": {"d"}}
    assert cycles(graph) == [["a", "b"], ["d", "e", "f"]]


def test_the_graph_sees_lazy_and_type_only_imports() -> None:
    graph = import_graph()
    assert "agent.cli.node" in graph["agent.cli.main"]  # top level
    assert "agent.service.serve" in graph["agent.cli.node"]  # inside cmd_agent
    assert "agent.tls" in graph["agent.service.metrics"]  # under TYPE_CHECKING


def test_no_import_cycles_among_agent_modules() -> None:
    assert cycles(import_graph()) == []


def test_the_named_edges_stay_gone() -> None:
    """The three the structure is built around, named so a cycle that comes back says which."""
    graph = import_graph()
    assert "agent.criu.lazy" not in graph["agent.criu.runner"]  # lazy builds on runner
    assert "agent.service.node" not in graph["agent.service.metrics"]  # metrics get read callables
    # The wire tables are below the migration core; the enum they map lives in migration.model.
    migration = {m for m in graph["agent.wire"] if m.startswith("agent.migration.")}
    assert migration <= {"agent.migration.model"}


def test_product_modules_never_import_the_test_doubles() -> None:
    offenders = [
        f"{name} imports {m}"
        for name, deps in import_graph().items()
        if not (name == TESTING or name.startswith(f"{TESTING}."))
        for m in deps
        if m == TESTING or m.startswith(f"{TESTING}.")
    ]
    assert offenders == []
    for path in AGENT.rglob("*.py"):  # nor choose a double through the environment
        if AGENT / "testing" not in path.parents:
            assert "FERRY_NVML_REPLAY" not in path.read_text(), path


def test_the_doubles_are_found_by_that_check() -> None:
    # agent.testing imports the product and itself: the filter above must see those edges.
    graph = import_graph()
    assert "agent.testing.nvml_replay" in graph["agent.testing.agent"]
    assert "agent.cli.main" in graph["agent.testing.agent"]
