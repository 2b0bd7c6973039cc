"""The autoscaler's resizes give way to a checkpoint (in process): a prepare that comes
while it empties its last worker, or while the worker it adds boots, is not refused;
the resize stops with the worker count it had (what moved stays moved, the booting worker
is stopped), says it gave way, and is made again after the resume, every count exact. An
operator's resize still refuses the prepare, 409, as before."""

from __future__ import annotations

import asyncio
import time

import aiohttp

from tests import apps
from tests.support import CONTROL_TOKEN, Control, wait_until
from tests.test_live_operations import TOKEN_HEADER, count, operate, seed, status_of, whoami
from tests.test_metrics import metrics_url
from tests.test_rebalance import increment, metric, session_of, sessions_by_slot

APP = "tests.apps:create_app"
GAVE_WAY = (
    "gym_proxy_autoscale_skipped_total{why=\"it gave way to a checkpoint or an operator's "
    'operation"}'
)


async def slow(http: aiohttp.ClientSession, url: str, token: str, seconds: float) -> int:
    async with http.get(f"{url}/slow?seconds={seconds}", headers={TOKEN_HEADER: token}) as reply:
        return reply.status


def running_operation(status: dict) -> dict | None:
    return status["operations"]["running"]


async def test_a_checkpoint_that_comes_while_the_autoscaler_shrinks_is_not_refused(
    in_process, http
):
    """Every worker under --scale-down-busy: the autoscaler empties slot 1, whose busy
    session's move waits for its request. The prepare that comes then is not refused:
    the shrink gives way (slot 1 keeps its worker and its busy session, the idle ones it
    moved stay moved), the checkpoint prepares once the request ended, and after the
    resume the same shrink is made, every count exact."""
    proxy = await in_process(
        "--min-workers", "1", "--max-workers", "2", "--scale-down-busy", "2",
        "--scale-down-after", "2", "--metrics", "127.0.0.1:0",
        workers=2, control_token=CONTROL_TOKEN, app=APP,
    )  # fmt: skip
    on_1, on_0 = await sessions_by_slot(http, proxy.url, 3, on=1)
    tokens = on_1 + on_0
    for i, token in enumerate(tokens):
        await increment(http, proxy.url, token, i)
    busy, *idle = on_1
    owner_1 = (await whoami(http, proxy.url, busy))["owner"]
    request = asyncio.ensure_future(slow(http, proxy.url, busy, 5))

    async def shrinking() -> bool:
        running = running_operation(await status_of(http, proxy.url))
        return running is not None and running["reason"] == "autoscale"

    await wait_until(shrinking, 10, "the autoscaler to shrink")
    control = Control(http, proxy.url)
    started = time.monotonic()
    status, reply = await control.call("prepare", checkpoint_id="ck")
    assert status == 200 and reply["phase"] == "prepared", reply
    assert time.monotonic() - started < 10  # it waited for the request, not for a shrink
    during = await status_of(http, proxy.url)
    assert during["expected_workers"] == 2 and len(during["workers"]) == 2
    assert await metric(http, metrics_url(proxy), GAVE_WAY) == 1
    shrink = during["operations"]["last"]  # the idle sessions moved, the busy one stayed
    assert shrink["reason"] == "autoscale" and shrink["moved"] == len(idle), shrink
    (kept,) = shrink["failed"]
    assert kept["session_id"] == session_of(busy) and "gave way" in kept["reason"]
    assert shrink["slots"] == [
        {"slot": 1, "removed": False, "owner": owner_1, "outcome": "kept: it serves on in its slot"}
    ], shrink
    await control.ok("resume", checkpoint_id="ck")
    assert await request == 200

    async def one_worker() -> bool:
        return len((await status_of(http, proxy.url))["workers"]) == 1

    await wait_until(one_worker, 20, "the shrink made again after the resume")
    assert [await count(http, proxy.url, t) for t in tokens] == list(range(len(tokens)))
    url = metrics_url(proxy)
    assert await metric(http, url, 'gym_proxy_autoscale_total{direction="down"}') == 1


async def test_a_checkpoint_that_comes_while_the_autoscaler_grows_is_not_refused(
    in_process, http, monkeypatch
):
    """One worker busy past --scale-up-busy: the autoscaler adds one, whose boot waits
    (`tests.apps.boot_gate`). The prepare that comes then is not refused: the grow gives
    way (the booting worker is stopped and its slot removed: one worker, as before), the
    checkpoint prepares, and after the resume the grow is made again."""
    proxy = await in_process(
        "--min-workers", "1", "--max-workers", "2", "--scale-up-busy", "2",
        "--scale-up-after", "1", "--metrics", "127.0.0.1:0",
        workers=1, control_token=CONTROL_TOKEN, app="tests.apps:create_app_once_let_in",
    )  # fmt: skip
    gate = asyncio.Event()
    monkeypatch.setattr(apps, "boot_gate", gate)
    token = await seed(http, proxy.url)
    stop = asyncio.Event()

    async def load() -> None:  # short calls back to back: a checkpoint waits for none long
        while not stop.is_set():
            assert await slow(http, proxy.url, token, 0.2) == 200

    loads = [asyncio.ensure_future(load()) for _ in range(4)]
    try:

        async def growing() -> bool:
            running = running_operation(await status_of(http, proxy.url))
            return running is not None and running["step"] == "starting_worker"

        await wait_until(growing, 15, "the autoscaler to start a worker")
        booting = proxy.launcher.started[-1]
        control = Control(http, proxy.url)
        status, reply = await control.call("prepare", checkpoint_id="ck")
        assert status == 200 and reply["phase"] == "prepared", reply
        during = await status_of(http, proxy.url)
        assert during["expected_workers"] == 1 and len(during["workers"]) == 1
        assert booting.returncode is not None  # stopped as it booted
        assert await metric(http, metrics_url(proxy), GAVE_WAY) == 1
        await control.ok("resume", checkpoint_id="ck")
        gate.set()

        async def two_workers() -> bool:
            return len((await status_of(http, proxy.url))["workers"]) == 2

        await wait_until(two_workers, 20, "the grow made again after the resume")
    finally:
        stop.set()
        await asyncio.gather(*loads)
    url = metrics_url(proxy)
    assert await metric(http, url, 'gym_proxy_autoscale_total{direction="up"}') == 1


async def test_an_operators_resize_still_refuses_a_checkpoint(in_process, http):
    proxy = await in_process(workers=2, control_token=CONTROL_TOKEN, app=APP)
    (busy,), _ = await sessions_by_slot(http, proxy.url, 1, on=1)
    request = asyncio.ensure_future(slow(http, proxy.url, busy, 3))
    resize = asyncio.ensure_future(operate(http, proxy.url, "resize", workers=1, timeout_s=20))

    async def resizing() -> bool:
        return running_operation(await status_of(http, proxy.url)) is not None

    await wait_until(resizing, 10, "the operator's resize to run")
    status, reply = await Control(http, proxy.url).call("prepare", checkpoint_id="ck")
    assert status == 409 and reply["error"]["code"] == "operation_conflict", reply
    assert "a resize is running" in reply["error"]["detail"]
    assert await request == 200
    status, answer = await resize
    assert status == 200 and answer["complete"] and answer["workers"] == 1, answer
