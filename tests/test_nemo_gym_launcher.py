"""NeMo Gym's own launcher (`gym env start`, what `ng_run` and NeMo-RL's NemoGym actor
run) starting a server under gym-proxy with N workers (the NeMo Gym tier; see
tests/test_nemo_gym_stack.py). The config change is one line, the entrypoint:

    entrypoint: -mgym_proxy        # was: app.py
    num_workers: 3             # gym-proxy's worker count

The launcher runs `<venv python> <entrypoint>` in the server's directory, so the server's
venv (which has gym-proxy installed) runs `python -mgym_proxy`; gym-proxy finds the server
class in that directory's `app.py`, and its instance, host, port and worker count in the
config the launcher passes. The launcher initializes the real Ray once and hands every
server its address; a server that uses Ray (code_gen) joins that one cluster."""

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

from tests.nemo_gym import code_gen  # noqa: E402
from tests.nemo_gym_stack import CounterClient  # noqa: E402
from tests.ports import free_port  # noqa: E402
from tests.support import (  # noqa: E402
    CONTROL_TOKEN,
    REPO,
    TEST_SECRET,
    Control,
    wait_until,
    wait_until_sync,
)


def start_launcher(tmp_path: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    """`gym env start +config_paths=[config.yaml]`, NeMo Gym's launcher, in its own group."""
    with open(tmp_path / "launcher.log", "wb") as log:
        return subprocess.Popen(
            [str(Path(sys.executable).parent / "gym"), "env", "start",
             f"+config_paths=[{tmp_path / 'config.yaml'}]"],
            cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip


def counter_config(tmp_path: Path, port: int, head: int, runtime: Path) -> dict:
    """The launcher recipe as docs/nemo_gym.md writes it: the server's venv prepared
    (`skip_venv_if_present`), `entrypoint: -mgym_proxy`, NeMo Gym's `num_workers`, and
    gym-proxy's own settings in the block's `gym_proxy:` key, nothing in the environment."""
    venv = tmp_path / "venvs" / "resources_servers" / "example_session_state_mgmt" / ".venv"
    if not venv.exists():
        venv.parent.mkdir(parents=True)
        venv.symlink_to(sys.prefix)  # the server's venv: this one, where gym-proxy is installed
    (tmp_path / "secret").write_text(TEST_SECRET)
    (tmp_path / "control-token").write_text(CONTROL_TOKEN)
    return {
        "uv_venv_dir": str(tmp_path / "venvs"),
        "skip_venv_if_present": True,
        "head_server": {"host": "127.0.0.1", "port": head},
        "counter": {
            "resources_servers": {
                "example_session_state_mgmt": {
                    "entrypoint": "-mgym_proxy",
                    "num_workers": 3,
                    "host": "127.0.0.1",
                    "port": port,
                    "domain": "agent",
                    "gym_proxy": {
                        "session_state": "session_id_to_counter",
                        "preload": True,  # as docs/nemo_gym.md recommends
                        "secret_file": str(tmp_path / "secret"),
                        "control_token_file": str(tmp_path / "control-token"),
                        "runtime_dir": str(runtime),
                    },
                }
            }
        },
    }


async def launcher_ready(launcher: subprocess.Popen[bytes], log: Path) -> None:
    def ready() -> bool:
        assert launcher.poll() is None, log.read_text()
        return "All 1 / 1 servers ready" in log.read_text()

    await wait_until(ready, 180, "the launcher to report its server ready")


async def test_the_launcher_recipe_keeps_a_counters_sessions_across_a_crash(tmp_path, short_tmp):
    """NeMo Gym's counter started by `gym env start` under gym-proxy, configured only by
    its config block: 3 workers (`num_workers`) and its session dict declared
    (`gym_proxy: {session_state: ...}`). Sessions are checkpointed, the whole launcher
    is killed (-9, with its servers), a new launcher starts from the same config, the
    sessions are restored, and NeMo Gym's clients carry on with their cookies."""
    port, head = free_port(), free_port()
    (tmp_path / "config.yaml").write_text(
        json.dumps(counter_config(tmp_path, port, head, short_tmp))
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("GYM_PROXY_")}
    env["PYTHONPATH"] = str(REPO)
    url, log = f"http://127.0.0.1:{port}", tmp_path / "launcher.log"
    episodes = [{"rollout_id": f"{task}-0", "attempt": 0} for task in range(12)]
    launcher = start_launcher(tmp_path, env)
    try:
        async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as http:
            await launcher_ready(launcher, log)
            control = Control(http, url)
            status = await control.ok("status")
            assert (status["instance"], status["kind"]) == ("counter", "resources")
            assert len(status["workers"]) == status["expected_workers"] == 3
            async with http.get(f"http://127.0.0.1:{head}/server_instances") as resp:
                instances = await resp.json()
            assert [(i["config_path"], i["port"]) for i in instances] == [("counter", port)]
            clients = [CounterClient(http, url, task) for task in range(12)]
            for i, client in enumerate(clients):
                await client.seed(10 * i)
            await asyncio.gather(*(c.post("/increment_counter", {"count": 5}) for c in clients))
            reply = await control.ok("prepare", checkpoint_id="launched")
            assert reply["report"]["restarts"] == []  # the declared dict: nothing restart-only
            committed = await control.ok(
                "commit", checkpoint_id="launched", checkpoint_dir=str(tmp_path / "ck"),
                episode_ids=episodes,
            )  # fmt: skip
            assert committed["manifest"]["record_count"] == 12

            os.killpg(launcher.pid, signal.SIGKILL)  # the job dies: launcher, head, gym-proxy
            launcher.wait(30)
            await wait_until(
                lambda: not group_alive(launcher.pid), 30, "the killed group to be gone"
            )
            launcher = start_launcher(tmp_path, env)
            await launcher_ready(launcher, log)
            await control.ok(
                "restore", checkpoint_id="launched", checkpoint_dir=str(tmp_path / "ck"),
                episode_ids=episodes,
            )  # fmt: skip
            await control.ok("resume", checkpoint_id="launched")
            for i, client in enumerate(clients):
                assert await client.count() == 10 * i + 5, i  # the same cookies, restored
                assert await client.verify(10 * i + 5) == 1.0, i
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(launcher.pid, signal.SIGINT)  # Ctrl-C: the launcher stops its servers
        try:
            launcher.wait(60)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(launcher.pid, signal.SIGKILL)
    assert "NeMo Gym finished!" in log.read_text()


def command_of(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def group_alive(pgid: int) -> list[int]:
    """Processes of process group `pgid` still alive (not zombies)."""
    alive = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                alive.append(int(entry.name))
    return alive


@pytest.mark.timeout(600)  # the launcher's Ray cluster and three NeMo Gym workers on 2 cores
@pytest.mark.parametrize("placement", ["local", "ray"])
async def test_a_ray_server_under_the_launcher_shares_its_cluster_and_stops_in_its_second(
    tmp_path, short_tmp, placement
):
    """code_gen (its verify runs as a Ray task) started by NeMo Gym's launcher under
    gym-proxy with 3 workers: they join the launcher's one Ray cluster (the address the
    launcher hands down), score right and wrong programs on every worker, and on Ctrl-C
    gym-proxy stops within the one second the launcher gives a server
    (`_GRACEFUL_SHUTDOWN_TIMEOUT_SEC`), leaving no process and no runtime directory. The
    same with `worker_placement: ray` in the config block: the workers in actors of the
    launcher's cluster (the one `gcs_server`), reached over their TCP link."""
    from nemo_gym.cli import env as launcher_module

    psutil = pytest.importorskip("psutil")
    grace = launcher_module._GRACEFUL_SHUTDOWN_TIMEOUT_SEC
    assert grace == 1  # what this test holds gym-proxy to
    port, head = free_port(), free_port()
    venv = tmp_path / "venvs" / "resources_servers" / "code_gen" / ".venv"
    venv.parent.mkdir(parents=True)
    venv.symlink_to(sys.prefix)  # the server's venv: this one, where gym-proxy is installed
    config = code_gen.config(port, head, uv_venv_dir=str(tmp_path / "venvs"))
    config["skip_venv_if_present"] = True
    block = config[code_gen.INSTANCE]["resources_servers"]["code_gen"]
    block.update({"entrypoint": "-mgym_proxy", "num_workers": 3})
    if placement == "ray":  # each worker in an actor of the launcher's cluster (2 CPUs here)
        block["gym_proxy"] = {"worker_placement": "ray", "worker_cpus": 0.25}
    (tmp_path / "config.yaml").write_text(json.dumps(config))
    runtime = short_tmp
    env = {
        **os.environ,
        "GYM_PROXY_SECRET": TEST_SECRET,
        "GYM_PROXY_CONTROL_TOKEN": CONTROL_TOKEN,
        "GYM_PROXY_RUNTIME_DIR": str(runtime),
        "PYTHONPATH": str(REPO),
    }
    launcher = start_launcher(tmp_path, env)
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "launcher.log"
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:

            async def ready() -> bool:
                assert launcher.poll() is None, log.read_text()
                return "All 1 / 1 servers ready" in log.read_text()

            await wait_until(ready, 300, "the launcher to report its server ready")
            tree = psutil.Process(launcher.pid).children(recursive=True)
            assert sum(p.name() == "gcs_server" for p in tree) == 1  # the launcher's, only
            calls = [(code_gen.RIGHT if i % 2 else code_gen.WRONG, i + 2) for i in range(12)]

            async def verify(code: str, n: int) -> float:
                async with http.post(f"{url}/verify", json=code_gen.verify_body(code, n)) as r:
                    assert r.status == 200, await r.text()
                    return (await r.json())["reward"]

            rewards = await asyncio.gather(*(verify(code, n) for code, n in calls))
            assert rewards == [1.0 if code == code_gen.RIGHT else 0.0 for code, _ in calls]
            status = await Control(http, url).ok("status")
            assert [w["requests_served"] > 0 for w in status["workers"]] == [True] * 3
            # Placed on the launcher's one-node cluster, gym-proxy's node: Unix sockets too.
            placed = [w["node"] != "local" for w in status["workers"]]
            assert all(
                "/placed-" in w["address"] for w in status["workers"] if w["node"] != "local"
            )
            assert placed == [placement == "ray"] * 3, status["workers"]
        os.kill(launcher.pid, signal.SIGINT)  # Ctrl-C: the launcher stops its servers
        launcher.wait(60)
        text = log.read_text()
        assert "NeMo Gym finished!" in text
        assert "didn't shutdown within" not in text, text[-2000:]  # not killed: it stopped
        # gym-proxy and its workers are gone when the launcher is; the launcher's own Ray
        # cluster exits after its driver, the launcher, on its own time.
        assert [p for p in group_alive(launcher.pid) if "gym_proxy" in command_of(p)] == []
        try:
            wait_until_sync(lambda: group_alive(launcher.pid) == [], 60, "the group to exit")
        except AssertionError:
            left = [command_of(p)[:100] for p in group_alive(launcher.pid)]
            raise AssertionError(f"still running after the launcher: {left}") from None
        assert list(runtime.iterdir()) == []
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launcher.pid, signal.SIGKILL)
