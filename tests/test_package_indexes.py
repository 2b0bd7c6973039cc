"""A package docstring that names its modules is the package's map: it names every one
(issue 54). One that names none of them (a short summary) is not a map and is left
alone; one that names some and leaves out another is the map a new module forgot."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tests.support import REPO

pytestmark = pytest.mark.fast

FLOORS = ("proxy", "worker", "coordinator")
NAMED = re.compile(r"`([A-Za-z_][\w.]*?)(?:\.py)?`")


def packages() -> list[Path]:
    return sorted(p.parent for floor in FLOORS for p in (REPO / floor).rglob("__init__.py"))


def parts_of(package: Path) -> set[str]:
    modules = {p.stem for p in package.glob("*.py") if p.stem not in ("__init__", "__main__")}
    return modules | {p.name for p in package.iterdir() if (p / "__init__.py").is_file()}


def named_in(package: Path, parts: set[str]) -> set[str]:
    docstring = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
    return {name.rsplit(".", 1)[-1] for name in NAMED.findall(docstring)} & parts


@pytest.mark.parametrize("package", packages(), ids=lambda p: str(p.relative_to(REPO)))
def test_a_package_that_maps_its_modules_maps_them_all(package: Path):
    parts = parts_of(package)
    named = named_in(package, parts)
    assert not named or named == parts, f"{package.relative_to(REPO)} leaves out {parts - named}"


def test_the_check_sees_a_map_that_forgot_one(tmp_path: Path):
    (tmp_path / "__init__.py").write_text('"""The parts: `a` and `b`."""\n')
    for name in ("a", "b", "c"):
        (tmp_path / f"{name}.py").write_text("")
    parts = parts_of(tmp_path)
    assert named_in(tmp_path, parts) == {"a", "b"} != parts
