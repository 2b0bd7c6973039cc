"""What an install puts into a venv: one top-level name, `gym_proxy`.

Under NeMo Gym's launcher gym-proxy is installed into each server's own venv, beside
that server's dependencies; a generic top-level name (`proxy`, `worker`) would shadow,
or be shadowed by, another distribution's module without a word. The wheel is built
without the mypyc compile (GYM_PROXY_COMPILE=0): the layout is what is checked here;
tests/test_data_path_build.py checks the compiled build.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.support import REPO

pytestmark = pytest.mark.fast


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "--quiet", "-w", str(out), str(REPO)],
        env={**os.environ, "GYM_PROXY_COMPILE": "0"}, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    (built,) = out.glob("gym_proxy-*.whl")
    return built


def test_the_wheel_installs_one_top_level_name(wheel: Path):
    names = zipfile.ZipFile(wheel).namelist()
    top = {name.split("/")[0] for name in names}
    assert {t for t in top if not t.endswith(".dist-info")} == {"gym_proxy"}
    (top_level,) = [n for n in names if n.endswith(".dist-info/top_level.txt")]
    assert zipfile.ZipFile(wheel).read(top_level).decode().split() == ["gym_proxy"]
    for part in ("proxy", "worker", "coordinator"):
        assert f"gym_proxy/{part}/__init__.py" in names


def test_a_fresh_venv_gains_one_top_level_name(wheel: Path, tmp_path: Path):
    """Installed into a new virtualenv, the wheel adds `gym_proxy` and its metadata to
    site-packages, nothing else (its dependencies are not the point: --no-deps)."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    where = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        check=True, capture_output=True, text=True, timeout=60,
    ).stdout.strip()  # fmt: skip
    before = {entry.name for entry in Path(where).iterdir()}
    subprocess.run(
        [str(python), "-m", "pip", "install", "--no-deps", "--quiet", str(wheel)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    added = {entry.name for entry in Path(where).iterdir()} - before
    assert added == {"gym_proxy", "gym_proxy-0.1.0.dist-info"}, added


def test_the_installed_package_runs_from_its_one_name(wheel: Path, tmp_path: Path):
    """Installed apart from the source tree (its dependencies from this venv), the
    command and `python -m gym_proxy` load only from `gym_proxy`, and a module of
    someone else's called `proxy` beside it is left alone."""
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--quiet", "--target",
         str(target), str(wheel)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    (target / "proxy.py").write_text("WHOSE = 'another distribution'\n")
    env = {**os.environ, "PYTHONPATH": str(target)}
    probe = (
        "import gym_proxy, proxy; from gym_proxy.proxy import cli;"
        "print(gym_proxy.__file__); print(proxy.WHOSE)"
    )
    run = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True,
        text=True, timeout=60,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == [
        str(target / "gym_proxy" / "__init__.py"),
        "another distribution",
    ]
    usage = subprocess.run(
        [sys.executable, "-m", "gym_proxy", "--help"], cwd=tmp_path, env=env,
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert usage.returncode == 0, usage.stderr
    assert usage.stdout.startswith("usage: gym-proxy")
