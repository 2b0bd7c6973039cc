"""A remote worker's port: every connection proves the link key before it reaches the app
or the coordinator channel (`coordinator.contract.worker_link` has the handshake).

The gate listens on the socket the worker's host bound on its node and passed down (an
inherited descriptor): TCP, or a Unix socket in gym-proxy's runtime directory on
gym-proxy's own node, where every connection comes from one peer address (""). A
connection that proves the key is handed on as it is, without a copy or a second hop: a
DATA one to a fresh HTTP protocol of the worker's server (aiohttp's or uvicorn's, the
same that serve a local worker's Unix socket), a CHANNEL one to the worker as a stream
pair; a STOP one stops the worker (`on_stop`, as SIGTERM does) and is closed. One that
does not is aborted, having received the challenge only.

Connections proving themselves are bounded, each for HANDSHAKE_TIMEOUT seconds at most,
and held in two lanes of MAX_PENDING each. Anyone may open a connection, so a stranger
can always fill a bound; what it must not do is push out gym-proxy's own links, which
answer within a round trip but may still be waiting for it when a flood arrives. So an
address that has proved the key (gym-proxy's) has a lane of its own, which no
connection from another address ever takes a place from; everyone else shares the
other, where a new connection at the bound drops the oldest one of the address holding
the most (a flood from one address drops its own, not a worker's first link, its
channel, before any address has proved the key). The source address of a TCP
connection cannot be forged without being on its path; a stranger on gym-proxy's own
machine shares its lane, and its dials are then dialed again when dropped.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Callable
from typing import cast

from gym_proxy.coordinator.contract.framing import STREAM_LIMIT
from gym_proxy.coordinator.contract.worker_link import (
    ANSWER_SIZE,
    CHANNEL,
    HANDSHAKE_TIMEOUT,
    STOP,
    challenge,
    check_answer,
    proof,
)
from gym_proxy.worker.identity import WORKER_BACKLOG

__all__ = ["LinkGate", "MAX_PENDING", "address_of"]

log = logging.getLogger("gym_proxy.worker")

MAX_PENDING = 64
LOG_EVERY = 10.0  # seconds between log lines about refused connections

StreamPair = tuple[asyncio.StreamReader, asyncio.StreamWriter]


def address_of(sock: socket.socket) -> str:
    """A gate's socket as a URL: `unix://path` or `tcp://host:port`."""
    if sock.family == socket.AF_UNIX:
        return f"unix://{sock.getsockname()}"
    host, port = sock.getsockname()[:2]
    return f"tcp://{host}:{port}"


class LinkGate:
    """The worker's TCP port: `http` makes the protocol of an authenticated data
    connection; `channels` receives the authenticated channel connections; `on_stop` is
    called for an authenticated stop."""

    def __init__(
        self,
        sock: socket.socket,
        key: bytes,
        http: Callable[[], asyncio.Protocol],
        on_stop: Callable[[], None],
    ) -> None:
        self.sock = sock
        self.key = key
        self.http = http
        self.on_stop = on_stop
        self.channels: asyncio.Queue[StreamPair] = asyncio.Queue()
        self.proven: set[str] = set()  # addresses that proved the key: gym-proxy's
        self.ours = _Lane()  # connections from those addresses
        self.strangers = _Lane()  # from any other
        self.refused = 0
        self._server: asyncio.AbstractServer | None = None
        self._quiet_until = 0.0

    @property
    def address(self) -> str:
        return address_of(self.sock)

    @property
    def pending(self) -> int:
        """Connections proving themselves now."""
        return self.ours.count + self.strangers.count

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        if self.sock.family == socket.AF_UNIX:  # on gym-proxy's node (`worker_host`)
            self._server = await loop.create_unix_server(
                lambda: _Handshake(self), sock=self.sock, backlog=WORKER_BACKLOG
            )
        else:
            self._server = await loop.create_server(
                lambda: _Handshake(self), sock=self.sock, backlog=WORKER_BACKLOG
            )

    async def next_channel(self, within: float, unless: asyncio.Event | None = None) -> StreamPair:
        """The next authenticated channel connection (TimeoutError after `within` s, or
        as soon as `unless` is set: a worker told to stop waits for no channel)."""
        if unless is None:
            return await asyncio.wait_for(self.channels.get(), within)
        taken = asyncio.ensure_future(self.channels.get())
        told = asyncio.ensure_future(unless.wait())
        try:
            await asyncio.wait({taken, told}, timeout=within, return_when=asyncio.FIRST_COMPLETED)
        finally:
            told.cancel()
            if not taken.done():
                taken.cancel()
        if not taken.done() or taken.cancelled():
            raise TimeoutError("no channel came")
        return taken.result()

    def close(self) -> None:
        """Accept nothing more; connections handed on are their owners' to close."""
        if self._server is not None:
            self._server.close()
        for handshake in [*self.ours.all(), *self.strangers.all()]:
            handshake.refuse("the worker is stopping")

    def _admit(self, handshake: _Handshake) -> None:
        handshake.lane = self.ours if handshake.peer in self.proven else self.strangers
        handshake.lane.add(handshake)

    def _refused(self, peer: object, why: str) -> None:
        self.refused += 1
        now = time.monotonic()
        if now >= self._quiet_until:
            self._quiet_until = now + LOG_EVERY
            log.warning("worker port: refused a connection from %s: %s", peer, why)

    def _channel(self, transport: asyncio.Transport, rest: bytes) -> None:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=STREAM_LIMIT, loop=loop)
        protocol = asyncio.StreamReaderProtocol(reader, loop=loop)
        transport.set_protocol(protocol)
        protocol.connection_made(transport)
        if rest:
            protocol.data_received(rest)
        self.channels.put_nowait((reader, asyncio.StreamWriter(transport, protocol, reader, loop)))

    def _data(self, transport: asyncio.Transport, rest: bytes) -> None:
        protocol = self.http()
        transport.set_protocol(protocol)
        protocol.connection_made(transport)
        if rest:
            protocol.data_received(rest)


class _Lane:
    """Handshakes in progress by peer address, each address's oldest first; a new one at
    MAX_PENDING drops the oldest of the address holding the most."""

    def __init__(self) -> None:
        self.by_peer: dict[str, dict[_Handshake, None]] = {}
        self.count = 0

    def add(self, handshake: _Handshake) -> None:
        if self.count >= MAX_PENDING:
            heaviest = max(self.by_peer.values(), key=len)
            next(iter(heaviest)).refuse(
                "dropped for a newer connection: too many proving themselves"
            )
        self.by_peer.setdefault(handshake.peer, {})[handshake] = None
        self.count += 1

    def remove(self, handshake: _Handshake) -> None:
        held = self.by_peer.get(handshake.peer)
        if held is None or handshake not in held:
            return
        del held[handshake]
        self.count -= 1
        if not held:
            del self.by_peer[handshake.peer]

    def all(self) -> list[_Handshake]:
        return [h for held in self.by_peer.values() for h in held]


class _Handshake(asyncio.Protocol):
    """One connection until it proves the key (or fails to)."""

    def __init__(self, gate: LinkGate) -> None:
        self.gate = gate
        self.transport: asyncio.Transport | None = None
        self.peer = ""
        self.lane: _Lane | None = None
        self.buffer = b""
        self.nonce = b""
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport: uvloop's are not asyncio.Transport subclasses.
        self.transport = cast(asyncio.Transport, transport)
        peername = transport.get_extra_info("peername")
        self.peer = str(peername[0]) if peername else ""
        self.gate._admit(self)
        self.nonce, greeting = challenge()
        self.transport.write(greeting)
        loop = asyncio.get_running_loop()
        self.timer = loop.call_later(HANDSHAKE_TIMEOUT, self.refuse, "no answer in time")

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if len(self.buffer) < ANSWER_SIZE:
            return
        answer_bytes, rest = self.buffer[:ANSWER_SIZE], self.buffer[ANSWER_SIZE:]
        gate = self.gate
        kind = check_answer(gate.key, self.nonce, answer_bytes)
        if kind is None:
            self.refuse("a wrong answer to the challenge")
            return
        transport = self._done()
        if transport is None:
            return
        gate.proven.add(self.peer)
        transport.write(proof(gate.key, self.nonce, answer_bytes))
        if kind == CHANNEL:
            gate._channel(transport, rest)
        elif kind == STOP:
            transport.close()
            gate.on_stop()
        else:
            gate._data(transport, rest)

    def eof_received(self) -> bool:
        self.refuse("it closed before answering")
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._done()

    def refuse(self, why: str) -> None:
        transport = self._done()
        if transport is not None:
            self.gate._refused(transport.get_extra_info("peername"), why)
            transport.abort()

    def _done(self) -> asyncio.Transport | None:
        """Leave the lane once; the transport, the first time only."""
        if self.lane is not None:
            self.lane.remove(self)
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        transport, self.transport = self.transport, None
        return transport
