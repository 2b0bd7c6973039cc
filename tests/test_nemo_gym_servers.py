"""NeMo Gym server classes as APP (the NeMo Gym tier, tests/test_nemo_gym_stack.py): built
by their own `run_webserver()`, configured from NeMo Gym's global config, their session
dicts declared as state, and what goes wrong said in one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

pytest.importorskip("nemo_gym", reason="the NeMo Gym tier runs in tests/nemo_gym/install.sh's venv")

from tests.nemo_gym_stack import CounterClient  # noqa: E402
from tests.ports import free_port  # noqa: E402
from tests.support import CONTROL_TOKEN, REPO, TEST_SECRET, Control, wait_until  # noqa: E402

COUNTER = "resources_servers.example_session_state_mgmt.app:StatefulCounterResourcesServer"
TAGGED = "tests.nemo_gym.servers:TaggedResourcesServer"


def counter_config(port: int, workers: int | None = None, **extra: object) -> dict:
    block = {"entrypoint": "app.py", "host": "127.0.0.1", "port": port, "domain": "agent"}
    if workers is not None:
        block["num_workers"] = workers
    block.update(extra)
    return {
        "head_server": {"host": "127.0.0.1", "port": free_port()},
        "dry_run": False,
        "counter": {"resources_servers": {"example_session_state_mgmt": block}},
    }


def gym_proxy(tmp_path: Path, *args: str, env: dict | None = None) -> subprocess.Popen:
    (tmp_path / "secret").write_text(TEST_SECRET)
    (tmp_path / "control").write_text(CONTROL_TOKEN)
    with open(tmp_path / "proxy.log", "wb") as log:  # the child has its own copy
        return subprocess.Popen(
            [sys.executable, "-m", "gym_proxy", *args, "--secret-file", str(tmp_path / "secret"),
             "--control-token-file", str(tmp_path / "control"), "--runtime-dir", "/tmp"],
            cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
            env={**(env or os.environ), "PYTHONPATH": str(REPO)},
        )  # fmt: skip


async def wait_healthy(
    http: aiohttp.ClientSession, url: str, proc: subprocess.Popen, tmp_path: Path
) -> None:
    """Until the server's NeMo Gym liveness route answers 200."""

    async def healthy() -> bool:
        assert proc.poll() is None, (tmp_path / "proxy.log").read_text()
        try:
            async with http.get(f"{url}/health") as resp:
                return resp.status == 200
        except aiohttp.ClientConnectionError:
            return False  # not listening before every worker registered

    await wait_until(healthy, 60, f"{url} to serve")


async def test_a_server_class_from_a_config_file_takes_its_instance(tmp_path):
    """`gym-proxy <class> --nemo-gym-config FILE`: NeMo Gym's parser reads the file, the
    class's only instance gives the name, host, port and worker count; the counter runs
    as NeMo Gym builds it (its liveness routes, its session cookie), and gym-proxy warns
    that it declares no state."""
    port = free_port()
    config = tmp_path / "config.yaml"
    config.write_text(json.dumps(counter_config(port, workers=3)))
    proc = gym_proxy(tmp_path, COUNTER, "--nemo-gym-config", str(config))
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as http:
            await wait_healthy(http, url, proc, tmp_path)
            status = await Control(http, url).ok("status")
            assert (status["instance"], status["kind"]) == ("counter", "resources")
            assert len(status["workers"]) == status["expected_workers"] == 3
            client = CounterClient(http, url, task=7)
            await client.seed(4)
            assert "StatefulCounterResourcesServer___counter" in client.cookies
            assert "gym_proxy___counter" in client.cookies  # named after the instance
            await client.post("/increment_counter", {"count": 3})
            assert await client.count() == 7
        log = (tmp_path / "proxy.log").read_text()
        assert "declares no session state, so it is a restart-only participant" in log
    finally:
        proc.terminate()
        proc.wait(30)


def test_the_one_server_config_the_docs_show_names_its_instance():
    """docs/nemo_gym.md's "One server" stack.yaml, read by NeMo Gym's own parser as
    gym-proxy reads it: the instance the command names, its host, port and workers."""
    from gym_proxy.worker.app_loading import import_app_target
    from gym_proxy.worker.nemo_gym_server import resolve_instance

    shown = REPO / "docs" / "examples" / "nemo_gym" / "stack.yaml"
    assert (
        shown.read_text().split("head_server:", 1)[1] in (REPO / "docs" / "nemo_gym.md").read_text()
    )
    cls = import_app_target(COUNTER, ".")
    instance = resolve_instance(cls, str(shown), "example_session_state_mgmt_resources_server")
    assert (instance.host, instance.port, instance.num_workers) == ("127.0.0.1", 8001, 4)


async def test_the_config_blocks_log_level_holds_for_gym_proxys_own_log(tmp_path):
    """`gym_proxy: {log_level: warning}` in the server's block, as the shipped example
    sets it: gym-proxy's own INFO lines (the runtime directory, each worker started and
    registered, "ready on") are not written, and its warnings still are (the counter
    declares no state)."""
    port = free_port()
    config = tmp_path / "config.yaml"
    block = {"log_level": "warning"}
    config.write_text(json.dumps(counter_config(port, workers=2, gym_proxy=block)))
    proc = gym_proxy(tmp_path, COUNTER, "--nemo-gym-config", str(config))
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as http:
            await wait_healthy(http, url, proc, tmp_path)
            status = await Control(http, url).ok("status")
            assert len(status["workers"]) == 2
    finally:
        proc.terminate()
        proc.wait(30)
    log = (tmp_path / "proxy.log").read_text()
    assert "gym-proxy WARNING" in log and "declares no session state" in log
    assert "gym-proxy INFO" not in log, log


async def test_a_state_that_is_not_json_fails_the_commit_and_writes_nothing(tmp_path):
    port = free_port()
    config = counter_config(port)
    config["tagged"] = {"resources_servers": {"tagged": {
        "entrypoint": "app.py", "host": "127.0.0.1", "port": port, "domain": "agent",
    }}}  # fmt: skip
    del config["counter"]
    env = {**os.environ, "NEMO_GYM_CONFIG_DICT": json.dumps(config),
           "NEMO_GYM_CONFIG_PATH": "tagged"}  # fmt: skip
    proc = gym_proxy(
        tmp_path, TAGGED, "--workers", "2", "--session-state", "session_id_to_tags", env=env
    )
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as http:
            await wait_healthy(http, url, proc, tmp_path)
            plain, odd = CounterClient(http, url, 1), CounterClient(http, url, 2)
            await plain.post("/seed_session", {})
            await odd.post("/seed_session", {})
            await plain.post("/tag", {"tag": "a"})
            odd_session = (await odd.post("/tag", {"tag": "b", "as_set": True}))["session_id"]
            control = Control(http, url)
            assert (await control.ok("prepare", checkpoint_id="bad"))["phase"] == "prepared"
            status, reply = await control.call(
                "commit", checkpoint_id="bad", checkpoint_dir=str(tmp_path / "ck")
            )
            assert status == 500 and reply["error"]["code"] == "unexportable_state", reply
            detail = reply["error"]["detail"]
            assert f"session {odd_session}" in detail and "set" in detail, detail
            assert not (tmp_path / "ck").exists() or not any((tmp_path / "ck").rglob("*.json*"))
            await control.ok("resume", checkpoint_id="bad")  # the app's calls wait till then
            await odd.post("/tag", {"tag": "c"})  # a list again
            committed = await control.checkpoint("good", str(tmp_path / "ck"))
            assert committed["manifest"]["record_count"] == 2
            await control.ok("resume", checkpoint_id="good")
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([COUNTER], "give its global config with --nemo-gym-config FILE"),
        (["gym_proxy.worker.counter:create_app", "--session-state", "x"], "NeMo Gym server class"),
    ],
)
def test_what_cannot_work_is_one_line_before_any_worker(tmp_path, args, message):
    env = {k: v for k, v in os.environ.items() if not k.startswith("NEMO_GYM")}
    proc = gym_proxy(tmp_path, *args, env=env)
    assert proc.wait(60) == 2
    log = (tmp_path / "proxy.log").read_text()
    assert message in log and "worker 0 started" not in log, log


def test_a_session_state_that_is_no_dict_stops_the_boot(tmp_path):
    port = free_port()
    config = tmp_path / "config.yaml"
    config.write_text(json.dumps(counter_config(port)))
    proc = gym_proxy(
        tmp_path, COUNTER, "--nemo-gym-config", str(config), "--session-state", "config"
    )
    assert proc.wait(60) == 3  # a boot error: not respawned
    log = (tmp_path / "proxy.log").read_text()
    assert "--session-state config: StatefulCounterResourcesServer.config is a" in log, log
    assert "Traceback" not in log, log  # a mistake in the flags, not in the app


def test_a_mistyped_session_state_is_one_line_before_any_worker(tmp_path):
    """An attribute the class does not have: exit 2 with one line naming its dicts."""
    config = tmp_path / "config.yaml"
    config.write_text(json.dumps(counter_config(free_port())))
    proc = gym_proxy(
        tmp_path,
        COUNTER,
        "--nemo-gym-config",
        str(config),
        "--session-state",
        "session_id_to_countr",
    )
    assert proc.wait(60) == 2
    lines = (tmp_path / "proxy.log").read_text().strip().splitlines()
    assert lines == [
        "gym-proxy: error: --session-state session_id_to_countr: StatefulCounterResources"
        "Server has no attribute 'session_id_to_countr' (its dict fields: "
        "session_id_to_counter)"
    ], lines


def test_a_gym_proxy_block_that_cannot_work_is_one_line_before_any_worker(tmp_path):
    """The server block's `gym_proxy:` settings (proxy/config_block.py): a key the block
    cannot set is refused with the key's full path and what to write instead."""
    config = tmp_path / "config.yaml"
    block = {"session_state": "session_id_to_counter", "workers": 3}
    config.write_text(json.dumps(counter_config(free_port(), gym_proxy=block)))
    proc = gym_proxy(tmp_path, COUNTER, "--nemo-gym-config", str(config))
    assert proc.wait(60) == 2
    lines = (tmp_path / "proxy.log").read_text().strip().splitlines()
    assert lines == [
        "gym-proxy: error: counter.resources_servers.example_session_state_mgmt.gym_proxy."
        "workers cannot be set here: set the server's own `num_workers`"
    ], lines


async def test_the_counter_outlives_a_killed_gym_proxy_and_is_adopted(tmp_path):
    """NeMo Gym's counter on 2 workers with `--orphan-grace`: gym-proxy alone is killed
    (kill -9) with 8 sessions live, the same command is started again, and every
    session answers from the same worker processes with its count, through its NeMo Gym
    session cookie and gym-proxy's, as before the crash."""
    port = free_port()
    config = tmp_path / "config.yaml"
    config.write_text(json.dumps(counter_config(port, workers=2)))
    args = (COUNTER, "--nemo-gym-config", str(config), "--orphan-grace", "60")
    url = f"http://127.0.0.1:{port}"
    proc = gym_proxy(tmp_path, *args, "--session-state", "session_id_to_counter")
    try:
        async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as http:
            await wait_healthy(http, url, proc, tmp_path)
            pids = {w["pid"] for w in (await Control(http, url).ok("status"))["workers"]}
            clients = [CounterClient(http, url, task) for task in range(8)]
            for n, client in enumerate(clients):
                await client.seed(n)
                await client.post("/increment_counter", {"count": 10})
        proc.kill()
        proc.wait(10)
        proc = gym_proxy(tmp_path, *args, "--session-state", "session_id_to_counter")
        async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as http:
            await wait_healthy(http, url, proc, tmp_path)
            status = await Control(http, url).ok("status")
            assert {w["pid"] for w in status["workers"]} == pids
            for n, client in enumerate(clients):
                client.http = http
                await client.post("/increment_counter", {"count": 1})
                assert await client.count() == n + 11
        assert "adopted 2 workers of the dead instance" in (tmp_path / "proxy.log").read_text()
    finally:
        proc.terminate()
        proc.wait(30)
