"""kill -9 at each step of a move (named crash points, `GYM_PROXY_FAILPOINTS`), with real
processes: the source, the target or the proxy dies. Afterwards no session is served by
two workers, a session is on the survivor (with its exact count) or answers 410, and the
checkpoint committed before the move restores every committed value."""

from __future__ import annotations

import aiohttp
import pytest

from tests.support import CONTROL_TOKEN as CONTROL
from tests.support import Control, wait_until
from tests.test_session_moves import TOKEN_HEADER, count, move, seed, whoami


async def prepare(http: aiohttp.ClientSession, url: str, tmp_path) -> tuple[dict, dict]:
    """Sessions on both workers, each with a count, committed; then one more increment
    each, not committed. Answers {token: (session ID, slot)} and {token: count now}."""
    sessions: dict[str, tuple[str, int]] = {}
    while len({slot for _, slot in sessions.values()}) < 2 or len(sessions) < 8:
        token, sid, slot = await seed(http, url)
        sessions[token] = (sid, slot)
    counts = {}
    for n, token in enumerate(sessions):
        await increment(http, url, token, n + 1)
        counts[token] = n + 1
    control = Control(http, url)
    await control.checkpoint("ck-before", str(tmp_path))
    await control.ok("resume", checkpoint_id="ck-before")
    for token in sessions:
        await increment(http, url, token, 100)
    return sessions, counts


async def increment(http: aiohttp.ClientSession, url: str, token: str, by: int) -> None:
    async with http.post(
        f"{url}/increment_counter", json={"count": by}, headers={TOKEN_HEADER: token}
    ) as response:
        assert response.status == 200, await response.text()


async def answer_of(http: aiohttp.ClientSession, url: str, token: str) -> tuple[int, dict]:
    async with http.get(f"{url}/whoami", headers={TOKEN_HEADER: token}) as response:
        return response.status, await response.json()


def on_slot(sessions: dict, slot: int) -> list[str]:
    return sorted(sid for sid, at in sessions.values() if at == slot)


async def test_the_source_dies_while_it_answers_move_out(start_proxy, tmp_path):
    """The source is gone with its sessions: the move reports each not moved, they answer
    410 (never served by the target), the target's own sessions keep their counts."""
    proxy = start_proxy(workers=2, control_token=CONTROL, env=failpoint("worker-move-out"))
    async with aiohttp.ClientSession() as http:
        sessions, counts = await prepare(http, proxy.url, tmp_path)
        status, reply = await move(
            http, proxy.url, {"session_ids": on_slot(sessions, 0), "to_slot": 1}
        )
        assert status == 200 and reply["moved"] == [], reply
        assert all("did not answer" in f["reason"] for f in reply["failed"]), reply
        await wait_until(lambda: len(proxy.worker_pids()) == 2, 30, "slot 0 restarted")
        for token, (_, slot) in sessions.items():
            status, body = await answer_of(http, proxy.url, token)
            if slot == 0:
                assert status == 410 and body["error"]["code"] == "session_owner_gone", body
            else:
                assert status == 200 and body["slot"] == 1, body
                assert await count(http, proxy.url, token) == counts[token] + 100


async def test_the_target_dies_after_installing(start_proxy, tmp_path):
    """The target installed the sessions and died before answering: the move reports them
    not taken, and they serve on from the source with their exact counts."""
    proxy = start_proxy(workers=2, control_token=CONTROL, env=failpoint("worker-installed"))
    async with aiohttp.ClientSession() as http:
        sessions, counts = await prepare(http, proxy.url, tmp_path)
        status, reply = await move(
            http, proxy.url, {"session_ids": on_slot(sessions, 0), "to_slot": 1}
        )
        assert status == 200 and reply["moved"] == [], reply
        assert all("did not take it" in f["reason"] for f in reply["failed"]), reply
        for token, (_, slot) in sessions.items():
            status, body = await answer_of(http, proxy.url, token)
            if slot == 0:
                assert status == 200 and body["slot"] == 0, body
                assert await count(http, proxy.url, token) == counts[token] + 100
            else:
                assert status == 410, body


@pytest.mark.parametrize("point", ["move-before-install", "move-installed"])
async def test_the_proxy_dies_mid_move_and_the_checkpoint_restores(start_proxy, tmp_path, point):
    """The proxy dies (and its workers with it) between the source's export and the
    target's install, or after the install before the table changed: the checkpoint
    committed before restores every committed value onto fresh workers."""
    first = start_proxy(workers=2, control_token=CONTROL, env=failpoint(point))
    async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as http:
        sessions, counts = await prepare(http, first.url, tmp_path)
        ids = on_slot(sessions, 0)
        with pytest.raises(aiohttp.ClientError):
            await move(http, first.url, {"session_ids": ids, "to_slot": 1})
        assert first.wait_exit(30) == 97
        await wait_until(lambda: not first.worker_pids(), 30, "the workers to stop with it")
        second = start_proxy(workers=2, control_token=CONTROL)
        control = Control(http, second.url)
        await control.ok(
            "restore", checkpoint_id="rs", checkpoint_dir=str(tmp_path), episode_ids=[]
        )
        await control.ok("resume", checkpoint_id="rs")
        for token in sessions:
            assert await count(http, second.url, token) == counts[token]
        where = [(await whoami(http, second.url, t))["slot"] for t in sessions]
        assert set(where) <= {0, 1}


def failpoint(name: str) -> dict[str, str]:
    return {"GYM_PROXY_FAILPOINTS": name}
