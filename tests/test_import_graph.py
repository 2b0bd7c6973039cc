"""No import circle among gym-proxy's modules (issue 37: cli -> startup -> server -> cli,
and the worker's participation <-> front door were two). Every import counts, at a
module's top or inside a function, except those under `if TYPE_CHECKING:`, which never
run. Read from the sources with `ast`, so nothing is imported to check it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.support import REPO

pytestmark = pytest.mark.fast

PACKAGES = ("proxy", "worker", "coordinator")


def modules() -> dict[str, Path]:
    """gym_proxy.<dotted name> -> its source file."""
    found = {}
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found["gym_proxy." + ".".join(parts)] = path
    return found


class _Imports(ast.NodeVisitor):
    def __init__(self) -> None:
        self.names: set[str] = set()

    def visit_If(self, node: ast.If) -> None:
        if "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                self.visit(child)
            return
        self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        self.names.update(alias.name for alias in node.names)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level == 0 and node.module:
            self.names.update(f"{node.module}.{alias.name}" for alias in node.names)
            self.names.add(node.module)


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of ours it imports (a name imported from a module counts
    as that module; a submodule imported from a package counts as the submodule)."""
    known = modules()
    graph = {}
    for name, path in known.items():
        visitor = _Imports()
        visitor.visit(ast.parse(path.read_text()))
        targets = set()
        for imported in visitor.names:
            while imported and imported not in known:
                imported = imported.rpartition(".")[0]
            if imported and imported != name:
                targets.add(imported)
        graph[name] = targets
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_module_imports_itself_through_others():
    assert circles(import_graph()) == []


def test_the_check_finds_a_circle():
    """It is not vacuous: a circle of three is found, a TYPE_CHECKING edge is not one."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c"]]
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import x\nimport y\n"
    visitor = _Imports()
    visitor.visit(ast.parse(source))
    assert "x" not in visitor.names and "y" in visitor.names
    assert len(import_graph()) > 100  # every module was read
