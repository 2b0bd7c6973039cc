"""A stopped worker (SIGSTOP: alive, silent) hangs nothing but its own requests.

Control calls answer by their deadlines, a resume reopens the other workers at once,
their sessions never wait on it, timers keep running, and the supervisor's pings find it
silent: no new sessions go to it, and after `--worker-timeout` it is killed and restarted.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time

import aiohttp
import orjson
import pytest

from tests.support import CONTROL_TOKEN, Control, pid_alive, wait_until

TOKEN = "X-NeMo-Gym-Session-Token"
OWNER = "x-ng-session-owner"
SLACK = 2.5  # scheduling slack on a shared 2-core machine


async def sessions_by_owner(http, url, count=8):
    owners: dict[str, list[str]] = {}
    for i in range(count):
        async with http.post(f"{url}/seed_session", json={"initial_count": i}) as resp:
            token = resp.headers[TOKEN]
        owners.setdefault(token.split(".")[-2], []).append(token)
    assert len(owners) == 2
    return owners


async def pid_of(http, url, owner):
    async with http.get(f"{url}/whoami", headers={OWNER: owner}) as resp:
        return (await resp.json())["pid"]


@contextlib.asynccontextmanager
async def stopped(pid):
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


@pytest.fixture
def participant(start_proxy):
    # a long worker timeout: these tests keep the worker stopped on purpose
    return start_proxy("--worker-timeout", "60", workers=2, control_token=CONTROL_TOKEN)


async def test_prepare_and_resume_with_a_stopped_worker(participant, http):
    control = Control(http, participant.url)
    owners = await sessions_by_owner(http, participant.url)
    victim, healthy = sorted(owners)
    async with stopped(await pid_of(http, participant.url, victim)):
        started = time.monotonic()
        reply = await control.ok("prepare", checkpoint_id="stop1", deadline_ts=time.time() + 3)
        assert time.monotonic() - started < 3 + SLACK
        assert reply["phase"] == "preparing"
        assert "resources-workers-unreported:1" in reply["report"]["blockers"]
        # a call on the healthy worker waits at the door ...
        door = asyncio.ensure_future(
            http.post(
                f"{participant.url}/increment_counter",
                json={"count": 1},
                headers={TOKEN: owners[healthy][0]},
            )
        )

        async def at_door():
            return (await control.ok("status"))["report"]["counts"].get("door") == 1

        await wait_until(at_door, 10, "the healthy worker's call to wait at the door")
        # ... and goes on as soon as the resume reopens its worker
        started = time.monotonic()
        resumed = asyncio.ensure_future(control.ok("resume", checkpoint_id="stop1"))
        async with await asyncio.wait_for(door, 2) as resp:
            assert resp.status == 200
        assert (await resumed)["phase"] == "idle"
        assert time.monotonic() - started < SLACK
    # awake again, the worker takes part in the next checkpoint
    reply = await control.ok("prepare", checkpoint_id="stop2")
    assert reply["phase"] == "prepared"
    await control.ok("resume", checkpoint_id="stop2")


async def test_commit_fails_at_its_deadline_and_resume_wins(participant, http, tmp_path):
    control = Control(http, participant.url)
    owners = await sessions_by_owner(http, participant.url)
    victim, _ = sorted(owners)
    victim_pid = await pid_of(http, participant.url, victim)
    assert (await control.ok("prepare", checkpoint_id="c1"))["phase"] == "prepared"
    async with stopped(victim_pid):
        started = time.monotonic()
        status, body = await control.call(
            "commit",
            checkpoint_id="c1",
            checkpoint_dir=str(tmp_path),
            deadline_ts=time.time() + 2,
        )
        assert (status, body["error"]["code"]) == (409, "deadline_exceeded")
        assert time.monotonic() - started < 2 + SLACK
        # a commit with a far deadline is cut short by a resume
        long_commit = asyncio.ensure_future(
            control.call(
                "commit",
                checkpoint_id="c1",
                checkpoint_dir=str(tmp_path),
                deadline_ts=time.time() + 60,
            )
        )
        await asyncio.sleep(0.3)  # let it start waiting on the stopped worker
        started = time.monotonic()
        await control.ok("resume", checkpoint_id="c1")
        assert time.monotonic() - started < SLACK
        status, body = await asyncio.wait_for(long_commit, SLACK)
        assert (status, body["error"]["code"]) == (409, "stale_checkpoint")
        assert not list(tmp_path.rglob("manifest.json"))
        assert (await control.ok("status"))["phase"] == "idle"


async def test_timers_run_while_the_coordinator_waits(start_proxy, http, tmp_path):
    """The sweep (upstream timeouts, keep-alive expiry) never waits on a control call."""
    proxy = start_proxy(
        "--worker-timeout", "60", "--upstream-timeout", "2", workers=2, control_token=CONTROL_TOKEN
    )
    control = Control(http, proxy.url)
    owners = await sessions_by_owner(http, proxy.url)
    victim, _ = sorted(owners)
    victim_pid = await pid_of(http, proxy.url, victim)
    assert (await control.ok("prepare", checkpoint_id="t2"))["phase"] == "prepared"
    async with stopped(victim_pid):
        commit = asyncio.ensure_future(
            control.call(
                "commit",
                checkpoint_id="t2",
                checkpoint_dir=str(tmp_path),
                deadline_ts=time.time() + 30,
            )
        )
        # the stopped worker's own request: 504 from the sweep while commit holds the lock
        started = time.monotonic()
        async with http.get(
            f"{proxy.url}/get_counter_value", headers={TOKEN: owners[victim][0]}
        ) as resp:
            assert resp.status == 504, await resp.text()
        assert time.monotonic() - started < 2 + SLACK
        assert not commit.done()
        await control.ok("resume", checkpoint_id="t2")
        await commit


async def test_silent_worker_gets_no_new_sessions_then_is_replaced(start_proxy, http):
    # The worker timeout well past the upstream timeout's 2-3 s (a coarse 1 s clock): a
    # kill 3 s after the last ping answer could come first (then 410, not 504).
    proxy = start_proxy("--worker-timeout", "5", "--upstream-timeout", "2", workers=2)
    owners = await sessions_by_owner(http, proxy.url)
    victim, healthy = sorted(owners)
    victim_pid = await pid_of(http, proxy.url, victim)
    os.kill(victim_pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        async with http.get(
            f"{proxy.url}/get_counter_value", headers={TOKEN: owners[victim][0]}
        ) as resp:
            assert resp.status == 504
            assert (await resp.json())["error"]["code"] == "upstream_timeout"
        assert time.monotonic() - started < 2 + SLACK
        # The 504 may come before two ping intervals of silence (the upstream timeout is
        # judged on a coarse 1 s clock): new sessions avoid it from the supervisor's word.
        await wait_until(
            lambda: "is not answering; no new sessions go to it" in proxy.log(),
            10,
            "the supervisor to stop placing sessions on the silent worker",
        )

        async def new_sessions_avoid_it():
            placed = set()
            for _ in range(6):
                async with http.post(
                    f"{proxy.url}/whoami", timeout=aiohttp.ClientTimeout(total=5)
                ) as resp:
                    placed.add((await resp.json())["owner"])
            return placed == {healthy}

        await wait_until(new_sessions_avoid_it, 10, "new sessions to skip the silent worker")
        # the healthy worker's sessions were never held up
        async with http.post(
            f"{proxy.url}/increment_counter", json={"count": 1}, headers={TOKEN: owners[healthy][0]}
        ) as resp:
            assert resp.status == 200
        await wait_until(lambda: not pid_alive(victim_pid), 10, "the silent worker to be killed")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim_pid, signal.SIGCONT)
    async with http.get(
        f"{proxy.url}/get_counter_value", headers={TOKEN: owners[victim][0]}
    ) as resp:
        assert resp.status == 410

    async def replaced():
        seen = set()
        for _ in range(6):
            async with http.post(f"{proxy.url}/whoami") as resp:
                if resp.status == 200:
                    seen.add((await resp.json())["owner"])
        return len(seen) == 2 and victim not in seen

    await wait_until(replaced, 20, "a new worker in the slot")
    assert "did not answer" in proxy.log()


async def test_restore_fails_at_its_deadline_and_rolls_back(participant, http, tmp_path):
    from tests.test_crafted_checkpoints import GOOD_SESSION, craft

    craft(tmp_path, [orjson.dumps(GOOD_SESSION)])
    control = Control(http, participant.url)
    owners = await sessions_by_owner(http, participant.url)
    victim, _ = sorted(owners)
    victim_pid = await pid_of(http, participant.url, victim)
    async with stopped(victim_pid):
        started = time.monotonic()
        status, body = await control.call(
            "restore",
            checkpoint_id="r1",
            checkpoint_dir=str(tmp_path),
            episode_ids=[],
            deadline_ts=time.time() + 2,
        )
        assert (status, body["error"]["code"]) == (409, "deadline_exceeded"), body
        assert "nothing was installed" in body["error"]["detail"]
        assert time.monotonic() - started < 2 + SLACK + 2  # + the rollback's wait
        state = await control.ok("status")
        assert state["phase"] == "idle" and state["session_aliases"] == {}
    # awake again: it rolled back too, and a restore now succeeds
    reply = await control.ok(
        "restore", checkpoint_id="r2", checkpoint_dir=str(tmp_path), episode_ids=[]
    )
    assert reply["phase"] == "restored"
    await control.ok("resume", checkpoint_id="r2")
