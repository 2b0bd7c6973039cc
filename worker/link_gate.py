"""A remote worker's port: every connection proves the link key before it reaches the app
or the coordinator channel (`coordinator.contract.worker_link` has the handshake).

The gate listens on the socket the worker's host bound on its node and passed down (an
inherited descriptor). A connection that proves the key is handed on as it is, without a
copy or a second hop: a DATA one to a fresh HTTP protocol of the worker's server (aiohttp's
or uvicorn's, the same that serve a local worker's Unix socket), a CHANNEL one to the
worker as a stream pair. One that does not is aborted, having received the challenge
only. At most MAX_PENDING connections may be proving themselves at once (the oldest is
dropped for a new one), each for HANDSHAKE_TIMEOUT seconds at most.
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
    challenge,
    check_answer,
    proof,
)
from gym_proxy.worker.identity import WORKER_BACKLOG

__all__ = ["LinkGate", "MAX_PENDING"]

log = logging.getLogger("gym_proxy.worker")

MAX_PENDING = 64
LOG_EVERY = 10.0  # seconds between log lines about refused connections

StreamPair = tuple[asyncio.StreamReader, asyncio.StreamWriter]


class LinkGate:
    """The worker's TCP port: `http` makes the protocol of an authenticated data
    connection; `channels` receives the authenticated channel connections."""

    def __init__(self, sock: socket.socket, key: bytes, http: Callable[[], asyncio.Protocol]):
        self.sock = sock
        self.key = key
        self.http = http
        self.channels: asyncio.Queue[StreamPair] = asyncio.Queue()
        self.pending: dict[_Handshake, None] = {}  # oldest first
        self.refused = 0
        self._server: asyncio.AbstractServer | None = None
        self._quiet_until = 0.0

    @property
    def address(self) -> str:
        host, port = self.sock.getsockname()[:2]
        return f"tcp://{host}:{port}"

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _Handshake(self), sock=self.sock, backlog=WORKER_BACKLOG
        )

    async def next_channel(self, within: float) -> StreamPair:
        """The next authenticated channel connection (TimeoutError after `within` s)."""
        return await asyncio.wait_for(self.channels.get(), within)

    def close(self) -> None:
        """Accept nothing more; connections handed on are their owners' to close."""
        if self._server is not None:
            self._server.close()
        for handshake in list(self.pending):
            handshake.refuse("the worker is stopping")

    def _admit(self, handshake: _Handshake) -> None:
        if len(self.pending) >= MAX_PENDING:
            next(iter(self.pending)).refuse("too many connections proving themselves")
        self.pending[handshake] = None

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


class _Handshake(asyncio.Protocol):
    """One connection until it proves the key (or fails to)."""

    def __init__(self, gate: LinkGate) -> None:
        self.gate = gate
        self.transport: asyncio.Transport | None = None
        self.buffer = b""
        self.nonce = b""
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport: uvloop's are not asyncio.Transport subclasses.
        self.transport = cast(asyncio.Transport, transport)
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
        kind = check_answer(self.gate.key, self.nonce, answer_bytes)
        if kind is None:
            self.refuse("a wrong answer to the challenge")
            return
        transport = self._done()
        if transport is None:
            return
        transport.write(proof(self.gate.key, self.nonce, answer_bytes))
        if kind == CHANNEL:
            self.gate._channel(transport, rest)
        else:
            self.gate._data(transport, rest)

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
        """Leave the pending set once; the transport, the first time only."""
        self.gate.pending.pop(self, None)
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        transport, self.transport = self.transport, None
        return transport
