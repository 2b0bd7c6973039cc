"""A worker Ray placed (`--socket=fd:N`, `--coordinator=accept`), run in process: the
real `worker.process.WorkerServer` behind its gate on a loopback TCP socket (as on
another node) and on a Unix socket (as on gym-proxy's own node), its channel and its
data connections dialed as the proxy dials them (`coordinator.contract.worker_link`),
the test playing the coordinator. What the workers on a Ray cluster's nodes do with it
end to end runs in tests/test_nemo_gym_ray_placement.py."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import orjson
import pytest

from gym_proxy.coordinator.contract import messages as msg
from gym_proxy.coordinator.contract.channel import Channel
from gym_proxy.coordinator.contract.exit_codes import LOST_COORDINATOR
from gym_proxy.coordinator.contract.worker_link import (
    CHANNEL,
    DATA,
    LINK_KEY_ENV,
    LinkAddress,
    dial,
    link_key,
    stop_worker,
)
from gym_proxy.proxy.config import Config
from gym_proxy.worker.options import parse_worker_args, worker_argv
from gym_proxy.worker.process import ACCEPT, INHERITED, WorkerServer
from tests.support import wait_until

KEY = link_key(b"secret", "apps")
WAIT = 10.0


class _Coordinator:
    """The coordinator's end of a placed worker's channel: takes its registration."""

    def __init__(self) -> None:
        self.registered: asyncio.Future[msg.Register] = asyncio.Future()

    async def handle(self, message: msg.Message) -> msg.Message | None:
        if isinstance(message, msg.Register):
            self.registered.set_result(message)
            return msg.RegisterReply(msg.Tables({}, {}))
        return None


@dataclass
class Placed:
    worker: WorkerServer
    task: asyncio.Task[int]
    address: LinkAddress
    channel: Channel
    registered: msg.Register

    async def exit_code(self) -> int:
        return await asyncio.wait_for(self.task, WAIT)


def _bound(family: str, directory: Path) -> tuple[socket.socket, LinkAddress]:
    """The socket a worker's host binds and passes down, and where the proxy dials it."""
    if family == "tcp":
        sock = socket.create_server(("127.0.0.1", 0))
        return sock, LinkAddress("127.0.0.1", sock.getsockname()[1])
    path = str(directory / "placed-1.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    sock.listen()
    return sock, LinkAddress(path=path)


@pytest.fixture(params=["tcp", "unix"])
async def placed(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, short_tmp: Path
) -> AsyncIterator[Placed]:
    """A placed worker with a secret's orphan grace, registered over its gate."""
    async for started in _placed(request.param, monkeypatch, short_tmp, grace=30.0):
        yield started


async def _placed(
    family: str, monkeypatch: pytest.MonkeyPatch, directory: Path, grace: float
) -> AsyncIterator[Placed]:
    sock, address = _bound(family, directory)
    monkeypatch.setenv(LINK_KEY_ENV, KEY.hex())
    config = Config(app="tests.apps:create_app", orphan_grace=grace)
    incarnation = {"slot": 0, "owner": "placed", "instance": "apps", "workers": 1}
    socket_option = f"{INHERITED}{sock.detach()}"
    argv = worker_argv(config, socket=socket_option, coordinator=ACCEPT, **incarnation)
    worker = WorkerServer(parse_worker_args(argv), asyncio.Event())
    task = asyncio.ensure_future(worker.run())
    coordinator = _Coordinator()
    reader, writer = await dial(address, KEY, CHANNEL, greet_within=WAIT)
    channel = Channel(reader, writer, coordinator.handle)
    serving = asyncio.ensure_future(channel.serve())
    try:
        registered = await asyncio.wait_for(coordinator.registered, WAIT)
        yield Placed(worker, task, address, channel, registered)
    finally:
        worker.stop.set()
        channel.close()
        await asyncio.gather(task, serving, return_exceptions=True)


async def _get(address: LinkAddress, path: str) -> bytes:
    """One request on a data connection through the gate; the whole answer."""
    reader, writer = await dial(address, KEY, DATA)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: w\r\nConnection: close\r\n\r\n".encode())
    try:
        return await asyncio.wait_for(reader.read(), WAIT)
    finally:
        writer.close()


async def test_a_placed_worker_registers_through_its_gate_and_serves_its_app(placed):
    assert placed.registered.socket == placed.address.url
    assert (placed.registered.owner, placed.registered.rejoining) == ("placed", False)
    head, _, body = (await _get(placed.address, "/whoami")).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and orjson.loads(body)["owner"] == "placed"


async def test_a_stop_over_the_link_drains_and_exits_cleanly(placed):
    await stop_worker(placed.address, KEY)
    assert await placed.exit_code() == 0
    await wait_until(lambda: placed.channel.closed, WAIT, "the worker's channel to end")


async def test_a_placed_worker_that_loses_its_coordinator_waits_to_be_adopted(placed):
    """Its gym-proxy gone (the channel ends), it keeps its sessions for its orphan grace
    and rejoins over the next channel dialed in through its gate, as a local worker
    rejoins over the coordinator socket: registered as rejoining (the sessions it keeps
    are tests/test_nemo_gym_ray_placement.py's, through gym-proxy)."""
    placed.channel.close()
    await asyncio.sleep(0)  # the worker reads the channel's end
    assert not placed.task.done()
    coordinator = _Coordinator()
    reader, writer = await dial(placed.address, KEY, CHANNEL, greet_within=WAIT)
    channel = Channel(reader, writer, coordinator.handle)
    serving = asyncio.ensure_future(channel.serve())
    try:
        again = await asyncio.wait_for(coordinator.registered, WAIT)
        assert (again.owner, again.rejoining) == ("placed", True)
        assert not placed.task.done()
    finally:
        channel.close()
        await asyncio.gather(serving, return_exceptions=True)


async def test_a_placed_worker_without_an_orphan_grace_stops_at_once(short_tmp, monkeypatch):
    """Orphan grace 0 (started by NeMo Gym's launcher, or without a secret): nobody's to
    adopt it, it stops at once, LOST_COORDINATOR."""
    async for placed in _placed("tcp", monkeypatch, short_tmp, grace=0.0):
        placed.channel.close()
        assert await placed.exit_code() == LOST_COORDINATOR


async def test_a_proxy_that_stops_for_good_leaves_its_worker_stopping_cleanly(placed):
    await placed.channel.request(msg.ProxyStopping(), within=WAIT)
    placed.channel.close()
    assert await placed.exit_code() == 0
