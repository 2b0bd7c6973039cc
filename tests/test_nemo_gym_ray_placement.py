"""Workers on the nodes of a Ray cluster (`--worker-placement ray`): a real two-node
cluster on this machine (`tests/ray_nodes.py`: `ray start --head` and `ray start
--address`, token authentication on), gym-proxy started with `RAY_ADDRESS` naming it.

Each worker runs in a Ray actor that SPREAD places; the tests read where from
gym-proxy's status and check it against Ray's own state API. Through workers on both
nodes: sessions exact (the head's worker on a Unix socket in gym-proxy's runtime
directory, the other's on TCP); each worker's memory as it reports it, and a recycle
past `--max-worker-memory`; a worker's port that answers nothing but its challenge to a
connection without the link key; a checkpoint whose restore moves sessions between nodes
(and onto local workers); a drain (its sessions moved, its running episode handed over
to the other node), a rolling restart (a gated episode handed to its replacement) and a
resize; NeMo Gym's own counter with every reward right; the second node killed mid-load
(its sessions 410 with the reason, the others untouched, a replacement started on the
node left); and a stop that leaves no actor alive. One server of a local worker and
placed ones (`--local-workers`): a rebalance, a checkpoint and its restore across the
mix. A placed worker is lost only when it is gone: not for a flood of strangers' silent
connections at its port, nor for a handler that blocks its loop past the handshake's
limit. A stop goes through no Ray actor (one second, with every actor frozen), and a
gym-proxy killed with -9 leaves nothing behind.
In the NeMo Gym tier: Ray is installed by tests/nemo_gym/install.sh."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

pytest.importorskip("nemo_gym", reason="the NeMo Gym tier runs in tests/nemo_gym/install.sh's venv")
for _module in ("ray", "grpc", "aiohttp_cors", "opencensus"):  # Ray, and its state API's
    if importlib.util.find_spec(_module) is None:
        pytest.skip(f"needs {_module} (tests/nemo_gym/install.sh)", allow_module_level=True)

from gym_proxy.coordinator.contract.worker_link import (  # noqa: E402
    CHALLENGE_SIZE,
    MAGIC,
    LinkAddress,
)
from tests.nemo_gym_stack import CounterClient  # noqa: E402
from tests.ray_nodes import RayNodes, RayState  # noqa: E402
from tests.support import (  # noqa: E402
    CONTROL_TOKEN,
    REPO,
    Control,
    ProxyProcess,
    wait_until,
    wait_until_sync,
)
from tests.test_episode_handover import (  # noqa: E402
    handing_over,
    log_of,
    release,
    run_body,
    start_run,
    until_step,
)
from tests.test_live_operations import TOKEN_HEADER, count, operate, seed, status_of  # noqa: E402
from tests.test_metrics import metrics_url  # noqa: E402
from tests.test_nemo_gym_counter import COUNTER, counter_env, nemo_http  # noqa: E402
from tests.test_proxy_adoption import Load, counts_and_pids  # noqa: E402
from tests.test_proxy_adoption import seed as seed_sessions  # noqa: E402
from tests.test_rebalance import metric, sessions_by_slot, stalling  # noqa: E402

pytestmark = pytest.mark.timeout(420)

HOST_CLASS = "RayWorkerHost"  # the actor class of a placed worker
FLOOD_SOURCE = "127.0.0.2"  # a loopback address of its own: not the one gym-proxy dials from


@dataclass
class Cluster:
    nodes: RayNodes
    state: RayState

    def node_ids(self) -> dict[str, str]:
        """node ID -> "head" or "second", the alive ones."""
        return {
            n["node_id"]: "head" if n["is_head"] else "second"
            for n in self.state.ask("nodes")
            if n["state"] == "ALIVE"
        }

    def alive_actors(self) -> list[dict[str, Any]]:
        return [a for a in self.state.ask(f"actors {HOST_CLASS}") if a["state"] != "DEAD"]


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    directory = Path(tempfile.mkdtemp(prefix="rpl-", dir="/tmp"))
    nodes = RayNodes(directory)
    state: RayState | None = None
    try:
        head = nodes.start_head()
        second = nodes.add_node()
        nodes.wait_started(head, 120)
        nodes.wait_started(second, 120)
        state = RayState(nodes)
        cluster = Cluster(nodes, state)
        wait_until_sync(lambda: len(cluster.node_ids()) == 2, 60, "both nodes ALIVE")
        yield cluster
    finally:
        if state is not None:
            state.close()
        nodes.stop()


def placed(start_proxy: Any, cluster: Cluster, *args: str, **kwargs: Any) -> ProxyProcess:
    """gym-proxy with its workers on the cluster (half a CPU each: a node that is left
    holds a replacement beside its own worker)."""
    env = {**cluster.nodes.environment, "RAY_ADDRESS": cluster.nodes.address}
    env.update(kwargs.pop("env", {}))
    return start_proxy(
        "--worker-placement", "ray", "--worker-cpus", "0.5", "--boot-timeout", "180", *args,
        control_token=CONTROL_TOKEN, env=env, **kwargs,
    )  # fmt: skip


async def workers_of(http: aiohttp.ClientSession, url: str) -> list[dict[str, Any]]:
    return list((await status_of(http, url))["workers"])


async def on_both_nodes(http: aiohttp.ClientSession, url: str, cluster: Cluster) -> dict[int, str]:
    """slot -> "head" or "second"; asserts the two workers are on the two nodes."""
    where = {
        w["slot"]: cluster.node_ids().get(w["node"], w["node"]) for w in await workers_of(http, url)
    }
    assert sorted(where.values()) == ["head", "second"], where
    return where


async def whoami(http: aiohttp.ClientSession, url: str, token: str) -> dict[str, Any]:
    async with http.get(f"{url}/whoami", headers={TOKEN_HEADER: token}) as response:
        assert response.status == 200, await response.text()
        return dict(await response.json())


async def increment(http: aiohttp.ClientSession, url: str, token: str, by: int = 1) -> int:
    async with http.post(
        f"{url}/increment_counter", json={"count": by}, headers={TOKEN_HEADER: token}
    ) as response:
        return response.status


def jar() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        cookie_jar=aiohttp.DummyCookieJar(), timeout=aiohttp.ClientTimeout(total=60)
    )


async def test_sessions_exact_through_workers_on_both_nodes(start_proxy, cluster):
    proxy = placed(start_proxy, cluster, "--metrics", "127.0.0.1:0", app="tests.apps:create_app")
    async with jar() as http:
        where = await on_both_nodes(http, proxy.url, cluster)
        tokens = [await seed(http, proxy.url) for _ in range(40)]

        async def rollout(i: int, token: str) -> None:
            for _ in range(5):
                assert await increment(http, proxy.url, token, i) == 200
            assert await count(http, proxy.url, token) == 5 * i

        await asyncio.gather(*(rollout(i, t) for i, t in enumerate(tokens)))
        slots = [(await whoami(http, proxy.url, t))["slot"] for t in tokens]
        assert set(slots) == set(where), slots  # sessions on both nodes' workers
        workers = await workers_of(http, proxy.url)
        (runtime_dir,) = proxy.runtime_dirs()
        for worker in workers:  # on gym-proxy's node a Unix socket in its runtime directory
            node = cluster.node_ids()[worker["node"]]
            if node == "head":
                assert worker["address"].startswith(f"unix://{runtime_dir}/placed-"), worker
            else:
                assert worker["address"].startswith("tcp://"), worker
        metrics = re.search(r"metrics on (http://\S+/metrics)", proxy.log())
        assert metrics is not None, proxy.log()
        async with http.get(metrics.group(1)) as response:
            text = await response.text()
        for worker in workers:  # each worker's node, as status says it
            line = (  # the labels in the exposition's (alphabetical) order
                f'gym_proxy_worker_node{{node="{worker["node"]}",owner="{worker["owner"]}",'
                f'slot="{worker["slot"]}"}} 1.0'
            )
            assert line in text, text


async def test_a_placed_workers_memory_is_its_own_report_and_past_the_ceiling_it_is_recycled(
    start_proxy, cluster
):
    """A placed worker's pid is not one of gym-proxy's machine: it reports its resident
    memory in its pongs, which `/metrics` shows per slot and `--max-worker-memory`
    checks: below a fresh worker's, each worker is recycled once it has lived 10 s (its
    sessions moved, their counts kept)."""
    proxy = placed(
        start_proxy, cluster, "--metrics", "127.0.0.1:0", "--max-worker-memory", "1",
        app="tests.apps:create_app",
    )  # fmt: skip
    async with jar() as http:
        before = {w["owner"] for w in await workers_of(http, proxy.url)}
        token = await seed(http, proxy.url)
        assert await increment(http, proxy.url, token, 3) == 200
        metrics = re.search(r"metrics on (http://\S+/metrics)", proxy.log())
        assert metrics is not None, proxy.log()

        async def reported() -> bool:
            async with http.get(metrics.group(1)) as response:
                text = await response.text()
            found = re.findall(r'gym_proxy_worker_resident_memory_bytes\{slot="(\d)"\} (\S+)', text)
            return len(found) == 2 and all(float(value) > 2**24 for _, value in found)

        await wait_until(reported, 30, "both placed workers' memory in /metrics")

        async def recycled() -> bool:
            last = (await status_of(http, proxy.url))["operations"]["last"]
            return last is not None and last["reason"].startswith("recycle: resident memory")

        await wait_until(recycled, 60, "a recycle for memory")
        assert "is below a fresh worker's resident memory" in proxy.log()
        after = {w["owner"] for w in await workers_of(http, proxy.url)}
        assert after != before
        assert await count(http, proxy.url, token) == 3


async def test_a_worker_port_gives_nothing_without_the_link_key(start_proxy, cluster):
    """Straight to each worker's port (TCP on the second node, the Unix socket on
    gym-proxy's): the challenge, then nothing for an HTTP request, a wrong answer or
    silence; the app never sees any of them."""
    proxy = placed(start_proxy, cluster, app="tests.apps:create_app")
    async with jar() as http:
        attempts = (b"GET /whoami HTTP/1.1\r\nHost: x\r\n\r\n", b"D" + bytes(48))
        workers = await workers_of(http, proxy.url)
        for link, attempt in [(link_of(w), a) for w in workers for a in attempts]:
            reader, writer = await open_link(link)
            greeting = await reader.readexactly(CHALLENGE_SIZE)
            assert greeting.startswith(MAGIC)
            writer.write(attempt)
            rest = await asyncio.wait_for(reader.read(), 10)
            assert rest == b"", (attempt, rest)  # closed, having said nothing more
            writer.close()
        async with http.get(f"{proxy.url}/seen") as response:
            assert "/whoami" not in await response.text()


async def test_a_restore_moves_sessions_between_nodes_and_onto_local_workers(
    start_proxy, cluster, tmp_path
):
    first = placed(start_proxy, cluster, app="tests.apps:create_app")
    async with jar() as http:
        where = await on_both_nodes(http, first.url, cluster)
        tokens = [await seed(http, first.url) for _ in range(30)]
        for i, token in enumerate(tokens):
            assert await increment(http, first.url, token, i) == 200
        before = {t: where[(await whoami(http, first.url, t))["slot"]] for t in tokens}
        await Control(http, first.url).checkpoint("ck-nodes", str(tmp_path))
        first.close_process()
        wait_until_sync(lambda: not cluster.alive_actors(), 60, "the first server's actors to end")

        # Onto workers placed anew (3 this time), then onto local ones: every count.
        for second in (
            placed(start_proxy, cluster, app="tests.apps:create_app", workers=3),
            start_proxy(app="tests.apps:create_app", control_token=CONTROL_TOKEN),
        ):
            control = Control(http, second.url)
            await control.ok(
                "restore", checkpoint_id="r", checkpoint_dir=str(tmp_path), episode_ids=[]
            )
            await control.ok("resume", checkpoint_id="r")
            for i, token in enumerate(tokens):
                assert await count(http, second.url, token) == i
            second.close_process()
        nodes_now = cluster.node_ids()
        assert set(before.values()) == {"head", "second"} and nodes_now, before


async def test_a_drain_a_restart_and_a_resize_across_nodes(start_proxy, cluster):
    """Each carries what it holds across nodes: the drain moves slot 0's sessions and hands
    its running episode to the worker on the other node; the rolling restart hands a
    gated episode to its slot's replacement; every step runs once."""
    proxy = placed(start_proxy, cluster, app="tests.apps:create_app")
    async with jar() as http:
        where = await on_both_nodes(http, proxy.url, cluster)
        tokens = [await seed(http, proxy.url) for _ in range(20)]
        for i, token in enumerate(tokens):
            assert await increment(http, proxy.url, token, i) == 200
        on_0 = [t for t in tokens if (await whoami(http, proxy.url, t))["slot"] == 0][0]
        drained = await start_run(
            http, proxy.url, run_body("ep-d", 60, pause=0.05), headers={TOKEN_HEADER: on_0}
        )
        await until_step(http, proxy.url, "ep-d", 2, on_0)
        status, reply = await operate(http, proxy.url, "drain", slot=0, timeout_s=20)
        assert status == 200 and reply["complete"] and reply["moved"] >= 1, reply
        assert reply["episodes_moved"] == 1, reply
        other = (await workers_of(http, proxy.url))[1]["owner"]
        code, answer = await asyncio.wait_for(drained, 30)
        assert code == 200 and answer["owner"] == other, answer  # on the other node
        assert answer["state"]["log"] == log_of("ep-d", 60), answer
        for i, token in enumerate(tokens):
            assert await count(http, proxy.url, token) == i
            assert (await whoami(http, proxy.url, token))["slot"] == 1  # the other node
        status, reply = await operate(http, proxy.url, "undrain", slot=0)
        assert status == 200, reply
        # Gated, not timed: the episode is inside a step until its gate opens.
        gated = await start_run(
            http, proxy.url, run_body("ep-r", 3, gate="r"), headers={TOKEN_HEADER: on_0}
        )
        await until_step(http, proxy.url, "ep-r", 0, on_0)
        restart = asyncio.ensure_future(operate(http, proxy.url, "restart", timeout_s=60))
        await wait_until(lambda: handing_over(http, proxy.url), 120, "the hand-over to begin")
        await release(http, proxy.url, "r-0", other)  # step 0 ends where it runs, then parks
        status, reply = await restart
        assert status == 200 and reply["complete"] and reply["episodes_moved"] == 1, reply
        (new,) = [s["new_owner"] for s in reply["slots"] if s["old_owner"] == other]
        for i in range(3):  # a replay step cut by the hand-over runs again on the new worker
            await release(http, proxy.url, f"r-{i}", new)
        code, answer = await asyncio.wait_for(gated, 30)
        assert code == 200 and answer["owner"] == new, answer
        assert answer["state"]["log"] == log_of("ep-r", 3), answer
        for i, token in enumerate(tokens):
            assert await count(http, proxy.url, token) == i
        await on_both_nodes(http, proxy.url, cluster)  # the replacements, placed again
        for size in (3, 2):  # a third worker placed, then the last slot emptied and stopped
            status, reply = await operate(http, proxy.url, "resize", workers=size)
            assert status == 200 and reply["complete"], reply
            nodes = {cluster.node_ids().get(w["node"]) for w in await workers_of(http, proxy.url)}
            assert len(await workers_of(http, proxy.url)) == size and nodes <= {"head", "second"}
            for i, token in enumerate(tokens):
                assert await count(http, proxy.url, token) == i
        assert set(where) == {0, 1}


async def test_nemo_gym_counter_on_two_nodes_every_reward_right(start_proxy, cluster):
    """NeMo Gym's released counter, its workers on both nodes, under NeMo Gym's clients."""
    proxy = placed(start_proxy, cluster, "--name", "counter", app=COUNTER, env=counter_env())
    async with nemo_http() as http:
        async with jar() as plain:
            await on_both_nodes(plain, proxy.url, cluster)
        clients = [CounterClient(http, proxy.url, task) for task in range(60)]
        gate = asyncio.Semaphore(20)

        async def rollout(i: int, client: CounterClient) -> None:
            async with gate:
                await client.seed(i)
                for step in range(4):
                    await client.post("/increment_counter", {"count": 1})
                    assert await client.count() == i + step + 1, (i, step)
                assert await client.verify(i + 4) == 1.0

        await asyncio.gather(*(rollout(i, c) for i, c in enumerate(clients)))


def link_of(worker: dict[str, Any]) -> LinkAddress:
    """Where a worker's gate listens, as its status says."""
    address = str(worker["address"])
    if address.startswith("unix://"):
        return LinkAddress(path=address.removeprefix("unix://"))
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    return LinkAddress(host, int(port))


async def open_link(link: LinkAddress) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    if link.path:
        return await asyncio.open_unix_connection(link.path)
    return await asyncio.open_connection(link.host, link.port)


def nothing_listens(link: LinkAddress) -> bool:
    try:
        if link.path:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
                probe.connect(link.path)
        else:
            socket.create_connection((link.host, link.port), timeout=5).close()
    except (ConnectionRefusedError, FileNotFoundError):
        return True
    return False


async def on_tcp(http: aiohttp.ClientSession, url: str, cluster: Cluster) -> tuple[int, str, int]:
    """The slot, host and port of the worker on the second node (on TCP, as every worker
    of another node is; the head's is on a Unix socket, which strangers cannot reach)."""
    for worker in await workers_of(http, url):
        if cluster.node_ids().get(worker["node"]) == "second":
            link = link_of(worker)
            assert not link.path, worker
            return int(worker["slot"]), link.host, link.port
    raise AssertionError("no worker on the second node")


async def sessions_on(http: aiohttp.ClientSession, url: str, slot: int, wanted: int) -> list[str]:
    """New sessions until `wanted` of them are on worker `slot` (bounded); those."""
    on_slot: list[str] = []
    for _ in range(20 * wanted):
        token = await seed(http, url)
        if (await whoami(http, url, token))["slot"] == slot:
            on_slot.append(token)
            if len(on_slot) == wanted:
                return on_slot
    raise AssertionError(f"no {wanted} sessions on worker {slot}: {on_slot}")


async def get_status(http: aiohttp.ClientSession, url: str, token: str) -> int:
    async with http.get(url, headers={TOKEN_HEADER: token}) as response:
        await response.read()
        return response.status


async def loop_blocked(host: str, port: int) -> bool:
    """Whether a worker's loop is blocked: the kernel takes the connection, but its gate
    sends no challenge within a second."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        await asyncio.wait_for(reader.readexactly(CHALLENGE_SIZE), 1.0)
        return False
    except TimeoutError:
        return True
    finally:
        writer.close()


async def test_a_flood_of_silent_connections_at_a_workers_port_loses_no_session(
    start_proxy, cluster
):
    """About 10,000 silent connections a second at the TCP port of the worker on the
    second node from another address (opening them needs no key): the gate drops
    strangers' half-open handshakes, never gym-proxy's, so the 60 data connections the
    proxy dials meanwhile prove the key and every call on the worker's sessions answers
    200; the worker is never taken as gone."""
    proxy = placed(start_proxy, cluster, app="tests.apps:create_app")
    async with jar() as http:
        owners = [w["owner"] for w in await workers_of(http, proxy.url)]
        slot, host, port = await on_tcp(http, proxy.url, cluster)
        on_it = await sessions_on(http, proxy.url, slot, 6)
        flooder = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tests.link_flood", host, str(port), FLOOD_SOURCE, "10000", "30",
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            assert flooder.stdout is not None
            started = await asyncio.wait_for(flooder.stdout.readline(), 30)
            assert started == b"flooding\n", started
            # 60 at once: the worker's pooled connections are too few, so most are dialed
            # while the flood runs.
            statuses = await asyncio.gather(
                *(get_status(http, f"{proxy.url}/slow?seconds=1", on_it[i % 6]) for i in range(60))
            )
            assert flooder.returncode is None, "the flood ended before the calls did"
        finally:
            with contextlib.suppress(ProcessLookupError):
                flooder.kill()
            await flooder.wait()
        assert statuses == [200] * 60, statuses
        assert [w["owner"] for w in await workers_of(http, proxy.url)] == owners
        for token in on_it:
            assert await increment(http, proxy.url, token) == 200
            assert await count(http, proxy.url, token) == 1


async def test_a_handler_that_blocks_a_placed_workers_loop_past_the_handshake_limit(
    start_proxy, cluster
):
    """A CPU-bound call blocks the loop of the worker on the second node for 7 s, past
    the 5 s a link has to prove itself: the data connections the proxy dials meanwhile
    are not answered in time and are dialed again, the worker is not taken as gone, and
    every call on its sessions answers 200 once its loop is back, as with a local worker
    (which is given up only after `--worker-timeout` of unanswered pings)."""
    proxy = placed(start_proxy, cluster, app="tests.apps:create_app")
    async with jar() as http:
        owners = [w["owner"] for w in await workers_of(http, proxy.url)]
        slot, host, port = await on_tcp(http, proxy.url, cluster)
        on_it = await sessions_on(http, proxy.url, slot, 6)
        blocked = asyncio.ensure_future(get_status(http, f"{proxy.url}/block?seconds=7", on_it[0]))
        try:
            await wait_until(lambda: loop_blocked(host, port), 30, "worker 0's loop to be blocked")
            # Each of these needs a connection of its own: dialed while the loop is blocked.
            statuses = await asyncio.gather(*(increment(http, proxy.url, t) for t in on_it * 2))
            assert statuses == [200] * 12, statuses
            assert await blocked == 200
        finally:
            blocked.cancel()
        assert [w["owner"] for w in await workers_of(http, proxy.url)] == owners
        for token in on_it:
            assert await count(http, proxy.url, token) == 2


async def test_a_stop_goes_through_no_ray_actor(start_proxy, cluster):
    """Every worker's actor frozen (SIGSTOP: a Ray that is slow to answer, as on a loaded
    machine): SIGTERM still stops gym-proxy within the one second NeMo Gym's launcher
    gives a server, each worker told over its link and finishing its app's shutdown, and
    the runtime directory removed; the frozen actors end with the placement driver."""
    psutil = pytest.importorskip("psutil")
    proxy = placed(start_proxy, cluster, "--graceful-timeout", "5", app="tests.apps:create_app")
    async with jar() as http:
        workers = await workers_of(http, proxy.url)
        token = await seed(http, proxy.url)
        assert await increment(http, proxy.url, token) == 200
    pids = [int(w["pid"]) for w in workers]
    actors = [psutil.Process(pid).parent() for pid in pids]  # each worker's RayWorkerHost
    for actor in actors:
        actor.suspend()
    try:
        began = time.monotonic()
        proxy.signal(signal.SIGTERM)
        code = await asyncio.to_thread(proxy.wait_exit, 60)
        took = time.monotonic() - began
    finally:
        for actor in actors:
            with contextlib.suppress(psutil.Error):
                actor.resume()
    assert code == 0, proxy.log()[-3000:]
    assert took < 1.0, f"stopped in {took:.2f} s:\n{proxy.log()[-3000:]}"
    assert proxy.runtime_dirs() == []
    for worker in workers:
        assert f"worker {worker['slot']} (pid {worker['pid']}) exited with code 0" in proxy.log()
    wait_until_sync(lambda: not any(psutil.pid_exists(p) for p in pids), 30, "the workers to end")
    wait_until_sync(lambda: not cluster.alive_actors(), 60, "the frozen actors to end")


async def test_ctrl_c_in_a_terminal_lets_the_placed_workers_finish(start_proxy, cluster):
    """Ctrl-C in a terminal: SIGINT to the whole process group, the placement driver's
    included (NeMo Gym's launcher's too, when it started gym-proxy). The driver leaves the
    stop to gym-proxy, which stops its workers as local ones: the call in flight is
    answered, and every worker exits 0 (not killed with its actor)."""
    proxy = placed(start_proxy, cluster, app="tests.apps:create_app", new_session=True)
    async with jar() as http:
        workers = await workers_of(http, proxy.url)
        token = await seed(http, proxy.url)
        call = asyncio.ensure_future(get_status(http, f"{proxy.url}/slow?seconds=2", token))
        try:

            async def in_the_worker() -> bool:
                async with http.get(f"{proxy.url}/seen", headers={TOKEN_HEADER: token}) as r:
                    return "/slow" in (await r.json())["paths"]

            await wait_until(in_the_worker, 30, "the call to be in its worker")
            os.killpg(proxy.pid, signal.SIGINT)
            assert await asyncio.wait_for(call, 30) == 200
        finally:
            call.cancel()
    assert await asyncio.to_thread(proxy.wait_exit, 60) == 0, proxy.log()[-3000:]
    for worker in workers:
        exited = f"worker {worker['slot']} (pid {worker['pid']}) exited with code 0"
        assert exited in proxy.log(), proxy.log()[-3000:]


async def test_a_proxy_killed_with_9_leaves_nothing_behind(start_proxy, cluster):
    """gym-proxy killed with -9 (as NeMo Gym's launcher kills a server that missed its
    second; under it, the orphan grace is 0): its placement driver kills the workers'
    actors and, its proxy dead, removes the runtime directory; the workers stop as their
    channels end; nothing of it is left."""
    psutil = pytest.importorskip("psutil")
    proxy = placed(start_proxy, cluster, "--orphan-grace", "0", app="tests.apps:create_app")
    async with jar() as http:
        workers = await workers_of(http, proxy.url)
    pids = [int(w["pid"]) for w in workers]
    (driver,) = [
        p for p in psutil.Process(proxy.pid).children() if "placement" in " ".join(p.cmdline())
    ]
    assert len(proxy.runtime_dirs()) == 1
    proxy.popen.kill()
    proxy.popen.wait(10)
    wait_until_sync(lambda: not driver.is_running(), 30, "the placement driver to end")
    wait_until_sync(lambda: not any(psutil.pid_exists(p) for p in pids), 30, "the workers to end")
    assert proxy.runtime_dirs() == [], proxy.runtime_dirs()
    wait_until_sync(lambda: not cluster.alive_actors(), 60, "the actors to end")
    for worker in workers:  # nothing listens there any more
        assert nothing_listens(link_of(worker)), worker


def placement_driver(proxy: ProxyProcess) -> Any:
    """gym-proxy's placement driver process (psutil), once there is one."""
    import psutil

    drivers = [
        p for p in psutil.Process(proxy.pid).children() if "placement" in " ".join(p.cmdline())
    ]
    return drivers[0] if len(drivers) == 1 else None


async def test_a_placement_driver_killed_with_9_loses_nothing(start_proxy, cluster):
    """The placement driver alone killed with -9: the workers' actors outlive it (they are
    detached), gym-proxy starts another driver that follows them by name, and no session
    is lost: the same actors (by ID), every count exact, new calls answered. A worker
    that dies afterwards is heard through the new driver and replaced; a stop then leaves
    no actor."""
    proxy = placed(start_proxy, cluster, app="tests.apps:create_app")
    async with jar() as http:
        await on_both_nodes(http, proxy.url, cluster)
        tokens = [await seed(http, proxy.url) for _ in range(20)]
        for i, token in enumerate(tokens):
            assert await increment(http, proxy.url, token, i) == 200
        actors = {a["actor_id"] for a in cluster.alive_actors()}
        assert len(actors) == 2, actors
        first = placement_driver(proxy)
        first.kill()
        first.wait(10)
        replaced = "starting another, which follows the 2 workers' actors"
        wait_until_sync(lambda: replaced in proxy.log(), 30, "the driver to be replaced")
        wait_until_sync(lambda: placement_driver(proxy) is not None, 30, "a new driver")
        assert placement_driver(proxy).pid != first.pid
        for i, token in enumerate(tokens):
            assert await count(http, proxy.url, token) == i
            assert await increment(http, proxy.url, token) == 200
        assert {a["actor_id"] for a in cluster.alive_actors()} == actors
        victim = (await workers_of(http, proxy.url))[0]
        os.kill(victim["pid"], signal.SIGKILL)  # its exit reaches gym-proxy through the new driver

        async def slot_replaced() -> bool:
            now = {w["slot"]: w for w in await workers_of(http, proxy.url)}
            fresh = now.get(victim["slot"])
            return fresh is not None and fresh["owner"] != victim["owner"]

        await wait_until(slot_replaced, 60, "the killed worker's slot started again")
        assert f"(pid {victim['pid']}, owner {victim['owner']}) exited with code -9" in proxy.log()
    proxy.close_process()
    assert proxy.popen.returncode == 0, proxy.log()[-3000:]
    wait_until_sync(lambda: not cluster.alive_actors(), 60, "every actor to end")


async def test_gym_proxy_and_its_driver_both_killed_leave_no_actor(start_proxy, cluster):
    """gym-proxy and its placement driver killed with -9 together (a cgroup's OOM kill),
    and never started again: no driver is left to kill the detached actors, but each
    worker stops once its orphan grace (2 s here) ends with no successor, and its actor
    ends itself once no driver heard that (ORPHANED_AFTER)."""
    proxy = placed(start_proxy, cluster, "--orphan-grace", "2", app="tests.apps:create_app")
    async with jar() as http:
        await on_both_nodes(http, proxy.url, cluster)
    driver = placement_driver(proxy)
    driver.kill()
    proxy.popen.kill()
    proxy.popen.wait(10)
    driver.wait(10)
    assert len(cluster.alive_actors()) == 2  # detached: they outlived both
    wait_until_sync(lambda: not cluster.alive_actors(), 60, "the orphaned actors to end")


@pytest.mark.parametrize(
    ("local", "preload"), [(0, ()), (1, ()), (0, ("--preload",))],
    ids=["placed", "mixed", "preloaded"],
)  # fmt: skip
async def test_the_same_command_started_again_adopts_the_placed_workers(
    start_proxy, cluster, local, preload
):
    """kill -9 of gym-proxy with workers on both nodes: its driver leaves their actors
    (detached, named by gym-proxy's runtime directory) for the orphan grace, the workers
    keep their sessions; the same command started again finds the actors, links to the
    workers and adopts them: the same actors (by ID) and processes, every session's count
    exact, new sessions served; a stop then leaves no actor. Mixed (`--local-workers 1`):
    the local worker rejoins on the coordinator socket beside the placed ones found.
    Preloaded: the workers forked by the nodes' zygotes are adopted as well."""
    grace = ("--orphan-grace", "60", "--local-workers", str(local), *preload)
    first = placed(start_proxy, cluster, *grace, app="tests.apps:create_app", workers=2 + local)
    async with jar() as http:
        where = {w["slot"]: w["node"] for w in await workers_of(http, first.url)}
        ids = cluster.node_ids()
        assert sorted(ids[where[s]] for s in range(local, 2 + local)) == ["head", "second"]
        assert all(where[s] == "local" for s in range(local)), where
        tokens = [await seed(http, first.url) for _ in range(30)]
        for i, token in enumerate(tokens):
            assert await increment(http, first.url, token, i) == 200
        before = sorted(
            (w["slot"], w["owner"], w["pid"]) for w in await workers_of(http, first.url)
        )
    actors = {a["actor_id"] for a in cluster.alive_actors()}
    driver = placement_driver(first)
    first.popen.kill()
    first.popen.wait(10)
    driver.wait(30)  # it ends, leaving the actors to a successor
    assert "leaving the workers' actors to the gym-proxy that adopts" in first.log()
    assert {a["actor_id"] for a in cluster.alive_actors()} == actors
    second = placed(
        start_proxy, cluster, *grace, app="tests.apps:create_app", workers=2 + local,
        same_as=first,
    )  # fmt: skip
    adopted = f"adopted {2 + local} workers of the dead instance"
    assert adopted in second.log(), second.log()[-3000:]
    async with jar() as http:
        after = sorted(
            (w["slot"], w["owner"], w["pid"]) for w in await workers_of(http, second.url)
        )
        assert after == before
        for i, token in enumerate(tokens):
            assert await count(http, second.url, token) == i
            assert await increment(http, second.url, token) == 200
        fresh = await seed(http, second.url)
        assert await increment(http, second.url, fresh, 2) == 200
        assert await count(http, second.url, fresh) == 2
    assert {a["actor_id"] for a in cluster.alive_actors()} == actors
    second.close_process()
    assert second.popen.returncode == 0, second.log()[-3000:]
    wait_until_sync(lambda: not cluster.alive_actors(), 60, "every actor to end")


async def test_a_worker_waiting_for_room_when_gym_proxy_died_is_not_left_pending(
    start_proxy, cluster
):
    """kill -9 of gym-proxy while a resize's third worker waits for room (its actor
    pending: both nodes' CPUs are taken). The same command again adopts the two workers
    and serves their sessions at once (it waited for the third worker first, and a start
    that gave up on it stopped the adopted ones with every session); it gives the pending
    actor up in one line and kills it, so that no node takes it later (nor an autoscaler
    adds one for it); the kept count of 3 is then a resize, which stops at 2 and says so."""
    grace = ("--orphan-grace", "60", "--worker-cpus", "1")
    first = placed(start_proxy, cluster, *grace, app="tests.apps:create_app", workers=2)
    async with jar() as http:
        tokens = [await seed(http, first.url) for _ in range(10)]
        for i, token in enumerate(tokens):
            assert await increment(http, first.url, token, i) == 200
        resize = asyncio.ensure_future(operate(http, first.url, "resize", workers=3))

        def pending() -> list[str]:
            return [a["actor_id"] for a in cluster.alive_actors() if a["state"] != "ALIVE"]

        (waiting,) = await asyncio.to_thread(
            wait_until_sync, pending, 60, "the third worker's actor to wait for room"
        )
        driver = placement_driver(first)
        first.popen.kill()
        first.popen.wait(10)
        with contextlib.suppress(aiohttp.ClientError):
            await resize
    driver.wait(30)
    second = placed(
        start_proxy, cluster, *grace, "--placement-wait", "5", app="tests.apps:create_app",
        workers=2, same_as=first,
    )  # fmt: skip
    log = second.log()
    assert "adopted 2 workers of the dead instance" in log, log[-3000:]
    assert "not adopting the placed worker of actor" in log, log[-3000:]
    async with jar() as http:
        for i, token in enumerate(tokens):
            assert await count(http, second.url, token) == i

    def given_up() -> bool:
        return waiting not in {a["actor_id"] for a in cluster.alive_actors()}

    await asyncio.to_thread(wait_until_sync, given_up, 30, "the pending actor to be killed")
    await asyncio.to_thread(
        wait_until_sync, lambda: "resize (adoption) done" in second.log(), 60, "the grow to end"
    )
    assert "grow stopped at 2 workers" in second.log(), second.log()[-3000:]
    second.close_process()
    wait_until_sync(lambda: not cluster.alive_actors(), 60, "every actor to end")


async def test_a_take_over_with_placed_workers_under_load_fails_no_request(start_proxy, cluster):
    """An upgrade with workers on both nodes: the same command with `--take-over` started
    beside the running gym-proxy while 8 pooled clients that never retry increment random
    sessions of 100: the old one lets go of its workers (their actors left to the
    successor), the new one finds and adopts them; no request fails, every count is
    exactly its increments, the same actors (by ID) and processes serve, and the old
    gym-proxy finishes its connections and exits 0."""
    grace = ("--orphan-grace", "60")
    first = placed(start_proxy, cluster, *grace, app="tests.apps:create_app")
    async with aiohttp.ClientSession() as seeding:  # closed: no idle keep-alive connection
        sessions = await seed_sessions(seeding, first.url, 100)
    async with jar() as http:
        await on_both_nodes(http, first.url, cluster)
        pids = sorted(w["pid"] for w in await workers_of(http, first.url))
    actors = {a["actor_id"] for a in cluster.alive_actors()}
    first.listener.close()
    load = Load(first.url, sessions, retry=False)
    await wait_until(lambda: load.served["before"] >= 200, 30, "the load to run")
    second = placed(
        start_proxy, cluster, *grace, "--take-over", app="tests.apps:create_app",
        same_as=first, inherit=False, ready=False,
    )  # fmt: skip
    await wait_until(lambda: first.popen.poll() is not None, 90, "the old proxy to exit")
    load.marked.set()
    assert first.popen.returncode == 0, first.log()[-3000:]
    await wait_until(lambda: load.served["after"] >= 200, 30, "the new one to serve the load")
    assert "adopted 2 workers the previous instance passed on" in second.log()
    await load.finish()  # an exception here is a failed request
    async with jar() as http:
        assert sorted(w["pid"] for w in await workers_of(http, second.url)) == pids
        counts, answered = await counts_and_pids(http, second.url, sessions)
    assert counts == [n + 1 for n in load.confirmed] and answered <= set(pids)
    assert {a["actor_id"] for a in cluster.alive_actors()} == actors
    second.close_process()
    assert second.popen.returncode == 0, second.log()[-3000:]
    wait_until_sync(lambda: not cluster.alive_actors(), 60, "every actor to end")


async def test_local_and_placed_workers_in_one_server_rebalance_checkpoint_and_restore(
    start_proxy, cluster, tmp_path
):
    """Issue 55, item 3: `--local-workers 1` with placement: slot 0 a process of this
    machine, the others placed on the cluster. The local worker stalls: its idle sessions
    move to the placed one (a rebalance across the mix), its busy one stays, every count
    exact. A checkpoint of the mix restores into a mix of another size (one local, two
    placed: one on each node), every count exact, and a resize removes a placed worker."""
    proxy = placed(
        start_proxy, cluster, "--local-workers", "1", "--rebalance", "--stall-threshold", "0.5",
        "--metrics", "127.0.0.1:0", app="tests.apps:create_app",
    )  # fmt: skip
    async with jar() as http:
        where = {w["slot"]: w["node"] for w in await workers_of(http, proxy.url)}
        assert where[0] == "local" and where[1] in cluster.node_ids(), where
        mine, others = await sessions_by_slot(http, proxy.url, 5)
        tokens = mine + others
        for i, token in enumerate(tokens):
            assert await increment(http, proxy.url, token, i) == 200
        heavy, *light = mine
        moved = 'gym_proxy_rebalance_sessions_moved_total{reason="stalled"}'
        async with stalling(http, proxy.url, heavy):  # the local worker's loop blocked

            async def shed() -> bool:
                return await metric(http, metrics_url(proxy), moved) == len(light)

            await wait_until(shed, 60, "the local worker's idle sessions to move to the placed one")
        assert [(await whoami(http, proxy.url, t))["slot"] for t in light] == [1] * len(light)
        assert (await whoami(http, proxy.url, heavy))["slot"] == 0
        for i, token in enumerate(tokens):
            assert await count(http, proxy.url, token) == i
        await Control(http, proxy.url).checkpoint("ck-mix", str(tmp_path))
        proxy.close_process()
        wait_until_sync(lambda: not cluster.alive_actors(), 60, "the first server's actors to end")

        second = placed(
            start_proxy, cluster, "--local-workers", "1", app="tests.apps:create_app", workers=3
        )
        nodes = {w["slot"]: w["node"] for w in await workers_of(http, second.url)}
        assert nodes[0] == "local", nodes
        assert sorted(cluster.node_ids()[nodes[s]] for s in (1, 2)) == ["head", "second"], nodes
        control = Control(http, second.url)
        await control.ok("restore", checkpoint_id="r", checkpoint_dir=str(tmp_path), episode_ids=[])
        await control.ok("resume", checkpoint_id="r")
        for i, token in enumerate(tokens):
            assert await count(http, second.url, token) == i
        status, reply = await operate(http, second.url, "resize", workers=2)
        assert status == 200 and reply["complete"], reply
        nodes = {w["slot"]: w["node"] for w in await workers_of(http, second.url)}
        assert set(nodes) == {0, 1} and nodes[0] == "local", nodes
        for i, token in enumerate(tokens):
            assert await count(http, second.url, token) == i


async def test_preload_forks_each_node_s_workers_from_one_zygote_on_that_node(start_proxy, cluster):
    """Issue 55, item 3: `--preload` with placement. Four workers, two on each node: each
    is the child of its node's zygote (`worker.zygote`, started by the node's
    `NodeZygote` actor), two zygotes in all, so the app is imported once per node;
    sessions exact. A worker killed is forked again by a zygote already there (no new
    import); a node's zygote killed takes its workers with it (replaced, their sessions
    410, the others exact). A stop leaves no worker's actor, no node zygote's actor and
    no zygote."""
    psutil = pytest.importorskip("psutil")
    proxy = placed(start_proxy, cluster, "--preload", app="tests.apps:create_app", workers=4)

    def zygotes_of(pids: list[int]) -> set[int]:
        parents = {psutil.Process(pid).ppid() for pid in pids}
        for parent in parents:
            assert "gym_proxy.worker.zygote" in psutil.Process(parent).cmdline(), parent
        return parents

    async with jar() as http:
        workers = await workers_of(http, proxy.url)
        ids = cluster.node_ids()
        assert sorted(ids[w["node"]] for w in workers) == ["head", "head", "second", "second"]
        zygotes = zygotes_of([w["pid"] for w in workers])
        assert len(zygotes) == 2, zygotes
        tokens = [await seed(http, proxy.url) for _ in range(12)]
        for i, token in enumerate(tokens):
            assert await increment(http, proxy.url, token, i) == 200
        killed = workers[0]
        slots = {t: (await whoami(http, proxy.url, t))["slot"] for t in tokens}
        os.kill(killed["pid"], signal.SIGKILL)

        async def replaced() -> bool:
            now = {w["slot"]: w["pid"] for w in await workers_of(http, proxy.url)}
            return len(now) == 4 and now.get(killed["slot"], killed["pid"]) != killed["pid"]

        await wait_until(replaced, 60, "the killed worker's replacement")
        after = await workers_of(http, proxy.url)
        assert zygotes_of([w["pid"] for w in after]) == zygotes  # forked again, no new import

        # The second node's zygote killed: what it forked cannot be waited for, so its
        # workers are killed and replaced (forked by a zygote started again where needed).
        on_second = [w for w in after if ids[w["node"]] == "second"]
        (doomed,) = zygotes_of([w["pid"] for w in on_second])
        lost = {w["slot"]: w["pid"] for w in on_second}
        os.kill(doomed, signal.SIGKILL)

        async def all_replaced() -> bool:
            now = {w["slot"]: w["pid"] for w in await workers_of(http, proxy.url)}
            return len(now) == 4 and all(now.get(s, pid) != pid for s, pid in lost.items())

        await wait_until(all_replaced, 60, "the dead zygote's workers' replacements")

        def running(pid: int) -> bool:  # a zombie waits for the reaper it was left to
            with contextlib.suppress(psutil.NoSuchProcess):
                return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
            return False

        assert not any(map(running, lost.values())), lost
        final = await workers_of(http, proxy.url)
        zygotes = zygotes_of([w["pid"] for w in final])
        assert doomed not in zygotes, (doomed, zygotes)
        gone = {killed["slot"], *lost}
        for i, token in enumerate(tokens):
            if slots[token] not in gone:
                assert await count(http, proxy.url, token) == i
            else:  # it died with its worker, said so
                assert await increment(http, proxy.url, token) == 410
        assert "exited" in proxy.log(), proxy.log()
    assert cluster.state.ask("actors NodeZygote"), "no NodeZygote actor was seen"
    proxy.close_process()
    wait_until_sync(lambda: not cluster.alive_actors(), 60, "the workers' actors to end")
    wait_until_sync(
        lambda: all(a["state"] == "DEAD" for a in cluster.state.ask("actors NodeZygote")),
        60, "the node zygotes' actors to end",
    )  # fmt: skip
    wait_until_sync(lambda: not any(map(psutil.pid_exists, zygotes)), 30, "the zygotes to exit")


# Last: it kills the second node, which the tests above need.
async def test_a_node_killed_mid_load_and_a_stop_that_leaves_no_actor(start_proxy, cluster):
    """The second node's processes killed at once while clients increment: its sessions
    answer 410 naming the lost worker, the head's are untouched, a replacement starts on
    the head; then a stop leaves no worker actor alive in the cluster."""
    proxy = placed(start_proxy, cluster, app="tests.apps:create_app")
    async with jar() as http:
        where = await on_both_nodes(http, proxy.url, cluster)
        tokens = [await seed(http, proxy.url) for _ in range(30)]
        home = {t: where[(await whoami(http, proxy.url, t))["slot"]] for t in tokens}
        sent = dict.fromkeys(tokens, 0)
        gone: dict[str, int] = {}  # the session's first 410
        cut: dict[str, int] = {}  # 502s: requests in flight when their worker died
        stop = asyncio.Event()

        async def client(token: str) -> None:
            for _ in range(2000):  # bounded: stops by itself
                if stop.is_set() or token in gone:
                    return
                status = await increment(http, proxy.url, token)
                if status == 200:
                    sent[token] += 1
                elif status == 502:
                    cut[token] = cut.get(token, 0) + 1
                else:
                    gone[token] = status

        load = [asyncio.ensure_future(client(t)) for t in tokens]
        await wait_until(lambda: sum(sent.values()) > 100, 30, "load to run")
        second = next(n for n in cluster.nodes.nodes if n.name != "head")
        await asyncio.to_thread(second.kill)
        await wait_until(
            lambda: {t for t, h in home.items() if h == "second"} <= set(gone),
            30,
            "every session of the second node to be answered 410",
        )
        stop.set()
        await asyncio.wait_for(asyncio.gather(*load), 60)  # no request hangs
        assert set(gone) == {t for t, h in home.items() if h == "second"}, (gone, home)
        assert set(gone.values()) == {410}, gone
        # A 502 only for a request on a connection that died with the node (the one in
        # flight, or a pooled one whose end the proxy had not read yet); a connection
        # refused since answers 410 at once (`WorkerGone`), not 502 until Ray tells.
        assert set(cut) <= set(gone) and max(cut.values(), default=0) <= 3, cut
        async with http.post(
            f"{proxy.url}/increment_counter", json={"count": 1},
            headers={TOKEN_HEADER: next(iter(gone))},
        ) as response:  # fmt: skip
            assert response.status == 410
            assert "worker" in (await response.json())["error"]["detail"]
        for token, h in home.items():
            if h == "head":
                assert await count(http, proxy.url, token) == sent[token]

        async def replaced() -> bool:
            workers = await workers_of(http, proxy.url)
            return len(workers) == 2 and {cluster.node_ids().get(w["node"]) for w in workers} == {
                "head"
            }

        await wait_until(replaced, 90, "a replacement worker on the head node")
        fresh = await seed(http, proxy.url)
        assert await increment(http, proxy.url, fresh, 3) == 200
        links = [link_of(w) for w in await workers_of(http, proxy.url)]
        proxy.close_process()
        assert proxy.popen.returncode == 0, proxy.log()[-3000:]
    assert await asyncio.to_thread(cluster.alive_actors) == []
    for link in links:  # closed with its worker: nothing listens there any more
        assert nothing_listens(link), link
