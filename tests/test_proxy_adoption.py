"""When gym-proxy dies, its workers are not lost (`--orphan-grace`): they keep their
sessions and wait, and the same command started again adopts them, every session as it
was, in the same processes. Real processes: the proxy is killed with SIGKILL alone."""

from __future__ import annotations

import asyncio
import os
import random
import signal

import aiohttp
import orjson
import pytest

from gym_proxy.coordinator.contract.headers import WORKERS_PATH
from tests.conftest import BOTH_APP_KINDS
from tests.support import (
    CONTROL_TOKEN,
    Control,
    ProxyProcess,
    pid_alive,
    wait_until,
    wait_until_sync,
)

TOKEN_HEADER = "X-NeMo-Gym-Session-Token"
MOVE = "/ng-control/v1/gym-proxy/sessions/move"
CONTROL = "adoption-control-token"

GRACE = ("--orphan-grace", "60")


def crash(proxy: ProxyProcess) -> list[int]:
    """kill -9 the proxy alone; its workers' pids (alive)."""
    pids = proxy.worker_pids()
    os.kill(proxy.pid, signal.SIGKILL)
    proxy.popen.wait(10)
    assert pids and all(pid_alive(p) for p in pids)
    return pids


async def seed(http, url: str, count: int) -> list[tuple[str, int]]:
    sessions = []
    for i in range(count):
        async with http.post(f"{url}/seed_session", json={"initial_count": i}) as resp:
            assert resp.status == 200
            sessions.append((resp.headers[TOKEN_HEADER], i))
    return sessions


async def counts_and_pids(http, url: str, sessions: list[tuple[str, int]]) -> tuple[list, set]:
    """Each session's count after one more increment, and the pids that answered."""
    counts, pids = [], set()
    for token, _ in sessions:
        async with http.post(
            f"{url}/increment_counter", json={"count": 1}, headers={TOKEN_HEADER: token}
        ) as resp:
            assert resp.status == 200, await resp.text()
            counts.append((await resp.json())["count"])
        async with http.get(f"{url}/whoami", headers={TOKEN_HEADER: token}) as resp:
            pids.add((await resp.json())["pid"])
    return counts, pids


class Load:
    """Eight pooled clients incrementing random sessions until `finish`: each session's
    confirmed increments and (with `retry`) the calls a connection error cut, which may
    or may not have counted; the calls answered before and after `marked` is set."""

    def __init__(self, url: str, sessions: list[tuple[str, int]], retry: bool) -> None:
        self.url, self.sessions, self.retry = url, sessions, retry
        self.confirmed = [n for _, n in sessions]
        self.cut = [0] * len(sessions)
        self.served = {"before": 0, "after": 0}
        self.marked, self._stop = asyncio.Event(), asyncio.Event()
        self._tasks = [asyncio.ensure_future(self._client(n)) for n in range(8)]

    async def _client(self, seed_: int) -> None:
        rng = random.Random(seed_)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=4)) as pooled:
            while not self._stop.is_set():
                i = rng.randrange(len(self.sessions))
                try:
                    async with pooled.post(
                        f"{self.url}/increment_counter",
                        json={"count": 1},
                        headers={TOKEN_HEADER: self.sessions[i][0]},
                    ) as resp:
                        assert resp.status == 200, await resp.text()
                        await resp.read()
                except (TimeoutError, aiohttp.ClientConnectionError):
                    if not self.retry:
                        raise
                    self.cut[i] += 1  # it may have counted on the worker: unknown
                    await asyncio.sleep(0.01)  # a retrying client's pause
                    continue
                self.confirmed[i] += 1
                self.served["after" if self.marked.is_set() else "before"] += 1

    async def finish(self) -> None:
        """Stop the clients; a failed request (without `retry`) raises here."""
        self._stop.set()
        await asyncio.gather(*self._tasks)


@BOTH_APP_KINDS
@pytest.mark.parametrize("preload", [False, True], ids=["spawned", "preloaded"])
async def test_the_same_command_started_again_adopts_every_session(start_proxy, http, preload):
    """40 sessions on 2 workers, those of worker 0 moved to worker 1 (so the table, not
    their tokens, places them); kill -9 of the proxy; the same command again: the same
    two processes serve every session, counters exact, the moved ones still on worker 1."""
    args = (*GRACE, "--control-token", CONTROL, *(["--preload"] if preload else []))
    first = start_proxy(*args, workers=2)
    sessions = await seed(http, first.url, 40)
    slots = await slots_of(http, first.url, sessions)
    on_zero = [token for (token, _), slot in zip(sessions, slots, strict=True) if slot == 0]
    moving = [token.split(".")[2] for token in on_zero]
    async with http.post(
        f"{first.url}{MOVE}",
        json={"session_ids": moving, "to_slot": 1},
        headers={"Authorization": f"Bearer {CONTROL}"},
    ) as resp:
        assert resp.status == 200 and (await resp.json())["moved"] == sorted(moving)
    before, _ = await counts_and_pids(http, first.url, sessions)
    pids = crash(first)
    second = start_proxy(*args, workers=2, same_as=first)
    assert "adopted 2 workers of the dead instance" in second.log()
    assert second.worker_pids() == []  # none started: the old ones serve
    # A new client session: the old one's keep-alive connections died with the proxy.
    async with aiohttp.ClientSession() as again:
        after, answered = await counts_and_pids(again, second.url, sessions)
        assert after == [count + 1 for count in before]  # every counter exact
        assert len(answered) == 1 and answered < set(pids)  # worker 1, since the move
        assert set(await slots_of(again, second.url, sessions)) == {1}
        # new sessions go to the adopted workers too, and a stop ends them
        fresh = await seed(again, second.url, 4)
        assert (await counts_and_pids(again, second.url, fresh))[1] <= set(pids)
    second.signal(signal.SIGTERM)
    assert second.wait_exit() == 0
    wait_until_sync(lambda: not any(pid_alive(p) for p in pids), 15, "the workers to stop")


async def slots_of(http, url: str, sessions: list[tuple[str, int]]) -> list[int]:
    slots = []
    for token, _ in sessions:
        async with http.get(f"{url}/whoami", headers={TOKEN_HEADER: token}) as resp:
            slots.append((await resp.json())["slot"])
    return slots


async def test_with_no_proxy_started_again_the_workers_stop_after_the_grace(start_proxy, http):
    first = start_proxy("--orphan-grace", "1", workers=2)
    await seed(http, first.url, 2)
    pids = crash(first)
    wait_until_sync(lambda: not any(pid_alive(p) for p in pids), 20, "the grace to end them")
    assert "no gym-proxy adopted it within 1 s; stopping" in first.log()


async def test_workers_wait_only_for_a_proxy_that_dies_not_one_that_stops(start_proxy, http):
    """A crash leaves the workers waiting (`--orphan-grace`). A stop (SIGINT, as NeMo
    Gym's launcher sends) tells them first, so one that the launcher SIGKILLs a second
    later, before it stopped its workers (a request in flight holds it), leaves none."""
    first = start_proxy(*GRACE, "--control-token", CONTROL_TOKEN, workers=2)
    await seed(http, first.url, 1)
    pids = crash(first)
    wait_until_sync(lambda: "up to 60 s for a gym-proxy" in first.log(), 10, "the wait")
    second = start_proxy(*GRACE, "--control-token", CONTROL_TOKEN, workers=2, same_as=first)
    assert second.worker_pids() == [] and "adopted 2 workers" in second.log()
    async with aiohttp.ClientSession() as client:
        held = asyncio.ensure_future(client.get(f"{second.url}/slow?seconds=60&tag=held"))
        await wait_until(lambda: seen_slow(client, second.url), 10, "the request to run")
        second.signal(signal.SIGINT)
        wait_until_sync(lambda: "waiting up to" in second.log(), 10, "the stop to begin")
        os.kill(second.pid, signal.SIGKILL)
        second.popen.wait(10)
        wait_until_sync(lambda: not any(pid_alive(p) for p in pids), 15, "the workers to stop")
        held.cancel()  # aiohttp sent the GET again, to the listening socket no one serves


async def seen_slow(http, url: str) -> bool:
    """Whether a worker runs a /slow request."""
    for worker in (await Control(http, url).ok("status"))["workers"]:
        owner = {"x-ng-session-owner": worker["owner"]}
        async with http.get(f"{url}/seen", headers=owner) as resp:
            if "/slow" in (await resp.json())["paths"]:
                return True
    return False


async def test_a_proxy_with_another_secret_refuses_to_adopt(start_proxy, http):
    first = start_proxy(*GRACE, workers=1)
    sessions = await seed(http, first.url, 3)
    pids = crash(first)
    other = start_proxy(*GRACE, workers=1, same_as=first, secret="another-secret", ready=False)
    assert other.wait_exit() == 2
    assert "cannot adopt the workers a dead instance left in" in other.log()
    assert all(pid_alive(p) for p in pids)  # left to the one that may adopt them
    again = start_proxy(*GRACE, workers=1, same_as=first)
    async with aiohttp.ClientSession() as client:
        counts, _ = await counts_and_pids(client, again.url, sessions)
    assert counts == [1, 2, 3]


async def test_a_second_proxy_while_the_first_lives_is_refused(start_proxy, http):
    first = start_proxy(*GRACE, workers=1)
    second = start_proxy(*GRACE, workers=1, same_as=first, ready=False)
    assert second.wait_exit() == 2
    assert "another gym-proxy of this instance runs with" in second.log()
    async with http.get(f"{first.url}/whoami") as resp:
        assert resp.status == 200


def test_orphan_grace_needs_a_secret():
    proxy = ProxyProcess(*GRACE, workers=1, app="tests.apps:create_app", secret=None)
    try:
        assert proxy.wait_exit() == 2
        assert "--orphan-grace needs --secret or --secret-file" in proxy.log()
    finally:
        proxy.close()


async def test_a_checkpoint_open_at_the_crash_is_refused_after_the_adoption(start_proxy, http):
    """A checkpoint prepared (every worker's door closed) when the proxy dies: the new
    proxy reports idle, the controller's commit of it is refused (it starts again), and
    the adopted workers serve again (their doors reopened)."""
    args = (*GRACE, "--control-token", CONTROL_TOKEN)
    first = start_proxy(*args, workers=2)
    sessions = await seed(http, first.url, 6)
    assert (await Control(http, first.url).ok("prepare", checkpoint_id="ck"))["phase"] == "prepared"
    crash(first)
    second = start_proxy(*args, workers=2, same_as=first)
    async with aiohttp.ClientSession() as again:
        control = Control(again, second.url)
        assert (await control.ok("status"))["phase"] == "idle"
        code, body = await control.call("commit", checkpoint_id="ck", checkpoint_dir="/tmp/x")
        assert code == 409 and body["error"]["code"] == "invalid_phase", body
        counts, _ = await counts_and_pids(again, second.url, sessions)
        assert counts == [1, 2, 3, 4, 5, 6]


async def test_a_crash_during_the_adoption_leaves_the_workers_to_the_next(start_proxy, http):
    """The adopting proxy dies with one worker half adopted (a crash point): both workers
    go back to waiting, and the next start adopts them, every count exact."""
    first = start_proxy(*GRACE, workers=2)
    sessions = await seed(http, first.url, 10)
    pids = crash(first)
    dying = start_proxy(
        *GRACE, workers=2, same_as=first, env={"GYM_PROXY_FAILPOINTS": "adopting"}, ready=False
    )
    assert dying.wait_exit() == 97  # failpoints.FAILPOINT_EXIT
    assert all(pid_alive(p) for p in pids)
    third = start_proxy(*GRACE, workers=2, same_as=first)
    assert "adopted 2 workers of the dead instance" in third.log()
    async with aiohttp.ClientSession() as again:
        counts, answered = await counts_and_pids(again, third.url, sessions)
    assert counts == [n + 1 for n in range(10)] and answered <= set(pids)


async def test_a_crash_under_load_keeps_1000_sessions_on_4_workers(start_proxy, http):
    """Eight pooled clients increment random sessions of 1,000 (on 4 workers) while
    gym-proxy alone is killed and started again. Calls cut by the crash are retried, as
    NeMo Gym's clients retry; one whose answer was lost may have counted, so a session's
    count is its confirmed increments plus at most its cut ones, and no session is lost:
    every count is in that range, served by the same 4 processes."""
    first = start_proxy(*GRACE, workers=4)
    sessions = await seed(http, first.url, 1000)
    pids = first.worker_pids()
    load = Load(first.url, sessions, retry=True)
    await wait_until(lambda: load.served["before"] >= 300, 30, "the load to run")
    crash(first)
    load.marked.set()
    second = start_proxy(*GRACE, workers=4, same_as=first)
    await wait_until(lambda: load.served["after"] >= 300, 30, "the load to be served again")
    await load.finish()
    async with aiohttp.ClientSession() as again:
        counts, answered = await counts_and_pids(again, second.url, sessions)
    assert answered <= set(pids) and second.worker_pids() == []
    for i, count in enumerate(counts):
        confirmed, cut = load.confirmed[i], load.cut[i]
        assert confirmed + 1 <= count <= confirmed + cut + 1, (i, count, confirmed)


async def test_adopted_workers_take_a_rolling_restart_and_its_heirs_outlive_a_crash(
    start_proxy, http
):
    """The live operations treat an adopted worker as any other: a rolling restart after
    the adoption moves every session to new processes and stops the adopted ones (through
    their pidfds: they are not this proxy's children), every count exact. The restart
    made each new worker its old one's heir: after the next crash, a token whose session
    no worker holds any more (closed) still reaches the heir, not 410."""
    args = (*GRACE, "--control-token", CONTROL)
    first = start_proxy(*args, workers=2)
    sessions = await seed(http, first.url, 12)
    pids = crash(first)
    second = start_proxy(*args, workers=2, same_as=first)
    async with aiohttp.ClientSession() as again:
        async with again.post(
            f"{second.url}/ng-control/v1/gym-proxy/workers/restart",
            json={"timeout_s": 30},
            headers={"Authorization": f"Bearer {CONTROL}"},
        ) as resp:
            reply = await resp.json()
            assert resp.status == 200 and reply["complete"], reply
        wait_until_sync(lambda: not any(pid_alive(p) for p in pids), 15, "the old to stop")
        counts, answered = await counts_and_pids(again, second.url, sessions)
        closed, _ = sessions[0]
        [heir] = await slots_of(again, second.url, [sessions[0]])
        async with again.post(
            f"{second.url}/close_session", headers={TOKEN_HEADER: closed}
        ) as resp:
            assert resp.status == 200
        aliases = (await Control(again, second.url, CONTROL).ok("status"))["session_aliases"]
    assert counts == [n + 1 for n in range(12)]
    assert answered and answered.isdisjoint(pids) and answered <= set(second.worker_pids())
    crash(second)
    third = start_proxy(*args, workers=2, same_as=first)
    async with aiohttp.ClientSession() as again:
        assert (await Control(again, third.url, CONTROL).ok("status"))["session_aliases"] == aliases
        async with again.get(f"{third.url}/whoami", headers={TOKEN_HEADER: closed}) as resp:
            assert resp.status == 200, await resp.text()  # 410 without the kept aliases
            assert (await resp.json())["slot"] == heir


async def test_a_restored_episode_not_yet_claimed_continues_after_an_adoption(
    start_proxy, http, tmp_path
):
    """The restored episodes awaiting their replacement were held by the proxy that
    restored them: when it dies before the claim, the adopting proxy reads their records
    again from the checkpoint (the workers say which are unclaimed), and the replacement
    continues from the boundary, once; a wrong attempt is still refused."""
    args = (*GRACE, "--control-token", CONTROL_TOKEN)
    first = start_proxy(*args, workers=1)
    run = asyncio.ensure_future(
        http.post(f"{first.url}/run", json={"_ng_rollout_id": "r7", "steps": 2, "gate": "g"})
    )
    async with http.post(f"{first.url}/release?name=g-0") as resp:
        assert resp.status == 200

    async def at_boundary() -> bool:
        async with http.get(f"{first.url}/progress") as resp:
            return (await resp.json())["progress"].get("r7") == 1

    await wait_until(at_boundary, 10, "the episode's first boundary")
    scope = [{"rollout_id": "r7", "attempt": 0}]
    await Control(http, first.url).checkpoint("ck", str(tmp_path), episode_ids=scope)
    first.kill_all()
    with pytest.raises(aiohttp.ClientError):
        await run
    async with aiohttp.ClientSession() as client:
        second = start_proxy(*args, workers=1, same_as=first)
        control = Control(client, second.url)
        reply = await control.ok(
            "restore", checkpoint_id="rs", checkpoint_dir=str(tmp_path), episode_ids=scope
        )
        assert reply["restored"] == ["r7-a1"]
        await control.ok("resume", checkpoint_id="rs")
        crash(second)
    third = start_proxy(*args, workers=1, same_as=first)
    assert "1 restored episodes awaiting their replacement, read again from" in third.log()
    async with aiohttp.ClientSession() as client:
        status = await Control(client, third.url).ok("status")
        assert status["restored_pending"] == ["r7-a1"], status
        body = {"_ng_rollout_id": "r7", "_ng_attempt_index": 2, "steps": 2, "gate": "g"}
        async with client.post(f"{third.url}/run", json=body) as resp:
            assert resp.status == 409 and (await resp.json())["error"]["code"] == "stale_attempt"
        async with client.post(f"{third.url}/release?name=g-1") as resp:
            assert resp.status == 200
        body["_ng_attempt_index"] = 1  # the same task: its digest is the record's
        async with client.post(f"{third.url}/run", json=body) as resp:
            reply = await resp.json()
            assert resp.status == 200 and reply["restored"], reply
            assert reply["state"]["log"] == ["r7:0", "r7-a1:1"], reply
        status = await Control(client, third.url).ok("status")
        assert status["restored_pending"] == [], status  # claimed


async def test_a_take_over_under_load_fails_no_request(start_proxy):
    """An upgrade: the same command with `--take-over` started beside the running proxy
    takes its listening socket (the test's copy closed: only the proxy holds the port)
    and its workers while 8 pooled clients that never retry increment random sessions of
    200: no request fails, every count is exactly its increments, the same 2 processes
    serve, and the old proxy finishes its connections and exits 0."""
    first = start_proxy(*GRACE, workers=2)
    # Seeded on a connection closed at once: an idle keep-alive connection would keep the
    # old proxy (and the load) going until its client drops it.
    async with aiohttp.ClientSession() as seeding:
        sessions = await seed(seeding, first.url, 200)
    pids = first.worker_pids()
    first.listener.close()
    load = Load(first.url, sessions, retry=False)
    await wait_until(lambda: load.served["before"] >= 300, 30, "the load to run")
    # Not `ready=True`: its wait blocks, and the load must go on meanwhile.
    second = start_proxy(
        *GRACE, "--take-over", workers=2, same_as=first, inherit=False, ready=False
    )
    await wait_until(lambda: first.popen.poll() is not None, 60, "the old proxy to exit")
    load.marked.set()
    assert first.popen.returncode == 0
    await wait_until(
        lambda: load.served["after"] >= 300, 30, "the load to be served by the new one"
    )
    assert "ready on http://" in second.log()
    assert "adopted 2 workers the previous instance passed on" in second.log()
    await load.finish()  # an exception here is a failed request
    assert second.worker_pids() == [] and all(pid_alive(p) for p in pids)
    assert "taken over by a new gym-proxy" in first.log()
    async with aiohttp.ClientSession() as again:
        counts, answered = await counts_and_pids(again, second.url, sessions)
    assert counts == [n + 1 for n in load.confirmed] and answered <= set(pids)


def test_a_take_over_with_nothing_to_take_is_refused_in_one_line():
    app = "tests.apps:create_app"
    alone = ProxyProcess(*GRACE, "--take-over", workers=1, app=app)
    no_grace = ProxyProcess("--take-over", "--orphan-grace", "0", workers=1, app=app)
    no_secret = ProxyProcess(*GRACE, "--take-over", workers=1, app=app, secret=None)
    try:
        assert alone.wait_exit() == 2
        assert "--take-over: no running gym-proxy of instance" in alone.log()
        assert no_grace.wait_exit() == 2
        assert "--take-over needs --orphan-grace above 0" in no_grace.log()
        assert no_secret.wait_exit() == 2
        assert "--take-over needs --secret or --secret-file" in no_secret.log()
    finally:
        for proxy in (alone, no_grace, no_secret):
            proxy.close()


async def test_another_instance_leaves_waiting_workers_alone_and_says_so(start_proxy, http):
    first = start_proxy(*GRACE, workers=1)
    await seed(http, first.url, 2)
    pids = crash(first)
    other = start_proxy(*GRACE, "--name", "other", workers=1, same_as=first)
    line = "the workers of a dead gym-proxy (instance 'apps') wait in"
    assert line in other.log() and "this one is 'other'" in other.log()
    assert all(pid_alive(p) for p in pids) and other.worker_pids()  # its own, started


async def test_workers_past_the_new_worker_count_are_adopted_not_dropped(start_proxy, http):
    """The dead instance ran 3 workers (resized up, say); the command started again says
    --workers 2: all 3 are adopted, with their sessions, and the server keeps 3."""
    first = start_proxy(*GRACE, "--control-token", CONTROL_TOKEN, workers=3)
    sessions = await seed(http, first.url, 12)
    pids = crash(first)
    second = start_proxy(*GRACE, "--control-token", CONTROL_TOKEN, workers=2, same_as=first)
    assert "adopting worker 2 beyond --workers 2" in second.log()
    async with aiohttp.ClientSession() as again:
        counts, answered = await counts_and_pids(again, second.url, sessions)
        status = await Control(again, second.url).ok("status")
    assert counts == [n + 1 for n in range(12)] and answered == set(pids)
    assert status["expected_workers"] == 3 and len(status["workers"]) == 3


async def test_a_kept_count_past_the_adopted_workers_is_grown_to_once_they_serve(
    start_proxy, http, tmp_path
):
    """The dead instance was resized up to 3 and its worker 2 died with it; the command
    again says --workers 2. The adopted workers' sessions are served while worker 2 cannot
    start yet (its app waits for a file): the start no longer waits for it (a start that
    gave up would stop the adopted workers with every session); the count of 3 is then
    reached by a resize, logged as one."""
    hold = tmp_path / "hold"
    args = (*GRACE, "--control-token", CONTROL_TOKEN)
    env = {"GYM_TEST_HOLD_FILE": str(hold)}
    first = start_proxy(*args, workers=2, env=env)
    auth = {"Authorization": f"Bearer {CONTROL_TOKEN}"}
    async with http.post(
        f"{first.url}{WORKERS_PATH}/resize", json={"workers": 3}, headers=auth
    ) as resp:
        assert resp.status == 200, await resp.text()
    sessions = await seed(http, first.url, 9)
    slots = await slots_of(http, first.url, sessions)
    kept = [s for s, slot in zip(sessions, slots, strict=True) if slot != 2]
    third = (await Control(http, first.url).ok("status"))["workers"][2]["pid"]
    crash(first)
    os.kill(third, signal.SIGKILL)
    hold.write_text("worker 2's replacement waits")
    second = start_proxy(*args, workers=2, env=env, same_as=first)
    assert "the ones not adopted start once the adopted serve" in second.log(), second.log()
    async with aiohttp.ClientSession() as again:
        counts, _ = await counts_and_pids(again, second.url, kept)
        assert counts == [n + 1 for _, n in kept]
        hold.unlink()
        await wait_until(
            lambda: "resize (adoption) done" in second.log(), 60, "the grow to the kept 3"
        )
        status = await Control(again, second.url).ok("status")
        assert status["expected_workers"] == 3 and len(status["workers"]) == 3, status


async def test_a_resize_a_drain_and_the_retire_marks_outlive_the_crash(start_proxy, http):
    """What only the proxy knew survives it: the worker count a resize left (down, here:
    the command says 3), the drain of a worker (it still takes no new session), and the
    retire marks (the workers report them: counted, and a late call of a retired attempt
    is refused, until a `forget` that reaches the workers); and a second crash too, the
    adopting proxy having kept them (random-operation seed 300257)."""
    args = (*GRACE, "--control-token", CONTROL_TOKEN)
    first = start_proxy(*args, workers=3)
    control = Control(http, first.url)
    auth = {"Authorization": f"Bearer {CONTROL_TOKEN}"}
    workers = f"{first.url}{WORKERS_PATH}"
    async with http.post(f"{workers}/resize", json={"workers": 2}, headers=auth) as resp:
        assert resp.status == 200, await resp.text()
    async with http.post(f"{workers}/drain", json={"slot": 0}, headers=auth) as resp:
        assert resp.status == 200, await resp.text()
    episode = {"rollout_id": "r9", "attempt": 0}
    assert await control.ok("retire", checkpoint_id="c1", episode_ids=[episode])
    drained = (await control.ok("status"))["workers"][0]["owner"]
    pids = crash(first)
    second = start_proxy(*args, workers=3, same_as=first)
    assert "keeping the 2 workers the dead instance was resized to (--workers 3" in second.log()
    async with aiohttp.ClientSession() as again:
        control = Control(again, second.url)
        status = await control.ok("status")
        assert status["expected_workers"] == 2 and status["retired_rollouts"] == 1, status
        assert {w["pid"] for w in status["workers"]} == set(pids)
        assert [w["state"] for w in status["workers"]] == ["draining", "ready"], status
        fresh = await seed(again, second.url, 6)
        assert set(await slots_of(again, second.url, fresh)) == {1}  # not the drained one
        late = {"_ng_rollout_id": "r9", "_ng_attempt_index": 0, "steps": 1}
        async with again.post(f"{second.url}/run", json=late) as resp:
            assert resp.status == 409 and (await resp.json())["error"]["code"] == "stale_attempt"
        await control.ok("forget", checkpoint_id="c2", rollout_ids=["r9"])
        async with again.post(f"{second.url}/run", json=late) as resp:
            assert resp.status == 200, await resp.text()
    # A second crash: the one that adopted them keeps what it took in, for the next.
    os.kill(second.pid, signal.SIGKILL)  # its workers are not its children: they wait
    second.popen.wait(10)
    third = start_proxy(*args, workers=3, same_as=first)
    async with aiohttp.ClientSession() as again:
        status = await Control(again, third.url).ok("status")
        assert status["expected_workers"] == 2 and {w["pid"] for w in status["workers"]} == set(
            pids
        )
        assert [w["state"] for w in status["workers"]] == ["draining", "ready"], status
        async with again.post(f"{third.url}{WORKERS_PATH}/undrain", json={"slot": 0},
                              headers=auth) as resp:  # fmt: skip
            assert (await resp.json())["slots"] == [
                {"slot": 0, "owner": drained, "draining": False}
            ]


async def test_a_move_cut_by_the_crash_leaves_one_copy_of_each_session(start_proxy, http, tmp_path):
    """The proxy dies after the target installed worker 0's sessions and before the table
    sent them there (a crash point), so both workers hold them when the same command
    adopts them: each stays with the copy installed last (the target's), the source drops
    its own, every count is exact, and a checkpoint holds each session once."""
    args = (*GRACE, "--control-token", CONTROL)
    first = start_proxy(*args, workers=2, env={"GYM_PROXY_FAILPOINTS": "move-installed"})
    sessions = await seed(http, first.url, 12)
    slots = await slots_of(http, first.url, sessions)
    moving = [t.split(".")[2] for (t, _), slot in zip(sessions, slots, strict=True) if slot == 0]
    assert moving
    before, _ = await counts_and_pids(http, first.url, sessions)
    with pytest.raises(aiohttp.ClientError):
        await http.post(
            f"{first.url}{MOVE}",
            json={"session_ids": moving, "to_slot": 1},
            headers={"Authorization": f"Bearer {CONTROL}"},
        )
    assert first.wait_exit(30) == 97  # failpoints.FAILPOINT_EXIT
    second = start_proxy(*args, workers=2, same_as=first)
    assert f"{len(moving)} sessions were held by two workers" in second.log()
    async with aiohttp.ClientSession() as again:
        after, _ = await counts_and_pids(again, second.url, sessions)
        assert after == [count + 1 for count in before]
        assert set(await slots_of(again, second.url, sessions)) == {1}
        control = Control(again, second.url, CONTROL)
        await control.checkpoint("after", str(tmp_path))
    [records] = tmp_path.glob("gym/*/*/records-*.jsonl")
    held = [orjson.loads(line)["session_id"] for line in records.read_bytes().splitlines()]
    assert sorted(held) == sorted(t.split(".")[2] for t, _ in sessions)  # each once


async def test_a_take_over_waits_for_an_open_checkpoint_to_resume(start_proxy):
    """A checkpoint's phase lives in the running proxy: a take-over while one is open is
    refused in one line (exit 2), the old proxy serves on, untouched; after the resume
    the same take-over succeeds."""
    args = (*GRACE, "--control-token", CONTROL)
    first = start_proxy(*args, workers=2)
    # A client session closed before the take-over: an idle keep-alive connection would
    # keep the old proxy until its client drops it.
    async with aiohttp.ClientSession() as before:
        sessions = await seed(before, first.url, 4)
        control = Control(before, first.url, CONTROL)
        assert (await control.ok("prepare", checkpoint_id="up-1"))["phase"] == "prepared"
        refused = start_proxy(
            *args, "--take-over", workers=2, same_as=first, inherit=False, ready=False
        )
        assert refused.wait_exit() == 2
        assert "checkpoint up-1 is open; take over after its resume" in refused.log()
        assert (await control.ok("status"))["phase"] == "prepared"
        await control.ok("resume", checkpoint_id="up-1")
    second = start_proxy(*args, "--take-over", workers=2, same_as=first, inherit=False, ready=False)
    await wait_until(lambda: first.popen.poll() is not None, 60, "the old proxy to exit")
    assert first.popen.returncode == 0
    second.wait_ready()
    async with aiohttp.ClientSession() as again:
        counts, _ = await counts_and_pids(again, second.url, sessions)
    assert counts == [n + 1 for n in range(4)]


async def test_a_session_lost_after_a_move_stays_lost_through_an_adoption(start_proxy, http):
    """A session moved from worker 0 to worker 1, then worker 1 killed: the session is
    lost (410). After a crash of the proxy, the same command adopts the workers, which
    name only the sessions they hold, so the session's token routes back to worker 0: it
    refuses it 410 (it dropped that session when it moved), never serving it anew."""
    first = start_proxy(*GRACE, "--control-token", CONTROL, workers=2)
    sessions = await seed(http, first.url, 6)
    slots = await slots_of(http, first.url, sessions)
    token = next(t for (t, _), slot in zip(sessions, slots, strict=True) if slot == 0)
    auth = {"Authorization": f"Bearer {CONTROL}"}
    async with http.post(
        f"{first.url}{MOVE}", json={"session_ids": [token.split(".")[2]], "to_slot": 1},
        headers=auth,
    ) as resp:  # fmt: skip
        assert resp.status == 200, await resp.text()
    status = await Control(http, first.url, CONTROL).ok("status")
    target = next(w for w in status["workers"] if w["slot"] == 1)
    os.kill(target["pid"], signal.SIGKILL)

    async def lost(url: str) -> bool:
        async with aiohttp.ClientSession() as client:
            async with client.get(f"{url}/whoami", headers={TOKEN_HEADER: token}) as resp:
                body = await resp.json()
                return resp.status == 410 and body["error"]["code"] == "session_owner_gone"

    await wait_until(lambda: lost(first.url), 15, "the kill to lose the session")

    async def both_live() -> bool:
        return len((await Control(http, first.url, CONTROL).ok("status"))["workers"]) == 2

    await wait_until(both_live, 30, "slot 1 to be restarted")
    crash(first)
    second = start_proxy(*GRACE, "--control-token", CONTROL, workers=2, same_as=first)
    assert "adopted 2 workers of the dead instance" in second.log()
    assert await lost(second.url)
