"""gym-proxy-ctl across two participants of different kinds, with real processes."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import orjson

from coordinator.clients.controller import Participant, in_call_order
from tests.support import CONTROL_TOKEN, REPO, Control, wait_until

TOKEN = "X-NeMo-Gym-Session-Token"


def test_call_order_is_callers_first():
    kinds = ["resources", "agent", "custom", "environment", "model"]
    ordered = in_call_order([Participant(f"u{k}", "t", None, k) for k in kinds])  # type: ignore[arg-type]
    assert [p.kind for p in ordered] == ["environment", "model", "agent", "resources", "custom"]


def ctl(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-c", "from coordinator.clients.controller_cli import main; main()"]
    return subprocess.run([*command, "--token", CONTROL_TOKEN, *args], cwd=REPO, text=True,
                          capture_output=True, timeout=60)  # fmt: skip


async def seed(http, url, count):
    async with http.post(f"{url}/seed_session", json={"initial_count": count}) as resp:
        return resp.headers[TOKEN]


async def value(http, url, token):
    async with http.post(f"{url}/get_counter_value", headers={TOKEN: token}) as resp:
        return resp.status, (await resp.json()).get("count")


async def test_checkpoint_and_restore_two_participants(start_proxy, http, tmp_path):
    env = start_proxy(workers=1, control_token=CONTROL_TOKEN, env={"GYM_TEST_KIND": "environment"})
    res = start_proxy(workers=2, control_token=CONTROL_TOKEN)
    tokens = {env.url: await seed(http, env.url, 3), res.url: await seed(http, res.url, 5)}
    result = await asyncio.to_thread(
        ctl, "--server", res.url, "--server", env.url, "checkpoint", "ck1", str(tmp_path)
    )
    assert result.returncode == 0, result.stderr
    replies = orjson.loads(result.stdout)
    assert {r["manifest"]["kind"] for r in replies.values()} == {"environment", "resources"}
    assert (tmp_path / "gym/environment/apps/manifest.json").exists()
    assert (tmp_path / "gym/resources/apps/manifest.json").exists()
    for proxy in (env, res):
        assert (await Control(http, proxy.url).ok("status"))["phase"] == "idle"  # resumed
        proxy.kill_all()

    env2 = start_proxy(workers=2, control_token=CONTROL_TOKEN, env={"GYM_TEST_KIND": "environment"})
    res2 = start_proxy(workers=1, control_token=CONTROL_TOKEN)
    result = await asyncio.to_thread(
        ctl, "--server", env2.url, "--server", res2.url, "restore", "r1", str(tmp_path), "--resume"
    )
    assert result.returncode == 0, result.stderr
    assert await value(http, env2.url, tokens[env.url]) == (200, 3)
    assert await value(http, res2.url, tokens[res.url]) == (200, 5)


async def test_failed_prepare_resumes_everything(start_proxy, http, tmp_path):
    env = start_proxy(workers=1, control_token=CONTROL_TOKEN, env={"GYM_TEST_KIND": "environment"})
    res = start_proxy(workers=1, control_token=CONTROL_TOKEN)
    token = await seed(http, res.url, 1)
    slow = asyncio.ensure_future(http.get(f"{res.url}/slow?seconds=4", headers={TOKEN: token}))

    async def busy():
        status = await Control(http, res.url).ok("status")
        return status["workers"][0]["in_flight"] == 1

    await wait_until(busy, 10, "the slow request to be in flight")
    result = await asyncio.to_thread(
        ctl,
        "--timeout",
        "1",
        "--server",
        env.url,
        "--server",
        res.url,
        "checkpoint",
        "ck-fail",
        str(tmp_path),
    )
    assert result.returncode == 1 and "not_ready" in result.stderr
    assert not (tmp_path / "gym").exists()
    for proxy in (env, res):  # both resumed: admission open again
        assert (await Control(http, proxy.url).ok("status"))["phase"] == "idle"
        async with http.post(f"{proxy.url}/seed_session", json={}) as resp:
            assert resp.status == 200
    async with await slow as resp:
        assert resp.status == 200


def test_bad_usage():
    result = subprocess.run(
        [sys.executable, "-c", "from coordinator.clients.controller_cli import main; main()",
         "--server", "http://127.0.0.1:9", "status"],
        cwd=REPO, text=True, capture_output=True, timeout=60,
        env={"PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert result.returncode == 2 and "--token" in result.stderr
    result = ctl("--server", "http://127.0.0.1:9", "status")
    assert result.returncode == 1 and "unreachable" in result.stderr
