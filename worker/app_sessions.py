"""The app's own session ID, read from Starlette's session cookie (pure; no I/O).

NeMo Gym servers keep `{"session_id": <uuid4>}` in Starlette's SessionMiddleware cookie:
`base64(json).<timestamp>.<signature>` (itsdangerous' TimestampSigner), re-sent on every
response. The front door cannot rely on seeing `scope["session"]`: NeMo Gym's own
RolloutContextMiddleware passes a copy of the scope down. So it reads the cookie the
response sets (or, if none, the one the request carried). The signature is the app's to
check; the worker only needs to know which session the app is talking about.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Iterable

import orjson

__all__ = ["SESSION_KEY", "session_in_cookie_value", "session_in_headers"]

SESSION_KEY = "session_id"  # NeMo Gym's SESSION_ID_KEY


def session_in_cookie_value(value: bytes) -> str | None:
    """The `session_id` in one Starlette session cookie value, or None."""
    data, dot, rest = value.partition(b".")
    if not dot or rest.count(b".") != 1 or len(data) > 8192:
        return None
    try:
        payload = orjson.loads(base64.b64decode(data, validate=True))
    except (binascii.Error, ValueError):
        return None
    session_id = payload.get(SESSION_KEY) if isinstance(payload, dict) else None
    return session_id if isinstance(session_id, str) and session_id else None


def _cookie_values(header: bytes, set_cookie: bool) -> Iterable[bytes]:
    if set_cookie:  # "name=value; Path=/; ..."
        yield header.split(b";", 1)[0].partition(b"=")[2].strip().strip(b'"')
        return
    for pair in header.split(b";"):  # "a=1; b=2"
        yield pair.partition(b"=")[2].strip().strip(b'"')


def session_in_headers(headers: Iterable[tuple[bytes, bytes]], set_cookie: bool) -> str | None:
    """The app session named by a Starlette cookie among `Set-Cookie` (response) or
    `Cookie` (request) headers."""
    wanted = b"set-cookie" if set_cookie else b"cookie"
    for name, value in headers:
        if name.lower() == wanted:
            for cookie in _cookie_values(value, set_cookie):
                session_id = session_in_cookie_value(cookie)
                if session_id is not None:
                    return session_id
    return None
