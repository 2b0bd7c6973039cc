"""Worker deaths, boot failures and a dead proxy, with real processes and kill -9."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import aiohttp

from tests.support import ProxyProcess, pid_alive, wait_until, wait_until_sync

TOKEN = "X-NeMo-Gym-Session-Token"
OWNER = "x-ng-session-owner"
BOUND = 10.0  # no request may take longer than this, whatever dies


async def seed(http, url, count):
    sessions = []
    for i in range(count):
        async with http.post(f"{url}/seed_session", json={"initial_count": i}) as resp:
            token = resp.headers[TOKEN]
        sessions.append({"token": token, "owner": token.split(".")[-2], "count": i})
    return sessions


async def pid_of(http, url, owner):
    async with http.get(f"{url}/whoami", headers={OWNER: owner}) as resp:
        return (await resp.json())["pid"]


async def test_kill_9_worker_under_load(start_proxy, http):
    proxy = start_proxy("--access-log", workers=2)
    sessions = await seed(http, proxy.url, 40)
    owners = sorted({s["owner"] for s in sessions})
    assert len(owners) == 2
    victim, survivor = owners
    victim_pid = await pid_of(http, proxy.url, victim)
    statuses: dict[str, list[int]] = {victim: [], survivor: []}
    stop_at = time.monotonic() + 60

    async def drive(session, rounds):
        for _ in range(rounds):
            if time.monotonic() > stop_at:
                return
            started = time.monotonic()
            async with http.post(
                f"{proxy.url}/increment_counter",
                json={"count": 1},
                headers={TOKEN: session["token"]},
                timeout=aiohttp.ClientTimeout(total=BOUND),
            ) as resp:
                await resp.read()
                statuses[session["owner"]].append(resp.status)
                if resp.status == 200:
                    session["count"] += 1
            assert time.monotonic() - started < BOUND

    load = asyncio.gather(*(drive(s, 30) for s in sessions))
    await wait_until(lambda: len(statuses[victim]) > 20, 20, "load to start")
    os.kill(victim_pid, signal.SIGKILL)
    await load

    assert set(statuses[survivor]) == {200}
    # requests in flight at the kill may see 502 or 410; after that the session is gone
    assert set(statuses[victim]) <= {200, 410, 502}
    assert statuses[victim][-1] == 410
    for session in sessions:
        async with http.post(
            f"{proxy.url}/get_counter_value", headers={TOKEN: session["token"]}
        ) as resp:
            if session["owner"] == victim:
                assert resp.status == 410
                assert (await resp.json())["error"]["code"] == "session_owner_gone"
            else:
                assert (await resp.json())["count"] == session["count"]

    async def new_owner():
        async with http.post(f"{proxy.url}/whoami", headers={OWNER: survivor}) as _:
            pass
        owners_now = set()
        for _ in range(6):
            async with http.post(f"{proxy.url}/whoami") as resp:
                if resp.status == 200:
                    owners_now.add((await resp.json())["owner"])
        return len(owners_now - {survivor}) == 1 and victim not in owners_now

    await wait_until(new_owner, 20, "the slot to come back with a new owner")
    assert not pid_alive(victim_pid)


async def test_no_live_worker_is_503_with_retry_after(start_proxy, http, tmp_path):
    hold = tmp_path / "hold"
    proxy = start_proxy(workers=1, env={"GYM_TEST_HOLD_FILE": str(hold)})
    async with http.post(f"{proxy.url}/whoami") as resp:
        pid = (await resp.json())["pid"]
    hold.write_text("keep the restarted worker from booting")
    os.kill(pid, signal.SIGKILL)

    async def unavailable():
        async with http.post(f"{proxy.url}/whoami") as resp:
            if resp.status == 503:
                assert resp.headers["Retry-After"] == "1"
                assert (await resp.json())["error"]["code"] == "worker_unavailable"
                return True
            return False

    await wait_until(unavailable, 10, "503 while no worker is live")
    hold.unlink()

    async def serving():
        async with http.post(f"{proxy.url}/whoami") as resp:
            return resp.status == 200

    await wait_until(serving, 20, "the restarted worker to serve")


def test_boot_failure_stops_the_proxy(tmp_path):
    proxy = ProxyProcess(workers=2, app="tests.apps:broken_factory")
    try:
        code = proxy.wait_exit(30)
        log = proxy.log()
        assert code != 0
        assert "cannot build app tests.apps:broken_factory" in log
        assert log.count("worker 0 started") == 1  # no respawn loop
        assert proxy.runtime_dirs() == []
    finally:
        proxy.close()


def test_workers_exit_when_the_proxy_dies(start_proxy):
    proxy = start_proxy("--orphan-grace", "0", workers=2)
    workers = proxy.worker_pids()
    assert len(workers) == 2
    os.kill(proxy.pid, signal.SIGKILL)
    proxy.popen.wait(10)
    wait_until_sync(
        lambda: not any(pid_alive(p) for p in workers), 15, "orphaned workers to exit by themselves"
    )


async def test_dead_worker_mid_request_answers_promptly(start_proxy, http):
    proxy = start_proxy(workers=2)
    async with http.post(f"{proxy.url}/whoami") as resp:
        body = await resp.json()
    token = resp.headers[TOKEN]
    slow = asyncio.create_task(http.post(f"{proxy.url}/slow?seconds=30", headers={TOKEN: token}))

    async def in_flight():
        async with http.get(f"{proxy.url}/seen", headers={OWNER: body["owner"]}) as seen:
            return "/slow" in (await seen.json())["paths"]

    await wait_until(in_flight, 10, "the slow request to reach its worker")
    started = time.monotonic()
    os.kill(body["pid"], signal.SIGKILL)
    resp = await asyncio.wait_for(slow, BOUND)
    assert resp.status in (410, 502)
    code = (await resp.json())["error"]["code"]
    assert code in ("session_owner_gone", "upstream_connection_lost")
    assert time.monotonic() - started < BOUND


async def test_owners_that_look_like_flags_boot_and_route(start_proxy, http):
    """Owner IDs are random base64url, so one in 64 starts with `-`: every worker option
    must reach the worker as one argument that cannot be read as a flag."""
    owners = ["-P1SBqWaCxk", "--help", "-h"]
    proxy = start_proxy(workers=2, env={"GYM_PROXY_TEST_OWNERS": ",".join(owners)})
    for owner in owners[:2]:
        async with http.post(f"{proxy.url}/seed_session", headers={OWNER: owner}) as resp:
            assert resp.status == 200, await resp.text()
            token = resp.headers[TOKEN]
        assert token.split(".")[-2] == owner
        async with http.post(f"{proxy.url}/whoami", headers={TOKEN: token}) as resp:
            assert (await resp.json())["owner"] == owner
    async with http.post(f"{proxy.url}/whoami", headers={OWNER: owners[1]}) as resp:
        pid = (await resp.json())["pid"]
    os.kill(pid, signal.SIGKILL)  # the restart takes the third owner

    async def third_serves():
        async with http.post(f"{proxy.url}/whoami", headers={OWNER: owners[2]}) as resp:
            return resp.status == 200 and (await resp.json())["owner"] == owners[2]

    await wait_until(third_serves, 20, "the restarted worker (owner -h) to serve")
    assert "expected one argument" not in proxy.log()
    assert proxy.log().count("exited with code") == 1  # the kill, no failed boot


async def test_requests_during_boot_are_answered_at_once(start_proxy, http, tmp_path):
    """While no worker has registered yet, the public port answers 503 worker_unavailable
    with Retry-After at once (a health check never waits); then it serves."""
    hold = tmp_path / "hold"
    hold.write_text("keep every worker from booting")
    proxy = start_proxy(workers=2, ready=False, env={"GYM_TEST_HOLD_FILE": str(hold)})

    async def answered_503():
        try:
            async with http.get(
                f"{proxy.url}/health", timeout=aiohttp.ClientTimeout(total=2)
            ) as resp:
                assert resp.status == 503, await resp.text()
                assert resp.headers["Retry-After"] == "1"
                assert (await resp.json())["error"]["code"] == "worker_unavailable"
                return True
        except aiohttp.ClientConnectionError:
            return False  # the proxy has not bound its handlers yet

    await wait_until(answered_503, 10, "a 503 while the workers boot")
    assert "ready on" not in proxy.log()
    hold.unlink()
    await asyncio.to_thread(proxy.wait_ready)
    async with http.post(f"{proxy.url}/whoami") as resp:
        assert resp.status == 200
