"""tests/README.md's table: each module of the package, and the test files that import it
(`python -m tests.index` writes it again; tests/test_index.py fails when it is stale).

A module no test file imports is still tested: it is part of gym-proxy or its workers as
the real-process and in-process tests run them, and the table says so.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
README = REPO / "tests" / "README.md"
FLOORS = ("proxy", "worker", "coordinator")
TABLE_START = "<!-- the module index: python -m tests.index -->"

HEAD = """# The tests

How they are run, their tiers (fast, real-process, NeMo Gym) and what a test may and may
not do: [CONTRIBUTING.md](../CONTRIBUTING.md). Here: where the tests of each module are.

Each row names the test files that import the module. One that none imports is part of
gym-proxy or its workers as they run: the real-process tests start them (with the zygote
and the Ray helpers) and the in-process ones run them in the test's loop
(`tests/in_process.py`); they test it by what it does over the sockets.

"""


def modules() -> list[str]:
    """Every module of the package, as `folder/module.py` paths."""
    found = []
    for floor in FLOORS:
        for path in sorted((REPO / floor).rglob("*.py")):
            if path.name not in ("__init__.py", "__main__.py"):
                found.append(str(path.relative_to(REPO)))
    return found


def imported_by_tests() -> dict[str, set[str]]:
    """module path -> the test files (`tests/test_*.py`, and their helpers) importing it."""
    by_module: dict[str, set[str]] = {}
    for test in sorted((REPO / "tests").glob("*.py")):
        for node in ast.walk(ast.parse(test.read_text())):
            names: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:
                parts = name.split(".")
                if parts[0] != "gym_proxy" or len(parts) < 2:
                    continue
                path = "/".join(parts[1:]) + ".py"
                if (REPO / path).is_file():
                    by_module.setdefault(path, set()).add(test.name)
    return by_module


def render() -> str:
    by_module = imported_by_tests()
    rows = ["| module | test files that import it |", "|---|---|"]
    for module in modules():
        tests = sorted(by_module.get(module, ()))
        said = ", ".join(f"`{t}`" for t in tests) if tests else "through gym-proxy as it runs"
        rows.append(f"| `{module}` | {said} |")
    return HEAD + TABLE_START + "\n\n" + "\n".join(rows) + "\n"


if __name__ == "__main__":
    README.write_text(render())
