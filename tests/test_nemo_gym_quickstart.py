"""The NeMo Gym quick start (docs/examples/nemo_gym/quickstart.sh) runs as it is: NeMo
Gym's launcher with its head server, the counter under gym-proxy, NeMo Gym's rollout
collection in its CLI form, a checkpoint, and everything stopped after."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("nemo_gym", reason="the NeMo Gym tier runs in tests/nemo_gym/install.sh's venv")
psutil = pytest.importorskip("psutil")

from tests.support import REPO  # noqa: E402

SCRIPT = REPO / "docs" / "examples" / "nemo_gym" / "quickstart.sh"


@pytest.mark.timeout(600)
def test_the_quick_start_runs_and_leaves_nothing_running():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GYM_PROXY_", "NEMO_GYM_"))}
    env["QUICKSTART_VENV"] = sys.prefix  # the tier's venv (.venv313 in CI: the default)
    result = subprocess.run(
        ["bash", str(SCRIPT)], cwd=REPO, env=env, capture_output=True, text=True, timeout=540,
    )  # fmt: skip
    output = result.stdout + result.stderr
    found = re.search(r"quickstart: files in (\S+)", output)
    assert found is not None, output[-4000:]
    work = Path(found.group(1))
    try:
        assert result.returncode == 0, output[-4000:]
        assert "8 of 8 rollouts scored 1.0" in result.stdout, output[-4000:]
        assert re.findall(r"reward (\S+)", result.stdout) == ["1.0"] * 8
        assert "checkpoint: checkpoint quickstart committed on 1 participant(s); complete" in (
            result.stdout
        )
        assert any((work / "checkpoint").rglob("*.json*"))  # the manifest was written
        assert "NeMo Gym finished!" in (work / "launcher.log").read_text()
        assert not [p for p in work.iterdir() if p.name.startswith("gym-proxy-")]  # runtime dir
        left = []
        for proc in psutil.process_iter(["cmdline"]):
            if any(str(work) in part for part in proc.info["cmdline"] or ()):
                left.append(proc)
        assert not left, left
    finally:
        shutil.rmtree(work, ignore_errors=True)
