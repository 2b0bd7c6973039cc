"""A worker's request-head limits, derived from the proxy's, so that what the proxy lets
through a worker parses.

The proxy answers a request target over `--limit-request-line` with 414 and a header
block over `--limit-request-headers` with 431 (JSON, `proxy.data_path.client_connection`); below
those, it forwards. Left at their defaults, a worker's parsers are stricter: aiohttp's
server answers a header line over 8,190 bytes (`max_field_size`), a target over 8,190
(`max_line_size`) or a 129th header (`max_headers`) with a plain-text 400, and
`websockets`, which parses an ASGI app's WebSocket upgrade again after uvicorn, refuses a
line over 8,192 bytes or a 129th header. uvicorn's httptools parser has no such limits.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

__all__ = ["HeadLimits", "head_limits"]

SMALLEST_HEADER = 4  # "a:\r\n": a header block of N bytes holds at most N / 4 headers
PROXY_HEADERS = 16  # the proxy's own (Host, framing, session identity): room to spare
RESERIALIZED = 64  # uvicorn writes the upgrade's head again ("name: value", the version)


@dataclass(frozen=True)
class HeadLimits:
    """The largest request head a worker must take: its target, one header line (name
    and value), and how many headers."""

    target: int
    field: int
    headers: int

    def aiohttp(self) -> dict[str, Any]:
        """aiohttp's server options (`AppRunner(**limits.aiohttp())`)."""
        return {
            "max_line_size": self.target,
            "max_field_size": self.field,
            "max_headers": self.headers,
        }

    def raise_websockets_limits(self) -> None:
        """Raise `websockets`' handshake limits to these. They are read when it is first
        imported (by uvicorn, once the worker starts its server; by an app, maybe
        earlier), so this runs before the app is built; a larger setting stays."""
        wanted = {
            "WEBSOCKETS_MAX_LINE_LENGTH": max(self.target, self.field) + RESERIALIZED,
            "WEBSOCKETS_MAX_NUM_HEADERS": self.headers,
        }
        for name, value in wanted.items():
            current = os.environ.get(name, "")
            if not current.isdigit() or int(current) < value:
                os.environ[name] = str(value)


def head_limits(limit_request_line: int, limit_request_headers: int) -> HeadLimits:
    """The worker's limits for a proxy run with these `--limit-request-*` flags."""
    return HeadLimits(
        target=limit_request_line,
        field=limit_request_headers,
        headers=limit_request_headers // SMALLEST_HEADER + PROXY_HEADERS,
    )
