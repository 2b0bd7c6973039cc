"""The link to a worker Ray placed: one port per worker, which only gym-proxy can use.

A worker Ray places on a node (`--worker-placement ray`) is not gym-proxy's child, so it
listens on one port of its own, for its data connections and for its coordinator
channel, and the proxy dials both (the proxy opens no port of its own towards the
cluster). On another node the port is TCP, on the node's address; on gym-proxy's own
node it is a Unix socket inside gym-proxy's runtime directory (a `LinkAddress` is
either), which costs the proxy no loopback TCP stack per request. Every connection to
that port opens with a challenge-response handshake keyed by the *link key*, which only
gym-proxy and its workers hold; nothing reaches the app or the channel before it
succeeds::

    worker -> proxy   MAGIC (4) | worker nonce (16)
    proxy  -> worker  kind (1) | proxy nonce (16) | HMAC(key, "proxy" kind nw np) (32)
    worker -> proxy   HMAC(key, "worker" kind nw np) (32)

`kind` is DATA (HTTP follows, as on a local worker's socket), CHANNEL (the framed
coordinator channel follows, `coordinator.contract.framing`) or STOP (nothing follows:
the worker stops as on SIGTERM, which the proxy cannot send to a process of another
node). The worker's nonce is fresh for every connection, so an answer seen on the network
cannot be replayed; the worker's own proof tells the proxy it reached the worker it
started, not whatever took its port. A connection whose answer is wrong, short or late
(HANDSHAKE_TIMEOUT) is closed having received the 20-byte challenge only.

A dial fails in one of three ways, which mean different things: ConnectionRefusedError
from the kernel (nothing listens at the port: the worker is gone, its gate listening
from its start to its end; a Unix socket whose file is gone is refused alike),
LinkRefused (what listens there is not the worker: it did not open with a
challenge, or did not prove the key) and LinkUnproven (something listens but did not
prove itself in time, or dropped the link first: a worker whose loop is busy, or whose
gate dropped the half-open link for others; dial again, and leave the verdict on the
worker to its pings and its channel).

The link key is derived from gym-proxy's secret (`link_key`), never the secret itself: a
worker's node learns what opens its workers' ports, not what signs session tokens. What
it does not do is hide the traffic: like Ray's own connections without Ray's TLS, bytes
after the handshake travel in the clear on the cluster's network (docs/ray.md says when
that is enough and what to do when it is not).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar, cast

__all__ = [
    "LINK_KEY_ENV",
    "LinkAddress",
    "MAGIC",
    "DATA",
    "CHANNEL",
    "STOP",
    "CHALLENGE_SIZE",
    "ANSWER_SIZE",
    "PROOF_SIZE",
    "HANDSHAKE_TIMEOUT",
    "LinkError",
    "LinkRefused",
    "LinkUnproven",
    "link_key",
    "challenge",
    "answer",
    "check_answer",
    "proof",
    "connect",
    "dial",
    "stop_worker",
]

LINK_KEY_ENV = "GYM_PROXY_LINK_KEY"  # the key, hex, in a remote worker's environment
MAGIC = b"GPL1"
DATA = b"D"
CHANNEL = b"C"
STOP = b"S"
KINDS = (DATA, CHANNEL, STOP)
NONCE_SIZE = 16
MAC_SIZE = 32
CHALLENGE_SIZE = len(MAGIC) + NONCE_SIZE
ANSWER_SIZE = 1 + NONCE_SIZE + MAC_SIZE
PROOF_SIZE = MAC_SIZE
HANDSHAKE_TIMEOUT = 5.0  # seconds a connection may take to prove itself, either way


@dataclass(frozen=True, slots=True)
class LinkAddress:
    """Where a placed worker's gate listens: a Unix socket's `path` (on gym-proxy's
    node), else TCP `host`:`port`."""

    host: str = ""
    port: int = 0
    path: str = ""

    @property
    def url(self) -> str:
        return f"unix://{self.path}" if self.path else f"tcp://{self.host}:{self.port}"

    async def open(
        self, factory: Callable[[], asyncio.BaseProtocol]
    ) -> tuple[asyncio.BaseTransport, asyncio.BaseProtocol]:
        """A connection to it, with a protocol `factory` makes. A Unix socket whose file
        is gone is refused as a closed port is (nothing listens: ConnectionRefusedError)."""
        loop = asyncio.get_running_loop()
        if not self.path:
            return await loop.create_connection(factory, self.host, self.port)
        try:
            return await loop.create_unix_connection(factory, self.path)
        except FileNotFoundError as exc:
            raise ConnectionRefusedError(f"{self.path} is gone") from exc


class LinkError(ConnectionError):
    """A worker link that did not open (never ConnectionRefusedError: that one says
    nothing listens at the port, which neither of these does)."""


class LinkRefused(LinkError):
    """What answers at a worker's port is not the worker: it did not open with a
    gym-proxy challenge, or did not prove the link key."""


class LinkUnproven(LinkError):
    """Something listens at a worker's port but did not prove itself in time, or dropped
    the link before it did: try again; whether the worker is gone is not this to say."""


def link_key(secret: bytes, instance: str) -> bytes:
    """The link key of one gym-proxy instance's workers, from its secret."""
    return hmac.new(secret, b"gym-proxy worker link|" + instance.encode(), hashlib.sha256).digest()


def challenge() -> tuple[bytes, bytes]:
    """A fresh worker nonce and the challenge that carries it."""
    nonce = os.urandom(NONCE_SIZE)
    return nonce, MAGIC + nonce


def _mac(key: bytes, side: bytes, kind: bytes, worker_nonce: bytes, proxy_nonce: bytes) -> bytes:
    return hmac.new(key, side + kind + worker_nonce + proxy_nonce, hashlib.sha256).digest()


def answer(key: bytes, kind: bytes, challenge_bytes: bytes) -> tuple[bytes, bytes]:
    """The proxy's answer to a worker's challenge, and the proof the worker must send
    back. LinkRefused when the challenge is not one."""
    if len(challenge_bytes) != CHALLENGE_SIZE or not challenge_bytes.startswith(MAGIC):
        raise LinkRefused("the worker's port did not open with a gym-proxy worker challenge")
    worker_nonce = challenge_bytes[len(MAGIC) :]
    proxy_nonce = os.urandom(NONCE_SIZE)
    mac = _mac(key, b"proxy", kind, worker_nonce, proxy_nonce)
    expected = _mac(key, b"worker", kind, worker_nonce, proxy_nonce)
    return kind + proxy_nonce + mac, expected


def check_answer(key: bytes, worker_nonce: bytes, answer_bytes: bytes) -> bytes | None:
    """The kind a correct answer asks for; None for any other answer."""
    if len(answer_bytes) != ANSWER_SIZE:
        return None
    kind, proxy_nonce, mac = answer_bytes[:1], answer_bytes[1:-MAC_SIZE], answer_bytes[-MAC_SIZE:]
    if kind not in KINDS:
        return None
    if not hmac.compare_digest(mac, _mac(key, b"proxy", kind, worker_nonce, proxy_nonce)):
        return None
    return kind


def proof(key: bytes, worker_nonce: bytes, answer_bytes: bytes) -> bytes:
    """The worker's proof for an answer `check_answer` accepted."""
    kind, proxy_nonce = answer_bytes[:1], answer_bytes[1:-MAC_SIZE]
    return _mac(key, b"worker", kind, worker_nonce, proxy_nonce)


P = TypeVar("P", bound=asyncio.BaseProtocol)


class _Dialing(asyncio.Protocol):
    """The proxy's end of the handshake; `done` gets what came after the proof."""

    def __init__(self, key: bytes, kind: bytes, where: str, done: asyncio.Future[bytes]) -> None:
        self.key, self.kind, self.where, self.done = key, kind, where, done
        self.transport: asyncio.Transport | None = None
        self.buffer = b""
        self.expected = b""
        self.greeted = asyncio.Event()  # the worker's challenge came: it is serving
        self.lost: tuple[Exception | None] | None = None  # ended, with the error if any

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's: no subclass

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if not self.expected and len(self.buffer) >= CHALLENGE_SIZE:
            try:
                reply, self.expected = answer(self.key, self.kind, self.buffer[:CHALLENGE_SIZE])
            except LinkRefused as exc:
                self._fail(str(exc))
                return
            assert self.transport is not None
            self.transport.write(reply)
            self.buffer = self.buffer[CHALLENGE_SIZE:]
            self.greeted.set()
        if self.expected and len(self.buffer) >= PROOF_SIZE:
            if not hmac.compare_digest(self.buffer[:PROOF_SIZE], self.expected):
                self._fail(f"the worker at {self.where} did not prove the link key")
            elif not self.done.done():
                self.done.set_result(self.buffer[PROOF_SIZE:])

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = (exc,)
        if not self.done.done():
            why = f"the worker at {self.where} closed the link before proving itself"
            self.done.set_exception(LinkUnproven(why))

    def _fail(self, why: str) -> None:
        if self.transport is not None:
            self.transport.abort()
        if not self.done.done():
            self.done.set_exception(LinkRefused(why))


async def connect(
    address: LinkAddress,
    key: bytes,
    kind: bytes,
    factory: Callable[[], P],
    greet_within: float | None = None,
) -> tuple[asyncio.Transport, P]:
    """Connect to a worker's port (`address`) and run the handshake, then hand the connection, as it
    is, to a protocol `factory` makes. The challenge may take `greet_within` seconds (a
    worker still building its app accepts only then: its port was bound for it), the rest
    HANDSHAKE_TIMEOUT (also the default for the challenge). ConnectionRefusedError when
    nothing listens, LinkRefused when what listens is not the worker, LinkUnproven when it
    does not prove itself in time or drops the link first (module docstring)."""
    if greet_within is None:
        greet_within = HANDSHAKE_TIMEOUT
    where = address.url
    done: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
    opened, dialed = await address.open(lambda: _Dialing(key, kind, where, done))
    transport, dialing = cast(asyncio.Transport, opened), cast(_Dialing, dialed)
    greeted = asyncio.ensure_future(dialing.greeted.wait())
    try:
        either: set[asyncio.Future[Any]] = {greeted, done}
        finished, _ = await asyncio.wait(
            either, timeout=greet_within, return_when=asyncio.FIRST_COMPLETED
        )
        if not finished:
            raise LinkUnproven(f"the worker at {where} did not open the link in {greet_within:g} s")
        async with asyncio.timeout(HANDSHAKE_TIMEOUT):
            rest = await done
    except TimeoutError:
        transport.abort()
        why = f"the worker at {where} did not finish the handshake in {HANDSHAKE_TIMEOUT:g} s"
        raise LinkUnproven(why) from None
    except BaseException:
        transport.abort()
        raise
    finally:
        greeted.cancel()
    protocol = factory()
    transport.set_protocol(protocol)
    protocol.connection_made(transport)
    if rest:
        cast(asyncio.Protocol, protocol).data_received(rest)
    if dialing.lost is not None:  # it ended with the proof: its end is the new protocol's
        protocol.connection_lost(dialing.lost[0])
    return transport, protocol


async def stop_worker(address: LinkAddress, key: bytes) -> None:
    """Ask the worker at `address` to stop, as SIGTERM does (STOP); returns once it
    proved the key, having heard it. The errors of `connect`."""
    transport, _ = await connect(address, key, STOP, asyncio.Protocol)
    transport.close()


async def dial(
    address: LinkAddress,
    key: bytes,
    kind: bytes,
    limit: int = 1 << 16,
    greet_within: float | None = None,
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """`connect`, as a pair of streams (the coordinator channel's)."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=limit, loop=loop)
    transport, protocol = await connect(
        address,
        key,
        kind,
        lambda: asyncio.StreamReaderProtocol(reader, loop=loop),
        greet_within,
    )
    return reader, asyncio.StreamWriter(transport, protocol, reader, loop)
