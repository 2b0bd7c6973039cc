"""The code base stays ruff clean (the lint rules are in pyproject.toml)."""

from __future__ import annotations

import subprocess
import sys

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
