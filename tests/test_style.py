"""The code base stays ruff clean and type-checks (the rules are in pyproject.toml)."""

from __future__ import annotations

import subprocess
import sys
import tomllib

import pytest

from tests.support import REPO

pytestmark = pytest.mark.fast


def test_ruff_clean():
    result = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", str(REPO)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_clean(tmp_path):
    """The package type-checks under --strict and the tests in mypy's default mode with
    --check-untyped-defs (`[tool.mypy]` in pyproject.toml: its `tests.*` override relaxes
    the rest for them); the compiled data path is also checked by mypyc when it is built."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["mypy"]
    assert config["strict"] is True and config["packages"] == ["gym_proxy", "tests"]
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "cache")],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
