"""The counter server as a bare ASGI app, for the uvicorn shared-port baseline.

Under `uvicorn --workers N` every worker accepts from one shared port, so a session's
requests land on arbitrary workers: this app keeps each worker's counters apart and is
only a throughput baseline, not a correct stateful server (which is the point of
gym-proxy). The session is named by `x-ng-session-id`, as gym-proxy would pass it.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson

_COUNTERS: dict[bytes, int] = {}
_HEADERS = [(b"content-type", b"application/json")]


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    if scope["path"] == "/sse":
        await _sse(scope, send)
        return
    if scope["path"] == "/wait":  # bench/per_call.py: an app that takes `ms` to answer
        await asyncio.sleep(int(scope["query_string"].partition(b"=")[2] or 0) / 1000)
    body = await read_body(receive)
    session = dict(scope["headers"]).get(b"x-ng-session-id", b"")
    count = orjson.loads(body).get("count", 1) if body else 1
    _COUNTERS[session] = _COUNTERS.get(session, 0) + count
    payload = orjson.dumps({"count": _COUNTERS[session]})
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [*_HEADERS, (b"content-length", b"%d" % len(payload))],
        }
    )
    await send({"type": "http.response.body", "body": payload})


async def _sse(scope: dict[str, Any], send: Any) -> None:
    """`GET /sse?events=N&size=B`: N server-sent events of B bytes each, as fast as the
    connection takes them (for the streaming throughput bench)."""
    query = dict(p.split("=", 1) for p in scope["query_string"].decode().split("&") if "=" in p)
    events, size = int(query.get("events", 1000)), int(query.get("size", 1024))
    event = b"data: " + b"x" * max(0, size - 8) + b"\n\n"
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"text/event-stream")],
        }
    )
    for _ in range(events):
        await send({"type": "http.response.body", "body": event, "more_body": True})
    await send({"type": "http.response.body", "body": b""})


async def read_body(receive: Any) -> bytes:
    """The whole request body of an ASGI HTTP request."""
    body = b""
    more = True
    while more:
        message = await receive()
        body += message.get("body", b"")
        more = message.get("more_body", False)
    return body
