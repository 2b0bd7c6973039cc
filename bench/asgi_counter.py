"""The counter server as a bare ASGI app, for the uvicorn shared-port baseline.

Under `uvicorn --workers N` every worker accepts from one shared port, so a session's
requests land on arbitrary workers: this app keeps each worker's counters apart and is
only a throughput baseline, not a correct stateful server (which is the point of
gym-proxy). The session is named by `x-ng-session-id`, as gym-proxy would pass it.
"""

from __future__ import annotations

from typing import Any

import orjson

_COUNTERS: dict[bytes, int] = {}
_HEADERS = [(b"content-type", b"application/json")]


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    body = b""
    more = True
    while more:
        message = await receive()
        body += message.get("body", b"")
        more = message.get("more_body", False)
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
