"""Live operations (`proxy.fleet.operations.live`): rolling restart, resize, drain and recycle
while a pooled client (any session on any connection) increments counters; every counter
must come out exact and no request may fail.

Most run gym-proxy in process (`tests/in_process.py`: the real proxy and worker code in
the test's event loop, over real sockets, without the process starts). The ones that
need processes start real ones: signals and the log they leave, a kill -9 and a restore,
a worker's resident memory, a SIGSTOPped worker, the `gym-proxy-ctl` command."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import sys
from collections.abc import Awaitable, Callable

import aiohttp
import orjson
import pytest

from tests.conftest import BOTH_APP_KINDS
from tests.support import CONTROL_TOKEN as CONTROL
from tests.support import Control, app_saw, wait_until

WORKERS = "/ng-control/v1/gym-proxy/workers"
TOKEN_HEADER = "X-NeMo-Gym-Session-Token"
AUTH = {"Authorization": f"Bearer {CONTROL}"}

CTL_MAIN = "from gym_proxy.coordinator.clients.controller_cli import main; main()"


async def seed(http: aiohttp.ClientSession, url: str) -> str:
    async with http.post(f"{url}/seed_session", json={"initial_count": 0}) as response:
        assert response.status == 200, await response.text()
        return response.headers[TOKEN_HEADER]


async def whoami(http: aiohttp.ClientSession, url: str, token: str) -> dict:
    async with http.get(f"{url}/whoami", headers={TOKEN_HEADER: token}) as response:
        assert response.status == 200, await response.text()
        return await response.json()


async def count(http: aiohttp.ClientSession, url: str, token: str) -> int:
    async with http.post(
        f"{url}/get_counter_value", json={}, headers={TOKEN_HEADER: token}
    ) as response:
        assert response.status == 200, await response.text()
        return (await response.json())["count"]


async def operate(http: aiohttp.ClientSession, url: str, name: str, **body) -> tuple[int, dict]:
    async with http.post(f"{url}{WORKERS}/{name}", json=body, headers=AUTH) as response:
        return response.status, await response.json()


async def status_of(http: aiohttp.ClientSession, url: str) -> dict:
    async with http.get(f"{url}/ng-control/v1/checkpoint/status", headers=AUTH) as response:
        assert response.status == 200
        return await response.json()


class Load:
    """Clients incrementing random sessions until stopped; what each session was sent."""

    def __init__(self, http: aiohttp.ClientSession, url: str, tokens: list[str], seed: int):
        self.http, self.url, self.tokens = http, url, tokens
        self.sent = [0] * len(tokens)
        self.rng = random.Random(seed)
        self.stopping = asyncio.Event()
        self.failures: list[str] = []
        self.tasks: list[asyncio.Task[None]] = []

    def start(self, clients: int = 4, most: int = 20000) -> None:
        self.tasks = [asyncio.ensure_future(self._client(most)) for _ in range(clients)]

    async def _client(self, most: int) -> None:
        for _ in range(most):  # bounded: stops by itself
            if self.stopping.is_set():
                return
            i = self.rng.randrange(len(self.tokens))
            headers = {TOKEN_HEADER: self.tokens[i]}
            async with self.http.post(
                f"{self.url}/increment_counter", json={"count": 1}, headers=headers
            ) as response:
                if response.status != 200:
                    self.failures.append(f"{response.status} {await response.text()}")
                    return
            self.sent[i] += 1

    async def until(self, requests: int) -> None:
        await wait_until(lambda: sum(self.sent) >= requests, 60, f"{requests} requests sent")

    async def stop(self) -> None:
        self.stopping.set()
        await asyncio.wait_for(asyncio.gather(*self.tasks), 60)
        assert not self.failures, self.failures[:5]

    async def check(self) -> None:
        for i, token in enumerate(self.tokens):
            assert await count(self.http, self.url, token) == self.sent[i], i


async def under_load(
    proxy, sessions: int, operation: Callable[[aiohttp.ClientSession, Load], Awaitable[None]]
) -> Load:
    async with aiohttp.ClientSession() as http:
        tokens = [await seed(http, proxy.url) for _ in range(sessions)]
        load = Load(http, proxy.url, tokens, seed=sessions)
        load.start()
        await load.until(100)
        await operation(http, load)
        sent = sum(load.sent)
        await load.until(sent + 100)  # the load goes on after the operation
        await load.stop()
        await load.check()
        return load


@BOTH_APP_KINDS
async def test_rolling_restart_of_four_workers_loses_no_request_and_no_count(in_process, test_app):
    proxy = await in_process(workers=4, control_token=CONTROL, app=test_app)
    before = set(proxy.worker_pids())

    async def restart(http: aiohttp.ClientSession, load: Load) -> None:
        status, reply = await operate(http, proxy.url, "restart", timeout_s=30)
        assert status == 200, reply
        assert reply["complete"] and reply["failed"] == [], reply
        assert [s["slot"] for s in reply["slots"]] == [0, 1, 2, 3]
        assert all(s["outcome"] == "stopped" for s in reply["slots"]), reply
        assert reply["moved"] >= 1
        listed = await status_of(http, proxy.url)
        assert {w["pid"] for w in listed["workers"]}.isdisjoint(before)
        assert len(listed["workers"]) == 4 and listed["expected_workers"] == 4
        assert listed["operations"]["last"]["operation"] == "restart"

    await under_load(proxy, 60, restart)
    assert set(proxy.worker_pids()).isdisjoint(before)


async def test_resize_two_to_four_to_one_under_load(in_process):
    proxy = await in_process(workers=2, control_token=CONTROL)

    async def resize(http: aiohttp.ClientSession, load: Load) -> None:
        status, reply = await operate(http, proxy.url, "resize", workers=4)
        assert status == 200 and reply["complete"] and reply["workers"] == 4, reply
        await wait_until(lambda: len(proxy.worker_pids()) == 4, 30, "four workers")
        fresh = [await seed(http, proxy.url) for _ in range(12)]
        slots = {(await whoami(http, proxy.url, t))["slot"] for t in fresh}
        assert {2, 3} & slots, slots  # new sessions reach the new workers
        load.tokens += fresh
        load.sent += [0] * len(fresh)
        await load.until(sum(load.sent) + 100)
        status, reply = await operate(http, proxy.url, "resize", workers=1, timeout_s=30)
        assert status == 200 and reply["complete"] and reply["workers"] == 1, reply
        assert [s["slot"] for s in reply["slots"]] == [3, 2, 1]
        listed = await status_of(http, proxy.url)
        assert [w["slot"] for w in listed["workers"]] == [0]
        assert listed["expected_workers"] == 1

    load = await under_load(proxy, 30, resize)
    async with aiohttp.ClientSession() as http:
        for token in load.tokens:
            assert (await whoami(http, proxy.url, token))["slot"] == 0
    await wait_until(lambda: len(proxy.worker_pids()) == 1, 30, "one worker left")


async def test_drain_moves_a_thousand_sessions_and_takes_no_new_ones(in_process):
    proxy = await in_process(workers=2, control_token=CONTROL)
    async with aiohttp.ClientSession() as http:
        tokens = await asyncio.gather(*(seed(http, proxy.url) for _ in range(1000)))
        for i, token in enumerate(tokens[:50]):
            async with http.post(
                f"{proxy.url}/increment_counter", json={"count": i}, headers={TOKEN_HEADER: token}
            ) as response:
                assert response.status == 200
        on_zero = [t for t in tokens if (await whoami(http, proxy.url, t))["slot"] == 0]
        assert 300 < len(on_zero) < 700
        status, reply = await operate(http, proxy.url, "drain", slot=0)
        assert status == 200 and reply["complete"], reply
        assert reply["moved"] == len(on_zero) and reply["failed"] == [], reply
        for token in tokens:
            assert (await whoami(http, proxy.url, token))["slot"] == 1
        for i, token in enumerate(tokens[:50]):
            assert await count(http, proxy.url, token) == i
        fresh = [await seed(http, proxy.url) for _ in range(10)]
        assert {(await whoami(http, proxy.url, t))["slot"] for t in fresh} == {1}
        listed = await status_of(http, proxy.url)
        states = {w["slot"]: w["state"] for w in listed["workers"]}
        assert states == {0: "draining", 1: "ready"}, listed["workers"]
        status, reply = await operate(http, proxy.url, "undrain", slot=0)
        assert status == 200, reply
        fresh = [await seed(http, proxy.url) for _ in range(10)]
        assert 0 in {(await whoami(http, proxy.url, t))["slot"] for t in fresh}


async def test_a_shrink_after_a_drain_keeps_a_worker_taking_sessions(in_process):
    """Drain slot 0, then resize to one worker: refused (it would remove slot 1, the only
    worker taking sessions), nothing changes, and new sessions still reach slot 1; once
    slot 0 is undrained the same resize runs."""
    proxy = await in_process(workers=2, control_token=CONTROL)
    async with aiohttp.ClientSession() as http:
        status, reply = await operate(http, proxy.url, "drain", slot=0)
        assert status == 200 and reply["complete"], reply
        status, reply = await operate(http, proxy.url, "resize", workers=1)
        assert status == 400 and reply["error"]["code"] == "invalid_request", reply
        assert reply["error"]["detail"] == (
            "resizing to 1 worker would leave no worker taking new sessions "
            "(slot 0 is draining: undrain it first)"
        ), reply
        assert (await status_of(http, proxy.url))["expected_workers"] == 2
        fresh = [await seed(http, proxy.url) for _ in range(4)]
        assert {(await whoami(http, proxy.url, t))["slot"] for t in fresh} == {1}
        status, reply = await operate(http, proxy.url, "undrain", slot=0)
        assert status == 200, reply
        status, reply = await operate(http, proxy.url, "resize", workers=1)
        assert status == 200 and reply["complete"] and reply["workers"] == 1, reply
        for token in [*fresh, await seed(http, proxy.url)]:
            assert (await whoami(http, proxy.url, token))["slot"] == 0


async def test_status_lists_each_worker_once_with_its_state(in_process):
    """`status` has one list of workers: each registered worker, with the checkpoint
    fields and the operations' state and count; `operations` lists none again."""
    proxy = await in_process(workers=2, control_token=CONTROL)
    async with aiohttp.ClientSession() as http:
        await whoami(http, proxy.url, await seed(http, proxy.url))
        status = await status_of(http, proxy.url)
    assert sorted(status["operations"]) == ["last", "running"], status["operations"]
    fields = {"slot", "owner", "pid", "in_flight", "ready", "state", "requests_served", "node",
              "address", "load", "memory_bytes", "restarts", "sessions"}  # fmt: skip
    assert [sorted(w) for w in status["workers"]] == [sorted(fields)] * 2, status["workers"]
    load = {"busy_average", "answer_s", "loop_delay_s", "stalled"}  # None before its first look
    assert all(w["load"] is None or set(w["load"]) == load for w in status["workers"]), status
    assert status["rebalance"] == {"acting": False, "stalled_slots": [], "recent": []}
    assert {w["node"] for w in status["workers"]} == {"local"}
    assert all(w["address"].endswith(".sock") for w in status["workers"]), status["workers"]
    assert [(w["slot"], w["state"]) for w in status["workers"]] == [(0, "ready"), (1, "ready")]
    assert sum(w["requests_served"] for w in status["workers"]) == 2, status["workers"]


async def test_a_worker_is_recycled_after_max_requests(in_process):
    proxy = await in_process(
        "--max-requests", "150", "--max-requests-jitter", "20", workers=2, control_token=CONTROL
    )
    before = set(proxy.worker_pids())

    async def recycled(http: aiohttp.ClientSession, load: Load) -> None:
        await wait_until(
            lambda: len(set(proxy.worker_pids()) - before) >= 2, 60, "both workers recycled"
        )

        async def last_is_recycle() -> bool:
            last = (await status_of(http, proxy.url))["operations"]["last"]
            return last is not None and last["reason"].startswith("recycle: served")

        await wait_until(last_is_recycle, 30, "a recycle in status")

    await under_load(proxy, 20, recycled)


async def test_signals_restart_grow_and_shrink(start_proxy):
    """TTIN, TTOU and HUP under load; each signal taken logs one line saying what it
    does, and a TTOU that would leave no worker taking sessions logs why it did not run."""
    proxy = start_proxy(workers=2, control_token=CONTROL)

    async def signals(http: aiohttp.ClientSession, load: Load) -> None:
        before = set(proxy.worker_pids())
        proxy.signal(signal.SIGTTIN)
        await wait_until(lambda: len(proxy.worker_pids()) == 3, 30, "a third worker")
        proxy.signal(signal.SIGTTOU)
        await wait_until(lambda: len(proxy.worker_pids()) == 2, 30, "back to two workers")
        kept = set(proxy.worker_pids())
        proxy.signal(signal.SIGHUP)
        await wait_until(
            lambda: len(proxy.worker_pids()) == 2 and not set(proxy.worker_pids()) & kept,
            60,
            "both workers replaced",
        )
        assert not set(proxy.worker_pids()) & before
        status, reply = await operate(http, proxy.url, "drain", slot=0, timeout_s=30)
        assert status == 200 and reply["complete"], reply
        proxy.signal(signal.SIGTTOU)
        await wait_until(lambda: "SIGTTOU not run" in proxy.log(), 30, "the TTOU refused")
        assert len(proxy.worker_pids()) == 2

    await under_load(proxy, 20, signals)
    taken = [line.split(" gym-proxy ")[-1] for line in proxy.log().splitlines() if " SIG" in line]
    assert taken == [
        "INFO SIGTTIN: resizing 2 -> 3 workers",
        "INFO SIGTTOU: resizing 3 -> 2 workers",
        "INFO SIGHUP: rolling restart of 2 workers",
        "WARNING SIGTTOU not run: resizing to 1 worker would leave no worker taking new "
        "sessions (slot 0 is draining: undrain it first)",
    ], taken


async def test_operations_and_checkpoints_exclude_each_other(in_process, tmp_path):
    proxy = await in_process(workers=2, control_token=CONTROL)
    async with aiohttp.ClientSession() as http:
        control = Control(http, proxy.url)
        await control.ok("prepare", checkpoint_id="ck-op")
        for name, body in (("restart", {}), ("resize", {"workers": 3}), ("drain", {"slot": 0})):
            status, reply = await operate(http, proxy.url, name, **body)
            assert status == 409 and reply["error"]["code"] == "operation_conflict", reply
            assert "ck-op is open" in reply["error"]["detail"]
        await control.ok("resume", checkpoint_id="ck-op")
        token = await seed(http, proxy.url)
        slow = asyncio.ensure_future(
            http.get(f"{proxy.url}/slow?seconds=2", headers={TOKEN_HEADER: token})
        )
        # Running before the drain starts, so that the drain waits for it.
        await wait_until(lambda: app_saw(http, proxy.url, token, "/slow"), 10, "/slow to run")

        async def running() -> bool:
            return (await status_of(http, proxy.url))["operations"]["running"] is not None

        drain = asyncio.ensure_future(operate(http, proxy.url, "drain", slot=0, timeout_s=5))
        await wait_until(running, 10, "the drain to run")
        status, reply = await control.call("prepare", checkpoint_id="ck-op2")
        assert status == 409 and reply["error"]["code"] == "operation_conflict", reply
        status, reply = await operate(http, proxy.url, "restart")
        assert status == 409 and "a drain is running" in reply["error"]["detail"], reply
        status, reply = await drain
        assert status == 200, reply
        async with await slow as response:
            assert response.status == 200
        await control.ok("prepare", checkpoint_id="ck-op3")
        await control.ok("resume", checkpoint_id="ck-op3")


@pytest.mark.parametrize(
    ("name", "body", "detail"),
    [
        ("drain", {}, "slot must be a worker slot"),
        ("drain", {"slot": 7}, "no live worker in slot 7"),
        ("drain", {"slot": 0, "timeout_s": -1}, "timeout_s must be"),
        ("undrain", {"slot": "0"}, "slot must be a worker slot"),
        ("restart", {"slots": []}, "slots must be a non-empty list"),
        ("restart", {"slots": [5]}, "no live worker in slot 5"),
        ("resize", {"workers": 0}, "workers must be an integer"),
        ("resize", {"workers": 2, "extra": True}, "unknown fields: extra"),
    ],
)
async def test_bad_operation_calls_are_refused_with_what_is_wrong(shared_proxy, name, body, detail):
    """A refused call changes nothing, so the cases share one gym-proxy."""
    proxy = shared_proxy(workers=2, control_token=CONTROL)
    async with aiohttp.ClientSession() as http:
        status, reply = await operate(http, proxy.url, name, **body)
        assert status == 400 and reply["error"]["code"] == "invalid_request", reply
        assert detail in reply["error"]["detail"], reply
        async with http.post(f"{proxy.url}{WORKERS}/drain", json={"slot": 0}) as response:
            assert response.status == 401


async def test_a_restore_onto_a_resized_server_places_every_session(start_proxy, tmp_path):
    """A checkpoint of 2 workers, taken after a rolling restart; after kill -9, a fresh
    server grown to 3 workers live restores it: every committed count, over all three."""
    first = start_proxy(workers=2, control_token=CONTROL)
    async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as http:
        tokens = [await seed(http, first.url) for _ in range(30)]
        for i, token in enumerate(tokens):
            async with http.post(
                f"{first.url}/increment_counter", json={"count": i}, headers={TOKEN_HEADER: token}
            ) as response:
                assert response.status == 200
        status, reply = await operate(http, first.url, "restart")
        assert status == 200 and reply["complete"], reply
        control = Control(http, first.url)
        await control.checkpoint("ck-resized", str(tmp_path))
        # `status` (and its page) says the last commit: which, when, how many records
        done = (await control.ok("status"))["last_commit"]
        assert (done["checkpoint_id"], done["records"]) == ("ck-resized", 30), done
        first.kill_all()

        second = start_proxy(workers=2, control_token=CONTROL)
        status, reply = await operate(http, second.url, "resize", workers=3)
        assert status == 200 and reply["complete"], reply
        control = Control(http, second.url)
        await control.ok(
            "restore", checkpoint_id="rs", checkpoint_dir=str(tmp_path), episode_ids=[]
        )
        await control.ok("resume", checkpoint_id="rs")
        done = (await control.ok("status"))["last_restore"]
        assert (done["checkpoint_id"], done["records"]) == ("ck-resized", 30), done
        for i, token in enumerate(tokens):
            assert await count(http, second.url, token) == i
        slots = {(await whoami(http, second.url, t))["slot"] for t in tokens}
        assert slots <= {0, 1, 2} and len(slots) >= 2, slots
        # the restored sessions move like any other: drain slot 0 of the restored server
        status, reply = await operate(http, second.url, "drain", slot=0)
        assert status == 200 and reply["complete"] and reply["moved"] >= 1, reply
        for i, token in enumerate(tokens):
            assert await count(http, second.url, token) == i
            assert (await whoami(http, second.url, token))["slot"] in (1, 2)


async def test_a_replacement_that_cannot_boot_aborts_the_restart(in_process, tmp_path, monkeypatch):
    """The first replacement fails to build the app: the restart stops there, reports
    it, and every old worker keeps serving its sessions; the server does not stop."""
    broken = tmp_path / "broken"
    monkeypatch.setenv("GYM_TEST_BROKEN_FILE", str(broken))  # read as a worker builds the app
    proxy = await in_process(workers=2, control_token=CONTROL)
    before = sorted(proxy.worker_pids())
    async with aiohttp.ClientSession() as http:
        tokens = [await seed(http, proxy.url) for _ in range(10)]
        broken.touch()
        status, reply = await operate(http, proxy.url, "restart", timeout_s=10)
        assert status == 200 and not reply["complete"], reply
        assert [s["outcome"] for s in reply["slots"]] == ["kept: the replacement did not boot"]
        assert "the restart stopped here" in reply["errors"][0], reply
        assert sorted(proxy.worker_pids()) == before
        for token in tokens:
            assert await count(http, proxy.url, token) == 0
        broken.unlink()
        status, reply = await operate(http, proxy.url, "restart", timeout_s=10)
        assert status == 200 and reply["complete"], reply
        for token in tokens:
            assert await count(http, proxy.url, token) == 0
    assert not set(proxy.worker_pids()) & set(before)


async def test_a_long_request_leaves_the_old_worker_serving_until_it_ends(in_process):
    """A request outlives the restart's timeout: its slot gets its replacement, the old
    worker finishes the request (state leaving), and is retired in the background after:
    the session then answers from the replacement, its count exact."""
    proxy = await in_process(workers=1, control_token=CONTROL)
    old = proxy.worker_pids()
    async with aiohttp.ClientSession() as http:
        busy, idle = await seed(http, proxy.url), await seed(http, proxy.url)
        slow = asyncio.ensure_future(
            http.get(f"{proxy.url}/slow?seconds=3", headers={TOKEN_HEADER: busy})
        )

        async def running() -> bool:
            return (await status_of(http, proxy.url))["workers"][0]["in_flight"] == 1

        await wait_until(running, 10, "the slow request to run")
        status, reply = await operate(http, proxy.url, "restart", timeout_s=0.5)
        assert status == 200 and not reply["complete"], reply
        (slot,) = reply["slots"]
        assert slot["outcome"] == "left serving what it holds; decommissioned when it can be", slot
        assert slot["sessions_left"] == 1 and reply["moved"] == 1, reply
        states = {w["pid"]: w["state"] for w in (await status_of(http, proxy.url))["workers"]}
        assert states[old[0]] == "leaving" and list(states.values()).count("ready") == 1, states
        assert (await whoami(http, proxy.url, idle))["owner"] == slot["new_owner"]
        async with await slow as response:
            assert response.status == 200
        await wait_until(lambda: old[0] not in proxy.worker_pids(), 30, "the old worker to stop")
        assert (await whoami(http, proxy.url, busy))["owner"] == slot["new_owner"]
        assert await count(http, proxy.url, busy) == 0


async def test_restart_pause_is_checked_and_spaces_the_slots(in_process):
    """pause_s outside 0-600 is refused; with a pause the slots are restarted apart."""
    proxy = await in_process(workers=2, control_token=CONTROL)
    async with aiohttp.ClientSession() as http:
        status, reply = await operate(http, proxy.url, "restart", pause_s=-1)
        assert status == 400 and "pause_s must be" in reply["error"]["detail"], reply
        status, reply = await operate(http, proxy.url, "restart", pause_s=0.5)
        assert status == 200 and reply["complete"], reply
        assert reply["seconds"] >= 0.5, reply
        # An ended operation's answer is at `done` (issue 56: it kept its last running step).
        assert (reply["step"], reply["detail"], reply["step_slot"]) == ("done", "", None), reply
        status, reply = await operate(http, proxy.url, "restart", slots=[1], pause_s=30)
        assert status == 200 and reply["seconds"] < 30, reply  # one slot: nothing to wait for


async def test_a_worker_over_the_memory_ceiling_is_recycled(start_proxy):
    """--max-worker-memory below any worker's RSS: the supervisor says the ceiling is
    below a fresh worker's, and recycles each worker once it has lived 10 s (a rolling
    restart of that slot, not a restart a second); the session keeps its count."""
    proxy = start_proxy("--max-worker-memory", "1", workers=1, control_token=CONTROL)
    before = set(proxy.worker_pids())
    async with aiohttp.ClientSession() as http:
        token = await seed(http, proxy.url)

        async def recycled() -> bool:
            last = (await status_of(http, proxy.url))["operations"]["last"]
            return last is not None and last["reason"].startswith("recycle: resident memory")

        await wait_until(recycled, 40, "a recycle for memory")
        assert "is below a fresh worker's resident memory" in proxy.log()
        await wait_until(
            lambda: not set(proxy.worker_pids()) & before, 30, "the first worker replaced"
        )
        assert await count(http, proxy.url, token) == 0  # recycles go on: it moves each time


async def test_a_drain_sends_no_session_to_a_worker_that_does_not_answer(start_proxy):
    """Worker 2 is SIGSTOPped (its pings go unanswered): a drain of slot 0 moves every
    session to worker 1, none to the silent one."""
    proxy = start_proxy(workers=3, control_token=CONTROL)
    async with aiohttp.ClientSession() as http:
        tokens = [await seed(http, proxy.url) for _ in range(30)]
        on_zero = [t for t in tokens if (await whoami(http, proxy.url, t))["slot"] == 0]
        silent = next(
            w["pid"] for w in (await status_of(http, proxy.url))["workers"] if w["slot"] == 2
        )
        os.kill(silent, signal.SIGSTOP)
        try:

            async def unresponsive() -> bool:
                states = (await status_of(http, proxy.url))["workers"]
                return any(w["slot"] == 2 and w["state"] == "unresponsive" for w in states)

            await wait_until(unresponsive, 20, "worker 2 to be unresponsive")
            status, reply = await operate(http, proxy.url, "drain", slot=0, timeout_s=10)
            assert status == 200 and reply["complete"], reply
            assert reply["moved"] == len(on_zero), reply
            for token in on_zero:
                assert (await whoami(http, proxy.url, token))["slot"] == 1
        finally:
            os.kill(silent, signal.SIGCONT)


async def test_gym_proxy_ctl_runs_the_operations(start_proxy):
    """`gym-proxy-ctl drain/undrain/restart/resize` print the operation's report."""
    proxy = start_proxy(workers=2, control_token=CONTROL)

    async def ctl(*words: str) -> dict:
        command = [
            sys.executable, "-c", CTL_MAIN,
            "--server", proxy.url, "--token", CONTROL, "--timeout", "30", *words,
        ]  # fmt: skip
        done = await asyncio.create_subprocess_exec(*command, stdout=asyncio.subprocess.PIPE)
        out, _ = await asyncio.wait_for(done.communicate(), 60)
        assert done.returncode == 0, out
        return orjson.loads(out)

    async with aiohttp.ClientSession() as http:
        token = await seed(http, proxy.url)
        reply = await ctl("resize", "3")
        assert reply["operation"] == "resize" and reply["workers"] == 3, reply
        reply = await ctl("drain", "0")
        assert reply["operation"] == "drain" and reply["slots"][0]["draining"], reply
        reply = await ctl("undrain", "0")
        assert reply["slots"] == [
            {"slot": 0, "owner": reply["slots"][0]["owner"], "draining": False}
        ]
        reply = await ctl("restart", "--slot", "2", "--slot", "1", "--pause", "0")
        assert [s["slot"] for s in reply["slots"]] == [2, 1] and reply["complete"], reply
        assert await count(http, proxy.url, token) == 0
