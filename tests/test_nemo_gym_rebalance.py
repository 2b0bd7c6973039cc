"""`--rebalance` with NeMo Gym's own counter server (the released 0.7.0's
`StatefulCounterResourcesServer`, with `/block` added by `bench/skewed_nemo_gym.py`),
called as NeMo Gym's agents call it: by the cookies of the last response.

NeMo Gym keeps its own session IDs; the proxy counts a request's running under the
gym-proxy session that carried it. A rebalance that took one for the other would take a
session whose calls block its worker back to back for idle and move it with the others
(`bench/rebalance.py --app nemo_gym` saw it: the heavy sessions moved, their new workers
turned hot, sessions went back and forth). Here: the stalled worker sheds every light
session it holds and keeps its heavy one, whose calls all answer, though it pauses
between them (idle at many looks, it carries the loop's delay, charged by the worker to
NeMo Gym's own session ID); every count exact."""

from __future__ import annotations

import asyncio
import importlib.util
import re
from pathlib import Path
from types import ModuleType

import aiohttp
import pytest

pytest.importorskip("nemo_gym", reason="the NeMo Gym tier runs in tests/nemo_gym/install.sh's venv")

from tests.nemo_gym_stack import CounterClient  # noqa: E402
from tests.support import CONTROL_TOKEN, Control, wait_until  # noqa: E402
from tests.test_metrics import metrics_url  # noqa: E402

BENCH = Path(__file__).resolve().parent.parent / "bench"


def skewed_counter() -> ModuleType:
    """bench/skewed_nemo_gym.py: NeMo Gym's counter with `/block`, and its config."""
    spec = importlib.util.spec_from_file_location("skewed_nemo_gym", BENCH / "skewed_nemo_gym.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def sessions_held(http: aiohttp.ClientSession, url: str) -> dict[int, float]:
    """Each slot's sessions, as its worker's store holds them (`/metrics`)."""
    async with http.get(url) as response:
        text = await response.text()
    found = re.findall(r'^gym_proxy_worker_sessions\{slot="(\d+)"\} (\S+)$', text, re.M)
    return {int(slot): float(value) for slot, value in found}


async def test_a_stalled_worker_sheds_nemo_gym_sessions_and_keeps_the_busy_one(start_proxy):
    skewed_nemo_gym = skewed_counter()
    proxy = start_proxy(
        "--name", skewed_nemo_gym.INSTANCE, "--preload", "--boot-timeout", "180",
        "--session-state", skewed_nemo_gym.SESSION_STATE, "--app-dir", str(BENCH),
        "--rebalance", "--stall-threshold", "0.5", "--metrics", "127.0.0.1:0",
        workers=2, app="skewed_nemo_gym:SkewedCounter", env=skewed_nemo_gym.config_env(),
        control_token=CONTROL_TOKEN,
    )  # fmt: skip
    async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as http:
        clients = [CounterClient(http, proxy.url, task) for task in range(8)]
        for i, client in enumerate(clients):
            await client.seed(i)
        heavy, light = clients[0], clients[1:]
        for client in light:
            await client.post("/increment_counter", {"count": 1})
        metrics, control = metrics_url(proxy), Control(http, proxy.url)
        before = await sessions_held(http, metrics)
        assert sum(before.values()) == len(clients), before
        stop = asyncio.Event()
        blocks = 0

        async def stall() -> None:  # 1 s blocks, each followed by a second's pause
            nonlocal blocks
            while not stop.is_set():
                await heavy.post("/block?seconds=1.0", {})
                blocks += 1
                await asyncio.sleep(1.0)  # the client's pace, not a wait of the test

        staller = asyncio.ensure_future(stall())
        try:

            async def stalled_slots() -> list[int]:
                workers = (await control.ok("status"))["workers"]
                return [w["slot"] for w in workers if (w["load"] or {}).get("stalled")]

            stalled = await wait_until(stalled_slots, 30, "the heavy session's worker to stall")
            assert isinstance(stalled, list) and len(stalled) == 1, stalled
            slot = stalled[0]
            other = 1 - slot

            async def shed() -> bool:
                return (await sessions_held(http, metrics)).get(slot) == 1

            await wait_until(shed, 30, "the stalled worker to shed all but its busy session")
            # A source sheds again every 3 s while it stays stalled: after two more
            # rounds (four blocks and their pauses) it must still hold the heavy one.
            after = blocks
            await wait_until(lambda: blocks >= after + 4, 30, "four more blocks")

            async def both() -> dict[int, float]:  # a scrape in a block lacks its slot
                held = await sessions_held(http, metrics)
                return held if len(held) == 2 else {}

            held = await wait_until(both, 10, "a scrape that both workers answered")
            assert held == {slot: 1, other: len(clients) - 1}, held
        finally:
            stop.set()
            await staller
        recent = (await control.ok("status"))["rebalance"]["recent"]
        assert {e["slot"] for e in recent} == {slot}, recent
        assert not any(e["not_moved"] for e in recent), recent
        moved = sum(len(e["moved"]) for e in recent)
        assert moved == before[slot] - 1, (recent, before)
        assert [await c.count() for c in light] == [i + 1 for i in range(1, 8)]
        assert await heavy.count() == 0
