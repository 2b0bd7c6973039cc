"""NeMo Gym's own launcher (`gym env start`, what `ng_run` and NeMo-RL's NemoGym actor
run) starting a server under gym-proxy with N workers (the NeMo Gym tier; see
tests/test_nemo_gym_stack.py). The config change is one line, the entrypoint:

    entrypoint: -mproxy        # was: app.py
    num_workers: 3             # gym-proxy's worker count

The launcher runs `<venv python> <entrypoint>` in the server's directory, so the server's
venv (which has gym-proxy installed) runs `python -mproxy`; gym-proxy finds the server
class in that directory's `app.py`, and its instance, host, port and worker count in the
config the launcher passes. The launcher's Ray is the tier's substitute (its README)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

pytest.importorskip("nemo_gym", reason="the NeMo Gym tier runs in tests/nemo_gym/install.sh's venv")

from tests.nemo_gym_stack import CounterClient, free_port  # noqa: E402
from tests.support import CONTROL_TOKEN, REPO, TEST_SECRET, Control, wait_until  # noqa: E402


def start_launcher(tmp_path: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    """`gym env start +config_paths=[config.yaml]`, NeMo Gym's launcher, in its own group."""
    with open(tmp_path / "launcher.log", "wb") as log:
        return subprocess.Popen(
            [str(Path(sys.executable).parent / "gym"), "env", "start",
             f"+config_paths=[{tmp_path / 'config.yaml'}]"],
            cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip


async def test_nemo_gyms_launcher_starts_a_server_under_gym_proxy(tmp_path):
    port, head = free_port(), free_port()
    venv = tmp_path / "venvs" / "resources_servers" / "example_session_state_mgmt" / ".venv"
    venv.parent.mkdir(parents=True)
    venv.symlink_to(sys.prefix)  # the server's venv: this one, where gym-proxy is installed
    config = {
        "uv_venv_dir": str(tmp_path / "venvs"),
        "skip_venv_if_present": True,
        "head_server": {"host": "127.0.0.1", "port": head},
        "counter": {
            "resources_servers": {
                "example_session_state_mgmt": {
                    "entrypoint": "-mproxy",
                    "num_workers": 3,
                    "host": "127.0.0.1",
                    "port": port,
                    "domain": "agent",
                }
            }
        },
    }
    (tmp_path / "config.yaml").write_text(json.dumps(config))
    env = {
        **os.environ,
        "GYM_PROXY_SECRET": TEST_SECRET,
        "GYM_PROXY_CONTROL_TOKEN": CONTROL_TOKEN,
        "PYTHONPATH": str(REPO),
    }
    launcher = start_launcher(tmp_path, env)
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as http:

            async def ready() -> bool:
                assert launcher.poll() is None, (tmp_path / "launcher.log").read_text()
                return "All 1 / 1 servers ready" in (tmp_path / "launcher.log").read_text()

            await wait_until(ready, 120, "the launcher to report its server ready")
            status = await Control(http, url).ok("status")
            assert (status["instance"], status["kind"]) == ("counter", "resources")
            assert len(status["workers"]) == status["expected_workers"] == 3
            async with http.get(f"http://127.0.0.1:{head}/server_instances") as resp:
                instances = await resp.json()
            assert [(i["config_path"], i["port"]) for i in instances] == [("counter", port)]
            clients = [CounterClient(http, url, task) for task in range(12)]
            for i, client in enumerate(clients):
                await client.seed(i)
            await asyncio.gather(*(c.post("/increment_counter", {"count": 5}) for c in clients))
            assert [await c.count() for c in clients] == [i + 5 for i in range(12)]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(launcher.pid, signal.SIGINT)  # Ctrl-C: the launcher stops its servers
        try:
            launcher.wait(60)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(launcher.pid, signal.SIGKILL)
    assert "NeMo Gym finished!" in (tmp_path / "launcher.log").read_text()
