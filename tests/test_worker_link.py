"""The link to a worker on another node (`coordinator.contract.worker_link`) and the
worker's gate (`worker.link_gate`): the handshake's logic, then a real gate on a loopback
TCP socket, dialed as the proxy dials it; strangers' half-open connections (from other
loopback addresses) that never push gym-proxy's out; a stop asked over the link; a
placed worker's port that refuses (gone) and one that does not greet in time (dialed
again, not gone). What the workers on a Ray cluster's nodes do with it runs in
tests/test_nemo_gym_ray_placement.py."""

from __future__ import annotations

import asyncio
import socket
from typing import Any, cast

import pytest

from gym_proxy.coordinator.contract import worker_link
from gym_proxy.coordinator.contract.errors import WorkerGone
from gym_proxy.coordinator.contract.worker_link import (
    ANSWER_SIZE,
    CHALLENGE_SIZE,
    CHANNEL,
    DATA,
    MAGIC,
    PROOF_SIZE,
    LinkAddress,
    LinkRefused,
    LinkUnproven,
    answer,
    challenge,
    check_answer,
    dial,
    link_key,
    proof,
    stop_worker,
)
from gym_proxy.proxy.ray_cluster import remote_workers
from gym_proxy.proxy.ray_cluster.lines import PlacementSpec, WorkerStarted
from gym_proxy.proxy.ray_cluster.remote_workers import RayLauncher, RemoteWorker
from gym_proxy.worker import link_gate
from gym_proxy.worker.link_gate import LinkGate
from tests.support import wait_until

pytestmark = pytest.mark.fast

KEY = link_key(b"secret", "apps")
SPEC = PlacementSpec(1, 1.0, {}, "SPREAD", "apps", "")


def _at(port: int) -> LinkAddress:
    return LinkAddress("127.0.0.1", port)


def placed(port: int) -> WorkerStarted:
    """What the placement driver says of a worker started at `port` on this machine."""
    return WorkerStarted(1, "a", 1, "127.0.0.1", port, "", "", "")


def test_the_key_is_the_instances_and_never_the_secret():
    assert link_key(b"secret", "apps") == KEY
    assert link_key(b"secret", "other") != KEY
    assert link_key(b"other secret", "apps") != KEY
    assert b"secret" not in KEY and len(KEY) == 32


def test_an_answer_proves_the_key_for_one_challenge_only():
    nonce, greeting = challenge()
    assert greeting == MAGIC + nonce and len(greeting) == CHALLENGE_SIZE
    reply, expected = answer(KEY, DATA, greeting)
    assert len(reply) == ANSWER_SIZE
    assert check_answer(KEY, nonce, reply) == DATA
    assert proof(KEY, nonce, reply) == expected
    # Another key, another challenge (a replay), a changed kind or a cut answer: refused.
    assert check_answer(link_key(b"other", "apps"), nonce, reply) is None
    assert check_answer(KEY, challenge()[0], reply) is None
    assert check_answer(KEY, nonce, CHANNEL + reply[1:]) is None
    assert check_answer(KEY, nonce, reply[:-1]) is None
    assert check_answer(KEY, nonce, b"X" + reply[1:]) is None
    with pytest.raises(LinkRefused):
        answer(KEY, DATA, b"HTTP/1.1 200 OK\r\n\r\n")


class _Echo(asyncio.Protocol):
    """Stands for the worker's HTTP protocol: echoes what it gets, upper-cased."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.transport.write(data.upper())


async def _gate(key: bytes = KEY, on_stop: Any = None) -> LinkGate:
    sock = socket.create_server(("127.0.0.1", 0))
    gate = LinkGate(sock, key, _Echo, on_stop or (lambda: None))
    await gate.start()
    return gate


def _port(gate: LinkGate) -> int:
    return int(gate.address.rsplit(":", 1)[1])


async def test_a_data_connection_reaches_the_app_once_the_key_is_proved():
    gate = await _gate()
    try:
        reader, writer = await dial(_at(_port(gate)), KEY, DATA)
        writer.write(b"hello")
        assert await reader.readexactly(5) == b"HELLO"
        writer.close()
    finally:
        gate.close()


async def test_a_channel_connection_goes_to_the_worker_not_the_app():
    gate = await _gate()
    try:
        _, writer = await dial(_at(_port(gate)), KEY, CHANNEL)
        writer.write(b"frame")
        reader, worker_end = await gate.next_channel(5)
        assert await reader.readexactly(5) == b"frame"  # as sent, not echoed by the app
        worker_end.close()
        writer.close()
    finally:
        gate.close()


@pytest.mark.parametrize(
    "sent",
    [b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + bytes(40), b"D" + bytes(48), b""],
    ids=["http", "wrong-answer", "silence"],
)
async def test_without_the_key_a_connection_gets_the_challenge_only(sent, monkeypatch):
    monkeypatch.setattr(link_gate, "HANDSHAKE_TIMEOUT", 0.2)  # silence: refused soon
    gate = await _gate()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", _port(gate))
        assert (await reader.readexactly(CHALLENGE_SIZE)).startswith(MAGIC)
        writer.write(sent)
        assert await asyncio.wait_for(reader.read(), 5) == b""  # closed; the app saw nothing
        writer.close()
        assert gate.refused == 1 and not gate.pending
    finally:
        gate.close()


async def test_a_worker_with_another_key_is_not_believed():
    """Its gate cannot check the proxy's answer and drops the link: it never proves itself
    (`LinkUnproven`, dialed again while the worker's own channel says it is there)."""
    gate = await _gate(link_key(b"another secret", "apps"))
    try:
        with pytest.raises(LinkUnproven, match="closed the link before proving itself"):
            await dial(_at(_port(gate)), KEY, DATA)
    finally:
        gate.close()


async def test_connections_proving_themselves_are_bounded(monkeypatch):
    monkeypatch.setattr(link_gate, "MAX_PENDING", 3)
    gate = await _gate()
    try:
        opened = [await asyncio.open_connection("127.0.0.1", _port(gate)) for _ in range(5)]
        for reader, _ in opened:
            await reader.readexactly(CHALLENGE_SIZE)
        assert gate.pending == 3  # the two oldest were dropped for the newer ones
        for reader, _ in opened[:2]:
            assert await asyncio.wait_for(reader.read(), 5) == b""
        reader, writer = await dial(_at(_port(gate)), KEY, DATA)  # still served
        writer.write(b"ok")
        assert await reader.readexactly(2) == b"OK"
        for _, w in [*opened, (reader, writer)]:
            w.close()
    finally:
        gate.close()


Link = tuple[asyncio.StreamReader, asyncio.StreamWriter, bytes]


async def _half_open(port: int, source: str) -> Link:
    """A connection from `source` that got its challenge (returned) and answers nothing yet."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
    greeting = await reader.readexactly(CHALLENGE_SIZE)
    assert greeting.startswith(MAGIC)
    return reader, writer, greeting


async def _proves(link: Link) -> bool:
    """Answer the challenge now: whether the gate still held it and sent its proof."""
    reader, writer, greeting = link
    reply, expected = answer(KEY, DATA, greeting)
    writer.write(reply)
    try:
        return await asyncio.wait_for(reader.readexactly(PROOF_SIZE), 5) == expected
    except asyncio.IncompleteReadError:
        return False  # dropped before its answer


async def _dropped(link: Link) -> bool:
    return await asyncio.wait_for(link[0].read(), 5) == b""


async def test_a_flood_from_one_address_does_not_push_out_anothers_handshake(monkeypatch):
    """Before anyone proved the key (a worker's first link, its channel): at the bound, a
    new connection drops the oldest handshake of the address holding the most, so a
    flood from one address drops its own and the proxy's handshake waits for its answer."""
    monkeypatch.setattr(link_gate, "MAX_PENDING", 3)
    gate = await _gate()
    port = _port(gate)
    links: list[Link] = []
    try:
        links.append(ours := await _half_open(port, "127.0.0.1"))
        links += (strangers := [await _half_open(port, "127.0.0.2") for _ in range(6)])
        assert await _proves(ours)  # never dropped
        assert [await _dropped(link) for link in strangers[:4]] == [True] * 4  # the oldest
        assert gate.pending == 2  # the newest two, still proving themselves
    finally:
        for _, writer, _ in links:
            writer.close()
        gate.close()


async def test_strangers_half_open_connections_never_push_out_the_proxys(monkeypatch):
    """An address that proved the key (gym-proxy's) has a lane of its own: strangers from
    any number of addresses drop only each other, never one of its handshakes still
    waiting for its answer, however many of them it holds."""
    monkeypatch.setattr(link_gate, "MAX_PENDING", 3)
    gate = await _gate()
    port = _port(gate)
    links: list[Link] = []
    try:
        _, proven = await dial(_at(port), KEY, DATA)  # 127.0.0.1 proves the key
        proven.close()
        links += (ours := [await _half_open(port, "127.0.0.1") for _ in range(2)])
        links += (strangers := [await _half_open(port, f"127.0.0.{2 + i}") for i in range(8)])
        assert [await _proves(link) for link in ours] == [True, True]
        assert [await _dropped(link) for link in strangers[:5]] == [True] * 5
    finally:
        for _, writer, _ in links:
            writer.close()
        gate.close()


async def test_a_stop_asked_over_the_link_stops_the_worker():
    """The proxy's SIGTERM for a worker it cannot signal (`STOP`): proved like any link,
    then the worker's stop is called and the link closed; a wrong key stops nothing."""
    stops: list[str] = []
    gate = await _gate(on_stop=lambda: stops.append("stop"))
    try:
        with pytest.raises(LinkUnproven):  # dropped: it cannot check this answer
            await stop_worker(_at(_port(gate)), link_key(b"other", "apps"))
        assert stops == []
        await stop_worker(_at(_port(gate)), KEY)  # returns once it is heard
        assert stops == ["stop"] and gate.pending == 0
    finally:
        gate.close()


async def test_a_worker_still_building_its_app_is_waited_for_as_long_as_asked():
    """The port listens from the start (its host bound it); the worker accepts only once
    its app is built: a dial waits for the challenge `greet_within`, then gives up."""
    sock = socket.create_server(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    gate = LinkGate(sock, KEY, _Echo, lambda: None)
    with pytest.raises(LinkUnproven, match="did not open the link in 0.1 s"):
        await dial(_at(port), KEY, CHANNEL, greet_within=0.1)
    dialing = asyncio.ensure_future(dial(_at(port), KEY, CHANNEL, greet_within=10))
    await asyncio.sleep(0)  # the dial is in the backlog before the worker serves
    try:
        await gate.start()
        _, writer = await asyncio.wait_for(dialing, 10)
        _, worker_end = await gate.next_channel(5)
        worker_end.close()
        writer.close()
    finally:
        gate.close()


async def test_a_placed_worker_whose_port_refuses_is_taken_as_gone():
    """A refused data connection means nothing listens at the worker's port (its gate
    listens from start to end): its channel is cut, which takes it out of the routes as
    any lost channel does, instead of waiting for Ray to report its actor dead; the
    request that found it is told its worker is gone (`WorkerGone`: a 410, not a 502)."""
    launcher = RayLauncher(SPEC, KEY)
    closed = socket.create_server(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    worker = RemoteWorker(launcher, placed(port))
    proxy_end, worker_end = socket.socketpair()
    _, worker.channel = await asyncio.open_connection(sock=proxy_end)
    reader, writer = await asyncio.open_connection(sock=worker_end)
    try:
        with pytest.raises(WorkerGone):
            await worker.connect(cast(Any, _Echo), worker.address)  # never built: refused
        assert await asyncio.wait_for(reader.read(), 5) == b""  # the channel's end
    finally:
        writer.close()
        worker.channel.close()


async def test_a_placed_worker_that_does_not_greet_in_time_is_dialed_again_not_cut(monkeypatch):
    """A worker whose loop is blocked (a CPU-bound handler) takes no connection for a
    while, as one whose gate is not serving yet: a data dial that is not answered in the
    handshake's time is dialed again, its channel is left alone (its pings and its
    channel say whether it is gone, as for a local worker), and once the worker serves,
    the connection is made."""
    monkeypatch.setattr(worker_link, "HANDSHAKE_TIMEOUT", 0.2)
    dials = []

    async def counted(*args: Any, **kwargs: Any) -> Any:
        dials.append(args[:2])
        return await worker_link.connect(*args, **kwargs)

    monkeypatch.setattr(remote_workers, "connect", counted)
    launcher = RayLauncher(SPEC, KEY)
    sock = socket.create_server(("127.0.0.1", 0))  # listening; nothing accepts yet
    port = sock.getsockname()[1]
    gate = LinkGate(sock, KEY, _Echo, lambda: None)
    worker = RemoteWorker(launcher, placed(port))
    proxy_end, worker_end = socket.socketpair()
    _, worker.channel = await asyncio.open_connection(sock=proxy_end)
    reader, writer = await asyncio.open_connection(sock=worker_end)
    connecting = asyncio.ensure_future(worker.connect(cast(Any, _Echo), worker.address))
    try:
        await wait_until(lambda: len(dials) >= 2 or connecting.done(), 10, "a second dial")
        assert not connecting.done(), connecting  # not given up, not taken as gone
        await gate.start()
        conn = cast(_Echo, await asyncio.wait_for(connecting, 10))
        conn.transport.close()
        assert not reader.at_eof()  # its channel was never cut
    finally:
        connecting.cancel()
        gate.close()
        writer.close()
        worker.channel.close()


# ---- on gym-proxy's own node: the same gate on a Unix socket ------------------------------
async def _unix_gate(directory: Any, on_stop: Any = None) -> tuple[LinkGate, LinkAddress]:
    path = str(directory / "placed-1.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    sock.listen()
    gate = LinkGate(sock, KEY, _Echo, on_stop or (lambda: None))
    await gate.start()
    return gate, LinkAddress(path=path)


async def test_on_gym_proxys_node_the_link_is_a_unix_socket_with_the_same_handshake(short_tmp):
    """Data, channel and stop over the Unix socket, each proving the key first; a wrong
    key gets the challenge only, as on TCP."""
    stopped = asyncio.Event()
    gate, address = await _unix_gate(short_tmp, stopped.set)
    try:
        assert gate.address == address.url == f"unix://{short_tmp}/placed-1.sock"
        reader, writer = await dial(address, KEY, DATA)
        writer.write(b"hello")
        assert await reader.readexactly(5) == b"HELLO"
        writer.close()
        _, channel = await dial(address, KEY, CHANNEL)
        channel.write(b"frame")
        channel_reader, worker_end = await gate.next_channel(5)
        assert await channel_reader.readexactly(5) == b"frame"
        worker_end.close()
        channel.close()
        with pytest.raises(LinkUnproven):  # dropped: it cannot check this answer
            await stop_worker(address, link_key(b"other", "apps"))
        assert not stopped.is_set()
        await stop_worker(address, KEY)
        await asyncio.wait_for(stopped.wait(), 5)
    finally:
        gate.close()


async def test_a_placed_worker_whose_unix_socket_is_gone_is_taken_as_gone(short_tmp):
    """Its socket's file removed (its host unlinks it when the worker exits): refused as
    a closed port is, so the worker is taken as gone (a 410), not dialed for ever."""
    launcher = RayLauncher(SPEC, KEY)
    path = str(short_tmp / "placed-gone.sock")
    worker = RemoteWorker(launcher, WorkerStarted(1, "a", 1, "127.0.0.1", 0, path, "", ""))
    assert worker.address == f"unix://{path}"
    proxy_end, worker_end = socket.socketpair()
    _, worker.channel = await asyncio.open_connection(sock=proxy_end)
    reader, writer = await asyncio.open_connection(sock=worker_end)
    try:
        with pytest.raises(WorkerGone):
            await worker.connect(cast(Any, _Echo), worker.address)
        assert await asyncio.wait_for(reader.read(), 5) == b""  # the channel's end
    finally:
        writer.close()
        worker.channel.close()


def test_a_host_listens_on_a_unix_socket_only_in_a_private_directory(short_tmp):
    """gym-proxy's runtime directory (0700, this user's): a Unix socket in it. A directory
    others may enter, a missing one or a path too long for a Unix socket: TCP."""
    from gym_proxy.proxy.ray_cluster.worker_port import bind_port, private_directory

    private = short_tmp / "rt"
    private.mkdir(mode=0o700)
    shared = short_tmp / "shared"
    shared.mkdir(mode=0o755)
    deep = private / ("d" * 120)
    deep.mkdir(mode=0o700)
    assert private_directory(str(private)) and not private_directory(str(shared))
    sock, path = bind_port("127.0.0.1", str(private))
    assert sock.family == socket.AF_UNIX
    assert path.startswith(f"{private}/placed-") and path.endswith(".sock")
    sock.close()
    for refused in (shared, short_tmp / "missing", deep):
        sock, path = bind_port("127.0.0.1", str(refused))
        assert sock.family == socket.AF_INET and path == "", refused
        sock.close()
