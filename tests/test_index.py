"""tests/README.md says where the tests of each module are (tests/index.py)."""

from __future__ import annotations

import pytest

from tests.index import README, render

pytestmark = pytest.mark.fast


def test_the_module_index_is_current():
    assert README.read_text() == render(), "run: python -m tests.index"
