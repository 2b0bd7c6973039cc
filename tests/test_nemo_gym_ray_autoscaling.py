"""The worker count grows the Ray cluster (issue 55, item 2), on Ray's own autoscaling
test cluster: the head with Ray's autoscaler on its fake multi-node provider
(`tests/ray_nodes.py`, as `ray.cluster_utils.AutoscalingCluster`), room for one worker on
the head, and up to two more nodes of one CPU each that the autoscaler adds for pending
actors and removes once idle.

gym-proxy starts with one placed worker (`--min-workers 1 --max-workers 3`). Under load
(every worker past `--scale-up-busy`) its autoscaler grows: the new worker's actor does
not fit, waits pending (it is not refused), Ray's autoscaler adds a node for it, the
worker starts there and serves; twice, so three workers on three nodes. Once the load
stops, gym-proxy shrinks back to one (each removed worker's sessions moved) and Ray's
autoscaler removes the two idle nodes. Every call of the load answered 200, every count
exact, and no actor left but the first worker's. The time from the grow's decision to
the new node's worker serving is printed (bench/cluster_autoscale.py measures it)."""

from __future__ import annotations

import asyncio
import importlib.util
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

pytest.importorskip("nemo_gym", reason="the NeMo Gym tier runs in tests/nemo_gym/install.sh's venv")
for _module in ("ray", "grpc", "aiohttp_cors", "opencensus"):  # Ray, and its state API's
    if importlib.util.find_spec(_module) is None:
        pytest.skip(f"needs {_module} (tests/nemo_gym/install.sh)", allow_module_level=True)

from tests.ray_nodes import RayNodes, RayState  # noqa: E402
from tests.support import CONTROL_TOKEN, wait_until  # noqa: E402
from tests.test_live_operations import TOKEN_HEADER, count, operate, seed, status_of  # noqa: E402

pytestmark = pytest.mark.timeout(420)

NODE = {"resources": {"CPU": 1, "object_store_memory": 100 * 2**20}, "max_workers": 2}
HOST_CLASS = "RayWorkerHost"


class Cluster:
    def __init__(self, nodes: RayNodes, state: RayState) -> None:
        self.nodes, self.state = nodes, state

    def alive_nodes(self) -> list[str]:
        return [n["node_id"] for n in self.state.ask("nodes") if n["state"] == "ALIVE"]

    def alive_actors(self) -> list[dict[str, Any]]:
        return [a for a in self.state.ask(f"actors {HOST_CLASS}") if a["state"] != "DEAD"]


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    directory = Path(tempfile.mkdtemp(prefix="ras-", dir="/tmp"))
    nodes = RayNodes(directory)
    state: RayState | None = None
    try:
        head = nodes.start_autoscaling_head(1, {"node": NODE}, idle_minutes=0.05)
        nodes.wait_started(head, 120)
        state = RayState(nodes)
        yield Cluster(nodes, state)
    finally:
        if state is not None:
            state.close()
        nodes.stop()


async def slow(http: aiohttp.ClientSession, url: str, token: str) -> int:
    async with http.get(f"{url}/slow?seconds=0.3", headers={TOKEN_HEADER: token}) as reply:
        return reply.status


async def increment(http: aiohttp.ClientSession, url: str, token: str, by: int) -> None:
    async with http.post(
        f"{url}/increment_counter", json={"count": by}, headers={TOKEN_HEADER: token}
    ) as reply:
        assert reply.status == 200, await reply.text()


class Load:
    """Four clients per session group calling /slow back to back until stopped."""

    def __init__(self, http: aiohttp.ClientSession, url: str) -> None:
        self.http, self.url = http, url
        self.stop = asyncio.Event()
        self.tasks: list[asyncio.Task[None]] = []
        self.answers: dict[int, int] = {}

    def on(self, tokens: list[str]) -> None:
        for i in range(4):
            self.tasks.append(asyncio.ensure_future(self._client(tokens[i % len(tokens)])))

    async def _client(self, token: str) -> None:
        while not self.stop.is_set():
            status = await slow(self.http, self.url, token)
            self.answers[status] = self.answers.get(status, 0) + 1

    async def end(self) -> dict[int, int]:
        self.stop.set()
        await asyncio.gather(*self.tasks)
        return self.answers


async def grown_to(http: aiohttp.ClientSession, url: str, workers: int, within: float) -> float:
    """Seconds from the autoscaler's grow starting a worker to `workers` serving."""
    decided: list[float] = []

    async def growing() -> bool:
        running = (await status_of(http, url))["operations"]["running"]
        if running is not None and running["reason"] == "autoscale":
            decided.append(time.monotonic())
            return True
        return len((await status_of(http, url))["workers"]) >= workers

    await wait_until(growing, within, f"the autoscaler to grow to {workers} workers")

    async def serving() -> bool:
        return len((await status_of(http, url))["workers"]) == workers

    await wait_until(serving, within, f"{workers} workers serving")
    return time.monotonic() - decided[0] if decided else 0.0


async def test_the_worker_count_grows_and_shrinks_the_cluster(start_proxy, cluster):
    env = {**cluster.nodes.environment, "RAY_ADDRESS": cluster.nodes.address}
    proxy = start_proxy(
        "--worker-placement", "ray", "--worker-cpus", "1", "--min-workers", "1",
        "--max-workers", "3", "--scale-up-busy", "2", "--scale-up-after", "1",
        "--scale-down-busy", "0.5", "--scale-down-after", "2", "--boot-timeout", "180",
        workers=1, control_token=CONTROL_TOKEN, env=env,
    )  # fmt: skip
    assert len(cluster.alive_nodes()) == 1
    async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as http:
        url = proxy.url
        first = [await seed(http, url) for _ in range(4)]
        for i, token in enumerate(first):
            await increment(http, url, token, i + 1)
        load = Load(http, url)
        load.on(first)
        took = [await grown_to(http, url, 2, 120)]
        second = [await seed(http, url) for _ in range(4)]  # new sessions: the new worker's
        for i, token in enumerate(second):
            await increment(http, url, token, 10 + i)
        load.on(second)
        took.append(await grown_to(http, url, 3, 120))
        print(f"from the grow's decision to the new node's worker serving: {took} s")
        workers = (await status_of(http, url))["workers"]
        assert len({w["node"] for w in workers}) == 3, workers  # one per node
        assert len(cluster.alive_nodes()) == 3
        answers = await load.end()
        assert set(answers) == {200}, answers

        async def one_worker() -> bool:
            return len((await status_of(http, url))["workers"]) == 1

        await wait_until(one_worker, 120, "the autoscaler to shrink to one worker")
        await wait_until(
            lambda: asyncio.to_thread(lambda: len(cluster.alive_nodes()) == 1),
            120,
            "Ray's autoscaler to remove the idle nodes",
        )
        assert [await count(http, url, t) for t in first] == [1, 2, 3, 4]
        assert [await count(http, url, t) for t in second] == [10, 11, 12, 13]
    assert len(cluster.alive_actors()) == 1, cluster.alive_actors()
    log = proxy.log()
    assert "waits for room on the Ray cluster" not in log or "given up" in log
    assert "no room on the Ray cluster" not in log


async def test_a_resize_past_what_the_cluster_grows_to_stops_there_and_says_so(
    start_proxy, cluster
):
    """An operator's resize from one worker to four: the second and third wait for the
    nodes Ray's autoscaler adds; the fourth, for which the cluster cannot grow (two nodes
    at most), waits `--placement-wait`, is given up and its pending actor killed. The
    resize says where it stopped and why (the room, the wait), three workers serve, three
    actors are alive, and a session's count is exact throughout; the resize back to one
    lets Ray's autoscaler remove the nodes again."""
    env = {**cluster.nodes.environment, "RAY_ADDRESS": cluster.nodes.address}
    proxy = start_proxy(
        "--worker-placement", "ray", "--worker-cpus", "1", "--placement-wait", "5",
        "--boot-timeout", "180", workers=1, control_token=CONTROL_TOKEN, env=env,
    )  # fmt: skip
    async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as http:
        url = proxy.url
        token = await seed(http, url)
        await increment(http, url, token, 7)
        status, reply = await operate(http, url, "resize", workers=4)
        assert status == 200 and not reply["complete"], reply
        (error,) = reply["errors"]
        assert (
            error.startswith("grow stopped at 3 workers: ")
            and ("no room on the Ray cluster for a worker of {CPU 1} within 5 s (--placement-wait)")
            in error
        ), error
        workers = (await status_of(http, url))["workers"]
        assert len(workers) == 3 and len({w["node"] for w in workers}) == 3, workers
        assert len(cluster.alive_actors()) == 3, cluster.alive_actors()
        assert await count(http, url, token) == 7
        status, reply = await operate(http, url, "resize", workers=1)
        assert status == 200 and reply["complete"], reply
        await wait_until(
            lambda: asyncio.to_thread(lambda: len(cluster.alive_nodes()) == 1),
            120,
            "Ray's autoscaler to remove the idle nodes",
        )
        assert await count(http, url, token) == 7
    assert "a worker of {CPU 1} waits for room on the Ray cluster (5 s so far" in proxy.log()
