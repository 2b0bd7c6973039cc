"""The NeMo Gym quick start (docs/examples/nemo_gym/quickstart.sh) runs as it is: NeMo
Gym's launcher with its head server, the counter under gym-proxy, NeMo Gym's rollout
collection in its CLI form, a checkpoint, and everything stopped after. And when it
fails (issue 56: a user who sets `min_workers` in the counter's block without
`max_workers`), its output shows gym-proxy's own line first, before the end of the
launcher's log with NeMo Gym's traceback, and it leaves nothing running."""

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


COUNTER = "counter.resources_servers.example_session_state_mgmt.gym_proxy"


def quickstart(*overrides: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GYM_PROXY_", "NEMO_GYM_"))}
    env["QUICKSTART_VENV"] = sys.prefix  # the tier's venv (.venv313 in CI: the default)
    result = subprocess.run(
        ["bash", str(SCRIPT), *overrides], cwd=REPO, env=env, capture_output=True, text=True,
        timeout=540,
    )  # fmt: skip
    output = result.stdout + result.stderr
    found = re.search(r"quickstart: files in (\S+)", output)
    assert found is not None, output[-4000:]
    return result, Path(found.group(1))


def left_running(work: Path) -> list[object]:
    left = []
    for proc in psutil.process_iter(["cmdline"]):
        if any(str(work) in part for part in proc.info["cmdline"] or ()):
            left.append(proc)
    return left


@pytest.mark.timeout(600)
def test_the_quick_start_runs_and_leaves_nothing_running():
    result, work = quickstart()
    output = result.stdout + result.stderr
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
        assert not left_running(work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


@pytest.mark.timeout(600)
def test_a_quick_start_that_fails_shows_gym_proxy_s_own_line_first():
    result, work = quickstart(f"++{COUNTER}.min_workers=3")
    try:
        assert result.returncode == 1, result.stdout + result.stderr
        said = result.stderr.split("quickstart: failed; gym-proxy said:\n", 1)
        assert len(said) == 2, result.stderr[-4000:]
        first = said[1].splitlines()[0]
        assert first.endswith("--min-workers needs --max-workers"), said[1][:2000]
        assert f"quickstart: the end of {work}/launcher.log:" in said[1]
        assert not left_running(work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
