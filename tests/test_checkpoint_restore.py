"""Checkpoint, kill -9 every process, restart with another worker count, restore, resume."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from tests.conftest import ASGI_TEST_APP, BOTH_APP_KINDS, TEST_APP
from tests.support import CONTROL_TOKEN, Control, wait_until

TOKEN = "X-NeMo-Gym-Session-Token"
OWNER = "x-ng-session-owner"


async def make_sessions(http, url, count):
    sessions = []
    for i in range(count):
        async with http.post(f"{url}/seed_session", json={"initial_count": i * 10}) as resp:
            token = resp.headers[TOKEN]
        for _ in range(i % 4):
            async with http.post(
                f"{url}/increment_counter", json={"count": 1}, headers={TOKEN: token}
            ) as resp:
                assert resp.status == 200
        sessions.append((token, i * 10 + i % 4))
    return sessions


async def check_sessions(http, url, sessions, cookie):
    for n, (token, expected) in enumerate(sessions):
        # alternate carriers: the MCP header and the cookie must both still work
        headers = {TOKEN: token} if n % 2 else {"Cookie": f"{cookie}={token}"}
        async with http.post(f"{url}/get_counter_value", headers=headers) as resp:
            assert resp.status == 200, (n, resp.status, await resp.text())
            assert (await resp.json())["count"] == expected, n
            # the old token stays valid for life: no new token; a cookie client gets the
            # same cookie again (NeMo Gym's clients send on the last response's cookies)
            assert TOKEN not in resp.headers
            if n % 2:
                assert "Set-Cookie" not in resp.headers
            else:
                assert resp.headers["Set-Cookie"].startswith(f"{cookie}={token};")
        async with http.post(
            f"{url}/increment_counter", json={"count": 100}, headers={TOKEN: token}
        ) as resp:
            assert (await resp.json())["count"] == expected + 100
            assert TOKEN not in resp.headers


# Both app kinds where the worker's door does most (a resize installs sessions on workers
# that never held them); the aiohttp app alone for the other shapes.
@pytest.mark.parametrize(
    ("before", "after", "test_app"),
    [
        (1, 1, TEST_APP),
        (1, 2, TEST_APP),
        (2, 2, TEST_APP),
        (2, 1, TEST_APP),
        (2, 4, TEST_APP),
        (2, 4, ASGI_TEST_APP),
    ],
    ids=["1-1", "1-2", "2-2", "2-1", "2-4", "asgi-2-4"],
    indirect=["test_app"],
)
async def test_sessions_survive_crash_and_resize(start_proxy, http, tmp_path, before, after):
    first = start_proxy(workers=before, control_token=CONTROL_TOKEN)
    sessions = await make_sessions(http, first.url, 24)
    control = Control(http, first.url)
    reply = await control.checkpoint("ckpt-1", str(tmp_path))
    assert reply["manifest"]["record_count"] == 24
    first.kill_all()

    second = start_proxy(workers=after, control_token=CONTROL_TOKEN)
    control = Control(http, second.url)
    restored = await control.ok(
        "restore", checkpoint_id="restore-1", checkpoint_dir=str(tmp_path), episode_ids=[]
    )
    assert restored == {"phase": "restored", "source_checkpoint_id": "ckpt-1", "restored": []}
    status = await control.ok("status")
    assert status["phase"] == "restored" and len(status["session_aliases"]) == before
    assert (await control.ok("resume", checkpoint_id="restore-1"))["phase"] == "idle"
    await check_sessions(http, second.url, sessions, second.cookie)
    fresh = await make_sessions(http, second.url, 8)
    await check_sessions(http, second.url, fresh, second.cookie)


@BOTH_APP_KINDS
async def test_parked_episode_continues_after_restore(start_proxy, http, tmp_path):
    first = start_proxy(workers=2, control_token=CONTROL_TOKEN)
    async with http.post(f"{first.url}/whoami") as resp:
        owner = (await resp.json())["owner"]
    run = {"_ng_rollout_id": "r1", "steps": 3, "gate": "g"}
    task = asyncio.ensure_future(http.post(f"{first.url}/run", json=run, headers={OWNER: owner}))
    control = Control(http, first.url)

    async def release(name):
        async with http.post(f"{first.url}/release?name={name}", headers={OWNER: owner}) as r:
            assert r.status == 200

    async def progress():
        async with http.get(f"{first.url}/progress", headers={OWNER: owner}) as r:
            return (await r.json())["progress"].get("r1") == 1

    await release("g-0")  # step 0 runs, the episode reaches boundary {step: 1}
    await wait_until(progress, 10, "the episode to reach its first boundary")
    reply = await control.checkpoint(
        "ep-1", str(tmp_path), episode_ids=[{"rollout_id": "r1", "attempt": 0}]
    )
    assert reply["episode_ids"] == ["r1"]  # capture keys, as NeMo-RL reads them
    first.kill_all()
    with pytest.raises(aiohttp.ClientError):
        await task

    second = start_proxy(workers=1, control_token=CONTROL_TOKEN)
    control = Control(http, second.url)
    restored = await control.ok(
        "restore",
        checkpoint_id="ep-r",
        checkpoint_dir=str(tmp_path),
        episode_ids=[{"rollout_id": "r1", "attempt": 0}],
    )
    assert restored["restored"] == ["r1-a1"]
    await control.ok("resume", checkpoint_id="ep-r")
    stale = {"_ng_rollout_id": "r1", "_ng_attempt_index": 0, "steps": 3}
    async with http.post(f"{second.url}/run", json=stale) as resp:
        assert resp.status == 409
        assert (await resp.json())["error"]["code"] == "stale_attempt"
    other_task = {"_ng_rollout_id": "r1", "_ng_attempt_index": 1, "steps": 4, "gate": "g"}
    async with http.post(f"{second.url}/run", json=other_task) as resp:
        assert resp.status == 400  # NeMo Gym's rule: a replacement continues the same task
        assert "different task" in (await resp.json())["error"]["detail"]
    for name in ("g-1", "g-2"):  # let the replacement's remaining steps run at once
        async with http.post(f"{second.url}/release?name={name}") as r:
            assert r.status == 200
    replacement = {"_ng_rollout_id": "r1", "_ng_attempt_index": 1, "steps": 3, "gate": "g"}
    async with http.post(f"{second.url}/run", json=replacement) as resp:
        body = await resp.json()
    assert body["restored"] is True
    assert body["state"]["log"] == ["r1:0", "r1-a1:1", "r1-a1:2"]
    status = await control.ok("status")
    assert status["restored_pending"] == []
