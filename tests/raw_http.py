"""Raw HTTP/1.1 over sockets, for tests that must control every byte a client sends."""

from __future__ import annotations

import asyncio

import httptools

__all__ = ["Responses", "open_raw", "read_responses", "post", "close"]


class Responses:
    """Parses responses from a raw connection (httptools, like any client would)."""

    def __init__(self, head_requests: int = 0) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.done: list[tuple[int, dict[bytes, bytes], bytes]] = []
        self._headers: dict[bytes, bytes] = {}
        self._body = b""

    def on_message_begin(self):
        self._headers, self._body = {}, b""

    def on_header(self, name, value):
        self._headers[name.lower()] = value

    def on_body(self, body):
        self._body += body

    def on_message_complete(self):
        self.done.append((self.parser.get_status_code(), self._headers, self._body))


async def open_raw(proxy):
    return await asyncio.open_connection("127.0.0.1", proxy.port)


async def read_responses(reader, count, within=10.0):
    parsed = Responses()
    async with asyncio.timeout(within):
        while len(parsed.done) < count:
            data = await reader.read(65536)
            if not data:
                break
            parsed.parser.feed_data(data)
    return parsed.done


def post(path: str, body: bytes, extra: str = "") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Length: {len(body)}\r\n{extra}\r\n".encode()
        + body
    )


async def close(writer) -> None:
    """Close a raw connection and wait until it is closed (a transport left closing when
    the test's loop ends is reported as unclosed)."""
    writer.close()
    try:
        await writer.wait_closed()
    except (ConnectionError, OSError):
        pass
