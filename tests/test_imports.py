"""The package's import graph has no cycles: counting every import, also those inside functions (a function-level
import only hides a cycle, it does not remove it)."""

from __future__ import annotations

import ast
from pathlib import Path

import eaglespec

ROOT = Path(eaglespec.__file__).parent


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph() -> dict[str, set[str]]:
    """eaglespec module -> the eaglespec modules it imports (a package's `__init__` counts as the package)."""
    modules = {_module_name(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[: len(base) - (node.level - 1)]
                    stem = ".".join(base + ([node.module] if node.module else []))
                else:
                    stem = node.module or ""
                # `from . import x` may name a submodule; `from .m import f` names m
                targets = [f"{stem}.{alias.name}" for alias in node.names] + [stem]
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name and not name.startswith(target + "."):
                    graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
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


def test_the_import_graph_has_no_cycles():
    assert cycles(import_graph()) == []


def test_the_checker_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_platform_and_envs_are_leaves():
    graph = import_graph()
    assert graph["eaglespec.envs"] == set()
    assert graph["eaglespec.platform"] <= {"eaglespec.envs", "eaglespec.errors"}


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every module `start` imports, directly or through others."""
    seen: set[str] = set()
    todo = [start]
    while todo:
        for w in graph[todo.pop()]:
            if w not in seen:
                seen.add(w)
                todo.append(w)
    return seen


def test_the_algorithm_imports_no_backend_or_platform_code():
    """eaglespec.spec (tree, verification, decode loop, adaptive policy) and eaglespec.drafters reach no kernel,
    packing, quantization or compile code, not even through other modules: the CPU backend is applied from outside
    (backends/cpu/apply.py). Only the tree calibration reads the platform (its cache directory) and the CPU load."""
    graph = import_graph()
    algorithm = [m for m in graph if m.startswith(("eaglespec.spec", "eaglespec.drafters"))]
    assert "eaglespec.spec.decode" in algorithm and "eaglespec.drafters.eagle" in algorithm
    for module in algorithm:
        reached = reachable(graph, module)
        assert not {m for m in reached if m.startswith("eaglespec.backends")}, module
        if module != "eaglespec.drafters.autotree":
            assert "eaglespec.platform" not in reached and "eaglespec.cpuload" not in reached, module


def test_the_backend_is_applied_in_one_place():
    """Outside the backend itself, only the fast target (its plan), the API and the bench, CLI and tools that
    report or choose the build import eaglespec.backends."""
    graph = import_graph()
    users = {m for m, deps in graph.items() if not m.startswith("eaglespec.backends")
             and any(d.startswith("eaglespec.backends") for d in deps)}
    assert users <= {"eaglespec.targets.fast", "eaglespec.api", "eaglespec.cli", "eaglespec.bench.cli",
                     "eaglespec.bench.methods", "eaglespec.bench.oracle", "eaglespec.serve.cli",
                     "eaglespec.train.features", "eaglespec.bench.machine"}, users
