"""`--rebalance` with real workers: a hot worker (in process) and a stalled one (real
processes: a handler that blocks its event loop) shed their idle sessions to the other
worker and keep their busy one, every count exact; a stalled worker gets no new
sessions; an even load moves nothing; a session that keeps its worker hot stays there,
idle between its calls or not, and nothing flaps; a checkpoint waits for no rebalance
and none runs while it is open."""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator

import aiohttp
import pytest

from tests.support import CONTROL_TOKEN, Control, wait_until
from tests.test_live_operations import TOKEN_HEADER, count, seed, status_of, whoami
from tests.test_metrics import metrics_url

APP = "tests.apps:create_app"


async def increment(http: aiohttp.ClientSession, url: str, token: str, by: int) -> None:
    async with http.post(
        f"{url}/increment_counter", json={"count": by}, headers={TOKEN_HEADER: token}
    ) as response:
        assert response.status == 200, await response.text()


async def sessions_by_slot(
    http: aiohttp.ClientSession, url: str, wanted: int, on: int = 0
) -> tuple[list[str], list[str]]:
    """Seed sessions until `wanted` are on slot `on`: (those, the others)."""
    mine: list[str] = []
    others: list[str] = []
    while len(mine) < wanted:
        token = await seed(http, url)
        (mine if (await whoami(http, url, token))["slot"] == on else others).append(token)
    return mine, others


@contextlib.asynccontextmanager
async def stalling(http: aiohttp.ClientSession, url: str, token: str) -> AsyncIterator[None]:
    """While inside: the loop of `token`'s worker blocked 1.5 s at a time (`/block`), a
    few ms free between; every block answered 200."""
    stop = asyncio.Event()

    async def stall() -> None:
        while not stop.is_set():
            async with http.get(
                f"{url}/block?seconds=1.5", headers={TOKEN_HEADER: token}
            ) as response:
                assert response.status == 200

    staller = asyncio.ensure_future(stall())
    try:
        yield
    finally:
        stop.set()
        await staller


async def metric(http: aiohttp.ClientSession, url: str, name: str) -> float:
    async with http.get(url) as response:
        text = await response.text()
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


async def test_a_hot_worker_sheds_its_idle_sessions_and_keeps_its_busy_one(in_process, http):
    proxy = await in_process(
        "--rebalance", "--metrics", "127.0.0.1:0", workers=2, control_token=CONTROL_TOKEN, app=APP
    )
    light, _ = await sessions_by_slot(http, proxy.url, 6)
    for i, token in enumerate(light):
        await increment(http, proxy.url, token, i)
    heavy, *light = light
    headers = {TOKEN_HEADER: heavy}

    async def slow() -> int:
        async with http.get(f"{proxy.url}/slow?seconds=25", headers=headers) as response:
            return response.status

    # Four requests running on one session of slot 0, none on slot 1: hot after 3 s, and
    # busy for longer than the wait below may take (on a loaded machine the last light
    # session can go in a shed ten seconds after the first: the busy one must still run).
    running = [asyncio.ensure_future(slow()) for _ in range(4)]

    async def shed() -> bool:
        slots = [(await whoami(http, proxy.url, t))["slot"] for t in light]
        return slots == [1] * len(light)

    await wait_until(shed, 20, "the idle sessions to move to slot 1")
    assert (await whoami(http, proxy.url, heavy))["slot"] == 0  # busy: it stays
    assert [await count(http, proxy.url, t) for t in light] == [1, 2, 3, 4, 5]
    moved = 'gym_proxy_rebalance_sessions_moved_total{reason="hot"}'
    assert await metric(http, metrics_url(proxy), moved) == len(light)
    assert await asyncio.gather(*running) == [200] * 4


async def test_an_even_load_moves_nothing(in_process, http):
    proxy = await in_process(
        "--rebalance", "--metrics", "127.0.0.1:0", workers=2, control_token=CONTROL_TOKEN, app=APP
    )
    on_0, on_1 = await sessions_by_slot(http, proxy.url, 3)
    on_1 += (await sessions_by_slot(http, proxy.url, 3, on=1))[0]
    where = {t: (await whoami(http, proxy.url, t))["slot"] for t in on_0 + on_1}

    async def slow(token: str) -> int:
        async with http.get(
            f"{proxy.url}/slow?seconds=7", headers={TOKEN_HEADER: token}
        ) as response:
            return response.status

    # Three requests on each worker for 7 s: each past the 2 a hot one needs, for the
    # 3 s it needs, but evenly.
    codes = await asyncio.gather(*(slow(t) for t in (*on_0, *on_1[:3])))
    assert codes == [200] * 6
    assert {t: (await whoami(http, proxy.url, t))["slot"] for t in where} == where
    assert await metric(http, metrics_url(proxy), "gym_proxy_sessions_moved_total") == 0


@pytest.mark.parametrize("test_app", [APP], indirect=True)
async def test_a_stalled_worker_gets_no_new_sessions_and_sheds_its_idle_ones(start_proxy, http):
    proxy = start_proxy(
        "--rebalance", "--stall-threshold", "0.5", "--metrics", "127.0.0.1:0",
        workers=2, control_token=CONTROL_TOKEN,
    )  # fmt: skip
    light, _ = await sessions_by_slot(http, proxy.url, 5)
    for i, token in enumerate(light):
        await increment(http, proxy.url, token, i)
    heavy, *light = light
    owner = (await whoami(http, proxy.url, heavy))["owner"]
    flag = f'gym_proxy_worker_stalled{{owner="{owner}",slot="0"}}'
    async with stalling(http, proxy.url, heavy):

        async def stalled() -> bool:
            return await metric(http, metrics_url(proxy), flag) == 1

        await wait_until(stalled, 20, "slot 0 to be taken as stalled")
        fresh = [await seed(http, proxy.url) for _ in range(4)]
        assert [(await whoami(http, proxy.url, t))["slot"] for t in fresh] == [1] * 4

        moved = 'gym_proxy_rebalance_sessions_moved_total{reason="stalled"}'

        async def shed() -> bool:  # asked of /metrics: a request of theirs would busy them
            return await metric(http, metrics_url(proxy), moved) == len(light)

        await wait_until(shed, 30, "the stalled worker's idle sessions to move")
    assert [(await whoami(http, proxy.url, t))["slot"] for t in light] == [1] * len(light)
    assert [await count(http, proxy.url, t) for t in light] == [1, 2, 3, 4]
    assert (await whoami(http, proxy.url, heavy))["slot"] == 0
    reason = 'gym_proxy_rebalances_total{reason="stalled"}'
    assert await metric(http, metrics_url(proxy), reason) >= 1
    # `status` names each move: the light sessions, from slot 0 to slot 1's worker
    status = await Control(http, proxy.url).ok("status")
    rebalance = status["rebalance"]
    answer = {w["slot"]: w["load"]["answer_s"] for w in status["workers"]}
    assert answer[0] > 0.5 and answer[1] < 0.5, answer  # 1.5 s blocks; quick calls
    assert rebalance["acting"] is True
    ids = {(await whoami(http, proxy.url, t))["session_id"] for t in light}
    target = (await whoami(http, proxy.url, light[0]))["owner"]
    moves = {sid: to for event in rebalance["recent"] for sid, to in event["moved"].items()}
    assert moves == dict.fromkeys(ids, target), rebalance
    assert {(e["slot"], e["owner"], e["reason"]) for e in rebalance["recent"]} == {
        (0, owner, "stalled")
    }


async def test_no_rebalance_while_a_checkpoint_is_open(in_process, http):
    """A worker hot while a checkpoint is open (its prepare waits for the requests to
    end): the rebalance skips, says why, and moves nothing."""
    proxy = await in_process(
        "--rebalance", "--metrics", "127.0.0.1:0", workers=2, control_token=CONTROL_TOKEN, app=APP
    )
    light, _ = await sessions_by_slot(http, proxy.url, 4)
    heavy, *light = light

    async def slow() -> int:
        async with http.get(
            f"{proxy.url}/slow?seconds=8", headers={TOKEN_HEADER: heavy}
        ) as response:
            return response.status

    running = [asyncio.ensure_future(slow()) for _ in range(4)]
    in_flight = 'gym_proxy_worker_requests_in_flight{slot="0"}'

    async def started() -> bool:
        return await metric(http, metrics_url(proxy), in_flight) == 4

    await wait_until(started, 10, "the four requests to run")
    control = Control(http, proxy.url)
    prepare = asyncio.ensure_future(control.ok("prepare", checkpoint_id="ck"))
    skipped = 'gym_proxy_rebalance_skipped_total{why="a checkpoint is open"}'

    async def said() -> bool:
        return await metric(http, metrics_url(proxy), skipped) >= 1

    await wait_until(said, 20, "the rebalance to say it skipped")
    assert await metric(http, metrics_url(proxy), "gym_proxy_sessions_moved_total") == 0
    assert await asyncio.gather(*running) == [200] * 4
    assert (await prepare)["phase"] == "prepared"
    await control.ok("resume", checkpoint_id="ck")
    assert [(await whoami(http, proxy.url, t))["slot"] for t in light] == [0] * len(light)


async def test_the_worker_count_follows_demand_within_its_bounds(in_process, http):
    """One worker, busy past --scale-up-busy for --scale-up-after: a second starts (not a
    third: --max-workers 2); new sessions go to it; once idle for --scale-down-after,
    it is drained away, its sessions moved, every count exact."""
    proxy = await in_process(
        "--min-workers", "1", "--max-workers", "2", "--scale-up-busy", "2",
        "--scale-up-after", "1", "--scale-down-after", "2", "--metrics", "127.0.0.1:0",
        workers=1, control_token=CONTROL_TOKEN, app=APP,
    )  # fmt: skip
    first = [await seed(http, proxy.url) for _ in range(3)]

    async def slow() -> int:
        async with http.get(
            f"{proxy.url}/slow?seconds=5", headers={TOKEN_HEADER: first[0]}
        ) as response:
            return response.status

    running = [asyncio.ensure_future(slow()) for _ in range(4)]

    async def workers(n: int) -> bool:
        return len((await status_of(http, proxy.url))["workers"]) == n

    await wait_until(lambda: workers(2), 20, "a second worker")
    later = [await seed(http, proxy.url) for _ in range(3)]
    assert {(await whoami(http, proxy.url, t))["slot"] for t in later} == {1}
    for i, token in enumerate(first + later):
        await increment(http, proxy.url, token, i)
    assert await asyncio.gather(*running) == [200] * 4
    await wait_until(lambda: workers(1), 30, "the count back to one worker")
    assert [await count(http, proxy.url, t) for t in first + later] == list(range(6))
    url = metrics_url(proxy)
    assert await metric(http, url, 'gym_proxy_autoscale_total{direction="up"}') == 1
    assert await metric(http, url, 'gym_proxy_autoscale_total{direction="down"}') == 1
    # `status` (and the status page) says the bounds and the latest decision
    autoscale = (await status_of(http, proxy.url))["autoscale"]
    assert (autoscale["least"], autoscale["most"]) == (1, 2), autoscale
    last = autoscale["last"]
    assert (last["workers_from"], last["workers_to"], last["outcome"]) == (2, 1, "made"), last
    assert "requests" in last["why"], last


def session_of(token: str) -> str:
    """The session a token names (`v2.<instance>.<session>.<owner>.<mac>`)."""
    return token.split(".")[2]


@pytest.mark.parametrize("test_app", [APP], indirect=True)
async def test_a_session_that_keeps_its_worker_hot_stays_and_nothing_flaps(start_proxy, http):
    """One client's calls block its worker's loop 0.3 s every 1.2 s: the worker is hot
    by its delay, and its session is idle at most looks. It carries the loop's delay, so
    it stays; the idle sessions beside it move, each once, and none comes back once the
    cool-down and the sustain have passed (before, the culprit went with them, its new
    worker turned hot, and every session was shed back, again and again)."""
    proxy = start_proxy(
        "--rebalance", "--rebalance-cooldown", "1", workers=2, control_token=CONTROL_TOKEN
    )
    mine, _ = await sessions_by_slot(http, proxy.url, 5)
    for i, token in enumerate(mine):
        await increment(http, proxy.url, token, i)
    culprit, *idle = mine
    stop = asyncio.Event()
    calls = [0]

    async def block_now_and_then() -> None:  # the client's load, not a wait of the test
        while not stop.is_set():
            async with http.get(
                f"{proxy.url}/block?seconds=0.3", headers={TOKEN_HEADER: culprit}
            ) as response:
                assert response.status == 200
            calls[0] += 1
            await asyncio.sleep(0.9)

    control = Control(http, proxy.url)

    async def moves() -> list[str]:
        recent = (await control.ok("status"))["rebalance"]["recent"]
        return [session for event in recent for session in event["moved"]]

    client = asyncio.ensure_future(block_now_and_then())
    try:

        async def shed() -> bool:  # asked of `status`: a call of theirs would busy them
            return set(await moves()) >= {session_of(t) for t in idle}

        await wait_until(shed, 20, "the idle sessions to move off the hot worker")
        # Past the cool-down (1 s) and the sustain (3 s) of the worker that took them.
        settled = calls[0] + 6
        await wait_until(lambda: calls[0] >= settled, 20, "six more blocking calls")
    finally:
        stop.set()
        await client
    moved = await moves()
    assert session_of(culprit) not in moved, moved
    assert sorted(moved) == sorted(session_of(t) for t in idle), moved  # each once
    status = await control.ok("status")
    assert {e["slot"] for e in status["rebalance"]["recent"]} == {0}
    assert (await whoami(http, proxy.url, culprit))["slot"] == 0
    assert [(await whoami(http, proxy.url, t))["slot"] for t in idle] == [1] * len(idle)
    assert [await count(http, proxy.url, t) for t in mine] == list(range(len(mine)))


async def test_the_default_apps_compute_route_shows_a_rebalance(start_proxy, http):
    """docs/operations.md's "Seeing it in a minute", with the default app (the counter)
    and the default thresholds: one session computing 1.5 s at a time stalls its worker;
    the other sessions there move to the other worker, their counts intact, and the
    status names each move. The sessions' workers are read from their tokens (the
    counter has no /whoami)."""
    proxy = start_proxy(
        "--rebalance",
        workers=2,
        control_token=CONTROL_TOKEN,
        app="gym_proxy.worker.counter:create_app",
    )
    control = Control(http, proxy.url)
    owners = {w["slot"]: w["owner"] for w in (await control.ok("status"))["workers"]}
    tokens = []
    for i in range(8):
        async with http.post(f"{proxy.url}/seed_session", json={"initial_count": i}) as resp:
            assert resp.status == 200
            tokens.append(resp.headers[TOKEN_HEADER])
    on_0 = [t for t in tokens if t.split(".")[3] == owners[0]]  # v2.<tag>.<session>.<owner>.<mac>
    assert len(on_0) >= 3, (owners, tokens)
    heavy, light = on_0[0], on_0[1:]
    stop = asyncio.Event()

    async def compute() -> None:
        while not stop.is_set():
            async with http.post(
                f"{proxy.url}/compute", json={"seconds": 1.5}, headers={TOKEN_HEADER: heavy}
            ) as resp:
                assert resp.status == 200, await resp.text()

    light_ids = {t.split(".")[2] for t in light}
    computing = asyncio.ensure_future(compute())
    try:

        async def moved() -> bool:
            recent = (await control.ok("status"))["rebalance"]["recent"]
            return light_ids <= {sid for event in recent for sid in event["moved"]}

        await wait_until(moved, 60, "the computing worker's idle sessions to move")
    finally:
        stop.set()
        await computing
    recent = (await control.ok("status"))["rebalance"]["recent"]
    assert {(e["slot"], e["reason"]) for e in recent} == {(0, "stalled")}, recent
    for token in light:
        async with http.post(f"{proxy.url}/get_counter_value", headers={TOKEN_HEADER: token}) as r:
            assert (await r.json())["count"] == tokens.index(token)
    assert "shed" in proxy.log() and "(stalled: event-loop lag" in proxy.log()
