"""gym-proxy-ctl across two participants of different kinds, with real processes."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import orjson

from gym_proxy.coordinator.clients.controller import Participant, in_call_order
from tests.support import CONTROL_TOKEN, REPO, Control, app_saw, wait_until

TOKEN = "X-NeMo-Gym-Session-Token"
RESTART_ONLY_APP = "tests.apps:create_restart_only_app"

CTL_MAIN = "from gym_proxy.coordinator.clients.controller_cli import main; main()"


def test_call_order_is_callers_first():
    kinds = ["resources", "agent", "custom", "environment", "model"]
    # No HTTP session: ordering makes no call.
    ordered = in_call_order([Participant(f"u{k}", "t", None, k) for k in kinds])  # type: ignore[arg-type]
    assert [p.kind for p in ordered] == ["environment", "model", "agent", "resources", "custom"]


def ctl(*args: str) -> subprocess.CompletedProcess[str]:
    command = [
        sys.executable,
        "-c",
        CTL_MAIN,
    ]
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
    document = orjson.loads(result.stdout)
    assert document["complete"] is True and document["restart_count"] == 0, document
    replies = document["committed"]
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


async def test_a_partial_checkpoint_exits_3_and_names_its_restarts(
    in_process, http, tmp_path, test_app
):
    """A restart-only server (it declares no state) with requests in flight bound to
    rollouts: the checkpoint holds none of them. gym-proxy-ctl prints them by server,
    rollout ID and attempt, says so on stderr and exits 3; with --allow-restarts it exits 0
    and still prints them. The rollouts keep running: the checkpoint does not stop them."""
    proxy = await in_process(workers=2, app=RESTART_ONLY_APP, control_token=CONTROL_TOKEN)
    tokens = {}
    for key in ("ro-1", "ro-2-a1", "ro-3"):  # ro-2-a1: rollout ro-2, attempt 1
        url = f"{proxy.url}/ng-rollout/{key}/seed_session"
        async with http.post(url, json={"initial_count": 1}) as resp:
            assert resp.status == 200
            tokens[key] = resp.headers[TOKEN]
    held = [
        asyncio.ensure_future(
            http.post(f"{proxy.url}/ng-rollout/{key}/hold?name={key}", headers={TOKEN: token})
        )
        for key, token in tokens.items()
    ]

    async def all_in_flight() -> bool:
        status = await Control(http, proxy.url).ok("status")
        return sum(w["in_flight"] for w in status["workers"]) == 3

    await wait_until(all_in_flight, 10, "the three requests to be in flight")
    server = proxy.url.removeprefix("http://")  # HOST:PORT means http://HOST:PORT
    expected = {
        proxy.url: [
            {"rollout_id": "ro-1", "attempt": 0},
            {"rollout_id": "ro-2", "attempt": 1},
            {"rollout_id": "ro-3", "attempt": 0},
        ]
    }
    result = await asyncio.to_thread(ctl, "--server", server, "checkpoint", "ck", str(tmp_path))
    assert result.returncode == 3, (result.stdout, result.stderr)
    document = orjson.loads(result.stdout)
    assert document["complete"] is False and document["restarts"] == expected, document
    assert document["restart_count"] == 3
    assert document["committed"][proxy.url]["manifest"]["record_count"] == 0
    assert "partial: 3 rollout(s) in flight are not in it" in result.stderr
    assert "--allow-restarts" in result.stderr and result.stderr.count("\n") == 1
    assert (await Control(http, proxy.url).ok("status"))["phase"] == "idle"  # resumed

    result = await asyncio.to_thread(
        ctl, "--server", server, "checkpoint", "ck2", str(tmp_path / "2"), "--allow-restarts"
    )
    assert result.returncode == 0, (result.stdout, result.stderr)
    assert orjson.loads(result.stdout)["restarts"] == expected
    assert "accepted (--allow-restarts)" in result.stderr
    for key, token in tokens.items():
        release = f"{proxy.url}/release?name={key}"
        async with http.post(release, headers={TOKEN: token}) as resp:
            assert resp.status == 200
    for request in held:
        async with await request as resp:
            assert resp.status == 200


async def test_failed_prepare_resumes_everything(start_proxy, http, tmp_path):
    env = start_proxy(workers=1, control_token=CONTROL_TOKEN, env={"GYM_TEST_KIND": "environment"})
    res = start_proxy(workers=1, control_token=CONTROL_TOKEN)
    token = await seed(http, res.url, 1)
    slow = asyncio.ensure_future(http.get(f"{res.url}/slow?seconds=4", headers={TOKEN: token}))

    await wait_until(lambda: app_saw(http, res.url, token, "/slow"), 10, "/slow to run")
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
        [sys.executable, "-c", CTL_MAIN,
         "--server", "http://127.0.0.1:9", "status"],
        cwd=REPO, text=True, capture_output=True, timeout=60,
        env={"PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert result.returncode == 2 and "--token" in result.stderr
    result = ctl("--server", "http://127.0.0.1:9", "status")
    assert result.returncode == 1 and "unreachable" in result.stderr
