"""Moving live sessions between running workers (`POST /ng-control/v1/gym-proxy/sessions/move`),
gym-proxy in process (`tests/in_process.py`) unless a test needs processes (a crash, a
SIGSTOPped worker): under load from a pooled client whose session calls arrive on any
connection, every counter stays exact, tokens do not change, and a session whose request
outlives the move's timeout stays where it was, serving."""

from __future__ import annotations

import asyncio
import hashlib
import os
import random
import signal
import sys
import time

import aiohttp
import orjson
import pytest

from tests.apps import pattern_block
from tests.conftest import BOTH_APP_KINDS
from tests.support import CONTROL_TOKEN as CONTROL
from tests.support import Control, wait_until

MOVE = "/ng-control/v1/gym-proxy/sessions/move"
TOKEN_HEADER = "X-NeMo-Gym-Session-Token"

CTL_MAIN = "from gym_proxy.coordinator.clients.controller_cli import main; main()"


@pytest.fixture
async def proxy(in_process, test_app):
    return await in_process(workers=2, control_token=CONTROL, app=test_app)


async def seed(http: aiohttp.ClientSession, url: str) -> tuple[str, str, int]:
    """A new session: (its token, its session ID, the slot that holds it)."""
    async with http.post(f"{url}/seed_session", json={"initial_count": 0}) as response:
        assert response.status == 200
        token = response.headers[TOKEN_HEADER]
    where = await whoami(http, url, token)
    return token, where["session_id"], where["slot"]


async def whoami(http: aiohttp.ClientSession, url: str, token: str) -> dict:
    async with http.get(f"{url}/whoami", headers={TOKEN_HEADER: token}) as response:
        assert response.status == 200
        return await response.json()


async def count(http: aiohttp.ClientSession, url: str, token: str) -> int:
    async with http.post(
        f"{url}/get_counter_value", json={}, headers={TOKEN_HEADER: token}
    ) as response:
        assert response.status == 200
        return (await response.json())["count"]


async def move(http, url, body, token=CONTROL) -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with http.post(f"{url}{MOVE}", json=body, headers=headers) as response:
        return response.status, await response.json()


@BOTH_APP_KINDS
async def test_a_move_under_load_keeps_every_counter_exact(proxy):
    """All sessions of worker 0 move to worker 1 while four clients increment random
    sessions (any session on any pooled connection): nothing fails, every counter is
    exact, the tokens stay, and the moved sessions answer from worker 1."""
    url = proxy.url
    rng = random.Random(17)
    async with aiohttp.ClientSession() as http:
        sessions = [await seed(http, url) for _ in range(40)]
        on_zero = sorted(sid for _, sid, slot in sessions if slot == 0)
        assert on_zero and len(on_zero) < len(sessions)  # both workers hold some
        sent = [0] * len(sessions)
        started = asyncio.Event()

        async def client(picks: list[int]) -> None:
            for i in picks:
                body = {"count": 1}
                headers = {TOKEN_HEADER: sessions[i][0]}
                async with http.post(
                    f"{url}/increment_counter", json=body, headers=headers
                ) as response:
                    assert response.status == 200, await response.text()
                sent[i] += 1
                if sum(sent) >= 40:
                    started.set()

        picks = [[rng.randrange(len(sessions)) for _ in range(150)] for _ in range(4)]
        load = asyncio.gather(*(client(p) for p in picks))
        await asyncio.wait_for(started.wait(), 30)
        status, reply = await move(http, url, {"session_ids": on_zero, "to_slot": 1})
        await asyncio.wait_for(load, 60)
        assert status == 200, reply
        assert reply["moved"] == on_zero and reply["failed"] == [], reply
        for i, (token, sid, _) in enumerate(sessions):
            assert await count(http, url, token) == sent[i], sid
            assert (await whoami(http, url, token))["slot"] == 1
        assert sum(sent) == 600


async def test_a_running_request_past_the_timeout_keeps_its_session_in_place(proxy):
    """A session with a request still running at the move's timeout is reported and not
    moved; its request finishes where it ran, and the other session moves."""
    url = proxy.url
    async with aiohttp.ClientSession() as http:
        by_slot: dict[int, list[tuple[str, str]]] = {0: [], 1: []}
        while len(by_slot[0]) < 2:
            token, sid, slot = await seed(http, url)
            by_slot[slot].append((token, sid))
        (busy_token, busy), (_, idle) = by_slot[0][:2]
        slow = asyncio.ensure_future(
            http.get(f"{url}/slow?seconds=3", headers={TOKEN_HEADER: busy_token})
        )
        for _ in range(500):  # bounded: the slow request reaches worker 0
            workers = (await status_of(http, url))["workers"]
            if [w["in_flight"] for w in workers if w["slot"] == 0] == [1]:
                break
        else:
            raise AssertionError("the slow request never reached worker 0")
        body = {"session_ids": [busy, idle], "to_slot": 1, "timeout_s": 0.5}
        status, reply = await move(http, url, body)
        assert status == 200, reply
        assert reply["moved"] == [idle]
        reason = "a request of the session was still running at the timeout"
        assert reply["failed"] == [{"session_id": busy, "reason": reason}]
        async with await slow as response:
            assert response.status == 200 and (await response.json())["slot"] == 0
        assert (await whoami(http, url, busy_token))["slot"] == 0


async def status_of(http, url):
    async with http.get(
        f"{url}/ng-control/v1/checkpoint/status",
        headers={"Authorization": f"Bearer {CONTROL}"},
    ) as response:
        return await response.json()


async def test_bad_moves_are_refused_with_what_is_wrong(proxy):
    """Bad input gets a clear error; a session already on the target is reported; a move
    while a checkpoint is open is a conflict (and moves nothing)."""
    url = proxy.url
    async with aiohttp.ClientSession() as http:
        token, sid, slot = await seed(http, url)
        assert (await move(http, url, {"session_ids": [sid], "to_slot": 1}, token=None))[0] == 401
        cases = [
            ({"session_ids": [sid], "to_slot": 7}, "no live worker in slot 7"),
            ({"session_ids": [], "to_slot": 1}, "session_ids must be a non-empty list"),
            ({"session_ids": ["a b"], "to_slot": 1}, "session_ids must be a non-empty list"),
            ({"session_ids": [sid], "to_slot": "1"}, "to_slot must be a worker slot"),
            ({"session_ids": [sid], "to_slot": 1, "timeout_s": 0}, "timeout_s must be"),
            ({"session_ids": [sid], "to_slot": 1, "extra": 1}, "unknown fields: extra"),
        ]
        for body, detail in cases:
            status, reply = await move(http, url, body)
            assert status == 400 and reply["error"]["code"] == "invalid_request", reply
            assert detail in reply["error"]["detail"], reply
        status, reply = await move(http, url, {"session_ids": [sid], "to_slot": slot})
        assert status == 200 and reply["moved"] == [], reply
        assert reply["failed"][0]["reason"].startswith("not found on a source worker")
        headers = {"Authorization": f"Bearer {CONTROL}"}
        prepare = {"checkpoint_id": "ck-move", "deadline_ts": time.time() + 60}
        async with http.post(
            f"{url}/ng-control/v1/checkpoint/prepare", json=prepare, headers=headers
        ) as response:
            assert response.status == 200
        status, reply = await move(http, url, {"session_ids": [sid], "to_slot": 1 - slot})
        assert status == 409 and reply["error"]["code"] == "operation_conflict", reply
        async with http.post(
            f"{url}/ng-control/v1/checkpoint/resume", json=prepare, headers=headers
        ) as response:
            assert response.status == 200
        assert (await whoami(http, url, token))["slot"] == slot
        assert await count(http, url, token) == 0


@BOTH_APP_KINDS
async def test_a_move_waits_for_the_boundary_and_holds_new_requests(proxy):
    """A move waits for the session's running request; a request sent meanwhile waits at
    the proxy and is answered by the target, with the state the source left."""
    url = proxy.url
    async with aiohttp.ClientSession() as http:
        token, sid, slot = await seed(http, url)
        headers = {TOKEN_HEADER: token}
        async with http.post(
            f"{url}/increment_counter", json={"count": 5}, headers=headers
        ) as response:
            assert response.status == 200
        slow = asyncio.ensure_future(http.get(f"{url}/slow?seconds=2", headers=headers))
        for _ in range(500):  # bounded: the slow request reaches its worker
            workers = (await status_of(http, url))["workers"]
            if [w["in_flight"] for w in workers if w["slot"] == slot] == [1]:
                break
        else:
            raise AssertionError("the slow request never reached its worker")
        moving = asyncio.ensure_future(
            move(http, url, {"session_ids": [sid], "to_slot": 1 - slot, "timeout_s": 20})
        )
        for _ in range(500):  # bounded: the move is holding the session
            if (await status_of(http, url))["moving_sessions"]:
                break
        else:
            raise AssertionError("the move never started")
        held = asyncio.ensure_future(whoami(http, url, token))
        async with await slow as response:
            assert (await response.json())["slot"] == slot  # finished where it ran
        status, reply = await asyncio.wait_for(moving, 20)
        assert status == 200 and reply["moved"] == [sid], reply
        assert (await asyncio.wait_for(held, 20))["slot"] == 1 - slot
        assert await count(http, url, token) == 5


@BOTH_APP_KINDS
async def test_moved_sessions_survive_a_checkpoint_crash_and_restore(start_proxy, tmp_path):
    """A moved session's token names the worker it left; the checkpoint files it where it
    went, so after kill -9 and a restore onto 3 workers the old token still finds it."""
    first = start_proxy(workers=2, control_token=CONTROL)
    async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as http:
        sessions = [await seed(http, first.url) for _ in range(12)]
        expected = {}
        for n, (token, _, _) in enumerate(sessions):
            async with http.post(
                f"{first.url}/increment_counter", json={"count": n}, headers={TOKEN_HEADER: token}
            ) as response:
                assert response.status == 200
            expected[token] = n
        on_zero = sorted(sid for _, sid, slot in sessions if slot == 0)
        status, reply = await move(http, first.url, {"session_ids": on_zero, "to_slot": 1})
        assert status == 200 and reply["moved"] == on_zero, reply
        await Control(http, first.url).checkpoint("ck-moved", str(tmp_path))
        first.kill_all()

        second = start_proxy(workers=3, control_token=CONTROL)
        control = Control(http, second.url)
        await control.ok(
            "restore", checkpoint_id="rs", checkpoint_dir=str(tmp_path), episode_ids=[]
        )
        await control.ok("resume", checkpoint_id="rs")
        for token, value in expected.items():
            assert await count(http, second.url, token) == value


async def test_gym_proxy_ctl_moves_a_session(proxy):
    """`gym-proxy-ctl move` prints what moved; the session answers from its new worker."""
    async with aiohttp.ClientSession() as http:
        token, sid, slot = await seed(http, proxy.url)
        command = [
            sys.executable, "-c", CTL_MAIN,
            "--server", proxy.url, "--token", CONTROL,
            "move", "--session", sid, "--to-slot", str(1 - slot),
        ]  # fmt: skip
        done = await asyncio.create_subprocess_exec(*command, stdout=asyncio.subprocess.PIPE)
        out, _ = await asyncio.wait_for(done.communicate(), 60)
        assert done.returncode == 0
        reply = orjson.loads(out)
        assert reply["moved"] == [sid] and reply["to_slot"] == 1 - slot, reply
        assert (await whoami(http, proxy.url, token))["slot"] == 1 - slot


async def test_a_target_that_does_not_answer_leaves_the_sessions_serving_where_they_were(
    start_proxy,
):
    proxy = start_proxy(workers=2, control_token=CONTROL)  # a process: it is SIGSTOPped
    """The target stops answering (SIGSTOP) during the move: the move reports every
    session as not taken, and each still answers, with its count, from its old worker."""
    url = proxy.url
    async with aiohttp.ClientSession() as http:
        sessions = [await seed(http, url) for _ in range(6)]
        source = sessions[0][2]
        mine = [(t, s) for t, s, slot in sessions if slot == source]
        for n, (token, _) in enumerate(mine):
            async with http.post(
                f"{url}/increment_counter", json={"count": n + 1}, headers={TOKEN_HEADER: token}
            ) as response:
                assert response.status == 200
        workers = (await status_of(http, url))["workers"]
        target_pid = next(w["pid"] for w in workers if w["slot"] == 1 - source)
        os.kill(target_pid, signal.SIGSTOP)
        try:
            body = {"session_ids": [s for _, s in mine], "to_slot": 1 - source, "timeout_s": 1}
            status, reply = await move(http, url, body)
        finally:
            os.kill(target_pid, signal.SIGCONT)
        assert status == 200 and reply["moved"] == [], reply
        assert {f["session_id"] for f in reply["failed"]} == {s for _, s in mine}
        assert all("did not take it" in f["reason"] for f in reply["failed"]), reply
        for n, (token, _) in enumerate(mine):
            assert (await whoami(http, url, token))["slot"] == source
            assert await count(http, url, token) == n + 1


def resident_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


async def test_a_held_upload_waits_at_the_client_not_in_the_proxys_memory(start_proxy):
    """A 64 MiB upload on a session whose move waits for its running request: the proxy
    keeps reading paused while it is held (the client gets no further than the socket
    buffers), its RSS does not grow with the body, and once the move ends the upload
    reaches the target whole."""
    proxy = start_proxy(workers=2, control_token=CONTROL)  # a process: its memory is measured
    url = proxy.url
    size = 64 << 20
    block = pattern_block(7)
    async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as http:
        token, sid, slot = await seed(http, url)
        owner = (await whoami(http, url, token))["owner"]
        headers = {TOKEN_HEADER: token}
        # A request of the session that runs until the test releases it (its event 1).
        stream = await http.get(f"{url}/sse?name=hold&n=2", headers=headers)
        assert (await stream.content.readline()).startswith(b"data: event-0")
        moving = asyncio.ensure_future(
            move(http, url, {"session_ids": [sid], "to_slot": 1 - slot, "timeout_s": 60})
        )
        for _ in range(500):  # bounded: the move is holding the session
            if (await status_of(http, url))["moving_sessions"]:
                break
        else:
            raise AssertionError("the move never started")
        before = resident_mib(proxy.pid)
        sent = 0

        async def body():
            nonlocal sent
            while sent < size:
                yield block
                sent += len(block)

        upload = asyncio.ensure_future(http.post(f"{url}/upload", data=body(), headers=headers))
        await wait_until(lambda: sent >= 1 << 20, 10, "the upload to begin")
        # What must not happen, looked for over 3 s: the proxy reading the body on.
        deadline = time.monotonic() + 3
        grown = 0.0
        while time.monotonic() < deadline:
            grown = max(grown, resident_mib(proxy.pid) - before)
            assert sent < size // 2 and grown < 16, (sent, grown)
            await asyncio.sleep(0.1)
        release = {"x-ng-session-owner": owner}  # a new session on that worker: not held
        async with http.get(f"{url}/release?name=hold-0", headers=release) as response:
            assert response.status == 200
        await stream.read()
        stream.release()
        status, reply = await asyncio.wait_for(moving, 30)
        assert status == 200 and reply["moved"] == [sid], reply
        async with await asyncio.wait_for(upload, 60) as response:
            assert response.status == 200
            answer = await response.json()
    whole = hashlib.sha256()
    for _ in range(size // len(block)):
        whole.update(block)
    assert answer == {"sha256": whole.hexdigest(), "size": size}
