"""The NeMo Gym install (docs/examples/nemo_gym/install.sh, the quick start's first step)
says, before pip's resolver prints its `ERROR: pip's dependency resolver ...` block and
its "requires X, which is not installed" lines, that they are expected (issue 56): read
from what it printed when it made this tier's venv (tests/nemo_gym/install.sh keeps it
in the venv's install.log)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("nemo_gym", reason="the NeMo Gym tier runs in tests/nemo_gym/install.sh's venv")

LOG = Path(sys.prefix) / "install.log"
EXPECTED = "install.sh: pip may now end with \"ERROR: pip's dependency resolver"
RESOLVER = "ERROR: pip's dependency resolver does not currently take into account"


@pytest.mark.skipif(not LOG.exists(), reason="this venv was not made by tests/nemo_gym/install.sh")
def test_the_install_says_pip_s_resolver_block_is_expected_before_pip_prints_it():
    lines = LOG.read_text().splitlines()
    closure = any(line.startswith("install.sh: Python ") for line in lines)
    if not closure:  # a Python new enough for NeMo Gym's release: pip resolves it all
        assert not any(line.startswith(RESOLVER) for line in lines), lines
        return
    said = [i for i, line in enumerate(lines) if line.startswith(EXPECTED)]
    assert len(said) == 1, lines
    resolver = [i for i, line in enumerate(lines) if line.startswith(RESOLVER)]
    assert all(i > said[0] for i in resolver), lines
    for line in lines[said[0] + 1 :]:
        if "requires" in line and "which is not installed" in line:
            assert line.startswith("nemo-gym 0.7.0 requires "), line  # NeMo Gym's, nothing else
