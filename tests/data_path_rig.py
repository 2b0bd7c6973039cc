"""The proxy's data path driven in process: real `ClientConnection`, `Exchange` and
`UpstreamConnection` objects, with recording transports in place of sockets.

A test writes client bytes with `Client.send`, plays the worker with `Upstream.send`,
and reads what each side was sent. Nothing here reimplements the proxy: the rig only
stands where the kernel would.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import httptools

from gym_proxy.proxy.data_path.client_connection import ClientConnection, ProxyState
from gym_proxy.proxy.data_path.routing import Router, WorkerRoute
from gym_proxy.proxy.data_path.session_tokens import TokenCodec
from gym_proxy.proxy.data_path.upstream import UpstreamConnection, UpstreamPool

__all__ = ["Rig", "RecordingTransport", "parse_responses", "parse_requests", "UPGRADE", "SWITCH"]

SECRET = b"rig-secret-0123456789abcdef"
# A WebSocket upgrade request, and the worker's switch.
UPGRADE = (
    b"GET /ws HTTP/1.1\r\nHost: t\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
    b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
)
SWITCH = (
    b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
    b"Sec-WebSocket-Accept: s3pPLMBiTxaQ9kYGzzhZRbK+xOo=\r\n\r\n"
)


class RecordingTransport(asyncio.Transport):
    """Records writes; closing tells the protocol the way asyncio would (next tick)."""

    def __init__(self, protocol: asyncio.BaseProtocol) -> None:
        super().__init__()
        self.protocol = protocol
        self.data = bytearray()
        self.writes = 0
        self.eof = False
        self.closing = False
        self.aborted = False
        self.reading = True
        self.lost = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self.closing or self.eof:
            raise AssertionError("write after close or write_eof")
        self.data += data
        self.writes += 1

    def write_eof(self) -> None:
        self.eof = True

    def can_write_eof(self) -> bool:
        return True

    def close(self) -> None:
        self._lose(aborted=False)

    def abort(self) -> None:
        self._lose(aborted=True)

    def _lose(self, aborted: bool) -> None:
        if self.closing:
            return
        self.closing = True
        self.aborted = aborted
        asyncio.get_running_loop().call_soon(self._connection_lost)

    def _connection_lost(self) -> None:
        if not self.lost:
            self.lost = True
            self.protocol.connection_lost(None)

    def is_closing(self) -> bool:
        return self.closing

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def is_reading(self) -> bool:
        return self.reading

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default

    def get_write_buffer_size(self) -> int:
        return 0  # every write is recorded (copied) at once

    def take(self) -> bytes:
        """What was written since the last take."""
        data = bytes(self.data)
        self.data.clear()
        return data


class Client:
    """One client connection into the proxy."""

    def __init__(self, state: ProxyState) -> None:
        self.protocol = ClientConnection(state)
        self.transport = RecordingTransport(self.protocol)
        self.protocol.connection_made(self.transport)

    def send(self, data: bytes) -> None:
        """`data` arrives: read into the protocol's buffer as a transport does, as many
        reads as its buffer needs."""
        while data:
            buffer = self.protocol.get_buffer(len(data))
            size = min(len(buffer), len(data))
            buffer[:size] = data[:size]
            self.protocol.buffer_updated(size)
            data = data[size:]

    def hang_up(self) -> None:
        """The client's connection dropped (reset or closed)."""
        self.transport.closing = True
        self.transport._connection_lost()

    def responses(self, head_requests: int = 0) -> list[tuple[int, dict[bytes, bytes], bytes]]:
        return parse_responses(bytes(self.transport.data), head_requests)


class Upstream:
    """One connection from the proxy to a worker, played by the test."""

    def __init__(self, protocol: UpstreamConnection) -> None:
        self.protocol = protocol
        self.transport = RecordingTransport(protocol)
        protocol.connection_made(self.transport)

    def send(self, data: bytes) -> None:
        self.protocol.data_received(data)

    def hang_up(self, exc: Exception | None = None) -> None:
        self.transport.closing = True
        if not self.transport.lost:
            self.transport.lost = True
            self.protocol.connection_lost(exc)

    def requests(self) -> list[tuple[bytes, bytes, dict[bytes, bytes], bytes]]:
        return parse_requests(bytes(self.transport.data))


class Rig:
    """A proxy state with `workers` routable workers whose connections the test plays."""

    def __init__(self, workers: int = 1, **state: Any) -> None:
        self.router = Router()
        self.upstreams: list[Upstream] = []
        self.connect_failure: Callable[[], Exception] | None = None
        self.connect_gate: asyncio.Event | None = None
        for slot in range(workers):
            owner = f"owner{slot}"
            path = f"/rig/{owner}.sock"
            self.router.add_worker(
                WorkerRoute(owner, slot, path, pool=UpstreamPool(path, connect=self._connect))
            )
        control = WorkerRoute(
            "control", -1, "/rig/control.sock", pool=UpstreamPool("ctl", connect=self._connect)
        )
        self.codec = TokenCodec(SECRET)
        self.state = ProxyState(
            router=self.router,
            codec=self.codec,
            control=control,
            upstream_timeout=state.pop("upstream_timeout", 60.0),
            keepalive_timeout=state.pop("keepalive_timeout", 75.0),
            **state,
        )

    def worker(self, slot: int = 0) -> WorkerRoute:
        return self.router._live[slot]

    def client(self) -> Client:
        return Client(self.state)

    async def _connect(
        self, factory: Callable[[], UpstreamConnection], path: str
    ) -> UpstreamConnection:
        if self.connect_gate is not None:
            await self.connect_gate.wait()
        if self.connect_failure is not None:
            raise self.connect_failure()
        upstream = Upstream(factory())
        self.upstreams.append(upstream)
        return upstream.protocol

    async def settle(self) -> None:
        """Let connect tasks and scheduled callbacks run (a few loop turns, no timers)."""
        for _ in range(5):
            await asyncio.sleep(0)

    async def upstream(self, index: int = -1) -> Upstream:
        await self.settle()
        return self.upstreams[index]


class _Parsed:
    def __init__(self, request: bool, head_requests: int = 0) -> None:
        self.parser: Any = (
            httptools.HttpRequestParser(self) if request else httptools.HttpResponseParser(self)
        )
        self.done: list[Any] = []
        self.heads_left = head_requests
        self._headers: dict[bytes, bytes] = {}
        self._body = b""
        self._url = b""

    def on_message_begin(self) -> None:
        self._headers, self._body, self._url = {}, b"", b""

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        self._headers[name] = (
            value if name not in self._headers else self._headers[name] + b", " + value
        )

    def on_headers_complete(self) -> None:
        if self.heads_left and isinstance(self.parser, httptools.HttpResponseParser):
            if self.parser.get_status_code() >= 200:
                # A HEAD response: its head is the whole message.
                self.heads_left -= 1
                self.on_message_complete()
                self.parser = httptools.HttpResponseParser(self)
                raise _HeadDone

    def on_body(self, body: bytes) -> None:
        self._body += body

    def on_message_complete(self) -> None:
        if isinstance(self.parser, httptools.HttpRequestParser):
            self.done.append((self.parser.get_method(), self._url, self._headers, self._body))
        else:
            self.done.append((self.parser.get_status_code(), self._headers, self._body))


class _HeadDone(Exception):
    pass


# The status of the entry that ends parse_responses' list after a 101: the bytes after it.
TUNNEL_BYTES = 0


def parse_responses(
    data: bytes, head_requests: int = 0
) -> list[tuple[int, dict[bytes, bytes], bytes]]:
    """Every complete response in `data` (the first `head_requests` answer HEADs), then,
    after an upgrade, (TUNNEL_BYTES, {}, what follows it)."""
    parsed = _Parsed(request=False, head_requests=head_requests)
    while data:
        try:
            parsed.parser.feed_data(data)
            break
        except httptools.HttpParserCallbackError as exc:
            if not isinstance(exc.__context__, _HeadDone):
                raise
            end = data.find(b"\r\n\r\n")
            data = data[end + 4 :]
        except httptools.HttpParserUpgrade as exc:
            parsed.done.append((TUNNEL_BYTES, {}, data[exc.args[0] :]))
            break
    return parsed.done


def parse_requests(data: bytes) -> list[tuple[bytes, bytes, dict[bytes, bytes], bytes]]:
    """Every complete request in `data` (what a worker would have parsed)."""
    parsed = _Parsed(request=True)
    try:
        parsed.parser.feed_data(data)
    except httptools.HttpParserUpgrade as exc:
        parsed.done.append((b"UPGRADED", data[exc.args[0] :], {}, b""))
    return parsed.done
