"""No import circle among gym-proxy's modules (issue 37: cli -> startup -> server -> cli,
and the worker's participation <-> front door were two). Every import counts, at a
module's top or inside a function, except those under `if TYPE_CHECKING:`, which never
run. Read from the sources with `ast`, so nothing is imported to check it.

And no circle among its folders (issue 54: `proxy/fleet` and `proxy/ray_cluster`
imported each other): a folder is a layer, so the imports between two folders go one
way, those under `if TYPE_CHECKING:` too (a type is a dependency all the same). The
folders are the top-level packages (`coordinator`, `proxy`, `worker`), and below each
its sub-packages (`proxy/fleet`, `proxy/data_path`, `coordinator/contract`, ...), whose
own modules may import each other as they like; a module that sits in a top-level
package itself (`proxy/server.py`) is its own node, so no circle may pass through a
folder by way of one either."""

from __future__ import annotations

import ast
from collections.abc import Callable
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
    def __init__(self, type_checking: bool = False) -> None:
        self.names: set[str] = set()
        self.type_checking = type_checking  # count the imports under TYPE_CHECKING too

    def visit_If(self, node: ast.If) -> None:
        if not self.type_checking and "TYPE_CHECKING" in ast.unparse(node.test):
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


def import_graph(type_checking: bool = False) -> dict[str, set[str]]:
    """Module -> the modules of ours it imports (a name imported from a module counts
    as that module; a submodule imported from a package counts as the submodule)."""
    known = modules()
    graph = {}
    for name, path in known.items():
        visitor = _Imports(type_checking)
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


def folder_of(path: Path) -> str:
    """The folder a module counts in: its sub-package below a top-level package
    (`proxy/fleet`, however deep), else the module itself (`gym_proxy.proxy.server`)."""
    parts = path.relative_to(REPO).parts
    if len(parts) > 2:
        return "/".join(parts[:2])
    return "gym_proxy." + ".".join(path.relative_to(REPO).with_suffix("").parts)


def unit_graph(unit: Callable[[Path], str]) -> dict[str, dict[str, set[str]]]:
    """Unit -> the units it imports, each with the imports that make the edge
    (`importer -> imported`), TYPE_CHECKING included; a unit's own imports are left out."""
    known = modules()
    graph: dict[str, dict[str, set[str]]] = {unit(path): {} for path in known.values()}
    for name, targets in import_graph(type_checking=True).items():
        source = unit(known[name])
        for target in targets:
            other = unit(known[target])
            if other != source:
                graph[source].setdefault(other, set()).add(f"{name} -> {target}")
    return graph


def folder_circles(graph: dict[str, dict[str, set[str]]], folders_only: bool) -> list[str]:
    """Each circle of `unit_graph`'s units that passes through a folder, with the imports
    between its members (`folders_only`: every unit is a folder, so every circle counts)."""
    found = []
    for circle in circles({source: set(targets) for source, targets in graph.items()}):
        if not folders_only and all(member.startswith("gym_proxy.") for member in circle):
            continue  # modules of top-level packages only: the module check's business
        edges = sorted(
            edge
            for source in circle
            for target, why in graph[source].items()
            if target in circle
            for edge in why
        )
        found.append(f"{' <-> '.join(circle)}: {'; '.join(edges)}")
    return found


def test_no_two_top_level_packages_import_each_other():
    """coordinator <- worker <- proxy, and nothing back: the contract is the floor."""
    packages = unit_graph(lambda path: path.relative_to(REPO).parts[0])
    assert folder_circles(packages, True) == []


def test_no_two_folders_import_each_other():
    assert folder_circles(unit_graph(folder_of), False) == []


def test_the_folder_check_counts_what_the_module_check_does_not():
    """A TYPE_CHECKING import counts between folders, and a circle through a module of a
    top-level package counts when a folder is in it (one of such modules only is left to
    the module check, which lets a TYPE_CHECKING import close it)."""
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import x\n"
    visitor = _Imports(type_checking=True)
    visitor.visit(ast.parse(source))
    assert "x" in visitor.names
    assert folder_of(REPO / "proxy" / "fleet" / "mover.py") == "proxy/fleet"
    assert folder_of(REPO / "proxy" / "fleet" / "__init__.py") == "proxy/fleet"
    assert folder_of(REPO / "proxy" / "server.py") == "gym_proxy.proxy.server"
    server, fleet = "gym_proxy.proxy.server", "proxy/fleet"
    through_a_folder = {fleet: {server: {"f -> s"}}, server: {fleet: {"s -> f"}}}
    assert folder_circles(through_a_folder, False) == [f"{server} <-> {fleet}: f -> s; s -> f"]
    modules_only = {
        server: {"gym_proxy.proxy.a": {"s -> a"}},
        "gym_proxy.proxy.a": {server: {"a -> s"}},
    }
    assert folder_circles(modules_only, False) == []
    assert len(folder_circles(modules_only, True)) == 1
    assert len(unit_graph(folder_of)) > 20  # every folder and module was read


def test_the_proxy_s_floor_imports_no_worker_module():
    """`proxy.config` is what every part of the proxy reads: it stands on the contract
    (`coordinator.contract.nemo_gym_env` holds the launcher's variables), not on a worker."""
    graph = import_graph(type_checking=True)
    seen, todo = set(), ["gym_proxy.proxy.config"]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(graph[name])
    assert sorted(name for name in seen if name.startswith("gym_proxy.worker")) == []


def test_the_fleet_imports_nothing_of_the_ray_side():
    """The boundary's direction (`proxy/ray_cluster/__init__.py`): the Ray launcher fills
    the fleet's protocols (`WorkerLauncher`, `PlacedHandle`) and may import the fleet; the
    fleet runs workers without knowing where, so it imports nothing of `proxy/ray_cluster`."""
    graph = unit_graph(folder_of)
    assert graph["proxy/fleet"].get("proxy/ray_cluster", set()) == set()
