"""The data path runs as its mypyc build or as its Python source
(proxy/data_path/__init__.py).

The rest of the suite runs what the install built (the compiled modules after
`.ci/run`). Here: the install did build them, the Python source passes the in-process
data path tests as well, and an edited source is never shadowed by its stale build.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gym_proxy.proxy import data_path
from tests.support import REPO

pytestmark = pytest.mark.fast

BUILD_SKIPPED = os.environ.get("GYM_PROXY_COMPILE") == "0"
PURE_ASKED = os.environ.get("GYM_PROXY_PURE_PYTHON") == "1"
PROBE = (
    "import gym_proxy.proxy.data_path.exchange as e, gym_proxy.proxy.data_path as d;"
    "print(*d.mode(), sep='\\n'); print(e.__file__); print(d.unexpected())"
)


def probe(root: Path, pure: bool = False) -> tuple[str, str, str]:
    """(mode, reason, file of the exchange module) as a fresh interpreter in `root` sees;
    the source runs unexpected (a warning at start) exactly when a build is there and
    the source was not asked for."""
    env = {**os.environ, "GYM_PROXY_PURE_PYTHON": "1" if pure else ""}
    result = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=root, env=env, capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    mode, reason, module_file, unexpected = result.stdout.splitlines()
    built = any((root / "proxy" / "data_path").glob("*" + data_path.EXT_SUFFIX))
    built = built or (root / data_path.MANIFEST.relative_to(REPO)).exists()
    assert unexpected == str(mode == "python" and built and not pure), (mode, reason)
    return mode, reason, module_file


def copy_checkout(tmp_path: Path) -> Path:
    """The checkout with its build, in `tmp_path`/checkout (no venvs, history or build folder)."""
    ignore = shutil.ignore_patterns("__pycache__", ".venv*", "build", ".git")
    shutil.copytree(REPO, tmp_path / "checkout", ignore=ignore, symlinks=True)
    return tmp_path / "checkout"


@pytest.mark.skipif(BUILD_SKIPPED or PURE_ASKED, reason="the compiled build is off on purpose")
def test_the_install_runs_the_compiled_data_path():
    mode, reason = data_path.mode()
    assert mode == "compiled", f"the install did not build the data path: {reason}"
    assert probe(REPO)[0] == "compiled"


def test_the_python_source_passes_the_in_process_data_path_tests():
    mode, reason, module_file = probe(REPO, pure=True)
    assert mode == "python" and module_file.endswith("exchange.py"), (mode, reason)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_data_path.py"],
        cwd=REPO, env={**os.environ, "GYM_PROXY_PURE_PYTHON": "1"},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert " passed" in result.stdout


@pytest.mark.skipif(data_path.mode()[0] != "compiled", reason="no compiled build installed")
def test_an_edited_source_runs_as_python_not_as_its_stale_build(tmp_path: Path):
    built = tmp_path / "proxy" / "data_path"
    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copytree(REPO / "gym_proxy", tmp_path / "gym_proxy", ignore=ignore, symlinks=True)
    for package in ("proxy", "coordinator", "worker"):
        shutil.copytree(REPO / package, tmp_path / package, ignore=ignore)
    assert probe(tmp_path)[0] == "compiled"

    with (built / "outbox.py").open("a") as source:
        source.write("\n# an edit after the build\n")
    mode, reason, module_file = probe(tmp_path)
    assert mode == "python" and "gym_proxy.proxy.data_path.outbox" in reason
    assert module_file == str(built / "exchange.py")  # all or none

    for extension in built.glob("routing.*.so"):
        extension.unlink()  # a partial build runs as Python too
    (built / "outbox.py").write_bytes((REPO / "proxy" / "data_path" / "outbox.py").read_bytes())
    mode, reason, module_file = probe(tmp_path)
    assert mode == "python" and "manifest" in reason
    assert module_file == str(built / "exchange.py")

    (tmp_path / data_path.MANIFEST.relative_to(REPO)).unlink()  # a build with no manifest
    mode, reason, module_file = probe(tmp_path)
    assert mode == "python" and module_file == str(built / "exchange.py")

    (tmp_path / data_path.MANIFEST.relative_to(REPO)).write_bytes(data_path.MANIFEST.read_bytes())
    for extension in built.glob("*" + data_path.EXT_SUFFIX):
        extension.unlink()  # a manifest whose extensions are gone
    mode, reason, _ = probe(tmp_path)
    assert mode == "python" and "manifest is there but none" in reason


@pytest.mark.skipif(data_path.mode()[0] != "compiled", reason="no compiled build installed")
@pytest.mark.parametrize("compile_", ["1", "0"], ids=["compiling", "not-compiling"])
def test_setup_py_leaves_the_checkouts_build_alone(tmp_path: Path, compile_: str):
    """setup.py run in a built checkout by an install that is not this build's (`pip
    install .`, whose build goes to the build folder and the wheel; one with
    GYM_PROXY_COMPILE=0; or one for another Python) must not change what this build
    runs: its manifest and extensions stay, and it still runs compiled."""
    checkout = copy_checkout(tmp_path)
    manifest = checkout / data_path.MANIFEST.relative_to(REPO)
    before = manifest.read_bytes()
    result = subprocess.run(
        [sys.executable, "setup.py", "--version"], cwd=checkout,
        env={**os.environ, "GYM_PROXY_COMPILE": compile_}, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert manifest.read_bytes() == before
    assert probe(checkout)[0] == "compiled"
    folder = checkout / "proxy" / "data_path"
    other_abi = folder / "_compiled_sources.cpython-399-x86_64-linux-gnu.json"
    other_abi.write_text("{}")  # another Python's build beside this one
    (folder / "exchange.cpython-399-x86_64-linux-gnu.so").write_bytes(b"")
    assert probe(checkout)[0] == "compiled"
